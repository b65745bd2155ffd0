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
fsspec URLs (``gs://``, ``memory://``, ...): remote checkpoints are copied to a local temporary
directory first (needs local disk for the whole checkpoint), and exports are written locally
then uploaded.
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

from models.configs import LayerGroup, ModelConfig, UnsupportedConfigError

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
    "read_safetensors_dir",
    "load_hf_checkpoint",
    "load_hf_model",
    "export_hf",
]


class CheckpointError(ValueError):
    """A checkpoint directory cannot be read (missing file, malformed index)."""


class CheckpointMismatchError(CheckpointError):
    """Tensors and config disagree: a missing / unexpected tensor or a wrong shape (named in the message)."""


# --------------------------------------------------------------------------------------------------
# Transforms between one HF tensor (PyTorch Linear layout [out, in]) and its Flax slice.
# Both directions accept extra leading (batch) axes, so experts or layers can be converted at once.


@dataclasses.dataclass(frozen=True)
class Transform:
    """A named, invertible layout change. ``to_flax(x, dims)`` / ``to_hf(y, dims)`` act on the
    trailing axes (any leading axes are carried along); ``flax_shape(hf_shape, dims)`` maps shapes."""

    name: str
    to_flax: Callable[[np.ndarray, Mapping[str, int]], np.ndarray]
    to_hf: Callable[[np.ndarray, Mapping[str, int]], np.ndarray]
    flax_shape: Callable[[tuple[int, ...], Mapping[str, int]], tuple[int, ...]]


def _swap(x: np.ndarray) -> np.ndarray:
    return np.swapaxes(x, -1, -2)


def _split_heads_out(n_key: str) -> Transform:
    # HF [n*d, H] -> Flax [H, n, d]   (q/k/v projections; head j owns rows j*d:(j+1)*d)
    def to_flax(x, dims):
        y = _swap(x)
        return y.reshape(*y.shape[:-1], dims[n_key], dims["d"])

    def to_hf(y, dims):
        x = y.reshape(*y.shape[:-2], dims[n_key] * dims["d"])
        return _swap(x)

    def shape(s, dims):
        return (*s[:-2], s[-1], dims[n_key], dims["d"])

    return Transform(f"split_heads_out[{n_key}]", to_flax, to_hf, shape)


def _merge_heads_in(n_key: str) -> Transform:
    # HF [H, n*d] -> Flax [n, d, H]   (o_proj)
    def to_flax(x, dims):
        y = _swap(x)
        return y.reshape(*y.shape[:-2], dims[n_key], dims["d"], y.shape[-1])

    def to_hf(y, dims):
        x = y.reshape(*y.shape[:-3], dims[n_key] * dims["d"], y.shape[-1])
        return _swap(x)

    def shape(s, dims):
        return (*s[:-2], dims[n_key], dims["d"], s[-2])

    return Transform(f"merge_heads_in[{n_key}]", to_flax, to_hf, shape)


