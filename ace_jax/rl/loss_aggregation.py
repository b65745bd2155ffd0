"""Loss aggregation modes: per-token loss [N, T] and loss mask [N, T] -> (numerator, denominator).

Registry `LOSS_AGGREGATIONS` (the config's `grpo.loss_agg_mode`); loss = numerator / denominator.
The denominator depends on the mask only, so for gradient accumulation compute
`aggregation_denominator(loss_mask(...))` once on the full batch and pass it as
`loss_denominator` to every micro-batch: the micro-batch losses and gradients then sum to the
full-batch ones exactly (up to float summation order):

- `token_mean`               sum of all loss tokens / number of loss tokens (verl's default);
- `seq_mean_token_mean`      mean over sequences of (per-sequence token mean) (tunix's default);
- `seq_mean_token_sum_norm`  mean over sequences of (per-sequence token sum / max_completion_length)
                             (Dr.GRPO; the same normaliser as TRL's `dr_grpo`).

"Sequences" are the rows with at least one loss token: padding rows and filtered groups do not
count in any denominator.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections

from ace_jax.registry import Registry
from ace_jax.rl.advantage_estimators import group_rewards, zero_variance_groups

__all__ = [
    "LOSS_AGGREGATIONS",
    "aggregate_loss",
    "aggregation_denominator",
    "loss_mask",
    "register_loss_aggregation",
    "safe_divide",
]


LOSS_AGGREGATIONS: Registry = Registry("loss aggregation mode")

register_loss_aggregation = LOSS_AGGREGATIONS.register


def _masked(loss: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.where(mask > 0, loss * mask, 0.0)


@register_loss_aggregation("token_mean")
def token_mean(loss: jax.Array, mask: jax.Array, *, max_completion_length: int):
    """Sum over all loss tokens / number of loss tokens."""
    del max_completion_length
    return _masked(loss, mask).sum(), mask.sum()


@register_loss_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(loss: jax.Array, mask: jax.Array, *, max_completion_length: int):
    """Mean over sequences with >= 1 loss token of that sequence's token mean."""
    del max_completion_length
    tokens = mask.sum(axis=-1)
    has_tokens = tokens > 0
    per_seq = _masked(loss, mask).sum(axis=-1) / jnp.where(has_tokens, tokens, 1.0)
    return jnp.where(has_tokens, per_seq, 0.0).sum(), has_tokens.sum().astype(loss.dtype)


@register_loss_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(loss: jax.Array, mask: jax.Array, *, max_completion_length: int):
    """Dr.GRPO: mean over sequences with >= 1 loss token of (token sum / max_completion_length)."""
    if not max_completion_length > 0:
        raise ValueError("seq_mean_token_sum_norm needs max_completion_length > 0, "
                         f"got {max_completion_length}")
    has_tokens = mask.sum(axis=-1) > 0
    numerator = _masked(loss, mask).sum() / max_completion_length
    return numerator, has_tokens.sum().astype(loss.dtype)


def aggregate_loss(loss: jax.Array, mask: jax.Array, mode: str, *,
                   max_completion_length: int = 0) -> jax.Array:
    """Scalar loss from per-token loss [N, T] and loss mask [N, T] with aggregation `mode`.

    Returns 0 when the mask selects nothing."""
    if loss.shape != mask.shape or loss.ndim != 2:
        raise ValueError(f"loss {loss.shape} and mask {mask.shape} must both be [N, T]")
    num, den = LOSS_AGGREGATIONS.get(mode)(loss, mask.astype(loss.dtype),
                                          max_completion_length=max_completion_length)
    return safe_divide(num, den)


def aggregation_denominator(loss_mask: jax.Array, mode: str, *,
                            max_completion_length: int = 0) -> jax.Array:
    """The denominator `mode` uses for loss mask [N, T] (it depends on the mask only).

    For micro-batching, compute it once on the full batch's loss mask (completion mask times the
    zero-variance filter, see `loss_mask`) and pass it as `loss_denominator` to every micro-batch."""
    mask = jnp.asarray(loss_mask, jnp.float32)
    return LOSS_AGGREGATIONS.get(mode)(jnp.zeros_like(mask), mask,
                                       max_completion_length=max_completion_length)[1]


def loss_mask(completion_mask: jax.Array, rewards: jax.Array, group_size: int,
              cfg: ml_collections.ConfigDict) -> jax.Array:
    """float [N, T]: the tokens `grpo_loss` trains on (completion tokens of kept groups)."""
    keep = completion_mask > 0
    if cfg.filter_zero_variance_groups:
        grouped = group_rewards(jnp.asarray(rewards, jnp.float32), group_size)
        keep = keep & jnp.repeat(~zero_variance_groups(grouped, cfg.zero_variance_atol),
                                 group_size)[:, None]
    return keep.astype(jnp.float32)


def safe_divide(num: jax.Array, den: jax.Array) -> jax.Array:
    """num / den where den > 0, else 0 (no inf or nan, in the value or the gradient)."""
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)
