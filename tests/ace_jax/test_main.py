"""``python -m ace_jax`` (``ace_jax/__main__.py``): the entry point answers --help from outside
the checkout, maps a config's ``mode`` to its environment and refuses an unknown one before any
work; the trainer refuses an environment of another mode. (A whole run through it: test_ideator_trainer's launch
test; through launch/tpu_train.py, its thin wrapper: tests/launch/test_tpu_train.py.)"""
import os
import pathlib
import subprocess
import sys

import pytest

from ace_jax import __main__ as ace_main, config_utils
from ace_jax.train import environment
from ace_jax.train.setup import SetupError

REPO = pathlib.Path(__file__).resolve().parents[2]


def _run(*args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "ace_jax", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_help_works_outside_the_checkout(tmp_path):
    out = _run("--help", cwd=tmp_path)
    assert out.returncode == 1 and not out.stderr, out.stderr    # absl's --help exits with 1
    assert out.stdout.startswith("Train an agent: the library's entry point")
    for flag in ("--config:", "--[no]dry_run", "--[no]print_config", "--[no]no_progress"):
        assert flag in out.stdout


def test_an_unknown_mode_is_refused_with_the_valid_ones(tmp_path):
    out = _run(f"--config={REPO}/configs/local.py", f"--config.workdir={tmp_path}/run",
               "--config.mode=poet", cwd=tmp_path)
    assert out.returncode == 2
    assert "unknown mode 'poet'; valid names: acegrpo, ideator" in out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("config", ["local.py", "ideator.py"])
def test_each_mode_gets_the_environment_of_that_mode(config):
    cfg = config_utils.load_config_file(str(REPO / "configs" / config))
    assert ace_main.ENVIRONMENTS.get(cfg.mode)(cfg).mode == cfg.mode
    assert sorted(ace_main.ENVIRONMENTS.names()) == ["acegrpo", "ideator"]


def test_the_trainer_refuses_an_environment_of_another_mode(tmp_path):
    from ace_jax.train import trainer

    cfg = config_utils.load_config_file(str(REPO / "configs/ideator.py"))
    cfg.workdir = str(tmp_path / "run")
    with pytest.raises(SetupError, match="config mode='ideator' but the environment is "
                                         "CodeAgentEnv"):
        trainer.Trainer(cfg, progress=False, env=environment.CodeAgentEnv())
    with pytest.raises(SetupError, match="mode 'acegrpo'"):
        trainer.Trainer(cfg, progress=False)    # the default environment: the code agent
