"""The one two-way HF <-> Flax parameter table of the Qwen3 family, and HF load / export driven by it.

The table (`QWEN3_PARAM_TABLE`) is a list of `ParamRule` rows. Each row says, for one parameter:
the Flax flat name (``/``-joined, relative to a layer group for per-layer rows), the HF
safetensors key pattern, the scope (``global`` | ``layer`` | ``expert``), which layer kinds it
applies to (``dense`` / ``moe``), the HF shape as symbolic dims, and a named `Transform` between
one HF tensor ``[out, in]`` and its Flax slice. `load_hf_checkpoint` and `export_hf` both walk
this table; there is no second list of names anywhere.

Flax layout (the contract with `models.qwen3.flat_params`; Lg = layers of group g, and HF layer
``i`` of group g = ``layer_groups()[g]`` sits at index ``i - start``)::

    embed_tokens/embedding                      [V, H]
    layers/{g}/input_layernorm/scale            [Lg, H]
    layers/{g}/post_attention_layernorm/scale   [Lg, H]
    layers/{g}/self_attn/{q,k,v}_proj/kernel    [Lg, H, n, d]    n = nq for q, nkv for k/v
    layers/{g}/self_attn/o_proj/kernel          [Lg, nq, d, H]
    layers/{g}/self_attn/{q,k}_norm/scale       [Lg, d]
    layers/{g}/mlp/{gate,up}_proj/kernel        [Lg, H, I]       dense groups
    layers/{g}/mlp/down_proj/kernel             [Lg, I, H]
    layers/{g}/mlp/gate/kernel                  [Lg, H, E]       moe groups (router)
    layers/{g}/mlp/experts/{gate,up}_proj       [Lg, E, H, Im]
    layers/{g}/mlp/experts/down_proj            [Lg, E, Im, H]
    norm/scale                                  [H]
    lm_head/kernel                              [H, V]           absent when tie_word_embeddings

HF checkpoints are read in either expert layout: the Hub's per-expert keys
(``mlp.experts.{j}.gate_proj.weight`` ...) or transformers v5's fused keys
(``mlp.experts.gate_up_proj`` [E, 2*Im, H] with gate rows first, ``mlp.experts.down_proj``
[E, H, Im]). Export always writes per-expert keys (what v4, vLLM and the Hub expect).

Reading uses ``safetensors`` with numpy (no torch); bf16 is ``ml_dtypes.bfloat16`` so an HF ->
Flax -> HF round trip in bf16 is bit-exact (no float16 hop). Paths may be local directories or
fsspec URLs (``gs://``, ``memory://``, ...). `SafetensorsReader` reads blocks of tensors: local
files through ``safe_open(...).get_slice``, remote ones by byte ranges from their headers' offsets
(nothing is copied to local disk). `load_hf_params_sharded` / `load_hf_model(shardings=...)` build
each parameter with ``jax.make_array_from_callback``, so a host reads only the blocks its devices
hold (the table maps a Flax block to the HF keys and rows / columns it covers). Exports are
written locally then uploaded.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from models.configs import RUNTIME_FIELDS, LayerGroup, ModelConfig, UnsupportedConfigError

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "UnsupportedConfigError",
    "ParamRule",
    "Transform",
    "TRANSFORMS",
    "QWEN3_PARAM_TABLE",
    "param_table",
    "flax_param_shapes",
    "hf_param_shapes",
    "flax_to_hf",
    "hf_to_flax",
    "ReadStats",
    "SafetensorsReader",
    "read_safetensors_dir",
    "load_hf_config",
    "load_hf_checkpoint",
    "load_hf_params_sharded",
    "load_hf_model",
    "export_hf",
    "HFTensor",
    "export_plan",
    "hf_tensor",
    "hf_config_dict",
]


class CheckpointError(ValueError):
    """A checkpoint directory cannot be read (missing file, malformed index)."""


class CheckpointMismatchError(CheckpointError):
    """Tensors and config disagree: a missing / unexpected tensor or a wrong shape (named in the message)."""


# --------------------------------------------------------------------------------------------------
# Transforms between one HF tensor (PyTorch Linear layout [out, in]) and its Flax slice.
# Both directions accept extra leading (batch) axes, so experts or layers can be converted at once.


Range = tuple[int, int]  # [start, stop) along one axis


@dataclasses.dataclass(frozen=True)
class Transform:
    """A named, invertible layout change. ``to_flax(x, dims)`` / ``to_hf(y, dims)`` act on the
    trailing axes (any leading axes are carried along); ``flax_shape(hf_shape, dims)`` maps shapes.

    ``hf_region(flax_ranges, dims) -> (hf_ranges, covered)`` maps a block of the Flax slice (one
    ``(start, stop)`` per trailing Flax axis) to the block of the HF tensor to read (one range per
    HF axis) and the Flax block that ``to_flax`` of that HF block yields: ``covered`` equals the
    request except where the HF block must span whole heads (a ``head_dim`` range is widened to
    ``(0, d)``; the caller cuts the requested part out of ``covered``).
    """

    name: str
    to_flax: Callable[[np.ndarray, Mapping[str, int]], np.ndarray]
    to_hf: Callable[[np.ndarray, Mapping[str, int]], np.ndarray]
    flax_shape: Callable[[tuple[int, ...], Mapping[str, int]], tuple[int, ...]]
    hf_region: Callable[[Sequence[Range], Mapping[str, int]], tuple[tuple[Range, ...], tuple[Range, ...]]]


def _swap(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _split_heads_out(n_key: str) -> Transform:
    # HF [n*d, H] -> Flax [H, n, d]   (q/k/v projections; head j owns rows j*d:(j+1)*d)
    def to_flax(x, dims):  # any whole number of heads (a block of rows), hence -1
        y = _swap(x)
        return y.reshape(*y.shape[:-1], -1, dims["d"])

    def to_hf(y, dims):
        x = y.reshape(*y.shape[:-2], dims[n_key] * dims["d"])
        return _swap(x)

    def shape(s, dims):
        return (*s[:-2], s[-1], dims[n_key], dims["d"])

    def region(r, dims):
        (h, n, _), d = r, dims["d"]
        return ((n[0] * d, n[1] * d), h), (h, n, (0, d))

    return Transform(f"split_heads_out[{n_key}]", to_flax, to_hf, shape, region)


def _merge_heads_in(n_key: str) -> Transform:
    # HF [H, n*d] -> Flax [n, d, H]   (o_proj)
    def to_flax(x, dims):  # any whole number of heads (a block of columns), hence -1
        y = _swap(x)
        return y.reshape(*y.shape[:-2], -1, dims["d"], y.shape[-1])

    def to_hf(y, dims):
        x = y.reshape(*y.shape[:-3], dims[n_key] * dims["d"], y.shape[-1])
        return _swap(x)

    def shape(s, dims):
        return (*s[:-2], dims[n_key], dims["d"], s[-2])

    def region(r, dims):
        (n, _, h), d = r, dims["d"]
        return (h, (n[0] * d, n[1] * d)), (n, (0, d), h)

    return Transform(f"merge_heads_in[{n_key}]", to_flax, to_hf, shape, region)


TRANSFORMS: dict[str, Transform] = {
    "identity": Transform("identity", lambda x, d: x, lambda y, d: y, lambda s, d: tuple(s),
                          lambda r, d: (tuple(r), tuple(r))),
    "transpose": Transform("transpose", lambda x, d: _swap(x), lambda y, d: _swap(y),
                           lambda s, d: (*s[:-2], s[-1], s[-2]),
                           lambda r, d: ((*r[:-2], r[-1], r[-2]), tuple(r))),
    "q_heads": _split_heads_out("nq"),
    "kv_heads": _split_heads_out("nkv"),
    "o_heads": _merge_heads_in("nq"),
}


# --------------------------------------------------------------------------------------------------
# The table


@dataclasses.dataclass(frozen=True)
class ParamRule:
    """One row of a two-way parameter table.

    Attributes:
      flax: Flax flat name; for ``layer``/``expert`` scope it is relative to ``layers/{g}/``.
      hf: HF key; ``{i}`` = HF layer index, ``{j}`` = expert index (``expert`` scope only).
      scope: "global" (one tensor), "layer" (one per layer, stacked on a leading [Lg] axis) or
        "expert" (one per layer and expert, stacked [Lg, E, ...]).
      transform: name in `TRANSFORMS`, applied to one HF tensor.
      hf_shape: symbolic HF shape of one tensor: dim names from `_dims`, products like "nq*d".
      kinds: layer kinds ("dense", "moe") a per-layer row applies to.
      untied_only: the row exists only when ``tie_word_embeddings`` is false (lm_head).
      fused: for expert rows, transformers v5's fused key (with ``{i}``) and which part of it
        along axis 1 this row is: ("key", part, n_parts) — e.g. gate = part 0 of 2 of gate_up_proj.
    """

    flax: str
    hf: str
    scope: str
    transform: str
    hf_shape: tuple[str, ...]
    kinds: frozenset = frozenset({"dense", "moe"})
    untied_only: bool = False
    fused: tuple[str, int, int] | None = None


_DENSE = frozenset({"dense"})
_MOE = frozenset({"moe"})

QWEN3_PARAM_TABLE: tuple[ParamRule, ...] = (
    ParamRule("embed_tokens/embedding", "model.embed_tokens.weight", "global", "identity", ("V", "H")),
    ParamRule("input_layernorm/scale", "model.layers.{i}.input_layernorm.weight", "layer", "identity", ("H",)),
    ParamRule("post_attention_layernorm/scale", "model.layers.{i}.post_attention_layernorm.weight", "layer",
              "identity", ("H",)),
    ParamRule("self_attn/q_proj/kernel", "model.layers.{i}.self_attn.q_proj.weight", "layer", "q_heads",
              ("nq*d", "H")),
    ParamRule("self_attn/k_proj/kernel", "model.layers.{i}.self_attn.k_proj.weight", "layer", "kv_heads",
              ("nkv*d", "H")),
    ParamRule("self_attn/v_proj/kernel", "model.layers.{i}.self_attn.v_proj.weight", "layer", "kv_heads",
              ("nkv*d", "H")),
    ParamRule("self_attn/o_proj/kernel", "model.layers.{i}.self_attn.o_proj.weight", "layer", "o_heads",
              ("H", "nq*d")),
    ParamRule("self_attn/q_norm/scale", "model.layers.{i}.self_attn.q_norm.weight", "layer", "identity", ("d",)),
    ParamRule("self_attn/k_norm/scale", "model.layers.{i}.self_attn.k_norm.weight", "layer", "identity", ("d",)),
    ParamRule("mlp/gate_proj/kernel", "model.layers.{i}.mlp.gate_proj.weight", "layer", "transpose", ("I", "H"),
              kinds=_DENSE),
    ParamRule("mlp/up_proj/kernel", "model.layers.{i}.mlp.up_proj.weight", "layer", "transpose", ("I", "H"),
              kinds=_DENSE),
    ParamRule("mlp/down_proj/kernel", "model.layers.{i}.mlp.down_proj.weight", "layer", "transpose", ("H", "I"),
              kinds=_DENSE),
    ParamRule("mlp/gate/kernel", "model.layers.{i}.mlp.gate.weight", "layer", "transpose", ("E", "H"), kinds=_MOE),
    ParamRule("mlp/experts/gate_proj", "model.layers.{i}.mlp.experts.{j}.gate_proj.weight", "expert", "transpose",
              ("Im", "H"), kinds=_MOE, fused=("model.layers.{i}.mlp.experts.gate_up_proj", 0, 2)),
    ParamRule("mlp/experts/up_proj", "model.layers.{i}.mlp.experts.{j}.up_proj.weight", "expert", "transpose",
              ("Im", "H"), kinds=_MOE, fused=("model.layers.{i}.mlp.experts.gate_up_proj", 1, 2)),
    ParamRule("mlp/experts/down_proj", "model.layers.{i}.mlp.experts.{j}.down_proj.weight", "expert", "transpose",
              ("H", "Im"), kinds=_MOE, fused=("model.layers.{i}.mlp.experts.down_proj", 0, 1)),
    ParamRule("norm/scale", "model.norm.weight", "global", "identity", ("H",)),
    ParamRule("lm_head/kernel", "lm_head.weight", "global", "transpose", ("V", "H"), untied_only=True),
)

# model_type -> table. A new family registers its own table here.
_TABLES: dict[str, tuple[ParamRule, ...]] = {"qwen3": QWEN3_PARAM_TABLE, "qwen3_moe": QWEN3_PARAM_TABLE}


def param_table(model_type: str = "qwen3_moe") -> tuple[ParamRule, ...]:
    """The parameter table registered for an HF ``model_type``."""
    try:
        return _TABLES[model_type]
    except KeyError:
        raise UnsupportedConfigError(
            f"model_type={model_type!r} has no HF parameter table; known: {sorted(_TABLES)}"
        ) from None


def _model_type(config: ModelConfig) -> str:
    return "qwen3_moe" if config.num_experts > 0 else "qwen3"


def _dims(config: ModelConfig) -> dict[str, int]:
    return dict(
        V=config.vocab_size, H=config.hidden_size, nq=config.num_attention_heads,
        nkv=config.num_key_value_heads, d=config.head_dim, I=config.intermediate_size,
        Im=config.moe_intermediate_size, E=config.num_experts,
    )


def _eval_shape(sym: Sequence[str], dims: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(math.prod(dims[f] for f in s.split("*")) for s in sym)


def _active_rules(config: ModelConfig) -> list[ParamRule]:
    return [r for r in param_table(_model_type(config)) if not (r.untied_only and config.tie_word_embeddings)]


def _group_rules(rules: Sequence[ParamRule], group: LayerGroup) -> list[ParamRule]:
    return [r for r in rules if r.scope != "global" and group.kind in r.kinds]


def _flax_name(rule: ParamRule, g: int) -> str:
    return rule.flax if rule.scope == "global" else f"layers/{g}/{rule.flax}"


def flax_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Flat Flax name -> shape, for every parameter the table defines under ``config``."""
    dims, rules = _dims(config), _active_rules(config)
    out: dict[str, tuple[int, ...]] = {}
    for rule in rules:
        if rule.scope == "global":
            out[rule.flax] = TRANSFORMS[rule.transform].flax_shape(_eval_shape(rule.hf_shape, dims), dims)
    for g, group in enumerate(config.layer_groups()):
        for rule in _group_rules(rules, group):
            one = TRANSFORMS[rule.transform].flax_shape(_eval_shape(rule.hf_shape, dims), dims)
            lead = (group.count, dims["E"]) if rule.scope == "expert" else (group.count,)
            out[_flax_name(rule, g)] = (*lead, *one)
    return out


