"""The offline suite: registry, prepared layout, determinism, graders, seed corpus, leaderboards."""
import ast
import json
import re

import numpy as np
import pandas as pd
import pytest

from sandbox import grading, seed_corpus
from sandbox.grading import InvalidSubmissionError
from sandbox.prepare import file_checksums
from sandbox.tasks import base, offline_suite, registry

TASK_IDS = registry.list_tasks(family="offline")


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    """Every task prepared once with seed 0: {task_id: Task}."""
    root = tmp_path_factory.mktemp("suite")
    return {t: registry.load_task(t, root, seed=0) for t in TASK_IDS}


def _answers(task, split):
    return pd.read_csv(task.private_dir / base.ANSWER_FILES[split], dtype={"id": str})


def _gold_submission(task, path):
    gold = pd.concat([_answers(task, "dev"), _answers(task, "test")]).sample(frac=1, random_state=0)
    gold.to_csv(path, index=False)
    return gold


def test_suite_size_and_coverage():
    assert len(TASK_IDS) >= 12
    specs = {s.task_id: s for s in offline_suite.SUITE}
    kinds = {grading.get_metric(s.metric).kind for s in specs.values()}
    assert kinds == {"label", "probability", "score", "real"}
    # tabular clf + regression, images, text, time series
    for t in ("breast-cancer-diagnosis", "diabetes-progression", "digits-8x8", "photo-patches",
              "support-tickets", "goog-volume", "sensor-forecast"):
        assert t in TASK_IDS
    with pytest.raises(KeyError, match="unknown task"):
        registry.get_builder("no-such-task")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(offline_suite.OfflineTaskSpec(
            "iris-species", "x", "x", "x", "accuracy", offline_suite.load_iris, "x"))


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_prepared_layout(suite, task_id):
    task = suite[task_id]
    pub = task.public_dir
    assert sorted(p.name for p in pub.iterdir()) == [
        "description.md", "sample_submission.csv", "test.csv", "train.csv"]
    assert (pub / "description.md").read_text() == task.description
    train = pd.read_csv(pub / "train.csv", dtype={"id": str})
    test = pd.read_csv(pub / "test.csv", dtype={"id": str})
    sample = pd.read_csv(pub / "sample_submission.csv", dtype={"id": str})
    dev, final = _answers(task, "dev"), _answers(task, "test")
    # test has the features only; train has them plus the target(s)
    assert list(train.columns[: test.shape[1]]) == list(test.columns)
    target_names = list(train.columns[test.shape[1]:])
    assert target_names and not set(target_names) & set(test.columns)
    assert list(sample.columns) == ["id", *task.target_columns] == list(dev.columns)
    # ids: random 8-hex strings, unique, not row order; test ids = dev + final, disjoint halves
    ids = pd.concat([train["id"], test["id"]])
    assert ids.is_unique and ids.str.fullmatch(r"[0-9a-f]{8}").all()
    assert set(dev["id"]).isdisjoint(final["id"])
    assert set(dev["id"]) | set(final["id"]) == set(test["id"]) == set(sample["id"])
    assert abs(len(dev) - len(final)) <= max(2, 0.1 * len(test))
    n = len(train) + len(test)
    assert abs(len(train) / n - 0.6) < 0.05
    # the hidden answers and the packaged source are hidden from the sandbox
    assert str(task.private_dir) in task.hidden_paths
    assert any(p.endswith("sklearn/datasets/data") for p in task.hidden_paths)
    assert task.baseline_score == pytest.approx(task.grade(pub / "sample_submission.csv", "dev"))


@pytest.mark.parametrize("task_id", TASK_IDS)
def test_gold_scores_perfectly_and_beats_sample(suite, task_id, tmp_path):
    task = suite[task_id]
    _gold_submission(task, tmp_path / "gold.csv")
    perfect = {"accuracy": 1.0, "macro_f1": 1.0, "auc": 1.0, "rmse": 0.0, "mae": 0.0}
    for split in ("dev", "test"):
        score = task.grade(tmp_path / "gold.csv", split)
        if task.metric == "log_loss":
            assert score < 1e-12
        else:
            assert score == pytest.approx(perfect[task.metric], abs=1e-9)
        assert task.better(score, task.grade(task.public_dir / "sample_submission.csv", split))
    with pytest.raises(ValueError, match="split must be one of"):
        task.grade(tmp_path / "gold.csv", "train")


