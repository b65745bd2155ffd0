"""The agent's environment: prompts and action parsing (`agent`), advice from an ideator or
another model (`advice`), rewards from graded executions (`rewards`) and the tasks themselves,
loaded for training and evaluation (`tasks`).

Imports: `curriculum`, `runtime` (and `ace_jax.config_utils`, `ace_jax.registry`, `models`,
`sandbox`); checked by tests/test_layout.py."""
