"""The MLE-bench adapter on small competition directories the test writes itself."""
import math
import textwrap

import numpy as np
import pandas as pd
import pytest

from sandbox.grading import InvalidSubmissionError
from sandbox.tasks import mlebench

CLASSES = ["EAP", "HPL", "MWS"]


def _write_competition(root, cid, grader_name, grade_fn="mlebench.competitions.x.grade:grade",
                       n=40, leaderboard=(0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.9, 1.0, 1.1)):
    """MLE-bench layout: <root>/<cid>/prepared/{public,private} + config.yaml etc. in <root>/<cid>."""
    rng = np.random.default_rng(0)
    pub = root / cid / "prepared" / "public"
    priv = root / cid / "prepared" / "private"
    pub.mkdir(parents=True)
    priv.mkdir(parents=True)
    ids = [f"id{i:05d}" for i in range(n)]
    y = rng.integers(0, 3, n)
    pd.DataFrame({"id": [f"tr{i}" for i in range(10)], "text": "x", "author": "EAP"}).to_csv(
        pub / "train.csv", index=False)
    pd.DataFrame({"id": ids, "text": "some text"}).to_csv(pub / "test.csv", index=False)
    sample = pd.DataFrame({"id": ids, **{c: 1 / 3 for c in CLASSES}})
    sample.to_csv(pub / "sample_submission.csv", index=False)
    answers = pd.DataFrame({"id": ids, **{c: (y == k).astype(int) for k, c in enumerate(CLASSES)}})
    answers.to_csv(priv / "test.csv", index=False)
    (pub / "description.md").write_text("# public copy\n")
    comp = root / cid
    (comp / "config.yaml").write_text(textwrap.dedent(f"""\
        id: {cid}
        name: Toy
        competition_type: simple
        awards_medals: true
        description: mlebench/competitions/{cid}/description.md
        dataset:
          answers: {cid}/prepared/private/test.csv
          sample_submission: {cid}/prepared/public/sample_submission.csv
        grader:
          name: {grader_name}
          grade_fn: {grade_fn}
        """))
    (comp / "description.md").write_text("# Toy authors\nPredict the author.\n")
    pd.DataFrame({"teamName": [f"t{i}" for i in range(len(leaderboard))],
                  "score": list(leaderboard)}).to_csv(comp / "leaderboard.csv", index=False)
    return answers


def test_loads_and_grades_with_our_metric(tmp_path):
    answers = _write_competition(tmp_path, "toy-spooky", "multi-class-log-loss")
    task = mlebench.load_mlebench_task("toy-spooky", tmp_path)
    assert task.grade_fn is None  # mlebench is not installed here
    assert (task.metric, task.lower_is_better, task.target_columns) == ("log_loss", True, tuple(CLASSES))
    assert task.description.startswith("# Toy authors")
    assert str(task.private_dir) in task.hidden_paths
    assert len(task.leaderboard) == 10 and task.gold == 0.2
    dev, final = task._split_answers("dev"), task._split_answers("test")
    assert len(dev) == 20 and len(final) == 20 and set(dev["id"]).isdisjoint(final["id"])
    assert task.baseline_score == pytest.approx(math.log(3))

    answers.sample(frac=1, random_state=1).to_csv(tmp_path / "gold.csv", index=False)
    assert task.grade(tmp_path / "gold.csv", "dev") < 1e-12
    assert task.grade(tmp_path / "gold.csv", "test") < 1e-12
    assert task.position_score(0.0) == 1.0 and task.medal(0.0).gold
    answers.iloc[:-1].to_csv(tmp_path / "short.csv", index=False)
    with pytest.raises(InvalidSubmissionError, match="wrong row count"):
        task.grade(tmp_path / "short.csv", "dev")
    answers.drop(columns=["MWS"]).to_csv(tmp_path / "cols.csv", index=False)
    with pytest.raises(InvalidSubmissionError, match=r"missing \['MWS'\]"):
        task.grade(tmp_path / "cols.csv", "dev")
    d = task.to_dict()
    assert d["grade_fn"] is None and len(d["dev_ids"]) == 20


