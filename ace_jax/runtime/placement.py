"""NNX-aware placement: the model's logical axis names -> NamedShardings on a mesh.

`ace_jax.runtime.sharding` maps logical axis names to mesh axes for plain pytrees. This module applies it
to the objects of the RL runtime: a Flax NNX policy (its ``nnx.Param`` s carry their logical axes
as ``out_sharding`` metadata, see `models.qwen3`), the learner's ``LearnerState`` (params, optax
state, step), a ``TrainBatch`` and a ``KVCache``::

    placement = Placement.from_config(cfg.mesh)          # the mesh over all hosts' devices
    model = placement.init_model(lambda: Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))  # born sharded
    learner = Learner.create(model, grpo_cfg, optim_cfg, group_size=G, placement=placement)
    gen = Generator(model, sampling, placement=placement)  # batch- and cache-sharded rollouts

This module is the ONE definition of every sharding of the runtime: parameters (from each
Param's logical axes), optimizer state, learner state, batches and both KV-cache layouts
(`KV_CACHE_AXES`). The trainer, the learner, the generator, checkpoint restore (its targets carry
these shardings) and the dry run all take them from a `Placement`.

Every sharding follows `sharding.logical_to_pspec` (so a dim that a mesh axis does not divide is
replicated over that axis, with a warning), and a `Placement` is hashable, so it can be a static
argument of ``jax.jit``.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from ace_jax.runtime import sharding as sh

__all__ = [
    "Placement",
    "param_shardings",
    "place_params",
    "KV_CACHE_AXES",
    "KV_MASK_AXES",
]

# Logical axes of a `models.qwen3.KVCache`'s k / v arrays, per cache layout:
#   "standard": one array per layer group, k and v [Lg, B, S, nkv, d];
#   "decode":   one array per layer, k [B, nkv, d, S] and v [B, nkv, S, d].
KV_CACHE_AXES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "standard": (("layers", "batch", "cache_length", "kv_heads", "head_dim"),) * 2,
    "decode": (("batch", "kv_heads", "head_dim", "cache_length"),
               ("batch", "kv_heads", "cache_length", "head_dim")),
}
KV_MASK_AXES: tuple[str, ...] = ("batch", "cache_length")   # kv_mask [B, S]


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _param_state(model_or_state: Any) -> nnx.State:
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    if isinstance(model_or_state, nnx.State):
        return model_or_state
    raise TypeError(f"expected an nnx.Module or its nnx.State of Params, got "
                    f"{type(model_or_state).__name__}")


def param_shardings(model_or_state: Any, mesh: Mesh, rules: Mapping[str, Any]) -> nnx.State:
    """NamedShardings for a module's Params (or an ``nnx.split`` / ``nnx.state`` Param state).

    Returns an ``nnx.State`` of the same structure whose Variables hold a ``NamedSharding``
    instead of an array, so it can be passed wherever the param state goes (``jax.device_put``,
    ``jax.jit`` in/out_shardings). Every Param must carry ``out_sharding`` (its logical axes, one
    per dim); abstract states (``nnx.eval_shape``) work too.

    Raises:
      ValueError: a Param without logical axes, or whose axes do not match its rank.
      sharding.UnknownLogicalAxisError: an axis name the rules do not map.
    """
    state = _param_state(model_or_state)
    rules = sh.rules_from_config(rules.to_dict() if hasattr(rules, "to_dict") else rules)

    def one(path, var):
        axes = var.get_metadata().get("out_sharding")
        name = "/".join(str(p) for p in path)
        shape = tuple(np.shape(var.get_value()))
        if axes is None:
            raise ValueError(f"param {name} {shape} has no logical axes (out_sharding metadata)")
        if len(axes) != len(shape):
            raise ValueError(f"param {name}: logical axes {tuple(axes)} do not match shape {shape}")
        return var.replace(sh.logical_sharding(tuple(axes), shape, mesh, rules))

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=_is_variable)


def place_params(model_or_state: Any, mesh: Mesh, rules: Mapping[str, Any]) -> nnx.State:
    """Puts a module's Params (or a Param state) on the mesh as the rules say.

    A module is updated in place (its Params then hold the sharded arrays, so ``nnx.split``,
    `Generator` and `Learner.create` see them); the placed Param state is returned either way.
    """
    state = _param_state(model_or_state)
    placed = jax.device_put(state, param_shardings(state, mesh, rules))
    if isinstance(model_or_state, nnx.Module):
        nnx.update(model_or_state, placed)
    return placed


def _hashable_rules(rules: Mapping[str, Any]) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
    norm = sh.rules_from_config(rules.to_dict() if hasattr(rules, "to_dict") else rules)
    return tuple(sorted(norm.items()))


@dataclasses.dataclass(frozen=True)
class Placement:
    """A mesh plus a (normalised, hashable) rules table; builds the runtime's shardings.

    Attributes:
      mesh: the device mesh (axes `sharding.MESH_AXES`).
      rules: ((logical name, mesh axes or None), ...), sorted; build with `Placement.create`.
    """

    mesh: Mesh
    rules: tuple[tuple[str, tuple[str, ...] | None], ...]

    @classmethod
    def create(cls, mesh: Mesh, rules: Mapping[str, Any] | None = None) -> "Placement":
        """From a mesh and a rules table (config section, dict; default `sharding.DEFAULT_RULES`)."""
        if not isinstance(mesh, (Mesh, AbstractMesh)):
            raise TypeError(f"mesh must be a jax.sharding.Mesh (or an AbstractMesh, to trace "
                            f"without devices), got {type(mesh).__name__}")
        return cls(mesh, _hashable_rules(sh.DEFAULT_RULES if rules is None else rules))

    @classmethod
    def from_config(cls, mesh_cfg: Any, devices: Any = None) -> "Placement":
        """The mesh of a ``mesh`` config section (`sharding.default_config`) over ``devices``
        (default: every device of every process) with the section's rules table."""
        return cls.create(sh.make_mesh(mesh_cfg, devices), mesh_cfg.rules)

    def init_model(self, build: Any) -> nnx.Module:
        """A module born sharded: ``build()`` (e.g. ``lambda: Qwen3ForCausalLM(cfg, rngs=...)``)
        runs under ``jax.jit`` with its Params' out_shardings from `params`, so no device (and no
        host) ever holds the whole model. The values equal those of an eager ``build()``."""
        abstract = nnx.eval_shape(build)
        graphdef, state = nnx.split(abstract)
        if jax.tree.leaves(nnx.state(abstract, nnx.Not(nnx.Param))):
            raise ValueError("init_model expects a module that holds Params only")
        shardings = self.params(state)
        params = jax.jit(lambda: nnx.state(build(), nnx.Param), out_shardings=shardings)()
        return nnx.merge(graphdef, params)

    def context(self):
        """The mesh as the context of tracing (``with placement.context(): ...``): kernels that
        XLA cannot partition by itself (Pallas / Mosaic, e.g. splash attention) find it there
        and run under ``shard_map``. The learner, the generator and the trainer trace under it."""
        if isinstance(self.mesh, AbstractMesh):
            return jax.sharding.use_abstract_mesh(self.mesh)
        return jax.set_mesh(self.mesh)

    @property
    def rules_dict(self) -> dict[str, tuple[str, ...] | None]:
        return dict(self.rules)

    def sharding(self, axes: tuple[str | None, ...], shape: tuple[int, ...]) -> NamedSharding:
        """The NamedSharding of one array with logical ``axes`` and ``shape``."""
        return sh.logical_sharding(axes, shape, self.mesh, self.rules_dict)

    def params(self, model_or_state: Any) -> nnx.State:
        """`param_shardings` on this mesh."""
        return param_shardings(model_or_state, self.mesh, self.rules_dict)

    def place_params(self, model_or_state: Any) -> nnx.State:
        """`place_params` on this mesh (a module is updated in place)."""
        return place_params(model_or_state, self.mesh, self.rules_dict)

    def batch(self, tree: Any) -> Any:
        """Shardings of a pytree of [B, ...] arrays (e.g. a ``TrainBatch``): rows over the
        'batch' rule, every other dim replicated. Leaves may be arrays or ShapeDtypeStructs."""
        return jax.tree.map(lambda x: self.sharding(sh.batch_axes(np.ndim(x)), np.shape(x)), tree)

    def replicate(self, tree: Any) -> Any:
        """Every array of ``tree`` (PRNG keys included) replicated on every device of the mesh:
        a global array that every process of a multi-host run can use in the runtime's jitted
        functions. The value must be the same on every process."""
        from ace_jax.runtime import multihost  # local: multihost is only needed here

        rep = sh.replicated(self.mesh)

        def one(x):
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                data = sh.place(multihost.host_value(jax.random.key_data(x)), rep)
                return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
            return sh.place(multihost.host_value(x), rep)

        return jax.tree.map(one, tree)

    def place_batch(self, tree: Any) -> Any:
        """``tree`` placed by `batch`."""
        return sh.place(tree, self.batch(tree))

    def kv_cache(self, cache: Any) -> Any:
        """Shardings of a `models.qwen3.KVCache` (either layout; see `KV_CACHE_AXES`; a shared
        prefix's rows over the same axes as the rows, so a prompt's prefix sits with its G rows
        when they split as its rows do), as a KVCache of NamedShardings. Leaves may be arrays or
        ShapeDtypeStructs."""
        from models import qwen3  # local: models stay importable without the runtime

        if cache.layout not in KV_CACHE_AXES:
            raise ValueError(f"unknown KV-cache layout {cache.layout!r}; valid: {list(KV_CACHE_AXES)}")
        k_axes, v_axes = KV_CACHE_AXES[cache.layout]
        return qwen3.KVCache(k=tuple(self.sharding(k_axes, np.shape(x)) for x in cache.k),
                             v=tuple(self.sharding(v_axes, np.shape(x)) for x in cache.v),
                             kv_mask=self.sharding(KV_MASK_AXES, np.shape(cache.kv_mask)),
                             layout=cache.layout,
                             prefix=None if cache.prefix is None else self.kv_cache(cache.prefix))

    def constrain_kv_cache(self, cache: Any) -> Any:
        """``cache`` constrained to `kv_cache` inside a jitted function."""
        return jax.lax.with_sharding_constraint(cache, self.kv_cache(cache))

    def optimizer_state(self, tx: Any, params: Any) -> Any:
        """Shardings of ``tx.init(params)``: params-shaped parts follow the params, the rest
        (counts) replicated. ``params``: the Param state (arrays or abstract)."""
        abstract = jax.eval_shape(tx.init, params)
        return sh.optimizer_state_shardings(tx, abstract, self.params(params), self.mesh)
