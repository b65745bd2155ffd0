"""The memory of an execution's whole process tree is bounded by its task's budget.

RLIMIT_AS holds each process to the budget, not the tree: 4 children of 1 GiB each under a
2 GiB budget would take 4 GiB. The per-execution cgroup's memory controller
(``sandbox.backends.cgroup``) holds the tree: the kernel kills part of it, and the result says
``oom`` with what the limit did. Skipped, with the reason, where the host has no usable memory
cgroup (RLIMIT_AS per process is then all that holds, as the backend logs once).
"""
from __future__ import annotations

import dataclasses

import pytest

from sandbox.backends.cgroup import PidsCgroupParent
from sandbox.pool import SandboxPool
from sandbox.result import Status
from tests.sandbox.conftest import GOOD_CODE, bwrap_skip_reason

# 4 children, each touching 1 GiB (b"\1" * n fills it: every page resident), alive together for
# a moment; the parent exits 1 if any of them did not end well.
FOUR_CHILDREN_OF_1_GIB = """
import os, sys, time
kids = []
for _ in range(4):
    pid = os.fork()
    if pid == 0:
        block = b"\\1" * (1 << 30)
        time.sleep(1)
        os._exit(0)
    kids.append(pid)
failed = sum(os.waitpid(pid, 0)[1] != 0 for pid in kids)
print("children failed:", failed, flush=True)
sys.exit(1 if failed else 0)
"""
# Under a 1 GiB budget the parent holds 500 MiB and its child then asks for 700 MiB: each is
# within its RLIMIT_AS, the tree is not, and the OOM killer takes the larger, the child. The
# script itself carries on and exits 0.
SURVIVES_A_KILLED_CHILD = """
import os, time
pid = os.fork()
if pid == 0:
    time.sleep(1)
    block = b"\\1" * (700 << 20)
    time.sleep(2)
    os._exit(0)
ballast = b"\\1" * (500 << 20)
_, status = os.waitpid(pid, 0)
del ballast
print("child status", status, flush=True)
"""


def _memory_skip_reason(pool) -> str:
    reason = pool.backend.memory_cgroup_reason
    return f"no per-execution memory cgroup on this host: {reason}" if reason else ""


@pytest.fixture(scope="module", params=["process", "bwrap", "bwrap-warm"])
def pool(request, tmp_path_factory):
    if request.param.startswith("bwrap"):
        reason = bwrap_skip_reason()
        if reason:
            pytest.skip(reason)
    warm = dict(preload=("numpy",)) if request.param == "bwrap-warm" else {}
    p = SandboxPool(request.param.split("-")[0], num_workers=1,
                    root_dir=tmp_path_factory.mktemp("runs"), grace_s=0.3, **warm)
    reason = _memory_skip_reason(p)
    if reason:
        p.close()
        pytest.skip(reason)
    yield p
    p.close()


@pytest.fixture(scope="module")
def task_2gib(fake_task):
    return dataclasses.replace(fake_task, memory_limit_mb=2048, time_limit_s=60.0)


def test_a_tree_over_its_budget_is_killed_and_reported_as_oom(pool, task_2gib):
    r = pool.run(task_2gib, FOUR_CHILDREN_OF_1_GIB)
    assert r.status is Status.OOM, (r.status, r.error, r.stdout, r.stderr[-500:])
    assert "memory limit (2048 MiB for the whole process tree) killed" in r.error, r.error
    assert any("memory limit (2048 MiB" in n for n in r.notes), r.notes
    assert "children failed:" in r.stdout  # the script saw its children die
    # The next execution of the worker (the same cgroup, reused) starts with a clean count.
    ok = pool.run(task_2gib, GOOD_CODE)
    assert ok.status is Status.OK and not ok.notes, (ok.status, ok.notes)


def test_a_script_that_survives_a_killed_child_keeps_its_result(pool, fake_task):
    task = dataclasses.replace(fake_task, memory_limit_mb=1024, time_limit_s=60.0)
    r = pool.run(task, SURVIVES_A_KILLED_CHILD + GOOD_CODE)
    assert r.status is Status.OK, (r.status, r.error, r.stderr[-500:])
    assert "child status 9" in r.stdout  # SIGKILL by the OOM killer
    assert any("memory limit (1024 MiB" in n for n in r.notes), r.notes


def test_the_limit_follows_each_execution_budget(tmp_path):
    parent, reason = PidsCgroupParent.detect(owner="memtest0000000aa")
    if parent is None or parent.memory is None:
        pytest.skip(f"no memory cgroup here: {reason or parent.memory_reason}")
    limit_file = "memory.limit_in_bytes" if parent.memory.version == "v1" else "memory.max"
    try:
        cgroup = parent.acquire(16, 512)
        assert (cgroup.memory_dir / limit_file).read_text().strip() == str(512 << 20)
        parent.release(cgroup)
        for memory_mb in (2048, 256):  # reused: raised, then lowered (v1 memsw >= limit)
            again = parent.acquire(16, memory_mb)
            assert again is cgroup
            assert (cgroup.memory_dir / limit_file).read_text().strip() == str(memory_mb << 20)
            parent.release(again)
    finally:
        parent.close()
    assert not cgroup.memory_dir.exists() and not cgroup.path.exists()


def test_without_a_memory_cgroup_the_reason_is_given(tmp_path):
    parent, reason = PidsCgroupParent.detect(owner="memtest0000000bb", memory=False)
    if parent is None:
        pytest.skip(f"no pids cgroup here: {reason}")
    try:
        assert parent.memory is None and "memory=False" in parent.memory_reason
        cgroup = parent.acquire(16, 512)
        assert cgroup.memory_dir is None and cgroup.oom_kills() == 0
        parent.release(cgroup)
    finally:
        parent.close()
    with SandboxPool("process", num_workers=1, root_dir=tmp_path, use_cgroup=False) as pool:
        assert "no pids cgroup either" in pool.backend.memory_cgroup_reason
