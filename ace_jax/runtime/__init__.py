"""Where arrays live and how programs run: generation (`generate`; the paged, continuously
batched rollout engine `engine`, its config and device state `engine_config`, its device
programs `engine_programs`, what it hands back `completions`; the trainer's choice of the two,
`sampler`), the mesh and its shardings (`sharding`, `placement`), multi-host helpers
(`multihost`), Orbax checkpoints (`checkpoint`) and XLA's TPU compiler without a TPU
(`tpu_compile`).

Imports: no other room (and `models`); checked by tests/test_layout.py."""
