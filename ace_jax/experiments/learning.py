"""Does the embedded default learn? ``configs/local.py`` over several seeds of the whole run
(each seed its own warm start), with the gain of each curve and its interval over seeds.

    python -m ace_jax.experiments.learning --root runs/learning --seeds 0,1,2,3,4 --steps 40

    root/seed<k>/      one run of configs/local.py with seed=k, lp.seed=k, rl.num_steps=<steps>
    root/curves.png    the mean curves over seeds with 95% bands
    root/gains.md      the table printed last

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


def run_seeds(root: str, seeds: Sequence[int], steps: int,
              overrides: Mapping[str, Any] = (), progress: bool = True, **kwargs
              ) -> list[ablation.RunResult]:
    """One whole run of the config per seed (warm start included), in seed order."""
    overrides = dict(overrides)
    return ablation.run_jobs(
        [(f"seed{seed}", os.path.join(root, f"seed{seed}"),
          {**overrides, "seed": seed, "lp.seed": seed, "rl.num_steps": steps})
         for seed in seeds], desc="seeds", progress=progress, **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--root", default="runs/learning")
    p.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=40, help="RL steps per run")
    p.add_argument("--window", type=int, default=10, help="steps averaged at each end")
    p.add_argument("--config", default="configs/local.py")
    args, extra = p.parse_known_args(argv)
    overrides = {}
    for item in extra:  # --config.a.b=value, as on the main job's command line
        if not item.startswith("--config.") or "=" not in item:
            p.error(f"unrecognised argument {item!r} (overrides are --config.key=value)")
        key, value = item[len("--config."):].split("=", 1)
        overrides[key] = value
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    results = run_seeds(args.root, seeds, args.steps, overrides, config=args.config)
    for r in results:
        if r.error:
            print(f"FAILED {r.workdir}: {r.error}", file=sys.stderr)
    paths = {"default": [r.metrics_path for r in results
                         if r.error is None and os.path.exists(r.metrics_path)]}
    table = ablation.format_gain_table(ablation.gain_table(paths, KEYS, window=args.window),
                                       window=args.window)
    with open(os.path.join(args.root, "gains.md"), "w") as f:
        f.write(table + "\n")
    ablation.plot_curves(paths, KEYS, os.path.join(args.root, "curves.png"))
    print(table)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