def test_split_depends_on_seed(tmp_path):
    _write_competition(tmp_path, "toy", "multi-class-log-loss")
    a = mlebench.load_mlebench_task("toy", tmp_path, seed=0).dev_ids
    assert a == mlebench.load_mlebench_task("toy", tmp_path, seed=0).dev_ids
    assert a != mlebench.load_mlebench_task("toy", tmp_path, seed=1).dev_ids


def test_imported_grade_fn_gets_only_the_split_rows(tmp_path, monkeypatch):
    mod = tmp_path / "mods" / "fake_mlebench_grader.py"
    mod.parent.mkdir()
    mod.write_text(textwrap.dedent("""\
        class InvalidSubmissionError(Exception):
            pass

        def grade(submission, answers):
            if "EAP" not in submission.columns:
                raise InvalidSubmissionError("Submission is missing column EAP")
            assert list(submission["id"]) is not None
            return float(len(answers)) + 0.5 * float(set(submission["id"]) == set(answers["id"]))
        """))
    monkeypatch.syspath_prepend(str(mod.parent))
    answers = _write_competition(tmp_path, "custom", "some-metric-we-lack",
                                 grade_fn="fake_mlebench_grader:grade", n=31)
    task = mlebench.load_mlebench_task("custom", tmp_path)
    assert task.grade_fn is not None and task.metric == "some-metric-we-lack"
    assert task.lower_is_better  # inferred from the leaderboard order, as MLE-bench does
    answers.to_csv(tmp_path / "sub.csv", index=False)
    assert task.grade(tmp_path / "sub.csv", "dev") == 15.5   # 15 dev rows, ids restricted
    assert task.grade(tmp_path / "sub.csv", "test") == 16.5
    answers.drop(columns=["EAP"]).to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(InvalidSubmissionError, match="missing column EAP"):
        task.grade(tmp_path / "bad.csv", "dev")
    answers.iloc[:5].to_csv(tmp_path / "few.csv", index=False)
    with pytest.raises(InvalidSubmissionError, match="26 answer ids missing"):
        task.grade(tmp_path / "few.csv", "dev")
    assert task.to_dict()["grade_fn"] == "fake_mlebench_grader:grade"


def test_unknown_grader_without_mlebench_is_a_clear_error(tmp_path):
    _write_competition(tmp_path, "odd", "quadratic-weighted-kappa-v9")
    with pytest.raises(mlebench.UnsupportedGraderError, match="quadratic-weighted-kappa-v9"):
        mlebench.load_mlebench_task("odd", tmp_path)


def test_missing_files_are_named(tmp_path):
    _write_competition(tmp_path, "toy", "accuracy")
    (tmp_path / "toy" / "prepared" / "private" / "test.csv").unlink()
    with pytest.raises(FileNotFoundError, match="private/test.csv"):
        mlebench.load_mlebench_task("toy", tmp_path)


def test_label_competition_with_accuracy(tmp_path):
    root = tmp_path
    pub, priv = root / "cls" / "prepared" / "public", root / "cls" / "prepared" / "private"
    pub.mkdir(parents=True)
    priv.mkdir(parents=True)
    ids = [str(i) for i in range(20)]
    pd.DataFrame({"PassengerId": ids, "Transported": [True] * 20}).to_csv(
        pub / "sample_submission.csv", index=False)
    truth = pd.DataFrame({"PassengerId": ids, "Transported": [i % 2 == 0 for i in range(20)]})
    truth.to_csv(priv / "test.csv", index=False)
    (root / "cls" / "config.yaml").write_text("grader:\n  name: accuracy\n")
    task = mlebench.load_mlebench_task("cls", root)
    assert task.labels == ("False", "True") and task.leaderboard == []
    truth.to_csv(tmp_path / "gold.csv", index=False)
    assert task.grade(tmp_path / "gold.csv", "dev") == 1.0
    assert task.baseline_score == pytest.approx(
        np.mean([int(i) % 2 == 0 for i in sorted(task.dev_ids)]))
    with pytest.raises(ValueError, match="no reference leaderboard"):
        task.medal_thresholds()
