"""AceGRPO's curriculum: the Evolving Data Buffer (`buffer`; its per-state statistics and
pruning order `state_stats`), its local / gs:// store (`buffer_store`), seed solutions (`seeds`)
and the Learnability Potential with its samplers (`learnability`).

Imports: no other room (and `ace_jax.config_utils`, `ace_jax.registry`, `sandbox`); checked by
tests/test_layout.py."""