def hf_param_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF key -> shape in the Hub's per-expert layout (what `export_hf` writes), in export order."""
    return {key: shape for key, shape, _ in _hf_plan(config)}


# --------------------------------------------------------------------------------------------------
# numpy-level conversion (the table applied to dicts of arrays)


def _hf_plan(config: ModelConfig) -> Iterator[tuple[str, tuple[int, ...], tuple[ParamRule, str, tuple[int, ...]]]]:
    """Yields (hf_key, hf_shape, (rule, flax_name, index into the stacked Flax array)) in file order."""
    dims, rules = _dims(config), _active_rules(config)
    globals_ = [r for r in rules if r.scope == "global"]
    head = [r for r in globals_ if r.flax == "embed_tokens/embedding"]
    tail = [r for r in globals_ if r.flax != "embed_tokens/embedding"]
    for rule in head:
        yield rule.hf, _eval_shape(rule.hf_shape, dims), (rule, rule.flax, ())
    for g, group in enumerate(config.layer_groups()):
        for li in range(group.count):
            i = group.start + li
            for rule in _group_rules(rules, group):
                shape = _eval_shape(rule.hf_shape, dims)
                if rule.scope == "expert":
                    for j in range(dims["E"]):
                        yield rule.hf.format(i=i, j=j), shape, (rule, _flax_name(rule, g), (li, j))
                else:
                    yield rule.hf.format(i=i), shape, (rule, _flax_name(rule, g), (li,))
    for rule in tail:
        yield rule.hf, _eval_shape(rule.hf_shape, dims), (rule, rule.flax, ())


