"""Measurement: sampler-vs-learner mismatch of the local MoE policy in bf16, with MoE routing
replay (R3) off and on, on fixed batches.

For each seed: configs/local.py's policy (tiny Qwen3-MoE, 4 experts, top-2) in bfloat16 at a
random init of that seed samples B prompts x G completions with the paged engine (which records
each token's experts per MoE layer); the learner's log-probs of the same tokens are then
computed by its own full-sequence forward (`rollout_batch.completion_logprobs`), without and
with replaying the record. Reported per seed and mode, over completion tokens:

- ``mismatch_k3``: the k3 estimate of KL(sampler || learner) from the sampled tokens (what
  ``offpolicy/mismatch_k3`` logs on-policy);
- ``logprob_diff_max_abs``: the largest |learner - sampler| log-prob;
- ``router_disagreement_frac``: share of (token, MoE layer) pairs whose learner top-k set
  differs from the record (the same in both modes: the routers are the same);
- ``routing_mismatch_frac``: the same for the experts the learner's pass dispatched to (0 with
  replay, by construction).

The two sides differ only by numerics: the engine decodes token by token over a paged bf16 KV
cache, the learner runs each row at once. An fp32 control row shows the floor.

  python benchmarks/bench_routing_replay.py [--seeds 0,1,2] [--new 64]

Prints one JSON object per seed and dtype, then a summary object as its LAST line.
"""
from __future__ import annotations

import argparse
import json


def measure(seed: int, dtype: str, new_tokens: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from ace_jax import config_utils
    from ace_jax.rl import rollout_batch
    from ace_jax.runtime import engine, engine_config, generate
    from ace_jax.train import setup
    from models import qwen3

    cfg = config_utils.load_config_file("configs/local.py")
    cfg.model.overrides.dtype = dtype
    model = qwen3.Qwen3ForCausalLM(setup.build_model_config(cfg, None), rngs=nnx.Rngs(seed))
    b, g = cfg.rl.batch_states, cfg.rl.group_size
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, model.config.vocab_size, int(k)))
               for k in rng.integers(48, 160, b)]
    sampling = generate.SamplingConfig(max_new_tokens=new_tokens, group_size=g, temperature=1.0,
                                       prompt_bucket=16, eos_ids=())
    eng = engine.Engine(model, sampling, engine_config.EngineConfig(
        slots=8, max_context=max(map(len, prompts)) + new_tokens), record_routes=True)
    out = eng.generate(prompts, jax.random.key(seed))
    batch = rollout_batch.make_train_batch(prompts, out, np.zeros(b * g), prompt_bucket=16,
                                           pad_id=0)
    mask = np.asarray(batch.completion_mask) > 0
    row = dict(seed=seed, dtype=dtype, rows=b * g, completion_tokens=int(mask.sum()),
               moe_layers=model.config.num_moe_layers, experts=model.config.num_experts,
               top_k=model.config.num_experts_per_tok)
    for mode, replay in (("none", False), ("R3", True)):
        lp, _, _, stats = nnx.jit(lambda mdl, bt, r=replay: rollout_batch.completion_logprobs(
            mdl, bt, 1.0, replay_routes=r, return_route_stats=True))(model, batch)
        d = np.asarray(lp, np.float64) - np.asarray(batch.behaviour_logprobs, np.float64)
        d = d[mask]
        disagree = float(stats.disagree / jnp.maximum(stats.records, 1.0))
        row[mode] = dict(mismatch_k3=float(np.mean(np.exp(d) - d - 1.0)),
                         logprob_diff_max_abs=float(np.abs(d).max()),
                         router_disagreement_frac=disagree,
                         routing_mismatch_frac=0.0 if replay else disagree)
    return row


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--new", type=int, default=64, help="new tokens per completion")
    args = ap.parse_args(argv)
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for dtype in ("bfloat16", "float32"):
            rows.append(measure(seed, dtype, args.new))
            print(json.dumps(rows[-1]), flush=True)
    bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
    summary = dict(
        seeds=len(bf16),
        bf16_k3_none=[r["none"]["mismatch_k3"] for r in bf16],
        bf16_k3_r3=[r["R3"]["mismatch_k3"] for r in bf16],
        bf16_routing_mismatch_none=[r["none"]["routing_mismatch_frac"] for r in bf16],
        r3_lowers_k3_every_seed=all(r["R3"]["mismatch_k3"] < r["none"]["mismatch_k3"] for r in bf16),
        fp32_k3_none=[r["none"]["mismatch_k3"] for r in rows if r["dtype"] == "float32"])
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
