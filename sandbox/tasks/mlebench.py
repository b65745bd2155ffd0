"""Adapter: a prepared MLE-bench competition directory as a ``Task``.

MLE-bench keeps two trees per competition ``<id>``:

  * the data dir (``mlebench prepare``): ``<data_dir>/<id>/prepared/public/`` (train/test files,
    ``sample_submission.csv``, ``description.md``) and ``<data_dir>/<id>/prepared/private/test.csv``
    (the answers, in the submission's column layout);
  * the competition dir (the repo's ``mlebench/competitions/<id>/``): ``config.yaml`` (``grader.name``,
    ``grader.grade_fn`` = ``"module.path:function"``), ``description.md``, ``leaderboard.csv``
    (Kaggle's final private leaderboard, a ``score`` column, best first).

``competition_dir`` defaults to the installed ``mlebench`` package's copy when importable, else to
``<data_dir>/<id>/`` (handy for tests and hand-made tasks).

Grading: the answers' rows are split (seeded) into a dev half and a final half, like the offline
suite. A submission must cover every answer id. The score comes from MLE-bench's own grade
function (``grader.grade_fn``) when it can be imported; otherwise from our metric of the same name
when we have one (``GRADER_ALIASES``); otherwise loading fails with ``UnsupportedGraderError``.
"""
from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import os
import pathlib
from typing import Any, Callable, Optional

import numpy as np
import pandas as pd

from sandbox import grading
from sandbox.tasks import base

