"""Sampler ablations at laptop scale: one shared warm start, then one AceGRPO run per
(sampler, seed), each the same command-line job as the main run (``python -m ace_jax``).

    root/
      warm/                 the warm-start-only run (rl.num_steps=0): tokenizer + checkpoint 0
      <sampler>/seed<k>/    one RL run, started from warm/ (model.init_from_run), same budget

Every run is a subprocess of ``python -m ace_jax`` with ``--config.*`` overrides, so what the
notebook runs is exactly what a user would type, runs are resumable (re-running a finished
run returns at once) and a crash of one run is reported without losing the others.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ace_jax.experiments import provenance
from ace_jax.train import metrics as metrics_lib

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SAMPLERS = ("lp", "uniform", "lp_no_cooling", "variance_only", "headroom_only")
CURVES = ("rollout/valid_rate", "score/dev_norm_all", "grpo/zero_var_frac")
EVAL_DONE = "evaluated.json"  # in a run's report folder: the job and its overall metrics
EVAL_METRICS = ("valid", "human_rank", "steps_to_first_valid", "never_valid")
DONE_MARKER = "ablation_job.json"  # written into a run directory when its job exits cleanly


class AblationError(RuntimeError):
    """A run of the ablation failed (names the run and the tail of its log)."""


@dataclasses.dataclass
class RunResult:
    """One finished (or failed) run: its directory, wall time (s) and error (None if ok)."""
    workdir: str
    seconds: float
    error: Optional[str] = None
    reused: bool = False           # finished by an earlier call with the same settings

    @property
    def metrics_path(self) -> str:
        return os.path.join(self.workdir, "metrics.jsonl")


def _override_args(overrides: Mapping[str, Any]) -> list[str]:
    args = []
    for key, value in overrides.items():
        if isinstance(value, (tuple, list)):
            value = "(" + ",".join(repr(v) for v in value) + ("," if len(value) == 1 else "") + ")"
        args.append(f"--config.{key}={value}")
    return args


def job_command(workdir: str, overrides: Mapping[str, Any], config: str) -> list[str]:
    """The main job's command line for ``workdir``, ``config`` and ``overrides``."""
    return [sys.executable, "-m", "ace_jax", f"--config={config}",
            f"--config.workdir={workdir}", "--no_progress", *_override_args(overrides)]


def config_fingerprint(workdir: str, overrides: Mapping[str, Any], config: str,
                       env: Optional[Mapping[str, str]] = None) -> str:
    """The fingerprint of the run config the job would use (``train.config.fingerprint``, from
    ``python -m ace_jax --print_config``: the config file's contents and the overrides as the
    launcher parses them). Raises AblationError when the command line is refused."""
    proc = subprocess.run([*job_command(workdir, overrides, config), "--print_config"], cwd=REPO,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        raise AblationError(f"the config of {workdir} cannot be resolved (exit code "
                            f"{proc.returncode}):\n{proc.stderr[-1500:]}")
    return lines[-1]


def run_job(workdir: str, overrides: Mapping[str, Any], *, config: str = "configs/local.py",
            timeout_s: Optional[float] = None, env: Optional[Mapping[str, str]] = None
            ) -> RunResult:
    """Runs ``python -m ace_jax --config=<config> --config.workdir=<workdir> <overrides>``.

    Returns a RunResult; a non-zero exit or a timeout sets ``error`` to the log tail (the full
    log is ``<workdir>.log``) instead of raising, so one failed run does not stop an ablation.
    A run that already finished with the same resolved config (its fingerprint: the config
    file's contents, not its path, and the overrides) is not started again (``reused``); its
    marker (``DONE_MARKER``) records in ``commits`` the commit of every start that ran it (a
    resumed run may span several) and whether tracked files differed from it
    (``provenance.commit``; each start appends its line to ``<workdir>.commits``). An
    unfinished one resumes from its last checkpoint, and so does a finished one whose config
    changed (more ``rl.num_steps`` extends it; for a change that makes its checkpoints another
    experiment's, use another workdir).
    """
    os.makedirs(os.path.dirname(os.path.abspath(workdir)), exist_ok=True)
    marker = os.path.join(workdir, DONE_MARKER)
    try:
        job = {"config": config,
               "fingerprint": config_fingerprint(workdir, overrides, config, env),
               "overrides": {k: repr(v) for k, v in overrides.items()}}
    except AblationError as e:   # a refused command line (a misspelt key): reported
        return RunResult(workdir, 0.0, str(e))
    if os.path.exists(marker):
        with open(marker) as f:
            done = json.load(f)
        if done.get("fingerprint") == job["fingerprint"]:   # finished with this config
            return RunResult(workdir, 0.0, reused=True)
        os.remove(marker)      # another config: the job runs (resuming the run's checkpoints)
    cmd = job_command(workdir, overrides, config)
    log_path = workdir.rstrip("/") + ".log"
    head, dirty = provenance.commit(REPO)
    with open(workdir.rstrip("/") + ".commits", "a") as f:   # the code of each start
        f.write(json.dumps({"commit": head, "dirty": dirty}) + "\n")
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                  timeout=timeout_s, env={**os.environ, **(env or {})})
            rc: Optional[int] = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
    seconds = time.perf_counter() - t0
    if rc == 0:
        os.makedirs(workdir, exist_ok=True)
        with open(workdir.rstrip("/") + ".commits") as f:
            job["commits"] = list({json.dumps(json.loads(line), sort_keys=True): json.loads(line)
                                   for line in f if line.strip()}.values())
        with open(marker, "w") as f:
            json.dump(job, f)
        return RunResult(workdir, seconds)
    with open(log_path) as f:
        tail = f.read()[-1500:]
    why = "timed out" if rc is None else f"exit code {rc}"
    return RunResult(workdir, seconds, f"{why}; log {log_path}:\n{tail}")


