"""Warm interpreters for the bwrap backend: scripts forked from a sandbox that has already
imported numpy, pandas and sklearn.

Importing numpy, pandas and sklearn costs ~3.4 CPU-seconds on the 2-core host, more than most
agent scripts spend on their own work; with 16 executions per RL step that was most of the CPU
the sandbox took from the learner. With ``BwrapBackend(preload=(...))`` each execution is instead
forked from a *zygote*: a bwrap sandbox made once per task (same namespaces, binds and masks as a
cold execution of that task), whose PID 1 is ``sandbox/runner.py zygote`` with the modules
already imported. See ``sandbox.runner`` for the zygote's side.

Per execution (``WarmInterpreters.execute``): an idle zygote of the task is taken (or made); the
host writes solution.py and the empty submission/ and working/ dirs; the zygote forks; the host
sets the child's rlimits and moves it into a fresh pids cgroup (exactly as for a cold script),
then opens its gate; the wall-clock deadline, the disk poll, the memory samples, the output
capture and the kill are the cold path's. When the script ends, the zygote kills everything the
script left in the sandbox and reports the exit status and CPU time; once the host has copied
the submission out, the zygote empties its ``/workspace`` (but ``input``) and ``/tmp``.

What differs from a cold execution:
  * executions of one task in one zygote share the sandbox (one after another, never at once):
    the workspace and /tmp are emptied between them, and nothing of a script outlives it, but
    the zygote is the same process (it cannot be signalled or ptraced from inside, see
    ``sandbox.runner``);
  * the script is not PID 1 (the zygote is): SIGXCPU and SIGALRM behave as usual;
  * the peak memory includes the preloaded modules (~200 MB) even when the script imports none
    of them, and RLIMIT_AS applies to that address space too; the memory cgroup (the script is
    moved into it) counts only the pages the script itself makes or copies: those it shares
    with the zygote stay charged to the zygote.

A zygote that dies, fails to empty its sandbox or answers out of turn is discarded; a zygote
that cannot be made at all (a broken preload, bwrap refusing) makes that execution cold.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import os
import pathlib
import select
import selectors
import signal
import socket
import subprocess
import tempfile
import threading
import time
import uuid
from typing import Any, Optional

from sandbox.backends import base
from sandbox.backends import supervise as supervise_lib

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 300.0   # importing the preload under a loaded host can take a minute
REPLY_TIMEOUT_S = 30.0    # a wipe or a fork is answered within ms; longer is a hang
WARM_INTERPRETER_MB = 256  # RAM an idle warm interpreter holds, MiB (~200 with DEFAULT_PRELOAD)
DEFAULT_PRELOAD = ("numpy", "pandas", "scipy.stats", "sklearn.ensemble", "sklearn.linear_model",
                   "sklearn.model_selection", "sklearn.metrics", "sklearn.preprocessing",
                   "sklearn.neighbors", "sklearn.svm", "sklearn.tree", "sklearn.pipeline",
                   "sklearn.impute")


class ZygoteError(RuntimeError):
    """A warm interpreter died, hung or answered out of turn; it is discarded."""


class Zygote:
    """One warm interpreter: a bwrap sandbox of one task whose PID 1 serves executions.

    Layout on the host (``<root_dir>/run-<owner>-warm-XXXX``, swept like a working dir)::

        workspace/   bound at /workspace (task.public_dir bound read-only at /workspace/input)
        tmp/         bound at /tmp
        zygote.log   the sandbox's own stdout/stderr (bwrap's errors, the import of the preload)
    """

    def __init__(self, backend: Any, task: Any, preload: tuple[str, ...]):
        self.dir = pathlib.Path(tempfile.mkdtemp(prefix=f"run-{backend.owner.token}-warm-",
                                                 dir=backend.root_dir))
        self.workspace = self.dir / "workspace"
        (self.dir / "tmp").mkdir()
        self.workspace.mkdir()
        os.chmod(self.dir, 0o755)
        self.proc: Optional[subprocess.Popen] = None
        self.sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        status_r, status_w = os.pipe()
        try:
            cmd = backend.zygote_command(task, self.dir, theirs.fileno(), status_w, preload)
            with open(self.dir / "zygote.log", "wb") as logf:
                self.proc = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf, close_fds=True,
                    env=backend.environment(self.workspace, uuid.uuid4().hex),
                    pass_fds=(theirs.fileno(), status_w), process_group=0)
            theirs.close()
            os.close(status_w)
            status_w = None
            status = supervise_lib.StatusPipe(status_r)
            line = status.first_line(timeout_s=READY_TIMEOUT_S)
            if line is None:
                raise ZygoteError(f"bwrap could not start the warm sandbox: {self.log_tail()}")
            self.pid = int(json.loads(line)["child-pid"])  # the zygote (PID 1 inside), host pid
            ready = self._reply(READY_TIMEOUT_S)
            if not ready.get("ready"):
                raise ZygoteError(f"unexpected first reply {ready!r}")
            self.failed_imports = list(ready.get("failed", ()))
        except BaseException:
            if status_w is not None:
                os.close(status_w)
                theirs.close()
            self.close()
            raise
        finally:
            os.close(status_r)

    def log_tail(self, limit: int = 2000) -> str:
        try:
            return (self.dir / "zygote.log").read_bytes()[-limit:].decode(errors="replace").strip()
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _reply(self, timeout_s: float) -> dict:
        """The zygote's next message. ZygoteError when it died or stayed silent."""
        self.sock.settimeout(timeout_s)
        try:
            data = self.sock.recv(1 << 16)
        except (socket.timeout, OSError) as e:
            raise ZygoteError(f"the warm interpreter did not answer: {e}; {self.log_tail()}") from e
        if not data:
            raise ZygoteError(f"the warm interpreter exited; {self.log_tail()}")
        return json.loads(data)

    def wipe(self) -> None:
        """Empties /workspace (but input/) and /tmp, inside the sandbox."""
        self.sock.sendall(json.dumps({"op": "wipe"}).encode())
        reply = self._reply(REPLY_TIMEOUT_S)
        if reply.get("wiped") is not True:
            raise ZygoteError(f"the warm interpreter could not empty its sandbox: {reply!r}")

    def fork(self, env: dict, stdout_w: int, stderr_w: int, gate_r: int) -> int:
        """Forks the script, waiting at its gate; returns its host pid."""
        request = {"op": "run", "script": f"{WORKSPACE}/{base.SCRIPT_NAME}", "cwd": WORKSPACE,
                   "env": env}
        socket.send_fds(self.sock, [json.dumps(request).encode()], [stdout_w, stderr_w, gate_r])
        inner = self._reply(REPLY_TIMEOUT_S).get("pid")
        if not isinstance(inner, int):
            raise ZygoteError(f"expected the script's pid, got {inner!r}")
        host = _host_pid_of_child(self.pid, inner)
        if host is None:
            raise ZygoteError(f"the forked script (pid {inner} in the sandbox) is not a child of "
                              f"the warm interpreter {self.pid}")
        return host

    def close(self) -> None:
        """Ends the zygote (closing its socket ends its loop; as PID 1 its exit ends the
        sandbox) and removes its dir."""
        try:
            self.sock.close()
        except OSError:
            pass
        if self.proc is not None:
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        base.remove_workdir(self.dir)