def _fmt_keys(keys: Sequence[str], limit: int = 8) -> str:
    keys = sorted(keys)
    more = f" ... and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _check_shape(name: str, got: tuple[int, ...], want: tuple[int, ...], where: str) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointMismatchError(
            f"tensor {name!r} has shape {tuple(got)} in {where} but the config implies {tuple(want)}"
        )


def _cast(x: np.ndarray, dtype: Any) -> np.ndarray:
    if dtype is None:
        return x
    dt = _np_dtype(dtype)
    return x if x.dtype == dt else x.astype(dt)


def _np_dtype(dtype: Any) -> np.dtype:
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise ValueError(f"unknown dtype {dtype!r}") from exc


@dataclasses.dataclass(frozen=True)
class _Source:
    """Where one Flax parameter's numbers are in a checkpoint.

    ``tensors``: for a global rule ``(key,)``; for a layer rule one key per layer of the group; for
    an expert rule, per layer either the fused v5 key (a str) or the per-expert keys (a tuple).
    ``tied_copy``: a stored ``lm_head.weight`` that must equal this (embedding) tensor.
    """

    rule: ParamRule
    tensors: tuple
    tied_copy: str | None = None


_LEADING_AXES = {"global": 0, "layer": 1, "expert": 2}  # stacked [Lg] / [Lg, E] axes before the slice


def _plan_sources(config: ModelConfig, keys: Mapping[str, tuple[int, ...]]) -> dict[str, _Source]:
    """Flax name -> `_Source`, from the checkpoint's key -> shape alone (nothing is read).

    Raises:
      CheckpointMismatchError: naming the tensor(s): missing, unexpected, or of the wrong shape.
    """
    dims, rules = _dims(config), _active_rules(config)
    used: set[str] = set()
    missing: list[str] = []

    def need(key: str, want: tuple[int, ...]) -> bool:
        if key not in keys:
            missing.append(key)
            return False
        _check_shape(key, keys[key], want, "the checkpoint")
        used.add(key)
        return True

    plan: dict[str, _Source] = {}
    for rule in rules:
        if rule.scope == "global" and need(rule.hf, _eval_shape(rule.hf_shape, dims)):
            plan[rule.flax] = _Source(rule, (rule.hf,))

    for g, group in enumerate(config.layer_groups()):
        for rule in _group_rules(rules, group):
            one = _eval_shape(rule.hf_shape, dims)
            per_layer: list[str | tuple[str, ...]] = []
            complete = True
            for li in range(group.count):
                i = group.start + li
                if rule.scope == "layer":
                    key = rule.hf.format(i=i)
                    complete &= need(key, one)
                    per_layer.append(key)
                elif rule.fused is not None and rule.fused[0].format(i=i) in keys:
                    fkey, _, n_parts = rule.fused
                    key = fkey.format(i=i)
                    complete &= need(key, (dims["E"], one[0] * n_parts, one[1]))
                    per_layer.append(key)
                else:
                    experts = tuple(rule.hf.format(i=i, j=j) for j in range(dims["E"]))
                    complete &= all([need(k, one) for k in experts])  # a list: every missing key is named
                    per_layer.append(experts)
            if complete:
                plan[_flax_name(rule, g)] = _Source(rule, tuple(per_layer))

    if config.tie_word_embeddings and "lm_head.weight" in keys:
        # Some tied checkpoints still carry a copy of the head; accepted only if it IS the embedding
        # (checked block by block as the embedding is read).
        _check_shape("lm_head.weight", keys["lm_head.weight"], (dims["V"], dims["H"]), "the checkpoint")
        used.add("lm_head.weight")
        if "embed_tokens/embedding" in plan:
            plan["embed_tokens/embedding"] = dataclasses.replace(plan["embed_tokens/embedding"],
                                                                 tied_copy="lm_head.weight")
    if missing:
        raise CheckpointMismatchError(
            f"{len(missing)} tensor(s) required by the config are missing from the checkpoint: {_fmt_keys(missing)}"
        )
    unexpected = sorted(set(keys) - used)
    if unexpected:
        raise CheckpointMismatchError(
            f"{len(unexpected)} unexpected tensor(s) in the checkpoint (not in the Qwen3 table for this "
            f"config): {_fmt_keys(unexpected)} (shape of the first: {tuple(keys[unexpected[0]])})"
        )
    return plan


ReadMany = Callable[[Sequence[tuple[str, tuple[slice, ...]]]], list[np.ndarray]]
# [(HF key, box: one slice per axis), ...] -> those blocks of the HF tensors, in order


