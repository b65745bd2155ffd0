"""Warm interpreters (``sandbox.backends.warm`` and ``sandbox.runner``'s zygote): scripts forked
from a bwrap sandbox that preloaded their imports behave as cold ones, and cannot reach each
other or the zygote. The hostile-code suite (``test_hostile.py``) also runs against a warm pool
("bwrap-warm")."""
from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import time

import pytest

from sandbox.backends.warm import DEFAULT_PRELOAD
from sandbox.pool import SandboxPool
from sandbox.result import Status
from tests.sandbox.conftest import GOOD_CODE, TEST_LIMITS, bwrap_skip_reason

# An unseeded forest: its score depends on numpy's global RNG; the hash and `random` are printed.
SKLEARN_CODE = """
import random, sys
print("preloaded:", "sklearn.ensemble" in sys.modules)
import numpy as np
import pandas as pd
from sklearn.ensemble import RandomForestRegressor
train = pd.read_csv("input/train.csv")
test = pd.read_csv("input/test.csv")
model = RandomForestRegressor(n_estimators=3, max_features=1.0, bootstrap=True)
model.fit(train[["x"]], train["y"] + np.random.normal(size=len(train)))
pd.DataFrame({"id": test["id"], "y": model.predict(test[["x"]])}).to_csv(
    "submission/submission.csv", index=False)
print("draws:", random.random(), np.random.random(), hash("abc"))
"""


@pytest.fixture(scope="module")
def pools(tmp_path_factory):
    reason = bwrap_skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("warm_runs")
    cold = SandboxPool("bwrap", 2, root_dir=root, **TEST_LIMITS)
    warm = SandboxPool("bwrap", 2, root_dir=root, preload=DEFAULT_PRELOAD, max_idle_warm=2,
                       **TEST_LIMITS)
    yield cold, warm
    warm.close()
    cold.close()


def test_a_warm_script_scores_and_prints_as_a_cold_one(pools, fake_task):
    cold, warm = pools
    task = dataclasses.replace(fake_task, time_limit_s=60.0)
    runs = {name: [p.run(task, SKLEARN_CODE) for _ in range(2)]
            for name, p in (("cold", cold), ("warm", warm))}
    for name, rs in runs.items():
        assert all(r.status is Status.OK for r in rs), [(r.status, r.stderr) for r in rs]
    draws = {name: {tuple(r.stdout.split("draws:")[1].split()) for r in rs}
             for name, rs in runs.items()}
    assert all(len(d) == 1 for d in draws.values()), draws  # the same draws, every time
    # numpy's stream (what sklearn draws from) and the hash agree across the two ways too;
    # Python's `random` may not: an import of the script (sklearn.ensemble) draws from it when
    # cold, and was done by the zygote when warm.
    (cold_draws,), (warm_draws,) = draws["cold"], draws["warm"]
    assert cold_draws[1:] == warm_draws[1:], draws
    scores = {r.dev_score for rs in runs.values() for r in rs}
    assert len(scores) == 1, scores
    assert all("preloaded: True" in r.stdout for r in runs["warm"])
    assert all("preloaded: False" in r.stdout for r in runs["cold"])
    # The imports were paid once, by the zygote, not by the script.
    assert max(r.cpu_s for r in runs["warm"]) < min(r.cpu_s for r in runs["cold"])


def test_a_traceback_is_the_one_python_prints(pools, fake_task):
    code = "import numpy\n\ndef f():\n    return 1 / 0\n\nf()\n"
    outs = [p.run(fake_task, code) for p in pools]
    for r in outs:
        assert r.status is Status.RUNTIME_ERROR and r.exit_code == 1
        assert r.stderr.startswith("Traceback (most recent call last):\n"
                                   '  File "/workspace/solution.py", line 6, in <module>\n'), r.stderr
        assert "runner" not in r.stderr and r.stderr.rstrip().endswith("ZeroDivisionError: division by zero")
    assert outs[0].stderr == outs[1].stderr
    exits = [p.run(fake_task, "import sys\nsys.exit(3)\n").exit_code for p in pools]
    assert exits == [3, 3]


def test_nothing_of_one_execution_reaches_the_next(pools, fake_task):
    _, warm = pools
    write = ("import os\nopen('working/secret', 'w').write('1')\nopen('/tmp/secret', 'w').write('1')\n"
             "os.makedirs('locked/deep')\nos.chmod('locked', 0)\nimport numpy\nnumpy.leaked = 1\n")
    look = ("import os, numpy\nprint(sorted(os.listdir('.')), sorted(os.listdir('/tmp')), "
            "hasattr(numpy, 'leaked'))\n")
    assert warm.run(fake_task, write).status is Status.NO_SUBMISSION
    r = warm.run(fake_task, look)
    assert r.stdout.strip() == "['input', 'solution.py', 'submission', 'working'] [] False", r.stdout


