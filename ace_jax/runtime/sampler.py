"""The trainer's sampler for the ``engine`` config section (`make_sampler`): the paged
`engine.Engine` or the static `generate.Generator`, as the section's ``kind`` resolves
(`engine_config.resolve_kind`). Both have ``generate(prompts, key)`` and
``update_weights(params, version)``.
"""
from __future__ import annotations

import ml_collections
from flax import nnx

from ace_jax.runtime import generate
from ace_jax.runtime.engine import Engine
from ace_jax.runtime.engine_config import engine_config, resolve_kind


def make_sampler(model: nnx.Module, sampling: generate.SamplingConfig,
                 cfg: ml_collections.ConfigDict, *, max_context: int, placement=None, layout=None,
                 record_routes: bool = False):
    """The trainer's sampler for the ``engine`` section ``cfg``: an `Engine`, or a
    `generate.Generator` (see `engine_config.default_config`). Both have ``generate(prompts,
    key)`` and ``update_weights(params, version)``. ``max_context``: used when
    ``cfg.max_context`` is 0; ``record_routes``: the engine keeps the MoE routing record (also
    when ``cfg.record_routes``)."""
    devices = 1 if placement is None else placement.mesh.size
    if resolve_kind(cfg.kind, devices) == "static":
        return generate.Generator(model, sampling, placement=placement, layout=layout)
    return Engine(model, sampling, engine_config(cfg, max_context), placement=placement,
                  layout=layout, record_routes=record_routes or bool(cfg.record_routes))
