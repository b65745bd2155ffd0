"""The dry run's report (``ace_jax.train.dry_run.run_dry_run``) as text (``format_report``) and as
the one-line JSON result (``summary``)."""
from __future__ import annotations

from ace_jax.train.dry_run_analytic import GB
from ace_jax.train.dry_run_speed import format_speed

# What to change when a program does not fit.
_KNOBS = {
    "learner_step": "raise optim.microbatches (fewer rows per chip at once), shorten "
                    "rl.max_prompt_tokens / sampling.max_new_tokens, or add chips",
    "generate_rollout": "lower rl.batch_states (fewer rows, smaller KV cache), shorten "
                        "rl.max_prompt_tokens / sampling.max_new_tokens, or add chips",
    "engine_decode": "lower engine.num_pages (the page pool) or engine.slots, or add chips",
    "engine_prefill": "lower engine.prefill_chunk or engine.num_pages, or add chips",
}


def _coresident(report: dict) -> dict[str, int]:
    """What sits on a chip at once, per phase of a step (bytes per chip), from the compiled
    programs: during the rollout, the sampler's program at its peak plus the learner's state
    that stays on chip (master params and AdamW moments: ``learner_state_bytes``); during the
    learner step, its peak plus what the sampler keeps between rollouts: the engine's whole
    argument set (the sampler's weights, their per-layer slices, the page pool and the slots'
    state: `engine.Engine` holds them from call to call), else the static rollout's arguments
    (the sampler's weights, `generate.Generator.params`; its cache is the program's own). The
    sampler is the engine where its programs compiled, else the static rollout. Empty without
    a compiled learner step and sampler, or without the learner state's size."""
    comp, me = report["compiled"], report["memory"]
    learner, state = comp.get("learner_step"), me.get("learner_state_bytes")
    sampler = comp.get("engine_decode") or comp.get("generate_rollout")
    if not learner or not sampler or state is None or not (learner["ok"] and sampler["ok"]):
        return {}
    engine = [comp[k] for k in ("engine_decode", "engine_prefill") if k in comp]
    rollout_peak = max(c["peak_bytes"] for c in engine) if engine else sampler["peak_bytes"]
    return dict(rollout_coresident_gb=rollout_peak + state,
                learner_coresident_gb=learner["peak_bytes"] + sampler["argument_bytes"])


def summary(report: dict) -> dict:
    """The one-line JSON result: topology, chips, HBM, and per program the compiled peak per chip
    (decimal GB) and whether everything fits. Without a compile, the analytic totals stand in
    for the peaks (``compiled`` false)."""
    hw, me, sh = report["hardware"], report["memory"], report["shapes"]
    comp = report["compiled"]
    frac = report["max_hbm_fraction"]
    out = dict(topology=report["topology"] or None, chips=hw["chips"],
               hbm_gb=round(me["hbm_bytes"] / GB, 3), compiled=bool(comp),
               prompt_tokens=sh["prompt_len"], new_tokens=sh["new_tokens"],
               batch_states=sh["prompts"], group_size=sh["group_size"])
    fits = True
    for name, key, analytic in (("learner_step", "learner", me["train_total"]),
                                ("generate_rollout", "rollout", me["generate_total"])):
        c = comp.get(name)
        peak = c["peak_bytes"] if c else analytic
        ok = (c["ok"] and peak <= frac * me["hbm_bytes"]) if c else peak <= frac * me["hbm_bytes"]
        out[f"{key}_peak_gb"] = round(peak / GB, 3)
        out[f"{key}_fits"] = bool(ok)
        if c:
            out[f"{key}_compile_s"] = round(c["compile_s"], 1)
            out[f"{key}_tflops"] = round(c["flops"] / 1e12, 3)
            if not c["ok"] and not c["oom"]:
                out[f"{key}_error"] = c["error"][:300]
        fits = fits and ok
    engine = [comp[k] for k in ("engine_decode", "engine_prefill") if k in comp]
    if engine:          # the paged engine's programs (the trainer's sampler), where compiled
        peak = max(c["peak_bytes"] for c in engine)
        out["engine_peak_gb"] = round(peak / GB, 3)
        out["engine_fits"] = all(c["ok"] for c in engine) and peak <= frac * me["hbm_bytes"]
        fits = fits and out["engine_fits"]
        # copies of a pool array in the compiled calls' HLO (a layout conversion of the
        # KV pool, or a copy of it in the decode loop): HBM traffic no kernel's cost declares
        for name, key in (("engine_decode", "engine_pool_copies"),
                          ("engine_prefill", "engine_prefill_pool_copies")):
            copies = report.get("lowering", {}).get(name, {}).get("pool_copies")
            if copies is not None:
                out[key] = len(copies)
    coresident = _coresident(report)
    if coresident:
        out.update({k: round(v / GB, 3) for k, v in coresident.items()})
        ok = max(coresident.values()) <= frac * me["hbm_bytes"]
        out["coresident_fits"] = bool(ok)
        fits = fits and ok
    out["fits"] = fits
    routes = _routes_bytes(me)
    if routes:          # the learner's MoE routing record (grpo.routing_replay = "R3")
        out["learner_routes_mb"] = round(routes / 1e6, 3)
    sp = report.get("speed") or {}
    if sp:
        out.update(decode_tok_s_chip=round(sp["decode_tok_s_chip"], 1),
                   decode_min_tok_s_chip=round(sp["decode_min_tok_s_chip"], 1),
                   decode_hbm_gb=round(sp["decode_hbm_gb"], 3),
                   decode_collective_gb=round(sp["decode_collective_gb"], 4),
                   reshard_s=round(sp["reshard_s"], 4),
                   learner_flops_ratio=round(sp["learner_flops_ratio"], 3),
                   step_s_estimate=round(sp["step_s_estimate"], 1), decode_engine=sp["decode_engine"])
        if sp.get("host_round_trips_s"):
            out["host_round_trips_s"] = round(sp["host_round_trips_s"], 3)
        for key in ("decode_tok_s_chip_serial", "decode_serial_floor_tok_s_chip",
                    "decode_useful_tok_s_chip"):
            if key in sp:
                out[key] = round(sp[key], 1)
        if "paged_decode_tok_s_chip" in sp:
            out.update(paged_decode_tok_s_chip=round(sp["paged_decode_tok_s_chip"], 1),
                       paged_decode_hbm_gb=round(sp["paged_decode_hbm_gb"], 3))
    failed = [k for k, v in report.get("cost_programs", {}).items() if not v["ok"]]
    if failed:
        out["cost_program_errors"] = {k: report["cost_programs"][k]["error"][:200] for k in failed}
    return out



