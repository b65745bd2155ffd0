"""Adapter: a prepared MLE-bench competition directory as a ``Task``.

MLE-bench keeps two trees per competition ``<id>``:

  * the data dir (``mlebench prepare``): ``<data_dir>/<id>/prepared/public/`` (train/test files,
    ``sample_submission.csv``, ``description.md``) and ``<data_dir>/<id>/prepared/private/test.csv``
    (the answers, in the submission's column layout);
  * the competition dir (the repo's ``mlebench/competitions/<id>/``): ``config.yaml`` (``grader.name``,
    ``grader.grade_fn`` = ``"module.path:function"``), ``description.md``, ``leaderboard.csv``
    (Kaggle's final private leaderboard, a ``score`` column, best first; stored with Git LFS).

``find_competition_dir`` says which competition dir is used: ``<data_dir>/<id>/`` when it holds
``config.yaml`` (the files ``launch/stage_mlebench.py`` stages beside the data, copied from
MLE-bench: they belong to the mlebench version that prepared the data), else the installed
``mlebench`` package's copy when importable, else ``<data_dir>/<id>/``; the loaded task records it
as ``MLEBenchTask.competition_dir``. So a host loads staged competitions with or without
``mlebench``.

Grading: the answers' rows are split (seeded) into a dev half and a final half, like the offline
suite. A submission must cover every answer id, and it is validated whole (columns, ids,
duplicates, values; then MLE-bench's grader on every row, as MLE-bench's ``/validate`` does)
before either half is scored, so a problem in the half not being graded still makes it invalid.
Whatever MLE-bench scores as None (its ``InvalidSubmissionError`` or any other exception of its
grader on the whole file) is our ``InvalidSubmissionError``. The score comes from MLE-bench's own
grade function (``grader.grade_fn``) when it can be imported; otherwise from our metric of the
same name when we have one (``GRADER_ALIASES``); otherwise loading fails with
``UnsupportedGraderError``. The task records which (``MLEBenchTask.grader_source``: ``"mlebench"``
or ``"ours:<metric>"``).

Isolation: an MLE-bench task's private answers sit on the host (``prepared/private``), so it needs
a sandbox backend that hides them and the network (``Task.requires_isolation`` is True).

Leaderboard: a missing ``leaderboard.csv`` gives a task without a reference leaderboard (it trains
and evaluates; medals and HumanRank are not available). A Git LFS pointer in its place, or a file
without a numeric ``score`` column, is a ``LeaderboardError`` that says what to run.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
import os
import pathlib
from typing import Any, Callable, ClassVar, Optional

import numpy as np
import pandas as pd

from sandbox import grading
from sandbox.tasks import base

log = logging.getLogger("sandbox.tasks.mlebench")

#: MLE-bench grader names -> our metric names.
GRADER_ALIASES = {
    "accuracy": "accuracy", "multi-class-accuracy": "accuracy", "classification-accuracy": "accuracy",
    "multi-class-classification-accuracy": "accuracy",
    "auc-roc": "auc", "roc-auc": "auc", "auc": "auc", "column-wise-roc-auc": "auc",
    "mean-column-wise-roc-auc": "auc",
    "multi-class-log-loss": "log_loss", "log-loss": "log_loss", "logloss": "log_loss",
    "log_loss": "log_loss",
    "rmse": "rmse", "root-mean-squared-error": "rmse", "mae": "mae", "mean-absolute-error": "mae",
    "rmsle": "rmsle", "mean-column-wise-rmsle": "rmsle",
    "f1-macro": "macro_f1", "macro-f1": "macro_f1", "macro_f1": "macro_f1",
}


class UnsupportedGraderError(NotImplementedError):
    """The competition's grader is neither importable (mlebench) nor one of our metrics."""


class LeaderboardError(ValueError):
    """A ``leaderboard.csv`` that is there but unusable (a Git LFS pointer, no numeric scores)."""


#: First line of a Git LFS pointer file (what a checkout without ``git lfs pull`` holds).
GIT_LFS_POINTER_HEADER = "version https://git-lfs.github.com/spec/v1"


