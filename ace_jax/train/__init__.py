"""Training runs: the AceGRPO loop (`trainer`), SFT warm start (`sft`), metrics and logs
(`metrics`, `logs`) and the TPU-compiled dry run of a config (`dry_run`).

Imports: `runtime`, `rl`, `curriculum`, `env`, `policy` (and `ace_jax.config_utils`, `models`, `sandbox`);
checked by tests/test_layout.py."""
