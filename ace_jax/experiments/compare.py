"""A comparison of settings ("arms") over whole-run seeds, with its raw data kept in the repo.

    python -m ace_jax.experiments.compare --name offpolicy_k1 --seeds 0,1,2,3,4 --steps 40 \
        --arm behaviour:grpo.proximal=behaviour --arm learner:grpo.proximal=learner

    <root>/warm<k>/          seed k's warm start: the config with seed=k, rl.num_steps=0
                             (``--warm_root``: another comparison's, shared when the same)
    <root>/<arm>/seed<k>/    one RL run per (arm, seed) from warm<k> (model.init_from_run), seed=k
    results/<name>/metrics.csv.gz   every run's per-step metrics (``KEEP`` keys): arm, seed, step, ...
    results/<name>/runs.json        the command, commit, config and each run's config fingerprint

``seed`` drives the whole run (``train.config.resolve_seeds``): SFT order and examples, initial
weights, generation, sampler and the probe. The arms of one seed share its warm start, so a
difference between arms is paired by seed. Each run is ``ablation.run_job``: running the command
again reuses finished runs (keyed on their resolved config) and resumes an interrupted one, so a
comparison too long for one sitting is finished by running it again; ``--export_only`` writes the
raw data of the runs finished so far (``complete`` in runs.json says whether all are). One too
long for one machine runs a few seeds at a time: an export keeps the runs an earlier export of
the same settings wrote (``earlier_runs``), so ``--seeds`` names only the seeds still to run.

Tables and figures are made from the raw data alone: ``python -m ace_jax.experiments.tables``,
with the paired statistics here: ``paired_t_p`` (the t-test behind a 95% t-interval),
``sign_flip_p`` (the exact paired sign-flip test, which assumes no normality) and ``holm`` (the
family-wise correction of an experiment's several comparisons).
A confirmatory comparison's ``results/<name>/plan.md`` is committed before its data.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import os
import sys
from typing import Any, Mapping, Sequence

import numpy as np

from ace_jax.experiments import ablation, provenance
from ace_jax.train import metrics as metrics_lib

# The per-step metrics kept in the raw data (those present in a line; empty cells otherwise).
KEEP = ("probe/updates", "probe/valid_rate", "probe/score", "probe/humanrank",
        "probe/valid_rate_train", "probe/score_train", "probe/humanrank_train",
        "probe/valid_rate_heldout", "probe/score_heldout", "probe/humanrank_heldout",
        "probe/heldout_valid_rate", "probe/heldout_score",
        "probe/heldout_instances_valid_rate", "probe/heldout_instances_score",
        "probe/heldout_family_valid_rate", "probe/heldout_family_score",
        "rollout/valid_rate", "score/dev_norm_all", "reward/mean", "grpo/zero_var_frac",
        "rollout/root_frac", "rollout/completion_tokens_mean", "rollout/generated_tokens",
        "rollout/refill_rounds",
        "offpolicy/clip_frac", "offpolicy/behaviour_weight_mean",
        "offpolicy/behaviour_weight_max", "offpolicy/masked_frac", "offpolicy/mismatch_k3",
        "offpolicy/staleness", "grpo/clip_frac_low", "grpo/clip_frac_high", "grpo/entropy",
        "perf/step_seconds", "perf/compile_seconds", "perf/probe_seconds")
COLUMNS = ("arm", "seed", "step", *KEEP)


def parse_arm(spec: str) -> tuple[str, dict[str, str]]:
    """``name:key=value,key=value`` -> (name, overrides); ``name:`` = the config as is."""
    name, _, rest = spec.partition(":")
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"--arm {spec!r}: expected name:key=value[,key=value]")
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"--arm {spec!r}: {item!r} is not key=value")
        overrides[key.strip()] = value.strip()
    return name, overrides


def run(root: str, arms: Mapping[str, Mapping[str, Any]], seeds: Sequence[int], steps: int, *,
        overrides: Mapping[str, Any] = (), config: str = "configs/local.py",
        warm_root: str = "", progress: bool = True) -> dict[str, dict[int, ablation.RunResult]]:
    """Per seed (in order): its warm start (in ``warm_root``, default ``root``), then every arm
    from it. An arm's overrides win over the runner's: ``rl.num_steps=0,model.init_from_run=``
    with more ``sft.steps`` makes an arm a warm start of its own (an SFT control). Returns
    arm -> seed -> result (a seed whose warm start failed has no runs)."""
    out: dict[str, dict[int, ablation.RunResult]] = {a: {} for a in arms}
    for seed in seeds:
        base = {**dict(overrides), "seed": seed}
        warm = ablation.run_jobs([(f"warm{seed}", os.path.join(warm_root or root, f"warm{seed}"),
                                   {**base, "rl.num_steps": 0})], desc=f"seed {seed} warm start",
                                 progress=progress, config=config)[0]
        if warm.error:
            print(f"FAILED warm start of seed {seed}: {warm.error}", file=sys.stderr)
            continue
        jobs = [(f"{a}/seed{seed}", os.path.join(root, a, f"seed{seed}"),
                 {**base, "rl.num_steps": steps, "model.init_from_run": warm.workdir,
                  **dict(o)}) for a, o in arms.items()]
        for (a, _), res in zip(arms.items(), ablation.run_jobs(
                jobs, desc=f"seed {seed}", progress=progress, config=config)):
            if res.error:
                print(f"FAILED {res.workdir}: {res.error}", file=sys.stderr)
            out[a][seed] = res
    return out


def rows_of(path: str, arm: str, seed: int) -> list[dict[str, Any]]:
    """The ``COLUMNS`` rows of one run's metrics file (one per metrics line, in step order)."""
    rows = []
    for rec in sorted(metrics_lib.read_metrics(path), key=lambda r: r["step"]):
        rows.append({"arm": arm, "seed": seed, "step": int(rec["step"]),
                     **{k: rec[k] for k in KEEP if k in rec}})
    return rows