def _read_yaml(path: pathlib.Path) -> dict:
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - PyYAML ships with flax/orbax
        raise ImportError("reading MLE-bench config.yaml needs PyYAML (pip install pyyaml)") from e
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def _import_grade_fn(spec: str) -> Optional[Callable[[pd.DataFrame, pd.DataFrame], Any]]:
    """Imports ``"module.path:function"``; None if the module is not importable."""
    if not spec or ":" not in spec:
        return None
    module, _, name = spec.partition(":")
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            return None
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def find_competition_dir(competition_id: str, data_dir: "os.PathLike | str") -> pathlib.Path:
    """The folder with ``config.yaml`` / ``description.md`` / ``leaderboard.csv`` of a competition.

    ``<data_dir>/<id>/`` when it holds ``config.yaml`` (staged beside the data by
    ``launch/stage_mlebench.py``, or hand-made); else the installed ``mlebench`` package's
    ``competitions/<id>/`` when that package is importable and has the folder; else
    ``<data_dir>/<id>/``. The path may not exist; ``load_mlebench_task`` names the missing file.
    """
    beside = pathlib.Path(data_dir) / competition_id
    if (beside / "config.yaml").is_file():
        return beside
    spec = importlib.util.find_spec("mlebench")
    if spec is not None and spec.submodule_search_locations:
        d = pathlib.Path(list(spec.submodule_search_locations)[0]) / "competitions" / competition_id
        if d.is_dir():
            return d
    return pathlib.Path(data_dir) / competition_id


def is_git_lfs_pointer(path: "os.PathLike | str") -> bool:
    """True when the file's first line is a Git LFS pointer header (the content is not fetched)."""
    with open(path, "rb") as f:
        head = f.read(len(GIT_LFS_POINTER_HEADER) + 2)
    return head.decode("utf-8", errors="replace").startswith(GIT_LFS_POINTER_HEADER)


def _lfs_pull_hint(path: pathlib.Path) -> str:
    """Where to run ``git lfs pull``: the mle-bench checkout holding ``mlebench/competitions``."""
    parts = path.resolve().parts
    if "competitions" in parts:
        i = len(parts) - 1 - parts[::-1].index("competitions")
        if i >= 2 and parts[i - 1] == "mlebench":
            root = pathlib.Path(*parts[: i - 1])
            return (f"run `git lfs fetch --all && git lfs pull` in the mle-bench checkout "
                    f"({root}), then reinstall mlebench if it was installed from a copy "
                    "(pip install -e .)")
    return "run `git lfs fetch --all && git lfs pull` in the mle-bench checkout it came from"


def read_leaderboard(path: "os.PathLike | str") -> list[float]:
    """Scores of an MLE-bench ``leaderboard.csv`` in file order (best first), NaN rows dropped.

    Raises:
      LeaderboardError: the file is a Git LFS pointer (the message says what to run), is empty,
        has no ``score`` column or holds a non-numeric score.
    """
    path = pathlib.Path(path)
    if is_git_lfs_pointer(path):
        raise LeaderboardError(
            f"{path}: this leaderboard.csv is a Git LFS pointer, not the leaderboard; "
            f"{_lfs_pull_hint(path)}")
    try:
        lb = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise LeaderboardError(f"{path}: empty file; expected a 'score' column") from None
    if "score" not in lb.columns:
        raise LeaderboardError(f"{path}: no 'score' column (columns: {list(lb.columns)})")
    scores = pd.to_numeric(lb["score"], errors="coerce")
    bad = scores.isna() & lb["score"].notna()
    if bad.any():
        raise LeaderboardError(
            f"{path}: non-numeric score {lb['score'][bad].iloc[0]!r} on row {int(bad.idxmax())}")
    return [float(s) for s in scores.dropna()]


def _is_mlebench_invalid(e: BaseException) -> bool:
    """MLE-bench's own ``InvalidSubmissionError`` (matched by name: mlebench may be absent)."""
    return type(e).__name__ == "InvalidSubmissionError"


