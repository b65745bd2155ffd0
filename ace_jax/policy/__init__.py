"""Chat policies over a trained run or an OpenAI-compatible server (`policy`), the
OpenAI-compatible server itself (`serving`) and Hugging Face export (`export`).

Imports: `runtime` (and `ace_jax.config_utils`, `models`, `sandbox`);
checked by tests/test_layout.py."""
