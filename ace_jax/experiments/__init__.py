"""Multi-run experiments over the trainer: the sampler ablation (`ablation`).

Imports: `runtime`, `rl`, `curriculum`, `env`, `policy`, `train`, `ideator`, `eval` (and `ace_jax.config_utils`, `ace_jax.registry`, `models`,
`sandbox`); checked by tests/test_layout.py."""
