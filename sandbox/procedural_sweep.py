"""Runs the procedural family's baseline scripts through the sandbox pool: reference leaderboards.

    python -m sandbox.procedural_sweep --seed=0 --workers=2            # every instance (~240)
    python -m sandbox.procedural_sweep --tasks=proc-linear-000,proc-rules-004 --out=/tmp/p.csv

For every procedural instance (train, held-out and held-out family alike: evaluation needs
medals on the held-out ones) and each of its 8 baseline scripts
(``sandbox.seed_corpus.procedural.baseline_scripts``), the pool runs the script with
``split="test"`` (dev and final-test halves both graded), exactly as ``sandbox.sweep`` does for
the offline suite (it reuses ``sandbox.sweep.sweep_task``). The output is one compact CSV,
committed as data: ``sandbox/seed_corpus/results/seed<seed>/procedural.csv`` with the columns
``sandbox.tasks.procedural.RESULT_COLUMNS``:

  task_id, team (script file), status, score (final-test; MLE-bench's column), dev_score,
  wall_s (the execution's seconds), digest (``procedural.prepared_digest`` of the prepared
  files the scores were measured on, 16 hex digits)

The file is updated after each instance; a run over a subset keeps the other instances' rows.
By default the pool is bwrap with warm interpreters that import numpy, pandas and scikit-learn
once per instance (``--backend=process`` starts every script cold: slower, same scores).
"""
from __future__ import annotations

import argparse
import pathlib
import sys
import time
from typing import Optional, Sequence

import pandas as pd

from sandbox import prepare as prepare_mod
from sandbox import sweep
from sandbox.seed_corpus import procedural as proc_scripts
from sandbox.tasks import procedural, registry

DIGEST_CHARS = 16


def result_rows(task, rows: list[dict], digest: str) -> list[dict]:
    """``sweep.sweep_task`` rows as ``procedural.RESULT_COLUMNS`` rows."""
    return [{"task_id": task.task_id, "team": r["script"], "status": r["status"],
             "score": r["test_score"], "dev_score": r["dev_score"], "wall_s": r["wall_s"],
             "digest": digest[:DIGEST_CHARS]} for r in rows]


def write_results(path: pathlib.Path, rows: list[dict], replace_ids: Sequence[str]) -> pd.DataFrame:
    """Merges ``rows`` into the CSV at ``path`` (the rows of ``replace_ids`` replaced); sorted by
    task then team; floats with 6 significant digits."""
    new = pd.DataFrame(rows, columns=list(procedural.RESULT_COLUMNS))
    if path.exists():
        old = pd.read_csv(path, dtype={"task_id": str, "team": str, "status": str, "digest": str})
        new = pd.concat([old[~old["task_id"].isin(set(replace_ids))], new], ignore_index=True)
    new = new.sort_values(["task_id", "team"], kind="stable").reset_index(drop=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    new.to_csv(path, index=False, lineterminator="\n", float_format="%.6g")
    procedural._results.cache_clear()
    return new


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sandbox.procedural_sweep",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--cache_dir", default="cache/tasks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default="", help="comma-separated instance ids (default: all)")
    ap.add_argument("--backend", default="bwrap", help="sandbox backend name")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default="", help="output CSV (default: the committed file)")
    args = ap.parse_args(argv)

    from sandbox.pool import SandboxPool

    ids = [t for t in args.tasks.split(",") if t] or procedural.all_ids()
    for t in ids:
        if registry.family_of(t) != procedural.FAMILY:
            raise KeyError(f"{t!r} is not a procedural instance")
    out = pathlib.Path(args.out or str(procedural.RESULTS_FILE).format(seed=args.seed))
    cache = pathlib.Path(args.cache_dir)
    preload = proc_scripts.PRELOAD if args.backend == "bwrap" else ()
    rows: list[dict] = []
    t_all = time.time()
    with SandboxPool(args.backend, num_workers=args.workers, preload=preload) as pool:
        for n, t in enumerate(ids, 1):
            t0 = time.time()
            prepare_mod.prepare_task(t, cache, args.seed)
            task = registry.load_task(t, cache, args.seed, prepare_if_missing=False)
            digest = procedural.prepared_digest(registry.task_dir(cache, t, args.seed))
            runs = sweep.sweep_task(pool, task, proc_scripts.baseline_scripts(t))
            rows += result_rows(task, runs, digest)
            write_results(out, result_rows(task, runs, digest), [t])   # after each instance
            lb = sweep.leaderboard_frame(task, runs)
            bad = [f"{r['script']}:{r['status']}" for r in runs if r["status"] != "ok"]
            best = lb["score"].iloc[0] if len(lb) else float("nan")
            print(f"[{n}/{len(ids)}] {t:22s} {task.metric:9s} {len(lb)}/{len(runs)} valid, best "
                  f"final {best:.5f}, baseline dev {task.baseline_score:.5f}, "
                  f"{time.time() - t0:4.1f} s" + (f"  failed: {bad}" if bad else ""), flush=True)
    print(f"{len(ids)} instances, {len(rows)} runs in {time.time() - t_all:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
