"""What every isolation backend shares: limits, the raw outcome record, bounded capture, workdirs.

A backend runs one script for one task and returns a ``RawExecution`` (what happened to the
process). It does not grade: ``sandbox.pool`` turns a ``RawExecution`` into an
``ExecutionResult`` (status, grading, metric parsing) the same way for every backend.

The task contract (duck-typed, see ``sandbox/tasks``): ``task_id: str``, ``public_dir: Path``,
``time_limit_s: float``, ``memory_limit_mb: int``, ``hidden_paths: tuple[str, ...]``,
``grade(submission_csv: Path, split: str) -> float``.
"""
from __future__ import annotations

import abc
import contextlib
import dataclasses
import math
import os
import pathlib
import shutil
import stat
import tempfile
import threading
from typing import Any, Optional


class SandboxUnavailableError(RuntimeError):
    """The requested isolation backend cannot run on this host; the message says how to fix it."""


class SandboxSetupError(RuntimeError):
    """The sandbox could not be prepared for one execution (workdir, input copy, spawn)."""


class SandboxConfigError(ValueError):
    """A sandbox setting cannot work as given; the message names the setting and how to fix it."""


class IsolationRequiredError(SandboxConfigError):
    """A task that needs an isolating backend (``task.requires_isolation``: its private answers
    lie on the host) was given to a backend without isolation, which was not explicitly allowed."""


