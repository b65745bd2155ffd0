"""KL estimators: per-token KL(pi || pi_ref) from log-probs of the sampled tokens, picked by name.

Registry `KL_ESTIMATORS` (the config's `grpo.kl_estimator`, used when `grpo.beta > 0`):
`k1` logp - ref, `k2` (logp - ref)^2 / 2, `k3` exp(ref - logp) - (ref - logp) - 1,
`low_var_kl` k3 with verl's clamps (log-ratio to [-20, 20], result to [-10, 10]).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from ace_jax.registry import Registry

__all__ = [
    "KL_ESTIMATORS",
    "kl_divergence",
    "register_kl_estimator",
]


KL_ESTIMATORS: Registry = Registry("KL estimator")

register_kl_estimator = KL_ESTIMATORS.register


@register_kl_estimator("k1")
def kl_k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """logp - ref (unbiased, high variance, can be negative)."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2")
def kl_k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """(logp - ref)^2 / 2 (biased, low variance, >= 0)."""
    return 0.5 * jnp.square(logprobs - ref_logprobs)


@register_kl_estimator("k3")
def kl_k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """exp(ref - logp) - (ref - logp) - 1 (unbiased, low variance, >= 0; Schulman's k3)."""
    d = ref_logprobs - logprobs
    return jnp.exp(d) - d - 1.0


@register_kl_estimator("low_var_kl")
def kl_low_var(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k3 with verl's clamps: log-ratio clipped to [-20, 20], the estimate to [-10, 10]."""
    d = jnp.clip(ref_logprobs - logprobs, -20.0, 20.0)
    return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


def kl_divergence(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str) -> jax.Array:
    """Per-token KL estimate, same shape as the inputs, by registered `estimator` name."""
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)