def _routes_bytes(memory: dict) -> int:
    """The learner's routing record per chip: as the compiled learner step takes it when it was
    compiled, else exact from its sharding; 0 without a record."""
    compiled = memory.get("routes_compiled_bytes")
    return int(memory.get("routes_bytes", 0) if compiled is None else compiled)


# ------------------------------------------------------------------------------------ printing

def _gb(x: float) -> str:
    """Bytes in decimal units, right-aligned: '   1.91 GB', ' 286.55 kB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:9.2f} {unit}"
    return f"{x:9.0f} B "


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}"
    return f"{n:.0f}"


def format_report(report: dict) -> str:
    """A plain-text rendering of `run_dry_run`'s report (per-device memory, time, lowering)."""
    mo, hw, sh, me, ti = (report[k] for k in ("model", "hardware", "shapes", "memory", "time"))
    mesh = report["mesh"]
    lines = [
        f"== ace-jax dry run: {mo['preset']} on {hw['chips']} x {hw['chip']} ==",
        f"model   {_count(mo['total_params'])} params, {_count(mo['active_params'])} active "
        f"({_count(mo['matmul_active_params'])} matmul), {mo['layers']} layers, "
        f"{mo['experts']} experts top-{mo['top_k']}, compute {mo['dtype']}, master {mo['param_dtype']}, "
        f"remat {mo['remat']}, moe {mo['moe_dispatch']}",
        "mesh    " + " x ".join(f"{a}={s}" for a, s in mesh["shape"].items())
        + f"  ({'abstract' if mesh['abstract'] else 'real devices'}, lowered for {mesh['platform']})",
        f"batch   {sh['prompts']} states x G={sh['group_size']} = {sh['rows']} rollouts of "
        f"{sh['prompt_len']} prompt + {sh['new_tokens']} new = {sh['seq_len']} tokens; "
        f"{sh['microbatches']} microbatches, {sh['rows_per_device_microbatch']} row(s) per device each",
        "",
        f"-- memory per device, learner step (HBM {hw['hbm_gb_per_chip']:.0f} GB) --",
    ]
    for item in me["train"]:
        lines.append(f"  {item['name']:<38}{_gb(item['bytes'])}   {item['note']}")
    lines.append(f"  {'TOTAL':<38}{_gb(me['train_total'])}   "
                 f"{'fits' if me['train_fits'] else 'DOES NOT FIT'} "
                 f"({100 * me['train_total'] / me['hbm_bytes']:.0f}% of HBM)")
    lines.append("")
    lines.append("-- memory per device, generation --")
    for item in me["generate"]:
        lines.append(f"  {item['name']:<38}{_gb(item['bytes'])}   {item['note']}")
    lines.append(f"  {'TOTAL':<38}{_gb(me['generate_total'])}   "
                 f"{'fits' if me['generate_fits'] else 'DOES NOT FIT'} "
                 f"({100 * me['generate_total'] / me['hbm_bytes']:.0f}% of HBM)")
    row = lambda name, secs, note: f"  {name:<38}{secs:9.1f} s    {note}"  # noqa: E731
    lines += [
        "",
        f"-- time per RL step, analytic (MFU {hw['mfu']:.0%}, bandwidth efficiency "
        f"{hw['hbm_bw_efficiency']:.0%}; the spec's decode layout, not the sampler's: the compiled "
        f"speed section below is the estimate) --",
        row("train (fwd + bwd)", ti["train_s"], f"{ti['train_flops']:.3e} FLOP, "
            f"{ti['train_flops_per_token'] / 1e9:.1f} GFLOP/token"),
        row("prefill", ti["prefill_s"], f"{ti['prefill_flops']:.3e} FLOP"),
        row(f"decode ({hw['decode_replicas']} model replicas)", ti["decode_s"],
            f"HBM bound, {ti['generated_tokens']} tokens, {ti['kv_bytes_per_token']} B KV/token"),
        row("step", ti["step_s"], "lower bound: no sampling, host or sandbox overhead"),
        row("decode, worst case", ti["decode_worst_case_s"],
            f"if XLA all-gathers the FSDP weights every step "
            f"({_gb(ti['decode_gathered_bytes_per_step']).strip()}/device/step)"),
        row("step, worst case", ti["step_worst_case_s"], ""),
        "",
        "-- lowering --",
    ]
    for name, r in report["lowering"].items():
        if r.get("ok"):
            lines.append(f"  {name:<18} ok   trace {r['trace_s']:.1f} s, lower {r['lower_s']:.1f} s, "
                         f"{r['hlo_chars'] / 1e6:.1f} M chars of StableHLO")
        else:
            lines.append(f"  {name:<18} FAILED  {r.get('error', '')}")
    if not report["lowering"]:
        lines.append("  skipped (dry_run.lower = False)")
    comp = report.get("compiled", {})
    if comp:
        hbm = me["hbm_bytes"]
        lines += ["", f"-- compiled by XLA's TPU compiler for {report['topology'] or mesh['platform']} "
                      f"(per chip; HBM {hbm / GB:.2f} GB) --"]
        analytic = {"learner_step": me["train_total"], "generate_rollout": me["generate_total"]}
        for name, r in comp.items():
            if r["ok"]:
                lines.append(
                    f"  {name:<18} arguments {_gb(r['argument_bytes']).strip()}, temporaries "
                    f"{_gb(r['temp_bytes']).strip()}, outputs {_gb(r['output_bytes']).strip()}, "
                    f"aliased {_gb(r['alias_bytes']).strip()}")
                lines.append(
                    f"  {'':<18} PEAK {_gb(r['peak_bytes']).strip()} = "
                    f"{100 * r['peak_bytes'] / hbm:.0f}% of HBM "
                    f"({'fits' if r['peak_bytes'] <= report['max_hbm_fraction'] * hbm else 'DOES NOT FIT'}); "
                    + (f"analytic estimate {_gb(analytic[name]).strip()} "
                       f"({(analytic[name] - r['peak_bytes']) / GB:+.2f} GB); "
                       if name in analytic else "") +
                    f"{r['flops'] / 1e12:.1f} TFLOP (XLA cost analysis: loop bodies counted once); "
                    f"compiled in {r['compile_s']:.0f} s")
                if name == "learner_step" and me.get("routes_compiled_bytes") is not None:
                    lines.append(
                        f"  {'':<18} of its arguments, the MoE routing record (R3): "
                        f"{_gb(me['routes_compiled_bytes']).strip()} (its input `routes`; from "
                        f"the shardings {_gb(me.get('routes_bytes', 0)).strip()})")
            elif r["oom"]:
                lines.append(f"  {name:<18} DOES NOT FIT: the compiler needs "
                             f"{_gb(r['peak_bytes']).strip()} of temporaries, "
                             f"{(r['peak_bytes'] - hbm) / GB:.1f} GB over HBM; to fit: "
                             f"{_KNOBS.get(name, '')}")
            else:
                lines.append(f"  {name:<18} compile FAILED  {r['error']}")
    elif report.get("not_compiled"):
        lines += ["", f"-- not compiled: {report['not_compiled']} --"]
    lines += format_speed(report.get("speed") or {})
    if report["checks"]:
        lines += ["", "-- cross-checks against reference/qwen3_moe_spec.md §5 --"]
        for c in report["checks"]:
            lines.append(f"  {c['name']:<24} ours {c['ours']:>18,.2f}  spec {c['spec']:>18,.2f}  "
                         f"{'ok' if c['ok'] else 'MISMATCH'}")
    lines.append(f"\n(dry run took {report['timings_s']['total']:.1f} s)")
    return "\n".join(lines)
