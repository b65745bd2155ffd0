"""Leftovers of dead hosts are swept by owner lock, never by a pid that can be reused.

Each owner here is a real process (``OWNER``) that takes an ``OwnerLock`` on a root dir, makes a
working dir (and, where the host allows, a pids cgroup holding a sleeping process) and waits.
Then a backend made on the same root dir sweeps, and the tests check:

  * a live owner's dirs and cgroups stay;
  * a dead owner's (SIGKILL: no clean-up of its own) go, with its lock file, and what still ran
    in its cgroup is killed;
  * an owner whose pid is alive but is another program now (it exec'd) is dead: its dirs go;
  * an owner in a PID namespace (pid 2 there, and pid 2 is alive here too) is told apart the
    same way: kept while it lives, swept once killed;
  * junk in the root dir (malformed lock names, a directory or a symlink in place of a lock, a
    working dir with no lock file) is left alone and the backend still runs code.
"""
from __future__ import annotations

import fcntl
import os
import pathlib
import subprocess
import sys
import time

import pytest

from sandbox.backends import SandboxUnavailableError
from sandbox.backends.base import remove_owner_workdirs
from sandbox.backends.bwrap import find_bwrap
from sandbox.backends.cgroup import PidsCgroupParent
from sandbox.backends.owner import OwnerLock, lock_path, sweep_dead_owners
from sandbox.backends.process import ProcessBackend
from tests.sandbox.conftest import GOOD_CODE, bwrap_skip_reason

REPO = pathlib.Path(__file__).resolve().parents[2]

# argv: root_dir, then ("wait" | "exec"), with_cgroup ("0" | "1"). Prints "<token> <pid> <cgroup>"
# once its leftovers exist; "exec" then becomes /bin/sleep (same pid, another program).
OWNER = """
import os, subprocess, sys
from sandbox.backends.base import prepare_workdir
from sandbox.backends.cgroup import PidsCgroupParent
from sandbox.backends.owner import OwnerLock
root, then, with_cgroup = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
owner = OwnerLock(root)
prepare_workdir(root, "print(1)\\n", owner.token)
cgroup = ""
if with_cgroup:
    parent, _ = PidsCgroupParent.detect(owner=owner.token)
    cg = parent.create(pids_max=4)
    child = subprocess.Popen(["sleep", "60"])
    (cg.path / "cgroup.procs").write_text(str(child.pid))
    cgroup = str(cg.path)
print(owner.token, os.getpid(), cgroup or "-", flush=True)
if then == "exec":
    os.execv("/bin/sleep", ["sleep", "60"])
sys.stdin.read()
"""


