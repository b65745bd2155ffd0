"""Every results table of the docs, regenerated from the raw data under ``results/``.

    python -m ace_jax.experiments.tables            # rewrite the tables in the docs
    python -m ace_jax.experiments.tables --check    # exit 1 when a doc's table differs

A table is a registered function (``TABLES``) of the results folder that returns markdown. In a
document it sits between two markers, and only the text between them is generated::

    <!-- table:routing_replay -->
    ...
    <!-- /table:routing_replay -->

``--check`` (run by CI) recomputes each marked table from the committed raw data and fails when
one differs from the document, or names a table no function makes, so a number in the docs
cannot drift from the data it came from.

    python -m ace_jax.experiments.tables --figures  # the tables, and docs/figures/<name>.png

A figure is a registered function too (``FIGURES``), of the same raw data; ``--check`` does not
compare figures (their pixels depend on the matplotlib build), only the tables beside them.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Callable, Mapping, Sequence

import numpy as np

from ace_jax.experiments import ablation, compare
from ace_jax.registry import Registry, UnknownNameError

REPO = ablation.REPO
DOCS = ("README.md", "docs/results.md", "docs/offpolicy.md")
TABLES: Registry[Callable[[str], str]] = Registry("results table")
FIGURES: Registry[Callable[[str, str], str]] = Registry("results figure")
FIGURE_DIR = "docs/figures"
MARKER = re.compile(r"(<!-- table:([\w-]+) -->\n)(.*?)(<!-- /table:\2 -->)", re.S)
CONFIDENCE = 0.95


class TableError(RuntimeError):
    """A document names a table no function makes, or a table's raw data is missing."""


def _interval(values: Sequence[float], digits: int = 3, signed: bool = True) -> str:
    """"mean [low, high]" (95% Student-t); said so when there are too few values."""
    if not len(values):
        return "n/a (no runs)"
    mean, low, high = ablation.mean_interval(values, CONFIDENCE)
    f = f"{'+' if signed else ''}.{digits}f"
    if not np.isfinite(low):
        return f"{mean:{f}} (n = {len(values)}: no interval)"
    return f"{mean:{f}} [{low:{f}}, {high:{f}}]"


# ------------------------------------------------------------------------ routing replay

@TABLES.register("routing_replay")
def routing_replay(results: str) -> str:
    """Per seed: bf16 route mismatch and sampler-learner k3 without / with R3, fp32 k3."""
    path = os.path.join(results, "routing_replay", "local_bf16.jsonl")
    rows = [json.loads(x) for x in open(path).read().splitlines() if x.strip()]
    by = {(r["seed"], r["dtype"]): r for r in rows if "seed" in r}
    seeds = sorted({s for s, _ in by})
    out = ["| seed | bf16 routes differing (none) | bf16 k3 (none) | bf16 k3 (R3) | "
           "k3 none / R3 | fp32 k3 (none) |", "|---|---|---|---|---|---|"]
    for s in seeds:
        b, f = by[(s, "bfloat16")], by[(s, "float32")]
        out.append(f"| {s} | {100 * b['none']['routing_mismatch_frac']:.2f}% | "
                   f"{b['none']['mismatch_k3']:.2e} | {b['R3']['mismatch_k3']:.2e} | "
                   f"{b['none']['mismatch_k3'] / b['R3']['mismatch_k3']:.1f}x | "
                   f"{f['none']['mismatch_k3']:.1e} |")
    return "\n".join(out)


# ------------------------------------------------------------------------ staleness speed

STALENESS_RUNNER = "benchmarks/bench_offpolicy_staleness.py"


