"""ace_jax/train/summary.py: the lines a run ends with, from a known metrics file."""
import json

from ace_jax.train import summary


def test_the_run_summary_states_the_curves_and_where_things_are(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "rollout/valid_rate": v} for s, v in enumerate([0.0, 0.5, 0.5, 1.0])]
    rows[0].update({"probe/updates": 0.0, "probe/score": 0.1, "probe/valid_rate": 0.25})
    rows.append({"step": 4, "probe/updates": 4.0, "probe/score": 0.3, "probe/valid_rate": 0.5})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    curves = summary.run_curves(str(path))
    assert curves == {"steps": 4, "window": 2, "valid_first": 0.25, "valid_last": 0.75,
                      "probes": [{"updates": 0.0, "score": 0.1, "valid_rate": 0.25},
                                 {"updates": 4.0, "score": 0.3, "valid_rate": 0.5}]}
    assert summary.run_curves(None) == {} and summary.run_curves(str(tmp_path / "no")) == {}
    text = summary.format_run_summary(dict(
        name="local", steps=4, minutes=1.25, generated_tokens=12345, curves=curves, metrics="gs://b/r/m.jsonl",
        checkpoints="gs://b/r/checkpoints", tensorboard="gs://b/r/tensorboard"))
    assert text.splitlines()[0] == \
        "done: local: 4 RL steps in 1.2 min, 12,345 completion tokens generated"
    assert "0.25 (first 2 steps) -> 0.75 (last 2)" in text
    assert "score 0.100 -> 0.300, valid rate 0.25 -> 0.50 (after 0 -> 4 updates)" in text
    assert "tensorboard --logdir gs://b/r/tensorboard" in text and "gs://b/r/checkpoints" in text


def test_the_run_summary_repeats_what_its_tasks_lack():
    """An MLE-bench task whose leaderboard is a Git LFS pointer, and one graded by our fallback
    metric, are each named at the end of the run; a task that lacks neither adds no line."""
    import types

    lfs = types.SimpleNamespace(task_id="a", leaderboard_error="a.csv is a Git LFS pointer; run "
                                "`git lfs pull`", grader_source="mlebench")
    ours = types.SimpleNamespace(task_id="b", leaderboard_error="", grader_source="ours:auc",
                                 grader_name="auc-roc")
    fine = types.SimpleNamespace(task_id="c", leaderboard_error="", grader_source="mlebench:staged")
    text = summary.format_run_summary(dict(name="", steps=1, minutes=1.0, metrics="m",
                                           checkpoints="c", tensorboard="t"),
                                      tasks=[lfs, ours, fine])
    warnings = [line for line in text.splitlines() if line.startswith("  warning")]
    assert warnings == [
        "  warning         a: a.csv is a Git LFS pointer; run `git lfs pull`",
        "  warning         b: graded by our fallback metric 'auc', not MLE-bench's grader "
        "'auc-roc' (install MLE-bench: scripts/install_mlebench.sh)"]
