"""XLA's persistent compilation cache: compiled programs are written to a folder and reused by
every later process that compiles the same program (a resumed run, the next seed of a study, the
five samplers of an ablation, a benchmark run again), so only the first run of a setting pays
for compiling.

The key of an entry is the program, the compile options, the devices and the jax / XLA
versions, so a hit gives the executable a fresh compile would give (the same results). Writes
are atomic: processes of one machine (or the hosts of a pod, on a shared ``gs://`` folder) may
share one folder. On a pod JAX writes entries from process 0 only. JAX's
``jax_share_binary_between_hosts`` (process 0 compiles, the others wait for its binary) stays
off: it needs every process to compile the same programs in the same order, and a run's
processes do not (process 0 alone trains the tokenizer; the two-process test deadlocked in a
shared compile at the first barrier).

``python -m ace_jax`` enables it from the run config's top-level ``compile_cache_dir``
(``""`` = off), ``launch/evaluate.py`` and ``launch/serve.py`` from their ``--compile_cache_dir``
flag (unset: ``DEFAULT_DIR``). It is process-wide jax state, so library code never calls
`enable`.
"""
from __future__ import annotations

import logging
import os

import jax

logger = logging.getLogger(__name__)

DEFAULT_DIR = "~/.cache/ace_jax/xla"
"""The default of ``compile_cache_dir``: one cache per user, shared by all of their runs."""

MIN_COMPILE_SECONDS = 0.5
"""Programs that compile faster than this are not written (reading them back saves nothing)."""

MAX_BYTES = 2 << 30
"""A local cache beyond this drops its least recently used entries."""


def enable(path: str | None, *, min_compile_seconds: float = MIN_COMPILE_SECONDS) -> str | None:
    """Turns the cache on in ``path`` (``~`` expanded; a local folder is created; None:
    ``DEFAULT_DIR``, what a flag left unset means); returns the folder, or None when ``path`` is
    empty (the cache stays off). Programs that compiled in less than ``min_compile_seconds`` are
    not written."""
    if path is None:
        path = DEFAULT_DIR
    if not path:
        return None
    if "://" not in path:
        path = os.path.abspath(os.path.expanduser(path))
        os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(min_compile_seconds))
    # A shared remote folder (gs://) is not evicted: JAX's eviction locks the folder with a
    # local file lock, which a bucket cannot hold (it would make a local "gs:" folder).
    jax.config.update("jax_compilation_cache_max_size", -1 if "://" in path else MAX_BYTES)
    logger.info("XLA compilation cache: %s", path)
    return path
