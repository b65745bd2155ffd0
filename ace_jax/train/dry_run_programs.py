"""The dry run's programs (``ace_jax.train.dry_run``): THE jitted functions the trainer runs,
``learner.jit_learner_step`` and ``generate._rollout`` (and, where ``engine.kind`` resolves to
the paged engine, its decode call and prefill), traced, lowered and (with devices) COMPILED (``ace_jax.runtime.tpu_compile``) from ``ShapeDtypeStruct`` inputs carrying the trainer's
shardings (``lower_programs``); the abstract ``TrainBatch`` they take (``abstract_batch``), with
the MoE routing record where the learner replays it (``learner_routes``), and its bytes per chip
read back from the compiled learner step (``entry_parameter_bytes``)."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx
from jax.sharding import NamedSharding

from ace_jax.rl import learner
from ace_jax.rl.rollout_batch import TrainBatch
from ace_jax.runtime import (engine_config, engine_programs, generate, placement as placement_lib,
                             sampler_layout, sharding, tpu_compile)
from models import attention, configs as model_configs, kernel_mesh, qwen3


def with_sharding(sds: Any, sh: NamedSharding) -> jax.ShapeDtypeStruct:
    """``sds`` (anything with shape and dtype) as a ShapeDtypeStruct carrying ``sh``."""
    return jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sh)


def learner_routes(config: ml_collections.ConfigDict, mc: model_configs.ModelConfig
                   ) -> tuple[int, int] | None:
    """(L_moe, k) of the MoE routing record the learner's batch carries (uint8
    ``[rows, P + M, L_moe, k]``): with ``grpo.routing_replay = "R3"`` and an MoE policy (the
    trainer's sampler records it then); None otherwise."""
    if config.grpo.routing_replay != "R3" or not mc.num_moe_layers:
        return None
    return int(mc.num_moe_layers), int(mc.num_experts_per_tok)


def abstract_batch(n: int, p: int, m: int, place: placement_lib.Placement,
                   routes: tuple[int, int] | None = None) -> TrainBatch:
    """A TrainBatch of ShapeDtypeStructs carrying the placement's batch shardings (the trainer's
    `Learner.step` places the batch by them): n rows of p prompt + m completion tokens;
    ``routes`` (L_moe, k): with the routing record uint8 [n, p + m, L_moe, k] (`learner_routes`),
    None: without one."""
    t = p + m
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    batch = TrainBatch(input_ids=s((n, t), jnp.int32), positions=s((n, t), jnp.int32),
                       attention_mask=s((n, t), jnp.bool_), completion_mask=s((n, m), jnp.float32),
                       behaviour_logprobs=s((n, m), jnp.float32), rewards=s((n,), jnp.float32),
                       ref_logprobs=s((n, m), jnp.float32),
                       routes=None if routes is None else s((n, t) + tuple(routes), jnp.uint8))
    return jax.tree.map(with_sharding, batch, place.batch(batch))


# bytes per element of XLA's HLO element types
_HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
              "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_ENTRY_PARAMETER = re.compile(
    r"=\s*(\w+)\[([\d,]*)\]\S*\s+parameter\(\d+\).*?op_name=\"([^\"]*)\"")


def entry_parameter_bytes(hlo: str, name: str) -> int:
    """Bytes per chip of the compiled program's inputs named ``name`` (the last part of the
    argument's path, e.g. "routes" for the batch's `TrainBatch.routes`), read from its optimised
    HLO (``hlo``: `tpu_compile.CompiledProgram.hlo`): after SPMD partitioning an entry
    parameter's shape is one chip's shard. Unpadded: layout tiling is not counted. 0 when no
    such input (e.g. the compiler dropped an unused one)."""
    start = hlo.find("\nENTRY ")
    if start < 0:
        return 0
    end = hlo.find("\n}", start)
    total = 0
    for line in hlo[start:end if end > 0 else None].splitlines():
        found = _ENTRY_PARAMETER.search(line)
        if found and found[3].split(".")[-1] == name:
            dims = [int(d) for d in found[2].split(",") if d]
            total += math.prod(dims) * _HLO_BYTES[found[1]]
    return total


