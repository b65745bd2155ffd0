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

The serial figure (``*_serial``) charges what the max leaves out, per chip and step:

    t_serial = max(FLOPs / peak, HBM bytes / HBM BW) + sum_ops(bytes / axes) / ICI_axis
               + ICI hops x hop latency

compute and HBM overlapping inside a kernel but no collective overlapping either; ICI_axis is
one torus axis's bidirectional bandwidth (a collective along one axis uses its two links, not
the chip's six; one over a plane of two axes has both axes' links: the scaling book's
n_axes), the hops and each op's axes are read from the compiled HLO and its chips' places on
the torus (`tpu_compile.collective_hops`), and a hop's latency is the table's constant with its
source (`CHIPS`). The scaling book takes a collective's time as the max of its latency and
its bytes' time; the serial figure adds them. It is the figure the RL
step estimate uses for the decode of the engine the config runs (``decode_engine``).

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

from typing import Any, Sequence

from ace_jax.train.dry_run_analytic import GB

__all__ = ["CHIPS", "extrapolate", "at_blocks", "roofline", "serial", "serial_floor",
           "hops_per_layer", "average_step", "paged_decode", "useful_fraction",
           "completion_lengths", "speed_section"]

# Per chip. Source: Google Cloud's TPU v5p documentation, as gathered in reference/tpu_aot.md.
# ``ici_axis_gbps`` and ``hop_latency_us`` (the serial figure's): the scaling book ("How to Scale
# Your Model", jax-ml/scaling-book): tpus.md's table gives v5p 9e10 B/s one-way per link,
# 1.8e11 bidirectional (one axis with its wraparound); sharding.md: "Each hop over an ICI link
# has some intrinsic overhead regardless of the data volume. This is typically around 1us" (its
# own profile of a 3-hop gather took ~8 us, so 1 us per hop is a floor).
CHIPS: dict[str, dict[str, Any]] = {
    "TPU v5p": dict(peak_tflops_bf16=459.0, hbm_gbps=2765.0, ici_gbps=1200.0, hbm_gib=95.0,
                    ici_axis_gbps=180.0, hop_latency_us=1.0,
                    source="Google Cloud TPU v5p documentation (459 TFLOP/s bf16, 95 GiB HBM2e at "
                           "2,765 GB/s, ICI 1,200 GB/s bidirectional per chip); per axis 180 GB/s "
                           "and 1 us per ICI hop from the scaling book (jax-ml/scaling-book)"),
}


def _cost(c: dict) -> dict[str, float]:
    total = float(c["collective_bytes"].get("total", 0))
    hops = c.get("collective_hops") or {}
    return dict(flops=float(c["flops"]), hbm_bytes=float(c["hbm_bytes"]),
                collective_bytes=total, hops=float(hops.get("hops", 0)),
                axis_bytes=float(hops.get("axis_bytes", total)))


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


def serial(cost: dict[str, float], chip: dict[str, float]) -> dict[str, Any] | None:
    """The serial seconds of one program per chip (see the module docstring); None when the
    chip has no per-axis ICI figure or hop latency (`CHIPS`)."""
    if chip.get("ici_axis_gbps") is None or chip.get("hop_latency_us") is None:
        return None
    compute_s = max(cost["flops"] / (chip["peak_tflops_bf16"] * 1e12),
                    cost["hbm_bytes"] / (chip["hbm_gbps"] * GB))
    ici_s = cost.get("axis_bytes", cost["collective_bytes"]) / (chip["ici_axis_gbps"] * GB)
    latency_s = cost["hops"] * chip["hop_latency_us"] * 1e-6
    return dict(compute_s=compute_s, ici_axis_s=ici_s, latency_s=latency_s, hops=cost["hops"],
                seconds=compute_s + ici_s + latency_s)


def serial_floor(step_serial: dict[str, Any], min_hbm_s: float) -> dict[str, float]:
    """The serial figure's floor for a decode step of this mesh and batch: ``step_serial``'s
    (`serial`) collectives, bytes and hops, as compiled, after an HBM term of ``min_hbm_s``
    (the step's weights and K / V read once and nothing else: `dry_run_analytic.
    decode_min_bytes` at the HBM bandwidth). What the serial figure could reach if every other
    byte of HBM traffic went, the collectives unchanged. Seconds."""
    return dict(hbm_s=min_hbm_s, ici_axis_s=step_serial["ici_axis_s"],
                latency_s=step_serial["latency_s"],
                seconds=min_hbm_s + step_serial["ici_axis_s"] + step_serial["latency_s"])


def chip_figures(dry) -> dict[str, Any]:
    """The chip's figures: the config's ``dry_run`` values, with the table's source when the chip
    is in `CHIPS` (and then its per-axis ICI bandwidth and hop latency, else None)."""
    known = CHIPS.get(str(dry.chip), {})
    return dict(chip=str(dry.chip), peak_tflops_bf16=float(dry.peak_tflops_bf16),
                hbm_gbps=float(dry.hbm_bw_gbps), ici_gbps=float(dry.ici_gbps),
                ici_axis_gbps=known.get("ici_axis_gbps"), hop_latency_us=known.get("hop_latency_us"),
                source=known.get("source", "the config's dry_run section"))


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


