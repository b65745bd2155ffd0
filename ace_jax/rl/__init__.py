"""GRPO itself: advantage estimators, loss aggregations and KL estimators (`grpo`), the
rollout's training arrays (`rollout_batch`) and the jitted learner step (`learner`).

Imports: `runtime` (and `ace_jax.registry`, `models`); checked by tests/test_layout.py."""