def _lower(traced, platform: str | None):
    return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()


def lower_programs(config: ml_collections.ConfigDict, mc: model_configs.ModelConfig,
                   shp: dict[str, int], place: placement_lib.Placement, graphdef: Any,
                   params: Any, psh: Any, opt: Any, state_sh: Any, batch: TrainBatch, *,
                   platform: str | None, compile: bool
                   ) -> tuple[dict[str, dict], dict[str, tpu_compile.CompiledProgram]]:
    """Traces and lowers (``config.dry_run.lower`` or ``compile``) and compiles (``compile``) the
    learner step with the trainer's ``Placement`` and the rollout in the sampler's layout
    (`sampler_layout.SamplerLayout` of ``config.sampler_mesh``).

    Returns ``(lowering, compiled)``: per program ``{ok, trace_s, lower_s, hlo_chars | error}``
    and the ``tpu_compile.CompiledProgram``; both empty when nothing is lowered. The learner
    step takes ``batch`` as given (with the routing record when it has one: `learner_routes`)
    and then keeps its optimised HLO (``hlo``), to read the record's bytes per chip from it
    (`entry_parameter_bytes`).
    """
    dry = config.dry_run
    m, b, p, g = shp["new_tokens"], shp["prompts"], shp["prompt_len"], shp["group_size"]
    lowering: dict[str, dict] = {}
    compiled: dict[str, tpu_compile.CompiledProgram] = {}
    if dry.lower or compile:
        state_in = jax.tree.map(with_sharding, learner.LearnerState(
            params, opt, jax.ShapeDtypeStruct((), jnp.int32)), state_sh)
        jitted = learner.jit_learner_step(graphdef, config.grpo, config.optim, g, place, params,
                                          temperature=config.sampling.temperature)
        with place.context():
            lowering["learner_step"], lowered = _trace_and_lower(jitted, (state_in, batch), platform)
        if compile:
            compiled["learner_step"] = _compile(lowered, lowering["learner_step"],
                                                keep_hlo=batch.routes is not None)

        layout = sampler_layout.SamplerLayout.from_config(config.sampler_mesh, place, mc)
        splace = layout.placement
        knobs, key = _knobs_and_key(config, mc, splace)
        prompt_sh = splace.sharding(sharding.batch_axes(2), (b, p))
        ids = jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=prompt_sh)
        msk = jax.ShapeDtypeStruct((b, p), jnp.bool_, sharding=prompt_sh)
        args = (layout.graphdef(graphdef), m, g, splace, layout.abstract_params(params), knobs,
                ids, ids, msk, key)
        with splace.context():
            lowering["generate_rollout"], lowered = _trace_and_lower(generate._rollout, args,
                                                                     platform)
        if compile:
            compiled["generate_rollout"] = _compile(lowered, lowering["generate_rollout"])
        if engine_config.resolve_kind(config.engine.kind, splace.mesh.size) == "paged":
            for name, (info, lowered) in engine_programs_lowered(
                    config, shp, layout, graphdef, params, platform=platform).items():
                lowering[name] = info
                if compile:
                    compiled[name] = _compile(lowered, info, keep_hlo=True)
                    info["pool_copies"] = _pool_copies(compiled[name], info["pool_chip"],
                                                       info["pool_dtype"])
    return lowering, compiled


def _pool_copies(program: tpu_compile.CompiledProgram, pool_chip: list[int],
                 dtype: str) -> list[dict] | None:
    """The copies of one of the engine's pool arrays (its per-chip dims ``pool_chip``, any
    layout: `tpu_compile.copies_of`, padding counted; a layout conversion of the pool, or a copy
    of it in a loop) in ``program``'s optimised HLO, as {shape, bytes, in_loop}; None when it
    did not compile. Drops the program's HLO text afterwards (it is large and not reported)."""
    if not program.ok or not program.hlo:
        return None
    found = tpu_compile.copies_of(program.hlo, pool_chip, dtype)
    program.hlo = None
    return [{k: c[k] for k in ("shape", "bytes", "in_loop")} for c in found]


