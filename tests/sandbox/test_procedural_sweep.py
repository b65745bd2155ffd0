"""``python -m sandbox.procedural_sweep``: a baseline script of a procedural instance runs through
the sandbox pool (the normal execution path) and is graded; the compact result file merges."""
import math

import pandas as pd
import pytest

from sandbox import procedural_sweep, sweep
from sandbox.seed_corpus import procedural as proc_scripts
from sandbox.tasks import procedural, registry

TASK = "proc-linear-000"


def test_one_baseline_runs_through_the_pool_and_is_graded(tmp_path):
    from sandbox.pool import SandboxPool
    from sandbox.result import Status

    task = registry.load_task(TASK, tmp_path, seed=0)
    script = [s for s in proc_scripts.baseline_scripts(TASK) if s.name == "03_logreg_c10.py"]
    with SandboxPool("process", num_workers=1) as pool:
        rows = sweep.sweep_task(pool, task, script)
    (row,) = rows
    assert row["status"] == Status.OK.value, row["error"]
    assert math.isfinite(row["dev_score"]) and math.isfinite(row["test_score"])
    assert row["reported_metric"] is not None
    assert task.better(row["dev_score"], task.baseline_score)


def test_write_results_merges_a_subset(tmp_path):
    path = tmp_path / "p.csv"
    row = dict(team="01_dummy.py", status="ok", score=0.5, dev_score=0.25, wall_s=0.3,
               digest="ab" * 8)
    procedural_sweep.write_results(path, [dict(row, task_id="proc-rules-001"),
                                          dict(row, task_id="proc-linear-002")],
                                   ["proc-rules-001", "proc-linear-002"])
    df = procedural_sweep.write_results(path, [dict(row, task_id="proc-rules-001", score=0.75)],
                                        ["proc-rules-001"])
    assert list(df.columns) == list(procedural.RESULT_COLUMNS)
    assert list(df["task_id"]) == ["proc-linear-002", "proc-rules-001"]
    again = pd.read_csv(path, dtype={"digest": str})
    assert again.loc[again.task_id == "proc-rules-001", "score"].item() == 0.75
    assert again["digest"].iloc[0] == "ab" * 8


def test_cli_refuses_a_task_of_another_family(tmp_path):
    with pytest.raises(KeyError, match="not a procedural instance"):
        procedural_sweep.main(["--tasks=iris-species", f"--out={tmp_path / 'x.csv'}",
                               f"--cache_dir={tmp_path}"])
