"""The agent's environment: prompts and action parsing (`agent`), advice from an ideator or
another model (`advice`) and rewards from graded executions (`rewards`).

Imports: `curriculum` (and `ace_jax.config_utils`, `models`, `sandbox`);
checked by tests/test_layout.py."""
