"""Runs the seed-corpus baselines through the sandbox pool and writes the reference leaderboards.

    python -m sandbox.sweep --cache_dir=cache/tasks --seed=0 --workers=2 --backend=process
    python -m sandbox.sweep --tasks=iris-species --out_dir=/tmp/sweep   # a subset elsewhere

For every task and every script in ``sandbox/seed_corpus/<task_id>/`` the pool runs the script
(``split="test"``: the dev and the final-test halves are both graded). Outputs, under
``<out_dir>/seed<seed>/`` (default ``sandbox/seed_corpus/results``, committed as data):

  * ``<task_id>/leaderboard.csv``: ``team,score,dev_score`` for every valid run, best first;
    ``score`` is the **final-test** score (MLE-bench's column name; medal thresholds use it).
  * ``<task_id>/results.json``: every run (status, scores, reported metric, seconds, memory, error).
  * ``pairs.json``: the declared (weaker, stronger) pairs with their dev scores and whether the
    stronger one really improves.
  * ``checksums.json``: the prepared files the scores were measured on (``sandbox.prepare --verify``
    compares with it).

These leaderboards come from our own baseline sweep, not from human Kaggle teams: ~10 "teams"
per task, so MLE-bench's rule gives gold = the best entry, silver = top 2, bronze = top 4.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Optional, Sequence

import pandas as pd

from sandbox import prepare as prepare_mod
from sandbox import seed_corpus
from sandbox.tasks import base, registry


def leaderboard_frame(task: base.Task, rows: list[dict]) -> pd.DataFrame:
    """Valid runs as ``team, score (final test), dev_score``, best first (ties: by name)."""
    valid = [r for r in rows if r["status"] == "ok" and r["test_score"] is not None]
    df = pd.DataFrame([{"team": r["script"], "score": r["test_score"], "dev_score": r["dev_score"]}
                       for r in valid], columns=["team", "score", "dev_score"])
    return df.sort_values(["score", "team"], ascending=[task.lower_is_better, True],
                          kind="stable").reset_index(drop=True)


def sweep_task(pool, task: base.Task, scripts: list[seed_corpus.SeedScript]) -> list[dict]:
    """Runs ``scripts`` on ``task`` through ``pool``; one JSON-ready dict per script."""
    results = pool.map([(task, s.code, "test") for s in scripts])
    rows = []
    for s, r in zip(scripts, results):
        rows.append({"script": s.name, "status": r.status.value, "dev_score": r.dev_score,
                     "test_score": r.test_score, "reported_metric": r.reported_metric,
                     "wall_s": round(r.wall_s, 2),
                     "peak_memory_mb": None if r.peak_memory_mb is None else round(r.peak_memory_mb, 1),
                     "error": r.error})
    return rows


def measured_pairs(task: base.Task, rows: list[dict]) -> list[dict]:
    """The declared pairs of ``task`` with their dev scores; ``improves`` = strictly better dev."""
    declared = json.loads((seed_corpus.CORPUS_DIR / "pairs.json").read_text()).get(task.task_id, [])
    by_name = {r["script"]: r for r in rows}
    out = []
    for weak, strong in declared:
        w, s = by_name.get(weak, {}).get("dev_score"), by_name.get(strong, {}).get("dev_score")
        improves = w is not None and s is not None and task.better(s, w)
        out.append({"task_id": task.task_id, "weak": weak, "strong": strong,
                    "weak_dev": w, "strong_dev": s, "improves": bool(improves)})
    return out


def write_task_results(out: pathlib.Path, task: base.Task, rows: list[dict]) -> pd.DataFrame:
    d = out / task.task_id
    d.mkdir(parents=True, exist_ok=True)
    lb = leaderboard_frame(task, rows)
    lb.to_csv(d / "leaderboard.csv", index=False, lineterminator="\n")
    (d / "results.json").write_text(json.dumps(
        {"task_id": task.task_id, "metric": task.metric, "lower_is_better": task.lower_is_better,
         "seed": task.seed, "baseline_score_dev": task.baseline_score,
         "note": "our own baseline sweep (sandbox/sweep.py), not human teams", "runs": rows},
        indent=1) + "\n")
    return lb


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sandbox.sweep", description=__doc__.split("\n")[0])
    ap.add_argument("--cache_dir", default="cache/tasks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tasks", default="", help="comma-separated task ids (default: every task "
                                                "with seed scripts)")
    ap.add_argument("--backend", default="process", help="sandbox backend name")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out_dir", default=str(seed_corpus.RESULTS_DIR))
    args = ap.parse_args(argv)

    from sandbox.pool import SandboxPool  # the execution side (H3a); imported only when sweeping

    ids = [t for t in args.tasks.split(",") if t] or seed_corpus.task_ids()
    out = pathlib.Path(args.out_dir) / f"seed{args.seed}"
    out.mkdir(parents=True, exist_ok=True)
    all_pairs, checksums = [], {}
    pairs_path, sums_path = out / "pairs.json", out / prepare_mod.CHECKSUM_FILE
    if pairs_path.exists():  # keep other tasks' entries when sweeping a subset
        all_pairs = [p for p in json.loads(pairs_path.read_text()) if p["task_id"] not in ids]
    if sums_path.exists():
        checksums = {k: v for k, v in json.loads(sums_path.read_text()).items() if k not in ids}
    cache = pathlib.Path(args.cache_dir)
    with SandboxPool(args.backend, num_workers=args.workers) as pool:
        for t in ids:
            t0 = time.time()
            prepare_mod.prepare_task(t, cache, args.seed)
            task = registry.load_task(t, cache, args.seed, prepare_if_missing=False)
            rows = sweep_task(pool, task, seed_corpus.list_scripts(t))
            lb = write_task_results(out, task, rows)
            all_pairs += measured_pairs(task, rows)
            checksums[t] = prepare_mod.file_checksums(registry.task_dir(cache, t, args.seed))
            bad = [f"{r['script']}:{r['status']}" for r in rows if r["status"] != "ok"]
            best = lb["score"].iloc[0] if len(lb) else float("nan")
            print(f"{t:26s} {len(lb):2d}/{len(rows)} valid, best final {best:.5f}, "
                  f"baseline dev {task.baseline_score:.5f}, {time.time() - t0:5.1f} s"
                  + (f"  failed: {bad}" if bad else ""), flush=True)
    all_pairs.sort(key=lambda p: (p["task_id"], p["weak"], p["strong"]))
    pairs_path.write_text(json.dumps(all_pairs, indent=1) + "\n")
    sums_path.write_text(json.dumps(dict(sorted(checksums.items())), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
