"""Metrics (against sklearn), typed format errors, MLE-bench medal thresholds, position score."""
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn import metrics as skm

from sandbox import grading
from sandbox.grading import InvalidSubmissionError


# ------------------------------------------------------------------------------ metrics

def test_registry_directions():
    lower = {n for n, m in grading.METRICS.items() if m.lower_is_better}
    assert lower == {"log_loss", "rmse", "mae", "rmsle"}
    with pytest.raises(KeyError, match="unknown metric 'nope'"):
        grading.get_metric("nope")


def test_classification_metrics_match_sklearn():
    rng = np.random.default_rng(0)
    t = rng.choice(["a", "b", "c"], size=200)
    p = np.where(rng.random(200) < 0.7, t, rng.choice(["a", "b", "c"], size=200))
    assert grading.accuracy(t[:, None], p[:, None]) == pytest.approx(skm.accuracy_score(t, p))
    assert grading.macro_f1(t[:, None], p[:, None]) == pytest.approx(
        skm.f1_score(t, p, average="macro"))


def test_log_loss_matches_sklearn_and_renormalises():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 4, 100)
    onehot = np.eye(4)[y]
    p = rng.dirichlet(np.ones(4), 100)
    assert grading.log_loss(onehot, p) == pytest.approx(skm.log_loss(y, p, labels=range(4)))
    # Kaggle divides rows by their sum: scaling a row changes nothing
    assert grading.log_loss(onehot, p * 3.0) == pytest.approx(grading.log_loss(onehot, p))
    assert math.isfinite(grading.log_loss(onehot, np.eye(4)[(y + 1) % 4]))  # clipped, finite


def test_auc_matches_sklearn_with_ties():
    rng = np.random.default_rng(2)
    t = rng.integers(0, 2, 300)
    s = np.round(rng.random(300) + 0.3 * t, 1)  # many ties
    assert grading.auc(t[:, None], s[:, None]) == pytest.approx(skm.roc_auc_score(t, s))
    with pytest.raises(ValueError, match="single class"):
        grading.auc(np.ones((5, 1)), np.arange(5.0)[:, None])


def test_regression_metrics():
    t = np.array([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0]])
    p = np.array([[1.0, 12.0], [4.0, 20.0], [3.0, 27.0]])
    assert grading.rmse(t, p) == pytest.approx(
        (np.sqrt(4 / 3) + np.sqrt((4 + 9) / 3)) / 2)
    assert grading.mae(t, p) == pytest.approx((2 / 3 + 5 / 3) / 2)
    assert grading.rmsle(t[:, :1], p[:, :1]) == pytest.approx(
        np.sqrt(skm.mean_squared_log_error(t[:, 0], p[:, 0])))
    with pytest.raises(InvalidSubmissionError, match="> -1"):
        grading.rmsle(t, -2 * np.ones_like(t))


# ------------------------------------------------------------------------------ validation

IDS = ["a1", "b2", "c3", "d4"]


def _sub(**cols):
    return pd.DataFrame({"id": IDS, **cols})


def _validate(df, metric="rmse", targets=("y",), labels=None):
    return grading.validate_submission(df, id_column="id", target_columns=targets,
                                       expected_ids=IDS, metric=metric, labels=labels)


def test_valid_submission_is_indexed_and_typed():
    out = _validate(_sub(y=["1", "2.5", "3", "4"]).iloc[::-1])
    assert list(out.index) == IDS[::-1] and out["y"].dtype == np.float64


