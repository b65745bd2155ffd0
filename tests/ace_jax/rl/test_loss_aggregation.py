"""Tests for ace_jax.rl.loss_aggregation: hand-computed modes, exact micro-batch accumulation,
the all-masked case and errors."""
import jax.numpy as jnp
import numpy as np
import pytest

from ace_jax.registry import UnknownNameError
from ace_jax.rl.loss_aggregation import LOSS_AGGREGATIONS, aggregate_loss

LOSS = np.array([[1.0, 2.0, 3.0, np.inf], [10.0, np.nan, 0.0, 0.0], [5.0, 5.0, 0.0, 0.0]],
                np.float32)
MASK = np.array([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], np.float32)


@pytest.mark.parametrize("mode,want", [
    ("token_mean", (1 + 2 + 3 + 10) / 4),
    ("seq_mean_token_mean", (2 + 10) / 2),              # row 3 has no tokens and does not count
    ("seq_mean_token_sum_norm", (6 / 5 + 10 / 5) / 2),  # max_completion_length = 5
])
def test_aggregation_by_hand(mode, want):
    got = aggregate_loss(jnp.asarray(LOSS), jnp.asarray(MASK), mode, max_completion_length=5)
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_aggregation_micro_batches_accumulate_exactly(mode):
    rng = np.random.default_rng(0)
    loss = rng.normal(size=(6, 5)).astype(np.float32)
    mask = (rng.random((6, 5)) < 0.6).astype(np.float32)
    fn = LOSS_AGGREGATIONS.get(mode)
    num, den = fn(jnp.asarray(loss), jnp.asarray(mask), max_completion_length=7)
    parts = [fn(jnp.asarray(loss[s]), jnp.asarray(mask[s]), max_completion_length=7)
             for s in (slice(0, 2), slice(2, 6))]
    np.testing.assert_allclose(sum(p[0] for p in parts) / sum(p[1] for p in parts), num / den,
                               rtol=1e-6)


def test_aggregation_all_masked_is_zero_and_errors():
    z = aggregate_loss(jnp.ones((2, 3)), jnp.zeros((2, 3)), "token_mean")
    assert float(z) == 0.0
    with pytest.raises(ValueError, match="max_completion_length > 0"):
        aggregate_loss(jnp.ones((2, 3)), jnp.ones((2, 3)), "seq_mean_token_sum_norm")
    with pytest.raises(UnknownNameError, match="seq_mean_token_mean, seq_mean_token_sum_norm"):
        aggregate_loss(jnp.ones((2, 3)), jnp.ones((2, 3)), "seq_sum")
    with pytest.raises(ValueError, match=r"\[N, T\]"):
        aggregate_loss(jnp.ones((2, 3)), jnp.ones((2, 4)), "token_mean")
