"""The ``Task`` record: one prepared MLE task in MLE-bench's directory layout, plus its grader.

A prepared task directory looks like::

    <root>/<task_id>/
      public/    train.csv, test.csv (no labels), sample_submission.csv, description.md
                 (mounted read-only at ./input inside the sandbox)
      private/   answers_dev.csv, answers_test.csv (same columns as a submission; never visible
                 inside the sandbox)
      task.json  the record below (metric, columns, labels, limits, baseline score, ...)
      checksums.json  sha256 of every public/private file (written by ``sandbox.prepare``)

The test rows are split (seeded) into a *dev* half, graded after every execution (the RL signal),
and a *final* half, graded with ``split="test"`` for evaluation only. A submission always covers
every test id.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Any, ClassVar, Optional, Sequence

import pandas as pd

from sandbox import grading

SPLITS = ("dev", "test")
ANSWER_FILES = {"dev": "answers_dev.csv", "test": "answers_test.csv"}


class NoLeaderboardError(ValueError):
    """A medal or position score was asked of a task without a reference leaderboard.

    Such a task still trains and evaluates: callers check ``Task.has_leaderboard`` and report
    medals and HumanRank as not available (None, printed "n/a").
    """


@dataclasses.dataclass
class Task:
    """One MLE task, duck-typed by ``sandbox.pool.SandboxPool``.

    Attributes:
      task_id: registry name, e.g. ``"digits-8x8"``.
      description: the task page (markdown); also ``public_dir/description.md``.
      public_dir: data the agent sees (mounted read-only at ``./input``).
      private_dir: hidden answers for the dev and final-test halves.
      metric: a name registered in ``sandbox.grading.METRICS``.
      lower_is_better: metric direction (declared, never inferred).
      id_column: the submission's id column.
      target_columns: the submission's prediction columns, in order.
      labels: allowed labels for ``label`` metrics (strings), else None.
      time_limit_s: wall-clock budget of one execution, seconds.
      memory_limit_mb: memory budget of one execution, MiB.
      hidden_paths: host paths the agent must not see (private dir, packaged source data).
      leaderboard: reference scores (final-test split) used for medals and position scores.
      leaderboard_source: where the leaderboard came from (e.g. "baseline sweep, seed 0").
      baseline_score: the sample submission's (trivial prediction's) dev score; the "prior" a first
        valid submission is compared with.
      seed: the seed the task was prepared with.
      source: a short note on the data source (host-side documentation, not shown to the agent).
      requires_isolation: (class attribute, not a field: task.json and its checksums are
        unchanged) True when the task's hidden files (e.g. MLE-bench's private answers) must be
        kept from generated code by an isolating sandbox backend; False here, True for
        ``sandbox.tasks.mlebench.MLEBenchTask``.
    """

    requires_isolation: ClassVar[bool] = False

    task_id: str
    description: str
    public_dir: pathlib.Path
    private_dir: pathlib.Path
    metric: str
    lower_is_better: bool
    id_column: str = "id"
    target_columns: tuple[str, ...] = ("target",)
    labels: Optional[tuple[str, ...]] = None
    time_limit_s: float = 120.0
    memory_limit_mb: int = 2048
    hidden_paths: tuple[str, ...] = ()
    leaderboard: list[float] = dataclasses.field(default_factory=list)
    leaderboard_source: str = ""
    baseline_score: Optional[float] = None
    seed: int = 0
    source: str = ""

    def __post_init__(self):
        self.public_dir = pathlib.Path(self.public_dir)
        self.private_dir = pathlib.Path(self.private_dir)
        self.target_columns = tuple(self.target_columns)
        self.labels = None if self.labels is None else tuple(str(l) for l in self.labels)
        self.hidden_paths = tuple(str(p) for p in self.hidden_paths)
        metric = grading.get_metric(self.metric)
        if metric.lower_is_better != self.lower_is_better:
            raise ValueError(
                f"task {self.task_id!r}: lower_is_better={self.lower_is_better} contradicts metric "
                f"{self.metric!r} (lower_is_better={metric.lower_is_better})")
        if str(self.private_dir) not in self.hidden_paths:
            self.hidden_paths = (str(self.private_dir),) + self.hidden_paths

    # ---------------------------------------------------------------- answers and grading

    @functools.cached_property
    def _answers(self) -> dict[str, pd.DataFrame]:
        out = {}
        for split, name in ANSWER_FILES.items():
            path = self.private_dir / name
            if not path.exists():
                raise FileNotFoundError(f"task {self.task_id!r}: answers file missing: {path}")
            df = pd.read_csv(path, dtype={self.id_column: str})
            if self.labels is not None:
                df = df.astype({c: str for c in self.target_columns})
            out[split] = df.set_index(self.id_column)[list(self.target_columns)]
        return out

    @property
    def test_ids(self) -> list[str]:
        """Every test id (dev half then final half), strings."""
        return [*self._answers["dev"].index, *self._answers["test"].index]

    def validate(self, submission_csv: "pathlib.Path | str") -> pd.DataFrame:
        """Format-only check (MLE-bench's /validate); returns the validated frame indexed by id.

        Raises InvalidSubmissionError naming the problem.
        """
        sub = grading.read_submission(submission_csv, self.id_column)
        return grading.validate_submission(
            sub, id_column=self.id_column, target_columns=self.target_columns,
            expected_ids=self.test_ids, metric=self.metric, labels=self.labels)

    def grade(self, submission_csv: "pathlib.Path | str", split: str = "dev") -> float:
        """Scores a submission CSV on the hidden ``split`` ("dev" or "test" = final half).

        The submission must cover every test id; only the split's rows are scored.
        Raises InvalidSubmissionError for any format problem, ValueError for an unknown split.
        """
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        validated = self.validate(submission_csv)
        return grading.score_submission(validated, self._answers[split], self.metric)

    # ---------------------------------------------------------------- leaderboard helpers

    @property
    def has_leaderboard(self) -> bool:
        """True when the task has reference scores (medals and HumanRank are defined)."""
        return bool(self.leaderboard)

    def leaderboard_hint(self) -> str:
        """What to do to get a reference leaderboard for this task (one sentence)."""
        return f"run `python -m sandbox.sweep` for seed {self.seed}"

    def _require_leaderboard(self) -> list[float]:
        if not self.has_leaderboard:
            raise NoLeaderboardError(
                f"task {self.task_id!r} (seed {self.seed}) has no reference leaderboard, so no "
                f"medals or HumanRank; {self.leaderboard_hint()}")
        return self.leaderboard

    def medal_thresholds(self) -> grading.MedalThresholds:
        """MLE-bench's thresholds on the reference leaderboard (NoLeaderboardError without one)."""
        return grading.medal_thresholds(self._require_leaderboard(), self.lower_is_better)

    def medal(self, score: Optional[float]) -> grading.MedalReport:
        """Medal flags for a final-test ``score`` (None = invalid submission)."""
        return grading.medal_report(score, self.medal_thresholds())

    def position_score(self, score: Optional[float]) -> float:
        """HumanRank (N - p + 1) / N of ``score`` on the reference leaderboard; 0 for None."""
        return grading.position_score(score, self._require_leaderboard(), self.lower_is_better)

    @property
    def gold(self) -> float:
        """Gold-medal threshold score."""
        return self.medal_thresholds().gold

    @property
    def median(self) -> float:
        """Median of the reference leaderboard."""
        return self.medal_thresholds().median

    def better(self, a: float, b: float) -> bool:
        """True when score ``a`` is strictly better than ``b`` in this task's direction
        (``grading.improves``)."""
        return grading.improves(a, b, self.lower_is_better)

    # ---------------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["public_dir"], d["private_dir"] = str(self.public_dir), str(self.private_dir)
        d["target_columns"] = list(self.target_columns)
        d["labels"] = None if self.labels is None else list(self.labels)
        d["hidden_paths"] = list(self.hidden_paths)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Task":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown Task fields: {sorted(unknown)}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, s: str) -> "Task":
        return cls.from_dict(json.loads(s))


def write_task_json(task: Task, task_dir: pathlib.Path) -> None:
    """Writes ``task.json`` with paths relative to ``task_dir`` (so the folder can move and its
    checksum is the same on every host)."""
    d = task.to_dict()
    d["public_dir"], d["private_dir"] = "public", "private"
    # Host-specific paths (the packaged sources) are not stored: the builder supplies them at load.
    d.pop("hidden_paths"), d.pop("leaderboard"), d.pop("leaderboard_source")
    (task_dir / "task.json").write_text(json.dumps(d, indent=1, sort_keys=True) + "\n")


def read_task_json(task_dir: pathlib.Path, *, leaderboard: Sequence[float] = (),
                   leaderboard_source: str = "",
                   extra_hidden_paths: Sequence[str] = ()) -> Task:
    """Reads a prepared task directory's ``task.json`` into a Task with absolute paths."""
    task_dir = pathlib.Path(task_dir).resolve()
    path = task_dir / "task.json"
    if not path.exists():
        raise FileNotFoundError(f"not a prepared task directory (no task.json): {task_dir}")
    d = json.loads(path.read_text())
    d["public_dir"] = task_dir / d["public_dir"]
    d["private_dir"] = task_dir / d["private_dir"]
    d["hidden_paths"] = tuple(d.get("hidden_paths", ())) + tuple(extra_hidden_paths)
    d["leaderboard"] = [float(s) for s in leaderboard]
    d["leaderboard_source"] = leaderboard_source
    return Task.from_dict(d)
