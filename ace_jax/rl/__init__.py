"""GRPO itself: the registries of advantage estimators (`advantage_estimators`), loss
aggregations (`loss_aggregation`), KL estimators (`kl_estimators`) and behaviour weights
(`behaviour_weights`), the config section and clipped policy loss built from them (`grpo`), the
rollout's training arrays (`rollout_batch`) and the jitted learner step (`learner`).

Imports: `runtime` (and `ace_jax.registry`, `models`); checked by tests/test_layout.py."""
