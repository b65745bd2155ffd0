"""Grading contract shared by every task.

Holds the typed format error, the metric registry, submission format validation, MLE-bench's medal
thresholds and MLE-Dojo's position score (HumanRank).

Conventions:
  * A submission and the hidden answers share one column layout: an id column plus ``k`` target
    columns (a label, a probability per class, a score, or one or more real values).
  * Every metric takes ``y_true`` and ``y_pred`` as arrays of shape ``[n_rows, k]`` aligned by id
    and returns one float. ``lower_is_better`` belongs to the metric, never inferred from data.
  * Every format problem raises ``InvalidSubmissionError`` with a message that names the problem;
    the score is never computed on a malformed file.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable, Optional, Sequence

import numpy as np
import pandas as pd


class InvalidSubmissionError(ValueError):
    """A submission has a format problem (shape, ids, columns, NaN, ...); the message says which."""


# --------------------------------------------------------------------------------------------
# Metrics
# --------------------------------------------------------------------------------------------

#: What the prediction columns must contain for a metric.
#:   label:       one categorical column; values must be among the task's labels.
#:   probability: one column per class, values in [0, 1], rows renormalised (Kaggle log loss).
#:   score:       finite reals (ranking metrics such as AUC); one column per binary target.
#:   real:        finite reals (regression); one column per target.
PREDICTION_KINDS = ("label", "probability", "score", "real")


@dataclasses.dataclass(frozen=True)
class Metric:
    """A registered metric.

    Attributes:
      name: registry key, e.g. ``"log_loss"``.
      lower_is_better: the direction of the metric.
      kind: one of ``PREDICTION_KINDS``; drives format validation.
      fn: ``fn(y_true [n, k], y_pred [n, k]) -> float``.
    """

    name: str
    lower_is_better: bool
    kind: str
    fn: Callable[[np.ndarray, np.ndarray], float]


METRICS: dict[str, Metric] = {}


def improves(a: Optional[float], b: Optional[float], lower_is_better: bool) -> bool:
    """Whether score ``a`` is strictly better than ``b`` in a metric's direction. A missing or
    non-finite ``a`` never improves; any finite ``a`` improves on a missing or non-finite ``b``.
    The one definition of "better" (tasks, the buffer's targets, rewards, evaluation)."""
    if a is None or not math.isfinite(a):
        return False
    if b is None or not math.isfinite(b):
        return True
    return a < b if lower_is_better else a > b


def register_metric(name: str, *, lower_is_better: bool, kind: str):
    """Decorator: registers ``fn(y_true, y_pred) -> float`` under ``name``."""
    if kind not in PREDICTION_KINDS:
        raise ValueError(f"metric kind must be one of {PREDICTION_KINDS}, got {kind!r}")

    def deco(fn):
        if name in METRICS:
            raise ValueError(f"metric {name!r} is already registered")
        METRICS[name] = Metric(name, lower_is_better, kind, fn)
        return fn

    return deco


def get_metric(name: str) -> Metric:
    """Returns the registered metric ``name``; raises KeyError listing the known names."""
    try:
        return METRICS[name]
    except KeyError:
        raise KeyError(f"unknown metric {name!r}; registered: {sorted(METRICS)}") from None


@register_metric("accuracy", lower_is_better=False, kind="label")
def accuracy(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Fraction of rows (all columns) predicted exactly. Arrays [n, k] of labels."""
    return float(np.mean(np.all(np.asarray(y_true) == np.asarray(y_pred), axis=1)))


@register_metric("macro_f1", lower_is_better=False, kind="label")
def macro_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Unweighted mean over the true classes of per-class F1. Arrays [n, 1] of labels."""
    t, p = np.asarray(y_true)[:, 0], np.asarray(y_pred)[:, 0]
    f1s = []
    for c in np.unique(t):
        tp = np.sum((t == c) & (p == c))
        fp = np.sum((t != c) & (p == c))
        fn = np.sum((t == c) & (p != c))
        f1s.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return float(np.mean(f1s))


def _libm(fn, x: np.ndarray) -> np.ndarray:
    """The ``math`` function ``fn`` (the C library's) over an array, element by element, in
    float64. numpy's own ``log`` and ``log1p`` take an AVX-512 path on CPUs that have one, whose
    results differ from the C library's in the last bit for some inputs; a score must not depend
    on the CPU that graded it (a leaderboard measured on one machine is compared with scores,
    and a prepared task's files with their digests, from another)."""
    return np.vectorize(fn, otypes=[np.float64])(x)


@register_metric("log_loss", lower_is_better=True, kind="probability")
def log_loss(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Multi-class log loss in nats. y_true [n, C] one-hot; y_pred [n, C] probabilities.

    Kaggle's rule: rows are divided by their sum, then clipped to [1e-15, 1 - 1e-15].
    """
    p = np.asarray(y_pred, dtype=np.float64)
    p = p / p.sum(axis=1, keepdims=True)
    p = np.clip(p, 1e-15, 1 - 1e-15)
    t = np.asarray(y_true, dtype=np.float64)
    logs = np.zeros_like(p)
    logs[t != 0] = _libm(math.log, p[t != 0])       # only the terms that count (one per row)
    return float(-np.mean(np.sum(t * logs, axis=1)))


def _binary_auc(t: np.ndarray, s: np.ndarray) -> float:
    """ROC AUC with ties counted one half (Mann-Whitney U). t in {0, 1}, s real; shapes [n]."""
    t = t.astype(bool)
    n_pos, n_neg = int(t.sum()), int((~t).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC is undefined when the answers hold a single class")
    ranks = pd.Series(s).rank(method="average").to_numpy()
    return float((ranks[t].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@register_metric("auc", lower_is_better=False, kind="score")
def auc(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """ROC AUC, mean over columns. y_true [n, k] in {0, 1}; y_pred [n, k] real scores."""
    yt, yp = np.asarray(y_true, dtype=np.float64), np.asarray(y_pred, dtype=np.float64)
    return float(np.mean([_binary_auc(yt[:, j], yp[:, j]) for j in range(yt.shape[1])]))


@register_metric("rmse", lower_is_better=True, kind="real")
def rmse(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Root mean squared error, mean over columns (column-wise RMSE). Arrays [n, k], target units."""
    d = np.asarray(y_true, dtype=np.float64) - np.asarray(y_pred, dtype=np.float64)
    return float(np.mean(np.sqrt(np.mean(d**2, axis=0))))


@register_metric("mae", lower_is_better=True, kind="real")
def mae(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Mean absolute error, mean over columns. Arrays [n, k], target units."""
    d = np.asarray(y_true, dtype=np.float64) - np.asarray(y_pred, dtype=np.float64)
    return float(np.mean(np.mean(np.abs(d), axis=0)))


@register_metric("rmsle", lower_is_better=True, kind="real")
def rmsle(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Root mean squared log error, mean over columns; predictions must be > -1. Arrays [n, k]."""
    yt, yp = np.asarray(y_true, dtype=np.float64), np.asarray(y_pred, dtype=np.float64)
    if np.any(yp <= -1):
        raise InvalidSubmissionError("rmsle needs every prediction > -1")
    d = _libm(math.log1p, yp) - _libm(math.log1p, yt)
    return float(np.mean(np.sqrt(np.mean(d**2, axis=0))))


# --------------------------------------------------------------------------------------------
# Format validation (one code path for validate and grade)
# --------------------------------------------------------------------------------------------

def _fmt_ids(ids: Sequence[str], limit: int = 5) -> str:
    ids = list(ids)
    head = ", ".join(repr(i) for i in ids[:limit])
    return head + (f", ... ({len(ids)} in all)" if len(ids) > limit else "")


def canonical_label(value) -> str:
    """Label as a string; integral floats lose their ``.0`` (``3.0`` -> ``"3"``)."""
    if isinstance(value, (float, np.floating)) and math.isfinite(value) and float(value).is_integer():
        return str(int(value))
    return str(value).strip()


def read_submission(path: "os.PathLike | str", id_column: str) -> pd.DataFrame:
    """Reads a submission CSV with the id column as strings; format errors are typed."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise InvalidSubmissionError(f"no submission file at {path}")
    if not path.endswith(".csv"):
        raise InvalidSubmissionError(f"submission must be a .csv file, got {os.path.basename(path)}")
    try:
        df = pd.read_csv(path, dtype={id_column: str}, keep_default_na=True)
    except pd.errors.EmptyDataError:
        raise InvalidSubmissionError("submission file is empty") from None
    except (pd.errors.ParserError, UnicodeDecodeError, ValueError) as e:
        raise InvalidSubmissionError(f"submission is not a readable CSV: {e}") from None
    return df


def check_columns(submission: pd.DataFrame, id_column: str, target_columns: Sequence[str]) -> None:
    """Raises InvalidSubmissionError unless the columns are exactly ``id_column`` and
    ``target_columns`` (any order, no duplicates)."""
    if not isinstance(submission, pd.DataFrame):
        raise InvalidSubmissionError(f"submission must be a DataFrame, got {type(submission).__name__}")
    cols = [str(c) for c in submission.columns]
    expected_cols = [id_column, *target_columns]
    missing = [c for c in expected_cols if c not in cols]
    extra = [c for c in cols if c not in expected_cols]
    if missing or extra:
        raise InvalidSubmissionError(
            f"wrong columns: missing {missing}, unexpected {extra}; expected exactly {expected_cols}")
    if len(set(cols)) != len(cols):
        raise InvalidSubmissionError(f"duplicate column names in {cols}")


def check_ids(submission: pd.DataFrame, id_column: str, expected_ids: Sequence[str]) -> pd.Series:
    """Checks that the id column holds every expected id exactly as often as ``expected_ids`` does.

    Args:
      submission: the submission frame [n_rows, ...].
      id_column: the id column's name.
      expected_ids: the answer ids [n_expected] (usually unique; an id listed twice must appear
        twice).

    Returns:
      the ids as stripped strings, [n_rows], in the submission's row order.

    Raises:
      InvalidSubmissionError: empty ids, or a wrong row count / duplicate / missing / unknown ids;
        the message names the first few offending ids of each kind.
    """
    ids = submission[id_column]
    if ids.isna().any():
        rows = np.flatnonzero(ids.isna().to_numpy())
        raise InvalidSubmissionError(
            f"{len(rows)} rows have an empty {id_column!r} (rows {_fmt_ids(rows.tolist())}, "
            "0-indexed after the header)")
    ids = ids.astype(str).str.strip()
    got = ids.value_counts()
    want = pd.Series([str(i) for i in expected_ids], dtype=object).value_counts()
    counts = pd.concat([got.rename("got"), want.rename("want")], axis=1).fillna(0)
    problems = []
    for what, mask in (("duplicate ids", (counts["got"] > counts["want"]) & (counts["want"] > 0)),
                       ("missing ids", counts["got"] < counts["want"]),
                       ("unknown ids", counts["want"] == 0)):
        bad = sorted(counts.index[mask.to_numpy()])
        if bad:
            problems.append(f"{what}: {_fmt_ids(bad)}")
    if len(ids) != len(expected_ids):
        detail = f" ({'; '.join(problems)})" if problems else ""
        raise InvalidSubmissionError(
            f"wrong row count: {len(ids)} rows, expected {len(expected_ids)}{detail}")
    if problems:
        raise InvalidSubmissionError("; ".join(problems))
    return ids


def to_numeric_columns(frame: pd.DataFrame, columns: Sequence[str], ids: pd.Series) -> pd.DataFrame:
    """``frame`` with ``columns`` as finite float64; ``ids`` [n_rows] name offending rows.

    Raises:
      InvalidSubmissionError: a non-numeric, empty (NaN) or infinite value; the message names the
        column, the first few offending ids and (for non-numeric values) an example.
    """
    out = frame.copy()
    ids = pd.Series(ids.to_numpy(), index=frame.index)
    for c in columns:
        col = pd.to_numeric(out[c], errors="coerce")
        non_numeric = (col.isna() & out[c].notna()).to_numpy()
        if non_numeric.any():
            raise InvalidSubmissionError(
                f"non-numeric values in column {c!r}, e.g. {out[c][non_numeric].iloc[0]!r} "
                f"({int(non_numeric.sum())} rows; ids {_fmt_ids(ids[non_numeric].tolist())})")
        nan = col.isna().to_numpy()
        if nan.any():
            raise InvalidSubmissionError(
                f"NaN in column {c!r} ({int(nan.sum())} rows; ids {_fmt_ids(ids[nan].tolist())})")
        values = col.to_numpy(dtype=np.float64)
        inf = ~np.isfinite(values)
        if inf.any():
            raise InvalidSubmissionError(
                f"infinite values in column {c!r} ({int(inf.sum())} rows; "
                f"ids {_fmt_ids(ids[inf].tolist())})")
        out[c] = values
    return out


def validate_submission(
    submission: pd.DataFrame,
    *,
    id_column: str,
    target_columns: Sequence[str],
    expected_ids: Sequence[str],
    metric: "Metric | str",
    labels: Optional[Sequence[str]] = None,
) -> pd.DataFrame:
    """Checks a submission's format and returns it indexed by id, target columns typed.

    Args:
      submission: the submission as read from CSV (id column as strings).
      id_column: name of the id column.
      target_columns: the prediction columns, in the answers' order.
      expected_ids: every id the submission must cover (dev and final halves together), [n].
      metric: the metric (or its name); its ``kind`` decides the value checks.
      labels: the allowed labels for ``label`` metrics (strings).

    Returns:
      DataFrame [n, k] indexed by id (string), columns ``target_columns``; floats for numeric kinds,
      canonical label strings for ``label``.

    Raises:
      InvalidSubmissionError: naming the first problem found (columns, row count, duplicate, missing
        or extra ids, NaN/inf, non-numeric values, probabilities out of [0, 1], unknown labels) and
        the first few offending ids.
    """
    metric = get_metric(metric) if isinstance(metric, str) else metric
    check_columns(submission, id_column, target_columns)
    ids = check_ids(submission, id_column, expected_ids)
    out = submission.copy()
    out[id_column] = ids
    out = out.set_index(id_column)[list(target_columns)]

    if metric.kind == "label":
        empty = out.isna().any(axis=1).to_numpy()
        if empty.any():
            raise InvalidSubmissionError(
                f"empty (NaN) labels in the submission ({int(empty.sum())} rows; "
                f"ids {_fmt_ids(out.index[empty].tolist())})")
        out = out.map(canonical_label)
        if labels is not None:
            allowed = set(map(str, labels))
            bad = sorted(set(out.to_numpy().ravel()) - allowed)
            if bad:
                raise InvalidSubmissionError(
                    f"unknown labels {bad[:5]}; expected one of {sorted(allowed)}")
        return out

    out = to_numeric_columns(out, target_columns, pd.Series(out.index))
    if metric.kind == "probability":
        v = out.to_numpy()
        outside = np.any((v < 0) | (v > 1), axis=1)
        if outside.any():
            raise InvalidSubmissionError(
                f"probabilities must lie in [0, 1] ({int(outside.sum())} rows outside; "
                f"ids {_fmt_ids(out.index[outside].tolist())})")
        zero = v.sum(axis=1) <= 0
        if zero.any():
            raise InvalidSubmissionError(
                f"a row of probabilities sums to 0 (ids {_fmt_ids(out.index[zero].tolist())})")
    return out


def validate_against_answers(
    submission: pd.DataFrame,
    answers: pd.DataFrame,
    *,
    id_column: str,
    target_columns: Sequence[str],
) -> pd.DataFrame:
    """Format check for a grader we do not know (e.g. MLE-bench's own ``grade_fn``), led by the
    answers: the rules every such grader assumes, applied to the whole submission.

    * the columns are exactly ``id_column`` + ``target_columns`` (any order);
    * every answer id appears exactly as often as in the answers (no duplicate, missing or
      unknown id);
    * a target column whose answers are numbers (not bools) holds finite numbers only;
    * any other target column has no empty cell, unless its answers have empty cells too
      (e.g. an empty run-length mask).

    Args:
      submission: as read by ``read_submission`` (id column as strings), [n, 1 + k].
      answers: every answer row (both halves), id column as strings, [n, >= 1 + k].
      id_column, target_columns: the submission layout.

    Returns:
      the submission in its own row order and column order, ids as stripped strings, numeric
      target columns as float64 (so a grader never sees a string where it expects a number).

    Raises:
      InvalidSubmissionError: naming the problem and the first few offending ids.
    """
    check_columns(submission, id_column, target_columns)
    ids = check_ids(submission, id_column, answers[id_column].astype(str).str.strip().tolist())
    out = submission.copy()
    out[id_column] = ids
    numeric = [c for c in target_columns if pd.api.types.is_numeric_dtype(answers[c])
               and not pd.api.types.is_bool_dtype(answers[c])]
    out = to_numeric_columns(out, numeric, ids)
    for c in target_columns:
        if c in numeric or answers[c].isna().any():
            continue
        empty = out[c].isna().to_numpy()
        if empty.any():
            raise InvalidSubmissionError(
                f"empty values in column {c!r} ({int(empty.sum())} rows; "
                f"ids {_fmt_ids(ids[empty].tolist())})")
    return out


def score_submission(
    validated: pd.DataFrame, answers: pd.DataFrame, metric: "Metric | str"
) -> float:
    """Scores a validated submission on the answer rows.

    Args:
      validated: output of ``validate_submission`` (indexed by id), covering at least the answer ids.
      answers: the answers, indexed by id (strings), same target columns.
      metric: the metric or its name.
    Returns:
      the metric value (float).
    """
    metric = get_metric(metric) if isinstance(metric, str) else metric
    pred = validated.loc[answers.index, list(answers.columns)]
    y_true = answers.to_numpy()
    if metric.kind == "label":
        y_true = np.vectorize(canonical_label, otypes=[object])(y_true)
    return float(metric.fn(y_true, pred.to_numpy()))


# --------------------------------------------------------------------------------------------
# Medals (MLE-bench) and position score (MLE-Dojo HumanRank)
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class MedalThresholds:
    """Scores needed for each medal (inclusive) and the leaderboard median (to beat strictly)."""

    gold: float
    silver: float
    bronze: float
    median: float
    lower_is_better: bool
    num_teams: int


def _sorted_best_first(leaderboard: Sequence[float], lower_is_better: bool) -> list[float]:
    scores = [float(s) for s in leaderboard]
    if not scores:
        raise ValueError("empty reference leaderboard: no medal thresholds or position score")
    if any(not math.isfinite(s) for s in scores):
        raise ValueError("reference leaderboard holds a non-finite score")
    return sorted(scores, reverse=not lower_is_better)


def medal_thresholds(leaderboard: Sequence[float], lower_is_better: bool) -> MedalThresholds:
    """MLE-bench's ``get_thresholds``: Kaggle progression positions on a reference leaderboard.

    Args:
      leaderboard: the reference scores (any order; sorted best-first here using the declared
        direction, not inferred from the order).
      lower_is_better: metric direction.
    Returns:
      MedalThresholds; with N teams and pos(k) the k-th best score (1-indexed):
      N<100: gold pos(max(1,floor(.1N))), silver pos(max(1,floor(.2N))), bronze pos(max(1,floor(.4N)));
      100<=N<250: pos(10), .2N, .4N; 250<=N<1000: pos(10+floor(.002N)), pos(50), pos(100);
      N>=1000: pos(10+floor(.002N)), pos(max(1,floor(.05N))), pos(max(1,floor(.1N))).
    """
    s = _sorted_best_first(leaderboard, lower_is_better)
    n = len(s)

    def pos(k: int) -> float:
        return s[min(max(1, k), n) - 1]

    if n < 100:
        g, sv, b = pos(int(0.1 * n)), pos(int(0.2 * n)), pos(int(0.4 * n))
    elif n < 250:
        g, sv, b = pos(10), pos(int(0.2 * n)), pos(int(0.4 * n))
    elif n < 1000:
        g, sv, b = pos(10 + int(0.002 * n)), pos(50), pos(100)
    else:
        g, sv, b = pos(10 + int(0.002 * n)), pos(int(0.05 * n)), pos(int(0.1 * n))
    return MedalThresholds(g, sv, b, float(np.median(s)), lower_is_better, n)


@dataclasses.dataclass(frozen=True)
class MedalReport:
    """MLE-bench's per-run flags. An invalid submission (score None) gets every flag False."""

    score: Optional[float]
    gold: bool
    silver: bool
    bronze: bool
    above_median: bool

    @property
    def any_medal(self) -> bool:
        return self.gold or self.silver or self.bronze


def medal_report(score: Optional[float], thresholds: MedalThresholds) -> MedalReport:
    """Medal flags for ``score`` (inclusive thresholds; above-median is strict)."""
    if score is None or not math.isfinite(score):
        return MedalReport(None, False, False, False, False)

    def at_least(thr: float) -> bool:
        return score <= thr if thresholds.lower_is_better else score >= thr

    gold = at_least(thresholds.gold)
    silver = not gold and at_least(thresholds.silver)
    bronze = not gold and not silver and at_least(thresholds.bronze)
    above = (score < thresholds.median) if thresholds.lower_is_better else (score > thresholds.median)
    return MedalReport(float(score), gold, silver, bronze, above)


def position_score(score: Optional[float], leaderboard: Sequence[float], lower_is_better: bool) -> float:
    """HumanRank as MLE-Dojo computes it: (N - p + 1) / N in [0, 1].

    p is the 1-indexed position of the first leaderboard entry (best first) that ``score`` beats or
    ties, N + 1 if none; equivalently 1 - #(entries strictly better than score) / N. A missing or
    invalid submission (``None``/NaN) scores 0.
    """
    s = _sorted_best_first(leaderboard, lower_is_better)
    n = len(s)
    if score is None or not math.isfinite(score):
        return 0.0
    position = next((i + 1 for i, v in enumerate(s)
                     if (score <= v if lower_is_better else score >= v)), n + 1)
    return (n - position + 1) / n