SUBMISSION_RELPATH = pathlib.Path("submission") / "submission.csv"
SCRIPT_NAME = "solution.py"
# What runs the script, in every backend that can bind it: ``python -s -P -u runner.py run
# solution.py`` (``-I`` less ``-E``, so that the ``PYTHONHASHSEED=0`` of the scrubbed
# environment holds). See ``sandbox.runner``: it seeds the RNGs and prints Python's traceback.
RUNNER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runner.py")
PYTHON_FLAGS = ("-s", "-P", "-u")


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits: a backend's (``backend.limits``) and one execution's (``task_limits``).

    Every value a backend's limits show is applied as shown; ``time_s`` and ``memory_mb`` are
    None there (the default): each execution takes them from its task.

    Attributes:
      time_s: wall-clock budget in seconds; then SIGTERM to everything, ``grace_s``, SIGKILL.
        None: each task's ``time_limit_s``.
      memory_mb: memory budget in MiB: the address-space limit (RLIMIT_AS) of each process, and
        the memory cgroup limit of the whole process tree where the host has one
        (``sandbox.backends.cgroup``); docker: the container's limit. None: each task's
        ``memory_limit_mb``.
      max_time_s: a cap on the wall-clock budget, in seconds: an execution gets
        min(time budget, max_time_s); 0 = no cap.
      max_memory_mb: a cap on the memory budget, in MiB: an execution gets
        min(memory budget, max_memory_mb); 0 = no cap.
      cpu_factor: RLIMIT_CPU = ceil(time_s * cpu_factor) + 1 CPU-seconds per process.
      pids_max: most processes/threads alive at once (cgroup pids.max, or RLIMIT_NPROC).
      file_size_mb: largest single file a process may write (RLIMIT_FSIZE), MiB.
      disk_mb: most bytes (allocated blocks) the working dir may hold, MiB; polled.
      open_files: RLIMIT_NOFILE.
      grace_s: seconds between SIGTERM and SIGKILL on timeout.
    """

    time_s: Optional[float] = None
    memory_mb: Optional[int] = None
    max_time_s: float = 0.0
    max_memory_mb: int = 0
    cpu_factor: float = 2.0
    pids_max: int = 64
    file_size_mb: int = 256
    disk_mb: int = 1024
    open_files: int = 256
    grace_s: float = 1.0

    def __post_init__(self):
        for name in ("time_s", "memory_mb", "cpu_factor", "pids_max", "file_size_mb", "disk_mb",
                     "open_files"):
            value = getattr(self, name)
            if value is None and name in ("time_s", "memory_mb"):
                continue
            if not _is_finite_number(value) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive finite number, got {value!r}")
        for name in ("max_time_s", "max_memory_mb", "grace_s"):
            value = getattr(self, name)
            if not _is_finite_number(value) or value < 0:
                raise ValueError(f"Limits.{name} must be a finite number >= 0, got {value!r}")


def _is_finite_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and math.isfinite(value))


@dataclasses.dataclass
class RawExecution:
    """What happened to the process tree of one execution (before grading).

    Attributes:
      exit_code: exit status of the script (negative: killed by that signal); None if not started.
      wall_s: seconds from spawn to the end of the main process (or the kill).
      cpu_s: CPU seconds (user + system) of the script and the processes it waited for; None
        when unknown (docker).
      peak_memory_mb: peak RSS in MiB of the process tree (best effort), None if too short to see.
      stdout, stderr: bounded head + tail of each stream.
      timed_out: the wall-clock deadline passed and the tree was killed.
      cpu_limit_hit: killed by RLIMIT_CPU (SIGXCPU at the soft limit, or SIGKILL at the hard
        one, which is all a PID-namespace init such as the script under bwrap receives).
      disk_limit_hit: the working dir grew past ``Limits.disk_mb`` and the tree was killed.
      oom_killed: the memory limit killed the process (cgroup/docker OOM kill).
      cancelled: the pool was closed while this ran; the tree was killed.
      submission: a private host copy of ./submission/submission.csv (regular file only), or None.
      submission_error: why a present submission was not copied (symlink, too large, ...), or "".
      leftovers_killed: processes of the execution other than the script that the sandbox killed:
        alive when the script ended, or when the sandbox killed it (timeout, disk limit, cancel).
      notes: extra facts worth showing (e.g. "pid limit (64) refused 812 new processes or
        threads").
      workdir: the kept working dir (only with ``keep=True``), else None.
      error: setup failure message ("" if the sandbox itself worked).
    """

    exit_code: Optional[int] = None
    wall_s: float = 0.0
    cpu_s: Optional[float] = None
    peak_memory_mb: Optional[float] = None
    stdout: str = ""
    stderr: str = ""
    timed_out: bool = False
    cpu_limit_hit: bool = False
    disk_limit_hit: bool = False
    oom_killed: bool = False
    cancelled: bool = False
    submission: Optional[pathlib.Path] = None
    submission_error: str = ""
    leftovers_killed: int = 0
    notes: list = dataclasses.field(default_factory=list)
    workdir: Optional[pathlib.Path] = None
    error: str = ""


class BoundedCapture:
    """Keeps the first ``head_bytes`` and the last ``tail_bytes`` of a byte stream; counts the rest.

    Memory stays O(head + tail) however much the process prints.
    """

    def __init__(self, head_bytes: int = 4096, tail_bytes: int = 4096):
        if head_bytes < 0 or tail_bytes < 0:
            raise ValueError("head_bytes and tail_bytes must be >= 0")
        self.head_bytes, self.tail_bytes = head_bytes, tail_bytes
        self._head = bytearray()
        self._tail = bytearray()
        self.total = 0

    def feed(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_bytes - len(self._head)
        if room > 0:
            self._head += data[:room]
            data = data[room:]
        if data and self.tail_bytes:
            self._tail += data
            if len(self._tail) > self.tail_bytes:
                del self._tail[: len(self._tail) - self.tail_bytes]

    @property
    def omitted(self) -> int:
        return self.total - len(self._head) - len(self._tail)

    def text(self) -> str:
        head = self._head.decode("utf-8", errors="replace")
        tail = self._tail.decode("utf-8", errors="replace")
        if self.omitted > 0:
            return f"{head}\n...[{self.omitted} bytes omitted]...\n{tail}"
        return head + tail


def prepare_workdir(root: pathlib.Path, code: str, owner: str) -> pathlib.Path:
    """Creates a fresh ``<root>/run-<owner>-XXXX`` with solution.py, working/, submission/, tmp/,
    input/. ``owner`` is the token of the backend's ``OwnerLock`` (``sandbox.backends.owner``).

    ``input/`` is left empty: the backend fills it (copy) or mounts over it (bind).
    """
    root = pathlib.Path(root)
    root.mkdir(parents=True, exist_ok=True)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix=f"run-{owner}-", dir=root))
    os.chmod(workdir, 0o755)
    for sub in ("input", "working", "submission", "tmp"):
        (workdir / sub).mkdir()
    (workdir / SCRIPT_NAME).write_text(code, encoding="utf-8")
    return workdir


RAM_FILE_SYSTEMS = ("tmpfs", "ramfs")


def ram_backed(path: os.PathLike) -> bool:
    """Whether files under ``path`` (or its nearest existing parent) are held in RAM: the file
    system of its mount (the longest mount point that contains it) is tmpfs or ramfs."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                pre, _, post = line.partition(" - ")
                fields, post_fields = pre.split(), post.split()
                if len(fields) < 5 or not post_fields:
                    continue
                point = fields[4].replace("\\040", " ")
                if (real == point or real.startswith(point.rstrip("/") + "/")) and \
                        len(point) >= len(best):
                    best, fstype = point, post_fields[0]
    except OSError:
        return False
    return fstype in RAM_FILE_SYSTEMS


def remove_owner_workdirs(root: pathlib.Path, owner: str) -> bool:
    """Removes every ``<root>/run-<owner>-*`` working dir (those of a dead owner: they would
    otherwise hold disk, RAM on /dev/shm, until reboot). True once none is left."""
    prefix = f"run-{owner}-"
    try:
        entries = [e for e in os.scandir(root) if e.name.startswith(prefix)]
    except OSError:
        return True  # no root dir: nothing of it is left
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            remove_workdir(pathlib.Path(entry.path))
        else:
            with contextlib.suppress(OSError):
                os.unlink(entry.path)
    return not any(os.path.lexists(e.path) for e in entries)


def copy_input_readonly(public_dir: pathlib.Path, dest: pathlib.Path) -> None:
    """Copies ``public_dir`` into ``dest`` (an existing empty dir) and makes the copy read-only.

    Read-only modes stop a non-root process; root ignores them (see the process backend notes).
    The task's own public dir is never exposed, so it cannot be modified through the copy.
    """
    public_dir = pathlib.Path(public_dir)
    if not public_dir.is_dir():
        raise SandboxSetupError(f"task public_dir {public_dir} is not a directory")
    shutil.copytree(public_dir, dest, symlinks=False, dirs_exist_ok=True)
    for dirpath, dirnames, filenames in os.walk(dest, topdown=False):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o444)
        os.chmod(dirpath, 0o555)


