"""jax's persistent compilation cache switched for a block of tests (tests/conftest.py turns it
on for the whole run)."""
import contextlib
from typing import Optional

import jax


@contextlib.contextmanager
def persistent_cache(path: Optional[str], min_compile_seconds: Optional[float] = None):
    """The cache in ``path`` (None: off) for the block, programs written from
    ``min_compile_seconds`` of compile time (None: as set); the settings before it afterwards."""
    from jax.experimental.compilation_cache import compilation_cache

    keys = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    before = {k: getattr(jax.config, k) for k in keys}
    jax.config.update(keys[0], path)
    if min_compile_seconds is not None:
        jax.config.update(keys[1], min_compile_seconds)
    compilation_cache.reset_cache()         # re-read the settings at the next compile
    try:
        yield
    finally:
        for k, v in before.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()
