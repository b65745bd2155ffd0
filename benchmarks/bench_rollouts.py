"""Benchmark: what a user running long agent rollouts feels, drained steps against partial
rollouts (`ace_jax.train.partial_rollouts`), in the same run on the same engine shapes.

The policy is the embedded default's (``configs/local.py``: its Qwen3-MoE shape, random weights:
the cost does not depend on them). Every RL step takes B groups of G samples; the engine has
B x G decode slots (as ace30b gives its engine one slot per row). Completion lengths are
heavy-tailed: each sample's length is drawn log-uniform on [16, ``--budget``] (seeded, the same
group sequence for both modes) and the sample runs to exactly that length (its budget; no EOS),
so every token is a real decode step. Between steps the weights change
(``Engine.update_weights`` with scaled parameters and the next version), as after a learner step:

- drained (today's default, ``rl.partial_rollouts=0``): a step submits its B groups and drains
  them; it lasts as long as its longest sample, finished slots idle;
- partial (``rl.partial_rollouts=--factor``): the engine holds ceil(factor x B) groups, a step
  takes the first B that complete, the rest decode on under the new weights (per-token
  versions, staleness bounded by ``--bound``).

The first step of each mode compiles and is not timed. Reported: useful tokens per second
(completion tokens of the groups the steps took, over the steps' wall time), the decode
row-steps spent per useful token, the token staleness distribution, and whether any sample
was lost (a taken group with a sample short of its drawn length, or a submitted group neither
taken nor still in flight) or duplicated (taken twice). The learner's own step (the same in both
modes) is left out: this is the rollout side of the step. Prints one JSON line last:
``useful_speedup``, ``lost``, ``duplicated``, ``staleness_max``, and the figures behind them.

With ``--out FILE`` the JSON line is also appended to FILE with the commit it ran on; the
table in docs/offpolicy.md is generated from ``results/partial_rollouts/raw.jsonl`` by
``python -m ace_jax.experiments.tables``.

  python benchmarks/bench_rollouts.py [--steps 8] [--budget 256] [--factor 3] [--bound 3]
      [--out results/partial_rollouts/raw.jsonl]
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import pathlib
import time


@dataclasses.dataclass
class _State:
    state_id: int


def log_uniform_lengths(rng, n: int, low: int, high: int) -> list[int]:
    """``n`` integer lengths, log-uniform on [low, high]."""
    import numpy as np

    return np.clip(np.round(np.exp(rng.uniform(math.log(low), math.log(high), n))),
                   low, high).astype(int).tolist()


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--steps", type=int, default=8, help="timed RL steps per mode")
    ap.add_argument("--batch-groups", type=int, default=4, help="B: groups a step takes")
    ap.add_argument("--group-size", type=int, default=4, help="G: samples per group")
    ap.add_argument("--budget", type=int, default=256, help="max completion tokens")
    ap.add_argument("--min-length", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=96, help="prompt tokens per group")
    from ace_jax.train import config as run_config

    rl = run_config.rl_config()   # the run config's defaults
    ap.add_argument("--factor", type=float, default=rl.partial_factor, help="rl.partial_factor")
    ap.add_argument("--bound", type=int, default=rl.max_token_staleness,
                    help="rl.max_token_staleness")
    ap.add_argument("--sync-every", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="", help="append the JSON line (with its commit) here")
    args = ap.parse_args(argv)

    import jax
    import numpy as np
    from flax import nnx

    from ace_jax import config_utils
    from ace_jax.runtime import engine, engine_config, generate
    from ace_jax.train import partial_rollouts as pr
    from models import configs as model_configs, qwen3

    cfg = config_utils.load_config_file(str(pathlib.Path(__file__).resolve().parents[1] /
                                            "configs" / "local.py"))
    mc = model_configs.get_model_config(cfg.model.preset, **dict(cfg.model.overrides))
    model = qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    b, g = args.batch_groups, args.group_size
    rng = np.random.default_rng(args.seed)
    # the group sequence both modes draw from, in order (more than either can take)
    pool = 4 * (args.steps + 1) * b
    groups = [(rng.integers(1, mc.vocab_size, args.prompt).tolist(),
               log_uniform_lengths(rng, g, args.min_length, args.budget)) for _ in range(pool)]
    sampling = generate.SamplingConfig(max_new_tokens=args.budget, temperature=1.0, eos_ids=())
    shapes = engine_config.EngineConfig(slots=b * g, page_size=16,
                                        max_context=args.prompt + args.budget,
                                        prefill_chunk=128, sync_every=args.sync_every)

    def new_weights(version):
        return jax.tree.map(lambda x: x * (1.0 + 1e-3 * (version % 7)), params)

    def run(factor: float) -> dict:
        """``args.steps`` timed steps (after one untimed) at ``factor`` (1: drained)."""
        eng = engine.Engine(model, sampling, shapes)
        rollouts = pr.PartialRollouts(eng, group_size=g, batch_groups=b, factor=factor,
                                      max_token_staleness=args.bound, key=jax.random.key(0))
        drawn = iter(range(pool))

        def draw(n):
            out = []
            for _ in range(n):
                i = next(drawn)
                out.append(pr.NewGroup(_State(i), groups[i][0], groups[i][1]))
            return out

        taken, staleness, useful, seconds = [], [], 0, 0.0   # taken: (group, lengths)
        decode0 = 0
        for step in range(args.steps + 1):
            if step == 1:   # the first step compiled; from here on it counts
                decode0 = eng.stats["decode_steps"]
            t0 = time.perf_counter()
            rollouts.top_up(draw, step)
            got = rollouts.collect(learn_version=step)
            eng.update_weights(new_weights(step + 1), version=step + 1)
            jax.block_until_ready(eng.params)
            if step:
                seconds += time.perf_counter() - t0
            for grp in got:
                comps = rollouts.completions(grp)
                taken.append((grp.state.state_id, [len(c.tokens) for c in comps]))
                if step:
                    useful += sum(len(c.tokens) for c in comps)
                    staleness += [int(step - v) for c in comps for v in c.versions]
        ids = [i for i, _ in taken]
        # a sample short of (or past) its drawn length, or a drawn group neither taken nor
        # still in flight
        lost = sum(n != want for i, lens in taken for n, want in zip(lens, groups[i][1]))
        lost += len(set(range(rollouts.stats["submitted"])) - set(ids) - set(rollouts.groups))
        slot_steps = (eng.stats["decode_steps"] - decode0) * shapes.slots
        rollouts.cancel_all()
        return dict(factor=factor, useful_tokens=useful, seconds=seconds,
                    useful_tokens_per_s=useful / seconds, groups_taken=len(ids) - b,
                    row_steps_per_useful_token=slot_steps / useful,
                    lost=lost, duplicated=len(ids) - len(set(ids)),
                    staleness_hist=dict(sorted(collections.Counter(staleness).items())),
                    forced_groups=rollouts.stats["forced_groups"])

    load_before = os.getloadavg()[0]
    drained = run(1.0)
    partial = run(args.factor)
    lengths = np.asarray([n for _, lens in groups for n in lens])
    result = dict(
        bench="rollouts", steps=args.steps, batch_groups=b, group_size=g, slots=shapes.slots,
        budget=args.budget, length_law=f"log-uniform on [{args.min_length}, {args.budget}]",
        length_mean=float(lengths.mean()), length_p50=float(np.median(lengths)),
        factor=args.factor, bound=args.bound, drained=drained, partial=partial,
        useful_speedup=partial["useful_tokens_per_s"] / drained["useful_tokens_per_s"],
        lost=drained["lost"] + partial["lost"],
        duplicated=drained["duplicated"] + partial["duplicated"],
        staleness_max=max(partial["staleness_hist"], default=0),
        loadavg_before=load_before, cpus=os.cpu_count())
    print(f"drained: {drained['useful_tokens_per_s']:.0f} useful tok/s "
          f"({drained['row_steps_per_useful_token']:.2f} row-steps per useful token)")
    print(f"partial x{args.factor:g}: {partial['useful_tokens_per_s']:.0f} useful tok/s "
          f"({partial['row_steps_per_useful_token']:.2f} row-steps per useful token), token "
          f"staleness {partial['staleness_hist']}")
    if args.out:
        from ace_jax.experiments import provenance

        head, dirty = provenance.commit(short=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(dict(result, commit=head, dirty=dirty)) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