@pytest.mark.parametrize("df, match", [
    (_sub(z=[1, 2, 3, 4]), r"wrong columns: missing \['y'\], unexpected \['z'\]"),
    (_sub(y=[1, 2, 3, 4], extra=[0, 0, 0, 0]), r"unexpected \['extra'\]"),
    (_sub(y=[1, 2, 3, 4]).iloc[:3], "wrong row count: 3 rows, expected 4"),
    (pd.DataFrame({"id": ["a1", "a1", "c3", "d4"], "y": [1, 2, 3, 4]}),
     "duplicate ids: 'a1'; missing ids: 'b2'"),
    (pd.DataFrame({"id": ["a1", "b2", "c3", "zz"], "y": [1, 2, 3, 4]}),
     "missing ids: 'd4'; unknown ids: 'zz'"),
    (pd.DataFrame({"id": ["a1", "b2", "c3", "d4", "d4"], "y": [1, 2, 3, 4, 4]}),
     r"wrong row count: 5 rows, expected 4 \(duplicate ids: 'd4'\)"),
    (pd.DataFrame({"id": ["a1", None, "c3", "d4"], "y": [1, 2, 3, 4]}), r"empty 'id' \(rows 1,"),
    (_sub(y=[1, np.nan, 3, 4]), r"NaN in column 'y' \(1 rows; ids 'b2'\)"),
    (_sub(y=[1, np.inf, 3, -np.inf]), r"infinite values in column 'y' \(2 rows; ids 'b2', 'd4'\)"),
    (_sub(y=[1, "cat", 3, 4]), "non-numeric values in column 'y', e.g. 'cat' .*ids 'b2'"),
])
def test_format_errors_are_typed_and_named(df, match):
    with pytest.raises(InvalidSubmissionError, match=match):
        _validate(df)


def test_offending_ids_are_listed_five_at_most():
    ids = [f"r{i:02d}" for i in range(12)]
    df = pd.DataFrame({"id": ids, "y": [np.nan] * 7 + [1.0] * 5})
    with pytest.raises(InvalidSubmissionError,
                       match=r"NaN in column 'y' \(7 rows; ids 'r00', 'r01', 'r02', 'r03', 'r04', "
                             r"\.\.\. \(7 in all\)\)"):
        grading.validate_submission(df, id_column="id", target_columns=("y",), expected_ids=ids,
                                    metric="rmse")


def test_probability_checks():
    ok = _sub(a=[0.5, 1, 0, 0.2], b=[0.5, 0, 1, 0.8])
    _validate(ok, "log_loss", ("a", "b"))
    with pytest.raises(InvalidSubmissionError, match=r"in \[0, 1\] \(1 rows outside; ids 'a1'\)"):
        _validate(_sub(a=[1.5, 1, 0, 0.2], b=[0.5, 0, 1, 0.8]), "log_loss", ("a", "b"))
    with pytest.raises(InvalidSubmissionError, match="sums to 0"):
        _validate(_sub(a=[0, 1, 0, 0.2], b=[0, 0, 1, 0.8]), "log_loss", ("a", "b"))


def test_label_checks_and_canonical_labels():
    out = _validate(_sub(y=[3.0, 1, "2", 3]), "accuracy", labels=["1", "2", "3"])
    assert list(out["y"]) == ["3", "1", "2", "3"]
    with pytest.raises(InvalidSubmissionError, match=r"unknown labels \['7'\]"):
        _validate(_sub(y=[7, 1, 2, 3]), "accuracy", labels=["1", "2", "3"])
    with pytest.raises(InvalidSubmissionError, match="NaN"):
        _validate(_sub(y=[None, 1, 2, 3]), "accuracy", labels=["1", "2", "3"])


def test_read_submission_errors(tmp_path):
    with pytest.raises(InvalidSubmissionError, match="no submission file"):
        grading.read_submission(tmp_path / "missing.csv", "id")
    (tmp_path / "s.txt").write_text("id,y\n")
    with pytest.raises(InvalidSubmissionError, match=r"must be a \.csv"):
        grading.read_submission(tmp_path / "s.txt", "id")
    (tmp_path / "e.csv").write_text("")
    with pytest.raises(InvalidSubmissionError, match="empty"):
        grading.read_submission(tmp_path / "e.csv", "id")
    (tmp_path / "ids.csv").write_text("id,y\n007,1\n")
    assert grading.read_submission(tmp_path / "ids.csv", "id")["id"].tolist() == ["007"]