def _read_block(source: _Source, block: Sequence[Range], dims: Mapping[str, int], read_many: ReadMany) -> np.ndarray:
    """One block of a Flax parameter (``block``: one ``(start, stop)`` per Flax axis), in its stored dtype.

    Reads only what the block covers, in one ``read_many`` call: the layers and experts in its
    leading ranges and, within each HF tensor, the rows / columns the transform maps the trailing
    ranges to (whole heads when a ``head_dim`` range is partial).

    Raises:
      CheckpointMismatchError: a stored tied ``lm_head.weight`` differs from the embedding here.
    """
    rule = source.rule
    tr = TRANSFORMS[rule.transform]
    n_lead = _LEADING_AXES[rule.scope]
    lead, trail = tuple(block[:n_lead]), tuple(block[n_lead:])
    hf_ranges, covered = tr.hf_region(trail, dims)
    box = tuple(slice(a, b) for a, b in hf_ranges)
    layers = range(*lead[0]) if n_lead else range(1)
    experts = slice(*lead[1]) if n_lead == 2 else None
    requests: list[tuple[str, tuple[slice, ...]]] = []
    per_layer: list[int | None] = []  # blocks read per layer; None: one tensor is the layer's block
    for li in layers:
        tensors = source.tensors[li]
        if experts is None:
            requests.append((tensors, box))
            per_layer.append(None)
        elif isinstance(tensors, str):  # fused [E, n_parts * out, in]; this rule is rows part*out:(part+1)*out
            offset = rule.fused[1] * _eval_shape(rule.hf_shape, dims)[0]
            requests.append((tensors, (experts, slice(offset + box[0].start, offset + box[0].stop), *box[1:])))
            per_layer.append(None)
        else:
            requests.extend((key, box) for key in tensors[experts])
            per_layer.append(len(tensors[experts]))
    if source.tied_copy is not None:
        requests.append((source.tied_copy, box))
    parts = read_many(requests)
    if source.tied_copy is not None:
        copy = parts.pop()
        if not np.array_equal(np.asarray(copy, dtype=np.float32), np.asarray(parts[0], dtype=np.float32)):
            raise CheckpointMismatchError(
                f"config.json says tie_word_embeddings=true but {source.tied_copy!r} differs from "
                f"{source.tensors[0]!r}"
            )
    it = iter(parts)
    blocks = [next(it) if n is None else np.stack([next(it) for _ in range(n)]) for n in per_layer]
    x = blocks[0] if rule.scope == "global" else np.stack(blocks)
    local = tuple(slice(want[0] - have[0], want[1] - have[0]) for want, have in zip(trail, covered))
    return tr.to_flax(x, dims)[(Ellipsis, *local)]


def hf_to_flax(
    get: Callable[[str], np.ndarray],
    keys: Mapping[str, tuple[int, ...]],
    config: ModelConfig,
    *,
    dtype: Any = None,
) -> dict[str, np.ndarray]:
    """Build the flat Flax dict from HF tensors, validating names and shapes against the table.

    Every name and shape is checked (from ``keys``) before any tensor is read.

    Args:
      get: returns the HF tensor for a key (numpy, HF layout).
      keys: every HF key available -> its shape (used to check for missing / unexpected tensors
        and to detect the fused v5 expert layout per layer before reading anything).
      config: the model config the tensors must match.
      dtype: cast every array to this dtype (e.g. "float32", "bfloat16"); None keeps the stored one.

    Returns:
      flat Flax name -> numpy array (layouts of the module docstring).

    Raises:
      CheckpointMismatchError: naming the tensor(s): missing, unexpected, or of the wrong shape.
    """
    plan = _plan_sources(config, keys)
    dims, shapes = _dims(config), flax_param_shapes(config)

    def read_many(requests: Sequence[tuple[str, tuple[slice, ...]]]) -> list[np.ndarray]:
        return [get(key)[box] for key, box in requests]

    return {
        name: _cast(_read_block(source, [(0, n) for n in shapes[name]], dims, read_many), dtype)
        for name, source in plan.items()
    }


