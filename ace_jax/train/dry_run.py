"""The production dry run: compile what trains for the target slice, and report its memory.

``python -m ace_jax --config=configs/ace30b.py --dry_run`` calls `run_dry_run(config)`,
prints `dry_run_report.format_report` and, last, `dry_run_report.summary` as one JSON line (exit
status 1 when a program does not fit). Nothing is allocated and no weights are read:

1. the policy is built with ``nnx.eval_shape`` (parameter shapes and logical axes only), the
   optimizer state with ``jax.eval_shape(tx.init, ...)``;
2. every sharding comes from the trainer's own `placement.Placement` (``config.mesh`` and its
   rules) over the abstract devices of ``dry_run.topology`` (XLA's TPU compiler, libtpu, runs on
   any host: `ace_jax.runtime.tpu_compile`), over real devices given as ``devices=`` (e.g. 8 simulated CPU
   devices in the tests), or, with neither, over an `AbstractMesh` of ``dry_run.num_chips``;
3. THE jitted functions the trainer runs, `learner.jit_learner_step` and `generate._rollout`, are
   traced, lowered and (with devices) COMPILED from ``ShapeDtypeStruct`` inputs carrying those
   shardings; the model takes the target's code paths (``ModelConfig.platform``: splash attention
   and ``ragged_dot`` MoE on TPU). With ``grpo.routing_replay = "R3"`` the learner step's batch
   carries the MoE routing record (uint8 ``[rows, T, L_moe, k]``, split as the trainer splits
   the batch) and its bytes per chip are read from the compiled program's inputs. XLA's per-chip figures (arguments, temporaries, outputs,
   aliases, their peak against the chip's HBM as the compiler states it, FLOPs, compile time)
   are reported per program (`ace_jax.train.dry_run_programs`);
4. beside them an analytic table: exact per-device bytes of parameters, optimizer state, gradient
   buffers, batch and KV cache from the shardings, and labelled estimates of the activations,
   with its difference from the compiled peak (`ace_jax.train.dry_run_analytic`);
5. time is projected with the formulas of ``reference/qwen3_moe_spec.md`` §5.4-5.5: training FLOPs
   ``rows x T x (6 N_act + 6 L nq d T)`` at the stated MFU, prefill FLOPs at the same MFU, decode as
   HBM-bandwidth bound ``M x (replicas x bf16 weights + KV bytes read) / (chips x BW x eff)``.

Units: bytes and decimal GB (1 GB = 1e9 B; the compiler's own messages print GiB), FLOP,
seconds. "Per device" means per chip.

6. speed from compiled programs (`ace_jax.train.dry_run_speed`, with compile): a decode step of
   the sampler in its own layout (`sampler_layout`), the learner -> sampler resharding and a
   learner microbatch, compiled with unrolled layers (`dry_run_programs.cost_programs`); their
   FLOPs, HBM bytes and collective bytes give a roofline per program, the decode tokens/s per
   chip, the learner's FLOPs against 6 N_act per trained token and an RL step estimate.

The analytic decode estimate of 5. assumes ``dry_run.decode_replicas`` model replicas each reading
its weights once per step (spec §5.5); the compiled figures of 6. are the measure.
"""
from __future__ import annotations

import math
import time
from typing import Any

import jax
import ml_collections
from flax import nnx
from jax.sharding import AbstractMesh

from ace_jax.rl import learner
from ace_jax.runtime import (engine_config, generate, placement as placement_lib, sampler_layout,
                             sharding, tpu_compile)
from ace_jax.train import dry_run_analytic as analytic
from ace_jax.train.dry_run_analytic import GB
from ace_jax.train import dry_run_speed
from ace_jax.train.dry_run_programs import (abstract_batch, cost_programs, decode_key_blocks,
                                           entry_parameter_bytes, learner_routes, lower_programs,
                                           paged_decode_pages)
from models import configs as model_configs
from models import qwen3
from models.attention import resolve_attention_impl

