"""Evaluation of a policy on MLE tasks: episode records and their logs (`episodes`), running one
episode (`runner`), metrics and their aggregation (`scoring`), the harness over tasks and seeds
(`harness.evaluate`), reports and plots (`reports`), and what an evaluation takes from a
training run (`run_config`).

Imports: `curriculum`, `env`, `policy`, `ideator` (and `ace_jax.config_utils`, `sandbox`);
checked by tests/test_layout.py."""
