"""Training runs (their command line is the package's entry point, ``python -m ace_jax``,
``ace_jax/__main__.py``): the run's config schema (`config`), building a run (`setup`:
tasks, tokenizer, model, warm start), the AceGRPO loop (`trainer`, one `Trainer.step()`), its
generator (`generation`), the code agent's environment (`environment`), a step's rollouts as
arrays (`rollouts`), dynamic sampling (`dynamic_sampling`), SFT (`sft`), metrics and logs
(`metrics`, `step_metrics`, `logs`, the run's closing `summary`) and the
TPU-compiled dry run of a config (`dry_run`; its analytic memory and time plan
`dry_run_analytic`, its lowered and compiled programs `dry_run_programs`, its text and one-line
summary `dry_run_report`).

Imports: `runtime`, `rl`, `curriculum`, `env`, `policy` (and `ace_jax.config_utils`,
`ace_jax.registry`, `models`, `sandbox`); checked by tests/test_layout.py."""