WORKSPACE = "/workspace"


def _host_pid_of_child(parent: int, inner: int) -> Optional[int]:
    """The host pid of ``parent``'s child whose pid in its own namespace is ``inner``."""
    try:
        children = open(f"/proc/{parent}/task/{parent}/children").read().split()
    except OSError:
        return None
    for pid in children:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        if int(line.split()[-1]) == inner:
                            return int(pid)
                        break
        except (OSError, ValueError):
            continue
    return None


class WarmInterpreters:
    """The zygotes of one ``BwrapBackend``: idle ones kept per task (at most ``max_idle`` in all,
    the least recently used closed first), each running one execution at a time."""

    def __init__(self, backend: Any, preload: tuple[str, ...], max_idle: int = 8):
        self.backend, self.preload, self.max_idle = backend, tuple(preload), int(max_idle)
        self._idle: "collections.OrderedDict[int, tuple[Any, Zygote]]" = collections.OrderedDict()
        self._busy: set = set()
        self._lock = threading.Lock()
        self._closed = False
        # Zygotes are started from one long-lived thread: bwrap's --die-with-parent follows the
        # thread that started it, and a caller's thread may end before the zygote should.
        self._spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="zygote")
        self.cold_fallbacks = 0

    @staticmethod
    def key(task: Any) -> tuple:
        return (os.path.realpath(task.public_dir),
                tuple(sorted(os.fspath(p) for p in (getattr(task, "hidden_paths", ()) or ()))))

    def _take(self, task: Any) -> Zygote:
        key = self.key(task)
        with self._lock:
            for slot, (k, z) in list(self._idle.items()):
                if k == key:
                    del self._idle[slot]
                    if z.alive():
                        self._busy.add(z)
                        return z
                    z.close()
        z = self._spawner.submit(Zygote, self.backend, task, self.preload).result()
        with self._lock:
            self._busy.add(z)
        return z

    def _give_back(self, task: Any, z: Zygote) -> None:
        with self._lock:
            self._busy.discard(z)
            if not self._closed:
                self._idle[id(z)] = (self.key(task), z)
                z = None
                while len(self._idle) > self.max_idle:
                    _, (_, z_old) = self._idle.popitem(last=False)
                    z_old.close()
        if z is not None:
            z.close()

    def execute(self, task: Any, code: str,
                cancel: Optional[threading.Event]) -> Optional[base.RawExecution]:
        """Runs ``code`` forked from a zygote of ``task``; None when no zygote can be had (the
        caller then runs it cold)."""
        limits = base.task_limits(task, self.backend.limits)
        try:
            z = self._take(task)
        except (ZygoteError, OSError, ValueError, KeyError, base.SandboxSetupError) as e:
            self.cold_fallbacks += 1
            log.warning("no warm interpreter for task %s (%s); running this execution cold",
                        getattr(task, "task_id", "?"), e)
            return None  # the caller runs it cold
        keep = False
        cgroup = None
        try:
            (z.workspace / base.SCRIPT_NAME).write_text(code, encoding="utf-8")
            for sub in ("working", "submission"):
                (z.workspace / sub).mkdir(exist_ok=True)
            if self.backend.cgroup_parent is not None:
                cgroup = self.backend.cgroup_parent.acquire(limits.pids_max, limits.memory_mb)
            raw = self._run(z, limits, cgroup, cancel)
            if raw.exit_code is not None and not (raw.timed_out or raw.cancelled or raw.error):
                raw.submission, raw.submission_error = base.collect_submission(
                    z.workspace, self.backend.submission_max_bytes)
            keep = not raw.error
            return raw
        finally:
            if cgroup is not None:
                self.backend.cgroup_parent.release(cgroup)
            if keep:  # emptied now: nothing of a script waits on disk for the next one
                try:
                    z.wipe()
                except (ZygoteError, OSError) as e:
                    log.warning("closing a warm interpreter: %s", e)
                    keep = False
            if keep:
                self._give_back(task, z)
            else:
                with self._lock:
                    self._busy.discard(z)
                z.close()

    def _run(self, z: Zygote, limits: base.Limits, cgroup, cancel) -> base.RawExecution:
        """The cold path's ``ProcessBackend._run`` for a script forked by ``z``."""
        be = self.backend
        marker = uuid.uuid4().hex
        raw = base.RawExecution()
        out = base.BoundedCapture(be.output_head_bytes, be.output_tail_bytes)
        err = base.BoundedCapture(be.output_head_bytes, be.output_tail_bytes)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        gate_r, gate_w = os.pipe()
        start = time.monotonic()
        try:
            pid = z.fork(be.environment(z.workspace, marker), out_w, err_w, gate_r)
        except BaseException:
            for fd in (out_r, err_r, gate_w):
                os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, gate_r):
                os.close(fd)
        streams = {out_r: out, err_r: err}
        sel = selectors.DefaultSelector()
        memory = supervise_lib.MemorySampler(pid, cgroup, start)
        kill_reason = None
        report: Optional[dict] = None
        try:
            try:
                be._confine(pid, pid, limits, cgroup, move=True)
                os.write(gate_w, b"go\n")
            except (ProcessLookupError, BrokenPipeError):
                pass  # it died at the gate; the zygote reports how
            finally:
                os.close(gate_w)
            for fd in streams:
                os.set_blocking(fd, False)
                sel.register(fd, selectors.EVENT_READ)
            sel.register(z.sock, selectors.EVENT_READ)  # the zygote's report: the script ended
            kill_reason = supervise_lib.supervise(
                sel, streams, lambda: _readable(z.sock), start=start, limits=limits,
                disk_dir=z.dir, disk_poll_s=be.disk_poll_s, memory=memory, cancel=cancel)
            if kill_reason:
                alive = set(cgroup.pids()) if cgroup is not None else set()
                raw.leftovers_killed = len(alive - {pid})  # what the kill ends besides the script
            if kill_reason == "timeout":
                be._signal_tree(pid, cgroup, marker, signal.SIGTERM)
                grace_end = time.monotonic() + limits.grace_s
                while time.monotonic() < grace_end and not _readable(z.sock):
                    supervise_lib.pump(sel, streams, timeout=0.05)
            if kill_reason:
                alive = set(cgroup.pids()) if cgroup is not None else set()
                be._signal_tree(pid, cgroup, marker, signal.SIGKILL, extra=alive)
            end = time.monotonic()
            sel.unregister(z.sock)
            report = z._reply(REPLY_TIMEOUT_S)
            supervise_lib.drain(sel, streams, timeout=1.0)
        except ZygoteError as e:
            raw.error = f"the warm interpreter failed: {e}"
            be._signal_tree(pid, cgroup, marker, signal.SIGKILL)
            end = time.monotonic()
        finally:
            sel.close()
            for fd in streams:
                os.close(fd)
        raw.wall_s = end - start
        raw.stdout, raw.stderr = out.text(), err.text()
        raw.peak_memory_mb = memory.peak_mb()
        raw.timed_out = kill_reason == "timeout"
        raw.cancelled = kill_reason == "cancelled"
        raw.disk_limit_hit = kill_reason == "disk"
        if report is not None:
            if "exit" not in report:
                raw.error = f"the warm interpreter answered out of turn: {report!r}"
                return raw
            raw.exit_code = int(report["exit"])
            raw.cpu_s = float(report["cpu_s"])
            if not kill_reason:  # what outlived the script, killed by the zygote
                raw.leftovers_killed = int(report.get("killed", 0))
            raw.cpu_limit_hit = raw.exit_code == -signal.SIGXCPU or (
                raw.exit_code == -signal.SIGKILL and not kill_reason
                and raw.cpu_s >= supervise_lib.cpu_limit_s(limits))
        supervise_lib.note_cgroup_limits(raw, cgroup, limits)
        return raw

    def busy(self) -> list[Zygote]:
        """The zygotes running an execution now."""
        with self._lock:
            return list(self._busy)

    def resident_pids(self) -> set[int]:
        """Host pids of the idle zygotes and their bwrap parents (alive between executions)."""
        with self._lock:
            return {p for _, z in self._idle.values() for p in (z.pid, z.proc.pid)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = list(self._idle.values()), collections.OrderedDict()
        for _, z in idle:
            z.close()
        self._spawner.shutdown(wait=True)


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])
