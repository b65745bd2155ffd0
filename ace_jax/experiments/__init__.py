"""Multi-run experiments over the trainer: the sampler ablation (`ablation`), the multi-seed
learning runs of the default config (`learning`), comparisons of settings over whole-run seeds
with their raw data kept under results/ (`compare`) and the docs' tables made from it
(`tables`).

Imports: `policy`, `train`, `eval` (and `ace_jax.registry`, `sandbox`); checked by
tests/test_layout.py."""