def warm_start(root: str, overrides: Mapping[str, Any], **kwargs) -> RunResult:
    """The shared warm start: the config's SFT stage and no RL step (``rl.num_steps=0``)."""
    res = run_job(os.path.join(root, "warm"), {**overrides, "rl.num_steps": 0}, **kwargs)
    if res.error:
        raise AblationError(f"the warm start failed: {res.error}")
    return res


def run_ablation(root: str, overrides: Mapping[str, Any], *,
                 samplers: Sequence[str] = SAMPLERS, seeds: Sequence[int] = (0, 1, 2),
                 progress: bool = True, **kwargs) -> dict[str, list[RunResult]]:
    """Warm start once, then one RL run per (sampler, seed) from it, all with ``overrides``.

    The seed sets ``seed`` (generation, the sampler and the probe; the SFT order is the shared
    warm start's); everything else,
    including the initial weights and the step budget, is shared. Returns sampler -> results.
    """
    warm = warm_start(root, overrides, **kwargs)
    jobs = [(s, k) for k in seeds for s in samplers]  # seed-major: every sampler gets seed 0 first
    results = run_jobs([(f"{sampler}/seed{seed}", os.path.join(root, sampler, f"seed{seed}"),
                         {**overrides, "model.init_from_run": warm.workdir,
                          "lp.sampler": sampler, "seed": seed})
                        for sampler, seed in jobs], desc="ablation runs", progress=progress,
                       **kwargs)
    out: dict[str, list[RunResult]] = {s: [] for s in samplers}
    for (sampler, _), res in zip(jobs, results):
        out[sampler].append(res)
    return out


def run_jobs(jobs: Sequence[tuple[str, str, Mapping[str, Any]]], *, desc: str,
             progress: bool = True, **kwargs) -> list[RunResult]:
    """``run_job`` for each (label, workdir, overrides) in order, with a progress bar that
    names the last run and whether it failed."""
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc=desc, unit="run")
    out = []
    for label, workdir, overrides in jobs:
        res = run_job(workdir, overrides, **kwargs)
        out.append(res)
        if bar is not None:
            bar.set_postfix_str(f"{label} {'ok' if res.error is None else 'FAILED'}")
            bar.update(1)
    if bar is not None:
        bar.close()
    return out


def metrics_paths(results: Mapping[str, Sequence[RunResult]]) -> dict[str, list[str]]:
    """sampler -> the metrics files of its successful runs (failed runs are left out)."""
    return {s: [r.metrics_path for r in rs if r.error is None and os.path.exists(r.metrics_path)]
            for s, rs in results.items()}


