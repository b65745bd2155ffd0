"""Watching one running script: its output streams, memory, process tree, CPU time and kills.

The supervision that ``ProcessBackend`` (cold: a fresh interpreter per execution) and
``WarmBackend`` (a script forked from a warm interpreter) share: ``supervise`` runs the loop
that enforces the wall-clock deadline, the disk quota and cancellation while ``pump`` / ``drain``
read the streams; ``MemorySampler`` samples the tree's resident memory; ``StatusPipe`` carries
the gate's status; ``kill_gated`` / ``abort`` / ``marked_pids`` end what is left.
"""
from __future__ import annotations

import math
import os
import pathlib
import select
import selectors
import signal
import subprocess
import threading
import time
from typing import Optional

from sandbox.backends import base
from sandbox.backends.cgroup import PidsCgroup

MARKER_ENV = "ACE_SANDBOX_RUN"   # in every script's environment: its run's marker
_READ_CHUNK = 1 << 16




def supervise(sel: selectors.BaseSelector, streams: dict, ended, *, start: float,
              limits: base.Limits, disk_dir: pathlib.Path, disk_poll_s: float,
              memory: "MemorySampler", cancel: Optional[threading.Event],
              max_wait: float = 0.1) -> Optional[str]:
    """Reads the script's output until ``ended()`` (returns None) or a limit is passed (returns
    "cancelled", "timeout" or "disk"), sampling its memory meanwhile. ``sel`` holds the output
    pipes and anything whose readiness may mean the end (a pidfd, the zygote's socket)."""
    deadline = start + limits.time_s
    next_disk = start + disk_poll_s
    disk_bytes = int(limits.disk_mb) << 20
    while True:
        now = time.monotonic()
        pump(sel, streams, timeout=min(max(min(deadline, next_disk, memory.next_at) - now, 0.0),
                                        max_wait))
        if ended():
            return None
        now = time.monotonic()
        if now >= memory.next_at:
            memory.sample(now)
        if cancel is not None and cancel.is_set():
            return "cancelled"
        if now >= deadline:
            return "timeout"
        if now >= next_disk:
            next_disk = now + disk_poll_s
            if base.dir_usage_bytes(disk_dir, disk_bytes) > disk_bytes:
                return "disk"


def note_cgroup_limits(raw: base.RawExecution, cgroup: Optional[PidsCgroup],
                       limits: base.Limits) -> None:
    """Adds to ``raw`` what the execution's cgroup limits did: the forks the pid limit refused
    (a note) and the processes the memory limit's OOM killer ended. An OOM kill is the outcome
    (``raw.oom_killed``: status oom) when the script did not exit 0; a script that survived the
    loss of a child and exited 0 keeps its result, with a note."""
    if cgroup is None:
        return
    hits = cgroup.limit_hits()
    if hits:
        raw.notes.append(f"pid limit ({limits.pids_max}) refused {hits} new processes or threads")
    kills = cgroup.oom_kills()
    if kills:
        raw.notes.append(f"memory limit ({limits.memory_mb} MiB for the whole process tree) "
                         f"killed {kills} process(es)")
        raw.oom_killed = raw.exit_code != 0


def cpu_limit_s(limits: base.Limits) -> int:
    """The soft RLIMIT_CPU in CPU-seconds (the hard one is a second more)."""
    return int(math.ceil(limits.time_s * limits.cpu_factor)) + 1


def has_exited(pid: int) -> bool:
    """True once ``pid`` (our child) has terminated; does not reap it (WNOWAIT)."""
    try:
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return True
    return info is not None


class MemorySampler:
    """Peak memory of the execution's process tree, sampled from /proc while it runs.

    ``ru_maxrss`` from wait4 is not usable: the child is forked from the host before exec and
    the kernel carries the pre-exec high-water mark (the host's whole RSS) into it. Instead the
    tree (the cgroup's processes, else the children links from the main process) is read every
    10 ms at first, backing off to 100 ms; the peak is the larger of the biggest per-process
    VmHWM (a high-water mark, so nothing between samples is lost for long-lived processes) and
    the biggest sampled sum of VmRSS. Growth in the last interval before exit can be missed.
    """

    def __init__(self, pid: int, cgroup: Optional[PidsCgroup], start: float):
        self.pid, self.cgroup = pid, cgroup
        self.interval = 0.01
        self.next_at = start + 0.005
        self.peak_kb = 0

    def sample(self, now: float) -> None:
        pids = self.cgroup.pids() if self.cgroup is not None else tree_pids(self.pid)
        total_rss = 0
        for pid in pids:
            rss, hwm = status_memory_kb(pid)
            total_rss += rss
            self.peak_kb = max(self.peak_kb, hwm)
        self.peak_kb = max(self.peak_kb, total_rss)
        self.interval = min(self.interval * 1.5, 0.1)
        self.next_at = now + self.interval

    def peak_mb(self) -> Optional[float]:
        """Peak in MiB, or None when no sample saw the exec'd script (under 1 MiB: pre-exec)."""
        return self.peak_kb / 1024.0 if self.peak_kb >= 1024 else None


