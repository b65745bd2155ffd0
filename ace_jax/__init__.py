"""ace-jax: AceGRPO and MLE-Ideator in JAX/Flax (the RL system)."""
