"""The agent's environment: what the training loop asks of an environment and what it may
read of its run (`environment`: `Environment`, `EnvContext`), prompts and action parsing
(`agent`), advice from an ideator or another model (`advice`), rewards from graded executions
(`rewards`) and the tasks themselves, loaded for training and evaluation (`tasks`).

Imports: `curriculum`, `runtime` (and `ace_jax.registry`, `models`, `sandbox`); checked by
tests/test_layout.py."""
