"""Does the embedded default learn? ``configs/local.py`` over several seeds of the whole run
(each seed its own warm start), with the gain of each curve and its interval over seeds.

    python -m ace_jax.experiments.learning --root runs/learning --seeds 0,1,2,3,4 --steps 40

    root/seed<k>/      one run of configs/local.py with seed=k (init, SFT, generation, sampler,
                       probe), rl.num_steps=<steps>
    root/curves.png    the mean curves over seeds with 95% bands
    root/gains.md      the table printed last

With ``--eval_tasks``, each seed's policy is also evaluated before and after RL in the agent
scaffold (episodes of ``--eval_steps`` steps on those tasks, one per ``--eval_seeds`` seed):
"before" is ``root/warm<k>``, the same config and seed stopped after its warm start
(``rl.num_steps=0``; the warm start is deterministic for a seed), "after" is ``root/seed<k>``.

    root/eval/         the episode logs and reports
    root/eval.md       valid rate, HumanRank, steps to first valid, never valid: before / after
                       with 95% intervals over seeds, and the paired after - before difference

Each run is ``ablation.run_job`` (the command a user would type), so re-running the command
reuses finished seeds and resumes an interrupted one from its last checkpoint: a sweep too long
for one sitting is finished by running it again. The gain of a curve is the mean of its last
``--window`` steps minus the mean of its first; the table gives its mean over seeds and the
95% Student-t interval (``ablation.gain_table``). A claim that the default learns needs that
interval to exclude zero.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Mapping, Sequence

from ace_jax.experiments import ablation

KEYS = ("rollout/valid_rate", "score/dev_norm_all", "grpo/zero_var_frac")
# Where the batch came from and how the policy did there: the aggregate valid rate moves with the
# root / child mix, these separate a better policy from a harder batch (a child curve starts at
# the first step with a child in the batch).
MIX_KEYS = ("rollout/root_frac", "rollout/valid_rate_root", "rollout/valid_rate_child")


def _per_seed(prefix: str, root: str, seeds: Sequence[int], steps: int,
              overrides: Mapping[str, Any], desc: str, **kwargs) -> list[ablation.RunResult]:
    """``root/<prefix><seed>``: one job of the config per seed (``seed``, which drives the whole
    run, and ``rl.num_steps = steps``), in seed order."""
    return ablation.run_jobs(
        [(f"{prefix}{seed}", os.path.join(root, f"{prefix}{seed}"),
          {**dict(overrides), "seed": seed, "rl.num_steps": steps})
         for seed in seeds], desc=desc, **kwargs)


def run_seeds(root: str, seeds: Sequence[int], steps: int,
              overrides: Mapping[str, Any] = (), progress: bool = True, **kwargs
              ) -> list[ablation.RunResult]:
    """One whole run of the config per seed (warm start included), in seed order."""
    return _per_seed("seed", root, seeds, steps, overrides, "seeds", progress=progress, **kwargs)


def warm_runs(root: str, seeds: Sequence[int], overrides: Mapping[str, Any] = (),
              progress: bool = True, **kwargs) -> list[ablation.RunResult]:
    """Per seed, the run's warm start alone (the same config and seed, ``rl.num_steps=0``)."""
    return _per_seed("warm", root, seeds, 0, overrides, "warm starts", progress=progress,
                     **kwargs)


def evaluate_before_after(root: str, results: Sequence[ablation.RunResult],
                          warms: Sequence[ablation.RunResult], task_ids: Sequence[str], *,
                          episode_seeds: Sequence[int], max_steps: int,
                          progress: bool = True) -> str:
    """Evaluates each seed's warm start and trained policy; writes and returns ``eval.md``.
    Seeds whose run or warm start failed are left out of both sides."""
    pairs = [(w, r) for w, r in zip(warms, results) if w.error is None and r.error is None]
    rows = ablation.evaluate_runs(
        {"before": [w.workdir for w, _ in pairs], "after": [r.workdir for _, r in pairs]},
        task_ids, os.path.join(root, "eval"), seeds=episode_seeds, max_steps=max_steps,
        progress=progress)
    text = (f"Episodes of {max_steps} steps on {', '.join(task_ids)}; episode seeds "
            f"{', '.join(map(str, episode_seeds))}; mean [95% CI] over {len(pairs)} seeds.\n\n"
            + ablation.format_eval_table(rows) + "\n\n"
            + ablation.format_differences(ablation.paired_differences(rows[0], rows[1])))
    with open(os.path.join(root, "eval.md"), "w") as f:
        f.write(text + "\n")
    return text


def _report_failures(results: Sequence[ablation.RunResult]) -> Sequence[ablation.RunResult]:
    for r in results:
        if r.error:
            print(f"FAILED {r.workdir}: {r.error}", file=sys.stderr)
    return results


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", default="runs/learning")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=40, help="RL steps per run")
    p.add_argument("--window", type=int, default=10, help="steps averaged at each end")
    p.add_argument("--config", default="configs/local.py")
    p.add_argument("--eval_tasks", default="",
                   help="comma-separated task ids: also evaluate each seed before / after RL")
    p.add_argument("--eval_steps", type=int, default=8, help="steps per evaluation episode")
    p.add_argument("--eval_seeds", default="0", help="comma-separated episode seeds per task")
    args, extra = p.parse_known_args(argv)
    overrides = {}
    for item in extra:  # --config.a.b=value, as on the main job's command line
        if not item.startswith("--config.") or "=" not in item:
            p.error(f"unrecognised argument {item!r} (overrides are --config.key=value)")
        key, value = item[len("--config."):].split("=", 1)
        overrides[key] = value
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    results = _report_failures(run_seeds(args.root, seeds, args.steps, overrides,
                                         config=args.config))
    paths = {"default": [r.metrics_path for r in results
                         if r.error is None and os.path.exists(r.metrics_path)]}
    table = ablation.format_gain_table(
        ablation.gain_table(paths, KEYS + MIX_KEYS, window=args.window), window=args.window)
    with open(os.path.join(args.root, "gains.md"), "w") as f:
        f.write(table + "\n")
    ablation.plot_curves(paths, KEYS + MIX_KEYS[:2], os.path.join(args.root, "curves.png"))
    print(table)
    failed = any(r.error for r in results)
    if args.eval_tasks:
        warms = _report_failures(warm_runs(args.root, seeds, overrides, config=args.config))
        failed = failed or any(w.error for w in warms)
        print(evaluate_before_after(
            args.root, results, warms, [t for t in args.eval_tasks.split(",") if t.strip()],
            episode_seeds=[int(s) for s in args.eval_seeds.split(",") if s.strip()],
            max_steps=args.eval_steps))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
