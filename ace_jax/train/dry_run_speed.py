"""The dry run's speed section: rooflines of the compiled programs, per chip.

Every figure comes from a program XLA's TPU compiler compiled for the target slice
(`ace_jax.train.dry_run_programs.cost_programs`): ``cost_analysis()``'s FLOPs and HBM bytes
accessed, and the bytes moved by collectives summed from the optimised HLO
(`ace_jax.runtime.tpu_compile.collective_bytes`). The cost programs are compiled without on-chip
memory-space assignment (`tpu_compile.HBM_TRAFFIC_OPTIONS`): with it, XLA's "bytes accessed"
counts a weight it prefetches into VMEM about 5 times (copy, then reads of the on-chip copy);
without it every operand is read from HBM once, an upper bound on the real program's HBM traffic.
A program's roofline time is

    t = max(FLOPs / peak FLOP/s,  HBM bytes / HBM bandwidth,  collective bytes / (ICI / 2))

(ICI is quoted bidirectional per chip; a device receives at half of it), and the binding term is
named. What it leaves out: the latency of many small collectives (a decode step's are a few MB,
latency-bound), overlap of compute and communication (the max assumes perfect overlap), kernel
efficiency (peak, not achieved), host work and the sandbox.

XLA counts a ``while`` body once, so the programs are compiled with their layers UNROLLED for one
and for two layers, and the cost of L layers is extrapolated exactly (every layer of the stack is
the same program): ``cost(L) = cost(1) + (L - 1) x (cost(2) - cost(1))``. The learner is costed
per microbatch (one microbatch's rows, one log-prob chunk) and multiplied by the microbatches.

Decode is costed as the rollout's average step: a step reads the filled key blocks only, so its
cost is affine in the number of blocks it reads, and the costs of two compiled steps (the middle
of the rollout and the last, full-cache step) interpolate exactly to the mean block count over
the rollout's M steps (`dry_run_programs.decode_key_blocks`; one step in the middle would
count a half-filled block as a whole one). The last step (the slowest) is reported beside it.
The paged engine's decode step (`dry_run_programs.paged_decode_program`: each group's prompt
pages held once and read once per step) is costed the same way, affine in the own pages a row
reads (`dry_run_programs.paged_decode_pages`), and reported beside the static generator's.
"""
from __future__ import annotations

from typing import Any

from ace_jax.train.dry_run_analytic import GB

__all__ = ["CHIPS", "extrapolate", "at_blocks", "roofline", "average_step", "paged_decode", "speed_section"]

# Per chip. Source: Google Cloud's TPU v5p documentation, as gathered in reference/tpu_aot.md.
CHIPS: dict[str, dict[str, Any]] = {
    "TPU v5p": dict(peak_tflops_bf16=459.0, hbm_gbps=2765.0, ici_gbps=1200.0, hbm_gib=95.0,
                    source="Google Cloud TPU v5p documentation (459 TFLOP/s bf16, 95 GiB HBM2e at "
                           "2,765 GB/s, ICI 1,200 GB/s bidirectional per chip)"),
}


def _cost(c: dict) -> dict[str, float]:
    return dict(flops=float(c["flops"]), hbm_bytes=float(c["hbm_bytes"]),
                collective_bytes=float(c["collective_bytes"].get("total", 0)))


def extrapolate(one: dict, two: dict, layers: int) -> dict[str, float]:
    """Costs of ``layers`` layers from compiled programs of 1 and 2 (unrolled) layers."""
    c1, c2 = _cost(one), _cost(two)
    return {k: c1[k] + (layers - 1) * (c2[k] - c1[k]) for k in c1}


def at_blocks(step: dict[str, float], last: dict[str, float], blocks: dict[str, float]
              ) -> dict[str, float]:
    """The cost of a decode step reading ``blocks["mean"]`` key blocks, interpolated between the
    ``step`` and ``last`` programs' costs (which read ``blocks["decode_step"]`` and
    ``blocks["decode_last"]``); the step's own cost when they read as many."""
    span = blocks["decode_last"] - blocks["decode_step"]
    w = (blocks["mean"] - blocks["decode_step"]) / span if span else 0.0
    return {k: step[k] + w * (last[k] - step[k]) for k in step}