def tree_pids(root: int, limit: int = 4096) -> list[int]:
    """``root`` and its descendants, following /proc/<pid>/task/<tid>/children."""
    out, stack = [], [root]
    while stack and len(out) < limit:
        pid = stack.pop()
        out.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
            except OSError:
                continue
    return out


def status_memory_kb(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of ``pid`` in KiB; zeros if it is gone or a zombie."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return rss, hwm


def kill_gated(*pids: Optional[int]) -> None:
    """SIGKILLs each of ``pids`` (None and the already dead are skipped)."""
    for pid in dict.fromkeys(pids):
        if pid is not None:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def abort(proc: subprocess.Popen, gate_w: int, target: Optional[int] = None) -> None:
    """Kills a process still waiting at its gate (and ``target``, its confined descendant), then
    closes the gate: a process that reads EOF there must find itself already killed."""
    kill_gated(proc.pid, target)
    proc.wait()
    os.close(gate_w)
    proc.stdout.close()
    proc.stderr.close()


class StatusPipe:
    """The read end of a sandbox's status pipe (bwrap's ``--json-status-fd``).

    Read in two parts: the first line while the sandbox starts (bwrap writes the pid of its
    namespace child right after cloning it), everything else once the execution has ended.
    """

    def __init__(self, fd: int):
        self.fd = fd
        self.data = b""

    def first_line(self, timeout_s: float) -> Optional[bytes]:
        """The first line, waiting up to ``timeout_s``; None if the writer closed the pipe first.

        Raises SandboxSetupError when nothing arrives in time.
        """
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.data:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.fd], [], [], remaining)[0]:
                raise base.SandboxSetupError(
                    f"the sandbox reported nothing on its status pipe within {timeout_s:.0f} s")
            chunk = os.read(self.fd, _READ_CHUNK)
            if not chunk:
                return None
            self.data += chunk
        return self.data.split(b"\n", 1)[0]

    def read_all(self) -> bytes:
        """Everything written so far (its writers are dead or done)."""
        self.data += read_available(self.fd)
        return self.data


def read_available(fd: int, limit: int = 1 << 16) -> bytes:
    """What a pipe holds now (its writers are dead or done), at most ``limit`` bytes."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < limit:
        try:
            chunk = os.read(fd, limit - len(data))
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


def pidfd_open(pid: int) -> Optional[int]:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def pump(sel: selectors.BaseSelector, streams: dict, timeout: float) -> None:
    """Reads whatever the pipes hold (waiting at most ``timeout`` s); other fds only wake us."""
    for key, _ in sel.select(timeout):
        if key.fd not in streams:
            continue
        try:
            data = os.read(key.fd, _READ_CHUNK)
        except BlockingIOError:
            continue
        if data:
            streams[key.fd].feed(data)
        else:
            sel.unregister(key.fd)


def drain(sel: selectors.BaseSelector, streams: dict, timeout: float) -> None:
    """Reads what is left in the pipes until EOF (everything holding them is dead) or timeout."""
    end = time.monotonic() + timeout
    while any(fd in streams for fd in sel.get_map()) and time.monotonic() < end:
        pump(sel, streams, timeout=0.05)


def marked_pids(marker: str) -> list[int]:
    """Pids of live processes whose environment holds ``ACE_SANDBOX_RUN=<marker>``."""
    needle = f"{MARKER_ENV}={marker}".encode()
    own = os.getpid()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit() or int(entry) == own:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env:
            found.append(int(entry))
    return found


def uid_task_count(uid: int) -> int:
    """Threads currently owned by ``uid`` (what RLIMIT_NPROC counts)."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                text = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            count += int(fields.get("Threads", "1"))
    return count