def write_csv(rows: Sequence[Mapping[str, Any]], path: str) -> None:
    """``rows`` as a gzipped CSV of ``COLUMNS`` (floats with repr precision; absent = empty),
    written byte-for-byte the same for the same rows (no gzip timestamp or file name)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({c: (repr(float(r[c])) if c in KEEP and r.get(c) is not None else r.get(c, ""))
                    for c in COLUMNS})
    with open(path, "wb") as f, gzip.GzipFile(filename="", fileobj=f, mode="wb", mtime=0) as z:
        z.write(buf.getvalue().encode())


def read_csv(path: str) -> list[dict[str, Any]]:
    """The rows of a ``write_csv`` file: arm (str), seed and step (int), metrics (float; a key
    absent from a row is left out of it)."""
    with gzip.open(path, "rt") as f:
        out = []
        for r in csv.DictReader(f):
            row: dict[str, Any] = {"arm": r["arm"], "seed": int(r["seed"]),
                                   "step": int(r["step"])}
            row.update({k: float(v) for k, v in r.items() if k in KEEP and v != ""})
            out.append(row)
    return out


# ------------------------------------------------------------------------ paired statistics

SIGN_FLIP_MAX_SEEDS = 20   # 2^20 sign assignments enumerated exactly


def paired_t_p(diffs: Sequence[float]) -> float:
    """The two-sided p of the one-sample Student-t test of mean 0 on paired differences (the
    test behind ``ablation.mean_interval``'s interval); nan with fewer than 2 values or none
    spread (every difference equal)."""
    from scipy import stats

    v = np.asarray(diffs, dtype=np.float64)
    if v.size < 2 or not v.std(ddof=1) > 0:
        return float("nan")
    t = v.mean() / (v.std(ddof=1) / np.sqrt(v.size))
    return float(2 * stats.t.sf(abs(t), v.size - 1))


def sign_flip_p(diffs: Sequence[float]) -> float:
    """The exact two-sided paired sign-flip (permutation) test of mean 0: under the null each
    seed's difference is as likely with either sign, so p is the share of the 2^n sign
    assignments whose |sum| reaches the observed |sum| (a relative 1e-9 tolerance keeps
    assignments tied in exact arithmetic tied). With n seeds it is never below 2 / 2^n
    (0.0625 at 5). nan with no values; ValueError above ``SIGN_FLIP_MAX_SEEDS``."""
    v = np.asarray(diffs, dtype=np.float64)
    if not v.size:
        return float("nan")
    if v.size > SIGN_FLIP_MAX_SEEDS:
        raise ValueError(f"sign_flip_p enumerates 2^n assignments: n = {v.size} > "
                         f"{SIGN_FLIP_MAX_SEEDS}")
    signs = 1 - 2 * ((np.arange(2 ** v.size)[:, None] >> np.arange(v.size)) & 1)
    sums = np.abs(signs @ v)
    observed = abs(v.sum())
    return float(np.mean(sums >= observed - 1e-9 * max(observed, np.abs(v).sum()) - 1e-15))


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values of one family (family-wise error rate): the i-th
    smallest of m gets max over j <= i of min(1, (m - j + 1) p_(j)); a nan p (no test) is
    left nan and not counted in m."""
    p = np.asarray(pvalues, dtype=np.float64)
    out = np.full(p.shape, np.nan)
    idx = [i for i in np.argsort(p, kind="stable") if np.isfinite(p[i])]
    running = 0.0
    for rank, i in enumerate(idx):
        running = max(running, min(1.0, (len(idx) - rank) * p[i]))
        out[i] = running
    return [float(x) for x in out]


WARM = "warm"   # the arm name of the warm starts in the raw data (with ``export(warm_root=)``)


def earlier_runs(out_dir: str, settings: Mapping[str, Any]
                 ) -> tuple[list[int], dict[tuple[str, int], tuple[dict, list[dict[str, Any]]]]]:
    """What an earlier export wrote to ``out_dir`` when it had the same config, overrides and
    arms as ``settings``: (its seeds, the planned ones; its runs, each its runs.json entry and
    its rows, keyed on (arm, seed)); ([], {}) when there is none or the settings differ. A
    comparison too long for one machine is run a few seeds at a time (``--seeds`` of those
    left) and each export keeps the others."""
    info_path = os.path.join(out_dir, "runs.json")
    csv_path = os.path.join(out_dir, "metrics.csv.gz")
    if not (os.path.exists(info_path) and os.path.exists(csv_path)):
        return [], {}
    with open(info_path) as f:
        info = json.load(f)
    if any(info.get(k) != v for k, v in settings.items()):
        print(f"{out_dir}: the earlier export's settings differ; its runs are not kept",
              file=sys.stderr)
        return [], {}
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in read_csv(csv_path):
        rows.setdefault((r["arm"], r["seed"]), []).append(r)
    return list(info.get("seeds", [])), {(e["arm"], e["seed"]): (
        e, rows.get((e["arm"], e["seed"]), [])) for e in info.get("runs", [])}


def export(out_dir: str, root: str, arms: Mapping[str, Mapping[str, Any]], seeds: Sequence[int],
           *, command: str, config: str, overrides: Mapping[str, Any] = (),
           warm_root: str | None = None) -> dict:
    """Writes ``metrics.csv.gz`` and ``runs.json`` of the finished runs under ``root`` to
    ``out_dir``; returns the runs.json content. With ``warm_root`` the warm starts are
    exported too, as arm ``WARM`` (their probe is the one of every arm's first parameters).
    A run with no folder under ``root`` that an earlier export to ``out_dir`` holds (same
    settings, ``earlier_runs``) is kept as that export wrote it, and that export's seeds (the
    planned ones, finished or not) stay in ``seeds``.
    A run's entry in runs.json names the commits it ran on (``ablation.run_job``'s marker;
    absent for runs made before markers recorded them)."""
    os.makedirs(out_dir, exist_ok=True)
    settings = {"config": config, "overrides": {k: str(v) for k, v in dict(overrides).items()},
                "arms": {a: {k: str(v) for k, v in o.items()} for a, o in arms.items()}}
    earlier_seeds, earlier = earlier_runs(out_dir, settings)
    seeds = sorted(set(seeds) | set(earlier_seeds))
    rows, runs = [], []
    dirs = [(arm, seed, os.path.join(root, arm, f"seed{seed}")) for arm in arms for seed in seeds]
    if warm_root is not None:
        dirs = [(WARM, seed, os.path.join(warm_root, f"warm{seed}")) for seed in seeds] + dirs
    for arm, seed, workdir in dirs:
        marker = os.path.join(workdir, ablation.DONE_MARKER)
        if not os.path.exists(marker):
            if (arm, seed) in earlier:          # exported before, its folder is elsewhere
                entry, kept = earlier[arm, seed]
                rows += kept
                runs.append(entry)
            continue
        with open(marker) as f:
            job = json.load(f)
        rows += rows_of(os.path.join(workdir, "metrics.jsonl"), arm, seed)
        runs.append({"arm": arm, "seed": seed, "fingerprint": job["fingerprint"],
                     **({"commits": job["commits"]} if "commits" in job else {})})
    write_csv(rows, os.path.join(out_dir, "metrics.csv.gz"))
    info = {"command": command, "commit": provenance.commit(ablation.REPO)[0], **settings,
            "seeds": list(seeds), "runs": runs,
            "complete": sum(r["arm"] != WARM for r in runs) == len(arms) * len(seeds)}
    with open(os.path.join(out_dir, "runs.json"), "w") as f:
        json.dump(info, f, indent=1)
        f.write("\n")
    return info


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--name", required=True, help="the experiment: results/<name>/")
    p.add_argument("--root", default="", help="run folders (default runs/<name>)")
    p.add_argument("--arm", action="append", required=True,
                   help="name:key=value[,key=value] (repeat for each arm)")
    p.add_argument("--warm_root", default="",
                   help="where the warm starts are (default --root): another comparison's "
                        "root shares its warm starts (reused when their configs are the same)")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--config", default="configs/local.py")
    p.add_argument("--results", default="results", help="where results/<name>/ goes")
    p.add_argument("--export_warm", action="store_true",
                   help="export the warm starts' metrics too (arm 'warm': their probe is the "
                        "arms' first, for arms run with probe.at_start=False)")
    p.add_argument("--export_only", action="store_true",
                   help="write the raw data of the finished runs, start none")
    args, extra = p.parse_known_args(argv)
    overrides = {}
    for item in extra:
        if not item.startswith("--config.") or "=" not in item:
            p.error(f"unrecognised argument {item!r} (overrides are --config.key=value)")
        key, value = item[len("--config."):].split("=", 1)
        overrides[key] = value
    try:
        arms = dict(parse_arm(a) for a in args.arm)
    except ValueError as e:
        p.error(str(e))
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    root = args.root or os.path.join("runs", args.name)
    failed = False
    if not args.export_only:
        results = run(root, arms, seeds, args.steps, overrides=overrides, config=args.config,
                      warm_root=args.warm_root)
        failed = any(r.error for per in results.values() for r in per.values())
    command = "python -m ace_jax.experiments.compare " + " ".join(
        sys.argv[1:] if argv is None else argv)
    info = export(os.path.join(args.results, args.name), root, arms, seeds, command=command,
                  config=args.config, overrides={**overrides, "rl.num_steps": args.steps},
                  warm_root=(args.warm_root or root) if args.export_warm else None)
    done = sum(r["arm"] != WARM for r in info["runs"])
    print(f"{done} of {len(arms) * len(info['seeds'])} runs in "
          f"{os.path.join(args.results, args.name)} (complete: {info['complete']})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
