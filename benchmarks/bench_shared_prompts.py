"""Benchmark: the GRPO learner step with each group's prompt run once (``optim.share_prompts``)
against full rows, on the embedded default's model and step shape (same run, alternating).

The step: configs/local.py's policy (fp32 tiny Qwen3-MoE) and batch, B = 4 prompts x G = 4
samples, each prompt ``--prompt`` tokens (left-padded as the sampler pads them) and each
completion up to ``--new`` tokens with lengths drawn around ``--mean-len`` (the local run's
completions average ~230 of 384 tokens). Both sides run the same jitted ``Learner.step``
(forward, backward, clip, AdamW) on the same batch; ``loss`` / ``grad_norm`` of both are printed
so the equality can be seen. Compile time is excluded and reported apart.

  python benchmarks/bench_shared_prompts.py [--prompt 576] [--new 384] [--rounds 3]

Prints one JSON object as its LAST line, with ``speedup`` = full-row seconds / shared seconds.
"""
from __future__ import annotations

import argparse
import json
import time


def build(prompt_len: int, new: int, mean_len: int, seed: int = 0):
    """(model, TrainBatch, config) for configs/local.py with a synthetic grouped rollout."""
    import numpy as np
    from flax import nnx

    from ace_jax import config_utils
    from ace_jax.rl import rollout_batch
    from ace_jax.runtime import generate
    from ace_jax.train import setup
    from models import qwen3

    cfg = config_utils.load_config_file("configs/local.py")
    model = qwen3.Qwen3ForCausalLM(setup.build_model_config(cfg, None), rngs=nnx.Rngs(seed))
    b, g = cfg.rl.batch_states, cfg.rl.group_size
    v = model.config.vocab_size
    rng = np.random.default_rng(seed)
    prompts = [list(rng.integers(1, v, prompt_len - 17 * i)) for i in range(b)]
    lengths = np.clip(rng.normal(mean_len, 80, b * g).astype(np.int32), 1, new)
    lengths[0] = new                      # one sample ran to the limit
    gen = generate.GenerationResult(
        tokens=rng.integers(1, v, (b * g, new)).astype(np.int32),
        logprobs=-rng.random((b * g, new)).astype(np.float32), lengths=lengths,
        finish_reason=np.zeros(b * g, np.int32), prompt_index=np.repeat(np.arange(b), g))
    rewards = rng.normal(size=b * g).astype(np.float32)
    batch = rollout_batch.make_train_batch(prompts, gen, rewards,
                                           prompt_bucket=cfg.sampling.prompt_bucket, pad_id=0)
    return model, batch, cfg


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompt", type=int, default=576, help="longest prompt of the batch (tokens)")
    ap.add_argument("--new", type=int, default=384, help="sampling.max_new_tokens")
    ap.add_argument("--mean-len", type=int, default=230, help="mean completion length")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import jax

    from ace_jax.rl import learner

    model, batch, cfg = build(args.prompt, args.new, args.mean_len)
    sides = {}
    for share in (False, True):
        o = cfg.optim.copy_and_resolve_references()
        o.share_prompts = share
        lrn = learner.Learner.create(model, cfg.grpo, o, group_size=cfg.rl.group_size,
                                     temperature=cfg.sampling.temperature)
        t0 = time.perf_counter()
        jax.block_until_ready(lrn.step(batch))
        sides[share] = dict(learner=lrn, compile_s=time.perf_counter() - t0, times=[])
    for _ in range(args.rounds):            # alternate: both sides see the same load
        for share, side in sides.items():
            lrn = side["learner"]
            t0 = time.perf_counter()
            metrics = jax.block_until_ready(lrn.step(batch))
            side["times"].append(time.perf_counter() - t0)
            side["loss"], side["grad_norm"] = float(metrics["loss"]), float(metrics["grad_norm"])
    out = {"rows": int(batch.input_ids.shape[0]), "row_tokens": int(batch.input_ids.shape[1])}
    for share, side in sides.items():
        name = "shared" if share else "full_rows"
        out[name] = dict(seconds=min(side["times"]), seconds_all=[round(t, 3) for t in side["times"]],
                         compile_s=round(side["compile_s"] - min(side["times"]), 2),
                         loss=side["loss"], grad_norm=side["grad_norm"])
    out["speedup"] = round(out["full_rows"]["seconds"] / out["shared"]["seconds"], 3)
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