def engine_programs_lowered(config: ml_collections.ConfigDict, shp: dict[str, int],
                            layout: sampler_layout.SamplerLayout, graphdef: Any, params: Any, *,
                            platform: str | None) -> dict[str, tuple[dict, Any]]:
    """The paged engine's two big programs as the trainer's `engine.Engine` jits them, at the
    config's ``engine`` shapes in the sampler ``layout``, traced and lowered: ``engine_decode``
    (`engine_programs.decode`: ``engine.sync_every`` steps of every slot, the whole model, the
    whole page pool and the shared prefixes) and ``engine_prefill`` (`engine_programs.prefill`:
    one ``engine.prefill_chunk`` of a prompt per row shard). Their arguments are what the engine
    holds: the sampler's params and their per-layer slices, the slots' state with the pool, split
    as `engine_config.state_shardings` splits it; the host inputs replicated. ``graphdef`` /
    ``params``: the learner's (abstract). Returns {name: (info, lowered)} (`_trace_and_lower`,
    its info with ``pool_chip``, ``pool_dtype`` and ``pool_chip_bytes``: one pool array's dims,
    dtype and dense bytes per chip)."""
    splace, smc = layout.placement, layout.model_config
    ecfg = engine_config.engine_config(config.engine,
                                       max_context=shp["prompt_len"] + shp["new_tokens"])
    shards, pool_pages = engine_config.row_shards(splace, ecfg, smc.num_key_value_heads)
    knobs, _ = _knobs_and_key(config, smc, splace)
    empty = functools.partial(engine_config.empty_state, smc, ecfg, pool_pages,
                              int(knobs.stop_table.shape[1]))
    abstract = jax.eval_shape(empty)
    state = jax.tree.map(with_sharding, abstract,
                         engine_config.state_shardings(splace.mesh, smc, abstract))
    sgraph, sparams = layout.graphdef(graphdef), layout.abstract_params(params)
    rep = sharding.replicated(splace.mesh)
    host = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rep)  # noqa: E731
    prefix = None
    if ecfg.shared_prefixes:
        prefix = qwen3.PagedPrefix(host((ecfg.shared_prefixes, ecfg.pages_per_row)),
                                   host((ecfg.shared_prefixes,)),
                                   host((ecfg.shared_prefixes, ecfg.prefix_rows)))
    # the engine records the MoE routes for the learner where it replays them (`learner_routes`)
    record = learner_routes(config, smc) is not None
    decode = jax.jit(functools.partial(engine_programs.decode, record_routes=record),
                     static_argnums=(0, 1), donate_argnums=(5,))
    prefill = jax.jit(functools.partial(engine_programs.prefill, record_routes=record),
                      static_argnums=(0,), donate_argnums=(2,))
    out = {}
    with splace.context():
        out["engine_decode"] = _trace_and_lower(decode, (
            sgraph, ecfg.sync_every, sparams, layout.abstract_layer_params(sgraph, params), knobs,
            state, prefix), platform)
        out["engine_prefill"] = _trace_and_lower(prefill, (
            sgraph, sparams, state.pools, host((shards, ecfg.prefill_chunk)),
            host((shards, ecfg.pages_per_row)), host((shards,)), host((shards,))), platform)
    pool = state.pools[0][0]
    chip = pool.sharding.shard_shape(pool.shape)
    for info, _ in out.values():
        info.update(pool_chip=list(chip), pool_dtype=str(pool.dtype),
                    pool_chip_bytes=math.prod(chip) * pool.dtype.itemsize)
    return out