#: MLE-bench grader names -> our metric names.
GRADER_ALIASES = {
    "accuracy": "accuracy", "multi-class-accuracy": "accuracy", "classification-accuracy": "accuracy",
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


def _default_competition_dir(competition_id: str, data_dir: pathlib.Path) -> pathlib.Path:
    spec = importlib.util.find_spec("mlebench")
    if spec is not None and spec.submodule_search_locations:
        d = pathlib.Path(list(spec.submodule_search_locations)[0]) / "competitions" / competition_id
        if d.is_dir():
            return d
    return data_dir / competition_id


@dataclasses.dataclass
class MLEBenchTask(base.Task):
    """A Task backed by one MLE-bench answers file and (optionally) MLE-bench's grade function.

    Extra attributes:
      answers_file: ``prepared/private/test.csv``.
      grader_name: ``config.yaml``'s ``grader.name``.
      grade_fn: MLE-bench's ``grade(submission_df, answers_df) -> float`` or None (ours is used).
      dev_ids: the answer ids of the dev half (the rest form the final half).
    """

    answers_file: Optional[pathlib.Path] = None
    grader_name: str = ""
    grade_fn: Optional[Callable[[pd.DataFrame, pd.DataFrame], Any]] = None
    dev_ids: frozenset = frozenset()

    def __post_init__(self):
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
        d["dev_ids"] = sorted(self.dev_ids)
        d["grade_fn"] = None if self.grade_fn is None else (
            f"{self.grade_fn.__module__}:{self.grade_fn.__qualname__}")
        return d

    def _all_answers(self) -> pd.DataFrame:
        if "_answers_df" not in self.__dict__:
            df = pd.read_csv(self.answers_file, dtype={self.id_column: str})
            if self.id_column not in df.columns:
                raise ValueError(f"{self.answers_file}: no id column {self.id_column!r}")
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
        sub = grading.read_submission(submission_csv, self.id_column)
        if self.grade_fn is None:
            return grading.validate_submission(
                sub, id_column=self.id_column, target_columns=self.target_columns,
                expected_ids=self.test_ids, metric=self.metric, labels=self.labels)
        if self.id_column not in sub.columns:
            raise grading.InvalidSubmissionError(
                f"submission has no id column {self.id_column!r}; columns: {list(sub.columns)}")
        got, want = set(sub[self.id_column].astype(str)), set(self.test_ids)
        if got != want:
            raise grading.InvalidSubmissionError(
                f"id mismatch: {len(want - got)} answer ids missing, {len(got - want)} unknown ids")
        return sub

    def grade(self, submission_csv, split: str = "dev") -> float:
        if split not in base.SPLITS:
            raise ValueError(f"split must be one of {base.SPLITS}, got {split!r}")
        validated = self.validate(submission_csv)
        answers = self._split_answers(split)
        if self.grade_fn is None:
            a = answers.astype({self.id_column: str}).set_index(self.id_column)[list(self.target_columns)]
            return grading.score_submission(validated, a, self.metric)
        sub = validated[validated[self.id_column].astype(str).isin(set(answers[self.id_column]))]
        try:
            score = self.grade_fn(sub.reset_index(drop=True), answers)
        except Exception as e:  # MLE-bench's own InvalidSubmissionError -> ours
            if type(e).__name__ == "InvalidSubmissionError":
                raise grading.InvalidSubmissionError(str(e)) from e
            raise
        if score is None:
            raise grading.InvalidSubmissionError("MLE-bench's grader returned no score")
        return float(score)


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
      competition_dir: folder with config.yaml / description.md / leaderboard.csv (see module doc).
      seed: seed of the dev/final split of the answer rows.
      time_limit_s, memory_limit_mb: per-execution budget.
      use_mlebench_grader: use ``grader.grade_fn`` when importable (False: force our metric).

    Raises:
      FileNotFoundError: a required file is missing (named in the message).
      UnsupportedGraderError: no importable grade function and no matching metric of ours.
    """
    data_dir = pathlib.Path(data_dir)
    prepared = data_dir / competition_id / "prepared"
    public, private = prepared / "public", prepared / "private"
    comp = pathlib.Path(competition_dir) if competition_dir else _default_competition_dir(
        competition_id, data_dir)
    for p in (public / "sample_submission.csv", private / "test.csv", comp / "config.yaml"):
        if not p.exists():
            raise FileNotFoundError(f"MLE-bench competition {competition_id!r}: missing {p}")
    cfg = _read_yaml(comp / "config.yaml")
    grader = cfg.get("grader") or {}
    grader_name = str(grader.get("name", ""))
    grade_fn = _import_grade_fn(str(grader.get("grade_fn", ""))) if use_mlebench_grader else None
    metric = GRADER_ALIASES.get(grader_name.lower())
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
    leaderboard = []
    if lb_path.exists():
        lb = pd.read_csv(lb_path)
        if "score" not in lb.columns:
            raise ValueError(f"{lb_path}: no 'score' column")
        leaderboard = [float(s) for s in lb["score"].dropna()]
    if metric is not None:
        lower = grading.get_metric(metric).lower_is_better
    elif "lower_is_better" in cfg or "is_lower_better" in grader:
        lower = bool(cfg.get("lower_is_better", grader.get("is_lower_better")))
    elif len(leaderboard) >= 2:
        lower = leaderboard[0] < leaderboard[-1]  # MLE-bench's own inference
    else:
        raise ValueError(f"competition {competition_id!r}: cannot tell the metric direction")

    ids = sorted(set(answers[id_column].astype(str)))
    rng = np.random.default_rng([seed, 11])
    dev_ids = frozenset(np.asarray(ids, dtype=object)[rng.permutation(len(ids))[: len(ids) // 2]])

    desc_path = comp / "description.md"
    if not desc_path.exists():
        desc_path = public / "description.md"
    description = desc_path.read_text() if desc_path.exists() else f"# {competition_id}\n"

    labels = None
    if grade_fn is None and grading.get_metric(metric).kind == "label":
        labels = tuple(sorted({grading.canonical_label(v)
                               for c in target_columns for v in answers[c].dropna()}))
    task = MLEBenchTask(
        task_id=competition_id, description=description, public_dir=public.resolve(),
        private_dir=private.resolve(), metric=metric or grader_name, lower_is_better=lower,
        id_column=id_column, target_columns=target_columns, labels=labels,
        time_limit_s=time_limit_s, memory_limit_mb=memory_limit_mb,
        leaderboard=leaderboard,
        leaderboard_source=f"MLE-bench leaderboard.csv ({len(leaderboard)} Kaggle teams)" if leaderboard else "",
        seed=seed, source=f"MLE-bench prepared competition at {prepared}",
        answers_file=private / "test.csv", grader_name=grader_name, grade_fn=grade_fn,
        dev_ids=dev_ids)
    try:
        task.baseline_score = task.grade(public / "sample_submission.csv", "dev")
    except grading.InvalidSubmissionError:
        task.baseline_score = None
    return task
