"""Hostile and broken agent code, against the process and the bubblewrap backends.

Every test checks the status it expects, that the pool still serves a good script afterwards,
and that no process of the execution is alive afterwards. What the process backend cannot
enforce (network, visibility, the host's own processes) is skipped for it with the reason.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import uuid

import pytest

from sandbox.result import Status
from tests.sandbox.conftest import GOOD_CODE, TEST_LIMITS, leftover_processes, processes_with


def run_checked(pool, task, code, **kwargs):
    """Runs ``code``; afterwards no process of this pool is alive and a good script still works."""
    result = pool.run(task, code, **kwargs)
    assert leftover_processes(pool) == [], "a process outlived its execution"
    healthy = pool.run(task, GOOD_CODE)
    assert healthy.status is Status.OK, (healthy.status, healthy.error, healthy.stderr)
    return result


def short(task, seconds=1.5):
    return dataclasses.replace(task, time_limit_s=seconds)


def needs_isolation(pool, what: str):
    if pool.backend.name == "process":
        pytest.skip(f"process backend does not isolate {what} (documented in "
                    "sandbox/backends/process.py); bwrap does")


def needs_pid_limit(pool):
    if pool.backend.cgroup_parent is None and os.getuid() == 0:
        pytest.skip("no pids cgroup and running as root (RLIMIT_NPROC does not bind root): a fork "
                    f"bomb would only be stopped by the timeout; cgroup: {pool.backend.cgroup_reason}")


def test_infinite_loop_times_out(pool, fake_task):
    r = run_checked(pool, short(fake_task, 1.0), "while True:\n    pass\n")
    assert r.status is Status.TIMEOUT, (r.status, r.error)
    assert r.wall_s >= 1.0       # killed at its limit, not before (how soon after: load-bound)


def pid_limit_notes(result) -> list:
    return [n for n in result.notes if n.startswith("pid limit")]


def test_fork_bomb_is_contained_and_reported(pool, fake_task):
    needs_pid_limit(pool)
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_checked(pool, short(fake_task, 1.5), code)
    assert r.status in (Status.RUNTIME_ERROR, Status.TIMEOUT), (r.status, r.error)
    if pool.backend.cgroup_parent is not None:  # the cgroup counts what it refused
        assert pid_limit_notes(r) and "pid limit" in r.error, (r.notes, r.error)
        # The bomb's processes were alive at the kill; the cgroup caps them (the script, and
        # under bwrap bwrap itself, hold slots of their own).
        assert 1 <= r.leftovers_killed < TEST_LIMITS["pids_max"], r.leftovers_killed
        assert "other process(es) killed" in r.error


def test_thread_bomb_does_not_read_as_a_plain_timeout(pool, fake_task):
    needs_pid_limit(pool)
    # Small stacks and room for glibc's per-thread malloc arenas: the pid limit binds first.
    code = ("import threading, time\nthreading.stack_size(1 << 16)\nwhile True:\n    try:\n"
            "        threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "    except (RuntimeError, MemoryError):\n        pass\n")
    task = dataclasses.replace(fake_task, time_limit_s=1.5, memory_limit_mb=4096)
    r = run_checked(pool, task, code)
    assert r.status is Status.TIMEOUT, (r.status, r.error)
    if pool.backend.cgroup_parent is not None:
        assert pid_limit_notes(r) and "pid limit" in r.error, (r.notes, r.error)
        assert r.leftovers_killed == 0  # threads, not processes: nothing else to kill


def test_a_plain_timeout_reports_nothing_more(pool, fake_task):
    r = run_checked(pool, short(fake_task, 1.0), "while True:\n    pass\n")
    assert r.status is Status.TIMEOUT and r.notes == () and r.leftovers_killed == 0, r
    assert r.error == "wall-clock time limit exceeded; the process tree was killed"


def test_memory_bomb_is_oom(pool, fake_task):
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(32 << 20))\n"
    r = run_checked(pool, dataclasses.replace(fake_task, memory_limit_mb=192, time_limit_s=10), code)
    assert r.status is Status.OOM, (r.status, r.error, r.stderr[-500:])


def test_one_huge_file_hits_the_file_size_limit(pool, fake_task):
    # file_size_mb=8 in the test pools: the 9th MiB fails with EFBIG.
    code = "with open('working/big.bin', 'wb') as f:\n    for _ in range(64):\n        f.write(b'x' * (1 << 20))\n"
    r = run_checked(pool, fake_task, code)
    assert r.status is Status.RUNTIME_ERROR, (r.status, r.error)
    assert "File too large" in r.stderr or "EFBIG" in r.stderr or "27" in r.error


def test_many_files_hit_the_disk_limit_and_host_disk_is_untouched(pool, fake_task):
    # disk_mb=32 in the test pools; 4 MiB files stay under the per-file limit.
    code = ("import time\nfor i in range(200):\n"
            "    with open(f'working/f{i}.bin', 'wb') as f:\n        f.write(b'x' * (4 << 20))\n"
            "    time.sleep(0.01)\n")
    before = shutil.disk_usage(pool.backend.root_dir).used
    r = run_checked(pool, short(fake_task, 5.0), code)
    assert r.status is Status.RUNTIME_ERROR, (r.status, r.error)
    assert "disk limit" in r.error
    assert list(pool.backend.root_dir.glob("run-*/**/f*.bin")) == []  # the files are gone
    # and so is the working dir, but a warm interpreter's (emptied: the line above)
    assert [p for p in pool.backend.root_dir.glob("run-*") if "-warm-" not in p.name] == []
    assert shutil.disk_usage(pool.backend.root_dir).used - before < 64 << 20


def test_tmp_is_capped(pool, fake_task):
    code = "import tempfile\nwith tempfile.TemporaryFile() as f:\n    for _ in range(64):\n        f.write(b'x' * (1 << 20))\n"
    r = run_checked(pool, fake_task, code)
    assert r.status is Status.RUNTIME_ERROR, (r.status, r.error)


def test_huge_stdout_is_bounded_and_still_classified(pool, fake_task):
    code = GOOD_CODE + "import sys\nfor _ in range(64):\n    sys.stdout.write('y' * (1 << 20))\nprint()\nprint('VALIDATION_METRIC: 0.5')\n"
    r = run_checked(pool, fake_task, code)
    assert r.status is Status.OK and r.dev_score == 0.0, (r.status, r.error)
    assert len(r.stdout) < 10_000
    assert "bytes omitted" in r.stdout
    assert r.reported_metric == 0.5  # the tail is kept, the last metric line wins


def test_network_is_unreachable(pool, fake_task):
    needs_isolation(pool, "the network")
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    port = server.getsockname()[1]
    code = f"""
