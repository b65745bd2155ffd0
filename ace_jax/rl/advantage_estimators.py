"""Advantage estimators: rewards [num_groups, G] -> advantages [num_groups, G], picked by name.

Registry `ADVANTAGE_ESTIMATORS` (`ace_jax.registry.Registry`, the config's
`grpo.advantage_estimator`); a new estimator is one small registered function:

    @register_advantage_estimator("my_estimator")
    def my_estimator(rewards, *, eps, std_ddof): ...   # [num_groups, G] -> [num_groups, G]

- `grpo`   (r - mean) / (std + eps), std with `std_ddof` (default 1 = unbiased, as TRL and verl's
           `torch.std`; 0 = biased, as `jnp.std`);
- `drgrpo` r - mean (Dr.GRPO: no std scaling);
- `rloo`   r - mean of the other G - 1 rewards (= G / (G - 1) * (r - mean)).

Whatever the estimator, a group whose rewards agree within `zero_variance_atol` gets advantage
exactly 0 (float rounding in the mean is never amplified by 1 / (std + eps)); with
`filter_zero_variance_groups` its tokens also leave every loss denominator (`grpo.grpo_loss`,
`loss_aggregation.loss_mask`). Flat rewards [N] are group-major: rows [g*G, (g+1)*G) are group g.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from ace_jax.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "compute_advantages",
    "group_rewards",
    "register_advantage_estimator",
    "zero_variance_groups",
]


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")

register_advantage_estimator = ADVANTAGE_ESTIMATORS.register


def group_rewards(rewards: jax.Array, group_size: int | None = None) -> jax.Array:
    """Rewards as [num_groups, G]: 2-D input is returned as is; flat [N] input needs `group_size`."""
    rewards = jnp.asarray(rewards)
    if rewards.ndim == 2:
        if group_size is not None and rewards.shape[1] != group_size:
            raise ValueError(f"rewards have group size {rewards.shape[1]}, group_size={group_size}")
        grouped = rewards
    elif rewards.ndim == 1:
        if group_size is None:
            raise ValueError("flat rewards [N] need group_size")
        if group_size < 1 or rewards.shape[0] % group_size:
            raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
        grouped = rewards.reshape(-1, group_size)
    else:
        raise ValueError(f"rewards must be [num_groups, G] or [N], got shape {rewards.shape}")
    if grouped.shape[1] < 2:
        raise ValueError(f"GRPO needs at least 2 completions per group, got G={grouped.shape[1]}")
    return grouped


@register_advantage_estimator("grpo")
def grpo_advantages(rewards: jax.Array, *, eps: float, std_ddof: int) -> jax.Array:
    """(r - mean) / (std + eps) per group; std with `std_ddof` (1 unbiased, 0 biased)."""
    mean = rewards.mean(axis=-1, keepdims=True)
    std = rewards.std(axis=-1, keepdims=True, ddof=std_ddof)
    return (rewards - mean) / (std + eps)


@register_advantage_estimator("drgrpo")
def drgrpo_advantages(rewards: jax.Array, *, eps: float, std_ddof: int) -> jax.Array:
    """r - mean per group (Dr.GRPO removes the std scaling); eps and std_ddof are unused."""
    del eps, std_ddof
    return rewards - rewards.mean(axis=-1, keepdims=True)


@register_advantage_estimator("rloo")
def rloo_advantages(rewards: jax.Array, *, eps: float, std_ddof: int) -> jax.Array:
    """r_i - mean_{j != i} r_j (leave-one-out baseline); eps and std_ddof are unused."""
    del eps, std_ddof
    g = rewards.shape[-1]
    others_mean = (rewards.sum(axis=-1, keepdims=True) - rewards) / (g - 1)
    return rewards - others_mean


def zero_variance_groups(rewards: jax.Array, atol: float) -> jax.Array:
    """bool [num_groups]: groups whose rewards all agree within `atol` (max - min <= atol).

    A range test, not `std != 0`: float noise in rewards would defeat an exact test."""
    return (rewards.max(axis=-1) - rewards.min(axis=-1)) <= atol


def compute_advantages(rewards: jax.Array, cfg: ml_collections.ConfigDict,
                       group_size: int | None = None) -> jax.Array:
    """Advantages for rewards [num_groups, G] (or flat [N] with `group_size`), same shape as input.

    The estimator is `cfg.advantage_estimator`. Groups whose rewards agree within
    `cfg.zero_variance_atol` get advantage exactly 0 (whatever the estimator, filtered or not)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    grouped = group_rewards(rewards, group_size)
    fn = ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)
    adv = fn(grouped, eps=cfg.advantage_eps, std_ddof=cfg.advantage_std_ddof)
    # Groups whose rewards agree within zero_variance_atol carry no signal: their advantage is
    # exactly 0, so float rounding in the mean is never amplified by 1 / (std + eps).
    flat = zero_variance_groups(grouped, cfg.zero_variance_atol)
    adv = jnp.where(flat[:, None], 0.0, adv)
    return adv.reshape(rewards.shape)
