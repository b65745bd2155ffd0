"""Tests for ace_jax.rl.advantage_estimators: hand-computed estimators, flat vs grouped rewards,
the zero-variance guard and input errors."""
import math

import numpy as np
import pytest

from ace_jax.registry import UnknownNameError
from ace_jax.rl import grpo
from ace_jax.rl.advantage_estimators import compute_advantages


def cfg_with(**overrides):
    cfg = grpo.default_config()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


REWARDS = np.array([[1.0, 0.0, 0.0, 1.0], [2.0, 4.0, 6.0, 8.0]], np.float32)


def test_grpo_advantages_unbiased_std_by_hand():
    adv = compute_advantages(REWARDS, cfg_with(advantage_eps=0.0, advantage_std_ddof=1))
    s0 = math.sqrt(1.0 / 3.0)          # sqrt(4 * 0.25 / 3)
    s1 = math.sqrt(20.0 / 3.0)         # sqrt((9 + 1 + 1 + 9) / 3)
    want = [[0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0], [-3 / s1, -1 / s1, 1 / s1, 3 / s1]]
    np.testing.assert_allclose(adv, want, rtol=1e-6)


def test_grpo_advantages_biased_std_and_eps_by_hand():
    adv = compute_advantages(REWARDS, cfg_with(advantage_eps=0.1, advantage_std_ddof=0))
    s1 = math.sqrt(5.0)
    want = [[0.5 / 0.6, -0.5 / 0.6, -0.5 / 0.6, 0.5 / 0.6],
            [-3 / (s1 + 0.1), -1 / (s1 + 0.1), 1 / (s1 + 0.1), 3 / (s1 + 0.1)]]
    np.testing.assert_allclose(adv, want, rtol=1e-6)


def test_drgrpo_advantages_by_hand():
    adv = compute_advantages(REWARDS, cfg_with(advantage_estimator="drgrpo"))
    np.testing.assert_allclose(adv, [[0.5, -0.5, -0.5, 0.5], [-3, -1, 1, 3]], rtol=1e-6)


def test_rloo_advantages_by_hand():
    adv = compute_advantages(REWARDS, cfg_with(advantage_estimator="rloo"))
    # r_i - mean of the other three
    want = [[1 - 1 / 3, 0 - 2 / 3, 0 - 2 / 3, 1 - 1 / 3], [2 - 6, 4 - 16 / 3, 6 - 14 / 3, 8 - 4]]
    np.testing.assert_allclose(adv, want, rtol=1e-6)


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_flat_rewards_with_group_size_match_grouped(name):
    cfg = cfg_with(advantage_estimator=name)
    flat = compute_advantages(REWARDS.reshape(-1), cfg, group_size=4)
    assert flat.shape == (8,)
    np.testing.assert_array_equal(flat, np.asarray(compute_advantages(REWARDS, cfg)).reshape(-1))


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo"])
def test_zero_variance_group_gets_exactly_zero_advantage(name):
    # mean([0.1] * 3) != 0.1 in float32: without the guard, grpo would turn that rounding noise
    # into advantages of size noise / eps
    rewards = np.array([[3.0, 3.0, 3.0], [0.1, 0.1, 0.1], [0.1, 0.1, 0.1 + 1e-7], [0.0, 1.0, 0.0]],
                       np.float32)
    adv = np.asarray(compute_advantages(rewards, cfg_with(advantage_estimator=name)))
    np.testing.assert_array_equal(adv[:3], 0.0)
    assert np.abs(adv[3]).min() > 0.1


def test_advantage_input_errors():
    cfg = cfg_with()
    with pytest.raises(ValueError, match="at least 2 completions"):
        compute_advantages(np.ones((3, 1)), cfg)
    with pytest.raises(ValueError, match="groups of 4"):
        compute_advantages(np.ones(6), cfg, group_size=4)
    with pytest.raises(ValueError, match="need group_size"):
        compute_advantages(np.ones(6), cfg)
    with pytest.raises(UnknownNameError, match="drgrpo, grpo, rloo"):
        compute_advantages(REWARDS, cfg_with(advantage_estimator="ppo"))
