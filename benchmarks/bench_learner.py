"""Benchmark: tokens/s of one full GRPO learner step vs a transformers training step (same run).

Our side: ``Learner.step`` (forward + backward + global-norm clip + AdamW, one jitted call) on a
batch of 16 rows = 4 prompts x G=4 samples, each row a 128-token prompt followed by a 128-token
completion (256 tokens through the model), fp32. The peer (``../shared/bench/hf_baseline.py
train``) runs HF ``Qwen3MoeForCausalLM`` forward (LM loss on every position) + backward + AdamW
on the same [16, 256] shape with 2 torch threads. Both count batch x sequence tokens per second.

``mfu`` = model FLOP/s / ``matmul_peak_flops()`` (measured in this run), with model FLOPs per
step = 6 x active matmul params x tokens + 3 x forward attention FLOPs (causal: mean context
(T+1)/2). Compile time is excluded from the timed steps and reported separately.

  python benchmarks/bench_learner.py [--repeats 3] [--rounds 2] [--dispatch ragged] [--scan-layers]
                                     [--no-peer]

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


def build_batch(model, shape: dict, group_size: int, seed: int = 0):
    """A TrainBatch [B, P + M] with random prompt/completion tokens; the behaviour log-probs are
    the model's own teacher-forced log-probs (an on-policy first step), rewards random."""
    import jax
    import numpy as np
    from flax import nnx

    from ace_jax.rl import rollout_batch

    b, p, m, v = shape["batch"], shape["prompt"], shape["new"], shape["vocab"]
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, v, (b, p + m)).astype(np.int32)
    pos = np.broadcast_to(np.arange(p + m, dtype=np.int32), (b, p + m)).copy()
    batch = rollout_batch.TrainBatch(
        input_ids=ids, positions=pos, attention_mask=np.ones((b, p + m), bool),
        completion_mask=np.ones((b, m), np.float32), behaviour_logprobs=np.zeros((b, m), np.float32),
        rewards=rng.integers(0, 2, (b,)).astype(np.float32), ref_logprobs=np.zeros((b, m), np.float32))
    logits, _ = nnx.jit(rollout_batch.completion_logits)(model, batch)
    lp = rollout_batch.token_logprobs(logits, batch.input_ids[:, p:], 1.0)
    batch = batch._replace(behaviour_logprobs=np.asarray(lp))
    return jax.tree.map(jax.numpy.asarray, batch)


def measure_ours(shape: dict, dispatch: str, repeats: int, group_size: int = 4,
                 microbatches: int = 1, scan_layers: bool = False) -> dict:
    import jax
    from flax import nnx

    from ace_jax.rl import grpo, learner
    from models import qwen3

    cfg = bench_tiny_model_config(shape)
    cfg = dataclasses.replace(cfg, moe_dispatch=dispatch, scan_layers=scan_layers,
                              moe_capacity_factor=dropless_capacity_factor(cfg))
    model = qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    batch = build_batch(model, shape, group_size)
    g, o = grpo.default_config(), learner.default_config()
    o.microbatches = microbatches
    lrn = learner.Learner.create(model, g, o, group_size=group_size)
    t0 = time.perf_counter()
    metrics = lrn.step(batch)
    jax.block_until_ready((lrn.state, metrics))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        metrics = lrn.step(batch)
        jax.block_until_ready((lrn.state, metrics))
        times.append(time.perf_counter() - t0)
    best = min(times)
    if int(metrics["skipped"]):
        raise RuntimeError("the benchmarked learner step was skipped (non-finite loss)")
    seq = shape["prompt"] + shape["new"]
    tokens = shape["batch"] * seq
    flops = (6.0 * active_matmul_params(cfg) * tokens
             + 3.0 * tokens * attention_flops_per_token(cfg, (seq + 1) / 2))
    return dict(tokens_per_s=tokens / best, seconds=best, seconds_all=times,
                compile_s=max(first - best, 0.0), model_flops_per_step=flops,
                loss=float(metrics["loss"]), grad_norm=float(metrics["grad_norm"]))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_round_args(ap)
    ap.add_argument("--microbatches", type=int, default=1)
    ap.add_argument("--scan-layers", action="store_true",
                    help="scan the 4 layers (config default) instead of unrolling them: unrolled "
                         "is faster on CPU (no stacked per-layer residual buffers) and compiles "
                         "faster at this depth")
    args = ap.parse_args(argv)
    shape = dict(BENCH_TINY)
    peer, ours, loadavg = best_of_rounds(
        args.rounds,
        None if args.no_peer else lambda: run_peer("train", shape, repeats=args.peer_repeats),
        lambda: measure_ours(shape, args.dispatch, args.repeats, microbatches=args.microbatches,
                             scan_layers=args.scan_layers))
    peak = matmul_peak_flops()
    result = dict(
        bench="learner", shape=shape, loadavg_1min=loadavg,
        dispatch=args.dispatch, microbatches=args.microbatches, scan_layers=args.scan_layers,
        ours=ours, peer=peer, peak_flops=peak,
        mfu=ours["model_flops_per_step"] / ours["seconds"] / peak,
        ratio=None if peer is None else ours["tokens_per_s"] / peer["tokens_per_s"],
        target_ratio=2.0)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
