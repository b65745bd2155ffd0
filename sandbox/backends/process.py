"""Process backend: one fresh working dir and one supervised process tree per execution.

Layout of a run (``<root_dir>/run-<owner>-XXXX``, deleted afterwards unless ``keep=True``;
``<owner>`` is the backend's ``OwnerLock`` token, by which a later backend sweeps the dirs and
cgroups of a host that died mid-execution, see ``sandbox.backends.owner``)::

    solution.py      the agent's code, run by ``sandbox/runner.py`` (``python -s -P -u runner.py run
                     solution.py``, with the ``python`` interpreter: the trainer's by default, or
                     the sandbox's own environment, ``sandbox.backends.interpreter``; it seeds the
                     RNGs, see sandbox.runner)
    input/           a read-only copy of ``task.public_dir``
    working/         scratch space
    submission/      where ./submission/submission.csv must be written
    tmp/             TMPDIR

What it enforces:
  * its own process group, stdin at EOF (an empty closed pipe), a scrubbed
    environment (PATH, HOME=workdir, LANG, TMPDIR, OMP/OPENBLAS/MKL/... = ``threads``, a run
    marker, plus ``extra_env``);
  * rlimits, set with ``prlimit`` while the child waits at a gate before exec (see ``_spawn``):
    RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE (one file), RLIMIT_CORE=0, RLIMIT_NOFILE;
  * the memory of the whole process tree: the same per-execution cgroup, with the memory
    controller where the host has a usable one (``sandbox.backends.cgroup``; a tree past its
    budget is OOM-killed and reported as a memory error); else (logged once) RLIMIT_AS per
    process is all that holds, and a tree of N processes may use N times the budget;
  * the process count: a per-execution cgroup ``pids.max`` when the host allows it
    (``sandbox.backends.cgroup``; on cgroup v1 the script is born in it: the host thread steps
    into the cgroup to start it, much cheaper than moving a process), else RLIMIT_NPROC, which
    the kernel enforces only for non-root users and counts over the whole uid (so it is set to
    the uid's current count plus ``pids_max``); as root without a cgroup nothing caps it but
    the wall-clock kill;
  * a wall-clock deadline: SIGTERM to the group (and the cgroup), ``grace_s``, then SIGKILL;
  * after the main process ends, everything left is killed: its process group, its cgroup, and
    any process carrying the run marker in its environment (daemons that called setsid; a
    daemon that also clears its environment escapes this last net unless the cgroup holds it);
  * the working dir is polled against ``disk_mb`` and the tree killed past it;
  * stdout/stderr are read through pipes into head+tail buffers, so printing cannot exhaust
    host memory or disk.

What it does NOT enforce (use the bwrap backend, the default isolation, for these):
  * network: nothing stops a connection here (no namespace);
  * visibility: the script can read any host file its uid can read, including
    ``task.hidden_paths`` (e.g. the sklearn dataset the task was built from) and private answers;
  * the host's own processes: a script running as the host uid can signal its parent (the pool)
    or any other process of that uid; as root it can write anywhere, including outside the workdir.
  Run it only on code you trust, or with bwrap. Tasks that say they need isolation
  (``task.requires_isolation``: MLE-bench's, whose private answers lie on the host) are refused
  (``IsolationRequiredError``) unless ``allow_unisolated=True``.
"""
from __future__ import annotations

import os
import pathlib
import resource
import selectors
import signal
import logging
import subprocess
import tempfile
import threading
import time
import uuid
from typing import Any, Iterable, Mapping, Optional

from sandbox.backends import base, interpreter
from sandbox.backends.cgroup import CgroupMoveError, PidsCgroup, PidsCgroupParent
from sandbox.backends.owner import OwnerLock, sweep_dead_owners
from sandbox.backends import supervise as supervise_lib
from sandbox.backends.supervise import MARKER_ENV

log = logging.getLogger("sandbox.backends")
_WARNED: set = set()  # reasons already logged (once per process)

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS")