@TABLES.register("offpolicy_staleness")
def offpolicy_staleness(results: str) -> str:
    """``results/offpolicy_staleness/raw.jsonl`` (one line per run, ``STALENESS_RUNNER``): per
    staleness bound k and seed, RL steps per minute (compile excluded, then with it) and the
    valid rate and score of the first vs the last 5 RL steps; with two or more seeds of a k, the
    mean speed per k with its 95% interval; a run with extra overrides names them under the
    table. An empty file (no run yet) is said so."""
    path = os.path.join(results, "offpolicy_staleness", "raw.jsonl")
    rows = sorted((json.loads(x) for x in open(path).read().splitlines() if x.strip()),
                  key=lambda r: (r["k"], r["seed"]))
    if not rows:
        return (f"No runs yet: `python {STALENESS_RUNNER}` writes them to "
                "`results/offpolicy_staleness/raw.jsonl`.")
    out = ["| k | seed | commit | RL steps | RL steps / min (compile excluded) | with compile | "
           "compile s | valid first 5 -> last 5 | score first 5 -> last 5 |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['k']} | {r['seed']} | {r['commit']}{'+dirty' if r['dirty'] else ''} | "
                   f"{r['steps']} | {r['rl_steps_per_min']:.2f} | "
                   f"{r['rl_steps_per_min_with_compile']:.2f} | {r['compile_s']:.1f} | "
                   f"{r['valid_first5']:.2f} -> {r['valid_last5']:.2f} | "
                   f"{r['score_first5']:.3f} -> {r['score_last5']:.3f} |")
    ks = sorted({r["k"] for r in rows})
    speed = {k: [r["rl_steps_per_min"] for r in rows if r["k"] == k] for k in ks}
    if max(map(len, speed.values())) >= 2:
        out += ["", "| k | runs | RL steps / min (compile excluded), mean [95% interval] |",
                "|---|---|---|"]
        out += [f"| {k} | {len(v)} | {_interval(v, 2, False)} |" for k, v in speed.items()]
    other = [r for r in rows if r.get("overrides")]
    if other:   # not the documented setting: said under the table
        out += [""] + [f"k = {r['k']}, seed {r['seed']}: with `{' '.join(r['overrides'])}`."
                       for r in other]
    return "\n".join(out)


ROLLOUTS_RUNNER = "benchmarks/bench_rollouts.py"


