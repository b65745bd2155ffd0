"""Logging set-up of the entry points: a terminal a person can read.

By default only warnings and errors are logged to the terminal: the INFO records of Orbax (a few
lines per array saved or restored), absl, JAX and our own modules are dropped. What a researcher
watches is not logged but printed, and is unaffected: the progress bar and the one line per RL
step of `ace_jax.train.metrics.MetricWriter`.

The rest is behind absl's own ``--verbosity`` flag (``-v``), with absl's levels:

    --verbosity=-3 fatal, -2 errors, -1 warnings (our default), 0 info (absl's default), 1 debug

``--logger_levels=name:LEVEL,...`` (absl) still sets single loggers, e.g.
``--logger_levels=ace_jax.train.trainer:INFO`` shows the trainer's INFO records only. JAX's C++ logging
is already limited to warnings by JAX itself (``TF_CPP_MIN_LOG_LEVEL=1``).

Call ``configure_logging()`` first thing in an absl ``main``, once the flags are parsed::

    def main(argv):
        logs.configure_logging()
"""
from __future__ import annotations

import logging
import os
from typing import Optional

DEFAULT_VERBOSITY = -1   # warnings and errors
# Loggers of libraries that log at INFO in normal operation; set explicitly, so a library that
# sets its own logger's level cannot undo the quiet.
LIBRARY_LOGGERS = ("absl", "orbax", "jax", "etils")

_ABSL_LEVELS = {-3: logging.FATAL, -2: logging.ERROR, -1: logging.WARNING, 0: logging.INFO,
                1: logging.DEBUG}


def level_of_verbosity(verbosity: int) -> int:
    """The Python logging level of an absl verbosity: -3 FATAL, -2 ERROR, -1 WARNING, 0 INFO,
    1 DEBUG; above 1, absl's vlog levels (DEBUG - (verbosity - 1)); below -3, FATAL.

    Raises:
      TypeError: ``verbosity`` is not an int.
    """
    if not isinstance(verbosity, int) or isinstance(verbosity, bool):
        raise TypeError(f"verbosity must be an int (absl levels -3..1), got {verbosity!r}")
    if verbosity > 1:
        return max(logging.DEBUG - (verbosity - 1), 1)
    return _ABSL_LEVELS.get(verbosity, logging.FATAL)


def requested_verbosity() -> int:
    """absl's ``--verbosity`` when given on the command line, else `DEFAULT_VERBOSITY` (absl
    would otherwise raise its default to INFO once the flags are parsed)."""
    from absl import flags

    fv = flags.FLAGS
    if "verbosity" in fv and fv.is_parsed() and fv["verbosity"].present:
        return int(fv.verbosity)
    return DEFAULT_VERBOSITY


def configure_logging(verbosity: Optional[int] = None) -> int:
    """Sets the logging threshold of the process; returns the Python level now in effect.

    Args:
      verbosity: an absl verbosity (see `level_of_verbosity`); None: `requested_verbosity()`
        (``--verbosity`` when given, else warnings and errors only).

    The root logger, absl's ``FLAGS.verbosity`` and the `LIBRARY_LOGGERS` all get the level;
    then ``--logger_levels`` (when parsed) is applied again on top. Handlers are left alone: in
    an absl app, absl's handler writes to stderr.
    """
    from absl import flags, logging as absl_logging

    if verbosity is None:
        verbosity = requested_verbosity()
    level = level_of_verbosity(verbosity)
    absl_logging.set_verbosity(verbosity)
    logging.getLogger().setLevel(level)
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(level)
    if level > logging.INFO:   # transformers' import-time advice (e.g. "PyTorch was not found":
        # it is used for tokenizers only) stays out of the default terminal
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    fv = flags.FLAGS
    if "logger_levels" in fv and fv.is_parsed():
        for name, name_level in fv.logger_levels.items():
            logging.getLogger(name).setLevel(name_level)
    return level