def flax_to_hf(
    flat: Mapping[str, Any],
    config: ModelConfig,
    *,
    dtype: Any = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF key, numpy tensor) in the per-expert Hub layout, lazily, in file order.

    Validates first that ``flat`` has exactly the table's names and shapes.

    Args:
      flat: flat Flax name -> array (numpy or fully addressable jax.Array).
      config: the model config.
      dtype: output dtype ("bfloat16", "float32", ...); None (default): the model's
        ``config.param_dtype``. Casting uses numpy/ml_dtypes round-to-nearest-even; a bf16 input
        is passed through bit-exactly.

    Raises:
      CheckpointMismatchError: a Flax parameter is missing, unexpected, or of the wrong shape.
    """
    _check_flat(flat, config)
    return _flax_to_hf_unchecked(flat, config, _export_dtype(dtype, config))


def _export_dtype(dtype: Any, config: ModelConfig) -> np.dtype:
    return _np_dtype(config.param_dtype if dtype is None else dtype)


def _check_flat(flat: Mapping[str, Any], config: ModelConfig) -> None:
    want = flax_param_shapes(config)
    missing = sorted(set(want) - set(flat))
    unexpected = sorted(set(flat) - set(want))
    if missing:
        raise CheckpointMismatchError(f"Flax parameters missing for this config: {_fmt_keys(missing)}")
    if unexpected:
        raise CheckpointMismatchError(f"unexpected Flax parameters for this config: {_fmt_keys(unexpected)}")
    for name, shape in want.items():
        _check_shape(name, tuple(np.shape(flat[name])), shape, "the Flax parameters")


def _flax_to_hf_unchecked(flat: Mapping[str, Any], config: ModelConfig, dtype: Any) -> Iterator[tuple[str, np.ndarray]]:
    dims = _dims(config)
    # Host copies of one layer's slices at a time (a device array is sliced before the transfer),
    # so exporting never holds a second full copy of the model on the host.
    host: dict[tuple[str, int | None], np.ndarray] = {}
    current_layer: tuple[str, int | None] | None = None
    for key, hf_shape, (rule, name, index) in _hf_plan(config):
        layer = ("/".join(name.split("/")[:2]) if index else "", index[0] if index else None)
        if layer != current_layer:
            host.clear()
            current_layer = layer
        slot = (name, index[0] if index else None)
        if slot not in host:
            host[slot] = np.asarray(flat[name][index[0]] if index else flat[name])
        y = host[slot][index[1:]] if len(index) > 1 else host[slot]
        x = np.ascontiguousarray(_cast(TRANSFORMS[rule.transform].to_hf(y, dims), dtype))
        assert x.shape == hf_shape, (key, x.shape, hf_shape)
        yield key, x


@dataclasses.dataclass(frozen=True)
class HFTensor:
    """One HF tensor of an export and where its numbers are in the Flax parameters.

    ``index`` indexes the stacked leading axes of ``flax`` (``()`` global, ``(layer,)`` per
    layer, ``(layer, expert)`` per expert; layer = index within the group); ``transform`` turns
    that Flax slice into the HF tensor of ``shape``.
    """

    key: str
    shape: tuple[int, ...]
    flax: str
    index: tuple[int, ...]
    transform: str


def export_plan(config: ModelConfig) -> dict[str, list[HFTensor]]:
    """Flat Flax name -> the HF tensors made from it (per-expert Hub layout), parameter by
    parameter: the order in which a streaming export reads each stacked parameter once and writes
    its tensors (`export_hf` writes the same keys layer by layer). Same keys and shapes as
    `hf_param_shapes`."""
    out: dict[str, list[HFTensor]] = {}
    order = list(flax_param_shapes(config))
    for key, shape, (rule, name, index) in _hf_plan(config):
        out.setdefault(name, []).append(HFTensor(key, tuple(shape), name, tuple(index), rule.transform))
    return {name: out[name] for name in order if name in out}


def hf_tensor(item: HFTensor, flax_slice: np.ndarray, config: ModelConfig, dtype: Any = None) -> np.ndarray:
    """The HF tensor ``item`` (C-contiguous, cast to ``dtype``; None keeps the slice's) from its Flax
    slice (the stacked parameter at ``item.index``)."""
    x = np.ascontiguousarray(_cast(TRANSFORMS[item.transform].to_hf(np.asarray(flax_slice), _dims(config)), dtype))
    if x.shape != item.shape:
        raise CheckpointMismatchError(f"tensor {item.key!r}: {x.shape} from {item.flax!r}, expected {item.shape}")
    return x


def hf_config_dict(config: ModelConfig, dtype: Any = None) -> dict[str, Any]:
    """The ``config.json`` `export_hf` writes for ``config`` stored in ``dtype``."""
    return _hf_config_for_export(config, None if dtype is None else _np_dtype(dtype))


# --------------------------------------------------------------------------------------------------
# Files


def _is_remote(path: str | os.PathLike) -> bool:
    s = os.fspath(path)
    return "://" in s and not s.startswith("file://")


def _local_path(path: str | os.PathLike) -> pathlib.Path:
    s = os.fspath(path)
    return pathlib.Path(s[len("file://"):] if s.startswith("file://") else s)


# safetensors dtype names -> numpy (bf16 / fp8 through ml_dtypes). Files are little-endian.
_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn",
              "F8_E5M2": "float8_e5m2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1",
              "BOOL": "?"}
_MAX_HEADER_BYTES = 100 * 1024**2  # the safetensors format's own bound on the JSON header
DEFAULT_MAX_GAP_BYTES = 1024**2


def _st_dtype(name: str, key: str, where: str) -> np.dtype:
    import ml_dtypes

    if name not in _ST_DTYPES:
        raise CheckpointError(f"tensor {key!r} in {where} has the unsupported dtype {name!r}")
    np_name = _ST_DTYPES[name]
    return np.dtype(getattr(ml_dtypes, np_name) if hasattr(ml_dtypes, np_name) else np_name)


@dataclasses.dataclass
class ReadStats:
    """What a load read from the checkpoint's safetensors files (a `SafetensorsReader` adds to it).

    Attributes:
      tensor_bytes: bytes of tensor data read. Local files: the bytes of every slice read (the file
        is memory-mapped and only the slice is copied out). Remote files: the bytes of every range
        requested, which includes the gaps (at most ``max_gap_bytes`` each) merged between runs.
      header_bytes: bytes of the safetensors headers read from remote files (``safe_open`` parses
        local headers; they are not counted).
      requests: slice reads (local) or byte-range requests (remote); headers not included.
      by_key: HF key -> tensor bytes read for it.
    """

    tensor_bytes: int = 0
    header_bytes: int = 0
    requests: int = 0
    by_key: dict[str, int] = dataclasses.field(default_factory=dict)

    def add(self, key: str, nbytes: int, requests: int = 1) -> None:
        self.tensor_bytes += nbytes
        self.requests += requests
        self.by_key[key] = self.by_key.get(key, 0) + nbytes


@dataclasses.dataclass(frozen=True)
class _TensorEntry:
    file: str                 # path of the safetensors file on its filesystem
    shape: tuple[int, ...]
    dtype: np.dtype
    offset: int               # absolute byte offset of the tensor's first element (remote reads)


def _fs_and_root(path: str | os.PathLike, storage_options: Mapping[str, Any] | None):
    import fsspec

    if _is_remote(path):
        fs, root = fsspec.core.url_to_fs(os.fspath(path), **dict(storage_options or {}))
        return fs, root.rstrip("/")
    return fsspec.filesystem("file"), str(_local_path(path).absolute())


def _checked_box(box: Sequence[slice] | None, shape: tuple[int, ...], key: str) -> tuple[Range, ...]:
    if box is None:
        return tuple((0, n) for n in shape)
    if len(box) != len(shape):
        raise ValueError(f"a block of tensor {key!r} {shape} needs {len(shape)} slices, got {len(box)}")
    out = []
    for s, n in zip(box, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"tensor {key!r}: only contiguous slices can be read, got step {step}")
        out.append((start, max(start, stop)))
    return tuple(out)


def _byte_runs(shape: tuple[int, ...], block: tuple[Range, ...], itemsize: int) -> tuple[np.ndarray, int]:
    """(start of every contiguous run of ``block`` in bytes from the tensor's first byte, run length).

    The runs are in C order: axis ``k`` is the last axis that ``block`` does not span fully (the
    axes after it are whole), so a run is ``block[k]`` times the whole trailing axes.
    """
    if not shape:
        return np.zeros(1, np.int64), itemsize
    k = len(shape) - 1
    while k > 0 and block[k] == (0, shape[k]):
        k -= 1
    strides = [math.prod(shape[a + 1:]) for a in range(len(shape))]
    starts = np.array([block[k][0] * strides[k]], np.int64)
    for a in range(k - 1, -1, -1):
        starts = (np.arange(*block[a], dtype=np.int64)[:, None] * strides[a] + starts[None, :]).reshape(-1)
    return starts * itemsize, (block[k][1] - block[k][0]) * strides[k] * itemsize


def _merge_runs(starts: np.ndarray, length: int, max_gap: int) -> list[tuple[int, int, list[int]]]:
    """Ascending runs ``[s, s + length)`` -> byte ranges ``(start, end, [run starts])``: a run
    that begins at most ``max_gap`` bytes after the current range ends extends it."""
    # Linear in the runs: a range's run list grows in place (a row-sharded vocabulary matrix
    # is ~150k runs merged into one range; copying the list at each run was quadratic: hours).
    ranges: list[list] = []
    for s in starts.tolist():
        if ranges and s - ranges[-1][1] <= max_gap:
            ranges[-1][1] = s + length
            ranges[-1][2].append(s)
        else:
            ranges.append([s, s + length, [s]])
    return [(a, b, runs) for a, b, runs in ranges]


class SafetensorsReader:
    """The safetensors files of one HF checkpoint directory, local or remote, read block by block.

    Opening reads only the index JSON and every file's header (key, dtype, shape, byte offsets);
    `read` returns one block of one tensor and reads nothing else. Local files are memory-mapped
    through ``safetensors.safe_open(...).get_slice``. Remote files (``gs://``, any fsspec URL) are
    read by byte ranges (``fs.cat_ranges``): the C-order runs that make up the block, where runs
    at most ``max_gap_bytes`` apart are fetched as one range (a column block of a row-major
    tensor is one short run per row: merging trades a few more bytes for far fewer requests).

    Args:
      path: a local directory or fsspec URL holding ``model.safetensors``, or
        ``model.safetensors.index.json`` and the shards it names.
      storage_options: fsspec options for a remote path (e.g. gcsfs ``endpoint_url``, ``token``).
      max_gap_bytes: remote reads only; 0 requests exactly the bytes of the block.
      stats: a `ReadStats` that reads are added to (default: a fresh one, ``.stats``).

    Attributes:
      shapes: HF key -> shape, for every tensor of every file.
      stats: the `ReadStats` of this reader.

    Raises:
      CheckpointError: no weights file, a shard named in the index is absent, a tensor in two
        files, the index and the shards disagree, or a malformed header.
    """

    def __init__(self, path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None,
                 max_gap_bytes: int = DEFAULT_MAX_GAP_BYTES, stats: ReadStats | None = None):
        if max_gap_bytes < 0:
            raise ValueError(f"max_gap_bytes must be >= 0, got {max_gap_bytes}")
        self.stats = stats if stats is not None else ReadStats()
        self._max_gap = int(max_gap_bytes)
        self._remote = _is_remote(path)
        self._fs, self._root = _fs_and_root(path, storage_options)
        self._shown = os.fspath(path) if self._remote else self._root
        self._handles: dict[str, Any] = {}
        self._entries: dict[str, _TensorEntry] = {}
        try:
            self._index_files()
        except BaseException:
            self.close()
            raise
        self.shapes = {k: e.shape for k, e in self._entries.items()}

    # ------------------------------------------------------------------------------- opening

    def _path(self, name: str) -> str:
        return f"{self._root}/{name}"

    def _index_files(self) -> None:
        index_file = self._path("model.safetensors.index.json")
        if self._fs.isfile(index_file):
            try:
                weight_map = json.loads(self._fs.cat_file(index_file))["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index_file} is not a valid safetensors index: {exc}") from exc
        elif self._fs.isfile(self._path("model.safetensors")):
            weight_map, files = None, ["model.safetensors"]
        else:
            raise CheckpointError(
                f"no weights in {self._shown!r}: expected model.safetensors or model.safetensors.index.json"
            )
        where: dict[str, str] = {}
        for fname in files:
            fpath = self._path(fname)
            if not self._fs.isfile(fpath):
                raise CheckpointError(f"shard {fname!r} named in the index is missing from {self._shown!r}")
            entries = self._remote_header(fpath, fname) if self._remote else self._local_header(fpath)
            for key, entry in entries.items():
                if key in where:
                    raise CheckpointError(f"tensor {key!r} appears in both {where[key]} and {fname}")
                where[key] = fname
                self._entries[key] = entry
        if weight_map is not None:
            for key, fname in weight_map.items():
                if key not in where:
                    raise CheckpointMismatchError(f"tensor {key!r} is in the index ({fname}) but in no shard")
                if where[key] != fname:
                    raise CheckpointError(f"tensor {key!r}: index says {fname}, found in {where[key]}")
            extra = sorted(set(where) - set(weight_map))
            if extra:
                raise CheckpointError(f"shards hold tensors absent from the index: {_fmt_keys(extra)}")

    def _local_header(self, fpath: str) -> dict[str, _TensorEntry]:
        from safetensors import safe_open

        try:
            handle = safe_open(fpath, framework="numpy")
        except Exception as exc:  # safetensors raises its own SafetensorError for a malformed file
            raise CheckpointError(f"{fpath} is not a readable safetensors file: {exc}") from exc
        self._handles[fpath] = handle
        out = {}
        for key in handle.keys():
            sl = handle.get_slice(key)
            out[key] = _TensorEntry(fpath, tuple(sl.get_shape()), _st_dtype(sl.get_dtype(), key, fpath), 0)
        return out

    def _remote_header(self, fpath: str, fname: str) -> dict[str, _TensorEntry]:
        head = self._fs.cat_file(fpath, start=0, end=8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < n <= _MAX_HEADER_BYTES:
            raise CheckpointError(f"{fname} in {self._shown!r} is not a safetensors file (header length {n})")
        raw = self._fs.cat_file(fpath, start=8, end=8 + n)
        self.stats.header_bytes += 8 + len(raw)
        try:
            header = json.loads(raw)
            out = {}
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                dtype, shape = _st_dtype(info["dtype"], key, fname), tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
                if end - begin != math.prod(shape) * dtype.itemsize:
                    raise CheckpointError(f"tensor {key!r} in {fname}: {end - begin} bytes for {shape} {dtype}")
                out[key] = _TensorEntry(fpath, shape, dtype, 8 + n + begin)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"{fname} in {self._shown!r} has a malformed safetensors header: {exc}") from exc
        return out

    # ------------------------------------------------------------------------------- reading

    def read(self, key: str, box: Sequence[slice] | None = None) -> np.ndarray:
        """The block ``box`` (one slice per axis, step 1; None = the whole tensor) of tensor ``key``,
        as numpy in the stored dtype (bf16 as ``ml_dtypes.bfloat16``).

        Raises:
          KeyError: ``key`` is not in the checkpoint.
          ValueError: ``box`` has the wrong length or a step other than 1.
        """
        return self.read_many([(key, box)])[0]

    def get(self, key: str) -> np.ndarray:
        """The whole tensor ``key``."""
        return self.read(key)

    def read_many(self, requests: Sequence[tuple[str, Sequence[slice] | None]]) -> list[np.ndarray]:
        """`read` of several (key, box) at once: remote byte ranges go out in one ``cat_ranges``
        call (concurrent on gcsfs), so a block spread over many HF tensors costs one round trip."""
        checked = []
        for key, box in requests:
            entry = self._entries[key]
            checked.append((key, entry, _checked_box(box, entry.shape, key)))
        if self._remote:
            return self._read_remote(checked)
        out = []
        for key, entry, block in checked:
            handle = self._handles[entry.file]
            x = handle.get_slice(key)[tuple(slice(a, b) for a, b in block)] if entry.shape else handle.get_tensor(key)
            self.stats.add(key, x.nbytes)
            out.append(x)
        return out

    def _read_remote(self, checked: Sequence[tuple[str, _TensorEntry, tuple[Range, ...]]]) -> list[np.ndarray]:
        plans = []  # per request: (byte ranges with their runs, run length)
        for key, entry, block in checked:
            if any(b == a for a, b in block):
                plans.append(([], 0))
                continue
            starts, length = _byte_runs(entry.shape, block, entry.dtype.itemsize)
            plans.append((_merge_runs(starts + entry.offset, length, self._max_gap), length))
        paths = [entry.file for (_, entry, _), (ranges, _) in zip(checked, plans) for _ in ranges]
        starts = [r[0] for ranges, _ in plans for r in ranges]
        ends = [r[1] for ranges, _ in plans for r in ranges]
        chunks = iter(self._fs.cat_ranges(paths, starts, ends) if paths else [])
        out = []
        for (key, entry, block), (ranges, length) in zip(checked, plans):
            parts = []
            for start, end, runs in ranges:
                chunk = next(chunks)
                if isinstance(chunk, BaseException):
                    raise chunk
                if len(chunk) != end - start:
                    raise CheckpointError(f"tensor {key!r}: {entry.file} ended after {len(chunk)} of "
                                          f"{end - start} bytes")
                parts.extend(chunk[s - start:s - start + length] for s in runs)
            if ranges:
                self.stats.add(key, sum(r[1] - r[0] for r in ranges), requests=len(ranges))
            shape = tuple(b - a for a, b in block)
            out.append(np.frombuffer(b"".join(parts), dtype=entry.dtype).reshape(shape))
        return out

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_safetensors_dir(
    path: str | os.PathLike, *, storage_options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, tuple[int, ...]], Callable[[str], np.ndarray]]:
    """Index the safetensors of an HF directory (local or fsspec URL) without loading them.

    Accepts ``model.safetensors.index.json`` + shards, or a single ``model.safetensors``.

    Returns:
      (key -> shape, get(key) -> numpy array). Arrays are read on demand (bf16 as ml_dtypes).

    Raises:
      CheckpointError: no weights file, a shard named in the index is absent, or the index and the
        shard contents disagree.
    """
    reader = SafetensorsReader(path, storage_options=storage_options)
    return dict(reader.shapes), reader.get




def load_hf_config(
    path: str | os.PathLike,
    *,
    config_overrides: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> ModelConfig:
    """The `ModelConfig` of an HF checkpoint directory: its ``config.json`` (no weights are read)
    with ``config_overrides`` on top (runtime fields such as ``dtype``, ``param_dtype``,
    ``moe_dispatch``; architecture fields must still match the weights when they are loaded).

    Raises:
      CheckpointError: the directory or its config.json does not exist, or is not valid JSON.
      UnsupportedConfigError: config features the port does not implement.
    """
    fs, root = _fs_and_root(path, storage_options)
    shown = os.fspath(path) if _is_remote(path) else root
    if not fs.isdir(root):
        raise CheckpointError(f"checkpoint directory {shown!r} does not exist")
    cfg_file = f"{root}/config.json"
    if not fs.isfile(cfg_file):
        raise CheckpointError(f"no config.json in {shown!r}")
    try:
        hf_cfg = json.loads(fs.cat_file(cfg_file))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {exc}") from exc
    overrides = dict(config_overrides or {})
    runtime = {k: overrides.pop(k) for k in list(overrides) if k in RUNTIME_FIELDS}
    config = ModelConfig.from_hf_dict(hf_cfg, **runtime)
    return config.replace(**overrides) if overrides else config


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    config_overrides: Mapping[str, Any] | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read an HF Qwen3 / Qwen3-MoE checkpoint directory into (ModelConfig, flat numpy params).

    The whole model is read into host memory; `load_hf_params_sharded` reads only the slices a
    host's devices hold.

    Args:
      path: a local directory or fsspec URL (``gs://...``, read in place by byte ranges) holding
        ``config.json`` and ``model.safetensors`` or sharded safetensors with
        ``model.safetensors.index.json``. Experts may be per-expert keys (the Hub) or fused
        (transformers v5 ``save_original_format=False``).
      dtype: cast all arrays to this dtype ("float32", "bfloat16", ...); None keeps the stored dtype.
      config_overrides: `ModelConfig` fields to set on top of config.json (runtime fields such as
        ``dtype``, ``param_dtype``, ``moe_dispatch``; architecture fields must still match the weights).
      storage_options: fsspec options for a remote path (e.g. gcsfs ``endpoint_url``, ``token``).

    Returns:
      (config, flat) with flat names and layouts of the module docstring.

    Raises:
      CheckpointError: missing config / weight files.
      CheckpointMismatchError: missing, unexpected, or wrongly shaped tensors (config.json and the
        weights disagree).
      UnsupportedConfigError: config features the port does not implement (sliding window, unknown
        rope type, ...).
    """
    config = load_hf_config(path, config_overrides=config_overrides, storage_options=storage_options)
    with SafetensorsReader(path, storage_options=storage_options) as reader:
        return config, hf_to_flax(reader.get, reader.shapes, config, dtype=dtype)


def _sharded_param(source: _Source, shape: tuple[int, ...], sharding: Any, dims: Mapping[str, int],
                   read_many: ReadMany, dtype: np.dtype):
    """One parameter as a ``jax.Array`` with ``sharding``, each addressable block read on its own
    (devices that hold the same block, e.g. replicas, share one read)."""
    import jax

    blocks: dict[tuple[Range, ...], np.ndarray] = {}

    def callback(index: tuple[slice, ...]) -> np.ndarray:
        block = tuple(s.indices(n)[:2] for s, n in zip(index, shape))
        if block not in blocks:
            blocks[block] = np.ascontiguousarray(_cast(_read_block(source, block, dims, read_many), dtype))
        return blocks[block]

    return jax.make_array_from_callback(shape, sharding, callback)


def load_hf_params_sharded(
    path: str | os.PathLike,
    config: ModelConfig,
    shardings: Mapping[str, Any],
    *,
    storage_options: Mapping[str, Any] | None = None,
    max_gap_bytes: int = DEFAULT_MAX_GAP_BYTES,
    stats: ReadStats | None = None,
) -> dict[str, Any]:
    """Read an HF checkpoint straight into sharded ``jax.Array`` s: this host reads only the blocks
    its addressable devices hold, never the whole model.

    Every parameter is built with ``jax.make_array_from_callback``; the callback maps the device's
    block of the Flax parameter through the table to the HF tensors and slices it covers (the
    layers and experts in the block; within each HF tensor the rows / columns of the block) and
    reads those alone (`SafetensorsReader`). Names and shapes are checked against the table from
    the safetensors headers before any tensor data is read.

    Args:
      path: a local directory or fsspec URL (``gs://...``) with the safetensors (per-expert or
        fused experts, one file or an index + shards). Its config.json is not read: ``config``
        (e.g. from `load_hf_config`) says what the tensors must be.
      config: the model config; arrays are cast to ``config.param_dtype``.
      shardings: flat Flax name (as in `flax_param_shapes` / ``models.qwen3.flat_params``) ->
        ``jax.sharding.Sharding``, one per parameter.
      storage_options: fsspec options for a remote path.
      max_gap_bytes: see `SafetensorsReader` (remote reads only).
      stats: a `ReadStats` to which every read is added (to see what this host read).

    Returns:
      flat Flax name -> ``jax.Array`` with the requested sharding and ``config.param_dtype``.

    Raises:
      ValueError / TypeError: ``shardings`` does not name exactly the parameters of ``config``, or
        holds something that is not a Sharding.
      CheckpointError, CheckpointMismatchError: as `load_hf_checkpoint`.
    """
    import jax

    want = flax_param_shapes(config)
    missing, unexpected = sorted(set(want) - set(shardings)), sorted(set(shardings) - set(want))
    if missing or unexpected:
        raise ValueError(f"shardings must name every parameter of the config: missing {_fmt_keys(missing)}; "
                         f"unexpected {_fmt_keys(unexpected)}")
    for name in want:
        if not isinstance(shardings[name], jax.sharding.Sharding):
            raise TypeError(f"shardings[{name!r}] is a {type(shardings[name]).__name__}, not a jax.sharding.Sharding")
    dims, dtype = _dims(config), _np_dtype(config.param_dtype)
    with SafetensorsReader(path, storage_options=storage_options, max_gap_bytes=max_gap_bytes,
                           stats=stats) as reader:
        plan = _plan_sources(config, reader.shapes)
        return {name: _sharded_param(plan[name], shape, shardings[name], dims, reader.read_many, dtype)
                for name, shape in want.items()}


def _flat_shardings(spec: Any) -> dict[str, Any]:
    """A flat {name: Sharding} from an ``nnx.State`` of shardings (as ``ace_jax.runtime.placement.
    param_shardings`` returns) or a flat mapping."""
    from flax import nnx

    if isinstance(spec, nnx.State):
        return {"/".join(str(p) for p in path): (v.get_value() if isinstance(v, nnx.Variable) else v)
                for path, v in nnx.to_flat_state(spec)}
    if isinstance(spec, Mapping):
        return dict(spec)
    raise TypeError(f"shardings must be an nnx.State or a flat {{name: Sharding}} mapping, got {type(spec).__name__}")


def load_hf_model(
    path: str | os.PathLike,
    *,
    rngs=None,
    shardings: Any = None,
    storage_options: Mapping[str, Any] | None = None,
    stats: ReadStats | None = None,
    **runtime: Any,
):
    """Build a `models.qwen3.Qwen3ForCausalLM` from an HF checkpoint directory and fill its weights.

    The module is created abstractly (``nnx.eval_shape``: no random initialisation, no memory for
    a throwaway copy), then every parameter is read by `load_hf_params_sharded` straight into its
    sharding, cast to ``config.param_dtype``: a host reads only the blocks its devices hold.

    Args:
      path: as in `load_hf_checkpoint` (local directory or fsspec URL).
      rngs: ``nnx.Rngs`` passed to the module constructor (default ``nnx.Rngs(0)``); it does not
        affect the loaded weights.
      shardings: where the parameters go. None: every parameter whole on this host's first local
        device. Otherwise a callable ``shardings(abstract_module)`` returning an ``nnx.State`` of
        shardings (e.g. ``lambda m: ace_jax.runtime.placement.param_shardings(m, mesh, rules)``) or a flat
        {name: Sharding}; or such a State / mapping itself.
      storage_options: fsspec options for a remote path (e.g. gcsfs ``endpoint_url``, ``token``).
      stats: a `ReadStats` to which every read is added.
      **runtime: `ModelConfig` overrides on top of config.json, e.g. ``dtype="bfloat16"`` (compute),
        ``param_dtype="bfloat16"`` (storage), ``moe_dispatch="dense"``, ``remat_policy="full"``.

    Returns:
      The filled module (``model.config`` is the loaded `ModelConfig`).

    Raises:
      As `load_hf_checkpoint` and `load_hf_params_sharded`.
    """
    import jax
    from flax import nnx

    from models.qwen3 import Qwen3ForCausalLM, set_flat_params

    config = load_hf_config(path, config_overrides=runtime, storage_options=storage_options)
    if rngs is None:
        model = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)))
    else:
        model = nnx.eval_shape(lambda r: Qwen3ForCausalLM(config, rngs=r), rngs)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        flat_shardings = {name: one for name in flax_param_shapes(config)}
    else:
        flat_shardings = _flat_shardings(shardings(model) if callable(shardings) else shardings)
    set_flat_params(model, load_hf_params_sharded(path, config, flat_shardings,
                                                  storage_options=storage_options, stats=stats))
    return model


