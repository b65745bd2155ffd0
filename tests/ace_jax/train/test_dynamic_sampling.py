"""Reinforce-Ada's balanced group and global baseline (the refill rounds of a whole run are in
test_trainer.py's dynamic-sampling runs)."""
import numpy as np
import pytest

from ace_jax.runtime import generate
from ace_jax.train import dynamic_sampling
from ace_jax.train.rollouts import Rollout, StepRollouts


def test_balanced_group_takes_the_best_and_the_worst():
    rewards = np.array([0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, -1.0])
    # the first 4 agree: their resampled rows 4-7 bring the spread
    assert dynamic_sampling.balanced_group(range(8), rewards, 4, 1e-6) == [4, 5, 6, 7]
    assert dynamic_sampling.balanced_group(range(8), rewards, 3, 1e-6) == [4, 5, 7]
    assert dynamic_sampling.balanced_group([0, 1, 2, 3], rewards, 4, 1e-6) == [0, 1, 2, 3]
    assert dynamic_sampling.balanced_group([1, 4], rewards, 2, 1e-6) == [1, 4]


def _step(rewards, state="s0", step=0):
    n = len(rewards)
    gen = generate.GenerationResult(
        np.ones((n, 3), np.int32), np.zeros((n, 3), np.float32), np.full(n, 3, np.int32),
        np.zeros(n, np.int32), np.zeros(n, np.int32))
    rollouts = [Rollout(state_id=state, task_id="t", state=state, policy_version=0, text="",
                        reward=float(r)) for r in rewards]
    return StepRollouts(step, [[5, 6]], gen, rollouts)


@pytest.mark.parametrize("normalise", [True, False])
def test_reinforce_ada_advantages_use_every_sample_of_the_state(normalise):
    """A state with no spread in its first G = 2 samples gets 2 more (rewards 1, 0): the kept
    group is the best and the worst ([1, 0]); its advantages use the mean (0.25) and std
    (ddof 1: 0.5) of all four samples, not of the two kept (which would give +-0.707)."""
    s = _step([0.0, 0.0])
    out = dynamic_sampling.refill(
        s, kind="reinforce_ada", rounds=2, batch_states=1, group_size=2, atol=1e-6,
        draw=None, roll_out=lambda states: _step([1.0, 0.0], state=states[0]),
        eps=0.0, std_ddof=1, normalise=normalise)
    assert s.refill_rounds == 1     # the spread was found in the first extra round
    assert out.rewards().tolist() == [1.0, 0.0]
    want = [1.5, -0.5] if normalise else [0.75, -0.25]
    np.testing.assert_allclose(out.advantages, want, rtol=1e-6)


def test_global_advantages_are_zero_without_spread():
    r = np.array([1.0, 1.0, 1.0, 1.0])
    assert dynamic_sampling.global_advantages(r, range(4), [0, 1], atol=1e-6, eps=1e-6,
                                              std_ddof=1).tolist() == [0.0, 0.0]