def summary_table(paths: Mapping[str, Sequence[str]], keys: Sequence[str] = CURVES, *,
                  window: int = 5) -> list[dict[str, Any]]:
    """Per sampler and key: mean over seeds of the first-``window`` and last-``window`` step
    averages, the standard error of the last-window average across seeds, and the seed count.

    Returns rows {"sampler", "key", "first", "last", "last_se", "n"}."""
    rows = []
    for sampler, files in paths.items():
        for key in keys:
            firsts, lasts = [], []
            for p in files:
                recs = [r for r in metrics_lib.read_metrics(p) if key in r]
                vals = np.array([float(r[key]) for r in sorted(recs, key=lambda r: r["step"])])
                if vals.size:
                    firsts.append(vals[:window].mean())
                    lasts.append(vals[-window:].mean())
            n = len(lasts)
            rows.append(dict(sampler=sampler, key=key,
                             first=float(np.mean(firsts)) if n else float("nan"),
                             last=float(np.mean(lasts)) if n else float("nan"),
                             last_se=float(np.std(lasts, ddof=1) / np.sqrt(n)) if n > 1 else 0.0,
                             n=n))
    return rows


def _curve(path: str, key: str) -> np.ndarray:
    """The values of ``key`` in a metrics file, in step order."""
    recs = [r for r in metrics_lib.read_metrics(path) if key in r]
    return np.array([float(r[key]) for r in sorted(recs, key=lambda r: r["step"])])


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): the mean of ``values`` and its Student-t ``confidence`` interval
    (nan bounds with fewer than 2 values)."""
    from scipy import stats

    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return (float(v.mean()) if v.size else float("nan")), float("nan"), float("nan")
    half = stats.t.ppf(0.5 + confidence / 2, v.size - 1) * v.std(ddof=1) / np.sqrt(v.size)
    return float(v.mean()), float(v.mean() - half), float(v.mean() + half)


def gain_table(paths: Mapping[str, Sequence[str]], keys: Sequence[str] = CURVES, *,
               window: int = 10, confidence: float = 0.95) -> list[dict[str, Any]]:
    """Per setting (a sampler) and key: each seed's gain, the mean of its last ``window`` steps
    minus the mean of its first ``window``, summarised over seeds by the mean gain and its
    ``confidence`` t-interval; plus the mean over all steps and seeds with its interval (for
    ``grpo/zero_var_frac``: 1 - it is the fraction of informative groups). A run with fewer
    than 2 x ``window`` steps is left out (its windows would overlap).

    Returns rows {"setting", "key", "first", "last", "gain", "gain_low", "gain_high",
    "mean", "mean_low", "mean_high", "n", "excludes_zero"}."""
    rows = []
    for setting, files in paths.items():
        for key in keys:
            curves = [c for c in (_curve(p, key) for p in files) if c.size >= 2 * window]
            firsts = [c[:window].mean() for c in curves]
            lasts = [c[-window:].mean() for c in curves]
            gain, low, high = mean_interval(np.subtract(lasts, firsts), confidence)
            mean, mean_low, mean_high = mean_interval([c.mean() for c in curves], confidence)
            rows.append(dict(setting=setting, key=key,
                             first=float(np.mean(firsts)) if curves else float("nan"),
                             last=float(np.mean(lasts)) if curves else float("nan"),
                             gain=gain, gain_low=low, gain_high=high, mean=mean,
                             mean_low=mean_low, mean_high=mean_high, n=len(curves),
                             excludes_zero=bool(low > 0 or high < 0)))
    return rows


def _seed_gains(files: Sequence[str], key: str, window: int) -> dict[str, float]:
    """Run label (its folder's name, e.g. ``seed3``) -> that run's gain of ``key`` (last minus
    first ``window`` steps); runs shorter than 2 x ``window`` steps are left out."""
    curves = {os.path.basename(os.path.dirname(p)): _curve(p, key) for p in files}
    return {label: float(c[-window:].mean() - c[:window].mean())
            for label, c in curves.items() if c.size >= 2 * window}


def gain_differences(paths: Mapping[str, Sequence[str]], a: str, b: str,
                     keys: Sequence[str] = CURVES, *, window: int = 10) -> list[dict[str, Any]]:
    """Per key, the gain of setting ``a`` minus that of ``b``, paired by seed (runs in folders of
    the same name, ``<setting>/seed<k>/``: the same warm start, generation and sampler seeds),
    over the seeds both settings ran, with its 95% t-interval (``paired_differences`` rows)."""
    before, after = {"values": {}}, {"values": {}}
    for key in keys:
        gains_a, gains_b = _seed_gains(paths[a], key, window), _seed_gains(paths[b], key, window)
        common = sorted(set(gains_a) & set(gains_b))
        after["values"][key] = [gains_a[s] for s in common]
        before["values"][key] = [gains_b[s] for s in common]
    return paired_differences(before, after)


def paired_differences(before: Mapping[str, Any], after: Mapping[str, Any]
                       ) -> list[dict[str, Any]]:
    """Per metric of ``before["values"]`` (rows of ``evaluate_runs``, or any dict with
    per-seed ``values[metric]`` lists, the same seeds in the same order on both sides), the mean
    over seeds of after - before and its 95% t-interval; seeds where either side has no value
    (nan) are left out.

    Returns rows {"metric", "diff", "low", "high", "n", "excludes_zero"}."""
    rows = []
    for metric, base in before["values"].items():
        d = [a - b for a, b in zip(after["values"][metric], base)
             if not (np.isnan(a) or np.isnan(b))]
        diff, low, high = mean_interval(d)
        rows.append(dict(metric=metric, diff=diff, low=low, high=high, n=len(d),
                         excludes_zero=bool(low > 0 or high < 0)))
    return rows


def format_differences(rows: Sequence[Mapping[str, Any]], label: str = "after - before") -> str:
    """``paired_differences`` rows as a markdown table; ``label`` names the difference."""
    lines = [f"| metric | {label} [95% CI over seeds] | seeds |", "|---|---|---|"]
    lines += [f"| {r['metric']} | {r['diff']:+.3f} [{r['low']:+.3f}, {r['high']:+.3f}] | {r['n']} |"
              for r in rows]
    return "\n".join(lines)


def format_gain_table(rows: Sequence[Mapping[str, Any]], window: int = 10) -> str:
    """``gain_table`` rows as a markdown table."""
    lines = [f"| setting | metric | first {window} steps | last {window} steps | gain "
             "[95% CI over seeds] | mean over steps [95% CI] | seeds |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['key']} | {r['first']:.3f} | {r['last']:.3f} | "
                     f"{r['gain']:+.3f} [{r['gain_low']:+.3f}, {r['gain_high']:+.3f}] | "
                     f"{r['mean']:.3f} [{r['mean_low']:.3f}, {r['mean_high']:.3f}] | {r['n']} |")
    return "\n".join(lines)


def plot_curves(paths: Mapping[str, Sequence[str]], keys: Sequence[str], out_path: str, *,
                smooth: int = 5, confidence: float = 0.95) -> str:
    """One panel per key: per setting, the mean over seeds of the ``smooth``-step running mean,
    with its ``confidence`` t-band over seeds (only steps every seed reached). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from scipy import stats

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    for ax, key in zip(axes[0], keys):
        for setting, files in paths.items():
            curves = [c for c in (_curve(p, key) for p in files) if c.size]
            if not curves:
                continue
            n = min(c.size for c in curves)
            kernel = np.ones(min(smooth, n)) / min(smooth, n)
            runs = np.stack([np.convolve(c[:n], kernel, mode="valid") for c in curves])
            x = np.arange(runs.shape[1]) + (kernel.size - 1)
            mean = runs.mean(0)
            ax.plot(x, mean, label=f"{setting} (n={len(curves)})")
            if len(curves) > 1:
                half = (stats.t.ppf(0.5 + confidence / 2, len(curves) - 1)
                        * runs.std(0, ddof=1) / np.sqrt(len(curves)))
                ax.fill_between(x, mean - half, mean + half, alpha=0.2)
        ax.set_title(key)
        ax.set_xlabel(f"RL step ({smooth}-step running mean)")
        ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``summary_table`` rows as a markdown table."""
    lines = ["| sampler | metric | first 5 steps | last 5 steps (± s.e.) | seeds |",
             "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['sampler']} | {r['key']} | {r['first']:.3f} | "
                     f"{r['last']:.3f} ± {r['last_se']:.3f} | {r['n']} |")
    return "\n".join(lines)


def evaluate_runs(runs: Mapping[str, Sequence[str]], task_ids: Sequence[str], out_root: str, *,
                  seeds: Sequence[int] = (0,), max_steps: int = 4, backend: str = "bwrap",
                  workers: int = 2, progress: bool = True) -> list[dict[str, Any]]:
    """Evaluates the newest checkpoint of each run directory in the agent scaffold
    (``ace_jax.eval.harness.evaluate``) and returns one row per label: the mean over its runs of
    the overall valid rate, HumanRank, steps to the first valid submission and never-valid
    fraction (``EVAL_METRICS``), each with its 95% t-interval over the runs (``<metric>_low``,
    ``<metric>_high``; nan with one run), and each run's value in run order
    (``values[metric]``, nan where the run had none) for paired comparisons.

    A run evaluated earlier with the same checkpoints, tasks, seeds and episode length (the
    ``EVAL_DONE`` file in its report folder) is not evaluated again, so an interrupted
    evaluation resumes where it stopped.

    Args:
      runs: label -> run directories (e.g. {"before": [warm], "lp": [seed runs...]}).
      task_ids: tasks of every episode; seeds / max_steps: episodes per task and their length.
      out_root: each run's reports go to ``<out_root>/<label>/<k>``.
    """
    from ace_jax.eval import harness, reports, run_config
    from ace_jax.policy import policy as policy_lib
    from ace_jax.policy.runs import read_run_config
    from sandbox.pool import SandboxPool, resolve_preload

    rows = []
    with SandboxPool(backend, num_workers=workers,
                     preload=resolve_preload("auto", backend)) as pool:  # warm, as in training
        for label, workdirs in runs.items():
            per_run = []
            for k, workdir in enumerate(workdirs):
                out_dir = os.path.join(out_root, label, str(k))
                job = {"workdir": os.path.abspath(workdir), "tasks": list(task_ids),
                       "seeds": [int(x) for x in seeds], "max_steps": int(max_steps),
                       "checkpoints": sorted(os.listdir(os.path.join(workdir, "checkpoints")))}
                done = os.path.join(out_dir, EVAL_DONE)
                if os.path.exists(done):
                    with open(done) as f:
                        cached = json.load(f)
                    if cached["job"] == job:  # evaluated before with these settings: reuse
                        per_run.append(cached["overall"])
                        continue
                run_cfg = read_run_config(workdir)
                tasks = run_config.run_tasks(task_ids, run_cfg)
                result = harness.evaluate(
                    policy_lib.policy_from_spec(f"run:{workdir}"), tasks, pool, seeds=seeds,
                    max_steps=max_steps, agent_cfg=run_config.run_agent_config(workdir),
                    buffer_cfg=run_config.run_buffer_config(workdir), progress=progress,
                    out_dir=out_dir)
                reports.write_reports(result, out_dir)
                per_run.append({m: s.mean for m, s in result.overall.stats.items()})
                with open(done, "w") as f:
                    json.dump({"job": job, "overall": per_run[-1]}, f)

            row = dict(label=label, runs=len(per_run), values={})
            for metric in EVAL_METRICS:  # mean over runs (seeds of the whole run) and its t-interval
                vals = [np.nan if r.get(metric) is None else float(r[metric]) for r in per_run]
                row["values"][metric] = vals
                row[metric], row[f"{metric}_low"], row[f"{metric}_high"] = mean_interval(
                    [v for v in vals if not np.isnan(v)])
            rows.append(row)
    return rows


def format_eval_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """``evaluate_runs`` rows as a markdown table (mean [95% CI over runs] where there are two
    runs or more)."""
    def cell(r, metric, digits):
        text = f"{r[metric]:.{digits}f}"
        low, high = r.get(f"{metric}_low", float("nan")), r.get(f"{metric}_high", float("nan"))
        return text if np.isnan(low) else f"{text} [{low:.{digits}f}, {high:.{digits}f}]"

    lines = ["| policy | runs | valid final submission | HumanRank | steps to first valid "
             "(episodes that reached one) | never valid |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['runs']} | {cell(r, 'valid', 2)} | "
                     f"{cell(r, 'human_rank', 3)} | {cell(r, 'steps_to_first_valid', 2)} | "
                     f"{cell(r, 'never_valid', 2)} |")
    return "\n".join(lines)
