"""A per-execution cgroup: ``pids`` (the fork-bomb limit that also binds root, and a kill-all)
and, where the host lets us, ``memory`` (the memory limit of the whole process tree).

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

Memory: RLIMIT_AS bounds each process, not the tree: a script that forks 4 children of 1 GB under
a 2 GB budget gets 4 GB of RAM. So each execution's cgroup also gets the ``memory`` controller
(``cgroup_hierarchy.MemoryHierarchy``), limited to the execution's memory budget: cgroup v1
``memory.limit_in_bytes`` (and ``memory.memsw.limit_in_bytes`` at the same value where swap is
accounted: no swap), in a directory of the same name in the v1 memory hierarchy (under this
process's own memory cgroup, as here); cgroup v2 ``memory.max`` and ``memory.swap.max = 0`` in the
execution's one cgroup. Past the limit the kernel reclaims the tree's page cache, then its OOM
killer kills a process of the tree (the largest); ``PidsCgroup.oom_kills`` counts those kills
(v1 ``memory.oom_control``, v2 ``memory.events``: ``oom_kill``), which the backends report as a
memory error. Files the tree writes to a tmpfs (bwrap's /tmp, a working dir on /dev/shm) are
charged to it too. Where no memory cgroup can be made (no writable memory hierarchy; on v2 a
cgroup that holds processes cannot enable ``memory`` for its children, the no-internal-process
rule, unless it is the root) ``PidsCgroupParent.memory_reason`` says why, the backend logs it once,
and only RLIMIT_AS per process holds.

Cost: moving a process into a cgroup (writing its pid to ``cgroup.procs``) write-locks the
cgroup threadgroup rwsem, which waits for an RCU grace period (~6-15 ms here) unless another move
happened a few ms before: in a pool, on every execution. Moving only the calling thread (writing
``0`` to a v1 ``tasks`` file) skips that lock (~0.2 ms). So on v1 the host thread that starts an
execution steps into the execution's cgroup, starts the process there (a child is born in its
parent thread's cgroup) and steps back out (``PidsCgroup.run_inside``); no process is ever moved.
While the thread is inside, ``pids.max`` is one higher for it, and lowered back before the child
may run the script (it waits at the backend's gate). On v2 (no thread-level moves outside threaded
cgroups) the started process is moved instead, as before. Making and removing a cgroup per
execution cost another ~0.5 ms, so ``PidsCgroupParent.acquire`` / ``release`` reuse a cgroup
once nothing is charged to it any more: each execution still starts in an empty cgroup of its own.
With a (v1) memory cgroup the thread steps into it too: ~0.12 ms more per execution here.
"""
from __future__ import annotations

import contextlib
import errno
import os
import pathlib
import signal
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Optional

from sandbox.backends.cgroup_hierarchy import (_DEFAULT_PARENT, _MEMORY_FILES, MemoryHierarchy,
                                               _own_cgroup, _pids_mount, _thread_cgroup,
                                               detect_memory)


class CgroupMoveError(OSError):
    """The calling thread could not step into a cgroup (``run_inside``); nothing was started."""


def _move_current_thread(cgroup_dir: pathlib.Path) -> None:
    """Moves only the calling thread into ``cgroup_dir`` (cgroup v1): ``0`` names the writer."""
    with open(cgroup_dir / "tasks", "w") as f:
        f.write("0")