# Published numbers of reference/qwen3_moe_spec.md §5 that the report checks itself against.
SPEC_REFERENCE: dict[str, dict[str, float]] = {
    "qwen3_30b_a3b": {
        "total_params": 30_532_122_624,          # §5.1
        "matmul_active_params": 3_041_865_728,   # §5.1 N_act (layers + lm_head)
        "kv_bytes_per_token": 98_304,            # §5.3 (bf16)
        "state_bytes_per_param": 16.0,           # §5.2 fp32 params + Adam mu, nu + fp32 grads
    },
}


# `engine_host_gather_ms` of `bash scripts/pod_rehearsal.sh --reduced` at commit 4f7054a,
# 2026-12-07: 15.42 ms per decode call (2 processes on one 2-core machine, a niced experiment
# beside it; the rehearsal's engine shapes, not the pod's)
HOST_ROUND_TRIP_MS = 15.4


def default_config() -> ml_collections.ConfigDict:
    """The ``dry_run`` config section: the target hardware and the projection's assumptions."""
    c = ml_collections.ConfigDict()
    c.chip = "TPU v5p"
    c.num_chips = 64                 # chips (not TensorCores: v5p-128 = 64 chips)
    c.hbm_gb_per_chip = 95.0         # decimal GB
    c.peak_tflops_bf16 = 459.0       # per chip, dense bf16
    c.hbm_bw_gbps = 2765.0           # per chip, GB/s
    c.ici_gbps = 1200.0              # per chip, bidirectional GB/s (half is used as receive BW)
    c.mfu = 0.4                      # assumed model-FLOPs utilisation of training and prefill
    c.hbm_bw_efficiency = 0.5        # assumed fraction of peak HBM bandwidth reached by decode
    c.decode_replicas = 8            # model replicas during decode (spec §5.5: 8 on v5p-128)
    c.prompt_tokens = 0              # 0: rl.max_prompt_tokens rounded up to sampling.prompt_bucket
    c.new_tokens = 0                 # 0: sampling.max_new_tokens
    c.platform = "tpu"               # lowering target for the abstract mesh (no topology)
    c.lower = True                   # trace + lower the learner step and the rollout
    # With a topology and libtpu installed, both programs are COMPILED by XLA's TPU compiler for
    # that slice (one abstract device per chip; num_chips and hbm_gb_per_chip then come from the
    # compiler) and their real per-chip memory is reported; "" = the abstract plan only.
    c.topology = ""                  # e.g. "v5p:4x4x4" (64 chips)
    c.max_hbm_fraction = 1.0         # a compiled program "fits" when its peak <= this x HBM
    # decode_useful_tok_s_chip's completion lengths: fractions of the new-token budget, cycled
    # over the rollout's rows (illustrative, not measured; "" for no useful figure)
    c.completion_mix = "0.25,0.5,0.75,1.0"
    # the paged engine's host round trip per decode call (gathering the call's results across
    # the processes, once computed): the RL step estimate adds it per call (new tokens /
    # engine.sync_every calls). Measured, not modelled (where: HOST_ROUND_TRIP_MS); a pod's 16
    # hosts over its data-centre network are not measured.
    c.host_round_trip_ms = HOST_ROUND_TRIP_MS
    return c


class DryRunConfigError(ValueError):
    """A config value the dry run cannot use (the message names the field)."""


