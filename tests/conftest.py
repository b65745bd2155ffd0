"""Test-wide setup: 8 simulated CPU devices (for sharding tests) and fp32 matmul precision.

XLA reads XLA_FLAGS when the backend starts, so it is set here, before any test imports jax.
"""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# libtpu (the TPU compile tests) refuses a second process on the host unless told it may.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
