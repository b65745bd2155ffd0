"""The pids cgroup of each execution: exact, empty at the start of every run of a worker
(an emptied one is reused: no mkdir/rmdir per execution), cheap to enter.

An execution's processes are born in its cgroup: the host thread that starts the script steps
into the cgroup for the spawn and back out (``PidsCgroup.run_inside``, cgroup v1), instead of
moving the process (~6-15 ms here). These tests drive one backend from one thread (what one pool
worker does) and check:

  * a fork bomb on the second execution of the worker (after a clean first one) is capped at
    ``pids_max`` and reported, and a clean execution after it is not reported as a limit hit;
  * the limit is exact: the thread's visit neither takes one of the ``pids_max`` slots from the
    script nor leaves one more to it; the script is in its execution's cgroup, and the host
    thread is back in its own cgroup afterwards;
  * a cgroup is reused only once empty, and the idle ones are removed when the backend closes;
  * the cgroups of one owner are removed, and only those.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

from sandbox.backends import make_backend
from sandbox.backends.cgroup import CgroupMoveError, PidsCgroupParent
from tests.sandbox.conftest import bwrap_skip_reason, processes_with

PIDS_MAX = 16
FORK_BOMB = ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
             "        pass\n")
# Forks sleeping children until fork() fails and prints how many it made (the sandbox kills the
# children at the end of the execution).
FORK_COUNT = ("import os, time\nn = 0\nfor _ in range(100):\n    try:\n        pid = os.fork()\n"
              "    except OSError:\n        break\n    if pid == 0:\n        time.sleep(60)\n"
              "        os._exit(0)\n    n += 1\nprint('forked', n, flush=True)\n")


def thread_pids_cgroup() -> str:
    for line in pathlib.Path("/proc/thread-self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(",") or controllers == "":
            return line
    return ""


@pytest.fixture(params=["process", "bwrap"])
def backend(request, tmp_path):
    if request.param == "bwrap":
        reason = bwrap_skip_reason()
        if reason:
            pytest.skip(reason)
    token = f"pidscg-{os.getpid()}-{request.node.name}"
    b = make_backend(request.param, root_dir=tmp_path / "runs", pids_max=PIDS_MAX, grace_s=0.3,
                     extra_env={"ACE_TEST_PIDS_CGROUP": token})
    if b.cgroup_parent is None:
        pytest.skip(f"no usable pids cgroup here: {b.cgroup_reason}")
    b.test_token = token
    yield b
    b.close()


class Recorder:
    """Wraps ``backend._run``: which cgroup each execution ran in, how many tasks it held when
    the execution began, and its ``pids.peak``."""

    def __init__(self, backend):
        self.cgroups, self.peaks, self.tasks_at_start = [], [], []
        original = backend._run

        def _run(task, workdir, limits, cgroup, cancel):
            self.cgroups.append(cgroup)
            self.tasks_at_start.append((cgroup.current(), cgroup.pids()))
            try:
                return original(task, workdir, limits, cgroup, cancel)
            finally:
                peak = cgroup.path / "pids.peak"  # read before the cgroup is removed
                self.peaks.append(int(peak.read_text()) if peak.exists() else None)

        backend._run = _run


def limit_notes(raw) -> list:
    return [n for n in raw.notes if n.startswith("pid limit")]


def test_fork_bomb_on_the_second_run_of_a_worker(backend, fake_task):
    rec = Recorder(backend)
    task = dataclasses.replace(fake_task, time_limit_s=1.5)
    home = thread_pids_cgroup()

    first = backend.execute(task, "print('clean')\n")
    assert first.exit_code == 0 and "clean" in first.stdout, (first.exit_code, first.stderr)
    assert limit_notes(first) == [], first.notes

    bomb = backend.execute(task, FORK_BOMB)
    assert bomb.timed_out or bomb.exit_code != 0, bomb
    assert limit_notes(bomb), bomb.notes  # the limit refused forks, and it is reported
    assert rec.peaks[1] is None or rec.peaks[1] <= PIDS_MAX, rec.peaks
    assert processes_with(backend.test_token) == [], "a process outlived its execution"

    after = backend.execute(task, "print('clean again')\n")
    assert after.exit_code == 0 and "clean again" in after.stdout, (after.exit_code, after.stderr)
    assert limit_notes(after) == [], after.notes  # the bomb's refusals are not this run's

    paths = [cg.path for cg in rec.cgroups]
    assert rec.tasks_at_start == [(0, [])] * 3, rec.tasks_at_start  # each began empty
    assert paths[1] == paths[0], paths  # the emptied cgroup of the clean run was reused
    assert thread_pids_cgroup() == home  # the worker thread is back in its own cgroup
    backend.close()
    assert not any(p.exists() for p in paths), paths  # the idle ones go with the backend


def test_the_limit_is_exact_and_the_script_is_born_in_its_cgroup(tmp_path, fake_task):
    # The process backend execs the script as the gate's pid: the script is 1 of PIDS_MAX tasks.
    b = make_backend("process", root_dir=tmp_path / "runs", pids_max=PIDS_MAX, grace_s=0.3)
    if b.cgroup_parent is None:
        pytest.skip(f"no usable pids cgroup here: {b.cgroup_reason}")
    rec = Recorder(b)
    code = ("print([l.split(':', 2)[2].strip() for l in open('/proc/self/cgroup')\n"
            "       if 'pids' in l.split(':')[1].split(',') or l.split(':')[1] == ''][0])\n"
            + FORK_COUNT)
    try:
        for i in range(2):
            raw = b.execute(fake_task, code)
            assert f"forked {PIDS_MAX - 1}" in raw.stdout, (i, raw.stdout, raw.stderr)
            assert limit_notes(raw), raw.notes
            own = raw.stdout.splitlines()[0]
            assert rec.cgroups[i].path.as_posix().endswith(own), (own, rec.cgroups[i].path)
    finally:
        b.close()


def test_run_inside_moves_only_the_calling_thread_and_back(tmp_path):
    parent, reason = PidsCgroupParent.detect()
    if parent is None:
        pytest.skip(f"no usable pids cgroup here: {reason}")
    cg = parent.create(pids_max=4)
    try:
        if not cg.can_run_inside:
            pytest.skip(f"threads cannot step into a {cg.version} cgroup")
        home = thread_pids_cgroup()
        seen = {}

        def inside():
            seen["here"] = thread_pids_cgroup()
            seen["max"] = (cg.path / "pids.max").read_text().strip()
            seen["other"] = other[0]
            return 7

        other = []
        t = threading.Thread(target=lambda: other.append(thread_pids_cgroup()))
        t.start()
        t.join()
        assert cg.run_inside(inside) == 7
        assert cg.path.name in seen["here"] and seen["max"] == "5"  # one more for the thread
        assert seen["other"] == home  # no other thread moved
        assert thread_pids_cgroup() == home and (cg.path / "pids.max").read_text().strip() == "4"

        with pytest.raises(ZeroDivisionError):  # back out even when fn raises
            cg.run_inside(lambda: 1 / 0)
        assert thread_pids_cgroup() == home and cg.current() == 0
    finally:
        cg.remove()
    with pytest.raises(CgroupMoveError):  # a removed cgroup: not entered, fn not called
        cg.run_inside(lambda: pytest.fail("called"))
    assert thread_pids_cgroup() == home


def test_remove_owner_removes_only_that_owners_cgroups():
    """(Who is dead is told by the owner lock: tests/sandbox/test_owner.py.)"""
    parent, reason = PidsCgroupParent.detect(owner="00000000000000aa")
    if parent is None:
        pytest.skip(f"no usable pids cgroup here: {reason}")
    other = PidsCgroupParent(parent.path, parent.version, parent.mount, owner="00000000000000bb")
    mine = [parent.create(pids_max=4), parent.create(pids_max=4)]
    theirs = other.create(pids_max=4)
    try:
        assert all(cg.path.name.startswith("run-00000000000000aa-") for cg in mine)
        assert parent.remove_owner("00000000000000aa") is True
        assert not any(cg.path.exists() for cg in mine) and theirs.path.exists()
        assert parent.remove_owner("00000000000000aa") is True  # nothing left: still done
    finally:
        for cg in mine + [theirs]:
            cg.remove()


def test_an_emptied_cgroup_is_reused_and_a_charged_one_is_not():
    parent, reason = PidsCgroupParent.detect()
    if parent is None:
        pytest.skip(f"no usable pids cgroup here: {reason}")
    parent = PidsCgroupParent(parent.path, parent.version, parent.mount)  # its own idle list
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]

    def start_inside(cg):
        if cg.can_run_inside:
            return cg.run_inside(lambda: subprocess.Popen(sleeper))
        p = subprocess.Popen(sleeper)
        (cg.path / "cgroup.procs").write_text(str(p.pid))
        return p

    cg = parent.acquire(pids_max=4)
    try:
        p = start_inside(cg)
        p.kill()
        p.wait()  # reaped: nothing charged any more
        parent.release(cg)
        again = parent.acquire(pids_max=6)
        assert again is cg and (cg.path / "pids.max").read_text().strip() == "6"
        assert cg.limit_hits() == 0

        zombie = start_inside(cg)
        zombie.kill()
        deadline = time.monotonic() + 5
        while cg.pids() and time.monotonic() < deadline:  # dead, but not reaped: still charged
            time.sleep(0.01)
        assert cg.current() == 1
        parent.release(cg)  # not kept: removed (rmdir does not wait for the zombie)
        assert not cg.path.exists()
        zombie.wait()
        fresh = parent.acquire(pids_max=4)
        assert fresh is not cg
        parent.release(fresh)
        assert fresh.path.exists()  # idle, kept for the next execution ...
    finally:
        parent.close()
    assert not fresh.path.exists()  # ... until the parent closes
