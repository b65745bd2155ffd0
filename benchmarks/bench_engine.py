"""Benchmark: the paged, continuously batched engine against the static generator (same run).

The requests are RL steps of the embedded default (``configs/local.py``: its policy shape, B = 4
prompts x G = 4 samples per step) with the prompt and completion lengths of a real run of it,
read from its ``rollouts/*.jsonl`` (``--rollouts``; default: the lengths recorded in
``benchmarks/data/local_rollout_lengths.json``, which says which run they come from). Prompts
are random tokens of the recorded lengths; each completion is made to end at its recorded length
(its sample's budget; no EOS), so both engines do the work the run did:

- static (``generate.Generator``, the reference): one batch per step, decoding until the
  longest row ends (every row computes every step, finished ones on padding);
- engine (``engine.Engine``): the step's B x G samples through ``--slots`` decode slots, a
  finished row's slot refilled at once, each prompt prefilled once into shared pages.

Greedy sampling, random weights (the cost does not depend on them); the first pass compiles and
is not timed, then the best of ``--repeats`` passes over the same steps counts. Prints one JSON
line: ``tokens_per_s`` / ``static_tokens_per_s`` (completion tokens the run kept, per second),
``speedup_vs_static``, ``tokens_identical`` (every completion equals the static one's first
tokens), ``batching_ceiling`` (the static generator's decode row-steps over the tokens kept: the
speedup continuous batching alone could give on these lengths, at equal cost per row-step),
``peak_pages`` / ``pool_pages`` and the length distribution used.

  python benchmarks/bench_engine.py [--rollouts runs/local/rollouts] [--steps 6] [--slots 8]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import pathlib
import time

DATA = pathlib.Path(__file__).resolve().parent / "data" / "local_rollout_lengths.json"


def read_rollouts(folder: str, group_size: int) -> list[dict]:
    """Per RL step: {"prompt_tokens": [B], "completion_tokens": [B][G]} from a run's
    ``rollouts/*.jsonl`` (the trainer writes a step's rows prompt-major, G per prompt)."""
    steps = []
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        rows = [json.loads(line) for line in open(path) if line.strip()]
        if not rows or "completion_tokens" not in rows[0] or len(rows) % group_size:
            continue
        groups = [rows[i:i + group_size] for i in range(0, len(rows), group_size)]
        steps.append(dict(prompt_tokens=[g[0]["prompt_tokens"] for g in groups],
                          completion_tokens=[[r["completion_tokens"] for r in g] for g in groups]))
    return steps


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rollouts", default="", help="a run's rollouts/ folder (default: the "
                    "recorded lengths in benchmarks/data/local_rollout_lengths.json)")
    ap.add_argument("--steps", type=int, default=6, help="RL steps of the run to replay")
    ap.add_argument("--group-size", type=int, default=4, help="the run's rl.group_size")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=256)
    ap.add_argument("--shared-prefixes", type=int, default=0, help="engine.shared_prefixes: "
                    "prompts read once per decode step for their samples (0: off)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--record", default="", help="with --rollouts: write their lengths to "
                    "benchmarks/data/local_rollout_lengths.json, this text saying where they are from")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from flax import nnx

    from ace_jax import config_utils
    from ace_jax.runtime import engine, engine_config, generate
    from models import configs as model_configs, qwen3

    if args.rollouts:
        source, steps = args.rollouts, read_rollouts(args.rollouts, args.group_size)
        if args.record:
            DATA.parent.mkdir(exist_ok=True)
            DATA.write_text(json.dumps(dict(source=args.record, steps=steps)) + "\n")
    else:
        recorded = json.loads(DATA.read_text())
        source, steps = recorded["source"], recorded["steps"]
    steps = steps[:args.steps]
    if not steps:
        raise SystemExit(f"no rollouts with token counts in {source}")
    cfg = config_utils.load_config_file(str(pathlib.Path(__file__).resolve().parents[1] /
                                            "configs" / "local.py"))
    mc = model_configs.get_model_config(cfg.model.preset, **dict(cfg.model.overrides))
    model = qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    requests = [([rng.integers(1, mc.vocab_size, p).tolist() for p in s["prompt_tokens"]],
                 s["completion_tokens"]) for s in steps]
    max_new = max(c for _, comp in requests for g in comp for c in g)
    max_prompt = max(len(p) for prompts, _ in requests for p in prompts)
    base = generate.SamplingConfig(max_new_tokens=max_new, group_size=len(requests[0][1][0]),
                                   temperature=0.0, eos_ids=(), prompt_bucket=64)
    static = generate.Generator(model, base)
    eng = engine.Engine(model, base, engine_config.EngineConfig(
        slots=args.slots, page_size=args.page_size, max_context=max_prompt + max_new,
        prefill_chunk=args.prefill_chunk, sync_every=args.sync_every,
        shared_prefixes=args.shared_prefixes, prefix_rows=len(requests[0][1][0])))

    def run_static():
        outs = []
        for prompts, comp in requests:
            m = max(c for g in comp for c in g)
            s = generate.SamplingConfig(**{**base.__dict__, "max_new_tokens": m})
            outs.append(jax.block_until_ready(static.generate(prompts, jax.random.key(0), s)))
        return outs

    def run_engine():
        outs = []
        for prompts, comp in requests:
            ids = [eng.submit(p, n=len(c), key=jax.random.fold_in(jax.random.key(0), b),
                              max_new_tokens=c) for b, (p, c) in enumerate(zip(prompts, comp))]
            got = {(c.request, c.sample): c.tokens for c in eng.drain()}
            outs.append([[got[(rid, g)] for g in range(len(cs))] for rid, cs in zip(ids, comp)])
        return outs

    def best(fn):
        fn()                                       # compiles
        times, out = [], None
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            out = fn()
            times.append(time.perf_counter() - t0)
        return min(times), out

    load_before = os.getloadavg()[0]
    static_s, static_out = best(run_static)
    engine_s, engine_out = best(run_engine)
    kept = sum(c for _, comp in requests for g in comp for c in g)
    identical = all(
        got == np.asarray(ref.tokens)[b * len(cs) + g, :len(got)].tolist()
        for ref, rows, (_, comp) in zip(static_out, engine_out, requests)
        for b, cs in enumerate(comp) for g, got in enumerate(rows[b]))
    lengths = np.asarray([c for _, comp in requests for g in comp for c in g])
    result = dict(
        bench="engine", source=source, steps=len(requests),
        rows_per_step=sum(len(g) for g in requests[0][1]), slots=args.slots,
        page_size=args.page_size, sync_every=args.sync_every,
        shared_prefixes=args.shared_prefixes,
        completion_tokens=dict(mean=float(lengths.mean()), min=int(lengths.min()),
                               median=float(np.median(lengths)), max=int(lengths.max())),
        prompt_tokens_mean=float(np.mean([len(p) for prompts, _ in requests for p in prompts])),
        tokens_per_s=kept / engine_s, static_tokens_per_s=kept / static_s,
        speedup_vs_static=static_s / engine_s, tokens_identical=bool(identical),
        # what continuous batching alone can win on these lengths: the static generator's
        # row-steps (every row runs until its step's longest) over the tokens kept
        batching_ceiling=sum(max(c for g in comp for c in g) * sum(len(g) for g in comp)
                             for _, comp in requests) / kept,
        peak_pages=eng.stats["peak_pages"], pool_pages=eng.config.pool_pages,
        engine_seconds=engine_s, static_seconds=static_s,
        loadavg_1min=(load_before, os.getloadavg()[0]))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
