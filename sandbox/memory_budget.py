"""The sandbox's worst-case RAM against what the host leaves it: ``MemoryBudget`` (the sum and
its check, ``SandboxBudgetError`` naming the figures and the knobs) and ``host_memory_mb`` (the
host's RAM, a container's cgroup limit where lower). ``SandboxPool.check_budget`` uses them."""
from __future__ import annotations

import dataclasses
from typing import Mapping

from sandbox.backends import SandboxConfigError


class SandboxBudgetError(SandboxConfigError):
    """The sandbox could take more of the host's RAM than the trainer leaves it."""


def host_memory_mb() -> int:
    """This host's RAM in MiB: /proc/meminfo's MemTotal, or the memory limit of this process's
    cgroup where that is lower (a container)."""
    total_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total_kb = int(line.split()[1])
                break
    limit = _own_cgroup_memory_limit_bytes()
    total_mb = total_kb // 1024
    return min(total_mb, limit >> 20) if limit else total_mb


def _own_cgroup_memory_limit_bytes() -> int:
    """The memory limit of this process's cgroup (v1 ``memory.limit_in_bytes``, v2
    ``memory.max``), in bytes; 0 when there is none or it cannot be read."""
    try:
        lines = open("/proc/self/cgroup").read().splitlines()
    except OSError:
        return 0
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if "memory" in controllers.split(","):
            candidates = [f"/sys/fs/cgroup/memory{path}/memory.limit_in_bytes"]
        elif hier == "0" and controllers == "":
            candidates = [f"/sys/fs/cgroup{path}/memory.max"]
        else:
            continue
        for c in candidates:
            try:
                text = open(c).read().strip()
            except OSError:
                continue
            if text.isdigit() and int(text) < (1 << 60):
                return int(text)
    return 0


@dataclasses.dataclass(frozen=True)
class MemoryBudget:
    """The sandbox's worst-case RAM against what the host leaves it. Every figure in MiB.

    Attributes:
      num_workers: executions at once.
      per_execution: the most one execution may hold, by part (its memory budget, its RAM-backed
        dirs: ``Backend.ram_per_execution_mb``).
      resident: what the backend holds between executions (idle warm interpreters).
      host_mb: the host's RAM (``host_memory_mb``).
      reserve_mb: kept for the trainer (``sandbox.reserve_gb``).
    """

    num_workers: int
    per_execution: Mapping[str, int]
    resident: Mapping[str, int]
    host_mb: int
    reserve_mb: int

    @property
    def total_mb(self) -> int:
        return (self.num_workers * sum(self.per_execution.values())
                + sum(self.resident.values()))

    @property
    def available_mb(self) -> int:
        return self.host_mb - self.reserve_mb

    def check(self) -> None:
        """Raises SandboxBudgetError, naming the figures and the knobs, if it does not fit."""
        if self.total_mb <= self.available_mb:
            return
        parts = " + ".join(f"{mb} MiB {name}" for name, mb in self.per_execution.items())
        resident = "".join(f" + {mb} MiB of {name} (sandbox.max_idle_warm)"
                           for name, mb in self.resident.items())
        raise SandboxBudgetError(
            f"the sandbox may hold {self.total_mb} MiB of RAM: {self.num_workers} workers "
            f"(sandbox.num_workers) x ({parts}){resident}, more than the "
            f"{self.available_mb} MiB this host leaves it ({self.host_mb} MiB of RAM less "
            f"sandbox.reserve_gb={self.reserve_mb / 1024:g} GiB for the trainer). Lower "
            "sandbox.num_workers, cap each execution's memory with sandbox.max_memory_mb (MiB), "
            "lower backend_options.disk_mb (the /tmp tmpfs and a working dir on /dev/shm hold "
            "RAM; backend_options.root_dir on a disk takes the working dirs out of RAM), or "
            "lower sandbox.reserve_gb if the trainer needs less")
