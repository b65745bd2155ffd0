"""Measurement: the RL loop of configs/local.py at bounded staleness k = 0 / 1 / 2, one raw line
per run in ``results/offpolicy_staleness/raw.jsonl`` (the table ``offpolicy_staleness`` of
docs/offpolicy.md is generated from it by ``python -m ace_jax.experiments.tables``).

  python benchmarks/bench_offpolicy_staleness.py [--ks 0,1,2] [--seeds 0]
      [--root runs/offpolicy_staleness] [--out results/offpolicy_staleness/raw.jsonl]
      [extra --config.* overrides, given to every run]

Each (k, seed) is one whole run of ``benchmarks/bench_local_run.py`` (a fresh work directory
``<root>/k<k>/seed<seed>``, the warm start included) with ``--config.rl.max_staleness=<k>
--config.seed=<seed>``; its JSON result becomes one line of ``--out``: ``k``, ``seed``,
``commit`` (short hash of HEAD) and ``dirty`` (uncommitted changes to tracked files), ``date``,
``cpus``, ``overrides`` (the extra arguments), and bench_local_run's ``steps`` (RL steps),
``minutes``, ``rl_steps_per_min`` (compile excluded), ``rl_steps_per_min_with_compile``,
``compile_s``, ``compiles_after_first_step``, ``valid_first5`` / ``valid_last5`` and
``score_first5`` / ``score_last5`` (first and last 5 RL steps; the fields' meaning is
bench_local_run's docstring). The file is rewritten after every run: a run of a (k, seed) already
in it replaces that line, the others stay, so an interrupted sweep resumes by re-running the
missing ones. Runs are timed: run them on an otherwise idle machine. Prints each line as it is
written.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import subprocess
import sys

from ace_jax.experiments import provenance

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = "results/offpolicy_staleness/raw.jsonl"
# What one line keeps of bench_local_run's result (the rest is in the run's work directory).
KEEP = ("steps", "minutes", "rl_steps_per_min", "rl_steps_per_min_with_compile", "compile_s",
        "compiles_after_first_step", "valid_first5", "valid_last5", "score_first5",
        "score_last5")


def commit() -> tuple[str, bool]:
    """(short hash of HEAD, whether tracked files outside results/ have uncommitted changes)."""
    return provenance.commit(REPO, short=True)


def record(k: int, seed: int, result: dict, *, overrides: list[str], head: str, dirty: bool,
           date: str | None = None) -> dict:
    """The raw line of one run from bench_local_run's JSON ``result``."""
    missing = [key for key in KEEP if key not in result]
    if missing:
        raise ValueError(f"bench_local_run's result lacks {missing} (no timed RL step?)")
    return {"k": int(k), "seed": int(seed), "commit": head, "dirty": bool(dirty),
            "date": date or datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "cpus": os.cpu_count(), "overrides": list(overrides),
            **{key: result[key] for key in KEEP}}


def merge(path: str | os.PathLike, line: dict) -> list[dict]:
    """Writes ``path`` with ``line`` in place of any line of the same (k, seed), sorted by
    (k, seed); returns the lines written."""
    path = pathlib.Path(path)
    old = ([json.loads(x) for x in path.read_text().splitlines() if x.strip()]
           if path.exists() else [])
    lines = sorted([r for r in old if (r["k"], r["seed"]) != (line["k"], line["seed"])] + [line],
                   key=lambda r: (r["k"], r["seed"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in lines))
    os.replace(tmp, path)
    return lines


def run_one(k: int, seed: int, workdir: pathlib.Path, overrides: list[str]) -> dict:
    """One whole run of bench_local_run.py; its JSON result (its last line of stdout)."""
    cmd = [sys.executable, str(REPO / "benchmarks/bench_local_run.py"), f"--workdir={workdir}",
           f"--config.rl.max_staleness={k}", f"--config.seed={seed}", "--no_progress",
           *overrides]
    print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True)
    sys.stderr.write(proc.stdout)
    if proc.returncode != 0:
        raise SystemExit(f"k={k} seed={seed}: bench_local_run.py failed (exit code "
                         f"{proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ks", default="0,1,2", help="staleness bounds (rl.max_staleness)")
    p.add_argument("--seeds", default="0", help="run seeds (config.seed)")
    p.add_argument("--root", default="runs/offpolicy_staleness", help="the runs' work directories")
    p.add_argument("--out", default=OUT, help="the raw lines (relative to the checkout)")
    args, overrides = p.parse_known_args(argv)
    out = REPO / args.out
    root = REPO / args.root
    for k in [int(x) for x in args.ks.split(",")]:
        for seed in [int(x) for x in args.seeds.split(",")]:
            head, dirty = commit()          # the code the run starts from
            result = run_one(k, seed, root / f"k{k}" / f"seed{seed}", overrides)
            line = record(k, seed, result, overrides=overrides, head=head, dirty=dirty)
            merge(out, line)
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
