"""SandboxPool: statuses, grading, ordering, utilization, shutdown; metric parsing."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import sys
import tempfile
import time
import uuid

import pytest

from sandbox import metric_parse
from sandbox.backends import (Backend, IsolationRequiredError, RawExecution, SandboxConfigError,
                              make_backend)
from sandbox.backends.base import BoundedCapture, collect_submission
from sandbox.backends.warm import WARM_INTERPRETER_MB
from sandbox.execution import execute_and_grade, with_sandbox_facts
from sandbox.memory_budget import SandboxBudgetError, host_memory_mb
from sandbox.pool import SandboxPool, default_config
from sandbox.result import ExecutionResult, Status
from tests.sandbox.conftest import GOOD_CODE, FakeTask, bwrap_skip_reason, processes_with


@pytest.fixture(scope="module")
def proc_pool(tmp_path_factory):
    token = uuid.uuid4().hex
    p = SandboxPool("process", num_workers=2, root_dir=tmp_path_factory.mktemp("runs"),
                    extra_env={"ACE_TEST_POOL": token}, grace_s=0.3)
    p.test_token = token
    yield p
    p.close()


# ---------------------------------------------------------------------------------------------
# statuses and grading


def test_ok_is_graded_on_dev_and_reports_the_metric(proc_pool, fake_task):
    r = proc_pool.run(fake_task, GOOD_CODE)
    assert r.status is Status.OK, (r.error, r.stderr)
    assert r.valid_submission and r.dev_score == 0.0 and r.test_score is None
    assert r.reported_metric == 0.0 and r.exit_code == 0 and r.error == ""
    assert r.wall_s > 0


def test_test_split_grades_both_splits(proc_pool, fake_task):
    code = GOOD_CODE.replace("2 * float(r['x'])", "2 * float(r['x']) + 1")
    r = proc_pool.run(fake_task, code, split="test")
    assert r.status is Status.OK
    assert r.dev_score == pytest.approx(1.0) and r.test_score == pytest.approx(1.0)


def test_runtime_error_keeps_the_exception_line(proc_pool, fake_task):
    r = proc_pool.run(fake_task, "print('before')\nraise KeyError('no column y')\n")
    assert r.status is Status.RUNTIME_ERROR and r.exit_code == 1
    assert r.error == "KeyError: 'no column y'"
    assert "before" in r.stdout and "Traceback" in r.stderr


def test_no_submission(proc_pool, fake_task):
    r = proc_pool.run(fake_task, "print('VALIDATION_METRIC: 0.9')\n")
    assert r.status is Status.NO_SUBMISSION and r.reported_metric == 0.9 and r.dev_score is None


def test_syntax_error_never_runs(proc_pool, fake_task):
    r = proc_pool.run(fake_task, "import os\nif True\n    pass\n")
    assert r.status is Status.SYNTAX_ERROR and r.exit_code is None and "line 2" in r.error


def test_wrong_columns_are_invalid(proc_pool, fake_task):
    code = "open('submission/submission.csv','w').write('id,target\\n')\n"
    r = proc_pool.run(fake_task, code)
    assert r.status is Status.INVALID_SUBMISSION and "columns" in r.error


def test_grader_bug_is_grader_error(proc_pool, fake_task):
    r = proc_pool.run(dataclasses.replace(fake_task, grader_bug=True), GOOD_CODE)
    assert r.status is Status.GRADER_ERROR and "grader bug" in r.error
    assert r.dev_score is None and not r.valid_submission


def test_oversized_code_is_refused(fake_task, tmp_path):
    pool = SandboxPool("process", num_workers=1, root_dir=tmp_path, max_code_bytes=100)
    with pool:
        r = pool.run(fake_task, "x = 1\n" * 50)
    assert r.status is Status.RUNTIME_ERROR and "larger than 100 bytes" in r.error


class ExplodingBackend(Backend):
    name = "exploding"

    def __init__(self):
        self.calls = 0

    def execute(self, task, code, *, cancel=None):
        self.calls += 1
        if "boom" in code:
            raise OSError("disk on fire")
        return RawExecution(exit_code=0, wall_s=0.01)


def test_a_backend_exception_becomes_sandbox_error_and_the_pool_survives(fake_task):
    with SandboxPool(ExplodingBackend(), num_workers=1) as pool:
        bad = pool.run(fake_task, "boom = 1\n")
        good = pool.run(fake_task, "x = 1\n")
    assert bad.status is Status.SANDBOX_ERROR and "OSError: disk on fire" in bad.error
    assert good.status is Status.NO_SUBMISSION


def test_a_task_without_a_budget_is_sandbox_error(proc_pool):
    r = proc_pool.run(object(), "x = 1\n")
    assert r.status is Status.SANDBOX_ERROR and "budget" in r.error


def test_bad_arguments_raise_at_submit(proc_pool, fake_task):
    with pytest.raises(ValueError, match="split"):
        proc_pool.submit(fake_task, "x=1", split="train")
    with pytest.raises(TypeError, match="code must be str"):
        proc_pool.submit(fake_task, b"x=1")
    with pytest.raises(ValueError, match="num_workers"):
        SandboxPool("process", num_workers=0)
    with pytest.raises(KeyError, match="known"):
        SandboxPool("vm")


def test_result_round_trips_through_json(proc_pool, fake_task):
    r = proc_pool.run(fake_task, GOOD_CODE)
    assert ExecutionResult.from_json(r.to_json()) == r
    bomb = ExecutionResult(status=Status.TIMEOUT, error="wall-clock time limit exceeded",
                           notes=("pid limit (32) refused 9 new processes or threads",),
                           leftovers_killed=31)
    assert ExecutionResult.from_json(bomb.to_json()) == bomb
    assert json.loads(bomb.to_json())["notes"] == list(bomb.notes)


def test_a_record_from_before_notes_loads_and_bad_notes_are_refused():
    old = {"status": "ok", "exit_code": 0, "wall_s": 1.0, "dev_score": 0.5}
    r = ExecutionResult.from_dict(old)
    assert r.notes == () and r.leftovers_killed == 0 and r.dev_score == 0.5
    with pytest.raises(TypeError, match="notes"):
        ExecutionResult.from_dict({**old, "notes": "pid limit"})  # a string, not a list
    with pytest.raises(TypeError, match="notes"):
        ExecutionResult.from_dict({**old, "notes": [1]})


def test_sandbox_facts_reach_the_result(fake_task):
    """What the backend saw (notes) and the processes it killed are kept, and named in the
    error of a failed execution: a fork bomb does not read as a plain timeout."""

    class Reporting(Backend):
        name = "reporting"

        def execute(self, task, code, *, cancel=None):
            return RawExecution(exit_code=-15, timed_out=True, leftovers_killed=31,
                                notes=["pid limit (32) refused 9 new processes or threads"])

    with SandboxPool(Reporting(), num_workers=1) as pool:
        r = pool.run(fake_task, "x = 1\n")
    assert r.status is Status.TIMEOUT and r.leftovers_killed == 31
    assert r.notes == ("pid limit (32) refused 9 new processes or threads",)
    assert r.error == ("wall-clock time limit exceeded; the process tree was killed (31 other "
                       "process(es) killed; pid limit (32) refused 9 new processes or threads)")
    assert with_sandbox_facts("x", RawExecution()) == "x"


# ---------------------------------------------------------------------------------------------
# concurrency


def test_map_preserves_order_and_runs_concurrently(proc_pool, fake_task):
    """Results come back in the order of the jobs; the first two jobs run at once (their
    scripts' own clocks overlap: a statement about order, not about how fast a loaded host is)."""
    jobs = [(fake_task, f"import time\nt = time.time()\ntime.sleep({d})\n"
                        f"print('job {i}', t, time.time())\n")
            for i, d in enumerate([1.5, 0.05, 0.3, 0.0])]
    jobs.append({"task": fake_task, "code": GOOD_CODE, "split": "test"})
    results = proc_pool.map(jobs)
    spans = []
    for i, r in enumerate(results[:4]):
        assert r.status is Status.NO_SUBMISSION and f"job {i} " in r.stdout
        spans.append([float(x) for x in r.stdout.split()[2:4]])
    assert results[4].status is Status.OK and results[4].test_score == 0.0
    (start0, end0), (start1, end1) = spans[0], spans[1]
    assert start1 < end0 and start0 < end1, spans   # two workers: job 1 ran during job 0


def test_utilization(fake_task, tmp_path):
    with SandboxPool("process", num_workers=2, root_dir=tmp_path) as pool:
        pool.map([(fake_task, "import time\ntime.sleep(0.5)\n")] * 2)
        busy = pool.utilization()
        time.sleep(0.6)
        after_idle = pool.utilization()
        pool.reset_utilization()
        time.sleep(0.05)
        reset = pool.utilization()
    assert 0.5 < busy <= 1.0
    assert after_idle < busy * 0.8
    assert reset == 0.0


def test_close_kills_running_and_cancels_queued(fake_task, tmp_path):
    token = uuid.uuid4().hex
    pool = SandboxPool("process", num_workers=1, root_dir=tmp_path, extra_env={"ACE_TEST_POOL": token})
    long_task = dataclasses.replace(fake_task, time_limit_s=60)
    running = pool.submit(long_task, "while True:\n    pass\n")
    queued = pool.submit(long_task, "x = 1\n")
    deadline = time.monotonic() + 10
    while not processes_with(token) and time.monotonic() < deadline:
        time.sleep(0.02)
    t0 = time.monotonic()
    pool.close()
    assert time.monotonic() - t0 < 5
    r = running.result(timeout=1)
    assert r.status is Status.SANDBOX_ERROR and "cancelled" in r.error
    assert queued.cancelled()
    assert processes_with(token) == []
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(fake_task, "x = 1\n")
    pool.close()  # idempotent


def test_from_config(fake_task, tmp_path):
    cfg = default_config()
    cfg.backend = "process"
    cfg.num_workers = 1
    cfg.backend_options.root_dir = str(tmp_path)
    cfg.backend_options.pids_max = 16
    with SandboxPool.from_config(cfg) as pool:
        assert pool.backend.name == "process" and pool.num_workers == 1
        assert pool.backend.limits.pids_max == 16
        assert pool.run(fake_task, GOOD_CODE).status is Status.OK


def test_the_time_cap_of_the_config_applies_to_every_execution(fake_task, tmp_path):
    cfg = default_config()
    cfg.backend, cfg.num_workers, cfg.max_time_limit_s = "process", 1, 0.5
    cfg.backend_options.root_dir = str(tmp_path)
    cfg.backend_options.grace_s = 0.1
    slow = dataclasses.replace(fake_task, time_limit_s=30.0)
    with SandboxPool.from_config(cfg) as pool:
        # What the backend shows is what it applies: a cap, and the rest from each task.
        assert pool.backend.limits.max_time_s == 0.5
        assert pool.backend.limits.time_s is None and pool.backend.limits.memory_mb is None
        t0 = time.monotonic()
        r = pool.run(slow, "while True:\n    pass\n")
        assert r.status is Status.TIMEOUT and 0.5 <= r.wall_s < 2.0, (r.status, r.wall_s)
        assert time.monotonic() - t0 < 5.0  # not the task's 30 s
        fast = dataclasses.replace(fake_task, time_limit_s=0.3)  # under the cap: its own budget
        r = pool.run(fast, "import time\ntime.sleep(2)\n")
        assert r.status is Status.TIMEOUT and r.wall_s < 0.5 + 1.0, r.wall_s
        assert pool.run(fake_task, GOOD_CODE).status is Status.OK


@pytest.mark.parametrize("cap,error", [(-1.0, ValueError), (float("nan"), ValueError),
                                       (float("inf"), ValueError), ("10", TypeError),
                                       (True, TypeError), (None, TypeError)])
def test_a_bad_time_cap_is_refused(cap, error, fake_task, tmp_path):
    with pytest.raises(error, match="max_time_limit_s"):
        SandboxPool("process", num_workers=1, root_dir=tmp_path, max_time_limit_s=cap)
    with SandboxPool("process", num_workers=1, root_dir=tmp_path) as pool:  # the next one works
        assert pool.run(fake_task, GOOD_CODE).status is Status.OK
    assert list(tmp_path.iterdir()) == []  # the refused pool made no backend, left no lock


def test_a_time_cap_with_a_built_backend_is_refused(tmp_path):
    backend = make_backend("process", root_dir=tmp_path, max_time_s=2.0)
    try:
        with pytest.raises(ValueError, match="max_time_limit_s"):
            SandboxPool(backend, num_workers=1, max_time_limit_s=5.0)
        assert backend.limits.max_time_s == 2.0  # a built backend carries its own cap
    finally:
        backend.close()


# ---------------------------------------------------------------------------------------------
# parsing units


@pytest.mark.parametrize("text,expected", [
    ("epoch 1\nVALIDATION_METRIC: 0.81\n", 0.81),
    ("VALIDATION_METRIC=1e-3", 1e-3),
    ("Validation accuracy: 0.93\n", 0.93),
    ("val_rmse=1.2", 1.2),
    ("CV score = 0.75 (+/- 0.02)", 0.75),
    ("fold 1 val_loss: 0.5 - val_acc: 0.7\nfold 2 val_loss: 0.4 - val_acc: 0.8\n", 0.8),
    ("Validation RMSE: 0.5\nVALIDATION_METRIC: 0.9\nValidation RMSE: 0.1\n", 0.9),  # strict wins
    ("VALIDATION_METRIC: 0.3\nVALIDATION_METRIC: 0.4\n", 0.4),  # last wins
    ("VALIDATION_METRIC: nan\n", None),
    ("val_loss: inf\n", None),
    ("VALIDATION_METRIC: 0.5\nVALIDATION_METRIC: nan\n", None),  # the winner is rejected
    ("accuracy: 0.9\ntrain loss 0.1\n", None),
    ("interval=3\nevaluation: 0.4\n", None),
    ("", None),
])
def test_metric_parse(text, expected):
    got = metric_parse.parse_reported_metric(text)
    assert got == expected if expected is None else got == pytest.approx(expected)


def test_metric_parse_match_details():
    m = metric_parse.find_metric("x\nval_rmse=1.25\n")
    assert m.name == "val_rmse" and not m.strict and m.line == "val_rmse=1.25"
    with pytest.raises(TypeError):
        metric_parse.parse_reported_metric(b"VALIDATION_METRIC: 1")


def test_bounded_capture():
    cap = BoundedCapture(head_bytes=5, tail_bytes=4)
    for chunk in (b"hello", b" big ", b"world", b"!end"):
        cap.feed(chunk)
    assert cap.total == 19 and cap.omitted == 10
    assert cap.text() == "hello\n...[10 bytes omitted]...\n!end"
    small = BoundedCapture(8, 8)
    small.feed("héllo".encode())
    assert small.text() == "héllo"


def test_collect_submission_refuses_symlinks_and_oversize(tmp_path):
    (tmp_path / "submission").mkdir()
    secret = tmp_path / "answers.csv"
    secret.write_text("id,y\n1,2\n")
    (tmp_path / "submission" / "submission.csv").symlink_to(secret)
    path, why = collect_submission(tmp_path, max_bytes=1 << 20)
    assert path is None and "symlink" in why
    (tmp_path / "submission" / "submission.csv").unlink()
    (tmp_path / "submission" / "submission.csv").write_text("id,y\n" + "1,2\n" * 100)
    path, why = collect_submission(tmp_path, max_bytes=50)
    assert path is None and "limit" in why
    path, why = collect_submission(tmp_path, max_bytes=1 << 20)
    assert why == "" and path.read_text().startswith("id,y\n1,2")
    os.unlink(path)


# ---------------------------------------------------------------------------------------------
# the sandbox's interpreter (sandbox.python)


def test_the_configured_interpreter_runs_the_executions(fake_task, tmp_path):
    cfg = default_config()
    cfg.backend, cfg.num_workers, cfg.python = "process", 1, sys.executable
    cfg.backend_options.root_dir = str(tmp_path)
    with SandboxPool.from_config(cfg) as pool:
        assert pool.backend.python == sys.executable
        r = pool.run(fake_task, "import sys\nprint(sys.executable)\n")
        assert r.stdout.strip() == sys.executable, (r.status, r.stderr)


@pytest.mark.parametrize("python,message", [
    ("/nonexistent/bin/python", "does not exist"),
    ("relative/venv/bin/python", "does not exist"),
    ("/etc/hostname", "not an executable file|did not run as a Python interpreter"),
])
def test_a_missing_interpreter_is_refused_at_construction(python, message, tmp_path):
    with pytest.raises(SandboxConfigError, match=message) as e:
        SandboxPool("process", num_workers=1, root_dir=tmp_path / "runs", python=python)
    assert "scripts/build_sandbox_env.sh" in str(e.value)
    if not python.startswith("/"):  # taken from the current directory, and shown resolved
        assert os.path.abspath(python) in str(e.value)
    assert not (tmp_path / "runs").exists() or not list((tmp_path / "runs").iterdir())


def test_an_interpreter_older_than_3_11_is_refused(tmp_path):
    # Answers the probe as a Python 3.8 would (a real old interpreter may not be installed).
    old = tmp_path / "python3.8"
    old.write_text('#!/bin/sh\necho \'{"version": [3, 8, 18], "prefix": "/x", "base_prefix": '
                   '"/x", "exec_prefix": "/x", "base_exec_prefix": "/x", "site_dirs": []}\'\n')
    old.chmod(0o755)
    with pytest.raises(SandboxConfigError, match=r"Python 3\.8\.18; the sandbox needs >= 3\.11"):
        SandboxPool("process", num_workers=1, root_dir=tmp_path / "runs", python=str(old))


def test_a_host_interpreter_with_docker_is_refused():
    with pytest.raises(SandboxConfigError, match="docker backend runs the image's own"):
        SandboxPool("docker", num_workers=1, python=sys.executable)


# ---------------------------------------------------------------------------------------------
# the sandbox's memory stays within the host's RAM less the trainer's


def test_a_pool_over_the_host_budget_is_refused_at_construction(fake_task, tmp_path):
    host = host_memory_mb()
    with pytest.raises(SandboxBudgetError, match="sandbox.num_workers"):
        SandboxPool("process", num_workers=2, root_dir=tmp_path / "runs", max_memory_mb=host)
    assert not list((tmp_path / "runs").iterdir())  # the refused pool closed its backend
    with SandboxPool("process", num_workers=1, root_dir=tmp_path / "runs", max_memory_mb=1024,
                     reserve_gb=0) as pool:  # a cap within the budget: built, and it applies
        big = dataclasses.replace(fake_task, memory_limit_mb=host)
        assert pool.backend.limits.max_memory_mb == 1024
        r = pool.run(big, "import resource\nprint(resource.getrlimit(resource.RLIMIT_AS)[0])\n")
        assert int(r.stdout) == 1024 << 20, (r.status, r.stdout, r.stderr)


def test_a_task_over_the_budget_is_refused_before_it_runs(fake_task, tmp_path):
    big = dataclasses.replace(fake_task, task_id="big", memory_limit_mb=host_memory_mb())
    cfg = default_config()
    cfg.backend, cfg.num_workers = "process", 1
    cfg.backend_options.root_dir = str(tmp_path / "runs")
    with pytest.raises(SandboxBudgetError, match="sandbox.max_memory_mb"):
        SandboxPool.from_config(cfg, tasks=[fake_task, big])
    assert not list((tmp_path / "runs").iterdir())
    with SandboxPool.from_config(cfg, tasks=[fake_task]) as pool:
        with pytest.raises(SandboxBudgetError):
            pool.check_tasks([big])
        with pytest.raises(SandboxBudgetError):  # and at its first submission
            pool.submit(big, GOOD_CODE)
        assert pool.run(fake_task, GOOD_CODE).status is Status.OK  # the pool carries on


def test_the_budget_counts_what_holds_ram(tmp_path):
    with SandboxPool("process", num_workers=2, root_dir=tmp_path, disk_mb=64) as pool:
        parts = pool.memory_budget(1000).per_execution
        assert parts == {"memory": 1000}  # a working dir on disk holds no RAM
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        shm = pathlib.Path(tempfile.mkdtemp(prefix="ace-budget-", dir="/dev/shm"))
        try:
            with SandboxPool("process", num_workers=2, root_dir=shm, disk_mb=64) as pool:
                parts = pool.memory_budget(1000).per_execution
                assert parts == {"memory": 1000, f"working dir in RAM ({shm})": 64}, parts
        finally:
            shutil.rmtree(shm, ignore_errors=True)
    if bwrap_skip_reason():
        return
    with SandboxPool("bwrap", num_workers=2, root_dir=tmp_path, disk_mb=64,
                     preload=("numpy",), max_idle_warm=3) as pool:
        budget = pool.memory_budget(1000)
        assert budget.per_execution == {"memory": 1000, "/tmp tmpfs": 64}
        assert budget.resident == {"3 idle warm interpreters": 3 * WARM_INTERPRETER_MB}
        assert budget.total_mb == 2 * 1064 + 3 * WARM_INTERPRETER_MB


@pytest.mark.parametrize("cap,error", [(-1, ValueError), (1.5, TypeError), ("8", TypeError)])
def test_a_bad_memory_cap_is_refused(cap, error, tmp_path):
    with pytest.raises(error, match="max_memory_mb"):
        SandboxPool("process", num_workers=1, root_dir=tmp_path, max_memory_mb=cap)


# ---------------------------------------------------------------------------------------------
# tasks that require isolation (MLE-bench's) and the process backend


@dataclasses.dataclass(frozen=True)
class IsolatedTask(FakeTask):
    """The fake task, marked as MLE-bench's tasks are (its private answers lie on the host)."""

    requires_isolation: bool = True


def test_the_process_backend_refuses_a_task_that_requires_isolation(fake_task, tmp_path):
    isolated = IsolatedTask(**dataclasses.asdict(fake_task))
    cfg = default_config()
    cfg.backend, cfg.num_workers = "process", 1
    cfg.backend_options.root_dir = str(tmp_path / "runs")
    with pytest.raises(IsolationRequiredError) as e:
        SandboxPool.from_config(cfg, tasks=[fake_task, isolated])
    for needle in ("prepared/private", "network", "apparmor_restrict_unprivileged_userns=0",
                   "sandbox.backend=bwrap", "sandbox.allow_unisolated=True"):
        assert needle in str(e.value), needle
    with SandboxPool.from_config(cfg) as pool:
        with pytest.raises(IsolationRequiredError):
            pool.submit(isolated, GOOD_CODE)
        with pytest.raises(IsolationRequiredError):  # the backend itself refuses it too
            execute_and_grade(pool.backend, isolated, GOOD_CODE)
        assert pool.run(fake_task, GOOD_CODE).status is Status.OK  # the pool carries on
    cfg.allow_unisolated = True
    with SandboxPool.from_config(cfg, tasks=[isolated]) as pool:  # allowed explicitly
        assert pool.run(isolated, GOOD_CODE).status is Status.OK
