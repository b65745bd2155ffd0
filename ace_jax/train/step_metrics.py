"""What one RL step's metrics line says about its rollouts, the LP sampler and the best scores
(``Trainer._step_metrics`` adds the timings, the learner's numbers and the environment's own).

Names (all scalars): ``reward/*``, ``rollout/*`` (validity, where the batch was drawn from, token
counts, each sandbox status' share), ``score/dev_norm_*`` (dev scores normalised by the task's
targets, ``ace_jax.env.rewards.normalised_score``), ``lp/*`` (the sampler's schedule and the
potential over the live buffer) and per task ``task/<id>/best_dev_score`` / ``task/<id>/medal``.
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import ml_collections
import numpy as np

from ace_jax.curriculum import buffer as buffer_lib, learnability
from ace_jax.env import rewards
from ace_jax.train import metrics as metrics_lib
from ace_jax.train.rollouts import StepRollouts
from sandbox.result import ExecutionResult, Status
from sandbox.tasks.targets import TaskTargets


def rollout_metrics(s: StepRollouts, targets: Mapping[str, TaskTargets],
                    reward_cfg: ml_collections.ConfigDict) -> dict[str, float]:
    """Rewards, validity, normalised dev scores, token counts and statuses of a step's rollouts
    (``reward_cfg``: the ``rewards`` section, its normalisation clips)."""
    rs = s.rollouts
    n = len(rs)
    rew = np.asarray([r.reward for r in rs])
    ok = [r.result is not None and r.result.status is Status.OK for r in rs]
    norm = [rewards.normalised_score(r.result.dev_score, targets[r.task_id],
                                     clip_low=reward_cfg.norm_clip_low,
                                     clip_high=reward_cfg.norm_clip_high)
            for r, v in zip(rs, ok) if v]
    m = {
        "reward/mean": rew.mean(), "reward/std": rew.std(),
        "rollout/valid_rate": sum(ok) / n,
        **root_child_metrics([r.state.depth == 0 for r in rs], ok),
        "rollout/format_valid_rate": sum(r.action.valid for r in rs) / n,
        "score/dev_norm_mean": float(np.mean(norm)) if norm else 0.0,
        # Failures count as the baseline (0): improves with validity AND quality.
        "score/dev_norm_all": float(np.sum(norm)) / n,
        "rollout/completion_tokens_mean": float(np.mean(s.gen.lengths)),
        # every completion token generated for the step (dynamic sampling's refills too):
        # what a budget-matched comparison counts
        "rollout/generated_tokens": float(s.gen_tokens),
        "rollout/refill_rounds": float(s.refill_rounds),
        "rollout/prompt_truncated": float(s.truncated),
        **sandbox_metrics([r.result for r in rs]),
    }
    for status in Status:
        m[f"rollout/status/{status.value}"] = sum(
            r.result is not None and r.result.status is status for r in rs) / n
    m["rollout/status/invalid_format"] = sum(not r.action.valid for r in rs) / n
    return m


def sandbox_metrics(results: Sequence[Optional[ExecutionResult]]) -> dict[str, float]:
    """The scripts the sandbox ran for a step (``perf/sandbox_scripts``: executions that started;
    a completion without a code block has no result) and their wall seconds added up
    (``perf/sandbox_run_seconds``). They run side by side, overlapping generation and learning:
    ``perf/sandbox_wait_seconds`` is the part the step waited for."""
    ran = [r for r in results if r is not None and r.exit_code is not None]
    return {"perf/sandbox_scripts": float(len(ran)),
            "perf/sandbox_run_seconds": float(sum(r.wall_s for r in ran))}


def root_child_metrics(is_root: Sequence[bool], valid: Sequence[bool]) -> dict[str, float]:
    """Where a batch was drawn from and how the policy did there, from one flag pair per rollout:
    ``rollout/root_frac`` (share of rollouts on root states: the buffer's initial drafts and
    seeds) and ``rollout/valid_rate_root`` / ``rollout/valid_rate_child`` (each only when the
    batch has such rollouts). The aggregate valid rate moves with this mix as the buffer fills
    with children, so these separate a better policy from a harder batch."""
    m = {"rollout/root_frac": sum(is_root) / len(is_root)}
    for name, want in (("root", True), ("child", False)):
        hits = [v for v, root in zip(valid, is_root) if bool(root) is want]
        if hits:
            m[f"rollout/valid_rate_{name}"] = sum(hits) / len(hits)
    return m


def lp_metrics(step: int, sampler: learnability.Sampler,
               buffer: buffer_lib.EvolvingBuffer) -> dict[str, float]:
    """The sampler's temperature and rho at ``step`` and the mean / max potential over the
    buffer's live states."""
    m = {}
    temp, rho = learnability.schedule(step, sampler.spec)
    m["lp/temperature"], m["lp/rho"] = float(temp), float(rho)
    lp = np.asarray(learnability.potential(learnability.lp_inputs(buffer.stats), sampler.spec))
    live = np.asarray(buffer.stats.valid)
    m["lp/mean"] = float(lp[live].mean()) if live.any() else 0.0
    m["lp/max"] = float(lp[live].max()) if live.any() else 0.0
    return m


def best_score_metrics(best_scores: Mapping[str, Optional[float]],
                       task_by_id: Mapping[str, Any]) -> dict[str, float]:
    """Each task's best valid dev score so far and, with a leaderboard, its medal level."""
    m = {}
    for task_id, best in best_scores.items():
        if best is None:
            continue
        task = task_by_id[task_id]
        m[metrics_lib.task_scalar(task_id, "best_dev_score")] = best
        if task.has_leaderboard:
            m[metrics_lib.task_scalar(task_id, "medal")] = medal_level(task.medal(best))
    return m


def medal_level(report) -> int:
    """3 gold, 2 silver, 1 bronze, 0 none, from a ``sandbox.grading.MedalReport``."""
    return 3 if report.gold else 2 if report.silver else 1 if report.bronze else 0
