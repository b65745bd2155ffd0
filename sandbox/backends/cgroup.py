"""A per-execution ``pids`` cgroup: the fork-bomb limit that also binds root, and a kill-all.

RLIMIT_NPROC counts processes per real uid and the kernel does not enforce it for uid 0 (even
inside a user namespace that root created: the outside uid is still 0). The host here runs as
root, so the process count of a sandboxed tree is capped with the cgroup ``pids`` controller
instead: ``pids.max`` makes fork()/clone() fail with EAGAIN past the limit, and listing
``cgroup.procs`` finds every process of the execution, including ones that escaped the process
group with setsid (daemons), so they can all be killed at the end.

Works with cgroup v1 (a ``pids`` hierarchy we can mkdir in, as here) and cgroup v2 (our cgroup
must be able to delegate ``+pids`` to a child; on v2 ``cgroup.kill`` is used when present).
``detect()`` says why it cannot be used otherwise; callers then fall back to RLIMIT_NPROC
(binding only for non-root) and document the gap.
"""
from __future__ import annotations

import errno
import os
import pathlib
import signal
import time
import uuid
from typing import Optional

_DEFAULT_PARENT = "ace_sandbox"


def _pids_mount() -> tuple[Optional[pathlib.Path], str, str]:
    """(mount point, version 'v1'|'v2', reason) of the hierarchy that carries ``pids``."""
    try:
        mountinfo = pathlib.Path("/proc/self/mountinfo").read_text()
    except OSError as e:
        return None, "", f"cannot read /proc/self/mountinfo: {e}"
    v2 = None
    for line in mountinfo.splitlines():
        pre, _, post = line.partition(" - ")
        fields, post_fields = pre.split(), post.split()
        if len(fields) < 5 or len(post_fields) < 3:
            continue
        fstype, options = post_fields[0], post_fields[2].split(",")
        mount_root, mount_point = fields[3], fields[4]
        if fstype == "cgroup" and "pids" in options and mount_root == "/":
            return pathlib.Path(mount_point), "v1", ""
        if fstype == "cgroup2" and mount_root == "/":
            v2 = pathlib.Path(mount_point)
    if v2 is not None:
        return v2, "v2", ""
    return None, "", "no cgroup 'pids' hierarchy is mounted"


def _own_cgroup(version: str) -> Optional[str]:
    try:
        lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if version == "v1" and "pids" in controllers.split(","):
            return path
        if version == "v2" and hier == "0" and controllers == "":
            return path
    return None


class PidsCgroup:
    """One execution's cgroup. Create with ``PidsCgroupParent.create``; always ``remove()`` it."""

    def __init__(self, path: pathlib.Path, version: str):
        self.path = path
        self.version = version

    @property
    def procs_file(self) -> str:
        return os.fspath(self.path / "cgroup.procs")

    def pids(self) -> list[int]:
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def limit_hits(self) -> int:
        """How many fork()/clone() calls the pid limit refused (``pids.events`` max counter)."""
        try:
            for line in (self.path / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def signal_all(self, sig: int) -> int:
        """Sends ``sig`` to every process in the cgroup; returns how many were signalled."""
        count = 0
        for pid in self.pids():
            try:
                os.kill(pid, sig)
                count += 1
            except ProcessLookupError:
                pass
        return count

    def kill_all(self, timeout_s: float = 5.0) -> int:
        """SIGKILLs every process until the cgroup is empty (a fork bomb races the first pass).

        Returns the number of distinct pids killed. Raises TimeoutError if it stays non-empty.
        """
        killed: set[int] = set()
        kill_file = self.path / "cgroup.kill"
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return len(killed)
            if self.version == "v2" and kill_file.exists():
                try:
                    kill_file.write_text("1")
                except OSError:
                    pass
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.add(pid)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"cgroup {self.path} still holds pids {self.pids()[:10]}")
            time.sleep(0.005)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kills what is left and removes the cgroup directory."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.kill_all(timeout_s=max(0.1, deadline - time.monotonic()))
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError as e:
                if e.errno != errno.EBUSY or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)


class PidsCgroupParent:
    """The directory under which per-execution pids cgroups are made (``<own cgroup>/ace_sandbox``)."""

    def __init__(self, path: pathlib.Path, version: str):
        self.path = path
        self.version = version

    @classmethod
    def detect(cls, parent_name: str = _DEFAULT_PARENT) -> tuple[Optional["PidsCgroupParent"], str]:
        """Returns (parent, "") if per-execution pids cgroups can be made here, else (None, reason)."""
        mount, version, reason = _pids_mount()
        if mount is None:
            return None, reason
        own = _own_cgroup(version)
        if own is None:
            return None, f"cannot find this process's {version} pids cgroup in /proc/self/cgroup"
        base = mount / own.lstrip("/")
        if version == "v2":
            try:
                controllers = (base / "cgroup.controllers").read_text().split()
            except OSError as e:
                return None, f"cannot read {base}/cgroup.controllers: {e}"
            if "pids" not in controllers:
                return None, f"the pids controller is not available in {base} (cgroup v2)"
        parent = base / parent_name
        try:
            parent.mkdir(exist_ok=True)
            if version == "v2":
                (base / "cgroup.subtree_control").write_text("+pids")
                (parent / "cgroup.subtree_control").write_text("+pids")
            probe = parent / f"probe-{uuid.uuid4().hex[:8]}"
            probe.mkdir()
            ok = (probe / "pids.max").exists()
            os.rmdir(probe)
        except OSError as e:
            return None, f"cannot create a pids cgroup under {parent}: {e.strerror or e}"
        if not ok:
            return None, f"{parent} has no pids.max (pids controller not enabled)"
        return cls(parent, version), ""

    def create(self, pids_max: int) -> PidsCgroup:
        """A fresh child cgroup with ``pids.max = pids_max``."""
        if pids_max <= 0:
            raise ValueError(f"pids_max must be positive, got {pids_max}")
        path = self.path / f"run-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        (path / "pids.max").write_text(str(int(pids_max)))
        return PidsCgroup(path, self.version)