class Owner:
    """One owner process; ``kill()`` SIGKILLs it (and, for a wrapped one, its wrapper)."""

    def __init__(self, root: pathlib.Path, then: str = "wait", with_cgroup: bool = False,
                 prefix: tuple = ()):
        self.proc = subprocess.Popen(
            list(prefix) + [sys.executable, "-c", OWNER, os.fspath(root), then,
                            "1" if with_cgroup else "0"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        line = self.proc.stdout.readline().split()
        assert len(line) == 3, f"owner failed to start (exit {self.proc.wait()})"
        self.token, self.pid = line[0], int(line[1])
        self.cgroup = None if line[2] == "-" else pathlib.Path(line[2])
        self.root = root
        if then == "exec":  # wait until the pid runs the other program
            deadline = time.monotonic() + 10
            while not _cmdline(self.pid).startswith(b"sleep") and time.monotonic() < deadline:
                time.sleep(0.005)

    def workdirs(self) -> list:
        return sorted(self.root.glob(f"run-{self.token}-*"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def owners():
    started = []
    yield lambda *a, **kw: started.append(Owner(*a, **kw)) or started[-1]
    for o in started:
        o.kill()
        if o.cgroup is not None:  # kill what it left in there, then remove it
            PidsCgroupParent.detect()[0].remove_owner(o.token)


def sweep(root: pathlib.Path) -> int:
    return sweep_dead_owners(root, lambda token: remove_owner_workdirs(root, token))


def test_owner_lock_is_held_until_released(tmp_path):
    owner = OwnerLock(tmp_path)
    assert owner.held and owner.path == lock_path(tmp_path, owner.token)
    fd = os.open(owner.path, os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):  # another open file description cannot take it
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        owner.release()
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free now
    finally:
        os.close(fd)
    assert not owner.held and not owner.path.exists()
    owner.release()  # idempotent
    assert OwnerLock(tmp_path).token != owner.token


def test_dead_owners_are_swept_and_live_ones_kept(tmp_path, owners):
    live = owners(tmp_path)
    dead = owners(tmp_path)
    other_program = owners(tmp_path, then="exec")  # its pid lives on, as /bin/sleep
    dead.kill()
    assert all(len(o.workdirs()) == 1 for o in (live, dead, other_program))
    assert os.path.exists(f"/proc/{other_program.pid}")  # a pid check would call it alive

    assert sweep(tmp_path) == 2
    assert len(live.workdirs()) == 1 and lock_path(tmp_path, live.token).exists()
    for gone in (dead, other_program):
        assert gone.workdirs() == [] and not lock_path(tmp_path, gone.token).exists()
    assert sweep(tmp_path) == 0  # nothing left to sweep; the live owner is still left alone
    assert len(live.workdirs()) == 1


def test_an_owner_in_a_pid_namespace_is_told_apart(tmp_path, owners):
    """In its own PID namespace the owner is pid 2, a number that is alive here too."""
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)
    prefix = (find_bwrap(), "--dev-bind", "/", "/", "--unshare-user", "--unshare-pid",
              "--die-with-parent", "--")
    owner = owners(tmp_path, prefix=prefix)
    assert owner.pid <= 3 and os.path.exists(f"/proc/{owner.pid}"), owner.pid
    assert sweep(tmp_path) == 0 and len(owner.workdirs()) == 1  # alive: kept
    owner.kill()  # bwrap dies; --die-with-parent kills the owner inside
    deadline = time.monotonic() + 5
    while sweep(tmp_path) == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert owner.workdirs() == [] and not lock_path(tmp_path, owner.token).exists()


def test_a_dead_owners_cgroup_is_emptied_and_removed(tmp_path, owners):
    parent, reason = PidsCgroupParent.detect()
    if parent is None:
        pytest.skip(f"no usable pids cgroup here: {reason}")
    live = owners(tmp_path, with_cgroup=True)
    dead = owners(tmp_path, with_cgroup=True)
    orphan = [int(p) for p in (dead.cgroup / "cgroup.procs").read_text().split()]
    dead.kill()
    assert orphan and all(os.path.exists(f"/proc/{p}") for p in orphan)  # it runs on unsupervised

    backend = ProcessBackend(root_dir=tmp_path)  # sweeps as it starts
    try:
        assert not dead.cgroup.exists() and dead.workdirs() == []
        assert live.cgroup.exists() and len(live.workdirs()) == 1
        assert backend.cgroup_parent.owner == backend.owner.token  # its own cgroups: its token
    finally:
        backend.close()
    deadline = time.monotonic() + 5  # killed; reaped by init, which may take a moment
    while any(_alive(p) for p in orphan) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not any(_alive(p) for p in orphan)


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_junk_in_the_root_dir_is_left_alone(tmp_path, fake_task):
    token = "0123456789abcdef"
    junk = [tmp_path / "owner-nothex.lock", tmp_path / f"owner-{token}0.lock",
            tmp_path / f"run-{token}-orphan"]  # a working dir with no lock file: owner unknown
    for p in junk:
        p.mkdir() if p.name.startswith("run-") else p.write_text("")
    as_dir = lock_path(tmp_path, "fedcba9876543210")
    as_dir.mkdir()  # a directory where a lock file should be
    as_link = lock_path(tmp_path, "00000000000000ff")
    as_link.symlink_to(tmp_path / "elsewhere")
    assert sweep(tmp_path) == 0
    assert all(p.exists() for p in junk + [as_dir]) and as_link.is_symlink()
    backend = ProcessBackend(root_dir=tmp_path, use_cgroup=False)  # carries on
    raw = backend.execute(fake_task, GOOD_CODE)
    backend.close()
    assert raw.exit_code == 0 and raw.submission is not None, raw.stderr
    os.unlink(raw.submission)
    assert not backend.owner.path.exists()  # a closed backend leaves no lock file


def test_a_root_dir_that_cannot_hold_working_dirs_is_a_typed_error(tmp_path, fake_task):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.raises(SandboxUnavailableError, match="cannot hold the working dirs"):
        ProcessBackend(root_dir=not_a_dir / "runs")
    backend = ProcessBackend(root_dir=tmp_path / "runs", use_cgroup=False)  # the next one works
    raw = backend.execute(fake_task, "print('ok')\n")
    backend.close()
    assert raw.exit_code == 0 and raw.stdout.strip() == "ok"


def test_a_working_dir_is_named_by_its_owner(tmp_path, fake_task):
    backend = ProcessBackend(root_dir=tmp_path, keep=True, use_cgroup=False)
    try:
        raw = backend.execute(fake_task, GOOD_CODE)
        assert raw.workdir.name.startswith(f"run-{backend.owner.token}-")
        os.unlink(raw.submission)
    finally:
        backend.close()
    # A kept dir outlives a clean owner and has no lock file any more: no sweep takes it.
    assert raw.workdir.is_dir() and sweep(tmp_path) == 0 and raw.workdir.is_dir()
