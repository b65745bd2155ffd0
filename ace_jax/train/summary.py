"""What a training run prints when it ends (``python -m ace_jax``): the run's name, steps,
minutes and generated tokens, first vs last valid rate and probe, and where its metrics,
checkpoints and TensorBoard logs are. Built from ``Trainer.run``'s summary and the metrics file."""
from __future__ import annotations

import os
from typing import Any, Sequence

import numpy as np

from ace_jax.train.metrics import read_metrics


def run_curves(path: str | None, window: int = 5) -> dict[str, Any]:
    """What a run's end summary says of its metrics file (``path``; {} when None or missing):
    the mean ``rollout/valid_rate`` of the first and of the last ``window`` steps (fewer when
    the run is short) and the first and last probes (``probe/score``, ``probe/valid_rate``)."""
    if not path or not os.path.exists(path):
        return {}
    records = read_metrics(path)
    steps = [r for r in records if "rollout/valid_rate" in r]
    probes = [r for r in records if "probe/updates" in r]
    out: dict[str, Any] = {"steps": len(steps)}
    if steps:
        w = max(1, min(window, len(steps) // 2))
        out.update(window=w, valid_first=float(np.mean([r["rollout/valid_rate"] for r in steps[:w]])),
                   valid_last=float(np.mean([r["rollout/valid_rate"] for r in steps[-w:]])))
    if probes:
        out["probes"] = [{k: probes[i].get(f"probe/{k}") for k in ("updates", "score", "valid_rate")}
                         for i in sorted({0, len(probes) - 1})]
    return out


def task_caveats(tasks: Sequence[Any]) -> list[str]:
    """What a run's tasks lack, one line each: a reference leaderboard that is a Git LFS pointer
    (no medals, HumanRank or headroom term) and a grader that is our fallback, not MLE-bench's."""
    out = []
    for t in tasks:
        if getattr(t, "leaderboard_error", ""):
            out.append(f"{t.task_id}: {t.leaderboard_error}")
        if str(getattr(t, "grader_source", "")).startswith("ours:"):
            out.append(f"{t.task_id}: graded by our fallback metric {t.grader_source[5:]!r}, not "
                       f"MLE-bench's grader {getattr(t, 'grader_name', '')!r} "
                       "(install MLE-bench: scripts/install_mlebench.sh)")
    return out


def format_run_summary(summary: dict[str, Any], tasks: Sequence[Any] = ()) -> str:
    """The lines a training run ends with (``Trainer.run``'s summary): steps and minutes, first vs
    last valid rate and probe, where the metrics, checkpoints and TensorBoard logs are, and what
    the run's ``tasks`` lack (``task_caveats``)."""
    c = summary.get("curves") or {}
    name = f"{summary['name']}: " if summary.get("name") else ""
    lines = [f"done: {name}{summary['steps']} RL steps in {summary['minutes']:.1f} min, "
             f"{summary.get('generated_tokens', 0):,} completion tokens generated"]
    if "valid_first" in c:
        lines.append(f"  valid rate      {c['valid_first']:.2f} (first {c['window']} steps) -> "
                     f"{c['valid_last']:.2f} (last {c['window']}); the states sampled change, "
                     "the probe does not")
    probes = c.get("probes") or []
    if probes:
        first, last = probes[0], probes[-1]
        lines.append(f"  probe           score {first['score']:.3f} -> {last['score']:.3f}, "
                     f"valid rate {first['valid_rate']:.2f} -> {last['valid_rate']:.2f} "
                     f"(after {first['updates']:.0f} -> {last['updates']:.0f} updates)")
    lines += [f"  metrics         {summary['metrics']}",
              f"  checkpoints     {summary['checkpoints']}",
              f"  tensorboard     tensorboard --logdir {summary['tensorboard']}"]
    lines += [f"  warning         {c}" for c in task_caveats(tasks)]
    return "\n".join(lines)
