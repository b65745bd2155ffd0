"""Agent code cannot recover the answers from inside the bubblewrap sandbox.

One probe script tries the three known leaks of a package-built task (digits-8x8):
  * ``sklearn.datasets.load_digits()`` (the labelled source rows);
  * reading the packaged files directly and matching the public test rows against them;
  * reading the task's private answers by their host path.
The same probe under the process backend (no isolation) is the control: there every leak works,
which shows the probe would notice a leak inside bwrap.
"""
import json
import textwrap

import pytest

from sandbox.backends.bwrap import bwrap_available
from sandbox.tasks import registry

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
