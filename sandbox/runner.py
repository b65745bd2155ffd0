"""Runs the agent's script inside the sandbox: started fresh, or forked from a warm interpreter.

This file is executed by the sandbox's own interpreter (``sandbox.python``: the trainer's, or a
venv of its own with the Kaggle stack, ``scripts/build_sandbox_env.sh``), so it uses the standard
library only and imports nothing of this project or the trainer's packages, in one of two ways::

    python -s -P -u runner.py run solution.py                    # cold: one interpreter per script
    python -s -P -u runner.py zygote FD numpy,pandas,sklearn...  # warm: PID 1 of a bwrap sandbox

Either way the script is run by ``run_script``, so both ways behave alike:

  * the global RNGs of ``random`` and numpy start from ``SEED`` in every execution (and the
    backends start the interpreter with ``PYTHONHASHSEED=0``), so the same code gets the same
    score: an unseeded ``RandomForestRegressor`` scored 0.596 in one run and 0.796 in another,
    which GRPO reads as signal. (Cold and warm agree on numpy's stream and on hashes; Python's
    ``random`` can differ between them, because some imports draw from it: importing
    ``sklearn.ensemble`` does, which a warm script finds already done.)
  * ``__main__`` is a fresh module whose ``__file__`` is the script's absolute path, ``sys.argv``
    is ``["solution.py"]``, and an uncaught exception prints the traceback Python itself would
    print (this file's frames left out), then exits 1; ``SystemExit`` behaves as usual.

Warm mode (``zygote``): the interpreter imports the preload modules once (numpy, pandas and
sklearn cost ~3.4 CPU-s per import on a 2-core host, more than most scripts themselves), says
``{"ready": ...}`` on the control socket ``FD``, then serves one execution at a time. Per request
(a JSON line plus three fds by SCM_RIGHTS: stdout, stderr and a gate pipe) it forks; the child
starts its own session, takes the fds as stdout/stderr, stdin from /dev/null and the request's
environment, closes the control socket, waits at the gate (the host sets its rlimits and cgroup
meanwhile, as for a cold script), then runs the script. The zygote reports ``{"pid": ...}``,
waits for the script, kills whatever the script left in the sandbox (``kill(-1)`` from PID 1
reaches every other process of the PID namespace, and nothing outside it) and reaps it, then
reports ``{"exit": code, "killed": n, "cpu_s": ...}``. It must be PID 1 of its namespace: it
refuses to run otherwise. As PID 1 it cannot be killed from inside the namespace (the kernel drops signals to
a namespace's init that it has no handler for), and it is not dumpable, so a script cannot
ptrace it either.
"""
from __future__ import annotations

import builtins
import os
import random
import sys
import types

# A cold script pays for every import here before its own first line: the zygote's modules
# (ctypes, gc, json, signal, socket) are imported by the functions that use them.

SEED = 0
_PR_SET_DUMPABLE = 4


def seed_rngs(seed: int = SEED) -> None:
    """Seeds ``random`` now and numpy's global RandomState now (warm: numpy is imported) or right
    after the script first imports numpy (cold: a script that never does pays nothing)."""
    random.seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    else:
        sys.meta_path.insert(0, _SeedNumpyOnImport(seed))


class _SeedNumpyOnImport:
    """A meta path finder that, once, wraps numpy's loader so numpy is seeded when loaded."""

    def __init__(self, seed: int):
        self.seed = seed

    def find_spec(self, name, path=None, target=None):
        if name != "numpy":
            return None
        import importlib.util

        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_seed(module):
            exec_module(module)
            module.random.seed(self.seed)

        spec.loader.exec_module = exec_and_seed
        return spec


def run_script(path: str) -> None:
    """Runs ``path`` as ``__main__``; an uncaught exception is printed as Python prints it
    (without this function's frame) and becomes ``SystemExit(1)``."""
    path = os.path.abspath(path)
    with open(path, "rb") as f:
        source = f.read()
    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    sys.argv = [os.path.basename(path)]
    seed_rngs()
    try:
        exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - the script's own error, shown as Python would
        tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
        sys.excepthook(type(e), e, e.with_traceback(tb).__traceback__)
        raise SystemExit(1) from None


def _send(sock, message: dict) -> None:
    import json

    sock.send(json.dumps(message).encode())  # one SOCK_SEQPACKET message


def _preload(modules: list[str]) -> list[str]:
    """Imports ``modules``; returns those that failed (a missing package is not an error)."""
    import importlib

    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - ImportError, or a package broken in this sandbox
            failed.append(name)
    return failed