@dataclasses.dataclass
class MLEBenchTask(base.Task):
    """A Task backed by one MLE-bench answers file and (optionally) MLE-bench's grade function.

    Extra attributes:
      answers_file: ``prepared/private/test.csv``.
      grader_name: ``config.yaml``'s ``grader.name``.
      grade_fn: MLE-bench's ``grade(submission_df, answers_df) -> float`` or None (ours is used).
      dev_ids: the answer ids of the dev half (the rest form the final half).
      competition_dir: the folder config.yaml / description.md / leaderboard.csv were read from
        (``find_competition_dir``).
      baseline_error: why the sample submission did not grade ("" when it did; then
        ``baseline_score`` is None).
      grader_source: which grader scores it: ``"mlebench"`` (``grade_fn``) or ``"ours:<metric>"``.
      requires_isolation: True (class attribute): the private answers are on the host.
    """

    requires_isolation: ClassVar[bool] = True

    answers_file: Optional[pathlib.Path] = None
    grader_name: str = ""
    grade_fn: Optional[Callable[[pd.DataFrame, pd.DataFrame], Any]] = None
    dev_ids: frozenset = frozenset()
    competition_dir: Optional[pathlib.Path] = None
    baseline_error: str = ""
    grader_source: str = ""

    def __post_init__(self):
        if self.competition_dir is not None:
            self.competition_dir = pathlib.Path(self.competition_dir)
        if self.grade_fn is None:
            super().__post_init__()
        else:  # MLE-bench's metric may have no registered twin; trust the declared direction
            self.public_dir = pathlib.Path(self.public_dir)
            self.private_dir = pathlib.Path(self.private_dir)
            self.target_columns = tuple(self.target_columns)
            self.hidden_paths = tuple(dict.fromkeys((str(self.private_dir), *self.hidden_paths)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record; the grade function is recorded by name only."""
        d = super().to_dict()
        d["answers_file"] = str(self.answers_file)
        d["competition_dir"] = None if self.competition_dir is None else str(self.competition_dir)
        d["dev_ids"] = sorted(self.dev_ids)
        d["grade_fn"] = None if self.grade_fn is None else (
            f"{self.grade_fn.__module__}:{self.grade_fn.__qualname__}")
        return d

    def leaderboard_hint(self) -> str:
        where = self.competition_dir or "?"
        return (f"the MLE-bench competition folder {where} has no leaderboard.csv (the task still "
                "trains and evaluates; medals and HumanRank are reported as n/a)")

    def _all_answers(self) -> pd.DataFrame:
        if "_answers_df" not in self.__dict__:
            df = pd.read_csv(self.answers_file, dtype={self.id_column: str})
            if self.id_column not in df.columns:
                raise ValueError(f"{self.answers_file}: no id column {self.id_column!r}")
            df[self.id_column] = df[self.id_column].str.strip()
            self.__dict__["_answers_df"] = df
        return self.__dict__["_answers_df"]

    @property
    def test_ids(self) -> list[str]:
        return list(dict.fromkeys(self._all_answers()[self.id_column].astype(str)))

    def _split_answers(self, split: str) -> pd.DataFrame:
        df = self._all_answers()
        in_dev = df[self.id_column].astype(str).isin(self.dev_ids)
        return df[in_dev if split == "dev" else ~in_dev].reset_index(drop=True)

    def validate(self, submission_csv) -> pd.DataFrame:
        """Checks the whole submission (every row, both halves), as MLE-bench would.

        With our metric: ``grading.validate_submission`` (returns the frame indexed by id). With
        MLE-bench's grade function: ``grading.validate_against_answers`` (columns, ids, duplicates,
        values), then the grade function on every row against every answer (MLE-bench's
        ``/validate``); returns the checked frame in file order.

        Raises:
          InvalidSubmissionError: naming the problem (and the first few offending ids).
        """
        sub = grading.read_submission(submission_csv, self.id_column)
        if self.grade_fn is None:
            return grading.validate_submission(
                sub, id_column=self.id_column, target_columns=self.target_columns,
                expected_ids=self.test_ids, metric=self.metric, labels=self.labels)
        answers = self._all_answers()
        checked = grading.validate_against_answers(
            sub, answers, id_column=self.id_column, target_columns=self.target_columns)
        self._run_grade_fn(checked, answers, whole=True)
        return checked

    def _run_grade_fn(self, submission: pd.DataFrame, answers: pd.DataFrame, *,
                      whole: bool) -> float:
        """MLE-bench's grade function on ``submission`` rows vs ``answers`` rows.

        MLE-bench's ``InvalidSubmissionError`` is ours. On the whole file (``whole``) any other
        exception is ours too: MLE-bench scores it None, an invalid submission. On one half of a
        file that passed whole, another exception propagates (a grader bug: ``grader_error``).
        """
        try:
            score = self.grade_fn(submission.reset_index(drop=True), answers.reset_index(drop=True))
        except Exception as e:  # noqa: BLE001 - sorted into invalid submission / grader bug
            if _is_mlebench_invalid(e):
                raise grading.InvalidSubmissionError(str(e)) from e
            if whole:
                raise grading.InvalidSubmissionError(
                    f"MLE-bench's grader {self.grader_name!r} could not score this submission "
                    f"({type(e).__name__}: {e}); MLE-bench counts it as an invalid submission "
                    "(score None)") from e
            raise
        if score is None:
            raise grading.InvalidSubmissionError("MLE-bench's grader returned no score")
        return float(score)

    def grade(self, submission_csv, split: str = "dev") -> float:
        """Scores the ``split`` half after validating the whole submission (``validate``).

        Raises InvalidSubmissionError for any format problem anywhere in the file, ValueError for an
        unknown split.
        """
        if split not in base.SPLITS:
            raise ValueError(f"split must be one of {base.SPLITS}, got {split!r}")
        validated = self.validate(submission_csv)
        answers = self._split_answers(split)
        if self.grade_fn is None:
            a = answers.set_index(self.id_column)[list(self.target_columns)]
            return grading.score_submission(validated, a, self.metric)
        rows = validated[validated[self.id_column].isin(set(answers[self.id_column]))]
        return self._run_grade_fn(rows, answers, whole=False)


def _known_labels(answers: pd.DataFrame, train_csv: pathlib.Path,
                  target_columns: tuple[str, ...]) -> tuple[str, ...]:
    """The labels a submission may hold when our metric grades: those of the answers and of the
    training file's column(s) of the same name (``public/train.csv``, when it has them), so a
    class the test rows happen to lack is a wrong prediction, not an invalid submission (as
    MLE-bench's graders score it). Canonical strings, sorted."""
    seen = {grading.canonical_label(v) for c in target_columns for v in answers[c].dropna()}
    if train_csv.exists():
        try:
            cols = [c for c in target_columns if c in pd.read_csv(train_csv, nrows=0).columns]
            if cols:
                train = pd.read_csv(train_csv, usecols=cols)
                seen |= {grading.canonical_label(v) for c in cols for v in train[c].dropna()}
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError):
            pass   # not a plain CSV: the answers' labels alone
    return tuple(sorted(seen))


def load_mlebench_task(
    competition_id: str,
    data_dir: "os.PathLike | str",
    competition_dir: "os.PathLike | str | None" = None,
    *,
    seed: int = 0,
    time_limit_s: float = 3600.0,
    memory_limit_mb: int = 16384,
    use_mlebench_grader: bool = True,
) -> MLEBenchTask:
    """Reads a prepared MLE-bench competition into a Task.

    Args:
      competition_id: e.g. ``"spooky-author-identification"``.
      data_dir: the MLE-bench data root holding ``<id>/prepared/{public,private}``.
      competition_dir: folder with config.yaml / description.md / leaderboard.csv; None:
        ``find_competition_dir`` (recorded as ``task.competition_dir`` either way).
      seed: seed of the dev/final split of the answer rows.
      time_limit_s, memory_limit_mb: per-execution budget.
      use_mlebench_grader: use ``grader.grade_fn`` when importable (False: force our metric).

    Returns:
      the task; ``leaderboard`` is empty when the competition has no ``leaderboard.csv``, and
      ``baseline_score`` is None (``baseline_error`` says why) when the sample submission does not
      grade.

    Raises:
      FileNotFoundError: a required file is missing (named in the message).
      UnsupportedGraderError: no importable grade function and no matching metric of ours.
      LeaderboardError: leaderboard.csv is a Git LFS pointer or has no numeric ``score`` column.
    """
    data_dir = pathlib.Path(data_dir)
    prepared = data_dir / competition_id / "prepared"
    public, private = prepared / "public", prepared / "private"
    comp = pathlib.Path(competition_dir) if competition_dir else find_competition_dir(
        competition_id, data_dir)
    for p in (public / "sample_submission.csv", private / "test.csv", comp / "config.yaml"):
        if not p.exists():
            hint = ("; stage the competition with `python launch/stage_mlebench.py` (it puts "
                    "MLE-bench's config.yaml beside the data) or install mlebench"
                    if p.name == "config.yaml" else "")
            raise FileNotFoundError(f"MLE-bench competition {competition_id!r}: missing {p}{hint}")
    cfg = _read_yaml(comp / "config.yaml")
    grader = cfg.get("grader") or {}
    grader_name = str(grader.get("name", ""))
    grade_fn = _import_grade_fn(str(grader.get("grade_fn", ""))) if use_mlebench_grader else None
    metric = GRADER_ALIASES.get(grader_name.lower())
    if (grade_fn is None and use_mlebench_grader and metric is not None
            and importlib.util.find_spec("mlebench") is not None):
        log.warning("%s: mlebench is installed but its grade_fn %r does not import; scoring with "
                    "our metric %r", competition_id, grader.get("grade_fn"), metric)
    if grade_fn is None and metric is None:
        raise UnsupportedGraderError(
            f"competition {competition_id!r} uses grader {grader_name!r}: install mlebench so its "
            f"grade_fn {grader.get('grade_fn')!r} can be imported, or add the metric to "
            f"sandbox.grading (known aliases: {sorted(GRADER_ALIASES)})")

    sample = pd.read_csv(public / "sample_submission.csv", nrows=5)
    id_column = str(sample.columns[0])
    target_columns = tuple(str(c) for c in sample.columns[1:])
    answers = pd.read_csv(private / "test.csv", dtype={id_column: str})
    if id_column not in answers.columns:
        raise ValueError(f"{private / 'test.csv'}: no id column {id_column!r} (from sample_submission)")

    lb_path = comp / "leaderboard.csv"
    leaderboard = read_leaderboard(lb_path) if lb_path.exists() else []
    if metric is not None:
        lower = grading.get_metric(metric).lower_is_better
    elif "lower_is_better" in cfg or "is_lower_better" in grader:
        lower = bool(cfg.get("lower_is_better", grader.get("is_lower_better")))
    elif len(leaderboard) >= 2:
        lower = leaderboard[0] < leaderboard[-1]  # MLE-bench's own inference
    else:
        raise ValueError(f"competition {competition_id!r}: cannot tell the metric direction")

    ids = sorted(set(answers[id_column].astype(str).str.strip()))
    rng = np.random.default_rng([seed, 11])
    dev_ids = frozenset(np.asarray(ids, dtype=object)[rng.permutation(len(ids))[: len(ids) // 2]])

    desc_path = comp / "description.md"
    if not desc_path.exists():
        desc_path = public / "description.md"
    description = desc_path.read_text() if desc_path.exists() else f"# {competition_id}\n"

    labels = None
    if grade_fn is None and grading.get_metric(metric).kind == "label":
        labels = _known_labels(answers, public / "train.csv", target_columns)
    task = MLEBenchTask(
        task_id=competition_id, description=description, public_dir=public.resolve(),
        private_dir=private.resolve(), metric=metric or grader_name, lower_is_better=lower,
        id_column=id_column, target_columns=target_columns, labels=labels,
        time_limit_s=time_limit_s, memory_limit_mb=memory_limit_mb,
        leaderboard=leaderboard,
        leaderboard_source=f"MLE-bench leaderboard.csv ({len(leaderboard)} Kaggle teams)" if leaderboard else "",
        seed=seed,
        source=f"MLE-bench prepared competition at {prepared}; competition folder {comp}",
        answers_file=private / "test.csv", grader_name=grader_name, grade_fn=grade_fn,
        dev_ids=dev_ids, competition_dir=comp,
        grader_source="mlebench" if grade_fn is not None else f"ours:{metric}")
    try:
        task.baseline_score = task.grade(public / "sample_submission.csv", "dev")
    except grading.InvalidSubmissionError as e:
        task.baseline_score, task.baseline_error = None, f"sample_submission.csv is invalid: {e}"
    return task
