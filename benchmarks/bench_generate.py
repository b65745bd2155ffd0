"""Benchmark: new tokens/s of grouped generation vs transformers ``model.generate`` (same run).

Our side: ``Generator.generate`` (one jitted prefill + ``while_loop`` decode with a KV cache) on the
"bench-tiny" Qwen3-MoE (fp32), 16 prompts of 128 random tokens, sampled at temperature 1 with
top-k / top-p off and no EOS, so every row gets exactly 128 new tokens (the peer forces the same
with ``min_new_tokens``). The peer (``../shared/bench/hf_baseline.py generate``) samples the same
shape with HF ``Qwen3MoeForCausalLM.generate`` on 2 torch threads. Both report
batch x new tokens / wall seconds of one whole generate call (prefill included); the best of
``--repeats`` runs. Our compile time (first call minus the best run) is reported separately.

``mfu`` = model FLOP/s of our generate call / ``matmul_peak_flops()`` measured in this run.
Model FLOPs: prefill 2 x active matmul params x B x P plus causal attention (mean context
(P+1)/2), and decode 2 x active params per new token plus attention over its real context
(P + t for the t-th new token); the lm_head is counted for every token (as the FLOP formula
does), although our prefill only forms the last position's logits.

  python benchmarks/bench_generate.py [--repeats 3] [--rounds 2] [--dispatch ragged] [--no-peer]

Load matters: the torch peer (2 OpenMP threads) slows down far more than XLA when other
processes compete for the cores (the same generate call measured 1.3 s on a quiet and 79 s
on a busy 2-core machine), so peer and ours alternate for ``--rounds`` rounds, each side keeps
its best, and the 1-minute load average before / after is reported; trust a ratio only when
that load is low.

Prints one JSON object as its LAST line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time


from _common import (BENCH_TINY, active_matmul_params, attention_flops_per_token,
                                add_round_args, bench_tiny_model_config, best_of_rounds,
                                dropless_capacity_factor, matmul_peak_flops, run_peer)


def generate_model_flops(cfg, batch: int, prompt: int, new: int) -> float:
    """Model FLOPs of one generate call (see the module docstring)."""
    active = active_matmul_params(cfg)
    prefill = batch * prompt * (2.0 * active + attention_flops_per_token(cfg, (prompt + 1) / 2))
    decode = sum(batch * (2.0 * active + attention_flops_per_token(cfg, prompt + t + 1))
                 for t in range(new))
    return prefill + decode


def measure_ours(shape: dict, dispatch: str, repeats: int, group_size: int = 1) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from ace_jax.runtime.generate import Generator, SamplingConfig
    from models import qwen3

    cfg = bench_tiny_model_config(shape)
    cfg = dataclasses.replace(cfg, moe_dispatch=dispatch,
                              moe_capacity_factor=dropless_capacity_factor(cfg))
    model = qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    b, p, m = shape["batch"], shape["prompt"], shape["new"]
    if b % group_size:
        raise ValueError(f"batch {b} is not divisible by group_size {group_size}")
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, shape["vocab"], (b // group_size, p)).tolist()
    sampling = SamplingConfig(max_new_tokens=m, group_size=group_size, temperature=1.0, top_k=0,
                              top_p=1.0, eos_ids=(), prompt_bucket=p)
    gen = Generator(model, sampling)
    t0 = time.perf_counter()
    out = jax.block_until_ready(gen.generate(prompts, jax.random.key(0)))
    first = time.perf_counter() - t0
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(gen.generate(prompts, jax.random.key(i + 1)))
        times.append(time.perf_counter() - t0)
    lengths = np.asarray(out.lengths)
    if out.tokens.shape != (b, m) or not np.all(lengths == m):
        raise RuntimeError(f"expected {b} rows of exactly {m} new tokens, got {out.tokens.shape}, "
                           f"lengths {sorted(set(lengths.tolist()))}")
    best = min(times)
    return dict(new_tokens_per_s=b * m / best, seconds=best, seconds_all=times,
                compile_s=max(first - best, 0.0),
                model_flops=generate_model_flops(cfg, b, p, m))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_round_args(ap)
    ap.add_argument("--group-size", type=int, default=1,
                    help="samples per prompt (the peer has 1; >1 shares each prompt's prefill)")
    args = ap.parse_args(argv)
    shape = dict(BENCH_TINY)
    peer, ours, loadavg = best_of_rounds(
        args.rounds,
        None if args.no_peer else lambda: run_peer("generate", shape, repeats=args.peer_repeats),
        lambda: measure_ours(shape, args.dispatch, args.repeats, args.group_size))
    peak = matmul_peak_flops()
    result = dict(
        bench="generate", shape=shape, loadavg_1min=loadavg,
        dispatch=args.dispatch, group_size=args.group_size,
        ours=ours, peer=peer, peak_flops=peak, mfu=ours["model_flops"] / ours["seconds"] / peak,
        ratio=None if peer is None else ours["new_tokens_per_s"] / peer["new_tokens_per_s"],
        target_ratio=5.0)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
