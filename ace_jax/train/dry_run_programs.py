"""The dry run's programs (``ace_jax.train.dry_run``): THE jitted functions the trainer runs,
``learner.jit_learner_step`` and ``generate._rollout``, traced, lowered and (with devices)
COMPILED (``ace_jax.runtime.tpu_compile``) from ``ShapeDtypeStruct`` inputs carrying the trainer's
shardings (``lower_programs``); the abstract ``TrainBatch`` they take (``abstract_batch``)."""
from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from jax.sharding import NamedSharding

from ace_jax.rl import learner
from ace_jax.rl.rollout_batch import TrainBatch
from ace_jax.runtime import generate, placement as placement_lib, sharding, tpu_compile
from models import configs as model_configs


def with_sharding(sds: Any, sh: NamedSharding) -> jax.ShapeDtypeStruct:
    """``sds`` (anything with shape and dtype) as a ShapeDtypeStruct carrying ``sh``."""
    return jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sh)


def abstract_batch(n: int, p: int, m: int, place: placement_lib.Placement) -> TrainBatch:
    """A TrainBatch of ShapeDtypeStructs carrying the placement's batch shardings."""
    t = p + m
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    batch = TrainBatch(input_ids=s((n, t), jnp.int32), positions=s((n, t), jnp.int32),
                       attention_mask=s((n, t), jnp.bool_), completion_mask=s((n, m), jnp.float32),
                       behaviour_logprobs=s((n, m), jnp.float32), rewards=s((n,), jnp.float32),
                       ref_logprobs=s((n, m), jnp.float32))
    return jax.tree.map(with_sharding, batch, place.batch(batch))


def _lower(traced, platform: str | None):
    return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()


def lower_programs(config: ml_collections.ConfigDict, mc: model_configs.ModelConfig,
                   shp: dict[str, int], place: placement_lib.Placement, graphdef: Any,
                   params: Any, psh: Any, opt: Any, state_sh: Any, batch: TrainBatch, *,
                   platform: str | None, compile: bool
                   ) -> tuple[dict[str, dict], dict[str, tpu_compile.CompiledProgram]]:
    """Traces and lowers (``config.dry_run.lower`` or ``compile``) and compiles (``compile``) the
    learner step and the rollout with the trainer's ``Placement``.

    Returns ``(lowering, compiled)``: per program ``{ok, trace_s, lower_s, hlo_chars | error}``
    and the ``tpu_compile.CompiledProgram``; both empty when nothing is lowered.
    """
    dry = config.dry_run
    m, b, p, g = shp["new_tokens"], shp["prompts"], shp["prompt_len"], shp["group_size"]
    rep = sharding.replicated(place.mesh)
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
            compiled["learner_step"] = _compile(lowered, lowering["learner_step"])

        sampling = generate.SamplingConfig(
            max_new_tokens=m, group_size=g, temperature=float(config.sampling.temperature),
            eos_ids=generate.model_eos_ids(mc), prompt_bucket=int(config.sampling.prompt_bucket))
        knobs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                             generate.SamplingKnobs.from_config(sampling))
        prompt_sh = place.sharding(sharding.batch_axes(2), (b, p))
        ids = jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=prompt_sh)
        msk = jax.ShapeDtypeStruct((b, p), jnp.bool_, sharding=prompt_sh)
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
        p_in = jax.tree.map(with_sharding, params, psh)
        args = (graphdef, m, g, place, p_in, knobs, ids, ids, msk, key)
        with place.context():
            lowering["generate_rollout"], lowered = _trace_and_lower(generate._rollout, args,
                                                                     platform)
        if compile:
            compiled["generate_rollout"] = _compile(lowered, lowering["generate_rollout"])
    return lowering, compiled


def _compile(lowered, lowering: dict) -> tpu_compile.CompiledProgram:
    """The compiled program, or (lowering failed) a failed one that carries the lowering error."""
    if lowered is None:
        return tpu_compile.CompiledProgram(ok=False, compile_s=0.0,
                                           error=f"not lowered: {lowering.get('error', '')}")
    return tpu_compile.compile_program(lowered)


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
