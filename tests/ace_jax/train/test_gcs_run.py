"""A run whose workdir is gs:// (a real GCS emulator, its own process): launched, killed with
SIGKILL, launched again, it resumes and finishes with every artefact in the bucket and none in a
local folder named ``gs:``; ``launch/evaluate.py --policy=run:gs://...`` evaluates it.

What the emulator does not support, and the test therefore avoids (named here): Orbax's OCDBT
checkpoint layout. OCDBT updates its manifest with conditional writes (if-generation-match on the
generation read back), and gcp-storage-emulator sends no ``x-goog-generation`` header with an
object's data, so tensorstore reads generation 0 and refuses the write ("Malformed
StorageGeneration"): reproduced with tensorstore alone (a ``gcs`` kvstore on the emulator: a
plain write and a write-if-absent succeed, a write conditional on the generation just read
fails). Real GCS returns the header. So this run saves its checkpoints with
``checkpoint.use_ocdbt=False`` (a zarr folder per array: no conditional writes); the pod keeps
the default (OCDBT)."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
STEPS = 6


def _env(emulator, home) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(emulator.env(), JAX_PLATFORMS="cpu", HOME=str(home))
    return env


def _lines(fs, path) -> list[dict]:
    try:
        return [json.loads(x) for x in fs.cat(path).decode().splitlines() if x.strip()]
    except FileNotFoundError:
        return []


@pytest.mark.slow
def test_a_gs_run_is_killed_resumes_finishes_and_evaluates(gcs_emulator, tmp_path):
    pytest.importorskip("gcp_storage_emulator")
    url = "gs://" + gcs_emulator.prefix() + "/run"
    fs = gcs_emulator.fs()
    env = _env(gcs_emulator, tmp_path / "home")
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cmd = [sys.executable, str(REPO / "launch/tpu_train.py"),
           f"--config={REPO}/configs/local.py:smoke", f"--config.workdir={url}",
           f"--config.rl.num_steps={STEPS}", f"--config.tasks.cache_dir={tmp_path}/tasks",
           "--config.probe.heldout_tasks=()", "--no_progress",
           "--config.checkpoint.use_ocdbt=False"]    # the emulator: see the module docstring
    metrics = url[len("gs://"):] + "/metrics.jsonl"
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "first.log", "w"), start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if f"step 1/{STEPS}" in (tmp_path / "first.log").read_text():
            break
        time.sleep(0.1)
    assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)                     # killed mid-run
    proc.wait()
    assert "Traceback" not in (tmp_path / "first.log").read_text()
    assert sum("reward/mean" in r for r in _lines(fs, metrics)) < STEPS

    out = subprocess.run(cmd + ["--verbosity=0"], cwd=cwd, env=env, capture_output=True,
                         text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "resumed at iteration" in out.stderr, out.stderr[-3000:]
    steps = [r["step"] for r in _lines(fs, metrics) if "reward/mean" in r]
    assert steps == list(range(STEPS)), steps
    top = {p.rsplit("/", 1)[-1] for p in fs.ls(url[len("gs://"):])}
    assert {"checkpoints", "buffer", "metrics.jsonl", "config.json", "rollouts",
            "tokenizer"} <= top, top
    assert len(fs.ls(url[len("gs://"):] + "/rollouts")) == STEPS

    ev = subprocess.run([sys.executable, str(REPO / "launch/evaluate.py"), f"--policy=run:{url}",
                         f"--out={url}/eval", "--tasks=iris-species", "--seeds=0",
                         "--max_steps=1", "--backend=process", f"--cache_dir={tmp_path}/tasks",
                         "--no_progress"], cwd=cwd, env=env, capture_output=True, text=True,
                        timeout=600)
    assert ev.returncode == 0, ev.stderr[-4000:]
    got = {p[len(url) - len("gs://"):] for p in fs.find(url[len("gs://"):] + "/eval")}
    assert {"/eval/results.json", "/eval/report.md", "/eval/seed_solutions.jsonl",
            "/eval/episodes/iris-species__seed0.jsonl"} <= got, got
    assert f"json: {url}/eval/results.json" in ev.stdout
    # nothing of the run or its evaluation landed on local disk under a folder named gs:
    assert os.listdir(cwd) == []