def _kill_everything_else() -> int:
    """Kills every other process of this PID namespace and reaps them all (we are its init).
    Returns how many were alive (zombies the script left unreaped are not counted)."""
    import signal

    alive = 0
    for entry in os.listdir("/proc"):  # this namespace's own /proc
        if entry.isdigit() and entry != "1":
            try:
                with open(f"/proc/{entry}/stat") as f:
                    alive += f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except (OSError, IndexError):
                continue
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    while True:
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return alive
        except InterruptedError:
            continue


def _remove_tree(path: str) -> bool:
    """Removes ``path`` but any mount point in it (a bind under /tmp); True unless something
    else could not be removed."""
    if os.path.ismount(path):
        return True
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            os.chmod(path, 0o700)  # a script may have left a dir it cannot be listed
            with os.scandir(path) as it:
                ok = all([_remove_tree(entry.path) for entry in it])
            try:
                os.rmdir(path)
            except OSError:
                return ok  # what is left holds a mount point
            return True
        os.unlink(path)
        return True
    except (OSError, RecursionError):
        return False


def _wipe(workspace: str, keep: str = "input") -> bool:
    """Empties ``workspace`` (but ``keep``, the read-only input mount) and /tmp."""
    ok = True
    for root in (workspace, "/tmp"):
        with os.scandir(root) as it:
            entries = [e.path for e in it if not (root == workspace and e.name == keep)]
        ok = all([_remove_tree(p) for p in entries]) and ok
    return ok


def _become_the_script(request: dict, out: int, err: int, gate: int) -> None:
    """In the forked child: take on the execution's session, fds, environment and cwd, then wait
    at the gate. Exits 125 when the host closes the gate without opening it."""
    import ctypes

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    for fd in (null, out, err):
        if fd > 2:
            os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    if not os.read(gate, 1):
        os._exit(125)
    os.close(gate)
    os.chdir(request["cwd"])
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # the script's own /proc/self works


def serve(control_fd: int, preload: list[str]) -> dict:
    """The zygote's loop (see the module docstring). Returns only in a forked child, ready to run
    the script named by the returned request; the zygote itself exits when the host closes the
    control socket."""
    import ctypes
    import gc
    import json
    import socket

    if os.getpid() != 1:
        raise SystemExit("runner.py zygote must be PID 1 of its own PID namespace "
                         "(kill(-1) would otherwise reach processes outside the sandbox)")
    ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    sock = socket.socket(fileno=control_fd)
    failed = _preload(preload)
    # What the preload made is never garbage: out of the collector's sight, a script's
    # collections (and the one at its end) do not walk it, nor touch its copy-on-write pages.
    gc.freeze()
    _send(sock, {"ready": True, "failed": failed})
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 16, 3)
        except ConnectionError:
            os._exit(0)
        if not data:
            os._exit(0)  # the host is done with us; as PID 1 our exit ends the namespace
        request = json.loads(data)
        if request.get("op") == "wipe":
            _send(sock, {"wiped": _wipe(os.getcwd())})
            continue
        out, err, gate = fds
        pid = os.fork()
        if pid == 0:
            sock.close()
            _become_the_script(request, out, err, gate)
            return request
        for fd in fds:
            os.close(fd)
        _send(sock, {"pid": pid})
        while True:
            try:
                _, status, usage = os.wait4(pid, 0)
                break
            except InterruptedError:
                continue
        _send(sock, {"exit": os.waitstatus_to_exitcode(status), "killed": _kill_everything_else(),
                     "cpu_s": usage.ru_utime + usage.ru_stime})


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[1] == "run":
        script = argv[2]
    elif len(argv) == 4 and argv[1] == "zygote":
        request = serve(int(argv[2]), [m for m in argv[3].split(",") if m])
        script = request["script"]
    else:
        raise SystemExit("usage: runner.py run SCRIPT | runner.py zygote FD MODULE[,MODULE...]")
    try:
        run_script(script)
        status = 0
    except SystemExit as e:
        status = exit_status(e)
    shut_down(status)


def exit_status(e: SystemExit) -> int:
    """The exit status Python gives an uncaught ``SystemExit`` (printing a non-int code)."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def shut_down(status: int) -> None:
    """Ends the process as interpreter shutdown would, as far as a script can tell: non-daemon
    threads joined, atexit handlers run, ``__main__``'s objects released (an unclosed file is
    flushed and closed), streams flushed; then ``os._exit``, skipping the teardown of every
    imported module, which cost ~0.7 CPU-s per script with numpy, pandas and sklearn loaded."""
    import atexit
    import gc
    import threading

    threading._shutdown()  # what Py_FinalizeEx calls first: waits for non-daemon threads
    atexit._run_exitfuncs()
    main_module = sys.modules.get("__main__")
    if main_module is not None:
        main_module.__dict__.clear()
    gc.collect()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream: nothing left to flush
            pass
    os._exit(status & 0xFF)  # as the OS truncates an exit(status): 256 -> 0, -1 -> 255


if __name__ == "__main__":
    main(sys.argv)
