"""Flax NNX Qwen3 / Qwen3-MoE, the HF <-> Flax parameter table and tokenizer helpers.

Knows nothing of RL: imports nothing from ``ace_jax`` or ``sandbox``.
"""
