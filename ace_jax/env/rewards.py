"""Reward registry (tunix style): a reward is a registered function, chosen by name in the config.

Every reward has the same keyword signature::

    fn(*, action, result, current_score, targets, cfg) -> float

* ``action``: ``ace_jax.env.agent.Action`` or ``InvalidAction`` (the parsed completion);
* ``result``: the ``sandbox.result.ExecutionResult`` of the executed code, or None when nothing was
  executed (an invalid action is never executed);
* ``current_score``: the state's current dev score (metric units), None when the state has no valid
  submission yet;
* ``targets``: the task's ``sandbox.tasks.targets.TaskTargets`` (gold, median, baseline,
  direction);
* ``cfg``: the ``rewards`` config section (``default_config()``).

Registered here:

* ``acegrpo_step`` (DESIGN.md): invalid format -> ``r_format``; execution failed or no valid
  submission -> ``r_fail``; valid -> ``r_valid + improve_coef * clip((s_new - s_cur) * sign /
  spread, -1, 1)`` with ``s_cur = current_score`` or, for a first valid submission, the task's
  baseline; ``sign`` = -1 for lower-is-better metrics; ``spread = |gold - median|`` of the
  reference leaderboard (a task without one: ``|baseline|``, see ``TaskTargets``).
* ``ideator_ternary`` (MLE-Ideator): +1 if the implementer's execution strictly improves on
  ``s_cur``, 0 if not or if it fails, -1 if the idea is not in the required format.

``normalised_score(score, targets)`` maps a dev score to "fraction of the way from the baseline to
gold" (the trainer's "mean normalised dev score"); without a leaderboard, to the improvement over
the baseline in units of |baseline|.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional, Sequence

import ml_collections

from ace_jax.registry import Registry
from sandbox.grading import improves
from sandbox.result import ExecutionResult, Status

RewardFn = Callable[..., float]
REWARDS: Registry[RewardFn] = Registry("reward")


def default_config() -> ml_collections.ConfigDict:
    """The ``rewards`` config section (every reward constant lives here)."""
    c = ml_collections.ConfigDict()
    # acegrpo_step
    c.r_format = -1.0        # completion not in the required format (not executed)
    c.r_fail = 0.0           # executed, but failed or wrote no valid submission
    # Optional shaping: the reward of code that does not even compile (None: r_fail, the paper's
    # reward). A value below r_fail gives a weak policy a signal towards runnable code.
    c.r_syntax_error = None
    c.r_valid = 1.0          # a valid, graded submission
    c.improve_coef = 0.5     # lambda: weight of the clipped, spread-normalised improvement
    c.improve_clip = 1.0     # the improvement term is clipped to [-improve_clip, improve_clip]
    # ideator_ternary
    c.ideator_improve = 1.0
    c.ideator_no_improve = 0.0
    c.ideator_format = -1.0
    c.ideator_require_idea = True  # an Action without an ``Idea:`` paragraph is a format error
    # normalised_score clipping (keeps a disastrous score from dominating a mean)
    c.norm_clip_low = -1.0
    c.norm_clip_high = 2.0
    return c


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering ``fn`` under ``name``; registering another function there is an error."""
    return REWARDS.register(name)


def list_rewards() -> list[str]:
    """Sorted names of the registered rewards."""
    return REWARDS.names()


def get_reward(name: str) -> RewardFn:
    """The reward registered as ``name``; ``UnknownNameError`` lists the known names."""
    return REWARDS.get(name)


# --------------------------------------------------------------------------------------------------
# Helpers


def valid_score(result: Optional[ExecutionResult]) -> Optional[float]:
    """The dev score of a valid, graded execution (finite), else None."""
    if result is None or result.status is not Status.OK or result.dev_score is None:
        return None
    s = float(result.dev_score)
    return s if math.isfinite(s) else None


def improvement(new: float, current: Optional[float], targets: Any, clip: float = 1.0) -> float:
    """clip(sign * (new - current) / spread, -clip, clip): positive when ``new`` is better.

    ``current`` None counts as the task's baseline. ``spread = |gold - median|`` (metric units).
    """
    cur = targets.baseline if current is None else float(current)
    raw = targets.sign * (float(new) - cur) / targets.spread
    return float(min(clip, max(-clip, raw)))