# ------------------------------------------------------------------------------ answers-led

ANSWERS = pd.DataFrame({"id": ["a1", "b2", "c3", "d4"], "p": [0.0, 1.0, 0.0, 1.0],
                        "mask": ["1 3", None, "5 2", "7 1"], "kind": ["x", "y", "x", "y"]})


def _against(df, answers=ANSWERS, targets=("p", "mask", "kind")):
    return grading.validate_against_answers(df, answers, id_column="id", target_columns=targets)


def test_validate_against_answers_types_numbers_and_keeps_order():
    df = pd.DataFrame({"kind": ["y", "x", "x", "y"], "id": [" d4", "c3", "a1", "b2"],
                       "p": ["0.5", 1, 0.25, "1e-1"], "mask": [None, "1 1", "", "2 2"]})
    out = _against(df)
    assert list(out.columns) == ["kind", "id", "p", "mask"]   # the file's own column order
    assert out["id"].tolist() == ["d4", "c3", "a1", "b2"]     # the file's row order, stripped
    assert out["p"].dtype == np.float64 and out["p"].tolist() == [0.5, 1.0, 0.25, 0.1]


@pytest.mark.parametrize("df, match", [
    (ANSWERS.drop(columns=["kind"]), r"wrong columns: missing \['kind'\]"),
    (ANSWERS.assign(extra=1), r"unexpected \['extra'\]"),
    (pd.concat([ANSWERS, ANSWERS.iloc[[2]]]),
     r"wrong row count: 5 rows, expected 4 \(duplicate ids: 'c3'\)"),
    (ANSWERS.iloc[[0, 1, 2, 2]], "duplicate ids: 'c3'; missing ids: 'd4'"),
    (ANSWERS.iloc[:3], r"wrong row count: 3 rows, expected 4 \(missing ids: 'd4'\)"),
    (ANSWERS.assign(p=[0.5, "abc", 0.1, 0.2]),
     r"non-numeric values in column 'p', e.g. 'abc' \(1 rows; ids 'b2'\)"),
    (ANSWERS.assign(p=[0.5, 0.5, np.nan, 0.2]), r"NaN in column 'p' \(1 rows; ids 'c3'\)"),
    (ANSWERS.assign(p=[np.inf, 0.5, 0.1, 0.2]),
     r"infinite values in column 'p' \(1 rows; ids 'a1'\)"),
    (ANSWERS.assign(kind=["x", None, "x", None]),
     r"empty values in column 'kind' \(2 rows; ids 'b2', 'd4'\)"),
])
def test_validate_against_answers_errors_name_the_rows(df, match):
    with pytest.raises(InvalidSubmissionError, match=match):
        _against(df)


def test_validate_against_answers_allows_empty_cells_only_where_the_answers_have_them():
    _against(ANSWERS.assign(mask=[None, None, None, None]))  # answers have an empty mask
    answers = ANSWERS.assign(mask=["1 3", "2 2", "5 2", "7 1"])
    with pytest.raises(InvalidSubmissionError, match="empty values in column 'mask'"):
        _against(ANSWERS, answers)


def test_validate_against_answers_repeated_answer_ids_must_repeat():
    answers = pd.DataFrame({"id": ["a", "a", "b"], "y": [1.0, 2.0, 3.0]})
    ok = grading.validate_against_answers(answers, answers, id_column="id", target_columns=("y",))
    assert ok["id"].tolist() == ["a", "a", "b"]
    with pytest.raises(InvalidSubmissionError, match="duplicate ids: 'b'; missing ids: 'a'"):
        grading.validate_against_answers(answers.assign(id=["a", "b", "b"]), answers,
                                         id_column="id", target_columns=("y",))