def test_corrupted_submissions_raise_typed_errors(suite, tmp_path):
    task = suite["digits-8x8"]
    gold = _gold_submission(task, tmp_path / "gold.csv")
    final_id = sorted(_answers(task, "test")["id"])[0]  # a row of the half not graded on "dev"
    in_final = gold["id"] == final_id
    bad = {
        "missing_id": (gold.iloc[1:], "wrong row count"),
        "dup_id": (pd.concat([gold.iloc[:1], gold.iloc[:-1]]), "duplicate ids"),
        "nan": (gold.assign(**{"3": np.nan}), "NaN in column '3'"),
        "nan_in_final_half": (gold.assign(**{"3": gold["3"].where(~in_final, np.nan)}),
                              rf"NaN in column '3' \(1 rows; ids '{final_id}'\)"),
        "dup_of_final_row": (pd.concat([gold[~in_final].iloc[1:], gold[in_final], gold[in_final]]),
                             rf"duplicate ids: '{final_id}'; missing ids: "),
        "text_in_final_half": (gold.astype({"5": object}).assign(
            **{"5": gold["5"].astype(object).where(~in_final, "high")}),
            rf"non-numeric values in column '5', e.g. 'high' \(1 rows; ids '{final_id}'\)"),
        "wrong_cols": (gold.rename(columns={"9": "nine"}), "wrong columns"),
        "neg_prob": (gold.assign(**{"0": -0.5}), r"\[0, 1\]"),
    }
    for name, (df, match) in bad.items():
        df.to_csv(tmp_path / f"{name}.csv", index=False)
        with pytest.raises(InvalidSubmissionError, match=match):
            task.grade(tmp_path / f"{name}.csv", "dev")
    label_task = suite["support-tickets"]
    df = _gold_submission(label_task, tmp_path / "l.csv").assign(category="refunds")
    df.to_csv(tmp_path / "l.csv", index=False)
    with pytest.raises(InvalidSubmissionError, match="unknown labels"):
        label_task.grade(tmp_path / "l.csv", "dev")


def test_prepare_is_deterministic_per_seed(tmp_path):
    for task_id in TASK_IDS:
        b = registry.get_builder(task_id)
        b.prepare(tmp_path / "a" / task_id, seed=3)
        b.prepare(tmp_path / "b" / task_id, seed=3)
        b.prepare(tmp_path / "c" / task_id, seed=4)
        a = file_checksums(tmp_path / "a" / task_id)
        assert a == file_checksums(tmp_path / "b" / task_id), task_id
        c = file_checksums(tmp_path / "c" / task_id)
        for f in ("public/train.csv", "public/test.csv", "private/answers_dev.csv"):
            assert a[f] != c[f], (task_id, f)


def test_time_split_and_synthetic_labelled(suite):
    task = suite["goog-volume"]
    train = pd.read_csv(task.public_dir / "train.csv")
    test = pd.read_csv(task.public_dir / "test.csv")
    assert train["date"].max() < test["date"].min()
    for t in ("support-tickets", "sensor-forecast"):
        assert "synthetic" in suite[t].description.lower()
        assert "SYNTHETIC" in suite[t].source


