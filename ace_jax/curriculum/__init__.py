"""AceGRPO's curriculum: the Evolving Data Buffer (`buffer`), its local / gs:// store
(`buffer_store`) and the Learnability Potential with its samplers (`learnability`).

Imports: no other room (and `ace_jax.config_utils`, `models`, `sandbox`);
checked by tests/test_layout.py."""