def useful_fraction(lengths: Sequence[int], slots: int, sync_every: int = 1) -> dict[str, float]:
    """The share of a rollout's decode slot-steps that make a token the learner keeps.

    ``len(lengths)`` rows of those completion lengths (tokens, each >= 1), in order, on
    ``slots`` slots, in calls of ``sync_every`` steps: a row enters a free slot at a call's start
    and decodes until its length; its slot then idles to the call's end; the rollout lasts until
    the last row ends (the learner waits for it). The static generator is ``slots = rows``,
    ``sync_every = 1``. Returns {"steps": decode steps, "fraction": sum(lengths) / (slots x
    steps)}."""
    if not lengths or slots < 1 or sync_every < 1 or min(lengths) < 1:
        raise ValueError(f"need rows of >= 1 token, slots >= 1 and sync_every >= 1, got "
                         f"{len(lengths)} rows (min {min(lengths, default=0)}), {slots}, {sync_every}")
    queue, running, steps = list(lengths), [], 0
    while queue or running:
        while queue and len(running) < slots:
            running.append(queue.pop(0))
        running = [r - sync_every for r in running if r > sync_every]
        steps += sync_every
    return dict(steps=float(steps), fraction=sum(lengths) / (slots * steps))


def completion_lengths(mix: str, rows: int, new_tokens: int) -> list[int]:
    """``rows`` completion lengths from ``mix`` ("0.25,0.5,1": fractions of the new-token budget,
    cycled over the rows), each at least one token."""
    try:
        fracs = [float(x) for x in str(mix).split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(f"dry_run.completion_mix {mix!r}: fractions separated by commas") from e
    if not fracs or not all(0 < f <= 1 for f in fracs):
        raise ValueError(f"dry_run.completion_mix {mix!r}: fractions in (0, 1] of the budget")
    return [max(1, round(fracs[i % len(fracs)] * new_tokens)) for i in range(rows)]


def hops_per_layer(one: dict, two: dict) -> dict[str, list[int]]:
    """A layer's collectives by kind and group size, {"<kind> x<n>": [ops, hops]}: the 2-layer
    program's (`tpu_compile.collective_hops` ``by_group``) less the 1-layer program's."""
    g1, g2 = ((c.get("collective_hops") or {}).get("by_group", {}) for c in (one, two))
    out = {k: [g2.get(k, [0, 0])[i] - g1.get(k, [0, 0])[i] for i in (0, 1)] for k in {*g1, *g2}}
    return {k: v for k, v in sorted(out.items()) if v != [0, 0]}


def _serial_fields(prefix: str, step: dict[str, Any], chip: dict, rows_per_chip: float,
                   compiled: dict[str, dict], program: str) -> dict:
    s = serial(step, chip)
    if s is None:
        return {}
    s["per_layer"] = hops_per_layer(compiled[f"{program}_L1"], compiled[f"{program}_L2"])
    return {f"{prefix}decode_serial": s,
            f"{prefix}decode_tok_s_chip_serial": rows_per_chip / s["seconds"]}


def speed_section(compiled: dict[str, dict], *, dry, shp: dict[str, int], layers: int, chips: int,
                  n_act: int, prefill_s: float, decode_min: dict[str, float],
                  key_blocks: dict[str, float], paged_pages: dict[str, float] | None = None,
                  engine_kind: str = "static", slots: int = 0, sync_every: int = 1,
                  completion_mix: str = "", host_round_trip_s: float = 0.0) -> dict[str, Any]:
    """The report's ``speed`` section from the cost programs (`cost_programs`), or {} when any
    is missing or failed. Per chip; seconds; tokens/s. ``decode_min``: the bytes a decode step
    must read at the mean fill (`dry_run_analytic.decode_min_bytes`), whose HBM time is the
    bound beside the compiled figure; ``key_blocks``: `dry_run_programs.decode_key_blocks`;
    ``paged_pages``: `dry_run_programs.paged_decode_pages` (the paged engine's decode figures,
    ``paged_decode*``, when its programs compiled). ``engine_kind`` (the resolved
    ``config.engine.kind``) names the engine whose decode the RL step estimate and
    ``decode_tok_s_chip_serial`` price (``decode_engine``): the paged engine's figures when they
    compiled, else the static generator's. ``completion_mix`` (`completion_lengths`; "" for
    none), ``slots`` and ``sync_every`` (the paged engine's) give ``decode_useful_tok_s_chip``:
    the serial figure times `useful_fraction`. ``decode_serial_floor_tok_s_chip``: the serial
    figure with the HBM term at ``decode_min`` (`serial_floor`). ``host_round_trip_s``: the
    paged engine's host round trip per decode call (``dry_run.host_round_trip_ms``), added to
    its rollout once per ``sync_every`` steps (``host_round_trips_s``)."""
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
    # tokens the step trains on: each group's prompt once and its G completions
    trained_tokens = b * (p + g * m)
    learner_flops_ratio = learner["flops"] * chips / (6.0 * n_act * trained_tokens)
    paged = None if paged_pages is None else paged_decode(compiled, layers, paged_pages, chip)
    out = _serial_fields("static_", decode, chip, rows_per_chip, compiled, "decode_step")
    if paged is not None:
        out.update(paged_decode=paged, paged_decode_own_pages=dict(paged_pages),
                   paged_decode_tok_s_chip=rows_per_chip / paged["seconds"],
                   paged_decode_hbm_gb=paged["hbm_bytes"] / GB,
                   **_serial_fields("paged_", paged, chip, rows_per_chip, compiled,
                                    "paged_decode_step"))
    engine = "paged" if engine_kind == "paged" and paged is not None else "static"
    runs = out.get(f"{engine}_decode_serial")
    min_s = decode_min["total"] / (chip["hbm_gbps"] * GB)
    if runs is not None:
        floor = serial_floor(runs, min_s)
        out.update(decode_tok_s_chip_serial=out[f"{engine}_decode_tok_s_chip_serial"],
                   decode_serial_floor=floor,
                   decode_serial_floor_tok_s_chip=rows_per_chip / floor["seconds"])
        if completion_mix:
            lengths = completion_lengths(completion_mix, n, m)
            use = (useful_fraction(lengths, slots or n, sync_every) if engine == "paged"
                   else useful_fraction(lengths, n))
            out.update(decode_useful=dict(use, mix=completion_mix),
                       decode_useful_tok_s_chip=out["decode_tok_s_chip_serial"] * use["fraction"])
    # the engine's decode: serial seconds where the chip's constants are known, else the max
    round_trips_s = -(-m // sync_every) * host_round_trip_s if engine == "paged" else 0.0
    rollout_s = (prefill_s + m * (runs or (paged if engine == "paged" else decode))["seconds"]
                 + round_trips_s)
    step_s = rollout_s + reshard["seconds"] + learner["seconds"]
    return dict(
        out, decode_engine=engine,
        chip=chip, decode=decode, decode_last=last, reshard=reshard, learner=learner,
        decode_rows_per_chip=rows_per_chip, decode_key_blocks=dict(key_blocks),
        decode_tok_s_chip=decode_tok_s_chip,
        decode_last_tok_s_chip=rows_per_chip / last["seconds"],
        decode_min=dict(decode_min, seconds=min_s), decode_min_tok_s_chip=rows_per_chip / min_s,
        decode_hbm_gb=decode["hbm_bytes"] / GB, decode_collective_gb=decode["collective_bytes"] / GB,
        reshard_s=reshard["seconds"], learner_flops_ratio=learner_flops_ratio,
        trained_tokens=trained_tokens, prefill_s=prefill_s, host_round_trips_s=round_trips_s,
        rollout_s=rollout_s,
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
    ]
    for engine in ("static", "paged"):
        s = speed.get(f"{engine}_decode_serial")
        if s:
            lines.append(
                f"  {engine} decode, serial: {speed[f'{engine}_decode_tok_s_chip_serial']:,.0f} "
                f"tokens/s per chip (= max(FLOP, HBM) {s['compute_s'] * 1e3:.3f} ms + ICI at "
                f"{c['ici_axis_gbps']:.0f} GB/s per axis {s['ici_axis_s'] * 1e3:.3f} ms + "
                f"{s['hops']:.0f} hops x {c['hop_latency_us']:g} us {s['latency_s'] * 1e3:.3f} ms); "
                f"a layer's collectives [ops, hops]: "
                + ", ".join(f"{k} {v}" for k, v in s.get("per_layer", {}).items()))
    if "decode_serial_floor" in speed:
        f = speed["decode_serial_floor"]
        lines.append(
            f"  serial floor: {speed['decode_serial_floor_tok_s_chip']:,.0f} tokens/s per chip "
            f"(the {speed['decode_engine']} engine's serial step with HBM at the bound above: "
            f"{f['hbm_s'] * 1e3:.3f} + ICI {f['ici_axis_s'] * 1e3:.3f} + hops "
            f"{f['latency_s'] * 1e3:.3f} ms; what no saving of HBM traffic alone can pass)")
    if "decode_useful" in speed:
        u = speed["decode_useful"]
        lines.append(
            f"  useful decode: {speed['decode_useful_tok_s_chip']:,.0f} tokens/s per chip (serial x "
            f"{u['fraction']:.3f}: completions at {u['mix']} of the budget, the rollout "
            f"{u['steps']:.0f} steps until its longest row ends; an illustrative mix, not measured)")
    trips = speed.get("host_round_trips_s", 0.0)
    decode_s = speed["rollout_s"] - speed["prefill_s"] - trips
    lines.append(
        f"  RL step estimate {speed['step_s_estimate']:.1f} s = prefill {speed['prefill_s']:.1f} "
        f"(analytic, at the MFU) + decode {decode_s:.1f} (the {speed['decode_engine']} engine, "
        f"serial where the chip's constants are known) + host round trips {trips:.2f} "
        f"(dry_run.host_round_trip_ms per engine call, measured on 2 CPU processes) + reshard "
        f"{speed['reshard_s']:.3f} + learner {speed['learner_s']:.1f}")
    return lines
