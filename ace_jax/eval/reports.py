"""Reports of an evaluation: a terminal table, a markdown report, plots, the seed solutions.

Nothing here runs at import time; matplotlib is imported only where needed.
"""
from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Sequence, Union

from ace_jax.curriculum import seeds
from ace_jax.eval.episodes import Episode, episodes_to_seed_solutions
from ace_jax.eval.harness import EvaluationResult
from ace_jax.eval.scoring import BEST_AT_K, FLAG_METRICS, LEADERBOARD_METRICS, NOT_AVAILABLE, Stat

METRIC_LABELS = {
    "valid": "valid %", "above_median": ">median %", "any_medal": "medal %", "gold": "gold %",
    "silver": "silver %", "bronze": "bronze %", "human_rank": "HumanRank",
    "steps_to_first_valid": "steps->valid", "never_valid": "never valid %",
    "test_score": "test score"}
PERCENT_METRICS = FLAG_METRICS + ("never_valid",)


def _fmt(stat: Stat, metric: str) -> str:
    """mean±SE in the metric's display units; "n/a" for a leaderboard metric with no value (no
    reference leaderboard), "-" for any other metric with none."""
    if stat.mean is None:
        return NOT_AVAILABLE if metric in LEADERBOARD_METRICS else "-"
    scale, digits = (100.0, 0) if metric in PERCENT_METRICS else (1.0, 3)
    if metric == "steps_to_first_valid":
        digits = 1
    text = f"{stat.mean * scale:.{digits}f}"
    if stat.se is not None:
        text += f"±{stat.se * scale:.{digits}f}"
    return text


TABLE_METRICS = ("valid", "above_median", "any_medal", "gold", "silver", "bronze", "human_rank",
                 "steps_to_first_valid", "never_valid")


def _rows(result: EvaluationResult) -> tuple[list[str], list[list[str]]]:
    head = ["task", "n"] + [METRIC_LABELS[m] for m in TABLE_METRICS] + ["grader err"]
    rows = []
    for s in result.tasks + [result.overall]:
        rows.append([s.task_id, str(s.n_episodes)] + [_fmt(s.stats[m], m) for m in TABLE_METRICS]
                    + [str(s.grader_errors)])
    return head, rows


def format_table(result: EvaluationResult) -> str:
    """A fixed-width terminal table: one row per task and one "overall" row (mean±SE)."""
    head, rows = _rows(result)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    sep = "-" * len(line(head))
    out = [line(head), sep] + [line(r) for r in rows[:-1]] + [sep, line(rows[-1])]
    if result.notes:
        out += ["", "notes:"] + [f"  - {n}" for n in result.notes]
    return "\n".join(out)


def format_markdown(result: EvaluationResult, figures: Sequence[str] = ()) -> str:
    """The markdown report: set-up, the per-task table, definitions, notes, figures."""
    cfg = result.config
    head, rows = _rows(result)
    md = [f"# Evaluation of `{result.policy}`", "",
          f"- tasks: {', '.join(cfg['tasks'])}", f"- seeds: {cfg['seeds']}",
          f"- max steps: {cfg['max_steps']}; time budget per episode: "
          + (f"{cfg['time_budget_s']:g} s" if cfg['time_budget_s'] is not None else "none"),
          f"- advisor: {cfg['advisor'] or 'none'} (stagnation steps: {cfg['stagnation_steps']})",
          f"- episodes: {len(result.episodes)}; wall time {result.wall_s:.0f} s", "",
          "## Results (mean ± standard error over seeds)", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(r) + " |" for r in rows[:-1]]
    md += ["| **" + rows[-1][0] + "** | " + " | ".join(rows[-1][1:]) + " |", ""]
    k, stats = len(cfg["seeds"]), result.overall.stats
    md += [f"MLE-Ideator's Avg@{k} / Best@{k} of HumanRank ({k} seeds per task): "
           f"{_fmt(Stat(stats['human_rank'].mean, None, 0), 'human_rank')} / "
           f"{_fmt(stats[BEST_AT_K], 'human_rank')}", ""]
    md += ["## Definitions", "",
           "- The final submission of an episode is its step with the best dev score (earliest "
           "on ties), executed once on the hidden final-test split; all metrics use that score.",
           "- valid: the final submission is valid on final-test. Medals and >median: "
           "MLE-bench thresholds on the task's reference leaderboard (medals inclusive, median "
           "strict); invalid counts as no medal.",
           "- HumanRank = (N - p + 1) / N (MLE-Dojo), N leaderboard entries, p = 1 + number of "
           "entries strictly better than the score (ties take the best tied position); invalid "
           "= 0. The offline leaderboards are our baseline sweep, not human teams.",
           f"- {NOT_AVAILABLE}: not available, the task has no reference leaderboard; the overall "
           "medal and HumanRank figures average over the tasks that have one.",
           "- steps->valid: mean 1-indexed step of the first valid dev submission over the "
           "episodes that reached one; never valid: the fraction that never did.",
           "- Per task: mean over seeds, SE = sample sd / sqrt(n). Overall: per seed the mean "
           "over tasks, then mean and SE over seeds.",
           "- Avg@k / Best@k (MLE-Ideator, k = seeds per task): the mean over tasks of the mean / "
           "the best HumanRank of the task's k episodes (the paper prints them x 100).", ""]
    if result.notes:
        md += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    for f in figures:
        md += [f"![{pathlib.Path(f).stem}]({pathlib.Path(f).name})", ""]
    return "\n".join(md)