def test_task_json_roundtrip_and_leaderboard_helpers(suite):
    task = suite["iris-species"]
    again = base.Task.from_json(task.to_json())
    assert again.to_dict() == task.to_dict()
    with pytest.raises(ValueError, match="unknown Task fields"):
        base.Task.from_dict({**task.to_dict(), "bogus": 1})
    with pytest.raises(ValueError, match="contradicts metric"):
        base.Task.from_dict({**task.to_dict(), "lower_is_better": False})
    assert task.has_leaderboard
    empty = base.Task.from_dict({**task.to_dict(), "leaderboard": []})
    assert not empty.has_leaderboard
    asks = (empty.medal_thresholds, lambda: empty.medal(0.1), lambda: empty.position_score(0.1))
    for ask in asks:
        with pytest.raises(base.NoLeaderboardError,
                           match=r"no reference leaderboard, so no medals or HumanRank; run "
                                 r"`python -m sandbox.sweep` for seed 0"):
            ask()
    lb = base.Task.from_dict({**task.to_dict(), "leaderboard": [0.05, 0.1, 0.2, 0.5, 1.1]})
    thr = lb.medal_thresholds()
    assert (lb.gold, lb.median, thr.bronze) == (0.05, 0.2, 0.1)  # lower is better
    assert lb.position_score(0.01) == 1.0 and lb.position_score(None) == 0.0
    assert lb.medal(0.05).gold and not lb.medal(0.3).any_medal


# ------------------------------------------------------------------------------ seed corpus

def test_seed_corpus_scripts_are_short_uniform_and_compile():
    assert set(seed_corpus.task_ids()) == set(TASK_IDS)
    for t in TASK_IDS:
        scripts = seed_corpus.list_scripts(t)
        assert 8 <= len(scripts) <= 12, t
        for s in scripts:
            ast.parse(s.code)
            n_lines = len(s.code.strip().splitlines())
            assert 15 <= n_lines <= 35, (s.path, n_lines)
            for needle in ('pd.read_csv("./input/train.csv")', 'print(f"VALIDATION_METRIC:',
                           '"./submission/submission.csv"', "train_test_split("):
                assert needle in s.code, (s.path, needle)
            assert "sklearn.datasets" not in s.code
    declared = json.loads((seed_corpus.CORPUS_DIR / "pairs.json").read_text())
    assert set(declared) == set(TASK_IDS)
    pairs = seed_corpus.improvement_pairs(measured_only=False)
    assert len(pairs) >= 4 * len(TASK_IDS)
    assert all(w.task_id == s.task_id and w.name != s.name for w, s in pairs)


def test_committed_sweep_leaderboards():
    """The sweep's outputs are committed for seed 0: every task has a spread-out leaderboard."""
    results = seed_corpus.RESULTS_DIR / "seed0"
    for t in TASK_IDS:
        lb = pd.read_csv(results / t / "leaderboard.csv")
        assert list(lb.columns) == ["team", "score", "dev_score"]
        assert len(lb) >= 8, t
        lower = grading.get_metric(offline_suite_metric(t)).lower_is_better
        s = lb["score"].to_numpy()
        assert np.all(np.diff(s) >= 0) if lower else np.all(np.diff(s) <= 0), t
        thr = grading.medal_thresholds(s, lower)
        assert thr.gold != thr.median, t  # the leaderboard is not flat
        runs = json.loads((results / t / "results.json").read_text())["runs"]
        assert {r["script"] for r in runs} == {s.name for s in seed_corpus.list_scripts(t)}
    measured = seed_corpus.improvement_pairs(seed=0)
    assert measured and {w.task_id for w, _ in measured} >= set(TASK_IDS)


def offline_suite_metric(task_id):
    return next(s.metric for s in offline_suite.SUITE if s.task_id == task_id)


def test_two_baselines_end_to_end_through_the_pool(suite):
    """The dummy and the logistic-regression scripts of one task, run by the sandbox pool."""
    from sandbox.pool import SandboxPool
    from sandbox.result import Status

    task = suite["iris-species"]
    scripts = [s for s in seed_corpus.list_scripts("iris-species")
               if s.name in ("01_dummy.py", "03_logreg_c1.py")]
    with SandboxPool("process", num_workers=2) as pool:
        dummy, logreg = pool.map([(task, s.code, "test") for s in scripts])
    for r in (dummy, logreg):
        assert r.status is Status.OK, r.error + r.stderr[-500:]
        assert r.valid_submission and r.reported_metric is not None
    assert dummy.dev_score == pytest.approx(task.baseline_score, abs=1e-3)  # class priors
    assert logreg.dev_score < 0.5 * dummy.dev_score and logreg.test_score < 0.5 * dummy.test_score
    assert re.search(r"VALIDATION_METRIC: [0-9.]+", logreg.stdout)