def default_root_dir(disk_mb: int = 1024) -> pathlib.Path:
    """Where working dirs are made unless ``root_dir`` is given.

    ``/dev/shm/ace_sandbox`` when /dev/shm is a writable RAM file system with at least
    4 x ``disk_mb`` free (making and deleting a run dir there takes ~0.1 ms, against ~20 ms on
    this host's ext4 mounted with ``discard``); else ``$TMPDIR/ace_sandbox``. A run dir on
    /dev/shm holds RAM, at most ``Limits.disk_mb`` per execution (polled).
    """
    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
        if os.access(shm, os.W_OK) and st.f_bavail * st.f_frsize >= 4 * (int(disk_mb) << 20):
            return pathlib.Path(shm) / "ace_sandbox"
    except OSError:
        pass
    return pathlib.Path(tempfile.gettempdir()) / "ace_sandbox"


def owner_lock(root_dir: pathlib.Path) -> OwnerLock:
    """This backend's ``OwnerLock`` on ``root_dir``; SandboxUnavailableError if it cannot be made."""
    try:
        return OwnerLock(root_dir)
    except OSError as e:
        raise base.SandboxUnavailableError(
            f"root_dir {os.fspath(root_dir)!r} cannot hold the working dirs: {e}") from e


class ProcessBackend(base.Backend):
    """Runs each execution as a supervised host process tree. See the module docstring.

    Args:
      root_dir: parent of the per-execution working dirs (default: ``default_root_dir()``).
      keep: keep working dirs after the run (for debugging); the path is in ``RawExecution.workdir``.
      limits: defaults for everything but time/memory, which come from each task.
      threads: value of OMP/OPENBLAS/MKL/... thread-count variables in the sandbox.
      use_cgroup: "auto" (a pids cgroup when the host allows it, with the memory controller
        where the host allows that too), True (require the pids cgroup), False (neither).
      output_head_bytes, output_tail_bytes: how much of each stream is kept.
      submission_max_mb: a larger submission.csv is refused (not copied out).
      extra_env: more environment variables for the script.
      python: the interpreter of the executions (default: this one, the trainer's); e.g. the
        ``bin/python`` of the sandbox's own venv (``scripts/build_sandbox_env.sh``). Python >= 3.11.
      disk_poll_s: how often the working dir size is checked.
      allow_unisolated: run tasks that require isolation (``task.requires_isolation``) anyway.

    Raises:
      SandboxConfigError: ``python`` does not exist or is not a Python >= 3.11.
      SandboxUnavailableError: ``root_dir`` cannot hold the working dirs, or ``use_cgroup=True``
        and no pids cgroup can be made.

    Working dirs and cgroups are named by ``owner.token`` (an ``OwnerLock`` on ``root_dir``, held
    until ``close()``); what dead owners left there is removed when a backend is made.
    """

    name = "process"
    isolated = False

    def __init__(self, *, root_dir: Optional[os.PathLike] = None, keep: bool = False,
                 limits: Optional[base.Limits] = None, threads: int = 1,
                 use_cgroup: Any = "auto", output_head_bytes: int = 4096,
                 output_tail_bytes: int = 4096, submission_max_mb: int = 256,
                 extra_env: Optional[Mapping[str, str]] = None, python: Optional[str] = None,
                 disk_poll_s: float = 0.25, allow_unisolated: bool = False):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        if use_cgroup not in ("auto", True, False):
            raise ValueError(f"use_cgroup must be 'auto', True or False, got {use_cgroup!r}")
        self.limits = limits or base.Limits()
        self.root_dir = (pathlib.Path(root_dir) if root_dir is not None
                         else default_root_dir(self.limits.disk_mb))
        self.keep = keep
        self.threads = threads
        self.output_head_bytes, self.output_tail_bytes = output_head_bytes, output_tail_bytes
        self.submission_max_bytes = int(submission_max_mb) << 20
        self.extra_env = dict(extra_env or {})
        self.interpreter = interpreter.probe(python)
        self.python = self.interpreter.executable
        self.allow_unisolated = bool(allow_unisolated)
        self.disk_poll_s = disk_poll_s
        self.owner = owner_lock(self.root_dir)
        self.cgroup_parent: Optional[PidsCgroupParent] = None
        self.cgroup_reason = "disabled (use_cgroup=False)"
        if use_cgroup:
            self.cgroup_parent, self.cgroup_reason = PidsCgroupParent.detect(
                owner=self.owner.token)
            if self.cgroup_parent is None and use_cgroup is True:
                self.owner.release()
                raise base.SandboxUnavailableError(
                    f"use_cgroup=True but no pids cgroup can be made: {self.cgroup_reason}")
        if use_cgroup and self.memory_cgroup_reason:
            _warn_once(f"sandbox: no per-execution memory cgroup ({self.memory_cgroup_reason}); "
                       "each process's memory is bounded by RLIMIT_AS only, so a script's "
                       "process tree may use a multiple of its task's memory limit")
        sweep_dead_owners(self.root_dir, self._remove_dead_owner)  # hosts killed mid-execution

    @property
    def memory_cgroup_reason(self) -> str:
        """Why the executions' process trees have no memory cgroup ("" when they have one)."""
        if self.cgroup_parent is None:
            return f"no pids cgroup either: {self.cgroup_reason}"
        return self.cgroup_parent.memory_reason

    def ram_per_execution_mb(self, memory_mb: int) -> dict[str, int]:
        """The memory budget, plus the working dir's ``disk_mb`` when ``root_dir`` is on a RAM
        file system (/dev/shm, ``default_root_dir``'s first choice). MiB."""
        parts = super().ram_per_execution_mb(memory_mb)
        if base.ram_backed(self.root_dir):
            parts[f"working dir in RAM ({self.root_dir})"] = int(self.limits.disk_mb)
        return parts

    # ----------------------------------------------------------------------------------------
    # Hooks the bwrap backend overrides (it is this backend plus a command prefix).

    def _prepare_input(self, task: Any, workdir: pathlib.Path) -> None:
        base.copy_input_readonly(pathlib.Path(task.public_dir), workdir / "input")

    # Backends that report their own setup failures on a pipe (bwrap's --json-status-fd).
    uses_status_fd = False

    def _command(self, task: Any, workdir: pathlib.Path, limits: base.Limits,
                 status_fd: Optional[int] = None) -> list[str]:
        return [self.python, *base.PYTHON_FLAGS, base.RUNNER, "run", base.SCRIPT_NAME]

    def _setup_failure(self, status: bytes, raw: base.RawExecution) -> str:
        """Reason the sandbox itself failed to start the script, from the status pipe ("" if ok)."""
        return ""

    def _gate(self, cmd: list[str], gate_r: int) -> tuple[list[str], Any, tuple[int, ...]]:
        """(argv, stdin, fds to pass): ``cmd`` made to wait until a byte arrives on ``gate_r``.

        Here a shell in front of it, ``/bin/sh -c 'read -r _ && exec "$@"'``, with the gate as
        its stdin: once open the pipe is at EOF, which is the script's stdin. At EOF without a
        line (the host gave up) it exits 125 without running anything.
        """
        return (["/bin/sh", "-c", 'read -r _ || exit 125; exec "$@"', "sandbox-gate"] + cmd,
                gate_r, ())

    def _confined_pid(self, proc: subprocess.Popen,
                      status: Optional["supervise_lib.StatusPipe"]) -> Optional[int]:
        """The waiting process whose rlimits the script will inherit (None: it already died)."""
        return proc.pid

    def _sandbox_home_and_tmp(self, workdir: pathlib.Path) -> tuple[str, str]:
        return os.fspath(workdir), os.fspath(workdir / "tmp")

    def _translate_exit(self, code: int) -> int:
        return code

    # ----------------------------------------------------------------------------------------

    def _remove_dead_owner(self, token: str) -> bool:
        """Removes the working dirs and (with a cgroup parent) the cgroups of a dead owner."""
        done = base.remove_owner_workdirs(self.root_dir, token)
        if self.cgroup_parent is not None:
            done = self.cgroup_parent.remove_owner(token) and done
        return done

    def environment(self, workdir: pathlib.Path, marker: str) -> dict[str, str]:
        """The complete environment of the script (nothing is inherited from the host)."""
        home, tmp = self._sandbox_home_and_tmp(workdir)
        env = {
            "PATH": os.pathsep.join(
                [os.path.dirname(self.python), "/usr/local/bin", "/usr/bin", "/bin"]),
            "HOME": home,
            "TMPDIR": tmp,
            "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0",  # with sandbox.runner's seeds: the same code, the same score
            MARKER_ENV: marker,
        }
        for var in THREAD_VARS:
            env[var] = str(self.threads)
        env.update(self.extra_env)
        return env

    def execute(self, task: Any, code: str, *,
                cancel: Optional[threading.Event] = None) -> base.RawExecution:
        self.check_task(task)
        limits = base.task_limits(task, self.limits)
        workdir = base.prepare_workdir(self.root_dir, code, self.owner.token)
        cgroup: Optional[PidsCgroup] = None
        try:
            self._prepare_input(task, workdir)
            if self.cgroup_parent is not None:
                cgroup = self.cgroup_parent.acquire(limits.pids_max, limits.memory_mb)
            raw = self._run(task, workdir, limits, cgroup, cancel)
            if raw.exit_code is not None and not (raw.timed_out or raw.cancelled or raw.error):
                raw.submission, raw.submission_error = base.collect_submission(
                    workdir, self.submission_max_bytes)
            return raw
        finally:
            if cgroup is not None:
                self.cgroup_parent.release(cgroup)
            if not self.keep:
                base.remove_workdir(workdir)

    def close(self) -> None:
        """Removes the idle pids cgroups kept for reuse and gives up the owner lock."""
        if self.cgroup_parent is not None:
            self.cgroup_parent.close()
        self.owner.release()

    # ----------------------------------------------------------------------------------------

    def _rlimits(self, limits: base.Limits,
                 cgroup: Optional[PidsCgroup]) -> list[tuple[int, tuple[int, int]]]:
        """(resource, (soft, hard)) pairs applied to the gated child before it may exec."""
        cpu = supervise_lib.cpu_limit_s(limits)
        out = [
            (resource.RLIMIT_AS, (int(limits.memory_mb) << 20,) * 2),
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_FSIZE, (int(limits.file_size_mb) << 20,) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
            (resource.RLIMIT_NOFILE, (int(limits.open_files),) * 2),
        ]
        if cgroup is None and os.getuid() != 0:
            nproc = supervise_lib.uid_task_count(os.getuid()) + int(limits.pids_max)
            out.append((resource.RLIMIT_NPROC, (nproc, nproc)))
        return out

    def _spawn(self, cmd: list[str], workdir: pathlib.Path, env: dict[str, str],
               limits: base.Limits, cgroup: Optional[PidsCgroup],
               status: Optional["supervise_lib.StatusPipe"] = None, pass_fds: tuple = ()
               ) -> tuple[subprocess.Popen, Optional[int]]:
        """Starts ``cmd`` behind a gate (``_gate``), confines it, then opens the gate.

        Returns the started process and the pid that execs the script (``_confined_pid``: the
        same process here, bwrap's namespace child under bwrap; None if it died first).

        The started process waits at the gate until the host has set the rlimits of the process
        that will exec the script (``_confined_pid``; ``prlimit``) and put it in the cgroup; the
        script inherits both. No ``preexec_fn``: CPython can then use vfork, so spawning does
        not copy the host's page tables (fork+preexec from a 1.5 GB host took ~200 ms here) and
        no Python code runs in a forked child of a multi-threaded host.

        With a cgroup, the process is started from inside it (``PidsCgroup.run_inside``: this
        thread steps in and out; cgroup v1), so it is born there; where that is not possible it
        is started outside and moved in (``cgroup.procs``, ~6-15 ms here) before the gate opens.
        """
        gate_r, gate_w = os.pipe()
        argv, stdin, gate_fds = self._gate(cmd, gate_r)
        started: list[subprocess.Popen] = []

        def start() -> subprocess.Popen:
            started.append(subprocess.Popen(
                argv, cwd=workdir, env=env, stdin=stdin, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, process_group=0, close_fds=True,
                pass_fds=tuple(pass_fds) + gate_fds))
            return started[-1]

        born_inside = False
        try:
            if cgroup is not None and cgroup.can_run_inside:
                try:
                    cgroup.run_inside(start)
                    born_inside = True
                except CgroupMoveError:
                    pass  # start it outside and move it in below
            if not started:
                start()
        except (OSError, subprocess.SubprocessError, RuntimeError) as e:
            if started:
                supervise_lib.abort(started[0], gate_w)
            else:
                os.close(gate_w)
            raise base.SandboxSetupError(f"could not start {cmd[0]}: {e}") from e
        finally:
            os.close(gate_r)
        proc = started[0]
        target = None
        try:
            target = self._confined_pid(proc, status)
            try:
                self._confine(proc.pid, target, limits, cgroup, move=not born_inside)
                os.write(gate_w, b"go\n")
            except (ProcessLookupError, BrokenPipeError):
                # One of them died in its own setup (bwrap: a mount failed) before the gate
                # opened. Kill the rest before the gate closes (a waiter reads EOF there and
                # goes on) and let the run end: the exit status and stderr say why.
                supervise_lib.kill_gated(proc.pid, target)
        except BaseException as e:  # never leave it waiting at the gate
            supervise_lib.abort(proc, gate_w, target)
            if isinstance(e, (OSError, ValueError)):
                raise base.SandboxSetupError(f"could not confine the sandbox process: {e}") from e
            raise
        os.close(gate_w)
        return proc, target

    def _confine(self, started: int, target: Optional[int], limits: base.Limits,
                 cgroup: Optional[PidsCgroup], move: bool) -> None:
        """Sets the rlimits of ``target`` (the pid that will exec the script) and, with ``move``,
        moves ``started`` and ``target`` into ``cgroup``. ProcessLookupError: one has died."""
        if target is not None:
            for res, value in self._rlimits(limits, cgroup):
                resource.prlimit(target, res, value)
        if cgroup is not None and move:
            for procs_file in cgroup.procs_files:
                for pid in dict.fromkeys((started, target)):
                    if pid is not None:
                        with open(procs_file, "w") as f:
                            f.write(str(pid))

    def _run(self, task: Any, workdir: pathlib.Path, limits: base.Limits,
             cgroup: Optional[PidsCgroup], cancel: Optional[threading.Event]) -> base.RawExecution:
        marker = uuid.uuid4().hex
        raw = base.RawExecution(workdir=workdir if self.keep else None)
        out = base.BoundedCapture(self.output_head_bytes, self.output_tail_bytes)
        err = base.BoundedCapture(self.output_head_bytes, self.output_tail_bytes)
        status = status_w = None
        if self.uses_status_fd:
            status_r, status_w = os.pipe()
            status = supervise_lib.StatusPipe(status_r)
        host_peak_kb = max(supervise_lib.status_memory_kb(os.getpid()))   # VmHWM >= VmRSS
        start = time.monotonic()
        try:
            cmd = self._command(task, workdir, limits, status_fd=status_w)
            proc, script_pid = self._spawn(
                cmd, workdir, self.environment(workdir, marker), limits, cgroup, status,
                pass_fds=(status_w,) if status_w is not None else ())
        except BaseException:
            if status is not None:
                os.close(status.fd)
            raise
        finally:
            if status_w is not None:
                os.close(status_w)
        pgid = proc.pid
        streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
        sel = selectors.DefaultSelector()
        pidfd = None
        kill_reason = None
        memory = supervise_lib.MemorySampler(proc.pid, cgroup, start)
        try:
            for fd in streams:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            pidfd = supervise_lib.pidfd_open(proc.pid)  # readable at exit: no polling
            if pidfd is not None:
                sel.register(pidfd, selectors.EVENT_READ)
            kill_reason = supervise_lib.supervise(
                sel, streams, lambda: supervise_lib.has_exited(proc.pid), start=start,
                limits=limits, disk_dir=workdir, disk_poll_s=self.disk_poll_s, memory=memory,
                cancel=cancel, max_wait=0.1 if pidfd is not None else 0.01)
            # The main process is a zombie (or still running): its pid still names the group,
            # so killing the group cannot hit a recycled pid.
            left = self._alive(cgroup, marker, exclude=proc.pid)
            raw.leftovers_killed = len(left - {script_pid})  # what outlived the script, or the kill
            if kill_reason == "timeout":
                # Polite first: SIGTERM, pump output during the grace period, then SIGKILL.
                self._signal_tree(pgid, cgroup, marker, signal.SIGTERM, extra=left)
                grace_end = time.monotonic() + limits.grace_s
                while time.monotonic() < grace_end and not supervise_lib.has_exited(proc.pid):
                    supervise_lib.pump(sel, streams, timeout=0.05)
                left = self._alive(cgroup, marker, exclude=proc.pid)
            self._signal_tree(pgid, cgroup, marker, signal.SIGKILL, extra=left)
            end = time.monotonic()
            _, wait_status, rusage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(wait_status)
            self._reap_leftovers(pgid, cgroup, marker, main=proc.pid)
            if pidfd is not None:
                sel.unregister(pidfd)
            supervise_lib.drain(sel, streams, timeout=1.0)
            setup_status = status.read_all() if status is not None else b""
        finally:
            sel.close()
            if pidfd is not None:
                os.close(pidfd)
            if status is not None:
                os.close(status.fd)
            proc.stdout.close()
            proc.stderr.close()
            if proc.returncode is None:  # unexpected error above: never leave the tree behind
                self._signal_tree(pgid, cgroup, marker, signal.SIGKILL,
                                  extra=self._alive(cgroup, marker, exclude=proc.pid))
                try:
                    os.wait4(proc.pid, 0)
                except ChildProcessError:
                    pass
                proc.returncode = -signal.SIGKILL
        raw.exit_code = self._translate_exit(proc.returncode)
        raw.wall_s = end - start
        # wait4's ru_maxrss = max(the host's PEAK RSS at fork, peak of the tree it waited for):
        # the forked copy inherits the host's high-water mark (VmHWM), not its current RSS (a
        # test runner that once held 6 GB and now holds 4.7 made a 96 MB script read 6,160 MB).
        # Exact when it clearly exceeds that, else rely on the /proc samples. The host's RSS
        # moves between its reading and the fork (a multi-GB test runner: by several percent),
        # hence the wide margin.
        if rusage.ru_maxrss > 1.25 * host_peak_kb + 256 * 1024:
            memory.peak_kb = max(memory.peak_kb, rusage.ru_maxrss)
        raw.peak_memory_mb = memory.peak_mb()
        raw.stdout, raw.stderr = out.text(), err.text()
        raw.timed_out = kill_reason == "timeout"
        raw.cancelled = kill_reason == "cancelled"
        raw.disk_limit_hit = kill_reason == "disk"
        # RLIMIT_CPU sends SIGXCPU at the soft limit, SIGKILL at the hard one; a PID-namespace
        # init (the script under bwrap) ignores the first, so a SIGKILL we did not send, after
        # at least the soft limit of CPU time (wait4 counts the reaped tree), is the limit too.
        cpu_s = raw.cpu_s = rusage.ru_utime + rusage.ru_stime
        raw.cpu_limit_hit = raw.exit_code == -signal.SIGXCPU or (
            raw.exit_code == -signal.SIGKILL and not kill_reason
            and cpu_s >= supervise_lib.cpu_limit_s(limits))
        if status is not None and not kill_reason:
            raw.error = self._setup_failure(setup_status, raw)
        supervise_lib.note_cgroup_limits(raw, cgroup, limits)
        return raw

    # Whether leftovers are also searched by the run marker in /proc/*/environ (a few ms per
    # scan). The process backend needs it: a daemon may leave the group, and as root even the
    # cgroup. The bwrap backend does not: its PID namespace dies with the main process.
    scan_marker = True

    def _alive(self, cgroup: Optional[PidsCgroup], marker: str, exclude: int) -> set[int]:
        alive = set(cgroup.pids()) if cgroup is not None else set()
        if self.scan_marker:
            alive |= set(supervise_lib.marked_pids(marker))
        alive.discard(exclude)
        return alive

    def _signal_tree(self, pgid: int, cgroup: Optional[PidsCgroup], marker: str, sig: int,
                     extra: Iterable[int] = ()) -> None:
        """Signals the process group, the cgroup's processes and ``extra`` pids."""
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        if cgroup is not None:
            cgroup.signal_all(sig)
        for pid in extra:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def _reap_leftovers(self, pgid: int, cgroup: Optional[PidsCgroup], marker: str, main: int,
                        timeout_s: float = 5.0) -> None:
        """Repeats SIGKILL until nothing of the execution is alive (a fork bomb races one pass)."""
        deadline = time.monotonic() + timeout_s
        delay = 0.0002  # what is left is usually gone within a ms (bwrap's pid 1 exiting)
        while True:
            alive = self._alive(cgroup, marker, exclude=main)
            if not alive or time.monotonic() > deadline:
                return
            self._signal_tree(pgid, cgroup, marker, signal.SIGKILL, extra=alive)
            time.sleep(delay)
            delay = min(delay * 2, 0.005)


def _warn_once(message: str) -> None:
    """Logs ``message`` as a warning the first time it is seen in this process."""
    if message not in _WARNED:
        _WARNED.add(message)
        log.warning(message)
