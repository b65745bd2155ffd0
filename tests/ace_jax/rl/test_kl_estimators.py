"""Tests for ace_jax.rl.kl_estimators: hand-computed estimates, the clamps, unbiasedness."""
import math

import jax.numpy as jnp
import numpy as np
import pytest

from ace_jax.rl.kl_estimators import kl_divergence


def test_kl_estimators_by_hand():
    logp = jnp.log(jnp.array([0.5, 0.25]))
    ref = jnp.log(jnp.array([0.25, 0.5]))
    l2 = math.log(2.0)
    np.testing.assert_allclose(kl_divergence(logp, ref, "k1"), [l2, -l2], rtol=1e-6)
    np.testing.assert_allclose(kl_divergence(logp, ref, "k2"), [l2 ** 2 / 2] * 2, rtol=1e-6)
    want_k3 = [0.5 + l2 - 1.0, 2.0 - l2 - 1.0]   # exp(d) - d - 1, d = ref - logp = -ln2, +ln2
    np.testing.assert_allclose(kl_divergence(logp, ref, "k3"), want_k3, rtol=1e-6)
    np.testing.assert_allclose(kl_divergence(logp, ref, "low_var_kl"), want_k3, rtol=1e-6)
    # the clamps of low_var_kl
    big = kl_divergence(jnp.array([0.0]), jnp.array([30.0]), "low_var_kl")
    np.testing.assert_allclose(big, [10.0])


@pytest.mark.parametrize("name", ["k1", "k3"])
def test_k1_k3_are_unbiased_for_the_exact_kl(name):
    p = np.array([0.1, 0.2, 0.3, 0.4])
    q = np.array([0.4, 0.3, 0.2, 0.1])
    exact = float(np.sum(p * np.log(p / q)))
    per_x = np.asarray(kl_divergence(jnp.log(p), jnp.log(q), name))
    np.testing.assert_allclose(np.sum(p * per_x), exact, rtol=1e-5)
