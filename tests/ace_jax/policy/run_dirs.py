"""Run directories for the tests of serving, evaluating and exporting a sharded run.

``make_run(workdir, overrides, mesh)`` writes what a training run leaves behind (``config.json``,
``tokenizer/``, ``checkpoints/<step>/``) for a tiny Qwen3-MoE of any size, its parameters saved
from the run's own mesh as the trainer saves them: each array is stored in chunks of its device
shards (``mesh``: e.g. ``dict(fsdp=4, expert=2)`` on 8 devices, a 2-host pod's layout; None:
saved from one device, one chunk per array). Also a script: ``python -m
tests.ace_jax.policy.run_dirs <workdir> <json overrides> <json mesh>`` (in a process of its own,
so that the test process's memory is not the writer's).
"""
from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np
import optax
from flax import nnx

from ace_jax.runtime import checkpoint as ckpt_lib
from models import configs as model_configs, qwen3
from tests.run_fixture import MODEL_OVERRIDES, write_run_files

# 8.4M parameters (33.8 MB in fp32) in 6 layers of 16 experts: the largest array (one expert
# projection of every layer) is 9.4 MB, 28% of the model; saved from fsdp 4 x expert 2 it is
# stored in chunks of 8 experts x a quarter of the hidden axis, so a streaming export reads it in
# blocks of 4.7 MB (14%). An export that held the model, or half of it, could not pass the
# memory bound of test_export_memory.py.
MEDIUM = dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=96,
              num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
              num_experts=16, num_experts_per_tok=2, max_position_embeddings=2048,
              tie_word_embeddings=False)


def make_run(workdir: str, overrides: dict | None = None, mesh: dict | None = None, *,
             vocab_size: int = 300, seed: int = 0, step: int = 1):
    """Writes a run directory; returns the flat parameters saved (numpy) and the model config."""
    from ace_jax.policy import runs

    overrides = dict(MODEL_OVERRIDES if overrides is None else overrides)
    tokenizer = write_run_files(workdir, overrides, vocab_size=vocab_size, mesh=mesh)
    model_cfg = model_configs.get_model_config("tiny_moe", **dict(overrides, vocab_size=len(tokenizer)))
    build = lambda: qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(seed))  # noqa: E731
    if mesh:
        model = runs.run_placement(workdir).init_model(build)
    else:
        model = build()
    params = nnx.state(model, nnx.Param)
    state = ckpt_lib.TrainState(step=step, params=params, opt_state=optax.sgd(1e-3).init(params),
                                rng=jax.random.key(seed), sampler_state={})
    with ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False) as c:
        c.save(state, force=True)
    return {k: np.asarray(v) for k, v in qwen3.flat_params(model).items()}, model_cfg


if __name__ == "__main__":
    make_run(sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]) or None)
