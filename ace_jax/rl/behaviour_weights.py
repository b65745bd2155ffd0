"""Behaviour weights: the detached weight W_t = weight(pi_prox / mu) of decoupled PPO, by name.

Two registries (the config's `grpo.behaviour_weight` and `grpo.behaviour_weight_level`, used
with `grpo.proximal = "learner"`):

- behaviour weight levels `BEHAVIOUR_WEIGHT_LEVELS`, log w per token [N, T] and completion mask
  [N, T] -> log w [N, T]: `token` each token's own; `sequence` the sum over the sequence's
  completion tokens (w = the product), applied to each; `geometric` the mean over them (w = the
  geometric mean of the token weights, exp(mean log w)), applied to each.
- behaviour weights `BEHAVIOUR_WEIGHTS`, log w [N, T] (log pi_prox - log mu, nats, already at its
  level and clamped to [-LOG_W_CLAMP, LOG_W_CLAMP] = [-20, 20], as verl) and the bounds ->
  `BoundedWeight` (weight, high, low, masked) [N, T]:
  `truncate` min(w, cap) (verl's / slime's TIS, TRL's `token_truncate`; no lower bound);
  `mask` w where lower <= w <= cap, else 0 and the token counted as masked (MIS: AReaL's
  `behav_imp_weight_cap` above, verl's rejection sampling on both sides, TRL's `*_mask`);
  `none` w itself (plain importance sampling).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections

from ace_jax.registry import Registry

__all__ = [
    "BEHAVIOUR_WEIGHTS",
    "BEHAVIOUR_WEIGHT_LEVELS",
    "LOG_W_CLAMP",
    "BoundedWeight",
    "bounded_weight",
    "level_log_weight",
    "register_behaviour_weight",
    "register_behaviour_weight_level",
    "tis_lower",
]


BEHAVIOUR_WEIGHTS: Registry = Registry("behaviour weight")
BEHAVIOUR_WEIGHT_LEVELS: Registry = Registry("behaviour weight level")

register_behaviour_weight = BEHAVIOUR_WEIGHTS.register
register_behaviour_weight_level = BEHAVIOUR_WEIGHT_LEVELS.register

LOG_W_CLAMP = 20.0   # |log w| bound (nats) before any exp: e^20 ~ 4.9e8, as verl's clamp


class BoundedWeight(NamedTuple):
    """What a behaviour-weight mode makes of log w [N, T].

    Attributes:
      weight: float32 [N, T] the weight W_t that multiplies the token's loss.
      high: bool [N, T] tokens whose w the upper bound changed (truncated or masked).
      low: bool [N, T] tokens whose w the lower bound changed (masked).
      masked: bool [N, T] tokens whose weight is 0 (they stay in the loss denominator).
    """

    weight: jax.Array
    high: jax.Array
    low: jax.Array
    masked: jax.Array


def tis_lower(cfg: ml_collections.ConfigDict) -> float:
    """The lower bound of ``behaviour_weight="mask"``: ``cfg.tis_lower``, or 1 / ``cfg.tis_cap``
    when it is None (0: no lower bound)."""
    lower = cfg.get("tis_lower")
    return 1.0 / cfg.tis_cap if lower is None else float(lower)


def _no_flags(log_w: jax.Array) -> jax.Array:
    return jnp.zeros(log_w.shape, bool)


@register_behaviour_weight("truncate")
def truncated_weight(log_w: jax.Array, *, cap: float, lower: float) -> BoundedWeight:
    """min(w, cap): truncated importance sampling (nothing is masked; ``lower`` is unused)."""
    del lower
    high = log_w > jnp.log(cap)
    return BoundedWeight(jnp.exp(jnp.minimum(log_w, jnp.log(cap))), high, _no_flags(log_w),
                         _no_flags(log_w))


@register_behaviour_weight("mask")
def masked_weight(log_w: jax.Array, *, cap: float, lower: float) -> BoundedWeight:
    """w where lower <= w <= cap, else 0 (masked importance sampling, MIS); masked tokens stay in
    the loss denominator. ``lower`` = 0: no lower bound."""
    high = log_w > jnp.log(cap)
    low = (log_w < jnp.log(lower)) if lower > 0 else _no_flags(log_w)
    masked = high | low
    return BoundedWeight(jnp.where(masked, 0.0, jnp.exp(log_w)), high, low, masked)


@register_behaviour_weight("none")
def plain_weight(log_w: jax.Array, *, cap: float, lower: float) -> BoundedWeight:
    """w: untruncated importance sampling (the bounds are unused)."""
    del cap, lower
    return BoundedWeight(jnp.exp(log_w), _no_flags(log_w), _no_flags(log_w), _no_flags(log_w))


@register_behaviour_weight_level("token")
def token_level(log_w: jax.Array, completion: jax.Array) -> jax.Array:
    """Each completion token's own log w [N, T] (0 elsewhere)."""
    return jnp.where(completion, log_w, 0.0)


@register_behaviour_weight_level("sequence")
def sequence_level(log_w: jax.Array, completion: jax.Array) -> jax.Array:
    """The sum of log w over the row's completion tokens (w = the product), on each of them."""
    total = jnp.where(completion, log_w, 0.0).sum(axis=-1, keepdims=True)
    return jnp.where(completion, total, 0.0)


@register_behaviour_weight_level("geometric")
def geometric_level(log_w: jax.Array, completion: jax.Array) -> jax.Array:
    """The mean of log w over the row's completion tokens (w = the geometric mean of the token
    weights), on each of them; length-normalised, so a long sequence's weight does not explode."""
    total = jnp.where(completion, log_w, 0.0).sum(axis=-1, keepdims=True)
    count = completion.sum(axis=-1, keepdims=True).astype(log_w.dtype)
    return jnp.where(completion, total / jnp.maximum(count, 1.0), 0.0)


def level_log_weight(cfg: ml_collections.ConfigDict, log_w: jax.Array,
                     completion: jax.Array) -> jax.Array:
    """Token log w [N, T] (nats) at ``cfg.behaviour_weight_level`` (0 off the completion tokens,
    not yet clamped)."""
    return BEHAVIOUR_WEIGHT_LEVELS.get(cfg.behaviour_weight_level)(log_w, completion)


def bounded_weight(cfg: ml_collections.ConfigDict, level: jax.Array,
                   completion: jax.Array) -> BoundedWeight:
    """The weight ``cfg.behaviour_weight`` makes of log w [N, T] at its level
    (`level_log_weight`): clamped to [-LOG_W_CLAMP, LOG_W_CLAMP], then bounded. A token the
    clamp changed counts as changed high / low too; flags are False off ``completion``."""
    clamped = jnp.clip(level, -LOG_W_CLAMP, LOG_W_CLAMP)
    b = BEHAVIOUR_WEIGHTS.get(cfg.behaviour_weight)(clamped, cap=cfg.tis_cap,
                                                    lower=tis_lower(cfg))
    return BoundedWeight(b.weight, (b.high | (level > LOG_W_CLAMP)) & completion,
                         (b.low | (level < -LOG_W_CLAMP)) & completion, b.masked & completion)
