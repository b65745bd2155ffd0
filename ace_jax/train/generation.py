"""The trainer's generator, the policy copy that samples the rollouts: its knobs
(`sampling_config`: the ``sampling`` section, with the tokenizer's end and padding ids), the
generator itself (`build`: the paged engine or the static generator, as
`ace_jax.runtime.sampler.make_sampler` picks by ``engine.kind``, refused where an RL option needs
the paged engine, with the partial rollouts it holds when ``rl.partial_rollouts`` is on), its
completions as host arrays (`host_generate`) and the learner's weights put into it
(`update_weights`).
"""
from __future__ import annotations

from typing import Optional

import jax
import ml_collections
import numpy as np

from ace_jax.runtime import engine, generate, multihost, sampler
from ace_jax.train import partial_rollouts
from ace_jax.train.setup import SetupError
from models import tokenizer as tok_lib


def sampling_config(cfg: ml_collections.ConfigDict, tokenizer) -> generate.SamplingConfig:
    """The run's sampling knobs: the ``sampling`` section, ``rl.group_size`` samples a prompt,
    a sample ending at the tokenizer's end of message or end of text, padded with the latter."""
    eos_ids = tuple(tokenizer.convert_tokens_to_ids([tok_lib.IM_END, tok_lib.ENDOFTEXT]))
    pad_id = int(tokenizer.convert_tokens_to_ids(tok_lib.ENDOFTEXT))
    return generate.SamplingConfig(
        max_new_tokens=cfg.sampling.max_new_tokens, group_size=cfg.rl.group_size,
        temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k,
        top_p=cfg.sampling.top_p, eos_ids=eos_ids, pad_id=pad_id,
        prompt_bucket=cfg.sampling.prompt_bucket)


def build(cfg: ml_collections.ConfigDict, model, sampling: generate.SamplingConfig, placement,
          layout) -> tuple[object, Optional[partial_rollouts.PartialRollouts]]:
    """(the generator, the partial rollouts it holds or None) of a run: the ``engine`` section's
    sampler (`sampler.make_sampler`) of ``model`` in the learner's ``placement`` or the
    sampler's own ``layout``, keeping the MoE routing record when ``grpo.routing_replay``
    replays it. SetupError when ``rl.partial_rollouts`` or routing replay is on and the sampler
    is not the paged engine (or, for routing replay, the policy has no MoE layer)."""
    generator = sampler.make_sampler(
        model, sampling, cfg.engine, placement=placement, layout=layout,
        max_context=cfg.rl.max_prompt_tokens + cfg.sampling.max_new_tokens,
        record_routes=cfg.grpo.routing_replay != "none")
    partial = None
    if cfg.rl.partial_rollouts:
        if not isinstance(generator, engine.Engine):
            raise SetupError("rl.partial_rollouts needs the paged engine (engine.kind "
                             f"resolved to {type(generator).__name__})")
        partial = partial_rollouts.PartialRollouts(
            generator, group_size=cfg.rl.group_size, batch_groups=cfg.rl.batch_states,
            factor=cfg.rl.partial_factor, max_token_staleness=cfg.rl.max_token_staleness,
            versions_per_step=int(cfg.grpo.minibatches),
            key=jax.random.fold_in(jax.random.key(cfg.seed), 1))
    if cfg.grpo.routing_replay != "none" and not (
            isinstance(generator, engine.Engine) and model.config.num_moe_layers):
        raise SetupError(f"grpo.routing_replay={cfg.grpo.routing_replay!r} replays the "
                         "sampler's MoE routing record, which only the paged engine keeps "
                         f"(engine.kind resolved to {type(generator).__name__}; MoE "
                         f"layers: {model.config.num_moe_layers})")
    return generator, partial


def host_generate(generator, prompts: list[list[int]], key: jax.Array,
                  sampling: Optional[generate.SamplingConfig] = None
                  ) -> generate.GenerationResult:
    """The generator's completions of ``prompts`` (``sampling``: its own by default) as host
    numpy arrays."""
    out = generator.generate(prompts, key, sampling)
    return generate.GenerationResult(   # the routing record is host numpy already (or None)
        *(np.asarray(multihost.host_value(x)) for x in out[:5]), *out[5:])


def update_weights(generator, learner) -> None:
    """The learner's parameters into the generator, stamped with the learner's step (their
    policy version)."""
    generator.update_weights(learner.params, version=int(learner.state.step))


def engine_metrics(generator) -> dict[str, float]:
    """The paged engine's host round trips so far: ``engine/decode_calls`` and
    ``engine/host_gather_ms`` (the mean milliseconds the host spent gathering a decode call's
    results once computed, across processes on a pod: what a call costs beyond its device
    time); {} for the static generator."""
    if not isinstance(generator, engine.Engine):
        return {}
    calls = generator.stats["decode_calls"]
    return {"engine/decode_calls": float(calls),
            "engine/host_gather_ms": 1e3 * generator.stats["host_gather_s"] / max(calls, 1)}
