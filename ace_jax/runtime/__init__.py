"""Where arrays live and how programs run: generation (`generate`), the mesh and its
shardings (`sharding`, `placement`), multi-host helpers (`multihost`), Orbax checkpoints
(`checkpoint`) and XLA's TPU compiler without a TPU (`tpu_compile`).

Imports: no other room (and `ace_jax.config_utils`, `ace_jax.registry`, `models`,
`sandbox`); checked by tests/test_layout.py."""