def normalised_score(score: Optional[float], targets: Any, *, clip_low: Optional[float] = -1.0,
                     clip_high: Optional[float] = 2.0) -> float:
    """(score - baseline) / (gold - baseline), clipped to [clip_low, clip_high] (None: no bound).

    0 = the trivial baseline, 1 = the gold threshold of the reference leaderboard; the formula is
    direction-aware by construction (numerator and denominator flip sign together for
    lower-is-better metrics). A missing score (no valid submission) counts as the baseline, 0.
    Without a leaderboard (``targets.gold`` None): sign * (score - baseline) / spread with spread
    = |baseline| (``TaskTargets``), so 1 = better than the baseline by the baseline's magnitude.

    Raises:
      ValueError: gold equals the baseline (the task gives no scale).
    """
    if targets.gold is None:
        denom = targets.sign * targets.spread
    else:
        denom = float(targets.gold) - float(targets.baseline)
    if denom == 0.0:
        raise ValueError(f"task {targets.task_id!r}: gold == baseline ({targets.gold}); "
                         "normalised_score is undefined")
    if score is None or not math.isfinite(float(score)):
        return 0.0
    v = (float(score) - float(targets.baseline)) / denom
    if clip_low is not None:
        v = max(float(clip_low), v)
    if clip_high is not None:
        v = min(float(clip_high), v)
    return float(v)


def _is_action(action: Any) -> bool:
    valid = getattr(action, "valid", None)
    if valid is None:
        raise TypeError(f"action must be an agent.Action or agent.InvalidAction, got {type(action).__name__}")
    return bool(valid)


# --------------------------------------------------------------------------------------------------
# Rewards


@register_reward("acegrpo_step")
def acegrpo_step(*, action: Any, result: Optional[ExecutionResult], current_score: Optional[float],
                 targets: Any, cfg: ml_collections.ConfigDict) -> float:
    """AceGRPO step reward (see the module docstring); returns a float in
    {r_format, r_fail} or [r_valid - improve_coef * improve_clip, r_valid + improve_coef * improve_clip]."""
    if not _is_action(action):
        return float(cfg.r_format)
    new = valid_score(result)
    if new is None:
        syntax = result is not None and result.status is Status.SYNTAX_ERROR
        shaped = cfg.get("r_syntax_error", None)
        return float(shaped if syntax and shaped is not None else cfg.r_fail)
    return float(cfg.r_valid + cfg.improve_coef * improvement(new, current_score, targets, cfg.improve_clip))


@register_reward("ideator_ternary")
def ideator_ternary(*, action: Any, result: Optional[ExecutionResult], current_score: Optional[float],
                    targets: Any, cfg: ml_collections.ConfigDict) -> float:
    """MLE-Ideator: +1 strictly better than ``current_score`` (baseline if None), 0 not better or
    failed, -1 bad format (an ``InvalidAction``, or no idea when ``cfg.ideator_require_idea``)."""
    if not _is_action(action) or (cfg.ideator_require_idea and not getattr(action, "idea", None)):
        return float(cfg.ideator_format)
    new = valid_score(result)
    if new is None:
        return float(cfg.ideator_no_improve)
    cur = targets.baseline if current_score is None else float(current_score)
    better = improves(new, cur, targets.lower_is_better)
    return float(cfg.ideator_improve if better else cfg.ideator_no_improve)


def compute_rewards(name: str, actions: Sequence[Any], results: Sequence[Optional[ExecutionResult]],
                    current_scores: Sequence[Optional[float]], targets: Sequence[Any],
                    cfg: Optional[ml_collections.ConfigDict] = None) -> list[float]:
    """Rewards of a batch (all sequences of the same length N): the registered reward ``name``
    of each (action, result, current score, task targets), as N floats (what the trainer's
    rollouts carry).

    Raises:
      UnknownNameError: ``name`` is not registered (the message lists the valid names).
      ValueError: the sequences differ in length.
    """
    fn = get_reward(name)
    cfg = cfg if cfg is not None else default_config()
    n = len(actions)
    lens = {"actions": n, "results": len(results), "current_scores": len(current_scores),
            "targets": len(targets)}
    if len(set(lens.values())) != 1:
        raise ValueError(f"compute_rewards: sequences differ in length: {lens}")
    out = [fn(action=a, result=r, current_score=s, targets=t, cfg=cfg)
           for a, r, s, t in zip(actions, results, current_scores, targets)]
    return [float(x) for x in out]