_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt",
)


def _hf_config_for_export(config: ModelConfig, dtype: Any) -> dict[str, Any]:
    d = config.to_hf_dict()
    # Hub v4.51 style: top-level rope_theta / rope_scaling, explicit torch_dtype, no rope_parameters.
    d.pop("rope_parameters", None)
    d.setdefault("rope_theta", config.rope_theta)
    d.setdefault("rope_scaling", None)
    if dtype is not None:
        d["torch_dtype"] = _np_dtype(dtype).name
    return d


def export_hf(
    model_or_flat: Any,
    config: ModelConfig,
    out_dir: str | os.PathLike,
    *,
    dtype: Any = None,
    max_shard_bytes: int = 5 * 1024**3,
    tokenizer_dir: str | os.PathLike | None = None,
    generation_config: Mapping[str, Any] | None = None,
) -> pathlib.Path | str:
    """Write an HF checkpoint directory (loadable by transformers ``from_pretrained`` and vLLM).

    Writes per-expert keys in sharded safetensors ``model-0000k-of-0000n.safetensors`` (each at most
    ``max_shard_bytes`` unless one tensor alone is larger) plus ``model.safetensors.index.json``,
    a v4-style ``config.json``, ``generation_config.json`` and, if given, the tokenizer files.

    Args:
      model_or_flat: a `Qwen3ForCausalLM` or its flat dict (name -> array). jax arrays must be
        fully addressable on this host (gather them first on a multi-host mesh).
      config: the model's `ModelConfig`.
      out_dir: local directory or fsspec URL (written locally, then uploaded with ``fs.put``).
      dtype: stored dtype ("bfloat16", "float32"); None (default): the model's ``config.param_dtype``,
        so an fp32 model exports fp32 unless bf16 is asked for.
      max_shard_bytes: shard size bound in bytes.
      tokenizer_dir: a tokenizer directory whose files are copied alongside.
      generation_config: extra generation_config.json fields (sampling defaults); token ids come
        from ``config``.

    Returns:
      out_dir (as a Path when local).

    Raises:
      CheckpointMismatchError: the parameters do not match ``config``.
    """
    from safetensors.numpy import save_file

    if _is_remote(out_dir):
        import fsspec

        with tempfile.TemporaryDirectory(prefix="ace_hf_export_") as tmp:
            export_hf(model_or_flat, config, tmp, dtype=dtype, max_shard_bytes=max_shard_bytes,
                      tokenizer_dir=tokenizer_dir, generation_config=generation_config)
            fs, root = fsspec.core.url_to_fs(os.fspath(out_dir))
            fs.makedirs(root, exist_ok=True)
            for p in sorted(pathlib.Path(tmp).iterdir()):
                fs.put(str(p), f"{root.rstrip('/')}/{p.name}")
        return os.fspath(out_dir)

    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    if isinstance(model_or_flat, Mapping):
        flat = model_or_flat
    else:
        from models.qwen3 import flat_params

        flat = flat_params(model_or_flat)
    _check_flat(flat, config)  # before anything is written
    stored = _export_dtype(dtype, config)
    out = _local_path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # Plan the shards from shapes alone, then materialise one shard at a time.
    shards: list[list[str]] = [[]]
    size = 0
    total = 0
    for key, shape, _ in _hf_plan(config):
        nbytes = math.prod(shape) * stored.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
        total += nbytes
    n = len(shards)
    key_to_shard = {k: s for s, keys in enumerate(shards) for k in keys}
    names = [f"model-{s + 1:05d}-of-{n:05d}.safetensors" for s in range(n)]

    for old in out.glob("model*.safetensors*"):  # never leave stale shards of an earlier export
        old.unlink()
    pending: dict[str, np.ndarray] = {}
    current = 0
    n_params = 0
    for key, x in _flax_to_hf_unchecked(flat, config, stored):
        s = key_to_shard[key]
        if s != current:
            save_file(pending, str(out / names[current]), metadata={"format": "pt"})
            pending, current = {}, s
        pending[key] = x
        n_params += x.size
    save_file(pending, str(out / names[current]), metadata={"format": "pt"})

    index = {
        "metadata": {"total_size": total, "total_parameters": n_params},
        "weight_map": {k: names[s] for k, s in key_to_shard.items()},
    }
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(json.dumps(_hf_config_for_export(config, stored), indent=2) + "\n")
    gen: dict[str, Any] = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    if isinstance(gen["eos_token_id"], tuple):
        gen["eos_token_id"] = list(gen["eos_token_id"])
    if config.pad_token_id is not None:
        gen["pad_token_id"] = config.pad_token_id
    gen.update(dict(generation_config or {}))
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if tokenizer_dir is not None:
        tdir = _local_path(tokenizer_dir)
        copied = [f for f in _TOKENIZER_FILES if (tdir / f).is_file()]
        if "tokenizer.json" not in copied:
            raise CheckpointError(f"tokenizer_dir {str(tdir)!r} has no tokenizer.json")
        for f in copied:
            shutil.copyfile(tdir / f, out / f)
    return out