def _knobs_and_key(config, mc, place):
    """Abstract sampling knobs and PRNG key, replicated on ``place``'s mesh."""
    rep = sharding.replicated(place.mesh)
    sampling = generate.SamplingConfig(
        max_new_tokens=int(config.sampling.max_new_tokens) or 1, group_size=int(config.rl.group_size),
        temperature=float(config.sampling.temperature), eos_ids=generate.model_eos_ids(mc),
        prompt_bucket=int(config.sampling.prompt_bucket))
    knobs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                         generate.SamplingKnobs.from_config(sampling))
    key = jax.eval_shape(lambda: jax.random.key(0))
    return knobs, jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)


def _abstract_model(mc: model_configs.ModelConfig):
    """(graphdef, abstract Param state) of a policy of ``mc``."""
    model = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))
    return nnx.split(model, nnx.Param)


def decode_step_program(config: ml_collections.ConfigDict, mc: model_configs.ModelConfig,
                        shp: dict[str, int], place: placement_lib.Placement, new_tokens: int, *,
                        platform: str | None) -> tpu_compile.CompiledProgram:
    """`generate.decode_step` compiled in the sampler's layout for a model of ``mc``: ``N`` rows
    whose ``new_tokens`` first new tokens are in the cache (`generate.decode_cache`: the prompts
    once per group as a shared prefix, or copied per row). The cache's memory layout is left to
    the compiler (``Layout.AUTO``), as the rollout's loop, which carries the cache, leaves it:
    with the default layout of a program's parameters XLA would transpose the whole cache in and
    out of every standalone step. So are the per-layer weights', which the rollout slices out
    once before its loop: the loop reads loop-invariant slices that XLA lays out once. The
    sampling compiles only the branch the config's top-k / top-p take (`generate.sample_token`'s
    ``truncate``): the rollout's run-time ``lax.cond`` runs one branch, XLA's cost analysis would
    count the vocabulary sort either way."""
    from jax.experimental.layout import Format, Layout  # local: only this program needs it

    n, p, m = shp["rows"], shp["prompt_len"], shp["new_tokens"]
    graphdef, params = _abstract_model(mc)
    layout = sampler_layout.SamplerLayout.from_config(config.sampler_mesh, place, mc)
    splace = layout.placement
    knobs, key = _knobs_and_key(config, mc, splace)
    keys = jax.ShapeDtypeStruct((n,), key.dtype, sharding=splace.sharding(sharding.batch_axes(1), (n,)))
    g = shp["group_size"]
    cache = jax.eval_shape(lambda: generate.decode_cache(layout.model_config, n // g, g, p, m))
    slot = (0 if cache.prefix is not None else p) + new_tokens
    cache_sh = splace.kv_cache(cache)

    def auto_layout(sh):  # the K / V arrays' layouts left to the compiler (the masks' default)
        return dataclasses.replace(sh, k=tuple(Format(Layout.AUTO, s) for s in sh.k),
                                   v=tuple(Format(Layout.AUTO, s) for s in sh.v),
                                   prefix=None if sh.prefix is None else auto_layout(sh.prefix))

    auto = auto_layout(cache_sh)
    rows = lambda shape, dt: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dt, sharding=splace.sharding(sharding.batch_axes(len(shape)), shape))
    sampler_graphdef = layout.graphdef(graphdef)
    params_in = layout.abstract_params(params)
    per_layer = layout.abstract_layer_params(sampler_graphdef, params)

    # only the sampling branch the run takes (top-k / top-p on or off), as it runs
    truncate = int(config.sampling.top_k) > 0 or float(config.sampling.top_p) < 1.0

    def step(params, knobs, cache, logits, positions, keys, layer_params):
        return generate.decode_step(sampler_graphdef, splace, params, knobs, cache, logits, positions,
                                    slot, keys, layer_params, truncate)

    auto_layers = jax.tree.map(lambda a: Format(Layout.AUTO, a.sharding), per_layer)
    jitted = jax.jit(step, in_shardings=(None, None, auto, None, None, None, auto_layers),
                     out_shardings=(None, None, None, auto), donate_argnums=(2,))
    args = (params_in, knobs, jax.tree.map(with_sharding, cache, cache_sh),
            rows((n, mc.vocab_size), jnp.float32), rows((n,), jnp.int32), keys, per_layer)
    with splace.context():
        info, lowered = _trace_and_lower(jitted, args, platform)
    return _compile(lowered, info, hbm_traffic=True)


def decode_step_index(m: int) -> int:
    """The new-token index of the ``decode_step`` cost program: the middle of M new tokens."""
    return max(0, m // 2 - 1)


def decode_key_blocks(shp: dict[str, int], shared_prefix: bool) -> dict[str, float]:
    """The key blocks of its own slots (``attention.DECODE_BLOCK_KV`` each) a row's decode step
    reads: at the ``decode_step`` and ``decode_last`` cost programs, and on average over the
    rollout's M steps (``mean``). The own slots are the M new tokens with ``shared_prefix``
    (the prompt is the group's shared prefix, read whole every step), else prompt + M. Step
    i (0-based) writes slot base + i and reads the ceil((base + i + 1) / block) blocks that
    hold filled slots."""
    p, m = shp["prompt_len"], shp["new_tokens"]
    base = 0 if shared_prefix else p
    block = min(attention.DECODE_BLOCK_KV, base + m)
    blocks = lambda i: -(-(base + i + 1) // block)  # noqa: E731
    return dict(decode_step=float(blocks(decode_step_index(m))), decode_last=float(blocks(m - 1)),
                mean=sum(blocks(i) for i in range(m)) / m)


def own_pages(prompt_len: int, page_size: int, step: int) -> int:
    """The pages of a row's own slots the paged engine's decode step ``step`` (0-based) reads:
    past its prompt's full pages (its group's shared prefix), from its prompt's last, partial
    page (``prompt_len % page_size`` slots, copied on write) to the slot the step writes."""
    return -(-(prompt_len % page_size + step + 1) // page_size)


def paged_decode_pages(shp: dict[str, int], page_size: int) -> dict[str, float]:
    """`own_pages` at the ``paged_decode_step`` and ``paged_decode_last`` cost programs (new
    tokens M/2 - 1 and M - 1) and on average over the rollout's M steps (``mean``): the paged
    step's cost is affine in them, as the dense step's in its key blocks (`decode_key_blocks`)."""
    p, m = shp["prompt_len"], shp["new_tokens"]
    pages = lambda i: float(own_pages(p, page_size, i))  # noqa: E731
    return dict(decode_step=pages(decode_step_index(m)), decode_last=pages(m - 1),
                mean=sum(pages(i) for i in range(m)) / m)


def paged_decode_program(config: ml_collections.ConfigDict, mc: model_configs.ModelConfig,
                         shp: dict[str, int], place: placement_lib.Placement, new_tokens: int, *,
                         platform: str | None) -> tpu_compile.CompiledProgram:
    """One step of the paged engine's decode (`engine_programs.decode`, ``steps=1``) compiled in
    the sampler's layout for a model of ``mc``: ``N`` slots, each group's prompt held ONCE in
    the pool as a shared prefix of ``prompt_len // page_size`` full pages (`qwen3.PagedPrefix`,
    read once per step for the group's G rows: cascade attention over pages), each row's own
    pages after it, with ``new_tokens`` new tokens in them. Pages of ``config.engine.page_size``
    slots. The pool's pages, the slots and the prefixes are split over the rows' mesh axes and
    KV heads over 'tensor' (`models.attention._page_shards`): each chip holds its rows' pages.

    The rows' tables are as wide as the prompt's pages plus the own pages of the fill, and the
    step is told so (``read_pages``), so the paged kernel's grid and its declared cost are the
    pages this step reads (with lengths traced they would be the whole table). Sampling: only the
    branch the config takes, as `decode_step_program`."""
    n, p, m, g = shp["rows"], shp["prompt_len"], shp["new_tokens"], shp["group_size"]
    page = int(config.engine.page_size)
    graphdef, params = _abstract_model(mc)
    layout = sampler_layout.SamplerLayout.from_config(config.sampler_mesh, place, mc)
    splace, smc = layout.placement, layout.model_config
    knobs, key = _knobs_and_key(config, mc, splace)
    prefix_pages = p // page
    own, own_max = own_pages(p, page, new_tokens), own_pages(p, page, m - 1)
    batch_axes, head_axis, shards = kernel_mesh.row_split(splace.mesh, n,
                                                          smc.num_key_value_heads)
    if n % shards or (n // g) % shards:
        raise ValueError(f"{n} rows in groups of {g} do not split over the {shards} row shards "
                         f"of the sampler mesh")
    # each shard: page 0 (reserved), its rows' own pages at the last step, its prompts' pages
    pool_pages = shards * (1 + n // shards * own_max + n // g // shards * prefix_pages)
    cache = jax.eval_shape(lambda: qwen3.init_paged_cache(
        smc, n, num_pages=pool_pages, page_size=page, pages_per_row=prefix_pages + own))
    P = jax.sharding.PartitionSpec
    mesh = splace.mesh
    pool_sh = NamedSharding(mesh, P(None, batch_axes, head_axis))
    rows = lambda shape, dt: jax.ShapeDtypeStruct(  # noqa: E731
        shape, dt, sharding=NamedSharding(mesh, P(batch_axes)))
    window = int(knobs.stop_table.shape[1])
    state = engine_programs.SlotState(
        pools=(tuple(with_sharding(x, pool_sh) for x in cache.k),
               tuple(with_sharding(x, pool_sh) for x in cache.v)),
        page_table=rows(cache.page_table.shape, jnp.int32), lengths=rows((n,), jnp.int32),
        logits=rows((n, mc.vocab_size), jnp.float32), keys=rows((n,), key.dtype), produced=rows((n,), jnp.int32),
        budget=rows((n,), jnp.int32), done=rows((n,), jnp.bool_), reason=rows((n,), jnp.int32),
        window=rows((n, window), jnp.int32), temperature=rows((n,), jnp.float32))
    entries = n // g
    prefix = qwen3.PagedPrefix(table=rows((entries, max(prefix_pages, 1)), jnp.int32),
                               lengths=rows((entries,), jnp.int32), rows=rows((entries, g), jnp.int32))
    sampler_graphdef = layout.graphdef(graphdef)
    truncate = int(config.sampling.top_k) > 0 or float(config.sampling.top_p) < 1.0

    def step(params, layers, knobs, state, prefix):
        return engine_programs.decode(sampler_graphdef, 1, params, layers, knobs, state,
                                      prefix if prefix_pages else None, read_pages=own,
                                      truncate=truncate)

    # the pools and the per-layer weights in their default layouts, the state donated: as the
    # engine jits its decode (`engine_programs.programs`)
    per_layer = layout.abstract_layer_params(sampler_graphdef, params)
    jitted = jax.jit(step, donate_argnums=(3,))
    with splace.context():
        info, lowered = _trace_and_lower(
            jitted, (layout.abstract_params(params), per_layer, knobs, state, prefix), platform)
    return _compile(lowered, info, hbm_traffic=True)


def cost_programs(config: ml_collections.ConfigDict, mc: model_configs.ModelConfig,
                  shp: dict[str, int], place: placement_lib.Placement, *, platform: str | None,
                  learner_programs: bool = True) -> dict[str, tpu_compile.CompiledProgram]:
    """The programs the speed section reads (`ace_jax.train.dry_run_speed`), compiled:

    - ``decode_step_L1`` / ``_L2``: `decode_step_program` at the middle of a rollout (M / 2
      new tokens, the last slot of a key block when M / 2 is a whole number of blocks), layers
      unrolled (1 and 2); ``decode_last_L1`` / ``_L2``: the last step (a full cache). A step's
      cost is affine in the key blocks it reads (`decode_key_blocks`), so the two give the
      rollout's average step;
    - ``paged_decode_step_L1`` / ``_L2``, ``paged_decode_last_L1`` / ``_L2``: the same steps
      of the paged engine (`paged_decode_program`), affine in the own pages read
      (`paged_decode_pages`);
    - ``reshard``: the sampler layout's learner -> sampler resharding of the whole model;
    - ``learner_microbatch_L1`` / ``_L2``: `learner.jit_learner_step` on ONE microbatch's rows,
      one log-prob chunk, layers unrolled (1 and 2) (skipped without ``learner_programs``).

    Unrolled because XLA counts a loop body once; the speed section extrapolates to L layers.
    """
    p, m = shp["prompt_len"], shp["new_tokens"]
    out: dict[str, tpu_compile.CompiledProgram] = {}
    for layers in (1, 2):
        small = mc.replace(num_hidden_layers=layers, scan_layers=False)
        for name, index in (("decode_step", decode_step_index(m)), ("decode_last", m - 1)):
            out[f"{name}_L{layers}"] = decode_step_program(config, small, shp, place, index,
                                                           platform=platform)
            out[f"paged_{name}_L{layers}"] = paged_decode_program(config, small, shp, place, index,
                                                                  platform=platform)
        if not learner_programs:
            continue
        graphdef, params = _abstract_model(small)
        optim = ml_collections.ConfigDict(config.optim.to_dict())
        optim.microbatches = 1
        optim.logprob_chunk_tokens = m
        # one microbatch's rows, in groups of prompt_rows rows per prompt when prompts are
        # shared (whole groups, or slices of them)
        rows_per_prompt = learner.prompt_rows(config.optim, shp["group_size"])
        optim.share_prompts, optim.prompt_split = rows_per_prompt > 1, "groups"
        rows_per_prompt = rows_per_prompt if rows_per_prompt > 1 else shp["group_size"]
        state_sh = learner.state_shardings(place, params, optim)
        tx, _ = learner.make_optimizer(optim)
        state_in = jax.tree.map(with_sharding, learner.LearnerState(
            params, jax.eval_shape(tx.init, params), jax.ShapeDtypeStruct((), jnp.int32)), state_sh)
        jitted = learner.jit_learner_step(graphdef, config.grpo, optim, rows_per_prompt, place,
                                          params, temperature=config.sampling.temperature)
        batch = abstract_batch(shp["rows_per_microbatch"], p, m, place,
                               learner_routes(config, small))
        with place.context():
            info, lowered = _trace_and_lower(jitted, (state_in, batch), platform)
        out[f"learner_microbatch_L{layers}"] = _compile(lowered, info, hbm_traffic=True)
    # the resharding of the whole model, learner -> sampler
    graphdef, params = _abstract_model(mc)
    layout = sampler_layout.SamplerLayout.from_config(config.sampler_mesh, place, mc)
    p_in = jax.tree.map(with_sharding, params, place.params(params))
    info, lowered = _trace_and_lower(layout.resharder(params), (p_in,), platform)
    out["reshard"] = _compile(lowered, info, hbm_traffic=True)
    return out


def _compile(lowered, lowering: dict, *, hbm_traffic: bool = False,
             keep_hlo: bool = False) -> tpu_compile.CompiledProgram:
    """The compiled program, or (lowering failed) a failed one that carries the lowering error.
    ``hbm_traffic``: the cost programs' (`tpu_compile.compile_program`: each operand counted
    once, not once per on-chip prefetch copy); ``keep_hlo``: keep the optimised HLO text."""
    if lowered is None:
        return tpu_compile.CompiledProgram(ok=False, compile_s=0.0,
                                           error=f"not lowered: {lowering.get('error', '')}")
    return tpu_compile.compile_program(lowered, hbm_traffic=hbm_traffic, keep_hlo=keep_hlo)


def _trace_and_lower(jitted, args, platform):
    """({ok, trace_s, lower_s, hlo_chars | error}, lowered or None)."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        traced = jitted.trace(*args)
        out["trace_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        lowered = _lower(traced, platform)
        out["lower_s"] = time.perf_counter() - t1
        out["hlo_chars"] = len(lowered.as_text())
        out["ok"] = True
        return out, lowered
    except Exception as e:  # reported, not raised: the memory plan is still useful
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        return out, None
