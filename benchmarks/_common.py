"""Shared helpers of the benchmarks: the peer baseline, a matmul peak, and model FLOP counts.

Every benchmark measures ace-jax and its peer (``../shared/bench/hf_baseline.py``, transformers on
CPU) in the same run, on the same shapes, and prints one JSON object as its last line.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
PEER = REPO.parent / "shared" / "bench" / "hf_baseline.py"

# The shared "bench-tiny" shapes (the defaults of hf_baseline.py).
BENCH_TINY = dict(vocab=4096, hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, experts=8,
                  topk=2, moe_inter=128, batch=16, prompt=128, new=128, threads=2)


def bench_tiny_model_config(shape: dict):
    """The ace-jax ModelConfig equal to hf_baseline.py's Qwen3MoeConfig for these shapes."""
    from models.configs import ModelConfig

    return ModelConfig(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=4 * shape["hidden"],
        moe_intermediate_size=shape["moe_inter"], num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], num_experts=shape["experts"],
        num_experts_per_tok=shape["topk"], norm_topk_prob=True,
        max_position_embeddings=4 * (shape["prompt"] + shape["new"]), tie_word_embeddings=False)


def run_peer(mode: str, shape: dict, repeats: int = 2) -> dict:
    """Runs hf_baseline.py in a subprocess (its own torch threads) and returns its JSON line."""
    if not PEER.exists():
        raise FileNotFoundError(f"peer baseline not found at {PEER}")
    args = [sys.executable, str(PEER), mode, "--repeats", str(repeats)]
    for k, v in shape.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def matmul_peak_flops(n: int = 1024, dtype: str = "float32", repeats: int = 5) -> float:
    """Measured FLOP/s of one large jitted matmul on the default JAX device (the 'peak')."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def active_matmul_params(cfg) -> int:
    """Parameters touched by one token's matmuls (attention, k routed experts, router, lm_head)."""
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * d * (2 * cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
    total = 0
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            mlp = 3 * h * cfg.moe_intermediate_size * cfg.num_experts_per_tok + h * cfg.num_experts
        else:
            mlp = 3 * h * cfg.intermediate_size
        total += attn + mlp
    return total + h * cfg.vocab_size


def attention_flops_per_token(cfg, context: float) -> float:
    """Forward FLOPs of QK^T and AV for one token attending to ``context`` positions."""
    return 4.0 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * context


def dropless_capacity_factor(cfg) -> float:
    """The smallest ``moe_capacity_factor`` for which the "capacity" dispatch can never drop an
    assignment: E / k gives ceil(factor * N * k / E) = N slots per expert (so it is exact)."""
    return float(cfg.num_experts) / float(cfg.num_experts_per_tok)


def add_round_args(ap, default_dispatch: str = "ragged") -> None:
    """The flags every peer benchmark shares (repeats, alternating rounds, dispatch, --no-peer)."""
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--peer-repeats", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="alternating peer / ours rounds")
    ap.add_argument("--dispatch", default=default_dispatch, choices=["dense", "ragged", "capacity"],
                    help="MoE dispatch; 'ragged' (default, the production one) is dropless: on CPU "
                         "blocked grouped matmuls, all experts for a decode step's few tokens; "
                         "'capacity' uses a capacity factor of E/k (dropless, exact, E x the FLOPs)")
    ap.add_argument("--no-peer", action="store_true", help="skip the transformers peer (no ratio)")


def best_of_rounds(rounds: int, measure_peer, measure_ours) -> tuple:
    """Peer and ours alternate for ``rounds`` rounds (the machine's load drifts; a peer measured
    only at one moment can be lucky or unlucky); each side keeps its fastest round (by
    ``"seconds"``). ``measure_peer`` may be None (no peer). Returns (peer, ours, loadavg before /
    after); ours keeps the first round's ``compile_s``."""
    import os

    load_before = os.getloadavg()[0]
    peer, ours = None, None
    for _ in range(rounds):
        if measure_peer is not None:
            p = measure_peer()
            peer = p if peer is None or p["seconds"] < peer["seconds"] else peer
        o = measure_ours()
        if ours is not None:
            o["compile_s"] = ours["compile_s"]
        ours = o if ours is None or o["seconds"] < ours["seconds"] else ours
    return peer, ours, (load_before, os.getloadavg()[0])
