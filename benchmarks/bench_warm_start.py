"""Warm-start measurement: can a few CPU minutes of SFT give RL a policy that is imperfect but not
hopeless?

Trains the BPE tokenizer and the SFT stage (``ace_jax.train.sft``) with the local model size, then samples
``--samples`` completions at temperature 1.0 for draft states of several tasks, runs every
well-formed one in the sandbox pool (dev split) and counts the outcomes: invalid format,
syntax error, runtime error, ..., ok. The last line printed is one JSON object::

  {"sft_seconds", "sft_cpu_seconds", "sft_steps", "sft_tokens", "final_loss", "valid_rate",
   "format_rate", "counts": {...}, "gen_tokens", "by_temperature": {T: {valid_rate, counts}}, ...}

(``valid_rate`` / ``counts`` / ``gen_tokens`` are those of the first ``--temperatures`` entry.)

Usage (the measurement reported to the lead; ``--sft_seconds=0`` budgets by steps, so a busy
machine measures the same training as an idle one, and ``sft_cpu_seconds`` gives its cost)::

  python benchmarks/bench_warm_start.py --sft_seconds=0 --sft_steps=200 --no_system \
      --kinds=draft --buckets=448 --temperatures=0.5,0.6
  python benchmarks/bench_warm_start.py --overrides='{"hidden_size": 96}' --vocab=768

CPU time (user + sys) is best measured around it: ``/usr/bin/time -v`` or bash ``time``.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import pathlib
import tempfile
import time


# Same model size as configs/local.py (c.model.overrides); kept here so the benchmark runs alone.
LOCAL_OVERRIDES = dict(
    vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    num_experts=4, num_experts_per_tok=2, max_position_embeddings=2048,
    tie_word_embeddings=True, dtype="float32", moe_dispatch="ragged", remat_policy="none")
DEFAULT_TASKS = "iris-species,wine-cultivar,diabetes-progression,breast-cancer-diagnosis"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sft_seconds", type=float, default=180.0, help="wall budget (<= 0: steps only)")
    ap.add_argument("--sft_steps", type=int, default=400)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--kinds", default="draft", help="SFT example kinds (draft,improve,debug)")
    ap.add_argument("--buckets", default="448,768", help="comma-separated SFT batch widths (tokens)")
    ap.add_argument("--description", default="brief", choices=("brief", "full"))
    ap.add_argument("--no_system", action="store_true", help="drop the system turn from prompts")
    ap.add_argument("--overrides", default="{}", help="JSON model overrides on top of the local size")
    ap.add_argument("--tasks", default=DEFAULT_TASKS, help="comma-separated tasks to sample drafts for")
    ap.add_argument("--samples", type=int, default=32, help="total completions (split over the tasks)")
    ap.add_argument("--max_new_tokens", type=int, default=384)
    ap.add_argument("--temperatures", default="1.0", help="comma-separated; the first gives valid_rate")
    ap.add_argument("--backend", default="process")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work_dir", default="")
    ap.add_argument("--show", type=int, default=2, help="print this many sampled completions")
    args = ap.parse_args()

    import jax
    from flax import nnx

    from ace_jax.env import agent
    from ace_jax.runtime.generate import Generator, SamplingConfig
    from ace_jax.train import sft
    from models import configs as model_configs
    from models import qwen3
    from models.tokenizer import ENDOFTEXT, IM_END
    from sandbox import seed_corpus
    from sandbox.pool import SandboxPool
    from sandbox.tasks import registry

    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="warm_start_"))
    tasks = registry.load_suite(prepare_if_missing=True, family="offline")
    by_id = {t.task_id: t for t in tasks}
    sample_tasks = [by_id[t] for t in args.tasks.split(",")]

    acfg = agent.default_config()
    acfg.description = args.description
    acfg.show_system = not args.no_system
    scfg = sft.default_config()
    scfg.update(dict(seconds=args.sft_seconds, steps=args.sft_steps, batch_size=args.batch_size,
                     learning_rate=args.lr, vocab_size=args.vocab, seed=args.seed,
                     kinds=tuple(args.kinds.split(",")),
                     buckets=tuple(int(b) for b in args.buckets.split(","))))

    import resource

    def cpu_s() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    t0 = time.perf_counter()
    tok = sft.build_tokenizer(tasks, seed_corpus.list_scripts(), args.vocab, str(work / "tokenizer"), acfg)
    tok_s = time.perf_counter() - t0
    examples = sft.build_sft_examples(tasks, scfg, acfg)
    overrides = {**LOCAL_OVERRIDES, **json.loads(args.overrides), "vocab_size": args.vocab}
    mcfg = model_configs.tiny_moe(**overrides)
    model = qwen3.Qwen3ForCausalLM(mcfg, rngs=nnx.Rngs(args.seed))
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"tokenizer {len(tok)} tokens in {tok_s:.1f}s; {len(examples)} examples "
          f"{dict(collections.Counter(e.kind for e in examples))}; model {n_params / 1e6:.2f}M params",
          flush=True)
    c0 = cpu_s()
    model, m = sft.train_sft(model, tok, examples, scfg, progress=True)
    sft_cpu = cpu_s() - c0
    lens = sorted(len(x.ids) for x in sft.tokenize_examples(tok, examples, 1 << 20)[0])
    print(f"example lengths (tokens): min {lens[0]}, median {lens[len(lens) // 2]}, max {lens[-1]}")
    print(f"sft cpu {sft_cpu:.0f}s; sft: {m['steps']} steps, {m['seconds']:.1f}s, loss {m['first_loss']:.3f} -> "
          f"{m['final_loss']:.3f}, {m['tokens']} completion tokens, dropped {m['dropped']}", flush=True)

    # Sample drafts: G = samples / len(tasks) completions per task, for each temperature.
    eos, pad = tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(ENDOFTEXT)
    group = max(1, args.samples // len(sample_tasks))
    from ace_jax.curriculum.buffer import State
    prompts = []
    for t in sample_tasks:
        st = State(state_id=0, task_id=t.task_id, parent_id=None, depth=0, code="", history=[],
                   score=None, origin="seed", created_step=0)
        prompts.append(tok.encode(agent.render_prompt(st, t, acfg), add_special_tokens=False))
    corpus_codes = {s.code.strip() for s in seed_corpus.list_scripts()}
    generator = Generator(model, SamplingConfig(max_new_tokens=args.max_new_tokens, group_size=group,
                                                eos_ids=(eos,), pad_id=pad, prompt_bucket=64))
    by_temp = {}
    with SandboxPool(args.backend, args.workers) as pool:
        for temp in [float(x) for x in args.temperatures.split(",")]:
            sampling = dataclasses.replace(generator.sampling, temperature=temp)
            t1 = time.perf_counter()
            out = generator.generate(prompts, jax.random.key(args.seed + 1), sampling)
            tokens, lengths = jax.device_get((out.tokens, out.lengths))
            gen_s = time.perf_counter() - t1
            texts = [tok.decode(tokens[i, :lengths[i]].tolist(), skip_special_tokens=True)
                     for i in range(len(lengths))]
            actions = [agent.parse_action(x) for x in texts]
            counts: collections.Counter = collections.Counter()
            jobs, job_rows = [], []
            for i, a in enumerate(actions):
                if a.valid:
                    jobs.append((sample_tasks[i // group], a.code))
                    job_rows.append(i)
                else:
                    counts[f"invalid_format:{a.reason.value}"] += 1
            t2 = time.perf_counter()
            results = pool.map(jobs) if jobs else []
            sandbox_s = time.perf_counter() - t2
            per_task = collections.defaultdict(collections.Counter)
            for i, r in zip(job_rows, results):
                counts[r.status.value] += 1
                per_task[sample_tasks[i // group].task_id][r.status.value] += 1
            for i, text in enumerate(texts[:args.show]):
                print(f"--- T={temp} sample {i} ({sample_tasks[i // group].task_id}) ---\n{text[:1500]}")
            errors = collections.Counter(r.error.split("\n")[0][:100] for r in results if not r.status.is_valid)
            n = len(texts)
            by_temp[temp] = dict(
                valid_rate=counts["ok"] / n, format_rate=sum(1 for a in actions if a.valid) / n,
                counts=dict(counts), per_task={k: dict(v) for k, v in per_task.items()},
                top_errors=errors.most_common(5), gen_tokens=int(lengths.sum()), gen_seconds=round(gen_s, 1),
                sandbox_seconds=round(sandbox_s, 1), mean_completion_tokens=float(lengths.mean()),
                distinct_scripts=len({a.code for a in actions if a.valid}),
                verbatim_corpus_copies=sum(1 for a in actions if a.valid and a.code.strip() in corpus_codes))
            print(f"T={temp}: {json.dumps(by_temp[temp])}", flush=True)
    first = by_temp[next(iter(by_temp))]
    report = dict(
        sft_seconds=round(m["seconds"], 1), sft_cpu_seconds=round(sft_cpu, 1), sft_steps=m["steps"],
        sft_tokens=m["tokens"], first_loss=round(m["first_loss"], 4), final_loss=round(m["final_loss"], 4),
        tokenizer_seconds=round(tok_s, 1), params=int(n_params), vocab=len(tok), samples=len(prompts) * group,
        valid_rate=first["valid_rate"], format_rate=first["format_rate"], counts=first["counts"],
        gen_tokens=first["gen_tokens"], by_temperature={str(k): {kk: v[kk] for kk in ("valid_rate", "counts")}
                                                        for k, v in by_temp.items()},
        overrides=json.loads(args.overrides), description=args.description, system=not args.no_system,
        kinds=args.kinds, buckets=args.buckets, batch_size=args.batch_size, lr=args.lr)
    print(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    main()
