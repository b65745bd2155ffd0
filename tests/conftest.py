"""Test-wide setup: 8 simulated CPU devices (for sharding tests), fp32 matmul precision, and one
persistent XLA compilation cache per test run.

XLA reads XLA_FLAGS when the backend starts, and jax reads ``JAX_COMPILATION_CACHE_DIR`` when it
is imported, so both are set here, before any test imports jax.

The cache: the library makes a fresh ``jax.jit`` per Learner, Engine and generator, so every test
that builds one compiles its programs again, although many tests build the same programs (the
tiny model's learner step, the engine's decode call). With the cache a program compiled once in
a run is read back by the later tests and by the other pytest-xdist worker (one folder per run,
named by the process that starts it; removed when the run ends). Only programs that took at
least 0.5 s to compile are written. A hit gives the executable a fresh compile would give (the
key is the program, its compile options, the devices and the jax / XLA versions).
``JAX_COMPILATION_CACHE_DIR=`` (empty) turns it off.
"""
import os
import re
import shutil
import tempfile

import pytest

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the TPU compile tests) refuses a second process on the host unless told it may.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

_RUN_CACHE = os.path.join(tempfile.gettempdir(), "ace_jax_tests_xla_" + os.environ.get(
    "PYTEST_XDIST_TESTRUNUID", str(os.getpid())))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", _RUN_CACHE)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")


def pytest_sessionfinish(session):
    """The run's cache goes when the run ends (in the process that started it: the xdist
    controller, or the only process without xdist)."""
    if not hasattr(session.config, "workerinput") and \
            os.environ.get("JAX_COMPILATION_CACHE_DIR") == _RUN_CACHE:
        shutil.rmtree(_RUN_CACHE, ignore_errors=True)


#: Skip reasons that mean a dependency CI installs is missing (.ci/run installs bwrap's wheel,
#: jax[tpu]'s libtpu and MLE-bench): under CI=true such a skip is a failure, so a broken install
#: step cannot pass unnoticed as a row of skips.
_MISSING_IN_CI = re.compile(r"bubblewrap unusable here|libtpu|mlebench is not installed|"
                            r"MLE-bench is not installed")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if os.environ.get("CI") != "true" or not report.skipped or not isinstance(
            report.longrepr, tuple):
        return
    reason = str(report.longrepr[2])
    if _MISSING_IN_CI.search(reason):
        report.outcome = "failed"
        report.longrepr = f"CI=true: a dependency CI installs is missing ({reason})"
