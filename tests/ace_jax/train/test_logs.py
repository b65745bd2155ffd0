"""The quiet terminal (ace_jax/train/logs.py): by default an absl app shows warnings and errors, not the
INFO records of absl, Orbax or our modules; --verbosity brings them back."""
import logging
import pathlib
import subprocess
import sys
import textwrap

import pytest

from ace_jax.train import logs

ROOT = str(pathlib.Path(__file__).resolve().parents[3])

# A tiny absl app: INFO on the absl logger (what Orbax uses), on an orbax logger and on one of
# ours, then a warning and an error; stdout says which level configure_logging set.
APP = textwrap.dedent("""
    import logging, sys
    from absl import app, logging as absl_logging
    from ace_jax.train import logs

    def main(argv):
        level = logs.configure_logging()
        absl_logging.info("absl-info-record")
        logging.getLogger("orbax.checkpoint").info("orbax-info-record")
        logging.getLogger("ace_jax.train.trainer").info("ours-info-record")
        logging.getLogger("ace_jax.train.trainer").debug("ours-debug-record")
        absl_logging.warning("absl-warning-record")
        logging.getLogger("ace_jax.train.trainer").error("ours-error-record")
        print("level", level)

    app.run(main)
""")


def _run_app(tmp_path, *flags):
    script = tmp_path / "app.py"
    script.write_text(APP)
    res = subprocess.run([sys.executable, str(script), *flags], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout, res.stderr


def test_default_shows_warnings_and_errors_only(tmp_path):
    out, err = _run_app(tmp_path)
    assert out.strip() == f"level {logging.WARNING}"
    assert "absl-warning-record" in err and "ours-error-record" in err
    assert "info-record" not in err and "debug-record" not in err
    assert len(err.strip().splitlines()) == 2, err


@pytest.mark.parametrize("flag,shown,hidden", [
    ("--verbosity=0", ["absl-info", "orbax-info", "ours-info", "absl-warning"], ["ours-debug"]),
    ("--verbosity=1", ["orbax-info", "ours-debug"], []),
    ("--verbosity=-2", ["ours-error"], ["absl-warning", "info-record"]),
    ("--logger_levels=ace_jax.train.trainer:INFO", ["ours-info", "absl-warning"],
     ["absl-info", "orbax-info"]),
])
def test_verbosity_flag_brings_back_what_it_names(tmp_path, flag, shown, hidden):
    _, err = _run_app(tmp_path, flag)
    for needle in shown:
        assert needle in err, (flag, needle, err)
    for needle in hidden:
        assert needle not in err, (flag, needle, err)


def test_level_of_verbosity_follows_absl():
    assert [logs.level_of_verbosity(v) for v in (-5, -3, -2, -1, 0, 1)] == [
        logging.FATAL, logging.FATAL, logging.ERROR, logging.WARNING, logging.INFO, logging.DEBUG]
    assert logs.level_of_verbosity(3) == logging.DEBUG - 2   # absl's vlog levels
    for bad in ("1", 1.0, None, True):
        with pytest.raises(TypeError, match="verbosity must be an int"):
            logs.level_of_verbosity(bad)


def test_requested_verbosity_defaults_to_warnings_before_flags_are_parsed():
    assert logs.requested_verbosity() == logs.DEFAULT_VERBOSITY == -1