def roofline(cost: dict[str, float], chip: dict[str, float]) -> dict[str, Any]:
    """Roofline seconds of one program per chip (see the module docstring)."""
    terms = dict(flops_s=cost["flops"] / (chip["peak_tflops_bf16"] * 1e12),
                 hbm_s=cost["hbm_bytes"] / (chip["hbm_gbps"] * GB),
                 ici_s=cost["collective_bytes"] / (chip["ici_gbps"] / 2 * GB))
    bound = max(terms, key=terms.get)
    return dict(cost, **terms, seconds=terms[bound], bound=bound[:-2])


def chip_figures(dry) -> dict[str, Any]:
    """The chip's figures: the config's ``dry_run`` values, with the table's source when the chip
    is in `CHIPS`."""
    source = CHIPS.get(str(dry.chip), {}).get("source", "the config's dry_run section")
    return dict(chip=str(dry.chip), peak_tflops_bf16=float(dry.peak_tflops_bf16),
                hbm_gbps=float(dry.hbm_bw_gbps), ici_gbps=float(dry.ici_gbps), source=source)


def average_step(compiled: dict[str, dict], prefix: str, layers: int, fill: dict[str, float],
                 chip: dict[str, float]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Rooflines of (the rollout's average decode step, its last step) from the cost programs
    ``{prefix}decode_step_L1/_L2`` and ``{prefix}decode_last_L1/_L2``, extrapolated to
    ``layers`` and interpolated to ``fill["mean"]`` (`at_blocks`; ``fill``: key blocks or own
    pages)."""
    step, last = (extrapolate(compiled[f"{prefix}{s}_L1"], compiled[f"{prefix}{s}_L2"], layers)
                  for s in ("decode_step", "decode_last"))
    return roofline(at_blocks(step, last, fill), chip), roofline(last, chip)


def paged_decode(compiled: dict[str, dict], layers: int, pages: dict[str, float],
                 chip: dict[str, float]) -> dict[str, Any] | None:
    """The paged engine's average decode step (`average_step` of the ``paged_decode_*`` cost
    programs at ``pages``, `dry_run_programs.paged_decode_pages`); None when they are missing
    or failed."""
    names = [f"paged_{s}_L{n}" for s in ("decode_step", "decode_last") for n in (1, 2)]
    if not all(compiled.get(n, {}).get("ok") for n in names):
        return None
    return average_step(compiled, "paged_", layers, pages, chip)[0]


def speed_section(compiled: dict[str, dict], *, dry, shp: dict[str, int], layers: int, chips: int,
                  n_act: int, prefill_s: float, decode_min: dict[str, float],
                  key_blocks: dict[str, float], paged_pages: dict[str, float] | None = None
                  ) -> dict[str, Any]:
    """The report's ``speed`` section from the cost programs (`cost_programs`), or {} when any
    is missing or failed. Per chip; seconds; tokens/s. ``decode_min``: the bytes a decode step
    must read at the mean fill (`dry_run_analytic.decode_min_bytes`), whose HBM time is the
    bound beside the compiled figure; ``key_blocks``: `dry_run_programs.decode_key_blocks`;
    ``paged_pages``: `dry_run_programs.paged_decode_pages` (the paged engine's decode figures,
    ``paged_decode*``, when its programs compiled)."""
    names = ("decode_step_L1", "decode_step_L2", "decode_last_L1", "decode_last_L2", "reshard",
             "learner_microbatch_L1", "learner_microbatch_L2")
    if not all(compiled.get(n, {}).get("ok") for n in names):
        return {}
    chip = chip_figures(dry)
    n, m, p, g, b = shp["rows"], shp["new_tokens"], shp["prompt_len"], shp["group_size"], shp["prompts"]
    k = shp["microbatches"]
    decode, last = average_step(compiled, "", layers, key_blocks, chip)
    reshard = roofline(_cost(compiled["reshard"]), chip)
    mb = extrapolate(compiled["learner_microbatch_L1"], compiled["learner_microbatch_L2"], layers)
    learner = roofline({key: k * v for key, v in mb.items()}, chip)
    rows_per_chip = n / chips
    decode_tok_s_chip = rows_per_chip / decode["seconds"]
    min_s = decode_min["total"] / (chip["hbm_gbps"] * GB)
    # tokens the step trains on: each group's prompt once and its G completions
    trained_tokens = b * (p + g * m)
    learner_flops_ratio = learner["flops"] * chips / (6.0 * n_act * trained_tokens)
    rollout_s = prefill_s + m * decode["seconds"]
    step_s = rollout_s + reshard["seconds"] + learner["seconds"]
    paged = None if paged_pages is None else paged_decode(compiled, layers, paged_pages, chip)
    if paged is not None:
        paged = dict(paged_decode=paged, paged_decode_own_pages=dict(paged_pages),
                     paged_decode_tok_s_chip=rows_per_chip / paged["seconds"],
                     paged_decode_hbm_gb=paged["hbm_bytes"] / GB)
    return dict(
        paged or {},
        chip=chip, decode=decode, decode_last=last, reshard=reshard, learner=learner,
        decode_rows_per_chip=rows_per_chip, decode_key_blocks=dict(key_blocks),
        decode_tok_s_chip=decode_tok_s_chip,
        decode_last_tok_s_chip=rows_per_chip / last["seconds"],
        decode_min=dict(decode_min, seconds=min_s), decode_min_tok_s_chip=rows_per_chip / min_s,
        decode_hbm_gb=decode["hbm_bytes"] / GB, decode_collective_gb=decode["collective_bytes"] / GB,
        reshard_s=reshard["seconds"], learner_flops_ratio=learner_flops_ratio,
        trained_tokens=trained_tokens, prefill_s=prefill_s, rollout_s=rollout_s,
        learner_s=learner["seconds"], step_s_estimate=step_s)


def format_speed(speed: dict[str, Any]) -> list[str]:
    """The speed section as report lines (empty when there is none)."""
    if not speed:
        return []
    c = speed["chip"]
    lines = ["", f"-- speed per chip, rooflines of the compiled programs ({c['chip']}: "
                 f"{c['peak_tflops_bf16']:.0f} TFLOP/s, HBM {c['hbm_gbps']:.0f} GB/s, ICI "
                 f"{c['ici_gbps']:.0f} GB/s bidirectional; {c['source']}) --",
             "  t = max(FLOP / peak, HBM bytes / HBM BW, collective bytes / (ICI / 2)); "
             "leaves out small-collective latency, overlap, kernel efficiency"]
    kb = speed["decode_key_blocks"]
    rows = [("decode", "decode", f"the rollout's average step ({kb['mean']:.2f} own key blocks, "
                                 f"between {kb['decode_step']:.0f} and {kb['decode_last']:.0f}), "
                                 f"{speed['decode_rows_per_chip']:.0f} rows/chip"),
            ("decode_last", "decode_last", "the last step, full cache"),
            ("reshard", "reshard", "learner -> sampler weights, once per RL step"),
            ("learner", "learner", "the whole step (microbatches x one)")]
    if "paged_decode" in speed:
        pg = speed["paged_decode_own_pages"]
        rows.append(("paged", "paged_decode",
                     f"the paged engine's average step, prompt pages once per group, "
                     f"{pg['mean']:.2f} own pages between {pg['decode_step']:.0f} and "
                     f"{pg['decode_last']:.0f}; {speed['paged_decode_tok_s_chip']:,.0f} tokens/s per chip"))
    for label, name, note in rows:
        r = speed[name]
        lines.append(f"  {label:<11} {r['flops'] / 1e12:9.3f} TFLOP {r['hbm_bytes'] / GB:9.3f} GB HBM "
                     f"{r['collective_bytes'] / GB:9.3f} GB coll -> {r['seconds'] * 1e3:10.3f} ms "
                     f"({r['bound']}-bound; {note})")
    lines += [
        f"  decode: {speed['decode_tok_s_chip']:,.0f} tokens/s per chip "
        f"(= {speed['decode_rows_per_chip']:.0f} rows / {speed['decode']['seconds'] * 1e3:.3f} ms; "
        f"{speed['decode_last_tok_s_chip']:,.0f} at the last step)",
        f"  decode bound from the bytes a step must read (exact from the shardings, analytic): weights "
        f"{speed['decode_min']['weights'] / GB:.2f} GB + KV {speed['decode_min']['kv'] / GB:.2f} GB -> "
        f"{speed['decode_min']['seconds'] * 1e3:.3f} ms, {speed['decode_min_tok_s_chip']:,.0f} tokens/s per chip. "
        "The compiled figure is the one this report uses; the bound is what a step cannot do without",
        f"  learner FLOPs / (6 x N_act x trained tokens {speed['trained_tokens']:,}) = "
        f"{speed['learner_flops_ratio']:.2f} (trained tokens: each prompt once + G completions)",
        f"  RL step estimate {speed['step_s_estimate']:.1f} s = prefill {speed['prefill_s']:.1f} "
        f"(analytic, at the MFU) + decode {speed['rollout_s'] - speed['prefill_s']:.1f} + reshard "
        f"{speed['reshard_s']:.3f} + learner {speed['learner_s']:.1f}",
    ]
    return lines
