"""A task's score targets: the anchors that rewards, the learnability potential and the metrics
measure a dev score against (gold and median of the reference leaderboard, the baseline of the
sample submission, the metric's direction), as one frozen record per task (``task_targets``)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

from sandbox.grading import improves


@dataclasses.dataclass(frozen=True)
class TaskTargets:
    """Per-task score anchors used for headroom (and by rewards).

    Attributes:
      task_id: the task.
      gold: the gold-medal threshold of the reference leaderboard (metric units); None when the
        task has no leaderboard.
      median: the leaderboard median (metric units); None exactly when ``gold`` is None.
      baseline: the task's prior baseline score (what a first valid submission improves on).
      lower_is_better: metric direction.

    A task without a leaderboard (``gold`` = ``median`` = None) still trains, with this fallback:

    * headroom is 1 for every score: no ceiling is known, so the learnability potential ranks the
      task's states by their reward spread alone;
    * spread = |baseline| (1 metric unit when the baseline is 0): an improvement as large as the
      baseline itself is one spread, so the reward's improvement term and the normalised score
      are relative to the baseline (log loss 1.10 -> 0.55 is +0.5, accuracy 0.40 -> 0.60 is
      +0.5).
    """

    task_id: str
    gold: Optional[float]
    median: Optional[float]
    baseline: float
    lower_is_better: bool = False

    def __post_init__(self):
        if (self.gold is None) != (self.median is None):
            raise ValueError(f"TaskTargets({self.task_id!r}): gold and median are both set (a "
                             f"leaderboard) or both None (none); got gold={self.gold!r}, "
                             f"median={self.median!r}")
        for name in ("gold", "median", "baseline"):
            value = getattr(self, name)
            if (value is not None or name == "baseline") and not math.isfinite(float(value)):
                raise ValueError(f"TaskTargets({self.task_id!r}).{name} must be finite, "
                                 f"got {value!r}")
        if self.has_leaderboard and self.spread <= 0:
            d = "below" if self.lower_is_better else "above"
            raise ValueError(f"TaskTargets({self.task_id!r}): gold ({self.gold}) must be strictly {d} "
                             f"the median ({self.median}) for a "
                             f"{'lower' if self.lower_is_better else 'higher'}-is-better metric")

    @property
    def has_leaderboard(self) -> bool:
        """True when gold and median come from a reference leaderboard."""
        return self.gold is not None

    @property
    def sign(self) -> float:
        """+1 if higher is better, -1 if lower is better."""
        return -1.0 if self.lower_is_better else 1.0

    @property
    def spread(self) -> float:
        """gold - median in the "better" direction (> 0), metric units; without a leaderboard
        |baseline|, or 1 when the baseline is 0."""
        if not self.has_leaderboard:
            return abs(float(self.baseline)) or 1.0
        return self.sign * (self.gold - self.median)

    def headroom(self, score: Optional[float]) -> float:
        """clip((gold - best) / spread, 0, 1), direction-aware; a missing score counts as baseline.
        1 for every score when the task has no leaderboard."""
        if not self.has_leaderboard:
            return 1.0
        s = self.baseline if score is None else float(score)
        return float(min(1.0, max(0.0, self.sign * (self.gold - s) / self.spread)))

    def better(self, a: Optional[float], b: Optional[float]) -> Optional[float]:
        """The better of two scores (None = no score; ``grading.improves``), ``b`` on a tie."""
        return a if improves(a, b, self.lower_is_better) else b


def task_targets(task: Any) -> TaskTargets:
    """The ``TaskTargets`` of a ``sandbox.tasks.base.Task`` (gold / median from its reference
    leaderboard, baseline = the sample submission's dev score).

    A task without a leaderboard gets gold = median = None: headroom 1 and rewards relative to
    the baseline (the fallback documented on ``TaskTargets``).

    Raises:
      ValueError: the task has no baseline score (names the task and, for an MLE-bench task, why
        its sample submission did not grade).
    """
    if task.baseline_score is None:
        why = getattr(task, "baseline_error", "") or "prepare it with sandbox.prepare"
        raise ValueError(f"task {task.task_id!r} has no baseline_score: {why}")
    gold = median = None
    if task.leaderboard:
        gold, median = float(task.gold), float(task.median)
    return TaskTargets(task_id=task.task_id, gold=gold, median=median,
                       baseline=float(task.baseline_score), lower_is_better=bool(task.lower_is_better))
