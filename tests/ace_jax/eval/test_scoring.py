"""The metrics of an episode and their aggregation, computed by hand: HumanRank, medals, mean
and SE, Best@k; and the reports built from them."""
import json
import math

import pytest

from ace_jax.eval import episodes, harness, reports, scoring
from tests.ace_jax.eval.scripted import copy_task


LEADERBOARD = [0.1, 0.2, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]  # log loss, lower is better


def _episode(task, seed, first_valid, test_score):
    """An episode record: steps 1..first_valid-1 crash, then a valid step; a final test score."""
    steps = []
    for n in range(1, (first_valid or 2) + 1):
        valid = first_valid is not None and n == first_valid
        steps.append(episodes.EpisodeStep(
            step=n, kind="draft", prompt=[], policy_seed=n, code="x = 1\n",
            status="ok" if valid else "runtime_error", dev_score=0.5 if valid else None,
            best_dev_so_far=0.5 if valid else None))
    final = episodes.FinalSubmission(
        step=first_valid, status="ok" if test_score is not None else episodes.NO_VALID,
        test_score=test_score)
    ep = episodes.Episode(task_id=task.task_id, seed=seed, policy="p", metric=task.metric,
                            lower_is_better=True, steps=steps, final=final)
    ep.outcome = scoring.score_episode(ep, task)
    return ep


def test_humanrank_medals_and_mean_se_by_hand(iris, tmp_path):
    task = copy_task(iris, leaderboard=LEADERBOARD)
    # Thresholds (N = 10 < 100): gold = 1st = 0.1, silver = 2nd = 0.2, bronze = 4th = 0.3,
    # median = (0.4 + 0.5) / 2 = 0.45.
    eps = [_episode(task, 0, 2, 0.2),     # ties entries 2-3: p = 1 + 1 = 2 -> 9/10; silver
           _episode(task, 1, 1, 0.35),    # 4 entries strictly better: p = 5 -> 6/10; > median
           _episode(task, 2, None, None),  # never valid -> 0, nothing
           _episode(task, 3, 3, 0.05)]    # best of all: p = 1 -> 1; gold
    hr = [e.outcome.human_rank for e in eps]
    assert hr == pytest.approx([0.9, 0.6, 0.0, 1.0])
    assert _episode(task, 4, 1, 0.95).outcome.human_rank == 0.0  # worse than all: p = N + 1
    flags = [(e.outcome.gold, e.outcome.silver, e.outcome.bronze, e.outcome.above_median)
             for e in eps]
    assert flags == [(False, True, False, True), (False, False, False, True),
                     (False, False, False, False), (True, False, False, True)]
    s = scoring.summarize_task(task.task_id, eps)
    st = s.stats
    # HumanRank: mean 0.625; deviations .275 -.025 -.625 .375 -> ss .6075 / 3 = .2025, sd .45,
    # SE = .45 / 2.
    assert (st["human_rank"].mean, st["human_rank"].se) == pytest.approx((0.625, 0.225))
    assert (st["any_medal"].mean, st["any_medal"].se) == pytest.approx((0.5, math.sqrt(1 / 3) / 2))
    assert [st[m].mean for m in ("gold", "silver", "bronze", "valid", "above_median")] == \
        pytest.approx([0.25, 0.25, 0.0, 0.75, 0.75])
    # Steps to first valid: over the 3 that reached one (2, 1, 3): mean 2, sd 1, SE 1/sqrt(3).
    assert (st["steps_to_first_valid"].mean, st["steps_to_first_valid"].se,
            st["steps_to_first_valid"].n) == pytest.approx((2.0, 1 / math.sqrt(3), 3))
    assert st["never_valid"].mean == 0.25
    assert st["test_score"].mean == pytest.approx((0.2 + 0.35 + 0.05) / 3)
    assert scoring.mean_se([0.7]) == scoring.Stat(0.7, None, 1)
    assert scoring.mean_se([None]) == scoring.Stat(None, None, 0)

    # Overall: per seed the mean over tasks, then mean and SE over seeds.
    other = copy_task(task, task_id="other-task")
    two = [eps[0], eps[1], _episode(other, 0, 1, 0.45), _episode(other, 1, None, None)]
    # other: 0.45 -> 5 entries better -> p = 6 -> 0.5; invalid -> 0.
    assert two[2].outcome.human_rank == pytest.approx(0.5)
    tasks, overall, _ = scoring.summarize(two)
    assert [t.task_id for t in tasks] == [task.task_id, "other-task"]
    # seed 0: (0.9 + 0.5) / 2 = 0.7; seed 1: (0.6 + 0) / 2 = 0.3 -> mean 0.5, SE 0.2 / sqrt(2)...
    # sd of (0.7, 0.3) = 0.2828, SE = 0.2.
    assert (overall.stats["human_rank"].mean, overall.stats["human_rank"].se) == \
        pytest.approx((0.5, 0.2))
    # valid: seed 0 (1 + 1) / 2 = 1, seed 1 (1 + 0) / 2 = .5 -> .75 ± .25
    assert (overall.stats["valid"].mean, overall.stats["valid"].se) == pytest.approx((0.75, 0.25))
    assert "test_score" not in overall.stats
    # Best@2: per task the best of its 2 seeds, then the mean over tasks: (0.9 + 0.5) / 2.
    assert overall.stats[scoring.BEST_AT_K] == scoring.Stat(pytest.approx(0.7), None, 2)
    with pytest.raises(ValueError, match="same number of episodes per task"):
        scoring.best_at_k(two[:3])

    result = harness.EvaluationResult(
        policy="p", config={"tasks": [task.task_id, "other-task"], "seeds": [0, 1],
                            "max_steps": 3, "time_budget_s": None, "stagnation_steps": 2,
                            "advisor": None},
        episodes=two, tasks=tasks, overall=overall, notes=[], wall_s=1.0)
    table = reports.format_table(result)
    assert "overall" in table and "0.500±0.200" in table and "75±25" in table
    paths = reports.write_reports(result, tmp_path)
    data = json.loads(open(paths["json"]).read())
    assert data["overall"]["stats"]["human_rank"]["mean"] == pytest.approx(0.5)
    markdown = open(paths["markdown"]).read()
    assert "| **overall** |" in markdown
    assert "Avg@2 / Best@2 of HumanRank (2 seeds per task): 0.500 / 0.700" in markdown
    for key in ("per_task_plot", "best_dev_plot"):
        assert open(paths[key], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_task_without_leaderboard_has_no_medals(iris):
    task = copy_task(iris, leaderboard=[])
    ep = _episode(task, 0, 1, 0.3)
    assert ep.outcome.valid and ep.outcome.human_rank is None and ep.outcome.gold is None
    s = scoring.summarize_task(task.task_id, [ep])
    assert s.stats["human_rank"].n == 0 and "no reference leaderboard" in s.notes[0]
    assert scoring.best_at_k([ep]) == scoring.Stat(None, None, 0)
