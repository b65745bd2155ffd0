"""MLE-Ideator: ideas, their parsing and categories (`ideator`), the ideator's prompt (`prompts`),
the advisor over a policy (`advisor`), warm-start examples (`sft_examples`) and the ideator's
environment for the one training loop (`ideator_trainer`: `IdeatorEnv`, `make_trainer`).

Imports: `runtime`, `curriculum`, `env`, `policy`, `train` (and `models`, `sandbox`); checked by
tests/test_layout.py."""
