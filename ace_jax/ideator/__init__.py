"""MLE-Ideator: ideas, their parsing and prompts (`ideator`) and the ideator's GRPO run
(`ideator_trainer`).

Imports: `runtime`, `rl`, `curriculum`, `env`, `policy`, `train` (and `ace_jax.config_utils`, `models`, `sandbox`);
checked by tests/test_layout.py."""
