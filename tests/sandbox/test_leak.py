"""Agent code cannot recover the answers from inside the bubblewrap sandbox.

One probe script tries the three known leaks of a package-built task (digits-8x8):
  * ``sklearn.datasets.load_digits()`` (the labelled source rows);
  * reading the packaged files directly and matching the public test rows against them;
  * reading the task's private answers by their host path.
The same probe under the process backend (no isolation) is the control: there every leak works,
which shows the probe would notice a leak inside bwrap. The same holds with the sandbox's own venv
(``sandbox.python``), whose sklearn has its own copy of the packaged data.

An MLE-bench-like task (its answers in ``prepared/private`` on the host, ``requires_isolation``):
the process backend refuses it unless allowed, and under bwrap the answers do not exist.
"""
import json
import pathlib
import textwrap

import pytest

from sandbox.backends.bwrap import bwrap_available
from sandbox.tasks import registry

SANDBOX_VENV = pathlib.Path(__file__).resolve().parents[2] / ".sandbox-venv"

PROBE = textwrap.dedent("""\
    import gzip, json, os
    import numpy as np
    import pandas as pd
    import sklearn, matplotlib
    out = {}
    sk_data = os.path.join(os.path.dirname(sklearn.__file__), "datasets", "data")
    out["sk_data_files"] = sorted(os.listdir(sk_data)) if os.path.isdir(sk_data) else None
    sample = os.path.join(os.path.dirname(matplotlib.__file__), "mpl-data", "sample_data")
    out["mpl_sample_files"] = sorted(os.listdir(sample)) if os.path.isdir(sample) else None
    try:
        from sklearn.datasets import load_digits
        out["load_digits_rows"] = int(load_digits().data.shape[0])
    except Exception as e:
        out["load_digits_rows"] = type(e).__name__
    try:
        raw = np.loadtxt(gzip.open(os.path.join(sk_data, "digits.csv.gz"), "rt"), delimiter=",")
        known = {tuple(r[:64].astype(int)) for r in raw}
        test = pd.read_csv("./input/test.csv").drop(columns=["id"]).to_numpy().astype(int)
        out["matched_test_rows"] = int(sum(tuple(r) in known for r in test))
    except Exception as e:
        out["matched_test_rows"] = type(e).__name__
    private = PRIVATE_DIR
    out["private_visible"] = os.path.exists(private)
    try:
        out["private_read"] = len(open(os.path.join(private, "answers_dev.csv")).read())
    except Exception as e:
        out["private_read"] = type(e).__name__
    out["n_test"] = len(pd.read_csv("./input/test.csv"))
    print("PROBE " + json.dumps(out))
    """)


@pytest.fixture(scope="module")
def digits_task(tmp_path_factory):
    return registry.load_task("digits-8x8", tmp_path_factory.mktemp("leak"), seed=0)


def _probe(backend, task):
    from sandbox.pool import SandboxPool

    code = PROBE.replace("PRIVATE_DIR", repr(str(task.private_dir)))
    with SandboxPool(backend, num_workers=1) as pool:
        r = pool.run(task, code)
    line = [l for l in r.stdout.splitlines() if l.startswith("PROBE ")]
    assert line, f"probe printed nothing ({r.status}): {r.error}\n{r.stderr[-2000:]}"
    return json.loads(line[0][len("PROBE "):])


def test_control_process_backend_leaks(digits_task):
    """Without isolation the probe recovers everything: the leak test below can fail."""
    out = _probe("process", digits_task)
    assert "digits.csv.gz" in out["sk_data_files"]
    assert out["load_digits_rows"] == 1797
    assert out["matched_test_rows"] == out["n_test"]  # every test row is in the packaged file
    assert out["private_visible"] and out["private_read"] > 0


def test_bwrap_hides_sources_and_answers(digits_task):
    ok, detail = bwrap_available()
    if not ok:
        pytest.skip(f"bubblewrap cannot create namespaces on this host: {detail}")
    out = _probe("bwrap", digits_task)
    assert not out["sk_data_files"], out  # masked: empty or absent
    assert not out["mpl_sample_files"], out
    assert isinstance(out["load_digits_rows"], str), out  # an exception name, no rows
    assert isinstance(out["matched_test_rows"], str), out  # the source file cannot be opened
    assert out["private_visible"] is False and out["private_read"] == "FileNotFoundError"
    assert out["n_test"] == len(digits_task.test_ids)  # the public input is still there


# ---------------------------------------------------------------------------------------------
# An MLE-bench-like task: its private answers lie on the host (prepared/private), beside the
# public files the sandbox binds. The process backend refuses it; bwrap runs it without them.

