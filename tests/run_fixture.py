"""A tiny, real training-run directory for the tests of everything that reads one.

``make_tiny_run(workdir)`` writes what ``launch/tpu_train.py`` leaves behind, at toy size:
``config.json`` (configs/local.py with a tiny MoE), ``tokenizer/`` (a byte-level BPE trained on a
few lines of code) and ``checkpoints/<step>/`` (an Orbax TrainState of randomly initialised
parameters and their AdamW state). No training happens; the weights are the seeded init.
"""
from __future__ import annotations

import json
import os

import jax
import optax
from flax import nnx

from ace_jax import config_utils
from ace_jax.runtime import checkpoint as ckpt_lib
from models import configs as model_configs, qwen3, tokenizer as tok_lib

CORPUS = [
    "import numpy as np\nimport pandas as pd\ntrain = pd.read_csv('./input/train.csv')\n" * 20,
    "print('VALIDATION_METRIC: 0.5')\nsub.to_csv('./submission/submission.csv', index=False)\n" * 20,
    "```python\nfrom sklearn.linear_model import LogisticRegression\n```\n" * 20,
]
MODEL_OVERRIDES = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                       num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                       head_dim=16, num_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=2048)


def write_run_files(workdir: str, overrides: dict, *, vocab_size: int = 300,
                    mesh: dict | None = None):
    """A run directory's ``tokenizer/`` (a BPE trained on ``CORPUS``) and ``config.json``
    (configs/local.py with the tiny_moe preset, ``overrides`` and ``mesh``); returns the
    tokenizer."""
    os.makedirs(workdir, exist_ok=True)
    tok_dir = os.path.join(workdir, "tokenizer")
    tok_lib.train_bpe_tokenizer(CORPUS, vocab_size, tok_dir)
    cfg = config_utils.load_config_file("configs/local.py")
    cfg.workdir = workdir
    cfg.model.preset = "tiny_moe"
    cfg.model.overrides = dict(overrides)
    for k, v in (mesh or {}).items():
        cfg.mesh[k] = v
    with open(os.path.join(workdir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=2, default=repr)
    return tok_lib.load_tokenizer(tok_dir)


def make_tiny_run(workdir: str, *, step: int = 1, seed: int = 0, vocab_size: int = 300):
    """Writes a tiny run directory; returns (model, tokenizer) as saved."""
    tokenizer = write_run_files(workdir, MODEL_OVERRIDES, vocab_size=vocab_size)
    model_cfg = model_configs.get_model_config(
        "tiny_moe", **dict(MODEL_OVERRIDES, vocab_size=len(tokenizer)))
    model = qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(seed))
    params = nnx.state(model, nnx.Param)
    state = ckpt_lib.TrainState(step=step, params=params,
                                opt_state=optax.adamw(1e-3).init(params),
                                rng=jax.random.key(seed), sampler_state={})
    with ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False) as c:
        c.save(state, force=True)
    return model, tokenizer
