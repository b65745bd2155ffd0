"""The sandbox runs what MLE-bench's agents write: the Kaggle stack in the sandbox's own venv.

The venv is ``.sandbox-venv`` at the repository's root, made by ``bash
scripts/build_sandbox_env.sh .sandbox-venv`` (requirements-sandbox.txt; CI builds it in the pod
rehearsal, scripts/pod_rehearsal.sh). Without it the tests that need it are skipped, saying so.

  * a script that imports lightgbm, xgboost, catboost and torch, fits a tiny model with each and
    writes a submission (``sandbox/backends/stack_check.py``) runs under bwrap with
    ``sandbox.python`` set to the venv, cold and forked from a warm interpreter, and is graded;
  * that sandbox binds the venv and not the trainer's;
  * the build script is idempotent and refuses what it cannot build.
"""
from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from sandbox.backends import stack_check
from sandbox.result import Status
from tests.sandbox.conftest import bwrap_skip_reason

REPO = pathlib.Path(__file__).resolve().parents[2]
SANDBOX_VENV = REPO / ".sandbox-venv"
SANDBOX_PYTHON = SANDBOX_VENV / "bin" / "python"
BUILD = REPO / "scripts" / "build_sandbox_env.sh"


def _skip_without_venv_or_bwrap() -> None:
    if not SANDBOX_PYTHON.exists():
        pytest.skip(f"the sandbox venv is not built ({SANDBOX_PYTHON}): build it with `bash "
                    "scripts/build_sandbox_env.sh .sandbox-venv` (CI builds it in the pod "
                    "rehearsal, scripts/pod_rehearsal.sh)")
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)


def _pins() -> dict[str, str]:
    """{distribution name (lower case): pinned version} of requirements-sandbox.txt."""
    pins = {}
    for line in (REPO / "requirements-sandbox.txt").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line)
        if m:
            pins[m.group(1).lower()] = m.group(2)
    return pins


@pytest.mark.parametrize("preload", ["", "auto"], ids=["cold", "warm"])
def test_the_kaggle_stack_runs_under_bwrap_with_the_sandbox_python(preload, tmp_path):
    _skip_without_venv_or_bwrap()
    result = stack_check.run_in_sandbox("bwrap", str(SANDBOX_PYTHON), preload=preload,
                                        backend_options={"root_dir": str(tmp_path / "runs")})
    assert result.status is Status.OK, (result.status, result.error, result.stderr[-3000:])
    line = [l for l in result.stdout.splitlines() if l.startswith(stack_check.MARKER)]
    report = json.loads(line[-1][len(stack_check.MARKER):])
    pins = _pins()
    for module, dist in (("numpy", "numpy"), ("pandas", "pandas"), ("sklearn", "scikit-learn"),
                         ("lightgbm", "lightgbm"), ("catboost", "catboost"), ("torch", "torch")):
        assert report[module] == pins[dist], (module, report[module], pins[dist])
    xgboost_pin = pins.get("xgboost-cpu") or pins["xgboost"]
    assert report["xgboost"] == xgboost_pin
    assert all(report[f"{m}_acc"] >= 0.8 for m in ("sklearn", "lightgbm", "xgboost", "catboost",
                                                   "torch")), report
    assert report["submission"] is True and result.valid_submission
    assert result.dev_score is not None and result.dev_score < 5.0  # y = 2x, fitted on train


def test_the_sandbox_binds_its_venv_and_not_the_trainers(fake_task, tmp_path):
    _skip_without_venv_or_bwrap()
    from sandbox.pool import SandboxPool

    trainer_prefix = sys.prefix
    probe = ("import json, os, sys\nprint(json.dumps({'prefix': sys.prefix, 'trainer_venv': "
             f"os.path.exists({trainer_prefix!r})}}))\n")
    with SandboxPool("bwrap", num_workers=1, root_dir=tmp_path / "runs",
                     python=str(SANDBOX_PYTHON)) as pool:
        r = pool.run(fake_task, probe)
    out = json.loads(r.stdout)
    assert out == {"prefix": str(SANDBOX_VENV), "trainer_venv": False}, (out, r.stderr)


# ---------------------------------------------------------------------------------------------
# scripts/build_sandbox_env.sh


def _build(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", os.fspath(BUILD), *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHON": sys.executable})


def test_a_second_build_returns_at_once():
    if not (SANDBOX_VENV / ".ace-sandbox-stamp").exists():
        pytest.skip(f"the sandbox venv is not built ({SANDBOX_VENV}): build it with `bash "
                    "scripts/build_sandbox_env.sh .sandbox-venv` (CI builds it in the pod "
                    "rehearsal, scripts/pod_rehearsal.sh)")
    start = time.monotonic()
    r = _build(os.fspath(SANDBOX_VENV))
    assert r.returncode == 0 and "is up to date" in r.stderr, r.stderr
    assert time.monotonic() - start < 5.0


def test_the_build_refuses_what_it_cannot_build(tmp_path):
    r = _build(os.fspath(tmp_path / "env"), "--python", "/nonexistent/python3")
    assert r.returncode == 1 and "no interpreter '/nonexistent/python3'" in r.stderr, r.stderr
    not_a_venv = tmp_path / "data"
    not_a_venv.mkdir()
    (not_a_venv / "precious.txt").write_text("keep me")
    r = _build(os.fspath(not_a_venv), "--torch-index", "none")
    assert r.returncode == 1 and "is not a venv; refusing to clear it" in r.stderr, r.stderr
    assert (not_a_venv / "precious.txt").read_text() == "keep me"
    r = _build(os.fspath(tmp_path / "env"), "--wheelhouse", os.fspath(tmp_path / "missing"))
    assert r.returncode == 1 and "is not a folder" in r.stderr, r.stderr
    r = _build()
    assert r.returncode == 1 and "DEST is required" in r.stderr, r.stderr