ANSWERS_PROBE = textwrap.dedent("""\
    import json, os
    private = PRIVATE_DIR
    out = {"input": sorted(os.listdir("input")), "private_visible": os.path.exists(private),
           "prepared_visible": os.path.exists(os.path.dirname(private))}
    try:
        out["private_read"] = len(open(os.path.join(private, "answers_dev.csv")).read())
    except Exception as e:
        out["private_read"] = type(e).__name__
    print("PROBE " + json.dumps(out))
    """)


@pytest.fixture(scope="module")
def mlebench_like_task(tmp_path_factory):
    """A ``sandbox.tasks.base.Task`` in MLE-bench's layout (<id>/prepared/{public,private}),
    marked ``requires_isolation`` as MLE-bench's tasks are."""
    from sandbox.tasks.base import Task

    prepared = tmp_path_factory.mktemp("mlebench") / "toy-competition" / "prepared"
    public, private = prepared / "public", prepared / "private"
    public.mkdir(parents=True)
    private.mkdir()
    (public / "train.csv").write_text("id,x,y\n" + "".join(f"r{i},{i},{2 * i}\n" for i in range(8)))
    (public / "test.csv").write_text("id,x\n" + "".join(f"t{i},{i}\n" for i in range(4)))
    for split, ids in (("dev", (0, 1)), ("test", (2, 3))):
        (private / f"answers_{split}.csv").write_text(
            "id,y\n" + "".join(f"t{i},{2 * i}\n" for i in ids))
    task = Task(task_id="toy-competition", description="Predict y.", public_dir=public,
                private_dir=private, metric="rmse", lower_is_better=True, target_columns=("y",))
    if not task.requires_isolation:  # before tasks.base's Task has the attribute set by default
        object.__setattr__(task, "requires_isolation", True)
    return task


def _answers_probe(task, backend, **pool_options):
    from sandbox.pool import SandboxPool

    code = ANSWERS_PROBE.replace("PRIVATE_DIR", repr(str(task.private_dir)))
    with SandboxPool(backend, num_workers=1, **pool_options) as pool:
        r = pool.run(task, code)
    line = [l for l in r.stdout.splitlines() if l.startswith("PROBE ")]
    assert line, f"probe printed nothing ({r.status}): {r.error}\n{r.stderr[-2000:]}"
    return json.loads(line[0][len("PROBE "):])


def test_the_process_backend_refuses_an_mlebench_task_unless_allowed(mlebench_like_task):
    from sandbox.backends import IsolationRequiredError
    from sandbox.pool import SandboxPool

    with SandboxPool("process", num_workers=1) as pool:
        with pytest.raises(IsolationRequiredError, match="prepared/private"):
            pool.run(mlebench_like_task, "print('never runs')\n")
    # The control: allowed explicitly, the script reads the answers (the probe would see a leak).
    out = _answers_probe(mlebench_like_task, "process", allow_unisolated=True)
    assert out["private_visible"] and out["private_read"] > 0


def test_bwrap_runs_an_mlebench_task_without_its_private_answers(mlebench_like_task):
    ok, detail = bwrap_available()
    if not ok:
        pytest.skip(f"bubblewrap cannot create namespaces on this host: {detail}")
    out = _answers_probe(mlebench_like_task, "bwrap")
    assert out["input"] == ["test.csv", "train.csv"]
    assert out["private_visible"] is False and out["prepared_visible"] is False, out
    assert out["private_read"] == "FileNotFoundError", out


def test_bwrap_with_the_sandbox_venv_hides_its_copy_of_the_sources(digits_task):
    """The sandbox's own venv has its own sklearn and matplotlib, with the same packaged data:
    the trainer-side hidden paths are masked at the same place in that venv."""
    ok, detail = bwrap_available()
    if not ok:
        pytest.skip(f"bubblewrap cannot create namespaces on this host: {detail}")
    python = SANDBOX_VENV / "bin" / "python"
    if not python.exists():
        pytest.skip(f"the sandbox venv is not built ({python}): build it with `bash "
                    "scripts/build_sandbox_env.sh .sandbox-venv` (CI builds it in the pod "
                    "rehearsal, scripts/pod_rehearsal.sh)")
    from sandbox.pool import SandboxPool

    code = PROBE.replace("PRIVATE_DIR", repr(str(digits_task.private_dir)))
    with SandboxPool("bwrap", num_workers=1, python=str(python)) as pool:
        r = pool.run(digits_task, code + "import sys\nprint('PREFIX', sys.prefix)\n")
    line = [l for l in r.stdout.splitlines() if l.startswith("PROBE ")]
    assert line, f"probe printed nothing ({r.status}): {r.error}\n{r.stderr[-2000:]}"
    out = json.loads(line[0][len("PROBE "):])
    assert f"PREFIX {SANDBOX_VENV}" in r.stdout  # it ran in the sandbox venv
    assert not out["sk_data_files"] and not out["mpl_sample_files"], out
    assert isinstance(out["load_digits_rows"], str) and isinstance(out["matched_test_rows"], str)
    assert out["private_visible"] is False