def remove_workdir(workdir: pathlib.Path) -> None:
    """Deletes a workdir, first restoring write permission on read-only parts (the input copy)."""

    def _onerror(func, path, exc_info):
        try:
            os.chmod(os.path.dirname(path), 0o755)
            os.chmod(path, 0o755)
        except OSError:
            pass
        try:
            func(path)
        except OSError:
            pass

    for dirpath, dirnames, _ in os.walk(workdir):
        for name in dirnames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                try:
                    os.chmod(p, 0o755)
                except OSError:
                    pass
    shutil.rmtree(workdir, onerror=_onerror)


def dir_usage_bytes(path: pathlib.Path, stop_above: int) -> int:
    """Allocated bytes (st_blocks * 512) under ``path``; stops counting once above ``stop_above``."""
    total = 0
    stack = [os.fspath(path)]
    while stack:
        current = stack.pop()
        try:
            with os.scandir(current) as it:
                for entry in it:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    total += getattr(st, "st_blocks", 0) * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
                    if total > stop_above:
                        return total
        except OSError:
            continue
    return total


def collect_submission(workdir: pathlib.Path, max_bytes: int) -> tuple[Optional[pathlib.Path], str]:
    """Copies ./submission/submission.csv out of the workdir without following symlinks.

    A symlink (e.g. to the private answers, which the host could read) or a non-regular file is
    refused. Returns (host copy path or None, reason it was refused or "").
    """
    sub_dir = os.path.join(workdir, "submission")
    try:
        dir_fd = os.open(sub_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        return None, f"./submission is not a plain directory ({e.strerror})"
    try:
        try:
            fd = os.open("submission.csv", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except FileNotFoundError:
            return None, ""
        except OSError as e:
            return None, f"submission.csv could not be opened safely ({e.strerror}; symlinks are refused)"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return None, "submission.csv is not a regular file"
            if st.st_size > max_bytes:
                return None, f"submission.csv is {st.st_size} bytes, over the {max_bytes}-byte limit"
            out_fd, out_path = tempfile.mkstemp(prefix="submission-", suffix=".csv")
            with os.fdopen(out_fd, "wb") as out, os.fdopen(os.dup(fd), "rb") as src:
                shutil.copyfileobj(src, out, length=1 << 20)
            return pathlib.Path(out_path), ""
        finally:
            os.close(fd)
    finally:
        os.close(dir_fd)


def task_limits(task: Any, limits: Limits) -> Limits:
    """The limits one execution of ``task`` runs under: ``limits`` (a backend's), with the task's
    time and memory budget where they are None, the time capped at ``limits.max_time_s`` and the
    memory at ``limits.max_memory_mb``.

    Raises:
      TypeError: the task has no budget attribute. ValueError: its budget is not a positive
        finite number.
    """
    try:
        time_s = float(task.time_limit_s) if limits.time_s is None else limits.time_s
        memory_mb = int(task.memory_limit_mb) if limits.memory_mb is None else limits.memory_mb
    except AttributeError as e:
        raise TypeError(f"task {task!r} lacks a budget attribute: {e}") from None
    if limits.max_time_s and time_s > limits.max_time_s:
        time_s = limits.max_time_s
    if limits.max_memory_mb and memory_mb > limits.max_memory_mb:
        memory_mb = int(limits.max_memory_mb)
    return dataclasses.replace(limits, time_s=time_s, memory_mb=memory_mb)


def requires_isolation(task: Any) -> bool:
    """Whether ``task`` must only run in an isolating backend (``task.requires_isolation``; a
    task without the attribute does not)."""
    return bool(getattr(task, "requires_isolation", False))


UNISOLATED_HINT = (
    "the process backend does not isolate: generated code could read the task's private answers "
    "(MLE-bench's prepared/private) and use the network. Make bubblewrap work (on Ubuntu >= 23.10 "
    "and 24.04 images: `sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0`, then "
    "`python -c \"from sandbox.backends import bwrap; print(bwrap.bwrap_available())\"` says "
    "True) and use sandbox.backend=bwrap, or accept the risk explicitly with "
    "sandbox.allow_unisolated=True")


class Backend(abc.ABC):
    """One isolation strategy. ``execute`` must be thread-safe: the pool calls it concurrently.

    ``limits``: the backend's limits (time and memory None: each task's). ``isolated``: whether
    the script is kept from the host's files and the network (bwrap, docker); a backend that is
    not refuses tasks that require isolation (``check_task``) unless ``allow_unisolated``.
    """

    name: str = "abstract"
    limits: Limits = Limits()  # a backend's own; each execution's: ``task_limits``
    isolated: bool = True
    allow_unisolated: bool = False

    def check_task(self, task: Any) -> None:
        """Raises IsolationRequiredError if this backend may not run ``task``."""
        if requires_isolation(task) and not (self.isolated or self.allow_unisolated):
            raise IsolationRequiredError(
                f"task {getattr(task, 'task_id', task)!r} requires an isolating sandbox backend, "
                f"and this one is {self.name!r}: {UNISOLATED_HINT}")

    @abc.abstractmethod
    def execute(self, task: Any, code: str, *, cancel: Optional[threading.Event] = None) -> RawExecution:
        """Runs ``code`` as ./solution.py for ``task``; never leaves a process behind.

        Raises SandboxSetupError (or any exception) only if the sandbox itself failed; the
        pool turns that into status sandbox_error.
        """

    def ram_per_execution_mb(self, memory_mb: int) -> dict[str, int]:
        """The most RAM one execution with a memory budget of ``memory_mb`` MiB may hold, by
        part, in MiB (``{"memory": memory_mb}`` here; backends add their RAM-backed dirs)."""
        return {"memory": int(memory_mb)}

    def resident_ram_mb(self) -> dict[str, int]:
        """RAM the backend may hold between executions, by part, in MiB (none here)."""
        return {}

    def close(self) -> None:
        """Releases backend resources (nothing by default)."""