import socket
for addr in [("127.0.0.1", {port}), ("1.1.1.1", 80), ("8.8.8.8", 53)]:
    try:
        socket.create_connection(addr, timeout=0.5).close()
        print("CONNECTED", addr)
    except OSError as e:
        print("BLOCKED", addr, e)
"""
    try:
        r = run_checked(pool, fake_task, code)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody reached the host's listener
    finally:
        server.close()
    assert "CONNECTED" not in r.stdout and r.stdout.count("BLOCKED") == 3, r.stdout


def test_private_and_hidden_paths_are_not_visible(pool, fake_task):
    needs_isolation(pool, "the file system")
    private = os.fspath(fake_task.private_dir / "dev_answers.csv")
    code = f"""
import os
print("private exists:", os.path.exists({private!r}))
print("hidden:", [p for p in {list(fake_task.hidden_paths)!r} if os.path.exists(p) and os.listdir(p)])
print("project tree:", os.path.exists({os.path.abspath("sandbox")!r}))
try:
    from sklearn.datasets import load_iris
    load_iris()
    print("IRIS LOADED")
except Exception as e:
    print("iris blocked:", type(e).__name__)
"""
    r = run_checked(pool, short(fake_task, 30.0), code)  # importing sklearn is slow on 2 busy cores
    assert r.status is Status.NO_SUBMISSION, (r.status, r.error, r.stderr[-500:])
    assert "private exists: False" in r.stdout
    assert "hidden: []" in r.stdout
    assert "project tree: False" in r.stdout
    assert "IRIS LOADED" not in r.stdout and "iris blocked" in r.stdout


def test_writing_outside_the_working_dir_fails(pool, fake_task):
    needs_isolation(pool, "writes outside the working dir (as root nothing is read-only)")
    target = os.path.join(os.path.dirname(os.path.dirname(os.__file__)), f"evil-{uuid.uuid4().hex}")
    code = f"""