def plot_per_task(result: EvaluationResult, path: Union[str, os.PathLike]) -> pathlib.Path:
    """Bars per task (and overall) with SE error bars: rates on the left, HumanRank right."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    summaries = result.tasks + [result.overall]
    names = [s.task_id for s in summaries]
    x = np.arange(len(names))
    rates = ("valid", "above_median", "any_medal")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(names) + 4), 4.2))
    width = 0.8 / len(rates)
    for i, m in enumerate(rates):
        means = [s.stats[m].mean or 0.0 for s in summaries]
        errs = [s.stats[m].se or 0.0 for s in summaries]
        ax1.bar(x + (i - 1) * width, means, width, yerr=errs, capsize=3,
                label=METRIC_LABELS[m].replace(" %", ""))
    ax1.set_ylim(0, 1.05)
    ax1.set_ylabel("rate")
    ax1.legend(fontsize=8)
    ax2.bar(x, [s.stats["human_rank"].mean or 0.0 for s in summaries],
            yerr=[s.stats["human_rank"].se or 0.0 for s in summaries], capsize=3,
            color="tab:purple")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("HumanRank")
    for j, s in enumerate(summaries):  # no leaderboard: say so rather than draw a zero bar
        if s.stats["human_rank"].mean is None:
            ax2.text(x[j], 0.02, NOT_AVAILABLE, ha="center", fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    fig.suptitle(f"{result.policy}: mean ± SE over seeds")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_best_dev(episodes: Sequence[Episode], path: Union[str, os.PathLike]) -> pathlib.Path:
    """Best dev score so far per step, one panel per task, one line per seed (metric units)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    by_task: dict[str, list[Episode]] = {}
    for e in episodes:
        by_task.setdefault(e.task_id, []).append(e)
    n = max(1, len(by_task))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (task_id, eps) in zip(axes.ravel(), by_task.items()):
        for e in sorted(eps, key=lambda e: e.seed):
            pts = [(s.step, s.best_dev_so_far) for s in e.steps if s.best_dev_so_far is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"seed {e.seed}")
        direction = "lower" if eps[0].lower_is_better else "higher"
        ax.set_title(f"{task_id} ({eps[0].metric}, {direction} is better)", fontsize=9)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(0.5, max([e.max_steps for e in eps] + [len(e.steps) for e in eps] + [1]) + 0.5)
        ax.set_ylabel("best dev score so far")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no valid submission", ha="center", va="center",
                    transform=ax.transAxes)
    for ax in axes.ravel()[len(by_task):]:
        ax.axis("off")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_reports(result: EvaluationResult, out_dir: Union[str, os.PathLike]) -> dict[str, str]:
    """Writes results.json, report.md, per_task.png, best_dev.png and seed_solutions.jsonl.

    Returns {kind: path}.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"per_task_plot": plot_per_task(result, out / "per_task.png"),
             "best_dev_plot": plot_best_dev(result.episodes, out / "best_dev.png")}
    paths["json"] = out / "results.json"
    paths["json"].write_text(json.dumps(result.to_dict(), indent=1, default=str) + "\n")
    paths["markdown"] = out / "report.md"
    paths["markdown"].write_text(format_markdown(
        result, [paths["per_task_plot"], paths["best_dev_plot"]]))
    paths["seed_solutions"] = seeds.write_seed_solutions(
        episodes_to_seed_solutions(result.episodes), out / "seed_solutions.jsonl")
    return {k: str(v) for k, v in paths.items()}
