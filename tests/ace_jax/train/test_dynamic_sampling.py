"""Reinforce-Ada's balanced group (the refill rounds themselves run in test_trainer.py's
dynamic-sampling runs)."""
import numpy as np

from ace_jax.train import dynamic_sampling


def test_balanced_group_takes_the_best_and_the_worst():
    rewards = np.array([0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.0, -1.0])
    # the first 4 agree: their resampled rows 4-7 bring the spread
    assert dynamic_sampling.balanced_group(range(8), rewards, 4, 1e-6) == [4, 5, 6, 7]
    assert dynamic_sampling.balanced_group(range(8), rewards, 3, 1e-6) == [4, 5, 7]
    assert dynamic_sampling.balanced_group([0, 1, 2, 3], rewards, 4, 1e-6) == [0, 1, 2, 3]
    assert dynamic_sampling.balanced_group([1, 4], rewards, 2, 1e-6) == [1, 4]