for path in ["input/train.csv", "input/new.csv", {target!r}, "/usr/evil", "/etc/evil"]:
    try:
        open(path, "a").write("x")
        print("WROTE", path)
    except OSError as e:
        print("refused", path, e.errno)
"""
    before = (fake_task.public_dir / "train.csv").read_bytes()
    r = run_checked(pool, fake_task, code)
    assert "WROTE" not in r.stdout, r.stdout
    assert not os.path.exists(target)
    assert r.stdout.count("refused") == 5
    assert (fake_task.public_dir / "train.csv").read_bytes() == before


def test_input_writes_never_reach_the_task_public_dir(pool, fake_task):
    code = """
import os
for path in ["input/train.csv", "input/new.csv"]:
    try:
        os.chmod("input", 0o755); os.chmod(path, 0o644) if os.path.exists(path) else None
        open(path, "a").write("tampered")
    except OSError as e:
        print("refused", path, e.errno)
"""
    before = sorted((p.name, p.read_bytes()) for p in fake_task.public_dir.iterdir())
    run_checked(pool, fake_task, code)
    assert sorted((p.name, p.read_bytes()) for p in fake_task.public_dir.iterdir()) == before


def test_signalling_the_parent_leaves_the_pool_alive(pool, fake_task):
    needs_isolation(pool, "the host's processes (a script of the host uid can signal the pool)")
    code = """
import os, signal
for action in (lambda: os.kill(os.getppid(), signal.SIGKILL),
               lambda: os.kill(os.getppid(), signal.SIGTERM),
               lambda: os.killpg(os.getpgid(os.getppid()), signal.SIGTERM),
               lambda: os.kill(-1, signal.SIGTERM)):
    try:
        action()
    except OSError as e:
        print("refused", e.errno)
print("ppid", os.getppid())
"""
    run_checked(pool, fake_task, code)  # this test process and the pool survived


def test_daemon_is_killed_at_the_end(pool, fake_task):
    token = f"daemon-{uuid.uuid4().hex}"
    code = f"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execve(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", {token!r}], {{}})
    os._exit(0)
time.sleep(0.3)
print("parent done")
"""
    r = run_checked(pool, fake_task, code)
    assert r.status is Status.NO_SUBMISSION, (r.status, r.error)
    assert "parent done" in r.stdout
    assert processes_with(token) == []


def test_stdin_is_at_eof(pool, fake_task):
    r = run_checked(pool, short(fake_task, 2.0), "import sys\nprint('stdin:', repr(sys.stdin.read()))\n")
    assert r.status is Status.NO_SUBMISSION, (r.status, r.error)
    assert "stdin: ''" in r.stdout
    assert r.wall_s < 1.5


def test_syntax_error(pool, fake_task):
    r = run_checked(pool, fake_task, "def f(:\n    pass\n")
    assert r.status is Status.SYNTAX_ERROR
    assert "line 1" in r.error
    assert r.exit_code is None  # never ran


def test_wrong_ids_are_invalid_submission(pool, fake_task):
    code = "open('submission/submission.csv', 'w').write('id,y\\nnope,1\\n')\n"
    r = run_checked(pool, fake_task, code)
    assert r.status is Status.INVALID_SUBMISSION, (r.status, r.error)
    assert "ids" in r.error
    assert r.dev_score is None and not r.valid_submission


def test_symlinked_submission_is_refused(pool, fake_task):
    answers = os.fspath(fake_task.private_dir / "dev_answers.csv")
    code = f"import os\nos.symlink({answers!r}, 'submission/submission.csv')\n"
    r = run_checked(pool, fake_task, code)
    assert r.status is Status.INVALID_SUBMISSION, (r.status, r.error)
    assert "symlink" in r.error
