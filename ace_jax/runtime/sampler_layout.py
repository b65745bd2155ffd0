"""The sampler's own layout: a mesh, rules and MoE parallelism chosen for decode, not training.

The learner FSDP-shards every weight (each chip holds 1/64 of each matrix and gathers it when it
computes); a decode step computes 8 rows per chip, so in that layout it would gather the whole
model on every step. As tunix gives each role its mesh, the sampler gets a `SamplerLayout`:

- its own `Placement` over the same devices: by default every chip on the ``expert`` axis, the
  experts split over it (E / n per chip, kept in place: tokens travel, `models.moe_sharding`
  "expert"), every dense weight replicated (``vocab`` / ``heads`` / ``mlp`` may go tensor-
  parallel over a ``tensor`` axis instead), rows over every non-tensor axis;
- the model's code paths for that layout (``moe_parallelism``; no remat), as a graphdef of its
  own;
- the weights in the compute dtype (bf16 on the pod: half the bytes every decode step reads);
- `reshard`: ONE jitted program, learner params -> sampler params (cast + the sampler's
  shardings), run once per RL step after the update; the dry run compiles and costs it.

``sampler_mesh.layout = "shared"`` (the default, and what the laptop runs) keeps today's path:
the generator decodes in the learner's placement with the learner's graphdef and params.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh

from ace_jax.runtime import placement as placement_lib, sharding
from models import configs as model_configs

__all__ = ["LAYOUTS", "WEIGHT_DTYPES", "SAMPLER_RULES", "default_config", "SamplerLayout"]

LAYOUTS = ("shared", "own")
WEIGHT_DTYPES = ("compute", "param")  # the model's compute dtype | the params' as stored

# Logical axis -> mesh axes for decode (see the module docstring).
SAMPLER_RULES: dict[str, str] = {
    "batch": "data,fsdp,expert",  # decode rows over every non-tensor axis
    "length": "",
    "cache_length": "",
    "embed": "",                  # dense weights replicated ...
    "vocab": "tensor",            # ... or tensor-parallel where a 'tensor' axis is set
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": "",
    "mlp": "tensor",
    "experts": "expert",          # experts stay in place: E / n per device
    "router": "",                 # the router replicated: every row's logits over all E experts,
    #                               with no per-layer gather of its [H, E] weight
    "layers": "",
}


def default_config() -> ml_collections.ConfigDict:
    """The ``sampler_mesh`` section: the sampler's mesh over the learner's devices."""
    c = ml_collections.ConfigDict()
    c.layout = "shared"            # shared: decode in the learner's placement | own: this mesh
    c.data = 1
    c.fsdp = 1
    c.tensor = 1
    c.expert = -1                  # -1: every device not used by the other axes
    c.axis_types = "auto"
    c.moe_parallelism = "expert"   # models.moe_sharding: "expert" (tokens travel) | "gather"
    c.weight_dtype = "compute"     # compute: the model's dtype (bf16 on the pod) | param: as stored
    c.moe_partials = "float32"     # the MoE's cross-device sum: float32 | compute (ModelConfig.moe_partials)
    c.rules = ml_collections.ConfigDict(dict(SAMPLER_RULES))
    return c


def _model_config(mc: model_configs.ModelConfig, cfg: ml_collections.ConfigDict
                  ) -> model_configs.ModelConfig:
    if cfg.weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"sampler_mesh.weight_dtype must be one of {list(WEIGHT_DTYPES)}, got "
                         f"{cfg.weight_dtype!r}")
    # no remat: sampling differentiates nothing
    changes: dict[str, Any] = dict(moe_parallelism=str(cfg.moe_parallelism),
                                   moe_partials=str(cfg.moe_partials), remat_policy="none")
    if cfg.weight_dtype == "compute":
        changes["param_dtype"] = mc.dtype
    return mc.replace(**changes)


def _mesh(cfg: ml_collections.ConfigDict, learner_mesh: Any) -> Any:
    """The sampler's mesh over the learner mesh's devices IN THE LEARNER'S ORDER (one jitted
    resharding program needs one device assignment); an `AbstractMesh` for an abstract one."""
    kinds = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    if cfg.axis_types not in kinds:
        raise sharding.MeshConfigError(f"sampler_mesh.axis_types must be one of {sorted(kinds)}, "
                                       f"got {cfg.axis_types!r}")
    n = int(np.prod(list(dict(learner_mesh.shape).values())))
    sizes = sharding.resolve_mesh_shape(cfg, n)
    shape = tuple(sizes[a] for a in sharding.MESH_AXES)
    types = (kinds[cfg.axis_types],) * len(shape)
    if isinstance(learner_mesh, AbstractMesh):
        return AbstractMesh(shape, sharding.MESH_AXES, axis_types=types)
    devices = np.asarray(learner_mesh.devices).reshape(shape)
    return Mesh(devices, sharding.MESH_AXES, axis_types=types)


@dataclasses.dataclass(frozen=True)
class SamplerLayout:
    """Where and how the sampler decodes (see the module docstring).

    Attributes:
      placement: the sampler's `Placement` (the learner's when ``shared``).
      model_config: the sampler's `ModelConfig` (the learner's when ``shared``).
      shared: decode in the learner's layout, nothing resharded.
    """

    placement: placement_lib.Placement
    model_config: model_configs.ModelConfig
    shared: bool

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict, learner: placement_lib.Placement,
                    model_config: model_configs.ModelConfig) -> "SamplerLayout":
        """From a ``sampler_mesh`` section, over the learner placement's devices."""
        if cfg.layout not in LAYOUTS:
            raise ValueError(f"sampler_mesh.layout must be one of {list(LAYOUTS)}, got {cfg.layout!r}")
        if cfg.layout == "shared":
            return cls(learner, model_config, True)
        return cls(placement_lib.Placement.create(_mesh(cfg, learner.mesh), cfg.rules),
                   _model_config(model_config, cfg), False)

    def graphdef(self, graphdef: Any) -> Any:
        """The sampler's graphdef for a learner's ``graphdef`` (the same when shared): the same
        modules and parameter tree, with the sampler's model config (its code paths)."""
        if self.shared:
            return graphdef
        from models import qwen3  # local: the one model family the runtime builds

        abstract = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(self.model_config, rngs=nnx.Rngs(0)))
        return nnx.split(abstract, nnx.Param)[0]

    def abstract_params(self, params: Any) -> Any:
        """The sampler's params as ShapeDtypeStructs with its shardings (``params``: the learner's,
        arrays or abstract)."""
        dtype = self._weight_dtype()
        cast = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype), params)
        return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                            cast, self.placement.params(cast))

    def abstract_layer_params(self, graphdef: Any, params: Any) -> tuple:
        """The per-layer weights the rollout slices out of the stacks before its decode loop
        (`Qwen3ForCausalLM.layer_params`) as ShapeDtypeStructs: each with its stack's sampler
        sharding less the leading layers axis. ``graphdef``: the sampler's; ``params``: the
        learner's (arrays or abstract)."""
        stacked = self.abstract_params(params)
        sliced = jax.eval_shape(lambda p: nnx.merge(graphdef, p).layer_params(), stacked)
        stacks = [nnx.split(stack)[1] for stack in nnx.merge(graphdef, stacked).layers]

        def place(a, stack):
            spec = jax.sharding.PartitionSpec(*tuple(stack.sharding.spec)[1:])
            return jax.ShapeDtypeStruct(a.shape, a.dtype,
                                        sharding=jax.sharding.NamedSharding(stack.sharding.mesh, spec))

        return tuple(tuple(jax.tree.map(place, layer, stack) for layer in group)
                     for group, stack in zip(sliced, stacks))

    def _weight_dtype(self):
        if self.shared or self.model_config.param_dtype == "float32":
            return None
        return jnp.dtype(self.model_config.param_dtype)

    def resharder(self, params: Any):
        """The jitted learner -> sampler resharding for params shaped like ``params`` (the
        learner's): cast to the sampler's weight dtype and lay out on its mesh. Identity when
        shared (a program that moves nothing). The same program the dry run compiles and costs."""
        if self.shared:
            return jax.jit(lambda p: p)
        dtype = self._weight_dtype()
        out = jax.tree.map(lambda s: s.sharding, self.abstract_params(params))
        return jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype or x.dtype), p),
                       out_shardings=out)
