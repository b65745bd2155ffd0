"""Every entry point refuses what it does not know before any work: tpu_train.py checks
``--config.*`` keys against the config (config_utils.check_overrides), the others take plain
absl flags, which absl refuses by name."""
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _run(script, *args):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(REPO / "launch" / script), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", ["evaluate.py", "serve.py", "export_hf.py"])
def test_unknown_flags_are_refused_by_name(script):
    out = _run(script, "--config.sampling.temperature=0.5")
    assert out.returncode != 0
    assert "Unknown command line flag 'config.sampling.temperature'" in out.stderr, out.stderr


def test_tpu_train_refuses_a_key_outside_the_schema():
    out = _run("tpu_train.py", "--config=configs/ace30b.py", "--config.dry_run.chips=8")
    assert out.returncode == 2
    assert "--config.dry_run.chips: no such config key. Did you mean dry_run.chip" in out.stderr
    assert "Valid keys under dry_run:" in out.stderr


@pytest.mark.parametrize("script", ["evaluate.py", "serve.py"])
def test_the_pod_flags_are_listed_in_help(script):
    """evaluate.py and serve.py share their pod flags (mirror.define_pod_flags); --help, which
    lists the main module's flags, lists them too."""
    out = _run(script, "--help")      # absl prints the help and exits 1
    for name in ("distributed", "coordinator_address", "num_processes", "process_id",
                 "compile_cache_dir"):
        assert f"  --{name}:" in out.stdout, (name, out.stdout[-2000:])