def _counter(path: pathlib.Path, key: str) -> int:
    """The value of line ``key N`` of a flat-keyed cgroup file (0 if absent or unreadable)."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


class PidsCgroup:
    """One execution's cgroup. Create with ``PidsCgroupParent.create``; always ``remove()`` it.

    ``memory``: where its memory cgroup lives (None: no memory cgroup; see the module docstring).
    """

    def __init__(self, path: pathlib.Path, version: str, mount: Optional[pathlib.Path] = None,
                 memory: Optional[MemoryHierarchy] = None):
        self.path = path
        self.version = version
        self.mount = mount  # root of the pids hierarchy (needed by run_inside)
        self.memory = memory
        self.memory_dir = memory.dir_of(path) if memory is not None else None
        self._max: Optional[int] = None
        self._memory_max: Optional[int] = None  # bytes
        self._hits_before = 0  # pids.events "max" when the current execution began
        self._oom_before = 0   # the memory cgroup's oom_kill count then

    @property
    def procs_file(self) -> str:
        return os.fspath(self.path / "cgroup.procs")

    @property
    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` a process is moved in by: the pids cgroup's and (v1) the memory
        cgroup's."""
        files = [self.procs_file]
        if self.memory_dir is not None and self.memory_dir != self.path:
            files.append(os.fspath(self.memory_dir / "cgroup.procs"))
        return files

    def pids(self) -> list[int]:
        """Processes in the cgroup; never this host process (a thread of it steps in to spawn)."""
        try:
            text = (self.path / "cgroup.procs").read_text()
        except OSError:
            return []
        own = os.getpid()
        return [pid for pid in map(int, text.split()) if pid != own]

    def current(self) -> int:
        """``pids.current``: tasks charged to the cgroup (live and not yet reaped)."""
        try:
            return int((self.path / "pids.current").read_text())
        except (OSError, ValueError):
            return 0

    def set_max(self, pids_max: int) -> None:
        """Writes ``pids.max``: at most ``pids_max`` tasks alive at once."""
        if pids_max <= 0:
            raise ValueError(f"pids_max must be positive, got {pids_max}")
        (self.path / "pids.max").write_text(str(int(pids_max)))
        self._max = int(pids_max)

    def set_memory_max(self, memory_bytes: int) -> None:
        """Limits the tree's memory to ``memory_bytes`` (RAM; no swap where swap is accounted).

        Raises ValueError without a memory cgroup or for a non-positive size, OSError when the
        kernel refuses the value.
        """
        if self.memory_dir is None:
            raise ValueError(f"{self.path} has no memory cgroup")
        if memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {memory_bytes}")
        limit_file, swap_file, _ = _MEMORY_FILES[self.memory.version]
        limit, swap = self.memory_dir / limit_file, self.memory_dir / swap_file
        value = str(int(memory_bytes))
        if self.memory.version == "v2":
            limit.write_text(value)
            if swap.exists():
                swap.write_text("0")
        elif not swap.exists():
            limit.write_text(value)
        elif self._memory_max is not None and memory_bytes > self._memory_max:
            swap.write_text(value)  # v1: memsw >= limit at every step; raise memsw first
            limit.write_text(value)
        else:
            limit.write_text(value)
            swap.write_text(value)
        self._memory_max = int(memory_bytes)

    def oom_kills(self) -> int:
        """Processes the memory limit's OOM killer killed since ``begin_execution`` (0 without
        a memory cgroup)."""
        return self._oom_count() - self._oom_before

    def _oom_count(self) -> int:
        if self.memory_dir is None:
            return 0
        return _counter(self.memory_dir / _MEMORY_FILES[self.memory.version][2], "oom_kill")

    @property
    def can_run_inside(self) -> bool:
        """Whether ``run_inside`` can be tried (cgroup v1 with known mount points)."""
        return self.version == "v1" and self.mount is not None and (
            self.memory_dir is None or self.memory.mount is not None)

    def run_inside(self, fn: Callable[[], Any]) -> Any:
        """Calls ``fn()`` with the calling thread inside the cgroup, so that what it starts is
        born inside; the thread is back where it was when this returns or raises.

        Only the thread moves (no threadgroup lock: no grace-period wait), so no process is
        moved. ``pids.max`` is raised by one for the thread meanwhile and restored before
        returning; ``fn`` must not let a started process run untrusted code before that (hold it
        at a gate). With a (v1) memory cgroup the thread steps into it as well: what it starts
        is charged there once it has its own address space (the pages of the host stay charged
        to the host's cgroup, whose process owns them).

        Raises CgroupMoveError if the thread cannot step in (nothing changed and ``fn`` not
        called: the caller can start the process outside and move it); whatever ``fn`` raises;
        RuntimeError if the thread could not step back out (``fn``'s process is then started).
        """
        if not self.can_run_inside:
            raise CgroupMoveError(errno.EOPNOTSUPP, "only cgroup v1 lets a thread step in")
        home = _thread_cgroup(self.version)
        if home is None or self._max is None:
            raise CgroupMoveError(errno.ENOENT, "this thread's pids cgroup or the limit is unknown")
        home_dir = self.mount / home.lstrip("/")
        memory_home = self._memory_home()
        for d in (home_dir, memory_home):
            if d is not None and not os.access(d / "tasks", os.W_OK):  # could step in, not back
                raise CgroupMoveError(errno.EACCES, f"cannot move a thread back into {d}")
        limit = self._max
        try:
            self.set_max(limit + 1)
            _move_current_thread(self.path)
        except OSError as e:
            with contextlib.suppress(OSError):
                self.set_max(limit)
            raise CgroupMoveError(e.errno, f"cannot step into {self.path}: {e.strerror}") from e
        if memory_home is not None:
            try:
                _move_current_thread(self.memory_dir)
            except OSError as e:
                self._step_out(home_dir)
                self.set_max(limit)
                raise CgroupMoveError(
                    e.errno, f"cannot step into {self.memory_dir}: {e.strerror}") from e
        try:
            return fn()
        finally:
            try:
                if memory_home is not None:
                    self._step_out(memory_home, self.memory.mount)
            finally:
                self._step_out(home_dir)
                self.set_max(limit)

    def _memory_home(self) -> Optional[pathlib.Path]:
        """The calling thread's own v1 memory cgroup dir (None without a memory cgroup)."""
        if self.memory_dir is None:
            return None
        home = _thread_cgroup("v1", "memory")
        if home is None:
            raise CgroupMoveError(errno.ENOENT, "this thread's memory cgroup is unknown")
        return self.memory.mount / home.lstrip("/")

    def _step_out(self, home_dir: pathlib.Path, root: Optional[pathlib.Path] = None) -> None:
        errors = []
        for target in (home_dir, root or self.mount):
            try:
                _move_current_thread(target)
                return
            except OSError as e:
                errors.append(f"{target}: {e}")
        raise RuntimeError(f"the host thread could not leave {self.path}: {errors}")

    def _events_max(self) -> int:
        try:
            for line in (self.path / "pids.events").read_text().splitlines():
                key, _, value = line.partition(" ")
                if key == "max":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def begin_execution(self) -> None:
        """Marks the start of an execution: ``limit_hits`` and ``oom_kills`` count from here (a
        reused cgroup)."""
        self._hits_before = self._events_max()
        self._oom_before = self._oom_count()

    def limit_hits(self) -> int:
        """How many fork()/clone() calls the pid limit refused since ``begin_execution``."""
        return self._events_max() - self._hits_before

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
        delay = 0.0002
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
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kills what is left and removes the cgroup directory (and its v1 memory cgroup)."""
        deadline = time.monotonic() + timeout_s
        self.kill_all(timeout_s=max(0.1, deadline - time.monotonic()))
        if self.memory_dir is not None and self.memory_dir != self.path:
            _rmdir_when_empty(self.memory_dir, deadline)
        _rmdir_when_empty(self.path, deadline, before=lambda: self.kill_all(
            timeout_s=max(0.1, deadline - time.monotonic())))


def _rmdir_when_empty(path: pathlib.Path, deadline: float,
                      before: Optional[Callable[[], Any]] = None) -> None:
    """Removes the cgroup dir ``path``, retrying while it is busy (a killed task not yet gone)
    until ``deadline`` (time.monotonic()); ``before`` runs before each try. Gone already: done."""
    while True:
        try:
            if before is not None:
                before()
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _remove_all(cgroups: list) -> None:
    """Removes (and empties) each cgroup in the list; one that stays busy is left to
    ``remove_owner``, which a later backend calls once this host is gone."""
    while cgroups:
        try:
            cgroups.pop().remove()
        except (OSError, TimeoutError):
            pass


class PidsCgroupParent:
    """The directory under which per-execution pids cgroups are made (``<own cgroup>/ace_sandbox``).

    Its cgroups are named ``run-<owner>-<id>``: ``owner`` is the token of the backend's
    ``OwnerLock`` (``sandbox.backends.owner``), by which a later backend finds and removes the
    cgroups of an owner that died (``remove_owner``); "" gives a random token with no lock file
    (cgroups nobody else will sweep).

    ``memory``: where the executions' memory cgroups go (None: none can be made here, and
    ``memory_reason`` says why); ``acquire(pids_max, memory_mb)`` then also limits the tree's
    memory.

    ``acquire`` / ``release`` hand out one cgroup per running execution and keep emptied ones
    for the next: making and removing a cgroup costs ~0.5 ms per execution here (mkdir, rmdir,
    and the kernel's offlining of the old one), reusing an empty one a few reads and at most
    one ``pids.max`` write. A cgroup is reused only when nothing is left in it, not even
    an unreaped task; ``limit_hits`` counts per execution (``begin_execution``). ``close``
    removes the idle ones.
    """

    def __init__(self, path: pathlib.Path, version: str, mount: Optional[pathlib.Path] = None,
                 max_idle: int = 16, owner: str = "",
                 memory: Optional[MemoryHierarchy] = None, memory_reason: str = ""):
        self.path = path
        self.owner = owner or uuid.uuid4().hex[:16]
        self.version = version
        self.mount = mount
        self.memory = memory
        self.memory_reason = "" if memory is not None else (
            memory_reason or "no memory hierarchy was given")
        self.max_idle = max_idle
        self._idle: list[PidsCgroup] = []
        self._lock = threading.Lock()
        weakref.finalize(self, _remove_all, self._idle)  # a parent dropped without close()

    @classmethod
    def detect(cls, parent_name: str = _DEFAULT_PARENT, owner: str = "", memory: bool = True
               ) -> tuple[Optional["PidsCgroupParent"], str]:
        """Returns (parent, "") if per-execution pids cgroups can be made here, else (None, reason).

        ``owner``: the token its cgroups are named by (see the class docstring). ``memory``: also
        look for a memory hierarchy (``detect_memory``); whether one was found is
        ``parent.memory`` (``parent.memory_reason`` says why not), not a reason to fail.
        """
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
        hierarchy, memory_reason = (detect_memory(parent, version, parent_name) if memory
                                    else (None, "not asked for (memory=False)"))
        if memory_reason:
            hierarchy = None
        return cls(parent, version, mount, owner=owner, memory=hierarchy,
                   memory_reason=memory_reason), ""

    def create(self, pids_max: int, memory_mb: Optional[int] = None) -> PidsCgroup:
        """A fresh child cgroup with ``pids.max = pids_max`` and, with a memory hierarchy and a
        ``memory_mb``, a memory limit of ``memory_mb`` MiB for the tree."""
        if pids_max <= 0:
            raise ValueError(f"pids_max must be positive, got {pids_max}")
        path = self.path / f"run-{self.owner}-{uuid.uuid4().hex[:12]}"
        path.mkdir()
        cgroup = PidsCgroup(path, self.version, self.mount, self.memory)
        try:
            if cgroup.memory_dir is not None and cgroup.memory_dir != path:
                cgroup.memory_dir.mkdir()
            cgroup.set_max(pids_max)
            self._limit_memory(cgroup, memory_mb)
        except (OSError, ValueError):
            _remove_all([cgroup])
            raise
        return cgroup

    def _limit_memory(self, cgroup: PidsCgroup, memory_mb: Optional[int]) -> None:
        if cgroup.memory_dir is not None and memory_mb is not None:
            if cgroup._memory_max != int(memory_mb) << 20:
                cgroup.set_memory_max(int(memory_mb) << 20)

    def acquire(self, pids_max: int, memory_mb: Optional[int] = None) -> PidsCgroup:
        """An empty cgroup with ``pids.max = pids_max`` (and a memory limit of ``memory_mb`` MiB
        where there is a memory hierarchy) for one execution: an idle one, else new."""
        with self._lock:
            cgroup = self._idle.pop() if self._idle else None
        if cgroup is None:
            cgroup = self.create(pids_max, memory_mb)
        else:
            try:
                if cgroup._max != int(pids_max):
                    cgroup.set_max(pids_max)
                self._limit_memory(cgroup, memory_mb)
            except (OSError, ValueError):
                _remove_all([cgroup])
                raise
        cgroup.begin_execution()
        return cgroup

    def release(self, cgroup: PidsCgroup) -> None:
        """Ends an execution's use of ``cgroup``: kills what is left, then keeps it for reuse if
        nothing is charged to it any more, else removes it (a killed task stays charged until it
        is reaped, e.g. an orphan whose new parent, the host's init, reaps lazily)."""
        try:
            cgroup.kill_all(timeout_s=1.0)  # returns once cgroup.procs is empty
            if cgroup.current() == 0:
                with self._lock:
                    if len(self._idle) < self.max_idle:
                        self._idle.append(cgroup)
                        return
        except (OSError, TimeoutError):
            pass
        _remove_all([cgroup])

    def close(self) -> None:
        """Removes the idle cgroups (one still in use is removed when released)."""
        with self._lock:
            _remove_all(self._idle)
            self.max_idle = 0

    def remove_owner(self, owner: str, timeout_s: float = 1.0) -> bool:
        """Kills what is left in the cgroups of ``owner`` (a dead host: nothing supervises its
        executions any more) and removes them. True once none is left; a cgroup that stays busy
        (a task not reaped yet) is left for a later call.
        """
        prefix = f"run-{owner}-"
        try:
            paths = [pathlib.Path(e.path) for e in os.scandir(self.path)
                     if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
        except OSError:
            return True  # no parent dir: none of its cgroups is left
        for path in paths:
            with contextlib.suppress(OSError, TimeoutError):
                PidsCgroup(path, self.version, self.mount, self.memory).remove(timeout_s=timeout_s)
        left = [p for p in paths if p.exists()]
        if self.memory is not None and self.memory.version == "v1":
            left += self._remove_owner_memory(prefix, timeout_s)
        return not left

    def _remove_owner_memory(self, prefix: str, timeout_s: float) -> list[pathlib.Path]:
        """Removes the v1 memory cgroups named ``prefix*`` (their processes were killed with the
        pids cgroups); returns those left."""
        try:
            paths = [pathlib.Path(e.path) for e in os.scandir(self.memory.parent)
                     if e.name.startswith(prefix) and e.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        for path in paths:
            with contextlib.suppress(OSError):
                _rmdir_when_empty(path, time.monotonic() + timeout_s)
        return [p for p in paths if p.exists()]
