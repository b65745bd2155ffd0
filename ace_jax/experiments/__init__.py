"""Multi-run experiments over the trainer: the sampler ablation (`ablation`) and the multi-seed
learning runs of the default config (`learning`).

Imports: `runtime`, `rl`, `curriculum`, `env`, `policy`, `train`, `ideator`, `eval` (and `ace_jax.config_utils`, `ace_jax.registry`, `models`,
`sandbox`); checked by tests/test_layout.py."""
