"""Does the embedded default learn? Runs the main job on configs/local.py from scratch and reads
its metrics.

  python benchmarks/bench_local_run.py [--workdir runs/bench_local] [extra --config.* overrides]

It runs ``python launch/tpu_train.py --config=configs/local.py`` in a fresh work directory
(warm start included), times it, and compares the first 5 and the last 5 RL steps:
valid-submission rate (``rollout/valid_rate``) and mean normalised dev score
(``score/dev_norm_all``: each completion's dev score normalised to baseline = 0, gold = 1, with
failures counted as the baseline, so it rises with validity and with quality). It writes the
learning curves to ``<workdir>/curves.png``. Last line: one JSON object with ``steps``,
``minutes``, ``valid_first5``, ``valid_last5``, ``score_first5``, ``score_last5`` and more.

Speed of the RL loop (warm start excluded), from the per-step ``perf/step_seconds`` and
``perf/compile_seconds`` (XLA compile time inside the step, jax's own compile events):
``rl_steps_per_min`` (steps / minutes of RL steps, compiling excluded), ``compile_s`` (total
compile seconds inside RL steps, reported apart), ``rl_steps_per_min_with_compile`` and
``compiling_steps`` (steps that compiled for more than a second: a new prompt bucket) and
``compiles_after_first_step`` (how many of them came after the first RL step); the probe's
seconds (``probe_s``) are not RL steps and are left out of the speed. ``probe_*_warm`` /
``probe_*_final``: the probe (``ace_jax.train.probe``) of the warm start and of the last update.
Programs compiled by an earlier run come from XLA's persistent cache (``compile_cache_dir``), so
``compile_s`` is that of a first run only on a cold cache: add ``--config.compile_cache_dir=``
to measure one.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def loop_speed(rows: list[dict]) -> dict:
    """RL steps per minute with compile time apart, from the metrics rows that have timings;
    the probe's seconds inside a step (``perf/probe_seconds``) are reported apart too."""
    timed = [r for r in rows if "perf/step_seconds" in r]
    if not timed:
        return {}
    probe_s = sum(r.get("perf/probe_seconds", 0.0) for r in timed)
    step_s = sum(r["perf/step_seconds"] for r in timed) - probe_s
    compile_s = sum(r.get("perf/compile_seconds", 0.0) for r in timed)
    return {"rl_steps_per_min": round(60 * len(timed) / max(step_s - compile_s, 1e-9), 3),
            "rl_steps_per_min_with_compile": round(60 * len(timed) / max(step_s, 1e-9), 3),
            "compile_s": round(compile_s, 1), "probe_s": round(probe_s, 1),
            "compiling_steps": [r["step"] for r in timed
                                if r.get("perf/compile_seconds", 0.0) > 1.0],
            # the generator compiles once (the paged engine's fixed shapes); the learner once
            # per prompt-length bucket: 0 needs a warm compile cache or one bucket
            "compiles_after_first_step": sum(r.get("perf/compile_seconds", 0.0) > 1.0
                                             for r in timed[1:])}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workdir", default="runs/bench_local")
    p.add_argument("--keep", action="store_true", help="reuse an existing workdir (resume)")
    args, overrides = p.parse_known_args()
    workdir = pathlib.Path(args.workdir)
    if workdir.exists() and not args.keep:
        shutil.rmtree(workdir)
    cmd = [sys.executable, "launch/tpu_train.py", "--config=configs/local.py",
           f"--config.workdir={workdir}", *overrides]
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True)
    minutes = (time.perf_counter() - t0) / 60

    from ace_jax.train import metrics

    lines = metrics.read_metrics(str(workdir / "metrics.jsonl"))
    rows = [r for r in lines if "reward/mean" in r]     # RL steps (not the last probe's line)
    probes = [r for r in lines if "probe/updates" in r]
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    col = lambda key, rs: [r[key] for r in rs if key in r]  # noqa: E731
    first, last = rows[:5], rows[-5:]
    metrics.plot_curves(str(workdir / "metrics.jsonl"), str(workdir / "curves.png"),
                        keys=("rollout/valid_rate", "score/dev_norm_all", "reward/mean",
                              "grpo/zero_var_frac", "rollout/format_valid_rate",
                              "score/dev_norm_mean", "rollout/root_frac",
                              "rollout/valid_rate_root", "rollout/valid_rate_child"))
    result = {
        "steps": len(rows), "minutes": round(minutes, 2),
        "valid_first5": mean(col("rollout/valid_rate", first)),
        "valid_last5": mean(col("rollout/valid_rate", last)),
        "score_first5": mean(col("score/dev_norm_all", first)),
        "score_last5": mean(col("score/dev_norm_all", last)),
        "format_first5": mean(col("rollout/format_valid_rate", first)),
        "format_last5": mean(col("rollout/format_valid_rate", last)),
        "score_valid_only_first5": mean(col("score/dev_norm_mean", first)),
        "score_valid_only_last5": mean(col("score/dev_norm_mean", last)),
        # Where the batch came from: the aggregate moves with the share of child states
        # (step_metrics.root_child_metrics); valid rates on root / child states (steps that had any).
        "root_frac_first5": mean(col("rollout/root_frac", first)),
        "root_frac_last5": mean(col("rollout/root_frac", last)),
        "valid_root_first5": mean(col("rollout/valid_rate_root", first)),
        "valid_root_last5": mean(col("rollout/valid_rate_root", last)),
        "valid_child_first5": mean(col("rollout/valid_rate_child", first)),
        "valid_child_last5": mean(col("rollout/valid_rate_child", last)),
        "curves": str(workdir / "curves.png"),
        # the sampler-neutral probe (ace_jax.train.probe): the warm start and the last update
        **{f"probe_{name}_{when}": p.get(f"probe/{name}", float("nan"))
           for when, p in (("warm", probes[0] if probes else {}),
                           ("final", probes[-1] if probes else {}))
           for name in ("valid_rate", "score", "humanrank")},
        **loop_speed(rows),
    }
    result["learns"] = (result["valid_last5"] > result["valid_first5"]
                        and result["score_last5"] > result["score_first5"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