@TABLES.register("partial_rollouts")
def partial_rollouts(results: str) -> str:
    """``results/partial_rollouts/raw.jsonl`` (one line per run of ``ROLLOUTS_RUNNER``): per
    factor and bound, useful tokens per second drained and partial, their ratio, the decode
    row-steps per useful token of each, the token staleness's maximum, and lost / duplicated
    samples."""
    path = os.path.join(results, "partial_rollouts", "raw.jsonl")
    rows = [json.loads(x) for x in open(path).read().splitlines() if x.strip()]
    if not rows:
        return (f"No runs yet: `python {ROLLOUTS_RUNNER} --out "
                "results/partial_rollouts/raw.jsonl`.")
    out = ["| commit | length law | slots | timed steps | factor | bound | useful tok/s drained | "
           "partial | speed-up | row-steps / useful token, drained -> partial | staleness max | "
           "lost | duplicated |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["budget"], r["steps"], r["factor"], r["bound"])):
        d, p = r["drained"], r["partial"]
        out.append(f"| {r['commit']}{'+dirty' if r['dirty'] else ''} | {r['length_law']} | "
                   f"{r['slots']} | {r['steps']} | {r['factor']:g} | {r['bound']} | "
                   f"{d['useful_tokens_per_s']:.0f} | {p['useful_tokens_per_s']:.0f} | "
                   f"{r['useful_speedup']:.2f}x | {d['row_steps_per_useful_token']:.2f} -> "
                   f"{p['row_steps_per_useful_token']:.2f} | {r['staleness_max']} | "
                   f"{r['lost']} | {r['duplicated']} |")
    return "\n".join(out)


# ------------------------------------------------------------------------ compare experiments

def probe_gains(rows: Sequence[dict], key: str, baseline: str = ""
                ) -> dict[tuple[str, int], float]:
    """(arm, seed) -> ``key`` at the last probe minus at the first (updates 0). With
    ``baseline`` (the warm starts' arm, ``compare.WARM``) the first probe is that arm's of the
    same seed, for every arm: the parameters every arm of the seed started from (arms run with
    ``probe.at_start=False`` do not probe them again), so the baseline arm's own gain is 0 and
    an arm whose one probe is at 0 updates (an SFT control) gains its probe minus the warm
    start's."""
    probes: dict[tuple[str, int], list] = {}
    for r in rows:
        if key in r and "probe/updates" in r:
            probes.setdefault((r["arm"], r["seed"]), []).append((r["probe/updates"], r[key]))
    out = {}
    for (arm, seed), got in sorted(probes.items()):
        got.sort()
        first = probes.get((baseline, seed), [None])[0] if baseline else got[0]
        if first is not None and first[0] == 0 and (baseline or len(got) >= 2):
            out[(arm, seed)] = got[-1][1] - first[1]
    return out


def detectable_effect(diffs: Sequence[float], confidence: float = CONFIDENCE,
                      power: float = 0.8) -> float:
    """The smallest paired mean difference a two-sided t-test at ``confidence`` detects with
    ``power``, given the observed spread: (t(1 - a/2, n-1) + t(power, n-1)) sd / sqrt(n)
    (nan with fewer than 2 values)."""
    from scipy import stats

    v = np.asarray(diffs, dtype=np.float64)
    if v.size < 2:
        return float("nan")
    t = stats.t.ppf(0.5 + confidence / 2, v.size - 1) + stats.t.ppf(power, v.size - 1)
    return float(t * v.std(ddof=1) / np.sqrt(v.size))


# All-task figures, then the training tasks alone (``_train``: the probe's in-distribution part,
# whose draft prompts are the buffer's root prompts) and the held-out tasks (``_heldout``).
PROBE_KEYS = ("probe/score", "probe/valid_rate", "probe/humanrank", "probe/score_train",
              "probe/valid_rate_train", "probe/score_heldout", "probe/valid_rate_heldout")


def _p(p: float, digits: int = 3) -> str:
    return "n/a" if not np.isfinite(p) else f"{p:.{digits}f}"


def _runs_json(results: str, name: str) -> dict:
    with open(os.path.join(results, name, "runs.json")) as f:
        return json.load(f)


def _finished(results: str, name: str, arms: Sequence[str]
              ) -> tuple[dict, list[dict], dict[str, list[int]]]:
    """``results/<name>``'s runs.json, its metrics rows, and per arm the planned seeds it
    finished."""
    info = _runs_json(results, name)
    rows = compare.read_csv(os.path.join(results, name, "metrics.csv.gz"))
    done = {(r["arm"], r["seed"]) for r in info["runs"]}
    return info, rows, {arm: [s for s in info["seeds"] if (arm, s) in done] for arm in arms}


def paired_points(results: str, name: str, arms: Sequence[str],
                  pairs: Sequence[tuple[str, str]], key: str, baseline: str = ""
                  ) -> tuple[dict[str, dict[int, float]], dict[tuple[str, str], dict[int, float]]]:
    """The numbers `compare_table` summarises for one probe key, per seed: each arm's gain
    (``probe_gains``) over the seeds it finished, and each pair's difference x - y over the
    seeds both finished. Returns (arm -> seed -> gain, (x, y) -> seed -> difference)."""
    _, rows, seeds = _finished(results, name, (*arms, *([baseline] if baseline else [])))
    return _per_seed(rows, seeds, key, pairs, baseline)


def _per_seed(rows, seeds, key, pairs, baseline):
    g = probe_gains(rows, key, baseline)
    gains = {a: {s: g[(a, s)] for s in seeds[a] if (a, s) in g} for a in seeds}
    diffs = {(x, y): {s: gains[x][s] - gains[y][s] for s in gains[x] if s in gains[y]}
             for x, y in pairs}
    return gains, diffs


def family_tests(per_pair: Mapping[tuple[str, str], Mapping[int, float]]
                 ) -> dict[tuple[str, str], dict[str, float]]:
    """Per pair of one family of comparisons (``paired_points``' differences): its paired
    t-test p (``t``), exact sign-flip p (``flip``), and both Holm-adjusted within the family
    (``holm_t``, ``holm_flip``)."""
    diffs = [list(d.values()) for d in per_pair.values()]
    p_t, p_flip = [compare.paired_t_p(d) for d in diffs], [compare.sign_flip_p(d) for d in diffs]
    return {xy: {"t": t, "flip": f, "holm_t": ht, "holm_flip": hf} for xy, t, f, ht, hf in
            zip(per_pair, p_t, p_flip, compare.holm(p_t), compare.holm(p_flip))}


def compare_table(results: str, name: str, arms: Sequence[str],
                  pairs: Sequence[tuple[str, str]], keys: Sequence[str] = PROBE_KEYS,
                  cost: bool = False, family: bool = False, baseline: str = "") -> str:
    """``results/<name>``: per probe key each arm's gain (last probe - first, over the seeds
    it finished) and, per pair (x, y), the paired difference x - y over the seeds both
    finished, with 95% Student-t intervals and the effect the design detects at 80% power.
    ``family``: the pairs of one probe key are one family of comparisons, and each pair's row
    also gives its seeds above 0, its t-test p, the exact sign-flip p (``compare.sign_flip_p``),
    both Holm-adjusted within the family (``compare.holm``), and its Bonferroni interval (each
    at 1 - 0.05 / m: simultaneous 95% coverage for the m pairs); a line under the table says,
    per key, whether Holm rejects any pair at 5%.
    ``cost``: a table of updates and generated completion tokens per arm too.
    ``baseline``: the gains' first probe is that arm's (``probe_gains``); a pair (x, baseline)
    is then x's gain itself. Runs that record their commits (``ablation.run_job``) are listed
    by commit under the tables."""
    info, rows, seeds = _finished(results, name, (*arms, *([baseline] if baseline else [])))
    done = {(r["arm"], r["seed"]) for r in info["runs"]}
    planned = len(info["arms"]) * len(info["seeds"])
    out = [f"{sum(a != compare.WARM for a, _ in done)} of {planned} runs finished"
           + ("" if info["complete"] else " (incomplete: no conclusion is drawn)") + ".", "",
           "| probe key | " + " | ".join(f"gain {a}" for a in arms) + " |",
           "|---|" + "---|" * len(arms)]
    per_key = {key: _per_seed(rows, seeds, key, pairs, baseline) for key in keys}
    for key, (gains, _) in per_key.items():
        out.append(f"| {key} | " + " | ".join(_interval(list(gains[a].values())) for a in arms)
                   + " |")
    m = len(pairs)
    if family:
        out += ["", "| probe key | paired difference | seeds | mean [95% interval] | seeds > 0 | "
                    "p (t) | p (sign-flip, exact) | Holm p (t) | Holm p (sign-flip) | "
                    f"family-wise 95% interval (Bonferroni, {m} pairs) | "
                    "detectable at 80% power |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    else:
        out += ["", "| probe key | paired difference | seeds | mean [95% interval] | "
                    "detectable at 80% power |", "|---|---|---|---|---|"]
    notes = []
    for key, (_, per_pair) in per_key.items():
        diffs = {xy: (list(d), list(d.values())) for xy, d in per_pair.items()}
        if family:
            tests = list(family_tests(per_pair).values())
            p_t, p_flip = [t["t"] for t in tests], [t["flip"] for t in tests]
            holm_t, holm_flip = [t["holm_t"] for t in tests], [t["holm_flip"] for t in tests]
        for i, ((x, y), (both, diff)) in enumerate(diffs.items()):
            mde = detectable_effect(diff)
            cells = [key, f"{x} - {y}", ", ".join(map(str, both)) or "none", _interval(diff)]
            if family:
                mean, low, high = ablation.mean_interval(diff, 1 - (1 - CONFIDENCE) / m)
                bonferroni = (f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]" if np.isfinite(low)
                              else "n/a")
                cells += [f"{sum(d > 0 for d in diff)} of {len(diff)}", _p(p_t[i]),
                          _p(p_flip[i], 4), _p(holm_t[i]), _p(holm_flip[i], 4), bonferroni]
            cells.append("n/a" if np.isnan(mde) else f"{mde:.3f}")
            out.append("| " + " | ".join(cells) + " |")
        tested = [p for p in holm_t if np.isfinite(p)] if family else []
        if tested:
            rejected = [f"{x} - {y}" for (x, y), p in zip(diffs, holm_t) if p < 1 - CONFIDENCE]
            notes.append(f"{key}: Holm (t) rejects "
                         + (", ".join(rejected) if rejected else
                            f"none of the {len(tested)} at family-wise 5% (smallest adjusted p "
                            f"{min(tested):.3f}), and no Bonferroni interval excludes 0") + ".")
    if notes:
        out += [""] + [f"- {x}" for x in notes]
        n = min(len([s for s in seeds[x] if s in seeds[y]]) for x, y in pairs)
        if n:
            out.append(f"- With {n} paired seeds the exact sign-flip p is never below "
                       f"2 / 2^{n} = {2 / 2 ** n:.4f}.")
    if cost:
        out += ["", "| arm | updates | generated tokens | refill rounds per step |",
                "|---|---|---|---|"]
        for a in arms:
            per = [[r for r in rows if r["arm"] == a and r["seed"] == s] for s in seeds[a]]
            upd = [max(r.get("probe/updates", 0.0) for r in p) for p in per]
            tok = [sum(r.get("rollout/generated_tokens", 0.0) for r in p) for p in per]
            refill = [r["rollout/refill_rounds"] for p in per for r in p
                      if "rollout/refill_rounds" in r]
            out.append(f"| {a} | {_interval(upd, 1, False)} | {_interval(tok, 0, False)} | "
                       f"{np.mean(refill) if refill else float('nan'):.2f} |")
    commits: dict[str, list[str]] = {}
    for r in info["runs"]:
        for c in r.get("commits", ()):
            commits.setdefault(c["commit"][:7] + (" (uncommitted changes)" if c["dirty"] else ""),
                               []).append(f"{r['arm']}/{r['seed']}")
    if commits:
        out += ["", "| commit | runs that ran on it |", "|---|---|"]
        out += [f"| {c} | {len(runs)}: {', '.join(runs)} |" for c, runs in commits.items()]
    return "\n".join(out)


@TABLES.register("offpolicy_k1")
def offpolicy_k1(results: str) -> str:
    """``results/offpolicy_k1``: behaviour vs learner (decoupled) at k = 1, on the probe."""
    return compare_table(results, "offpolicy_k1", ("behaviour", "learner"),
                         [("learner", "behaviour")])


@TABLES.register("samplers_budget")
def samplers_budget(results: str) -> str:
    """``results/samplers_budget``: LP against uniform, DAPO and Reinforce-Ada at one budget
    of generated tokens, on the probe; the three lp - arm pairs of a probe key are one family
    (Holm-adjusted t and sign-flip p, Bonferroni intervals)."""
    others = ("uniform", "dapo", "reinforce_ada")
    return compare_table(results, "samplers_budget", ("lp", *others),
                         [("lp", o) for o in others], cost=True, family=True)


# The held-out probe (issue 51): both held-out groups together, then each, then in-distribution.
HELDOUT_KEYS = ("probe/heldout_valid_rate", "probe/heldout_score",
                "probe/heldout_instances_valid_rate", "probe/heldout_instances_score",
                "probe/heldout_family_valid_rate", "probe/heldout_family_score",
                "probe/valid_rate_train", "probe/score_train")
PROCEDURAL_ARMS = ("lp", "uniform", "uniform_cap", "dapo", "reinforce_ada", "sft")
# plan.md's family: the default's gain (lp - warm), then LP against each other arm
PROCEDURAL_PAIRS = (("lp", compare.WARM), *[("lp", a) for a in PROCEDURAL_ARMS[1:]])


@TABLES.register("procedural_heldout")
def procedural_heldout(results: str) -> str:
    """``results/procedural_heldout`` (plan.md there): every arm's gain over its seed's warm
    start on the held-out probe, and one family of six paired comparisons per key: the
    default's gain (lp - warm), LP against truly uniform, uniform with the child cap, DAPO and
    Reinforce-Ada, and RL against the compute-matched SFT control (lp - sft)."""
    table = compare_table(results, "procedural_heldout", PROCEDURAL_ARMS, PROCEDURAL_PAIRS,
                          keys=HELDOUT_KEYS, cost=True, family=True, baseline=compare.WARM)
    if not _runs_json(results, "procedural_heldout")["complete"]:
        return table
    _, per_pair = paired_points(results, "procedural_heldout", PROCEDURAL_ARMS,
                                PROCEDURAL_PAIRS, HELDOUT_KEYS[0], baseline=compare.WARM)
    return "\n".join([table, "", f"Decision (plan.md's rule, on {HELDOUT_KEYS[0]}):",
                      *heldout_decision(per_pair)])


# plan.md's words for each test of its family: (when x - y > 0, when x - y < 0)
HELDOUT_CLAIMS = {
    ("lp", compare.WARM): ("RL raises the held-out valid rate", "RL lowers the held-out valid rate"),
    **{("lp", a): (f"LP ahead of {a}", f"LP behind {a}") for a in PROCEDURAL_ARMS[1:-1]},
    ("lp", "sft"): ("RL ahead of more SFT", "RL behind more SFT"),
}


def heldout_decision(per_pair: Mapping[tuple[str, str], Mapping[int, float]],
                     alpha: float = 1 - CONFIDENCE) -> list[str]:
    """plan.md's decision, one line per test of the family, then the default's: a test is
    significant when its Holm-adjusted t-test p is below ``alpha``; its claim in words
    (``HELDOUT_CLAIMS``) also needs its Holm-adjusted sign-flip p below ``alpha``; otherwise no
    difference detected, with the smallest effect the design detects at the observed sd.
    ``configs/local.py``'s default switches to the procedural family only when test (1)
    (lp - warm) is significant and positive."""
    lines = []
    tests = family_tests(per_pair)
    for i, (xy, d) in enumerate(per_pair.items(), 1):
        t, values = tests[xy], list(d.values())
        ps = f"Holm p {_p(t['holm_t'])} (t), {_p(t['holm_flip'], 4)} (sign-flip)"
        if t["holm_t"] < alpha and t["holm_flip"] < alpha:
            words = HELDOUT_CLAIMS[xy][0 if np.mean(values) > 0 else 1]
        elif t["holm_t"] < alpha:
            words = "significant by the t-test, not by the sign-flip test: no claim in words"
        else:
            words = ("no difference detected; the smallest effect this design detects at the "
                     f"observed sd is {detectable_effect(values):.3f}")
        lines.append(f"- ({i}) {xy[0]} - {xy[1]}: {words} ({ps}).")
    first = tests[PROCEDURAL_PAIRS[0]]
    learns = first["holm_t"] < alpha and np.mean(list(per_pair[PROCEDURAL_PAIRS[0]].values())) > 0
    lines.append("- configs/local.py's default: " + (
        "switches to the procedural family (test (1) is significant and positive)." if learns else
        "keeps the offline suite (test (1) is not significant and positive)."))
    return lines


@FIGURES.register("procedural_heldout")
def procedural_heldout_figure(results: str, out_path: str) -> str:
    """The plan's primary key (``probe/heldout_valid_rate``) seed by seed: left, each arm's gain
    over its seed's warm start; right, the family of six paired differences (lp - warm is the
    default's gain). Each with its mean and 95% t-interval (thick) and, on the right, the
    family-wise Bonferroni interval (thin). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = HELDOUT_KEYS[0]
    info = _runs_json(results, "procedural_heldout")
    gains, diffs = paired_points(results, "procedural_heldout", PROCEDURAL_ARMS,
                                 PROCEDURAL_PAIRS, key, baseline=compare.WARM)
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    panels = ((left, [(a, gains[a]) for a in PROCEDURAL_ARMS], "gain over the warm start", 1),
              (right, [(f"{x} - {y}", d) for (x, y), d in diffs.items()],
               f"paired difference (thin: family-wise, Bonferroni for {len(diffs)})",
               len(diffs)))
    for ax, series, title, family in panels:
        for i, (label, per_seed) in enumerate(series):
            values = list(per_seed.values())       # in seed order, spread left to right
            ax.scatter(i + np.linspace(-0.15, 0.15, len(values)), values, s=14, color="0.45",
                       zorder=3)
            if len(values) >= 2:
                mean, low, high = ablation.mean_interval(values, CONFIDENCE)
                ax.errorbar(i + 0.3, mean, yerr=[[mean - low], [high - mean]], fmt="o",
                            color="C0", lw=2.5, capsize=3, zorder=4)
                if family > 1:
                    _, flow, fhigh = ablation.mean_interval(values, 1 - (1 - CONFIDENCE) / family)
                    ax.vlines(i + 0.3, flow, fhigh, color="C0", lw=0.8, zorder=3)
        ax.axhline(0.0, color="k", lw=0.6)
        ax.set_xticks(range(len(series)), [label for label, _ in series], rotation=25,
                      ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
    left.set_ylabel(f"{key}\n(dots: seeds; bars: mean, 95% t)")
    done = sum(r["arm"] != compare.WARM for r in info["runs"])
    fig.suptitle(f"results/procedural_heldout: {done} of {len(info['arms']) * len(info['seeds'])} "
                 "runs" + ("" if info["complete"] else " (incomplete: no conclusion is drawn)"),
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


# ------------------------------------------------------------------------ ideator with room

IDEATOR_SETTINGS = ("implementer_alone", "with_untrained_ideator", "with_trained_ideator")
IDEATOR_PLANNED_SEEDS = tuple(range(10))  # results/ideator_room/plan.md


def _eval_stat(path: str, key: str) -> float:
    """The overall mean of ``key`` (human_rank = Avg@k, best_at_k, valid) of one evaluation's
    results.json(.gz) (`launch/evaluate.py`)."""
    import gzip

    with gzip.open(path, "rt") as f:
        mean = json.load(f)["overall"]["stats"][key]["mean"]
    return float("nan") if mean is None else float(mean)


@TABLES.register("ideator_room")
def ideator_room(results: str) -> str:
    """``results/ideator_room``: the pilot that fixed the implementer's SFT steps, then per run
    seed the three settings' Avg@3 / Best@3 / valid rate; the plan's paired comparison
    (intervals, detectable effect) only once all the planned seeds are in."""
    folder = os.path.join(results, "ideator_room")
    pilot = json.load(open(os.path.join(folder, "pilot.json")))
    out = ["Pilot (run seed 100, implementer alone; " + pilot["rule"] + "):", "",
           "| SFT steps | valid | Avg@3 |", "|---|---|---|"]
    out += [f"| {r['sft_steps']} | {r['valid']:.3f} | {r['human_rank']:.3f} |" for r in pilot["tried"]]
    out += ["", f"S = {pilot['S']}.", ""]
    raw = os.path.join(folder, "raw")
    seeds = [s for s in IDEATOR_PLANNED_SEEDS if all(
        os.path.exists(os.path.join(raw, f"seed{s}", f"{n}.json.gz")) for n in IDEATOR_SETTINGS)]
    stats = {s: {n: {k: _eval_stat(os.path.join(raw, f"seed{s}", f"{n}.json.gz"), k)
                     for k in ("human_rank", "best_at_k", "valid")} for n in IDEATOR_SETTINGS}
             for s in seeds}
    out += [f"{len(seeds)} of {len(IDEATOR_PLANNED_SEEDS)} planned run seeds finished.", "",
            "| run seed | " + " | ".join(f"Avg@3 {n}" for n in IDEATOR_SETTINGS)
            + " | valid alone | valid + trained |", "|---|" + "---|" * (len(IDEATOR_SETTINGS) + 2)]
    for s in seeds:
        st = stats[s]
        out.append(f"| {s} | " + " | ".join(f"{st[n]['human_rank']:.3f}" for n in IDEATOR_SETTINGS)
                   + f" | {st['implementer_alone']['valid']:.3f} | "
                   f"{st['with_trained_ideator']['valid']:.3f} |")
    if len(seeds) < len(IDEATOR_PLANNED_SEEDS):
        out += ["", "Incomplete: the plan's comparison is made once every planned seed is in; "
                "no conclusion is drawn."]
        return "\n".join(out)
    out += ["", "| paired by run seed | Avg@3 (primary: trained - alone) | Best@3 | valid | "
                "detectable Avg@3 at 80% power |", "|---|---|---|---|---|"]
    primary = None
    for x, y in (("with_trained_ideator", "implementer_alone"),
                 ("with_untrained_ideator", "implementer_alone"),
                 ("with_trained_ideator", "with_untrained_ideator")):
        diff = {k: [stats[s][x][k] - stats[s][y][k] for s in seeds]
                for k in ("human_rank", "best_at_k", "valid")}
        if primary is None:   # the first pair is the plan's primary comparison
            primary = diff["human_rank"]
        out.append(f"| {x} - {y} | {_interval(diff['human_rank'])} | "
                   f"{_interval(diff['best_at_k'])} | {_interval(diff['valid'])} | "
                   f"{detectable_effect(diff['human_rank']):.3f} |")
    out += ["", "Decision (the plan's rule, on the primary interval): " + _decision(
        primary, "the trained ideator helps this implementer",
        "the trained ideator hurts this implementer") + "."]
    return "\n".join(out)


def _decision(diffs: Sequence[float], above: str, below: str) -> str:
    """A registered plan's rule on the paired differences' 95% interval: ``above`` only when it
    lies entirely above 0, ``below`` only when entirely below, otherwise no difference detected
    with the smallest effect the design detects at the observed sd (80% power)."""
    mean, low, high = ablation.mean_interval(diffs, CONFIDENCE)
    if low > 0:
        return f"{above} (interval entirely above 0)"
    if high < 0:
        return f"{below} (interval entirely below 0)"
    return (f"no difference detected; the smallest effect this design detects at the observed "
            f"sd is {detectable_effect(diffs):.3f}")


# ------------------------------------------------------------------------ documents

def render(text: str, results: str) -> tuple[str, list[str]]:
    """``text`` with every marked table regenerated; and the names of those that changed."""
    changed = []

    def sub(m: re.Match) -> str:
        name = m.group(2)
        try:
            body = TABLES.get(name)(results).rstrip("\n") + "\n"
        except UnknownNameError as e:
            raise TableError(f"a document marks a table no function makes: {e}") from None
        except FileNotFoundError as e:
            raise TableError(f"table {name!r}: its raw data is missing ({e})") from None
        if body != m.group(3):
            changed.append(name)
        return m.group(1) + body + m.group(4)

    return MARKER.sub(sub, text), changed


def run(docs: Sequence[str] = DOCS, *, results: str = "results", root: str = REPO,
        check: bool = False) -> list[str]:
    """Regenerates (or with ``check`` compares) the tables of ``docs``; returns
    "doc: table" for every table that differed."""
    differ = []
    for doc in docs:
        path = os.path.join(root, doc)
        if not os.path.exists(path):
            continue
        text = open(path).read()
        new, changed = render(text, os.path.join(root, results))
        differ += [f"{doc}: {name}" for name in changed]
        if changed and not check:
            with open(path, "w") as f:
                f.write(new)
    return differ


def write_figure(name: str, *, results: str = "results", root: str = REPO) -> str:
    """Writes figure ``name`` from ``<root>/<results>`` to ``<root>/docs/figures/<name>.png``;
    returns its path."""
    try:
        return FIGURES.get(name)(os.path.join(root, results),
                                 os.path.join(root, FIGURE_DIR, f"{name}.png"))
    except FileNotFoundError as e:
        raise TableError(f"figure {name!r}: its raw data is missing ({e})") from None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check", action="store_true",
                   help="compare, write nothing; exit 1 when a table differs from its data")
    p.add_argument("--figures", action="store_true",
                   help=f"also write every figure ({FIGURE_DIR}/<name>.png)")
    p.add_argument("--results", default="results")
    p.add_argument("--root", default=REPO, help="the checkout whose docs and results are used")
    args = p.parse_args(argv)
    if args.check and args.figures:
        p.error("--check compares the tables only; --figures writes")
    try:
        differ = run(results=args.results, root=args.root, check=args.check)
        if args.figures:
            for name in FIGURES.names():
                print("figure: " + write_figure(name, results=args.results, root=args.root))
    except TableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for d in differ:
        print(("differs from its raw data: " if args.check else "regenerated: ") + d)
    if args.check and differ:
        print("run `python -m ace_jax.experiments.tables` and commit the docs", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
