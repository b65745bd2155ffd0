"""The metrics of an episode and their aggregation over tasks and seeds.

Metrics (``score_episode``, one value per episode; ``summarize`` gives mean and standard error):

* valid: the final submission is valid on the final-test split (1/0).
* above_median / any_medal / gold / silver / bronze: MLE-bench's flags of the final-test score on
  the task's reference leaderboard (``Task.medal``; medals inclusive, above-median strict).
  An invalid final submission gets 0 for all.
* human_rank: MLE-Dojo's HumanRank (N - p + 1) / N on the reference leaderboard of N entries,
  where p is the 1-indexed position the score would take: p = 1 + #(entries strictly better than
  the score), so a tie takes the best of the tied positions (the first entry, best first, that the
  score beats or ties); a score worse than every entry has p = N + 1 and HumanRank 0; an invalid
  final submission has HumanRank 0. Equivalently 1 - #(strictly better) / N
  (``sandbox.grading.position_score``). The offline suite's leaderboards are our own baseline
  sweep, not human teams.
* A task without a reference leaderboard (e.g. an MLE-bench competition with no
  ``leaderboard.csv``) is still evaluated: its medal flags and HumanRank are None (not
  available, printed "n/a"), with a note; the overall medal and HumanRank figures then average
  over the tasks that have a leaderboard.
* steps_to_first_valid: the 1-indexed step of the first valid dev submission (None if never;
  averaged only over episodes that reached one) and never_valid (1/0): the fraction that never did.
* test_score: the final-test score in metric units (valid episodes only; per task only).

Aggregation: per task, the mean over its seeds and the standard error sd / sqrt(n) with the
sample standard deviation (ddof = 1); SE is None for n < 2. Overall (MLE-bench's convention): for
each seed, the mean over tasks, then mean and SE of those per-seed values over seeds.

MLE-Ideator's Avg@k and Best@k, with k the seeds per task (k independent runs of each task):
Avg@k is the mean over tasks of the mean HumanRank over the k runs, which is the overall
``human_rank`` mean; Best@k (overall ``best_at_k``) is the mean over tasks of the best HumanRank
of the k runs (no SE: one value per task). The paper prints both x 100.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Iterable, Optional, Sequence

from ace_jax.eval.episodes import Episode, EpisodeOutcome, finite
from sandbox.result import Status

FLAG_METRICS = ("valid", "above_median", "any_medal", "gold", "silver", "bronze")
METRICS = FLAG_METRICS + ("human_rank", "steps_to_first_valid", "never_valid", "test_score")
OVERALL_METRICS = tuple(m for m in METRICS if m != "test_score")  # test scores mix units
BEST_AT_K = "best_at_k"  # overall only: MLE-Ideator's Best@k of HumanRank (``best_at_k``)
#: The metrics that need a reference leaderboard (None, printed "n/a", for a task without one).
LEADERBOARD_METRICS = ("above_median", "any_medal", "gold", "silver", "bronze", "human_rank")
NOT_AVAILABLE = "n/a"


@dataclasses.dataclass
class Stat:
    """Mean and standard error of ``n`` values (None when undefined: n = 0, or SE with n < 2)."""
    mean: Optional[float]
    se: Optional[float]
    n: int


@dataclasses.dataclass
class TaskSummary:
    """Metrics of one task over its seeds (or of all tasks: task_id "overall").

    Attributes:
      task_id: the task, or "overall".
      n_episodes: episodes counted.
      stats: metric name -> Stat (see ``METRICS``; "overall" holds ``OVERALL_METRICS`` and
        ``BEST_AT_K``).
      grader_errors: executions whose grader raised (an environment bug, not the agent's).
      harness_errors: episodes aborted by a harness failure.
      notes: what a reader must know (broken grader, no leaderboard, aborted episodes).
    """
    task_id: str
    n_episodes: int
    stats: dict[str, Stat]
    grader_errors: int = 0
    harness_errors: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)


def score_episode(episode: Episode, task: Any) -> EpisodeOutcome:
    """The metrics of one episode from its final-test score and the task's leaderboard.

    A task without a reference leaderboard gets None for the medal flags and HumanRank (and a
    note); every other failure of the leaderboard helpers propagates (a harness bug).
    """
    test = episode.final.test_score if finite(episode.final.test_score) else None
    first = next((s.step for s in episode.steps if s.valid), None)
    statuses = [s.status for s in episode.steps] + [episode.final.status]
    out = EpisodeOutcome(
        valid=test is not None, above_median=None, any_medal=None, gold=None, silver=None,
        bronze=None, human_rank=None, steps_to_first_valid=first, never_valid=first is None,
        test_score=test,
        best_dev_score=next((s.best_dev_so_far for s in reversed(episode.steps)), None),
        grader_errors=statuses.count(Status.GRADER_ERROR.value),
        policy_errors=statuses.count("policy_error"),
        invalid_format=statuses.count("invalid_format"),
        advice_requests=sum(s.advice_reason is not None for s in episode.steps))
    if not getattr(task, "leaderboard", None):
        out.note = (f"task {episode.task_id} has no reference leaderboard: medals and HumanRank "
                    f"{NOT_AVAILABLE} (not counted in the overall figures)")
        return out
    medal = task.medal(test)
    out.above_median, out.gold, out.silver, out.bronze = (
        medal.above_median, medal.gold, medal.silver, medal.bronze)
    out.any_medal = medal.any_medal
    out.human_rank = float(task.position_score(test))
    return out


def mean_se(values: Iterable[Optional[float]]) -> Stat:
    """Mean and standard error (sample sd, ddof = 1, over sqrt(n)) of the non-None values."""
    vals = [float(v) for v in values if v is not None]
    n = len(vals)
    if n == 0:
        return Stat(None, None, 0)
    mean = sum(vals) / n
    se = statistics.stdev(vals) / math.sqrt(n) if n >= 2 else None
    return Stat(mean, se, n)


def _outcomes(episodes: Sequence[Episode]) -> list[EpisodeOutcome]:
    missing = [f"{e.task_id}/seed{e.seed}" for e in episodes if e.outcome is None]
    if missing:
        raise ValueError(f"episodes without an outcome (run score_episode first): {missing}")
    return [e.outcome for e in episodes]


def _notes_for(task_id: str, episodes: Sequence[Episode]) -> tuple[int, int, list[str]]:
    grader = sum(e.outcome.grader_errors for e in episodes)
    aborted = [e for e in episodes if e.error]
    notes = []
    if grader:
        notes.append(f"task {task_id}: the grader raised in {grader} execution(s) (an "
                     "environment bug, not the agent's); those submissions count as invalid")
    for e in aborted:
        notes.append(f"task {task_id} seed {e.seed}: episode aborted by a harness error: "
                     f"{e.error}")
    leaderboard_notes = {e.outcome.note for e in episodes if e.outcome.note}
    notes += sorted(leaderboard_notes)
    return grader, len(aborted), notes


def summarize_task(task_id: str, episodes: Sequence[Episode]) -> TaskSummary:
    """Mean and SE over the episodes (one per seed) of one task."""
    outs = _outcomes(episodes)
    stats = {m: mean_se(o.value(m) for o in outs) for m in METRICS}
    grader, aborted, notes = _notes_for(task_id, episodes)
    return TaskSummary(task_id, len(episodes), stats, grader, aborted, notes)


def summarize_overall(episodes: Sequence[Episode]) -> TaskSummary:
    """Per seed the mean over tasks, then mean and SE over seeds (MLE-bench's convention).

    ``steps_to_first_valid`` of a seed is the mean over its episodes that reached a valid
    submission; a seed with none contributes no value.
    """
    _outcomes(episodes)
    by_seed: dict[int, list[Episode]] = {}
    for e in episodes:
        by_seed.setdefault(e.seed, []).append(e)
    stats = {}
    for m in OVERALL_METRICS:
        per_seed = [mean_se(e.outcome.value(m) for e in eps).mean
                    for _, eps in sorted(by_seed.items())]
        stats[m] = mean_se(per_seed)
    stats[BEST_AT_K] = best_at_k(episodes)
    grader = sum(e.outcome.grader_errors for e in episodes)
    aborted = sum(bool(e.error) for e in episodes)
    return TaskSummary("overall", len(episodes), stats, grader, aborted, [])


def best_at_k(episodes: Sequence[Episode], metric: str = "human_rank") -> Stat:
    """MLE-Ideator's Best@k: per task the best ``metric`` over its episodes (its k seeds), then
    the mean over the tasks that have a value; SE None (one value per task), n = those tasks.

    Raises ValueError if the tasks have different numbers of episodes (k would be ambiguous).
    """
    by_task: dict[str, list[Optional[float]]] = {}
    for e in episodes:
        by_task.setdefault(e.task_id, []).append(e.outcome.value(metric))
    if len({len(v) for v in by_task.values()}) > 1:
        raise ValueError("Best@k needs the same number of episodes per task, got "
                         + str({t: len(v) for t, v in by_task.items()}))
    best = [max(v for v in vals if v is not None) for vals in by_task.values()
            if any(v is not None for v in vals)]
    return Stat(sum(best) / len(best), None, len(best)) if best else Stat(None, None, 0)


def summarize(episodes: Sequence[Episode]) -> tuple[list[TaskSummary], TaskSummary, list[str]]:
    """(per-task summaries in first-seen task order, the overall summary, all notes)."""
    order: dict[str, list[Episode]] = {}
    for e in episodes:
        order.setdefault(e.task_id, []).append(e)
    tasks = [summarize_task(t, sorted(eps, key=lambda e: e.seed)) for t, eps in order.items()]
    notes = [n for t in tasks for n in t.notes]
    return tasks, summarize_overall(episodes), notes


# ------------------------------------------------------------------------------------ evaluation
