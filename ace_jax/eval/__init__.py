"""Evaluation: episodes of a policy on tasks, their statistics and reports (`evaluation`).

Imports: `runtime`, `curriculum`, `env`, `policy`, `train`, `ideator` (and `ace_jax.config_utils`, `models`, `sandbox`);
checked by tests/test_layout.py."""
