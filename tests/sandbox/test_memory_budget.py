"""sandbox.memory_budget: the budget's sum and its error, and configs/ace30b.py's sandbox on the
host it runs on. (A pool refusing what does not fit: tests/sandbox/test_pool.py.)"""
import pathlib

import pytest

from sandbox.backends.warm import WARM_INTERPRETER_MB
from sandbox.memory_budget import MemoryBudget, SandboxBudgetError, host_memory_mb


def test_the_budget_error_names_the_numbers_and_the_knobs():
    budget = MemoryBudget(num_workers=32, per_execution={"memory": 16384, "/tmp tmpfs": 20480},
                          resident={"64 idle warm interpreters": 64 * 256},
                          host_mb=458752, reserve_mb=8192)
    assert budget.total_mb == 32 * (16384 + 20480) + 64 * 256
    with pytest.raises(SandboxBudgetError) as e:
        budget.check()
    text = str(e.value)
    for needle in (f"{budget.total_mb} MiB", "32 workers (sandbox.num_workers)",
                   "16384 MiB memory", "20480 MiB /tmp tmpfs", "450560 MiB this host leaves it",
                   "sandbox.reserve_gb=8 GiB", "sandbox.max_memory_mb", "backend_options.disk_mb",
                   "sandbox.max_idle_warm"):
        assert needle in text, (needle, text)


def test_ace30b_sandbox_fits_a_v5p_host():
    """configs/ace30b.py's sandbox on a v5p host (448 GB of RAM; the kernel keeps ~2% of it):
    bwrap's /tmp tmpfs and a working dir on /dev/shm counted, MLE-bench's 16 GiB per task."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "ace30b", pathlib.Path(__file__).resolve().parents[2] / "configs" / "ace30b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sb = module.get_config().sandbox
    assert sb.backend == "bwrap" and sb.max_time_limit_s > 0 and sb.max_memory_mb > 0
    disk = sb.backend_options.disk_mb
    budget = MemoryBudget(sb.num_workers, {"memory": sb.max_memory_mb, "/tmp tmpfs": disk,
                                           "working dir in RAM": disk},
                          {"warm": sb.max_idle_warm * WARM_INTERPRETER_MB},
                          host_mb=int(448e9 * 0.98) >> 20, reserve_mb=int(sb.reserve_gb * 1024))
    budget.check()
    assert sb.num_workers * sb.backend_options.threads <= 208  # vCPUs of a v5p host


def test_host_memory_is_this_machine_s_ram_at_most():
    with open("/proc/meminfo") as f:
        total_mb = next(int(x.split()[1]) for x in f if x.startswith("MemTotal:")) // 1024
    assert 0 < host_memory_mb() <= total_mb