def _section(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    if name not in config:
        raise DryRunConfigError(f"the config has no {name!r} section")
    return config[name]


def build_model_config(config: ml_collections.ConfigDict) -> model_configs.ModelConfig:
    """The policy's `ModelConfig` from the ``model`` section: the preset with ``overrides``, and,
    when ``hf_path`` is set, the ``runtime`` fields the real run applies on top of its config.json
    (which the dry run does not read: the architecture comes from the preset)."""
    m = _section(config, "model")
    overrides = dict(m.get("overrides", {}) or {})
    if m.get("hf_path", "") and "runtime" in m:
        overrides.update(dict(m.runtime))
    return model_configs.get_model_config(m.preset, **overrides)


def build_mesh(config: ml_collections.ConfigDict, devices: Any = None):
    """(mesh, is_abstract): an `AbstractMesh` of ``dry_run.num_chips`` devices, or a real mesh
    over `devices` (e.g. the abstract TPU devices of `tpu_compile.topology_devices`)."""
    try:
        if devices is not None:
            return sharding.make_mesh(config.mesh, list(devices)), False
        n = int(config.dry_run.num_chips)
        if n < 1:
            raise DryRunConfigError(f"dry_run.num_chips must be >= 1, got {n}")
        sizes = sharding.resolve_mesh_shape(config.mesh, n)
    except sharding.MeshConfigError as e:
        raise DryRunConfigError(f"mesh: {e}") from None
    kinds = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    if config.mesh.axis_types not in kinds:
        raise DryRunConfigError(f"mesh.axis_types must be one of {sorted(kinds)}, got "
                                f"{config.mesh.axis_types!r}")
    mesh = AbstractMesh(tuple(sizes[a] for a in sharding.MESH_AXES), sharding.MESH_AXES,
                        axis_types=(kinds[config.mesh.axis_types],) * len(sharding.MESH_AXES))
    return mesh, True



# ------------------------------------------------------------------------------------ the run

def _shapes(config, mc) -> dict[str, int]:
    rl, smp, dry = config.rl, config.sampling, config.dry_run
    bucket = int(smp.prompt_bucket)
    p = int(dry.prompt_tokens) or int(math.ceil(int(rl.max_prompt_tokens) / bucket) * bucket)
    m = int(dry.new_tokens) or int(smp.max_new_tokens)
    b, g = int(rl.batch_states), int(rl.group_size)
    k = int(config.optim.microbatches)
    n = b * g
    for name, v in (("prompt tokens", p), ("new tokens", m), ("rl.batch_states", b),
                    ("rl.group_size", g), ("optim.microbatches", k)):
        if v < 1:
            raise DryRunConfigError(f"{name} must be >= 1, got {v}")
    if n % k:
        raise DryRunConfigError(f"rows = rl.batch_states x rl.group_size = {n} is not divisible by "
                                f"optim.microbatches = {k}")
    if p + m > mc.max_position_embeddings:
        raise DryRunConfigError(f"prompt {p} + new {m} tokens exceed the model's "
                                f"max_position_embeddings = {mc.max_position_embeddings}")
    return dict(prompts=b, group_size=g, rows=n, prompt_len=p, new_tokens=m, seq_len=p + m,
                microbatches=k, rows_per_microbatch=n // k)




def run_dry_run(config: ml_collections.ConfigDict, *, devices: Any = None,
                compile: bool | None = None) -> dict:
    """Build, shard, lower (and compile) the learner step and the rollout; project memory and time.

    Args:
      config: a full run config (sections model, mesh, rl, sampling, grpo, optim, dry_run).
      devices: None (default): the abstract TPU devices of ``dry_run.topology`` when it is set and
        libtpu is installed, else an `AbstractMesh` of ``dry_run.num_chips`` chips lowered for
        ``dry_run.platform``; or a list of real devices (e.g. ``jax.devices()``).
      compile: compile both programs and report XLA's memory analysis; None (default) = whenever
        the devices are real or a topology's (never for an `AbstractMesh`).

    Returns a report dict (see `dry_run_report`); memory values are bytes per device.
    Raises DryRunConfigError for a config it cannot use (unknown topology, a mesh that does not
    divide the chips, shapes), and tpu_compile.LibtpuMissingError never: without libtpu the report
    says that nothing was compiled.
    """
    if "dry_run" not in config:
        raise DryRunConfigError("the config has no 'dry_run' section (see ace_jax.train.dry_run.default_config)")
    dry = config.dry_run
    for name in ("mfu", "hbm_bw_efficiency"):
        if not 0 < float(dry[name]) <= 1:
            raise DryRunConfigError(f"dry_run.{name} must be in (0, 1], got {dry[name]}")
    t_start = time.perf_counter()
    topology = str(dry.get("topology", "") or "")
    not_compiled = ""
    if devices is None and topology:
        if tpu_compile.libtpu_available():
            try:
                devices = list(tpu_compile.topology_devices(topology))
            except (tpu_compile.TopologyError, tpu_compile.LibtpuMissingError) as e:
                raise DryRunConfigError(f"dry_run.topology: {e}") from None
        else:
            not_compiled = (f"libtpu is not installed: nothing was compiled for {topology} "
                            f"(`pip install \"jax[tpu]=={jax.__version__}\"` adds XLA's TPU "
                            "compiler; it runs without a TPU)")
    if compile and devices is None:
        raise DryRunConfigError("compile=True needs devices (a dry_run.topology with libtpu "
                                "installed, or devices=jax.devices())")
    mesh, abstract_mesh = build_mesh(config, devices)
    compile = (not abstract_mesh) if compile is None else compile
    chips = int(math.prod(dict(mesh.shape).values()))
    target = dry.platform if abstract_mesh else devices[0].platform
    mc = build_model_config(config).replace(platform=str(target))
    shp = _shapes(config, mc)
    place = placement_lib.Placement.create(mesh, config.mesh.rules)
    platform = str(dry.platform) if abstract_mesh else None
    hbm = float(dry.hbm_gb_per_chip) * GB
    if compile and target == "tpu":
        hbm = float(tpu_compile.hbm_bytes(devices[0]))

    # ---- abstract policy, optimizer state, shardings (the trainer's own Placement)
    t0 = time.perf_counter()
    model = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model, nnx.Param)
    total, active = qwen3.param_counts(mc)
    n_act = analytic.matmul_active_params(mc, total, active)
    psh = place.params(params)
    tx, schedule = learner.make_optimizer(config.optim)
    opt = jax.eval_shape(tx.init, params)
    state_sh = learner.state_shardings(place, params, config.optim)
    osh = state_sh.opt_state
    build_s = time.perf_counter() - t0

    n, p, m, t = shp["rows"], shp["prompt_len"], shp["new_tokens"], shp["seq_len"]
    batch = abstract_batch(n, p, m, place, learner_routes(config, mc))

    # ---- per-device memory (exact from the shardings, activations estimated) and time
    mem = analytic.memory_plan(mc, shp, mesh, place, params, psh, opt, osh, batch, total=total,
                               target=str(target), optim=config.optim)
    cdt, pdt = mc.dtype, mc.param_dtype
    L, H, V = mc.num_hidden_layers, mc.hidden_size, mc.vocab_size
    params_b, opt_b = mem["params_bytes"], mem["opt_bytes"]
    train_total, gen_total = mem["train_total"], mem["generate_total"]
    replicas = max(1, min(int(dry.decode_replicas), chips))
    time_s = analytic.time_projection(mc, shp, dry, n_act=n_act, total=total, chips=chips,
                                      replicas=replicas, grpo_beta=float(config.grpo.beta),
                                      params=params, psh=psh, mesh=mesh)

    # ---- lowering and compiling THE functions the trainer runs (learner.jit_learner_step,
    # generate._rollout), with the trainer's Placement
    lowering, compiled = lower_programs(config, mc, shp, place, graphdef, params, psh, opt,
                                        state_sh, batch, platform=platform, compile=compile)
    routes_compiled = _compiled_routes_bytes(compiled.get("learner_step"), batch)
    # ---- speed: rooflines of the compiled decode step, resharding and learner microbatch
    costs = cost_programs(config, mc, shp, place, platform=platform) if compile else {}
    costs = {k: v.to_dict() for k, v in costs.items()}
    layout = sampler_layout.SamplerLayout.from_config(config.sampler_mesh, place, mc)
    shared_prefix = generate.shared_prefix_decode(layout.model_config, shp["group_size"], m)
    decode_min = analytic.decode_min_bytes(layout, params, mc, n, p, m // 2, shp["group_size"],
                                           shared_prefix)
    speed = dry_run_speed.speed_section(costs, dry=dry,
                                        shp=shp, layers=L, chips=chips, n_act=n_act,
                                        prefill_s=time_s["prefill_s"], decode_min=decode_min,
                                        key_blocks=decode_key_blocks(shp, shared_prefix),
                                        paged_pages=paged_decode_pages(shp, int(config.engine.page_size)),
                                        engine_kind=engine_config.resolve_kind(
                                            config.engine.kind, layout.placement.mesh.size),
                                        slots=int(config.engine.slots),
                                        sync_every=int(config.engine.sync_every),
                                        completion_mix=str(dry.get("completion_mix", "")),
                                        host_round_trip_s=float(dry.get("host_round_trip_ms", 0.0)) / 1e3)

    report = {
        "model": dict(preset=config.model.preset, hf_path=str(config.model.get("hf_path", "")),
                      total_params=total, active_params=active, matmul_active_params=n_act,
                      layers=L, hidden=H, vocab=V, experts=mc.num_experts, top_k=mc.num_experts_per_tok,
                      dtype=cdt, param_dtype=pdt, remat=mc.remat_policy, moe_dispatch=mc.moe_dispatch,
                      attention_impl=resolve_attention_impl(mc.attention_impl, str(target), t)),
        "hardware": dict(chip=str(dry.chip), chips=chips, hbm_gb_per_chip=float(dry.hbm_gb_per_chip),
                         peak_tflops_bf16=float(dry.peak_tflops_bf16), hbm_bw_gbps=float(dry.hbm_bw_gbps),
                         mfu=float(dry.mfu), hbm_bw_efficiency=float(dry.hbm_bw_efficiency),
                         decode_replicas=replicas),
        "mesh": dict(shape=dict(mesh.shape), abstract=abstract_mesh, platform=str(target)),
        "shapes": dict(shp, rows_per_device_microbatch=mem["rows_per_device_microbatch"],
                       tokens_per_device_microbatch=mem["tokens_per_device_microbatch"]),
        "memory": dict(
            train=[dict(name=a, bytes=int(v), note=c) for a, v, c in mem["train"]],
            generate=[dict(name=a, bytes=int(v), note=c) for a, v, c in mem["generate"]],
            train_total=int(train_total), generate_total=int(gen_total), hbm_bytes=hbm,
            train_fits=bool(train_total <= hbm), generate_fits=bool(gen_total <= hbm),
            state_bytes_per_param=(params_b + opt_b + params_b) * chips / max(total, 1),
            learner_state_bytes=int(params_b + opt_b),
            params_global_bytes=mem["params_global_bytes"], routes_bytes=int(mem["routes_bytes"]),
            routes_compiled_bytes=routes_compiled),
        "time": time_s,
        "lowering": lowering,
        "compiled": {k: v.to_dict() for k, v in compiled.items()},
        "cost_programs": costs,
        "speed": speed,
        "sampler": dict(layout=str(config.sampler_mesh.layout),
                        moe_parallelism=str(config.sampler_mesh.moe_parallelism)),
        "not_compiled": not_compiled if not compiled else "",
        "max_hbm_fraction": float(dry.get("max_hbm_fraction", 1.0)),
        "topology": topology if compiled else "",
        "timings_s": dict(build=build_s, total=time.perf_counter() - t_start),
    }
    report["checks"] = _spec_checks(config.model.preset, report)
    return report


def _compiled_routes_bytes(program, batch) -> int | None:
    """Bytes per chip of the routing record as the compiled learner step takes it (its input
    ``routes``, `entry_parameter_bytes`); None when the batch has no record or nothing compiled.
    Drops the program's HLO text afterwards (it is large and not reported)."""
    if program is None or batch.routes is None or not program.ok or not program.hlo:
        return None
    found = entry_parameter_bytes(program.hlo, "routes")
    program.hlo = None
    return found


def _spec_checks(preset: str, report: dict) -> list[dict]:
    ref = SPEC_REFERENCE.get(preset)
    if not ref:
        return []
    ours = dict(total_params=report["model"]["total_params"],
                matmul_active_params=report["model"]["matmul_active_params"],
                kv_bytes_per_token=report["time"]["kv_bytes_per_token"],
                state_bytes_per_param=report["memory"]["state_bytes_per_param"])
    out = []
    for name, want in ref.items():
        got = ours[name]
        ok = abs(got - want) <= 0.02 * abs(want)   # sharding padding may add a little per device
        out.append(dict(name=name, ours=got, spec=want, ok=bool(ok)))
    return out