def test_score_submission_uses_only_answer_rows():
    sub = _validate(_sub(y=[1.0, 2.0, 100.0, 100.0]))
    answers = pd.DataFrame({"y": [1.0, 3.0]}, index=pd.Index(["a1", "b2"], name="id"))
    assert grading.score_submission(sub, answers, "mae") == pytest.approx(0.5)


# ------------------------------------------------------------------------------ medals

@pytest.mark.parametrize("n, gold, silver, bronze", [
    (10, 1, 2, 4), (5, 1, 1, 2), (150, 10, 30, 60), (500, 11, 50, 100), (2000, 14, 100, 200),
])
def test_medal_positions_follow_mle_bench(n, gold, silver, bronze):
    scores = list(np.random.default_rng(n).permutation(np.arange(1, n + 1, dtype=float)))
    hi = grading.medal_thresholds(scores, lower_is_better=False)  # pos(k) = n - k + 1
    assert (hi.gold, hi.silver, hi.bronze) == (n - gold + 1, n - silver + 1, n - bronze + 1)
    assert hi.median == pytest.approx((n + 1) / 2) and hi.num_teams == n
    lo = grading.medal_thresholds(scores, lower_is_better=True)   # pos(k) = k
    assert (lo.gold, lo.silver, lo.bronze) == (gold, silver, bronze)


def test_medal_report_inclusive_and_strict_median():
    thr = grading.medal_thresholds([10, 9, 8, 7, 6, 5, 4, 3, 2, 1], lower_is_better=False)
    assert grading.medal_report(10, thr).gold
    r = grading.medal_report(9, thr)
    assert (r.gold, r.silver, r.bronze, r.any_medal) == (False, True, False, True)
    assert grading.medal_report(7, thr).bronze
    r = grading.medal_report(5.5, thr)  # equal to the median: not above it
    assert not r.any_medal and not r.above_median
    r = grading.medal_report(None, thr)
    assert (r.score, r.any_medal, r.above_median) == (None, False, False)
    lo = grading.medal_thresholds([0.1, 0.2, 0.3, 0.4, 0.5], lower_is_better=True)
    assert grading.medal_report(0.1, lo).gold and grading.medal_report(0.29, lo).above_median
    with pytest.raises(ValueError, match="empty"):
        grading.medal_thresholds([], False)


def test_position_score_mle_dojo_example():
    board = list(range(462, 0, -1))  # higher is better, best first
    assert grading.position_score(45.5, board, lower_is_better=False) == pytest.approx(45 / 462)
    assert grading.position_score(1000, board, False) == 1.0
    assert grading.position_score(462, board, False) == 1.0  # a tie with the top
    assert grading.position_score(0, board, False) == 0.0
    assert grading.position_score(None, board, False) == 0.0
    assert grading.position_score(float("nan"), board, False) == 0.0
    assert grading.position_score(1.5, [1.0, 2.0, 3.0], lower_is_better=True) == pytest.approx(2 / 3)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-20, 20), min_size=1, max_size=30), st.integers(-25, 25), st.booleans())
def test_position_score_is_one_minus_fraction_strictly_better(board, score, lower):
    strictly_better = sum((b < score) if lower else (b > score) for b in board)
    assert grading.position_score(score, board, lower) == pytest.approx(
        1 - strictly_better / len(board))


def test_improves_is_strict_directional_and_treats_missing_scores():
    assert grading.improves(0.9, 0.8, lower_is_better=False)
    assert grading.improves(0.1, 0.2, lower_is_better=True)
    assert not grading.improves(0.8, 0.8, lower_is_better=False)          # a tie is not better
    assert not grading.improves(0.7, 0.8, lower_is_better=False)
    assert grading.improves(0.1, None, lower_is_better=True)              # anything beats none
    assert grading.improves(0.1, float("nan"), lower_is_better=False)
    assert not grading.improves(None, 0.1, lower_is_better=False)         # none never improves
    assert not grading.improves(float("inf"), 0.1, lower_is_better=False)