def test_a_script_cannot_kill_or_trace_its_zygote(pools, fake_task):
    _, warm = pools
    warm.run(fake_task, GOOD_CODE)
    before = warm.backend.warm.resident_pids()
    code = """
import os, signal
for act in (lambda: os.kill(1, signal.SIGKILL), lambda: os.kill(1, signal.SIGTERM),
            lambda: os.kill(-1, signal.SIGKILL), lambda: open("/proc/1/mem", "rb").read(1),
            lambda: open("/proc/1/environ", "rb").read()):
    try:
        act()
        print("done")
    except OSError as e:
        print("refused", e.errno)
"""
    r = warm.run(fake_task, code)
    assert r.status is Status.NO_SUBMISSION, (r.status, r.error, r.stderr)
    assert r.stdout.count("refused") >= 2, r.stdout  # /proc/1 is not readable: not dumpable
    after = warm.run(fake_task, GOOD_CODE)
    assert after.status is Status.OK
    assert warm.backend.warm.resident_pids() & before  # the same zygote served on


def test_a_dead_zygote_is_an_error_once_then_replaced(pools, fake_task):
    _, warm = pools
    warm.run(fake_task, GOOD_CODE)
    future = warm.submit(fake_task, "import time\ntime.sleep(30)\n")
    deadline = time.monotonic() + 25
    while not _busy(warm) and time.monotonic() < deadline:   # the job has started
        time.sleep(0.05)
    assert _busy(warm), "the job never started"
    for pid in warm.backend.warm.resident_pids() | {z.pid for z in _busy(warm)}:
        try:
            os.kill(pid, signal.SIGKILL)  # from the host: the zygote and its bwrap die
        except ProcessLookupError:
            pass
    r = future.result()
    assert r.status is Status.SANDBOX_ERROR and "warm interpreter" in r.error, (r.status, r.error)
    assert warm.run(fake_task, GOOD_CODE).status is Status.OK


def _busy(pool):
    return [z for z in pool.backend.warm.busy()]


def test_idle_zygotes_are_capped_and_a_broken_one_falls_back_to_cold(pools, fake_task, tmp_path):
    _, warm = pools
    tasks = []
    for i in range(3):  # three tasks: three zygotes, of which max_idle_warm=2 stay
        d = tmp_path / f"t{i}"
        d.mkdir()
        (d / "train.csv").write_text("id,x,y\n")
        tasks.append(dataclasses.replace(fake_task, public_dir=d))
    for t in tasks:
        assert warm.run(t, "print(1)\n").stdout == "1\n"
    assert len(warm.backend.warm.resident_pids()) == 2 * 2  # zygote + its bwrap, per idle one
    backend = warm.backend
    real = backend.zygote_command
    backend.zygote_command = lambda *a, **k: ["/bin/false"]
    try:
        other = dataclasses.replace(fake_task, public_dir=shutil.copytree(
            fake_task.public_dir, tmp_path / "copy"))
        before = backend.warm.cold_fallbacks
        r = warm.run(other, GOOD_CODE)
    finally:
        backend.zygote_command = real
    assert r.status is Status.OK and backend.warm.cold_fallbacks == before + 1


def test_what_outlives_the_script_is_killed_and_counted(pools, fake_task):
    _, warm = pools
    code = ("import subprocess, sys\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n"
            "subprocess.run([sys.executable, '-c', 'pass'])\n")  # reaped: not counted
    r = warm.run(fake_task, code)
    assert r.status is Status.NO_SUBMISSION, (r.status, r.error, r.stderr)
    assert r.leftovers_killed == 1, r


def test_preload_is_bwrap_only_and_auto_resolves_per_backend():
    from sandbox.pool import resolve_preload

    with pytest.raises(ValueError, match="needs the bwrap backend"):
        SandboxPool("process", 1, preload=("numpy",))
    assert resolve_preload("auto", "bwrap") == DEFAULT_PRELOAD
    assert resolve_preload("auto", "process") == resolve_preload("", "bwrap") == ()
    assert resolve_preload(" numpy, pandas ", "bwrap") == ("numpy", "pandas")
    with pytest.raises(TypeError, match="string"):
        resolve_preload(("numpy",), "bwrap")