TRANSFORMS: dict[str, Transform] = {
    "identity": Transform("identity", lambda x, d: x, lambda y, d: y, lambda s, d: tuple(s)),
    "transpose": Transform("transpose", lambda x, d: _swap(x), lambda y, d: _swap(y),
                           lambda s, d: (*s[:-2], s[-1], s[-2])),
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


def hf_to_flax(
    get: Callable[[str], np.ndarray],
    keys: Mapping[str, tuple[int, ...]],
    config: ModelConfig,
    *,
    dtype: Any = None,
) -> dict[str, np.ndarray]:
    """Build the flat Flax dict from HF tensors, validating names and shapes against the table.

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
    dims, rules = _dims(config), _active_rules(config)
    used: set[str] = set()
    missing: list[str] = []

    def fetch(key: str, want: tuple[int, ...]) -> np.ndarray | None:
        if key not in keys:
            missing.append(key)
            return None
        _check_shape(key, keys[key], want, "the checkpoint")
        used.add(key)
        return get(key)

    flat: dict[str, np.ndarray] = {}
    for rule in rules:
        if rule.scope != "global":
            continue
        x = fetch(rule.hf, _eval_shape(rule.hf_shape, dims))
        if x is not None:
            flat[rule.flax] = _cast(TRANSFORMS[rule.transform].to_flax(x, dims), dtype)

    for g, group in enumerate(config.layer_groups()):
        for rule in _group_rules(rules, group):
            tr = TRANSFORMS[rule.transform]
            one = _eval_shape(rule.hf_shape, dims)
            per_layer = []
            for li in range(group.count):
                i = group.start + li
                if rule.scope == "layer":
                    x = fetch(rule.hf.format(i=i), one)
                elif rule.fused is not None and rule.fused[0].format(i=i) in keys:
                    fkey, part, n_parts = rule.fused
                    fkey = fkey.format(i=i)
                    fshape = (dims["E"], one[0] * n_parts, one[1])
                    x = fetch(fkey, fshape)
                    if x is not None:
                        x = x[:, part * one[0]:(part + 1) * one[0], :]
                else:
                    experts = [fetch(rule.hf.format(i=i, j=j), one) for j in range(dims["E"])]
                    x = None if any(e is None for e in experts) else np.stack(experts)
                if x is not None:
                    per_layer.append(_cast(tr.to_flax(x, dims), dtype))
            if len(per_layer) == group.count:
                flat[_flax_name(rule, g)] = np.stack(per_layer)

    if config.tie_word_embeddings and "lm_head.weight" in keys:
        # Some tied checkpoints still carry a copy of the head; accept it only if it IS the embedding.
        _check_shape("lm_head.weight", keys["lm_head.weight"], (dims["V"], dims["H"]), "the checkpoint")
        used.add("lm_head.weight")
        if "embed_tokens/embedding" in flat and not np.array_equal(
            np.asarray(get("lm_head.weight"), dtype=np.float32),
            np.asarray(get("model.embed_tokens.weight"), dtype=np.float32),
        ):
            raise CheckpointMismatchError(
                "config.json says tie_word_embeddings=true but 'lm_head.weight' differs from "
                "'model.embed_tokens.weight'"
            )
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
    return flat


def flax_to_hf(
    flat: Mapping[str, Any],
    config: ModelConfig,
    *,
    dtype: Any = "bfloat16",
) -> Iterator[tuple[str, np.ndarray]]:
    """Yield (HF key, numpy tensor) in the per-expert Hub layout, lazily, in file order.

    Validates first that ``flat`` has exactly the table's names and shapes.

    Args:
      flat: flat Flax name -> array (numpy or fully addressable jax.Array).
      config: the model config.
      dtype: output dtype ("bfloat16" default, "float32", ...) or None to keep each array's dtype.
        Casting uses numpy/ml_dtypes round-to-nearest-even; a bf16 input is passed through
        bit-exactly.

    Raises:
      CheckpointMismatchError: a Flax parameter is missing, unexpected, or of the wrong shape.
    """
    _check_flat(flat, config)
    return _flax_to_hf_unchecked(flat, config, dtype)


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


# --------------------------------------------------------------------------------------------------
# Files


def _is_remote(path: str | os.PathLike) -> bool:
    s = os.fspath(path)
    return "://" in s and not s.startswith("file://")


def _local_path(path: str | os.PathLike) -> pathlib.Path:
    s = os.fspath(path)
    return pathlib.Path(s[len("file://"):] if s.startswith("file://") else s)


def read_safetensors_dir(path: str | os.PathLike) -> tuple[dict[str, tuple[int, ...]], Callable[[str], np.ndarray]]:
    """Index the safetensors of a local HF directory without loading them.

    Accepts ``model.safetensors.index.json`` + shards, or a single ``model.safetensors``.

    Returns:
      (key -> shape, get(key) -> numpy array). Arrays are read on demand (bf16 as ml_dtypes).

    Raises:
      CheckpointError: no weights file, a shard named in the index is absent, or the index and the
        shard contents disagree.
    """
    from safetensors import safe_open

    root = _local_path(path)
    index_file = root / "model.safetensors.index.json"
    single = root / "model.safetensors"
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index_file} is not a valid safetensors index: {exc}") from exc
        files = sorted(set(weight_map.values()))
    elif single.is_file():
        weight_map, files = None, ["model.safetensors"]
    else:
        raise CheckpointError(
            f"no weights in {str(root)!r}: expected model.safetensors or model.safetensors.index.json"
        )
    shapes: dict[str, tuple[int, ...]] = {}
    where: dict[str, pathlib.Path] = {}
    for fname in files:
        fpath = root / fname
        if not fpath.is_file():
            raise CheckpointError(f"shard {fname!r} named in the index is missing from {str(root)!r}")
        with safe_open(str(fpath), framework="numpy") as f:
            for key in f.keys():
                if key in where:
                    raise CheckpointError(f"tensor {key!r} appears in both {where[key].name} and {fname}")
                shapes[key] = tuple(f.get_slice(key).get_shape())
                where[key] = fpath
    if weight_map is not None:
        for key, fname in weight_map.items():
            if key not in where:
                raise CheckpointMismatchError(f"tensor {key!r} is in the index ({fname}) but in no shard")
            if where[key].name != fname:
                raise CheckpointError(f"tensor {key!r}: index says {fname}, found in {where[key].name}")
        extra = sorted(set(where) - set(weight_map))
        if extra:
            raise CheckpointError(f"shards hold tensors absent from the index: {_fmt_keys(extra)}")

    def get(key: str) -> np.ndarray:
        with safe_open(str(where[key]), framework="numpy") as f:
            return f.get_tensor(key)

    return shapes, get


def _copy_remote_dir(url: str, dest: pathlib.Path) -> None:
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    names = [p for p in fs.ls(root, detail=False)]
    if not names:
        raise CheckpointError(f"{url!r} is empty or does not exist")
    for p in names:
        base = p.rstrip("/").rsplit("/", 1)[-1]
        if fs.isdir(p):
            continue
        fs.get(p, str(dest / base))


def _read_config_json(root: pathlib.Path) -> dict[str, Any]:
    cfg_file = root / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"no config.json in {str(root)!r}")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {exc}") from exc


_RUNTIME_FIELDS = ("dtype", "param_dtype", "moe_dispatch", "remat_policy", "scan_layers")


def load_hf_checkpoint(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    config_overrides: Mapping[str, Any] | None = None,
) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """Read an HF Qwen3 / Qwen3-MoE checkpoint directory into (ModelConfig, flat numpy params).

    Args:
      path: a local directory (or fsspec URL, copied to a temp dir first) holding ``config.json``
        and ``model.safetensors`` or sharded safetensors with ``model.safetensors.index.json``.
        Experts may be per-expert keys (the Hub) or fused (transformers v5 ``save_original_format=False``).
      dtype: cast all arrays to this dtype ("float32", "bfloat16", ...); None keeps the stored dtype.
      config_overrides: `ModelConfig` fields to set on top of config.json (runtime fields such as
        ``dtype``, ``param_dtype``, ``moe_dispatch``; architecture fields must still match the weights).

    Returns:
      (config, flat) with flat names and layouts of the module docstring.

    Raises:
      CheckpointError: missing config / weight files.
      CheckpointMismatchError: missing, unexpected, or wrongly shaped tensors (config.json and the
        weights disagree).
      UnsupportedConfigError: config features the port does not implement (sliding window, unknown
        rope type, ...).
    """
    if _is_remote(path):
        with tempfile.TemporaryDirectory(prefix="ace_hf_load_") as tmp:
            _copy_remote_dir(os.fspath(path), pathlib.Path(tmp))
            return load_hf_checkpoint(tmp, dtype=dtype, config_overrides=config_overrides)
    root = _local_path(path)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory {str(root)!r} does not exist")
    hf_cfg = _read_config_json(root)
    overrides = dict(config_overrides or {})
    runtime = {k: overrides.pop(k) for k in list(overrides) if k in _RUNTIME_FIELDS}
    config = ModelConfig.from_hf_dict(hf_cfg, **runtime)
    if overrides:
        config = config.replace(**overrides)
    shapes, get = read_safetensors_dir(root)
    return config, hf_to_flax(get, shapes, config, dtype=dtype)


def load_hf_model(path: str | os.PathLike, *, rngs=None, **runtime: Any):
    """Build a `models.qwen3.Qwen3ForCausalLM` from an HF checkpoint directory and fill its weights.

    The module is created abstractly (``nnx.eval_shape``: no random initialisation, no memory for
    a throwaway copy), then every parameter is set from the checkpoint, cast to
    ``config.param_dtype``.

    Args:
      path: as in `load_hf_checkpoint`.
      rngs: ``nnx.Rngs`` passed to the module constructor (default ``nnx.Rngs(0)``); it does not
        affect the loaded weights.
      **runtime: `ModelConfig` overrides on top of config.json, e.g. ``dtype="bfloat16"`` (compute),
        ``param_dtype="bfloat16"`` (storage), ``moe_dispatch="dense"``, ``remat_policy="full"``.

    Returns:
      The filled module (``model.config`` is the loaded `ModelConfig`).

    Raises:
      As `load_hf_checkpoint`.
    """
    from flax import nnx

    from models.qwen3 import Qwen3ForCausalLM, set_flat_params

    config, flat = load_hf_checkpoint(path, dtype=None, config_overrides=runtime)
    flat = {k: _cast(v, config.param_dtype) for k, v in flat.items()}
    if rngs is None:
        model = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)))
    else:
        model = nnx.eval_shape(lambda r: Qwen3ForCausalLM(config, rngs=r), rngs)
    set_flat_params(model, flat)
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
    dtype: Any = "bfloat16",
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
      dtype: stored dtype ("bfloat16" default; None keeps each array's dtype).
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
    out = _local_path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # Plan the shards from shapes alone, then materialise one shard at a time.
    itemsize = {}
    for name, arr in flat.items():
        itemsize[name] = (_np_dtype(dtype) if dtype is not None else np.dtype(arr.dtype)).itemsize
    shards: list[list[str]] = [[]]
    size = 0
    total = 0
    for key, shape, (_, name, _) in _hf_plan(config):
        nbytes = math.prod(shape) * itemsize.get(name, 4)
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
    for key, x in _flax_to_hf_unchecked(flat, config, dtype):
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
    stored = dtype if dtype is not None else np.dtype(next(iter(flat.values())).dtype).name
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
