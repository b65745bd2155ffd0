"""Flax NNX Qwen3 (dense) and Qwen3-MoE, with HF transformers semantics.

Reads against transformers 5.24.0 ``models/qwen3_moe/modeling_qwen3_moe.py`` (and ``qwen3``): the
classes below carry the HF names (``Qwen3Attention``, ``Qwen3MLP``, ``Qwen3MoeSparseMoeBlock``,
``Qwen3DecoderLayer``, ``Qwen3ForCausalLM``) and the same order of operations; see
``/work/shared/reference/qwen3_moe_spec.md`` section 1 for the spec each step follows.

Parameter tree (``"/".join(path)`` of every ``nnx.Param`` in ``nnx.state(model, nnx.Param)``; the
group index ``g`` is an int key of an ``nnx.List``, rendered as a decimal number). ``Lg`` is the
number of layers of `LayerGroup` g (``config.layer_groups()``), H hidden, nq / nkv heads, d head_dim,
I intermediate, Im moe_intermediate, E experts, V vocab. Kernels are ``[in, out]`` (HF Linear
weights transposed), split per head for attention::

  embed_tokens/embedding                      [V, H]          (vocab, embed)
  layers/{g}/input_layernorm/scale            [Lg, H]         (layers, embed)
  layers/{g}/post_attention_layernorm/scale   [Lg, H]         (layers, embed)
  layers/{g}/self_attn/q_proj/kernel          [Lg, H, nq, d]  (layers, embed, heads, head_dim)
  layers/{g}/self_attn/k_proj/kernel          [Lg, H, nkv, d] (layers, embed, kv_heads, head_dim)
  layers/{g}/self_attn/v_proj/kernel          [Lg, H, nkv, d] (layers, embed, kv_heads, head_dim)
  layers/{g}/self_attn/o_proj/kernel          [Lg, nq, d, H]  (layers, heads, head_dim, embed)
  layers/{g}/self_attn/q_norm/scale           [Lg, d]         (layers, head_dim)
  layers/{g}/self_attn/k_norm/scale           [Lg, d]         (layers, head_dim)
  layers/{g}/mlp/gate_proj/kernel             [Lg, H, I]      (layers, embed, mlp)        dense groups
  layers/{g}/mlp/up_proj/kernel               [Lg, H, I]      (layers, embed, mlp)
  layers/{g}/mlp/down_proj/kernel             [Lg, I, H]      (layers, mlp, embed)
  layers/{g}/mlp/gate/kernel                  [Lg, H, E]      (layers, embed, router)     moe groups (router)
  layers/{g}/mlp/experts/gate_proj            [Lg, E, H, Im]  (layers, experts, embed, mlp)
  layers/{g}/mlp/experts/up_proj              [Lg, E, H, Im]  (layers, experts, embed, mlp)
  layers/{g}/mlp/experts/down_proj            [Lg, E, Im, H]  (layers, experts, mlp, embed)
  norm/scale                                  [H]             (embed,)
  lm_head/kernel                              [H, V]          (embed, vocab)   absent when tied

The logical axis names are kept on every Param as its ``out_sharding`` metadata (with
``eager_sharding=False``, so creating the model needs no mesh); ``nnx.get_partition_spec(state)``
reads them, and `logical_axes` returns them as a flat dict.

Numerics (``config.dtype`` = compute dtype c, ``config.param_dtype`` = storage dtype):
  * weights are cast to c where used; every matmul accumulates in fp32
    (``preferred_element_type=float32``) and rounds its output to c;
  * RMSNorm: normalise in fp32, round to the input dtype, then multiply by the weight cast to c;
  * RoPE: inv_freq in fp32 exactly as HF computes it (default or YaRN), angle = position * inv_freq
    in fp32, cos/sin (times the YaRN attention factor) rounded to c; rotate-half convention;
  * attention scores ``q.k`` rounded to c, times head_dim**-0.5 in c, softmax in fp32, probabilities
    rounded to c, then ``p.v``; a query row with no visible key gets uniform weights (finite, as HF)
    (the "dot" kernel; the blockwise and splash kernels of `models.attention` differ in where
    they round, see there);
  * router logits in c; softmax in fp32 over all experts; top-k; renormalise iff norm_topk_prob;
    routing weights rounded to c; the weighted sum of the k expert outputs is taken in fp32 and
    rounded to c (MaxText's order; HF accumulates in c expert by expert);
  * residual stream in c; logits = final-normed hidden state (c) times lm_head (cast to c) with
    fp32 accumulation, returned as float32 [B, T, V] WITHOUT rounding to c.

Layers: each `LayerGroup` is one `Qwen3DecoderLayer` stack run by one ``jax.lax.scan`` (compile
time does not grow with depth; ``scan_layers=False`` unrolls it), each layer wrapped in
``jax.checkpoint`` with the policy named by ``config.remat_policy``.

MoE dispatch (``config.moe_dispatch``): "dense" reference, "ragged" (dropless grouped matmuls:
``ragged_dot`` on accelerators, blocked matmuls on CPU) and "capacity" (batched matmuls over
per-expert buffers, drops overflow); see `Qwen3MoeExperts`.

KV cache: `init_cache` / ``Qwen3ForCausalLM.init_cache`` -> `KVCache` (one k and one v array per
layer group, each [Lg, B, S_max, nkv, d], plus ``kv_mask`` bool [B, S_max]; or, with
``layout="decode"``, one k [B, nkv, d, S_max] and one v [B, nkv, S_max, d] per layer). See
``Qwen3ForCausalLM.__call__`` for the masking rules. `init_paged_cache` -> `PagedKVCache`: a pool
of fixed-size pages per layer group shared by the rows through per-row page tables (the rollout
engine's cache, `ace_jax.runtime.engine`); each row fills its own slots from 0.

Attention kernels (``config.attention_impl``, one dispatch: `attend`): "dot" builds the [B, T, S]
mask and runs `dot_product_attention` (HF eager order, the parity reference); "blockwise" (CPU /
GPU, long rows) and "splash" (TPU) never form a [T, S] array: they take the mask as segment ids
and a causal offset (`AttentionMask`; kernels in `models.attention`). "auto": splash on TPU, else
dot up to 2048 keys and blockwise above. A decode step of a blockwise / splash model into a
"standard" cache reads only the filled cache blocks (`models.attention.decode_attention`). The
platform (``config.platform``, `models.configs.target_platform`) picks the kernels and the CPU
fast paths, so a CPU host compiling for TPU takes the TPU paths.

CPU fast paths (same results): "ragged" MoE runs blocked grouped matmuls (`moe_dispatch_blocked`)
or, for a decode step, all experts (`moe_dispatch_all_experts`); causal self-attention skips the
masked upper triangle in query blocks (`causal_attention`); a cache with a concrete ``cache_index``
is read only up to its filled slots; a decode step reads a "decode" layout cache without copies.

Precision note: on TPU, fp32 matmuls run at the backend's default precision unless
``jax_default_matmul_precision`` is raised; the fp32 test tolerances here assume CPU.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.attention import (
    blockwise_attention,
    decode_attention,
    decode_attention_shared_prefix,
    paged_attention,
    paged_attention_shared_prefix,
    paged_write,
    resolve_attention_impl,
    segment_mask,
    splash_attention,
)
from models import moe_sharding
from models.configs import REMAT_POLICIES, ModelConfig, target_platform, yarn_mscale

__all__ = [
    "AttentionMask",
    "KVCache",
    "ModelOutput",
    "PagedKVCache",
    "PagedPrefix",
    "Qwen3ForCausalLM",
    "Qwen3DecoderLayer",
    "init_cache",
    "with_shared_prefix",
    "init_paged_cache",
    "cache_shapes",
    "flat_params",
    "set_flat_params",
    "logical_axes",
    "param_counts",
    "rope_inv_freq",
    "load_balancing_loss",
    "moe_dispatch_dense",
    "moe_dispatch_ragged",
    "moe_dispatch_capacity",
    "moe_dispatch_blocked",
    "moe_dispatch_dropless",
    "moe_dispatch_all_experts",
    "moe_block_size",
    "attend",
    "causal_attention",
    "dot_product_attention_kv_major",
    "expert_capacity",
]

_F32 = jnp.float32
_MASK_VALUE = float(np.finfo(np.float32).min)  # added where a key is not visible (finite, like HF)


# ============================================================================ parameter helpers
def _new_param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: tuple[str, ...], dtype: Any, *, init: str,
               std: float = 0.02) -> nnx.Param:
    """A Param of ``shape`` with logical ``axes`` kept as ``out_sharding`` metadata.

    init: "normal" (N(0, std^2), drawn in fp32 then cast; HF ``initializer_range``) or "ones".
    """
    if len(shape) != len(axes):
        raise ValueError(f"shape {shape} and logical axes {axes} have different ranks")
    if init == "ones":
        value = jnp.ones(shape, dtype)
    elif init == "normal":
        value = (std * jax.random.normal(rngs.params(), shape, _F32)).astype(dtype)
    else:
        raise ValueError(f"unknown init {init!r}")
    return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def _stacked(num_layers: int | None, shape: tuple[int, ...], axes: tuple[str, ...]):
    """Prepends the layer axis when the module is a stack of ``num_layers`` layers."""
    if num_layers is None:
        return shape, axes
    return (num_layers, *shape), ("layers", *axes)


def _decode_kernel(mask: "AttentionMask") -> str:
    """The attention kernel of a decode step (`models.attention.decode_attention`,
    `paged_attention`) and of a paged prefill chunk: the Pallas one for a "splash" model (on TPU;
    interpret mode elsewhere, as splash itself) and for a paged cache on TPU, else XLA's loop."""
    if mask.impl == "paged":
        return "pallas" if mask.platform == "tpu" else "xla"
    if mask.impl != "splash":
        return "xla"
    return "pallas" if mask.platform == "tpu" else "pallas_interpret"


def _traced(x) -> bool:
    """True when ``x`` has no concrete value at trace time (a jit / scan / loop tracer)."""
    return isinstance(x, jax.core.Tracer)


def _einsum(equation: str, x: jax.Array, w: jax.Array, dtype: Any) -> jax.Array:
    """``einsum`` of x and w cast to ``dtype``, accumulated in fp32, output rounded to ``dtype``."""
    return jnp.einsum(equation, x.astype(dtype), w.astype(dtype), preferred_element_type=_F32).astype(dtype)


class Projection(nnx.Module):
    """A bias-free linear map stored as one ``kernel`` (``[in..., out...]``), applied by einsum.

    ``equation`` contracts the input with the (per-layer) kernel, e.g. ``"...h,hnd->...nd"``.
    Under a stack of layers the kernel has a leading ``layers`` axis; `Qwen3DecoderLayer` is always
    called on one layer's slice, so the equation never sees that axis.
    """

    def __init__(self, shape: tuple[int, ...], axes: tuple[str, ...], equation: str, *, num_layers: int | None,
                 config: ModelConfig, rngs: nnx.Rngs):
        shape, axes = _stacked(num_layers, shape, axes)
        self.kernel = _new_param(rngs, shape, axes, config.param_dtype, init="normal", std=config.initializer_range)
        self.equation = equation
        self.dtype = config.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        return _einsum(self.equation, x, self.kernel[...], self.dtype)


class RMSNorm(nnx.Module):
    """HF Qwen3RMSNorm: ``scale * cast_to_input_dtype(x32 * rsqrt(mean(x32**2, -1) + eps))``.

    The normalised value is rounded to the input dtype BEFORE the multiply by ``scale`` (cast to the
    compute dtype); the output is in the compute dtype. ``scale`` is [dim] (or [L, dim] stacked).
    """

    def __init__(self, dim: int, axis_name: str, *, num_layers: int | None, config: ModelConfig, rngs: nnx.Rngs):
        shape, axes = _stacked(num_layers, (dim,), (axis_name,))
        self.scale = _new_param(rngs, shape, axes, config.param_dtype, init="ones")
        self.eps = config.rms_norm_eps
        self.dtype = config.dtype

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(_F32)
        variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(variance + self.eps)).astype(x.dtype)
        return self.scale[...].astype(self.dtype) * normed.astype(self.dtype)


class Embedding(nnx.Module):
    """Token embedding table ``embedding`` [V, H]; lookup (no scaling) and the tied-head ``attend``."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.embedding = _new_param(rngs, (config.vocab_size, config.hidden_size), ("vocab", "embed"),
                                    config.param_dtype, init="normal", std=config.initializer_range)
        self.dtype = config.dtype

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        return jnp.take(self.embedding[...], input_ids, axis=0).astype(self.dtype)

    def attend(self, h: jax.Array) -> jax.Array:
        """fp32 logits [..., V] of hidden states h [..., H] against the table (tied lm_head)."""
        return jnp.einsum("...h,vh->...v", h.astype(self.dtype), self.embedding[...].astype(self.dtype),
                          preferred_element_type=_F32)


# ============================================================================ rotary embedding
def rope_inv_freq(config: ModelConfig) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [head_dim // 2], attention_scaling) exactly as HF computes them.

    Default RoPE: ``1 / theta ** (arange(0, d, 2) / d)`` in float32, scaling 1.0. YaRN
    (``rope_scaling.rope_type == "yarn"``): HF ``_compute_yarn_parameters`` (blend of interpolated and
    extrapolated frequencies with a linear ramp; scaling = attention_factor or 0.1 ln(factor) + 1).
    """
    d = config.head_dim
    base = np.float32(config.rope_theta)
    exponent = np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / np.float32(d)
    pos_freqs = np.power(base, exponent, dtype=np.float32)
    rs = config.rope_scaling
    if rs is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    factor = float(rs["factor"])
    attention_factor = rs.get("attention_factor")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1
    original_max = rs.get("original_max_position_embeddings", config.max_position_embeddings)

    def correction_dim(num_rotations):
        return (d * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(config.rope_theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(d // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_factor = (np.float32(1) - ramp).astype(np.float32)
    inv_freq_extrapolation = np.float32(1.0) / pos_freqs
    inv_freq_interpolation = np.float32(1.0) / (np.float32(factor) * pos_freqs)
    inv_freq = (inv_freq_interpolation * (np.float32(1) - extrapolation_factor)
                + inv_freq_extrapolation * extrapolation_factor)
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_cos_sin(positions: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, T, head_dim] in the compute dtype for int positions [B, T] (HF rotary_emb)."""
    inv_freq, scaling = rope_inv_freq(config)
    freqs = positions.astype(_F32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    cos, sin = jnp.cos(emb) * scaling, jnp.sin(emb) * scaling
    return cos.astype(config.dtype), sin.astype(config.dtype)


def rotate_half(x: jax.Array) -> jax.Array:
    half = x.shape[-1] // 2
    return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rotary_pos_emb(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, n, d] rotated by cos/sin [B, T, d] (split-half convention)."""
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]
    return x * cos + rotate_half(x) * sin


# ============================================================================ attention
def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scaling: float,
                          dtype: Any) -> jax.Array:
    """GQA attention (HF eager order). q [B,T,nq,d], k/v [B,S,nkv,d], mask bool [B,T,S] -> [B,T,nq,d].

    Query head j uses kv head ``j // (nq // nkv)`` (HF ``repeat_kv``).
    """
    b, t, nq, d = q.shape
    nkv = k.shape[2]
    q = q.reshape(b, t, nkv, nq // nkv, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=_F32).astype(dtype) * scaling
    scores = jnp.where(mask[:, None, None, :, :], scores.astype(_F32), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v.astype(dtype), preferred_element_type=_F32).astype(dtype)
    return out.reshape(b, t, nq, d)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, scaling: float,
                     dtype: Any, *, platform: str) -> jax.Array:
    """`dot_product_attention` for causal self-attention (T == S, query t sees no key past t).

    On CPU (``platform``, see `models.configs.target_platform`), long sequences are split into
    query blocks; block i (rows [i*bs, (i+1)*bs)) attends only to keys [0, (i+1)*bs), so the
    masked upper triangle is mostly never computed (8 blocks skip 7/16 of the scores) and each
    block's [.., bs, S] tensors stay cache-sized. The keys it
    skips are invisible to the block, so every row with a visible key gets the same result; a
    row with none (padding) stays finite but averages over fewer keys ("undefined", as in HF).
    """
    t = q.shape[1]
    if platform != "cpu" or t < 64 or k.shape[1] != t:
        return dot_product_attention(q, k, v, mask, scaling, dtype)
    block = max(32, -(-t // 8))
    outs = []
    for start in range(0, t, block):
        stop = min(start + block, t)
        outs.append(dot_product_attention(q[:, start:stop], k[:, :stop], v[:, :stop], mask[:, start:stop, :stop],
                                          scaling, dtype))
    return jnp.concatenate(outs, axis=1)


def dot_product_attention_kv_major(q: jax.Array, kt: jax.Array, vt: jax.Array, mask: jax.Array,
                                   scaling: float, dtype: Any) -> jax.Array:
    """`dot_product_attention` with the keys / values of a "decode" layout cache: q [B,T,nq,d],
    kt [B,nkv,d,S], vt [B,nkv,S,d], mask bool [B,T,S] -> [B,T,nq,d] (same math and roundings)."""
    b, t, nq, d = q.shape
    nkv = kt.shape[1]
    if t > 1:  # several queries per row (not a decode step): the standard layout's matmuls
        return dot_product_attention(q, jnp.transpose(kt, (0, 3, 1, 2)), jnp.transpose(vt, (0, 2, 1, 3)), mask,
                                     scaling, dtype)
    # One query per row (a decode step): broadcast products + fp32 sums, which XLA:CPU fuses into
    # two loops over the cache, ~3x faster than its batched [G, d] x [d, S] matmuls.
    q = q.reshape(b, nkv, nq // nkv, d, 1).astype(_F32)
    scores = jnp.sum(q * kt[:, :, None].astype(_F32), axis=3).astype(dtype) * scaling  # [B,nkv,G,S]
    scores = jnp.where(mask[:, :, None, :], scores.astype(_F32), _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(dtype)
    out = jnp.sum(probs[..., None].astype(_F32) * vt[:, :, None].astype(_F32), axis=3).astype(dtype)
    return out.reshape(b, 1, nq, d)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AttentionMask:
    """Which keys each query sees, for the kernel ``impl`` (built once per forward by
    `Qwen3ForCausalLM.__call__`; the convention of `models.attention`).

    q_segment_ids: int32 [B, T], 1 for a real query, 0 for padding.
    kv_segment_ids: int32 [B, S], 1 for a real key (S = T without a cache, the kv_len attended
      slots with one).
    offset: int scalar (Python int when known at trace time), the slot of query 0: query t sees
      key s iff s <= t + offset and the key is real.
    dense: bool [B, T, S] (that rule as an array, HF's mask) when ``impl`` is "dot"; else None.
    impl: "dot" | "blockwise" | "splash" | "paged" (a `PagedKVCache`: only the segment ids
      are read, the rest is the cache's) (static); platform: "cpu" | "gpu" | "tpu" (static).
    """

    q_segment_ids: jax.Array
    kv_segment_ids: jax.Array
    offset: jax.Array | int
    dense: jax.Array | None
    impl: str = dataclasses.field(metadata=dict(static=True))
    platform: str = dataclasses.field(metadata=dict(static=True))

    def as_dense(self) -> jax.Array:
        """bool [B, T, S]: ``dense``, or the same rule built from the segment ids."""
        if self.dense is not None:
            return self.dense
        return segment_mask(self.q_segment_ids, self.kv_segment_ids, self.offset)


def _attention_mask_for(impl: str, platform: str, attention_mask: jax.Array, kv_keys: jax.Array,
                       offset: jax.Array | int) -> AttentionMask:
    """The `AttentionMask` of T queries (``attention_mask`` bool [B, T]) over S keys (``kv_keys``
    bool [B, S], True = real) whose first query sits at slot ``offset``. The dense [B, T, S] mask is
    built only for ``impl == "dot"``."""
    dense = None
    if impl == "dot":
        t, s = attention_mask.shape[1], kv_keys.shape[1]
        visible = jnp.arange(s)[None, :] <= offset + jnp.arange(t)[:, None]  # [T, S]
        dense = visible[None] & kv_keys[:, None, :]
    return AttentionMask(q_segment_ids=attention_mask.astype(jnp.int32), kv_segment_ids=kv_keys.astype(jnp.int32),
                         offset=offset, dense=dense, impl=impl, platform=platform)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: AttentionMask, scaling: float, dtype: Any) -> jax.Array:
    """Attention of q [B,T,nq,d] over k / v [B,S,nkv,d] -> [B,T,nq,d], by the kernel ``mask.impl``.

    "dot": `causal_attention` (self-attention, T == S) or `dot_product_attention` on ``mask.dense``;
    "splash": `models.attention.splash_attention` (interpret mode off TPU) when the offset is known
    at trace time, else (a traced cache index) blockwise; "blockwise":
    `models.attention.blockwise_attention`.
    """
    if mask.impl == "dot":
        if k.shape[1] == q.shape[1]:
            return causal_attention(q, k, v, mask.dense, scaling, dtype, platform=mask.platform)
        return dot_product_attention(q, k, v, mask.dense, scaling, dtype)
    if mask.impl == "splash" and not _traced(mask.offset):
        return splash_attention(q, k, v, mask.q_segment_ids, mask.kv_segment_ids, int(mask.offset), scaling=scaling,
                                dtype=dtype, interpret=mask.platform != "tpu")
    return blockwise_attention(q, k, v, mask.q_segment_ids, mask.kv_segment_ids, mask.offset, scaling=scaling,
                               dtype=dtype)


class Qwen3Attention(nnx.Module):
    """Self-attention with per-head q_norm / k_norm (before RoPE), GQA, optional KV cache."""

    def __init__(self, config: ModelConfig, *, num_layers: int | None, rngs: nnx.Rngs):
        h, nq, nkv, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
        kw = dict(num_layers=num_layers, config=config, rngs=rngs)
        self.q_proj = Projection((h, nq, d), ("embed", "heads", "head_dim"), "...h,hnd->...nd", **kw)
        self.k_proj = Projection((h, nkv, d), ("embed", "kv_heads", "head_dim"), "...h,hnd->...nd", **kw)
        self.v_proj = Projection((h, nkv, d), ("embed", "kv_heads", "head_dim"), "...h,hnd->...nd", **kw)
        self.o_proj = Projection((nq, d, h), ("heads", "head_dim", "embed"), "...nd,ndh->...h", **kw)
        self.q_norm = RMSNorm(d, "head_dim", **kw)  # per head, over head_dim only
        self.k_norm = RMSNorm(d, "head_dim", **kw)
        self.scaling = d ** -0.5
        self.dtype = config.dtype

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, mask: AttentionMask,
                 kv_cache: tuple[jax.Array, jax.Array] | None = None, cache_index: jax.Array | None = None,
                 layer_index: jax.Array | int | None = None, kv_len: int | None = None,
                 kv_layout: str = "standard"):
        """x [B,T,H] -> ([B,T,H], updated (k, v) cache or None).

        mask: the `AttentionMask` of the T queries over the attended keys (the T new ones without a
          cache or for a prefill into an empty cache, else the kv_len leading cache slots); its
          ``impl`` picks the kernel (`attend`). A decode step (T == 1) of a blockwise / splash model
          into a "standard" cache reads the filled slots block by block (`decode_attention`).

        kv_cache: None, or this layer's (k, v):
          kv_layout "standard": one layer [B,S,nkv,d] (``layer_index`` None), or a whole layer stack
            [Lg,B,S,nkv,d] with this layer at ``layer_index``: the new keys / values are written in
            place at (layer_index, :, cache_index) and the stack is returned (a scan then carries
            the cache instead of slicing it out and stacking it back every step);
          kv_layout "decode": one layer, k [B,nkv,d,S] and v [B,nkv,S,d] (see `KVCache`);
          kv_layout "paged": a layer stack's page pools [Lg,P,nkv,page_size,d] (this layer at
            ``layer_index``); ``cache_index`` is then (page_table [B, pages], start [B], prefix:
            a `PagedPrefix` or None, read_pages: `PagedKVCache.read_pages`) and the T tokens of row b go to its slots
            start[b]..start[b]+T-1 (`PagedKVCache`).
        kv_len: static number of leading cache slots the queries may see (``mask`` covers kv_len
          keys); None = all S. ``kv_len == T`` with ``cache_index == 0`` attends to the new keys
          directly.
        """
        q = self.q_norm(self.q_proj(x))  # [B, T, nq, d]
        k = self.k_norm(self.k_proj(x))  # [B, T, nkv, d]
        v = self.v_proj(x)
        q = apply_rotary_pos_emb(q, cos, sin)
        k = apply_rotary_pos_emb(k, cos, sin)
        if kv_cache is None:  # causal self-attention over the T tokens
            return self.o_proj(attend(q, k, v, mask, self.scaling, self.dtype)), None
        k_cache, v_cache = kv_cache[:2]
        if kv_layout == "paged":  # cache_index: (page_table, start, prefix, read_pages)
            page_table, start, prefix, read_pages = cache_index
            k_cache, v_cache = paged_write(k_cache, v_cache, k, v, layer_index, page_table, start,
                                           mask.q_segment_ids)
            kw = dict(scaling=self.scaling, dtype=self.dtype, kernel=_decode_kernel(mask),
                      read_pages=read_pages)
            if prefix is not None and q.shape[1] == 1:   # a decode step: shared prompt pages once
                out = paged_attention_shared_prefix(q, k_cache, v_cache, layer_index, page_table,
                                                    start, prefix.table, prefix.lengths,
                                                    prefix.rows, **kw)
            else:
                out = paged_attention(q, k_cache, v_cache, layer_index, page_table, start, **kw)
            return self.o_proj(out), (k_cache, v_cache)
        k, v = k.astype(k_cache.dtype), v.astype(v_cache.dtype)
        # kv_len == T: a prefill into an empty cache (the index is 0, whether traced or not): the
        # queries see exactly the T new keys
        fresh = kv_len == x.shape[1]
        if kv_layout == "decode":
            k_cache = jax.lax.dynamic_update_slice(k_cache, jnp.transpose(k, (0, 2, 3, 1)), (0, 0, 0, cache_index))
            v_cache = jax.lax.dynamic_update_slice(v_cache, jnp.transpose(v, (0, 2, 1, 3)), (0, 0, cache_index, 0))
            if fresh:
                out = attend(q, k, v, mask, self.scaling, self.dtype)
            else:  # the CPU sampler's tuned path ([B, T, kv_len] mask: T is one token or a chunk)
                kt, vt = k_cache, v_cache
                if kv_len is not None and kv_len < kt.shape[-1]:
                    kt, vt = kt[..., :kv_len], vt[:, :, :kv_len]
                out = dot_product_attention_kv_major(q, kt, vt, mask.as_dense(), self.scaling, self.dtype)
            return self.o_proj(out), (k_cache, v_cache)
        prefix = kv_cache[2] if len(kv_cache) > 2 else None  # (k, v, kv_mask) of a shared prefix
        if layer_index is None:
            k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, cache_index, 0, 0))
            v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, cache_index, 0, 0))
            read = lambda c: c  # noqa: E731
        else:
            start = (layer_index, 0, cache_index, 0, 0)
            k_cache = jax.lax.dynamic_update_slice(k_cache, k[None], start)
            v_cache = jax.lax.dynamic_update_slice(v_cache, v[None], start)
            read = lambda c: jax.lax.dynamic_index_in_dim(c, layer_index, 0, keepdims=False)  # noqa: E731
        decode = x.shape[1] == 1 and mask.impl != "dot"  # a decode step: read the filled blocks only
        if decode:  # a concrete index (the mask's static offset) unrolls the block loop (the dry run's cost model)
            filled = cache_index + 1 if _traced(mask.offset) else int(mask.offset) + 1
            kv_mask = jnp.pad(mask.kv_segment_ids,  # [B, kv_len] -> the cache's S slots
                              ((0, 0), (0, k_cache.shape[-3] - mask.kv_segment_ids.shape[1])))
        if prefix is not None:  # rows sharing prompts: cascade attention
            if not decode:
                raise ValueError("a cache with a shared prefix takes decode steps (T = 1) of the "
                                 f"blockwise / splash kernels; got T={x.shape[1]}, impl={mask.impl!r}")
            out = decode_attention_shared_prefix(q, k_cache, v_cache, kv_mask, filled, *prefix,
                                                 scaling=self.scaling, dtype=self.dtype, layer=layer_index,
                                                 kernel=_decode_kernel(mask))
            return self.o_proj(out), (k_cache, v_cache, prefix)
        if fresh:
            out = attend(q, k, v, mask, self.scaling, self.dtype)
        elif decode:
            out = decode_attention(q, k_cache, v_cache, kv_mask, filled, scaling=self.scaling,
                                   dtype=self.dtype, layer=layer_index,
                                   kernel=_decode_kernel(mask))
        else:
            k, v = read(k_cache), read(v_cache)
            if kv_len is not None and kv_len < k.shape[1]:
                k, v = k[:, :kv_len], v[:, :kv_len]
            out = attend(q, k, v, mask, self.scaling, self.dtype)
        return self.o_proj(out), (k_cache, v_cache)


# ============================================================================ MLP and MoE
class Qwen3MLP(nnx.Module):
    """Dense SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, width ``intermediate_size``."""

    def __init__(self, config: ModelConfig, *, num_layers: int | None, rngs: nnx.Rngs):
        h, i = config.hidden_size, config.intermediate_size
        kw = dict(num_layers=num_layers, config=config, rngs=rngs)
        self.gate_proj = Projection((h, i), ("embed", "mlp"), "...h,hi->...i", **kw)
        self.up_proj = Projection((h, i), ("embed", "mlp"), "...h,hi->...i", **kw)
        self.down_proj = Projection((i, h), ("mlp", "embed"), "...i,ih->...h", **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


def moe_dispatch_dense(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype) -> jax.Array:
    """Reference dispatch: every expert on every token, one-hot combine.

    x [N, H]; top_k_index int [N, k]; top_k_weights [N, k]; w_gate / w_up [E, H, Im]; w_down [E, Im, H].
    Returns float32 [N, H] = sum_k w_k * expert_{idx_k}(x) (activations [N, E, Im]: tests only).
    """
    gate = _einsum("nh,ehi->nei", x, w_gate, dtype)
    up = _einsum("nh,ehi->nei", x, w_up, dtype)
    y = _einsum("nei,eih->neh", jax.nn.silu(gate) * up, w_down, dtype)  # [N, E, H]
    n, num_experts = x.shape[0], w_gate.shape[0]
    combine = jnp.zeros((n, num_experts), _F32)
    combine = combine.at[jnp.arange(n)[:, None], top_k_index].add(top_k_weights.astype(_F32))
    return jnp.einsum("neh,ne->nh", y.astype(_F32), combine)


def moe_dispatch_ragged(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype) -> jax.Array:
    """Dropless grouped-matmul dispatch (shapes as `moe_dispatch_dense`; float32 [N, H] out).

    The N*k token copies are sorted by expert id (stable), run through three ``jax.lax.ragged_dot``
    grouped matmuls (group sizes = tokens per expert), unsorted, and summed with their weights.
    """
    n, k = top_k_index.shape
    num_experts = w_gate.shape[0]
    flat_expert = top_k_index.reshape(-1)  # [N*k]; copy c belongs to token c // k
    order = jnp.argsort(flat_expert, stable=True)
    x_sorted = jnp.take(x, order // k, axis=0).astype(dtype)  # [N*k, H], grouped by expert id
    group_sizes = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)

    def grouped(lhs, rhs):
        return jax.lax.ragged_dot(lhs, rhs.astype(dtype), group_sizes, preferred_element_type=_F32).astype(dtype)

    h = jax.nn.silu(grouped(x_sorted, w_gate)) * grouped(x_sorted, w_up)
    y_sorted = grouped(h, w_down)  # [N*k, H]
    y = jnp.take(y_sorted, jnp.argsort(order), axis=0).reshape(n, k, -1)  # back to (token, slot)
    return jnp.einsum("nkh,nk->nh", y.astype(_F32), top_k_weights.astype(_F32))


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Slots per expert: ceil(capacity_factor * N * k / E), clipped to [1, N] (N: no drop possible)."""
    return int(min(num_tokens, max(1, math.ceil(capacity_factor * num_tokens * top_k / num_experts))))


def moe_dispatch_capacity(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype, capacity: int) -> jax.Array:
    """Capacity-bounded dispatch with batched (per-expert) matmuls (shapes as `moe_dispatch_dense`).

    Each expert gets a buffer of ``capacity`` slots [E, C, H]. Assignments are admitted in token
    order (token n's k choices before token n+1's); an assignment whose rank within its expert is
    >= C is DROPPED (contributes 0; the other weights are not renormalised). With C = N (capacity
    factor >= E / k) nothing can be dropped and the result equals the dropless dispatches.
    """
    n, k = top_k_index.shape
    num_experts, h_dim = w_gate.shape[0], x.shape[-1]
    flat_expert = top_k_index.reshape(-1)  # [N*k], assignment a = n * k + j
    one_hot = jax.nn.one_hot(flat_expert, num_experts, dtype=jnp.int32)  # [N*k, E]
    rank = jnp.sum((jnp.cumsum(one_hot, axis=0) - 1) * one_hot, axis=-1)  # rank within its expert
    keep = rank < capacity
    dump = num_experts * capacity  # one extra row that receives every dropped assignment
    slot = jnp.where(keep, flat_expert * capacity + rank, dump)  # [N*k]
    token = jnp.arange(n * k) // k
    buffer = jnp.zeros((dump + 1, h_dim), dtype).at[slot].set(x[token].astype(dtype))
    buffer = buffer[:dump].reshape(num_experts, capacity, h_dim)
    h = jax.nn.silu(_einsum("ech,ehi->eci", buffer, w_gate, dtype)) * _einsum("ech,ehi->eci", buffer, w_up, dtype)
    y = _einsum("eci,eih->ech", h, w_down, dtype).reshape(dump, h_dim)
    y = jnp.concatenate([y, jnp.zeros((1, h_dim), dtype)], axis=0)
    y = jnp.take(y, slot, axis=0).reshape(n, k, h_dim)  # dropped copies read the zero row
    weights = jnp.where(keep.reshape(n, k), top_k_weights.astype(_F32), 0.0)
    return jnp.einsum("nkh,nk->nh", y.astype(_F32), weights)


def moe_block_size(num_assignments: int, num_experts: int) -> int:
    """Rows per block of `moe_dispatch_blocked`: a power of two in [8, 128], about a quarter of the
    mean number of assignments per expert (less padding for small batches)."""
    target = max(1, num_assignments // (4 * num_experts))
    return int(min(128, max(8, 1 << (target.bit_length() - 1))))


def _block_swiglu_fwd_scan(buffer, block_expert, w_gate, w_up, w_down, dtype):
    """Per block b: y_b = swiglu_{e_b}(x_b) [nb, bs, H], one scan over the blocks (each reads its
    expert's weights in place)."""
    def block(_, xs):
        xb, e = xs
        wg, wu, wd = (jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False) for w in (w_gate, w_up, w_down))
        g, u = _einsum("ch,hi->ci", xb, wg, dtype), _einsum("ch,hi->ci", xb, wu, dtype)
        return None, _einsum("ci,ih->ch", jax.nn.silu(g) * u, wd, dtype)

    return jax.lax.scan(block, None, (buffer, block_expert))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _block_swiglu(buffer, block_expert, w_gate, w_up, w_down, dtype):
    """y [nb, bs, H]: block b of ``buffer`` [nb, bs, H] through expert ``block_expert[b]``'s SwiGLU.

    A custom VJP: the backward pass is one more scan over the blocks that recomputes the block's
    gate / up activations and accumulates its expert's weight gradients in place (autodiff of the
    forward scan stacks per-block residuals and adds a full [E, ...] cotangent per block)."""
    return _block_swiglu_fwd_scan(buffer, block_expert, w_gate, w_up, w_down, dtype)


def _block_swiglu_fwd(buffer, block_expert, w_gate, w_up, w_down, dtype):
    y = _block_swiglu_fwd_scan(buffer, block_expert, w_gate, w_up, w_down, dtype)
    return y, (buffer, block_expert, w_gate, w_up, w_down)


def _block_swiglu_bwd(dtype, res, dy):
    buffer, block_expert, w_gate, w_up, w_down = res

    def block(acc, xs):
        dwg, dwu, dwd = acc
        xb, e, dyb = xs
        wg, wu, wd = (jax.lax.dynamic_index_in_dim(w, e, 0, keepdims=False) for w in (w_gate, w_up, w_down))
        g, u = _einsum("ch,hi->ci", xb, wg, dtype), _einsum("ch,hi->ci", xb, wu, dtype)
        g32, u32 = g.astype(_F32), u.astype(_F32)
        sig = jax.nn.sigmoid(g32)
        silu = g32 * sig
        a = (jax.nn.silu(g) * u).astype(dtype)
        dyb = dyb.astype(dtype)
        da = jnp.einsum("ch,ih->ci", dyb, wd.astype(dtype), preferred_element_type=_F32)
        dg = (da * u32 * sig * (1.0 + g32 * (1.0 - sig))).astype(dtype)
        du = (da * silu).astype(dtype)
        # materialised transposes (the barrier keeps XLA from folding them back into the dots, whose
        # transposed-operand form XLA:CPU runs on a slow path)
        xt, at = jax.lax.optimization_barrier((xb.astype(dtype).T, a.T))
        add = lambda acc, val: jax.lax.dynamic_update_index_in_dim(  # noqa: E731
            acc, jax.lax.dynamic_index_in_dim(acc, e, 0, keepdims=False) + val, e, 0)
        dwd = add(dwd, jnp.einsum("ic,ch->ih", at, dyb, preferred_element_type=_F32))
        dwg = add(dwg, jnp.einsum("hc,ci->hi", xt, dg, preferred_element_type=_F32))
        dwu = add(dwu, jnp.einsum("hc,ci->hi", xt, du, preferred_element_type=_F32))
        dx = (jnp.einsum("ci,hi->ch", dg, wg.astype(dtype), preferred_element_type=_F32)
              + jnp.einsum("ci,hi->ch", du, wu.astype(dtype), preferred_element_type=_F32))
        return (dwg, dwu, dwd), dx.astype(buffer.dtype)

    zeros = tuple(jnp.zeros(w.shape, _F32) for w in (w_gate, w_up, w_down))
    (dwg, dwu, dwd), dx = jax.lax.scan(block, zeros, (buffer, block_expert, dy))
    return (dx, None, dwg.astype(w_gate.dtype), dwu.astype(w_up.dtype), dwd.astype(w_down.dtype))


_block_swiglu.defvjp(_block_swiglu_fwd, _block_swiglu_bwd)


@jax.custom_vjp
def _gather_rows(src, index, inverse):
    """``src[index]`` for an injective ``index`` [R] into src [S, ...] (entries -1: zero rows);
    ``inverse`` [S] is its inverse (-1 where no output row reads that row). The backward pass is
    then a gather too (``ct[inverse]``), not a scatter-add, which XLA:CPU runs serially."""
    return _masked_take(src, index)


def _masked_take(src, index):
    rows = jnp.take(src, jnp.maximum(index, 0), axis=0, mode="clip")
    return jnp.where((index >= 0).reshape((-1,) + (1,) * (src.ndim - 1)), rows, 0).astype(src.dtype)


def _gather_rows_fwd(src, index, inverse):
    return _masked_take(src, index), (index, inverse)


def _gather_rows_bwd(res, ct):
    index, inverse = res
    return _masked_take(ct, inverse), None, None


_gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def moe_dispatch_blocked(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype,
                         block_size: int | None = None) -> jax.Array:
    """Dropless blocked grouped-matmul dispatch (shapes as `moe_dispatch_dense`; float32 [N, H]).

    The N*k assignments are sorted by expert (stable) into a buffer of ``nb`` blocks of
    ``block_size`` rows in which every expert's run starts at a block boundary (each expert pads
    its last block with zero rows), so every block belongs to exactly one expert. Each block then
    runs through its expert's SwiGLU as a plain matmul, and the outputs are gathered back and
    summed with their weights in fp32. ``nb = (N*k + E*(block_size-1)) // block_size`` bounds the
    blocks any routing can need (static), so at most E*(block_size-1) padding rows are computed:
    about N*k rows in all, where "capacity" with C = N computes E*N and "dense" E*N.

    The same result as `moe_dispatch_ragged` (same products, same fp32 combine), without
    ``ragged_dot``, which XLA:CPU executes as a dense computation.
    """
    n, k = top_k_index.shape
    num_experts, h_dim = w_gate.shape[0], x.shape[-1]
    a = n * k
    bs = block_size or moe_block_size(a, num_experts)
    nb = (a + num_experts * (bs - 1)) // bs
    flat_expert = jnp.asarray(top_k_index).reshape(-1).astype(jnp.int32)  # assignment c: token c // k
    order = jnp.argsort(flat_expert, stable=True)
    counts = jnp.bincount(flat_expert, length=num_experts).astype(jnp.int32)
    start = jnp.cumsum(counts) - counts  # first sorted position of each expert
    padded = (counts + bs - 1) // bs * bs
    padded_end = jnp.cumsum(padded)
    padded_start = padded_end - padded  # first buffer row of each expert (a block boundary)
    expert_sorted = flat_expert[order]
    row_sorted = padded_start[expert_sorted] + jnp.arange(a, dtype=jnp.int32) - start[expert_sorted]
    row = jnp.zeros((a,), jnp.int32).at[order].set(row_sorted, unique_indices=True)  # assignment -> row
    inverse = jnp.full((nb * bs,), -1, jnp.int32).at[row].set(jnp.arange(a, dtype=jnp.int32), unique_indices=True)
    copies = jnp.broadcast_to(x.astype(dtype)[:, None, :], (n, k, h_dim)).reshape(a, h_dim)  # assignment order
    buffer = _gather_rows(copies, inverse, row).reshape(nb, bs, h_dim)  # padding rows are zero
    # expert of each block; the unused trailing blocks (zero rows) take the last expert
    block_expert = jnp.minimum(jnp.searchsorted(padded_end, jnp.arange(nb, dtype=jnp.int32) * bs, side="right"),
                               num_experts - 1).astype(jnp.int32)
    y = _block_swiglu(buffer, block_expert, w_gate, w_up, w_down, dtype)
    y = _gather_rows(y.reshape(nb * bs, h_dim), row, inverse).reshape(n, k, h_dim)
    return jnp.einsum("nkh,nk->nh", y.astype(_F32), top_k_weights.astype(_F32))


def moe_dispatch_all_experts(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype) -> jax.Array:
    """Every expert on every token, the routing weights applied BEFORE down_proj (shapes as
    `moe_dispatch_dense`; float32 [N, H]): ``sum_e c[n,e] down_e(h_e) = down([c * h])``, with
    c [N, E] the (top-k, zero elsewhere) routing weights, so the combine is part of the down_proj
    contraction over (expert, Im). For a handful of tokens (a decode step) this is the fastest
    dispatch on CPU: three batched matmuls over the E experts, no scatter / gather.
    """
    n, num_experts = x.shape[0], w_gate.shape[0]
    combine = jnp.zeros((n, num_experts), _F32).at[jnp.arange(n)[:, None], top_k_index].add(
        top_k_weights.astype(_F32))
    xb = jnp.broadcast_to(x.astype(dtype)[None], (num_experts, *x.shape))  # [E, N, H]
    h = jax.nn.silu(_einsum("enh,ehi->eni", xb, w_gate, dtype)) * _einsum("enh,ehi->eni", xb, w_up, dtype)
    h = (h.astype(_F32) * combine.T[:, :, None]).astype(dtype)
    return jnp.einsum("eni,eih->nh", h, w_down.astype(dtype), preferred_element_type=_F32)


def moe_dispatch_dropless(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype, *,
                          platform: str, parallelism: str = "gather",
                          partials: str = "float32") -> jax.Array:
    """The "ragged" (dropless) dispatch, implemented per ``platform`` (all exact; float32 [N, H]).

    ``platform``: "cpu" | "gpu" | "tpu" (see `models.configs.target_platform`). Accelerators:
    `moe_dispatch_ragged` (``ragged_dot`` grouped matmuls) under the tracing mesh as
    ``parallelism`` says (`models.moe_sharding`: "gather" the layer's weights to every device's
    tokens, or "expert": experts stay on their devices of the 'expert' axis, tokens travel).
    CPU: expert parallelism when asked for under an 'expert' mesh axis; otherwise few tokens
    (N*E <= 1024, e.g. one decode step of 16 rows): `moe_dispatch_all_experts` (every expert's
    weights are read once anyway), else `moe_dispatch_blocked`.
    """
    expert_parallel = parallelism != "gather" and moe_sharding.expert_axis_size(parallelism) > 1
    if platform != "cpu" or expert_parallel:
        return moe_sharding.sharded_dispatch(moe_dispatch_ragged, x, top_k_index, top_k_weights, w_gate,
                                             w_up, w_down, dtype, parallelism=parallelism, platform=platform,
                                             partials=partials)
    if x.shape[0] * w_gate.shape[0] <= 1024:
        return moe_dispatch_all_experts(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype)
    return moe_dispatch_blocked(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype)


class Qwen3MoeExperts(nnx.Module):
    """E SwiGLU experts stored as 3-D weights: gate_proj/up_proj [E, H, Im], down_proj [E, Im, H].

    ``config.moe_dispatch`` selects how the token -> expert assignment is executed:
      "dense":    `moe_dispatch_dense` (reference; [N, E, Im] activations).
      "ragged":   dropless sorted grouped matmuls (production default): `moe_dispatch_ragged`
                  (``ragged_dot``) on accelerators; on CPU, where ``ragged_dot`` runs densely,
                  `moe_dispatch_blocked`, or `moe_dispatch_all_experts` for a handful of tokens
                  (a decode step); see `moe_dispatch_dropless`. Under a mesh,
                  ``config.moe_parallelism`` says whether weights ("gather") or tokens
                  ("expert": expert parallelism) travel (`models.moe_sharding`).
      "capacity": `moe_dispatch_capacity` with C = `expert_capacity` (config.moe_capacity_factor);
                  drops assignments beyond capacity.
    All three combine the k expert outputs in fp32 and round the sum to the compute dtype
    (expert-parallel under a mesh: across devices in ``config.moe_partials``).
    """

    def __init__(self, config: ModelConfig, *, num_layers: int | None, rngs: nnx.Rngs):
        e, h, im = config.num_experts, config.hidden_size, config.moe_intermediate_size
        init = dict(init="normal", std=config.initializer_range)
        self.gate_proj = _new_param(rngs, *_stacked(num_layers, (e, h, im), ("experts", "embed", "mlp")),
                                    config.param_dtype, **init)
        self.up_proj = _new_param(rngs, *_stacked(num_layers, (e, h, im), ("experts", "embed", "mlp")),
                                  config.param_dtype, **init)
        self.down_proj = _new_param(rngs, *_stacked(num_layers, (e, im, h), ("experts", "mlp", "embed")),
                                    config.param_dtype, **init)
        self.num_experts = e
        self.dispatch = config.moe_dispatch
        self.capacity_factor = config.moe_capacity_factor
        self.parallelism = config.moe_parallelism
        self.partials = config.moe_partials
        self.dtype = config.dtype
        self.platform = config.platform  # resolved at trace time (`target_platform`)

    def __call__(self, x: jax.Array, top_k_index: jax.Array, top_k_weights: jax.Array) -> jax.Array:
        """x [N, H], top_k_index int [N, k], top_k_weights [N, k] -> [N, H] in the compute dtype."""
        weights = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        if self.dispatch == "dense":
            y = moe_dispatch_dense(x, top_k_index, top_k_weights, *weights, self.dtype)
        elif self.dispatch == "ragged":
            y = moe_dispatch_dropless(x, top_k_index, top_k_weights, *weights, self.dtype,
                                      platform=target_platform(self.platform), parallelism=self.parallelism,
                                      partials=self.partials)
        elif self.dispatch == "capacity":
            n, k = top_k_index.shape
            capacity = expert_capacity(n, k, self.num_experts, self.capacity_factor)
            y = moe_dispatch_capacity(x, top_k_index, top_k_weights, *weights, self.dtype, capacity)
        else:  # ModelConfig validates; kept for direct construction
            raise ValueError(f"unknown moe_dispatch {self.dispatch!r}")
        return y.astype(self.dtype)


class Qwen3MoeSparseMoeBlock(nnx.Module):
    """Router (``gate``, no bias) + experts; dropless top-k routing (spec 1.5)."""

    def __init__(self, config: ModelConfig, *, num_layers: int | None, rngs: nnx.Rngs):
        self.gate = Projection((config.hidden_size, config.num_experts), ("embed", "router"), "nh,he->ne",
                               num_layers=num_layers, config=config, rngs=rngs)
        self.experts = Qwen3MoeExperts(config, num_layers=num_layers, rngs=rngs)
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.dtype = config.dtype

    def __call__(self, x: jax.Array, routes: jax.Array | None = None
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x [B, T, H] -> (out [B, T, H], router_logits [B*T, E] in the compute dtype, the
        router's own top-k expert ids int32 [B*T, k]).

        ``routes`` (routing replay, R3): int [B*T, k] expert ids to dispatch by instead of the
        router's top-k; a row whose first id is not an expert (-1, or 255 in a uint8 record)
        keeps the router's choice (a token with no record). The gate weights are the live router's probabilities of the replayed experts
        (renormalised over them iff ``norm_topk_prob``), so the router keeps its gradient."""
        b, t, h = x.shape
        x = x.reshape(b * t, h)
        router_logits = self.gate(x)  # compute dtype, like HF
        router_probs = jax.nn.softmax(router_logits.astype(_F32), axis=-1)
        top_value, own_index = jax.lax.top_k(router_probs, self.top_k)
        top_index = own_index
        if routes is not None:
            routes = routes.astype(jnp.int32)
            top_index = jnp.where(has_route(routes, router_probs.shape[-1])[:, None], routes,
                                  own_index)
            top_value = jnp.take_along_axis(router_probs, top_index, axis=-1)
        if self.norm_topk_prob:
            top_value = top_value / jnp.sum(top_value, axis=-1, keepdims=True)
        top_value = top_value.astype(self.dtype)
        out = self.experts(x, top_index, top_value)
        return out.reshape(b, t, h), router_logits, own_index


def has_route(routes: jax.Array, num_experts: int) -> jax.Array:
    """bool [...]: whether a routing record int [..., k] holds experts (its first id in
    [0, num_experts)), not the "no record" mark (-1, or 255 in a uint8 record)."""
    first = routes[..., 0].astype(jnp.int32)
    return (first >= 0) & (first < num_experts)


def router_load_stats(router_logits: jax.Array, token_mask: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """One layer's terms of HF ``load_balancing_loss_func``.

    router_logits [N, E] (raw, compute dtype), token_mask float32 [N] (1 = real token).
    Returns (masked count of top-k selections per expert [E], masked sum of router probs per
    expert [E]), both float32. As in HF, the probabilities are ``softmax(logits)`` in the logits'
    dtype (no upcast: fp32 math rounded to that dtype) and top-k is taken on them.
    """
    num_experts = router_logits.shape[-1]
    probs = jax.nn.softmax(router_logits.astype(_F32), axis=-1).astype(router_logits.dtype)
    _, selected = jax.lax.top_k(probs, top_k)
    counts = jnp.sum(jax.nn.one_hot(selected, num_experts, dtype=_F32) * token_mask[:, None, None], axis=(0, 1))
    prob_sum = jnp.sum(probs.astype(_F32) * token_mask[:, None], axis=0)
    return counts, prob_sum


def load_balancing_loss(counts: jax.Array, prob_sum: jax.Array, total_rows: jax.Array) -> jax.Array:
    """``E * sum_e (counts_e / rows) * (prob_sum_e / rows)``; counts/prob_sum pooled over layers [E].

    ``total_rows`` = (number of MoE layers) x (number of real tokens). Balanced routing gives top_k.
    """
    num_experts = counts.shape[-1]
    rows = jnp.maximum(total_rows, 1.0)
    return num_experts * jnp.sum((counts / rows) * (prob_sum / rows))


# ============================================================================ decoder layer (stack)
class Qwen3DecoderLayer(nnx.Module):
    """Pre-norm decoder layer; built as a stack of ``num_layers`` layers of one kind.

    Parameters carry a leading ``layers`` axis; ``__call__`` runs ONE layer and must be called on a
    module merged from one layer's slice of the parameters (`_run_group` does this in a scan).
    """

    def __init__(self, config: ModelConfig, kind: str, *, num_layers: int, rngs: nnx.Rngs):
        if kind not in ("dense", "moe"):
            raise ValueError(f"layer kind must be 'dense' or 'moe', got {kind!r}")
        kw = dict(num_layers=num_layers, rngs=rngs)
        self.input_layernorm = RMSNorm(config.hidden_size, "embed", config=config, **kw)
        self.self_attn = Qwen3Attention(config, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, "embed", config=config, **kw)
        self.mlp = Qwen3MoeSparseMoeBlock(config, **kw) if kind == "moe" else Qwen3MLP(config, **kw)
        self.kind = kind

    def __call__(self, h, cos, sin, mask, kv_cache=None, cache_index=None, layer_index=None, kv_len=None,
                 kv_layout="standard", routes=None):
        """h [B,T,H] -> (h [B,T,H], kv_cache or None, router_logits [B*T,E] or None, the
        router's top-k ids int32 [B*T, k] or None).

        mask (an `AttentionMask`) / kv_cache / layer_index / kv_len / kv_layout: see
        `Qwen3Attention.__call__`; routes: see `Qwen3MoeSparseMoeBlock.__call__`."""
        residual = h
        x, kv_cache = self.self_attn(self.input_layernorm(h), cos, sin, mask, kv_cache, cache_index,
                                     layer_index, kv_len, kv_layout)
        h = residual + x
        residual = h
        x = self.post_attention_layernorm(h)
        router_logits = top_index = None
        if self.kind == "moe":
            x, router_logits, top_index = self.mlp(x, routes)
        else:
            x = self.mlp(x)
        return residual + x, kv_cache, router_logits, top_index


def _remat(fn, config: ModelConfig):
    if config.remat_policy == "none":
        return fn
    policy_name = REMAT_POLICIES[config.remat_policy]
    policy = None if policy_name is None else getattr(jax.checkpoint_policies, policy_name)
    return jax.checkpoint(fn, policy=policy, prevent_cse=not config.scan_layers)


def _run_group(stack: Qwen3DecoderLayer, config: ModelConfig, h, cos, sin, mask, token_mask, kv, cache_index,
               keep_router_logits: bool, kv_len: int | None = None, kv_layout: str = "standard",
               layer_params: tuple | None = None, cache_as_xs: bool = False,
               routes: jax.Array | None = None, keep_routes: bool = False):
    """Runs the ``Lg`` layers of one group over h [B,T,H].

    kv: None, or (k, v): [Lg, B, S, nkv, d] each ("standard" layout), or tuples of Lg per-layer
    arrays ("decode" layout, see `KVCache`). routes: None or int [Lg, B*T, k] (an MoE group's
    replayed expert ids, see `Qwen3MoeSparseMoeBlock.__call__`). Returns (h, new kv or None,
    (counts [E], prob_sum [E]) or None, router_logits [Lg, B*T, E] or None, the routers' top-k
    ids int32 [Lg, B*T, k] or None (``keep_routes``)).

    One ``jax.lax.scan`` when ``config.scan_layers``, else (and always with a "decode" cache) a
    Python loop. A "standard" cache stack is CARRIED through the layers (each layer writes its
    slice in place with a ``dynamic_update_slice`` at (layer, :, cache_index) and reads its own
    layer back), never split into per-layer scan inputs / outputs, so that inside a decode loop XLA
    updates it in place instead of copying the whole cache every step. ``mask`` (an
    `AttentionMask`), ``kv_len``: see `Qwen3Attention.__call__`. ``layer_params``: the Lg per-layer
    parameter states (see `Qwen3ForCausalLM.layer_params`) to use instead of slicing the stack here.
    ``cache_as_xs``: a "standard" cache goes through the scan as per-layer inputs and outputs
    instead of the carry (for a forward that is differentiated: the backward of a scan saves its
    carry at every layer, i.e. the whole cache stack Lg times).
    """
    graphdef, params = nnx.split(stack)
    top_k = config.num_experts_per_tok
    num_layers = jax.tree_util.tree_leaves(params)[0].shape[0]
    per_layer = kv_layout == "decode"

    def body(carry, layer_params, index, layer_routes):
        """One layer; ``kv``: None, the group's stacked cache (this layer at ``index``) or, for
        a "decode" cache, this layer's own (k, v); ``layer_routes``: [B*T, k] or None."""
        h, kv = carry
        layer = nnx.merge(graphdef, layer_params)
        h, kv, router_logits, top_index = layer(h, cos, sin, mask, kv, cache_index,
                                                None if kv is None or per_layer else index, kv_len,
                                                kv_layout, layer_routes)
        stats = None
        if router_logits is not None:
            stats = router_load_stats(router_logits, token_mask, top_k)
            if not keep_router_logits:
                router_logits = None
        return (h, kv), (stats, router_logits, top_index if keep_routes else None)

    if (config.scan_layers and kv_layout == "standard" and layer_params is None and kv is not None
            and cache_as_xs):
        def xs_body(h, xs):  # this layer's (k, v) [B, S, nkv, d] in and out
            lp, k_i, v_i, r_i = xs
            (h, kv_i), ys = body((h, (k_i, v_i)), lp, None, r_i)
            return h, (kv_i, ys)

        h, (kv, (stats, router_logits, top_index)) = jax.lax.scan(
            _remat(xs_body, config), h, (params, *kv, routes))
    elif config.scan_layers and not per_layer and layer_params is None:
        scan_body = _remat(lambda carry, xs: body(carry, *xs), config)
        (h, kv), (stats, router_logits, top_index) = jax.lax.scan(
            scan_body, (h, kv), (params, jnp.arange(num_layers, dtype=jnp.int32), routes))
    else:
        outs, new_k, new_v = [], [], []
        for i in range(num_layers):
            lp = jax.tree.map(lambda a: a[i], params) if layer_params is None else layer_params[i]  # noqa: B023
            layer_fn = _remat(functools.partial(body, index=i,  # a static layer index
                                                layer_routes=None if routes is None else routes[i]),
                              config)
            if per_layer:
                (h, (k_i, v_i)), y = layer_fn((h, (kv[0][i], kv[1][i])), lp)
                new_k.append(k_i)
                new_v.append(v_i)
            else:
                (h, kv), y = layer_fn((h, kv), lp)
            outs.append(y)
        if per_layer:
            kv = (tuple(new_k), tuple(new_v))
        stats, router_logits, top_index = jax.tree.map(lambda *a: jnp.stack(a), *outs)
    if stats is not None:
        stats = (jnp.sum(stats[0], axis=0), jnp.sum(stats[1], axis=0))
    return h, kv, stats, router_logits, top_index


def _group_routes(routes, groups, bt) -> list:
    """routes int [B, T, L_moe, k] (or None) -> per layer group: [Lg, B*T, k] for an MoE group
    (its layers' slice, in order), None for a dense group or no routes."""
    if routes is None:
        return [None] * len(groups)
    b, t = bt
    moe = sum(g.count for g in groups if g.kind == "moe")
    if routes.ndim != 4 or routes.shape[:3] != (b, t, moe):
        raise ValueError(f"routes must be [B, T, L_moe, k] = [{b}, {t}, {moe}, k], got "
                         f"{routes.shape}")
    flat = jnp.moveaxis(routes.reshape(b * t, moe, routes.shape[-1]), 1, 0)    # [L_moe, B*T, k]
    out, first = [], 0
    for g in groups:
        if g.kind == "moe":
            out.append(flat[first:first + g.count])
            first += g.count
        else:
            out.append(None)
    return out


# ============================================================================ cache and outputs
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Static-shape KV cache.

    k, v: the normed + rotated keys and the values, laid out per ``layout``:
      "standard": one array per layer group, k and v [Lg, B, S_max, nkv, head_dim];
      "decode":   one array per LAYER, k [B, nkv, head_dim, S_max] and v [B, nkv, S_max, head_dim]:
                  the operand layouts of the two attention matmuls, each layer its own buffer, so a
                  decode step updates the cache in place and reads it without slicing or
                  transposing (`init_cache(..., layout="decode")`; the CPU sampler's choice). The
                  layers then always run unrolled.
    kv_mask: bool [B, S_max]; True where the slot holds a real (non-padding) token.
    layout: static (pytree metadata).
    prefix: None, or a "standard" `KVCache` of B_p rows whose keys come BEFORE each row's own
      slots, row b_p shared by rows [b_p * G, (b_p + 1) * G) of this cache (G = B / B_p): a prompt
      prefilled once and its G samples (`with_shared_prefix`). Read, never written, by decode steps
      (`models.attention.decode_attention_shared_prefix`); this cache's own slots then start at 0.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    kv_mask: jax.Array
    layout: str = dataclasses.field(default="standard", metadata=dict(static=True))
    prefix: "KVCache | None" = None

    @property
    def batch_size(self) -> int:
        return self.kv_mask.shape[0]

    @property
    def max_len(self) -> int:
        return self.kv_mask.shape[1]


KV_LAYOUTS = ("standard", "decode")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedPrefix:
    """The prompts whose full pages several rows of a `PagedKVCache` share, for a decode step
    that reads each of them once for all its rows (`models.attention.paged_attention_shared_prefix`).

    table: int32 [Pn, prefix_pages], each prefix's pages; lengths: int32 [Pn], its slots (whole
      pages; 0 = an unused entry); rows: int32 [Pn, Gp], the rows that share it (-1: none), whose
      page tables list those pages first.
    """

    table: jax.Array
    lengths: jax.Array
    rows: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
    """Paged KV cache: one pool of fixed-size pages per layer group, shared by all rows.

    k, v: per layer group [Lg, num_pages, nkv, page_size, d] (normed + rotated keys, values):
      a page's heads together, each head's slots before its dims, so the minor two dims
      (page_size, d) tile without padding whatever nkv is (one KV head per chip on the pod) and
      the decode kernel reads the pool in its stored layout (no conversion on entry or exit).
    page_table: int32 [B, pages_per_row]: the pages of row b, in order (slot s of the row is
      offset s % page_size of page ``page_table[b, s // page_size]``); several rows may list the
      same page (a shared prompt) as long as none of them writes into it.
    lengths: int32 [B]: the slots each row has filled; a call's T tokens of row b go to slots
      lengths[b] .. lengths[b] + T - 1 (the real ones: ``attention_mask`` is right-padded) and the
      returned cache has lengths + the number of real tokens.
    prefix: None, or the `PagedPrefix` of the rows' shared prompt pages (a decode step then
      reads each once per prefix; chunks of T > 1 tokens read every row's table).
    read_pages: None, or a static bound on the pages of its table (with ``prefix``: past its
      prefix) that any row's decode step reads: attention then takes only that many columns
      of the table, so a kernel's grid and declared cost cover the pages read
      (`models.attention.paged_attention`). The caller promises it; the dry run's cost
      programs, which know the fill, set it. None: the whole table.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]
    page_table: jax.Array
    lengths: jax.Array
    prefix: PagedPrefix | None = None
    read_pages: int | None = dataclasses.field(default=None, metadata=dict(static=True))
    layout = "paged"

    @property
    def batch_size(self) -> int:
        return self.page_table.shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[3]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def max_len(self) -> int:
        """Slots a row can hold (pages_per_row x page_size)."""
        return self.page_table.shape[1] * self.page_size


def init_paged_cache(config: ModelConfig, batch: int, *, num_pages: int, page_size: int,
                     pages_per_row: int, dtype: Any = None) -> PagedKVCache:
    """An empty `PagedKVCache`: pools of ``num_pages`` pages of ``page_size`` slots, ``batch``
    rows with page tables of ``pages_per_row`` entries (all page 0) and lengths 0."""
    if min(batch, num_pages, page_size, pages_per_row) < 1:
        raise ValueError(f"init_paged_cache: batch, num_pages, page_size and pages_per_row must be "
                         f"positive, got {batch}, {num_pages}, {page_size}, {pages_per_row}")
    dtype = dtype or config.dtype
    nkv, d = config.num_key_value_heads, config.head_dim
    shapes = [(g.count, num_pages, nkv, page_size, d) for g in config.layer_groups()]
    return PagedKVCache(k=tuple(jnp.zeros(x, dtype) for x in shapes),
                        v=tuple(jnp.zeros(x, dtype) for x in shapes),
                        page_table=jnp.zeros((batch, pages_per_row), jnp.int32),
                        lengths=jnp.zeros((batch,), jnp.int32))


def cache_shapes(config: ModelConfig, batch: int, max_len: int, layout: str = "standard"):
    """[(k shape, v shape)] of the arrays of a `KVCache` with this ``layout`` (one per layer group
    for "standard", one per layer for "decode")."""
    if layout not in KV_LAYOUTS:
        raise ValueError(f"unknown KV-cache layout {layout!r}; valid: {list(KV_LAYOUTS)}")
    nkv, d = config.num_key_value_heads, config.head_dim
    if layout == "decode":
        return [((batch, nkv, d, max_len), (batch, nkv, max_len, d))] * config.num_hidden_layers
    return [((g.count, batch, max_len, nkv, d),) * 2 for g in config.layer_groups()]


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype: Any = None,
               layout: str = "standard") -> KVCache:
    """An empty cache for ``batch`` rows of ``max_len`` slots (dtype default: ``config.dtype``)."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"init_cache: batch and max_len must be positive, got batch={batch}, max_len={max_len}")
    dtype = dtype or config.dtype
    shapes = cache_shapes(config, batch, max_len, layout)
    return KVCache(
        k=tuple(jnp.zeros(k, dtype) for k, _ in shapes),
        v=tuple(jnp.zeros(v, dtype) for _, v in shapes),
        kv_mask=jnp.zeros((batch, max_len), bool),
        layout=layout,
    )


def with_shared_prefix(prefix: KVCache, group_size: int, max_new: int) -> KVCache:
    """An empty "standard" cache of ``max_new`` own slots for each of ``group_size`` rows per row of
    ``prefix`` (a prefilled "standard" cache), which they share (see `KVCache.prefix`)."""
    if prefix.layout != "standard" or prefix.prefix is not None:
        raise ValueError("a shared prefix is one 'standard' KVCache without a prefix of its own")
    b = prefix.batch_size * group_size
    return KVCache(k=tuple(jnp.zeros((k.shape[0], b, max_new, *k.shape[3:]), k.dtype) for k in prefix.k),
                   v=tuple(jnp.zeros((v.shape[0], b, max_new, *v.shape[3:]), v.dtype) for v in prefix.v),
                   kv_mask=jnp.zeros((b, max_new), bool), layout="standard", prefix=prefix)


class ModelOutput(NamedTuple):
    """Outputs of `Qwen3ForCausalLM.__call__`.

    logits: float32 [B, T, V], or None when called with ``compute_logits=False``.
    cache: the updated `KVCache`, or None without a cache.
    aux_loss: float32 scalar, HF ``load_balancing_loss_func`` pooled over all MoE layers (masked
      mean over real tokens); 0.0 for dense models. NOT multiplied by router_aux_loss_coef.
    hidden_states: [B, T, H] in the compute dtype, after the final norm (the lm_head input); use
      ``model.lm_logits`` on slices of it to compute logits in chunks.
    router_logits: None, or per layer group [Lg, B*T, E] (compute dtype; None for dense groups)
      when called with ``return_router_logits=True``.
    routes: None, or int32 [B, T, L_moe, k]: the top-k expert ids each MoE layer's router chose
      for each token (in layer order), when called with ``return_routes=True``.
    """

    logits: jax.Array | None
    cache: KVCache | None
    aux_loss: jax.Array
    hidden_states: jax.Array
    router_logits: tuple[jax.Array | None, ...] | None = None
    routes: jax.Array | None = None


# ============================================================================ the model
class Qwen3ForCausalLM(nnx.Module):
    """Qwen3 / Qwen3-MoE causal LM (HF ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM``)."""

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.embed_tokens = Embedding(config, rngs=rngs)
        self.layers = nnx.List([
            Qwen3DecoderLayer(config, g.kind, num_layers=g.count, rngs=rngs) for g in config.layer_groups()
        ])
        self.norm = RMSNorm(config.hidden_size, "embed", num_layers=None, config=config, rngs=rngs)
        if not config.tie_word_embeddings:
            self.lm_head = Projection((config.hidden_size, config.vocab_size), ("embed", "vocab"), "...h,hv->...v",
                                      num_layers=None, config=config, rngs=rngs)

    def init_cache(self, batch: int, max_len: int, dtype: Any = None) -> KVCache:
        """Same as the module function `init_cache` for this model's config."""
        return init_cache(self.config, batch, max_len, dtype)

    def __call__(self, input_ids: jax.Array, positions: jax.Array | None = None, *,
                 attention_mask: jax.Array | None = None,
                 cache: KVCache | PagedKVCache | None = None,
                 cache_index: jax.Array | int | None = None,
                 compute_logits: bool = True, return_router_logits: bool = False,
                 layer_params: tuple | None = None, cache_as_xs: bool = False,
                 routes: jax.Array | None = None, return_routes: bool = False) -> ModelOutput:
        """Forward pass.

        Args:
          input_ids: int [B, T] token ids.
          positions: int [B, T] RoPE positions (left-padded rows start at 0 at their first real
            token: the caller gives them). None: 0..T-1 in every row, or with a cache
            cache_index..cache_index+T-1, which needs a concrete cache_index (a traced one raises),
            or with a paged cache lengths[b]..lengths[b]+T-1.
          attention_mask: bool [B, T] (or 0/1 ints), True = real token; None = all real.
          cache: None, a `KVCache` with S_max >= cache_index + T slots, or a `PagedKVCache`
            (then no ``cache_index``: each row's tokens go to its own ``lengths[b]`` onwards, and
            ``attention_mask`` must be right-padded).
          cache_index: int32 scalar, the slot of the first new token (same for every row); required
            iff a `KVCache` is given. The caller keeps cache_index + T <= S_max: a concrete index is
            checked, a traced one cannot be (``dynamic_update_slice`` would clamp it).
          compute_logits: False skips the [B, T, V] logits (logits=None); the caller can then apply
            `lm_logits` to chunks of ``hidden_states``.
          return_router_logits: also return each group's router logits (for parity checks).
          layer_params: None, or `layer_params()` computed OUTSIDE an enclosing loop: the layers
            then run unrolled on these per-layer weights (a decode ``while_loop`` reads each
            layer's weights in place instead of slicing them out of the stacks every step).
          cache_as_xs: a scanned "standard" cache passes through the layers as per-layer scan
            inputs / outputs, not in the carry: set it when the forward is differentiated (the
            learner's shared-prompt pass), else the backward keeps a copy of the whole cache
            per layer. Decode loops keep the default (the carried cache is updated in place).
          routes: None, or int [B, T, L_moe, k] expert ids to dispatch each MoE layer's tokens
            by (routing replay; rows of -1 or 255: the router's own choice), e.g. the ``routes`` a sampler
            recorded; gate weights stay the live router's (`Qwen3MoeSparseMoeBlock.__call__`).
          return_routes: also return the routers' own top-k ids (``ModelOutput.routes``).

        Masking: without a cache, query t sees key t' iff t' <= t and attention_mask[b, t']. With a
        cache, the T new keys/values are written to slots [cache_index, cache_index + T), kv_mask of
        those slots is set from attention_mask, and query t sees slot s iff s <= cache_index + t and
        kv_mask[b, s]. The kernel is ``config.attention_impl`` resolved for the number of keys
        attended (`models.attention.resolve_attention_impl`); only "dot" builds the [B, T, S] mask,
        the others take the rule as segment ids and an offset (`AttentionMask`).

        Returns:
          `ModelOutput` (logits float32 [B, T, V], cache, aux_loss, router_logits).
        """
        cfg = self.config
        input_ids, positions, attention_mask = self._check_inputs(input_ids, positions, attention_mask, cache,
                                                                  cache_index)
        b, t = input_ids.shape
        kv_len = None
        platform = target_platform(cfg)
        paged = isinstance(cache, PagedKVCache)
        if paged:  # the paged kernels read the mask from the segment ids and the row lengths
            kv_mask = None
            ids = attention_mask.astype(jnp.int32)
            mask = AttentionMask(ids, ids, 0, None, impl="paged", platform=platform)
            cache_index = (cache.page_table, cache.lengths, cache.prefix, cache.read_pages)
        elif cache is None:
            kv_mask, kv_keys, offset = None, attention_mask, 0
        else:
            # A concrete cache_index bounds the slots the queries can see: attention reads only the
            # kv_len = cache_index + T filled slots (a prefill into an empty cache: only the T new
            # keys, at offset 0). The slots past it are invisible anyway (s > cache_index + t).
            kv_len = cache.max_len if _traced(cache_index) else int(cache_index) + t
            offset = cache_index if _traced(cache_index) else int(cache_index)
            if kv_len == t:  # a prefill into an empty cache: the index is 0, traced or not
                offset = 0
            cache_index = jnp.asarray(cache_index, jnp.int32)
            kv_mask = jax.lax.dynamic_update_slice(cache.kv_mask, attention_mask, (0, cache_index))
            kv_keys = kv_mask[:, :kv_len]
        if not paged:
            impl = resolve_attention_impl(cfg.attention_impl, platform, kv_keys.shape[1])
            mask = _attention_mask_for(impl, platform, attention_mask, kv_keys, offset)

        h = self.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, cfg)
        token_mask = attention_mask.reshape(-1).astype(_F32)

        new_k, new_v, all_router_logits, all_routes = [], [], [], []
        counts = prob_sum = None
        layout = "standard" if cache is None else cache.layout
        groups = cfg.layer_groups()
        group_routes = _group_routes(routes, groups, (b, t))
        for g, stack in enumerate(self.layers):
            if cache is None:
                kv = None
            elif layout == "decode":  # one array per layer
                first, count = groups[g].start, groups[g].count
                kv = (cache.k[first:first + count], cache.v[first:first + count])
            else:
                kv = (cache.k[g], cache.v[g])
                if not paged and cache.prefix is not None:
                    kv += ((cache.prefix.k[g], cache.prefix.v[g], cache.prefix.kv_mask),)
            h, kv, stats, router_logits, top_index = _run_group(
                stack, cfg, h, cos, sin, mask, token_mask, kv, cache_index, return_router_logits,
                kv_len, layout, None if layer_params is None else layer_params[g], cache_as_xs,
                group_routes[g], return_routes)
            if kv is not None and layout == "decode":
                new_k.extend(kv[0])
                new_v.extend(kv[1])
            elif kv is not None:
                new_k.append(kv[0])
                new_v.append(kv[1])
            if stats is not None:
                counts = stats[0] if counts is None else counts + stats[0]
                prob_sum = stats[1] if prob_sum is None else prob_sum + stats[1]
            all_router_logits.append(router_logits)
            if top_index is not None:
                all_routes.append(top_index)

        h = self.norm(h)
        logits = self.lm_logits(h) if compute_logits else None

        if counts is None:
            aux_loss = jnp.zeros((), _F32)
        else:
            aux_loss = load_balancing_loss(counts, prob_sum, cfg.num_moe_layers * jnp.sum(token_mask))
        if paged:
            new_cache = PagedKVCache(k=tuple(new_k), v=tuple(new_v), page_table=cache.page_table,
                                     lengths=cache.lengths + jnp.sum(attention_mask, axis=1, dtype=jnp.int32),
                                     prefix=cache.prefix, read_pages=cache.read_pages)
        else:
            new_cache = None if cache is None else KVCache(k=tuple(new_k), v=tuple(new_v), kv_mask=kv_mask,
                                                           layout=cache.layout, prefix=cache.prefix)
        out_routes = None
        if return_routes and all_routes:  # per group [Lg, B*T, k] -> [B, T, L_moe, k]
            out_routes = jnp.moveaxis(jnp.concatenate(all_routes, axis=0), 0, 1).reshape(
                b, t, -1, cfg.num_experts_per_tok)
        return ModelOutput(logits=logits, cache=new_cache, aux_loss=aux_loss, hidden_states=h,
                           router_logits=tuple(all_router_logits) if return_router_logits else None,
                           routes=out_routes)

    def layer_params(self) -> tuple[tuple[nnx.State, ...], ...]:
        """Per layer group, the parameter state of each of its layers (sliced out of the stacks)."""
        out = []
        for stack in self.layers:
            _, params = nnx.split(stack)
            count = jax.tree_util.tree_leaves(params)[0].shape[0]
            out.append(tuple(jax.tree.map(lambda a: a[i], params) for i in range(count)))  # noqa: B023
        return tuple(out)

    def lm_logits(self, hidden_states: jax.Array) -> jax.Array:
        """float32 logits [..., V] of final-normed hidden states [..., H] (compute dtype).

        The lm_head (or, when tied, the embedding table) is cast to the compute dtype and the
        product is accumulated in fp32 and NOT rounded to the compute dtype.
        """
        if self.config.tie_word_embeddings:
            return self.embed_tokens.attend(hidden_states)
        return jnp.einsum("...h,hv->...v", hidden_states.astype(self.config.dtype),
                          self.lm_head.kernel[...].astype(self.config.dtype), preferred_element_type=_F32)

    def _check_inputs(self, input_ids, positions, attention_mask, cache, cache_index):
        cfg = self.config
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {input_ids.shape}")
        if not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise TypeError(f"input_ids must be integer, got {input_ids.dtype}")
        if attention_mask is None:
            attention_mask = jnp.ones(input_ids.shape, bool)
        else:
            attention_mask = jnp.asarray(attention_mask)
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask shape {attention_mask.shape} != input_ids shape {input_ids.shape}")
            attention_mask = attention_mask.astype(bool)
        if isinstance(cache, PagedKVCache):
            return self._check_paged(input_ids, positions, attention_mask, cache, cache_index)
        if (cache is None) != (cache_index is None):
            raise ValueError("cache and cache_index must be given together (or neither)")
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
            groups = cfg.layer_groups()
            if cache.layout == "decode":
                if len(cache.k) != cfg.num_hidden_layers or len(cache.v) != cfg.num_hidden_layers:
                    raise ValueError(f"a 'decode' cache has {len(cache.k)} layers, the model has "
                                     f"{cfg.num_hidden_layers}")
            elif len(cache.k) != len(groups) or len(cache.v) != len(groups):
                raise ValueError(f"cache has {len(cache.k)} layer groups, the model has {len(groups)}")
            shapes = cache_shapes(cfg, input_ids.shape[0], cache.max_len, cache.layout)
            for g, (k, (want_k, want_v)) in enumerate(zip(cache.k, shapes)):
                if k.shape != want_k or cache.v[g].shape != want_v:
                    want = want_k if want_k == want_v else f"{want_k}/{want_v}"
                    raise ValueError(f"cache group {g}: k/v shapes {k.shape}/{cache.v[g].shape}, expected {want}")
            if input_ids.shape[1] > cache.max_len:
                raise ValueError(f"{input_ids.shape[1]} new tokens do not fit a cache of {cache.max_len} slots")
            if cache.prefix is not None:
                if cache.layout != "standard" or cache.batch_size % cache.prefix.batch_size:
                    raise ValueError(f"a shared prefix of {cache.prefix.batch_size} rows needs a 'standard' "
                                     f"cache whose {cache.batch_size} rows are whole groups of them")
                if positions is None:
                    raise ValueError("a cache with a shared prefix needs explicit positions (its own "
                                     "slots start at 0, after the prefix)")
            if jnp.ndim(cache_index) != 0:
                raise ValueError(f"cache_index must be a scalar, got shape {jnp.shape(cache_index)}")
            if not _traced(cache_index):  # a traced index cannot be checked here
                start = int(cache_index)
                if start < 0 or start + input_ids.shape[1] > cache.max_len:
                    raise ValueError(f"tokens [{start}, {start + input_ids.shape[1]}) do not fit a cache of "
                                     f"{cache.max_len} slots")
        positions = self._default_positions(input_ids.shape, cache_index) if positions is None else positions
        positions = jnp.asarray(positions)
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions shape {positions.shape} != input_ids shape {input_ids.shape}")
        if not jnp.issubdtype(positions.dtype, jnp.integer):
            raise TypeError(f"positions must be integer, got {positions.dtype}")
        return input_ids, positions, attention_mask

    def _check_paged(self, input_ids, positions, attention_mask, cache: PagedKVCache, cache_index):
        if cache_index is not None:
            raise ValueError("a PagedKVCache carries each row's start (lengths): pass no cache_index")
        groups = self.config.layer_groups()
        nkv, d = self.config.num_key_value_heads, self.config.head_dim
        if len(cache.k) != len(groups) or len(cache.v) != len(groups):
            raise ValueError(f"paged cache has {len(cache.k)} layer groups, the model has {len(groups)}")
        for g, (k, v) in enumerate(zip(cache.k, cache.v)):
            want = (groups[g].count, cache.num_pages, nkv, cache.page_size, d)
            if k.shape != want or v.shape != want:
                raise ValueError(f"paged cache group {g}: k/v shapes {k.shape}/{v.shape}, expected {want}")
        if cache.page_table.shape[0] != input_ids.shape[0] or cache.lengths.shape != (input_ids.shape[0],):
            raise ValueError(f"paged cache of {cache.page_table.shape[0]} rows (lengths "
                             f"{cache.lengths.shape}) for input_ids of {input_ids.shape[0]} rows")
        pre = cache.prefix
        if pre is not None and not (pre.table.ndim == 2 and pre.rows.ndim == 2
                                    and pre.table.shape[0] == pre.rows.shape[0]
                                    and pre.lengths.shape == (pre.rows.shape[0],)):
            raise ValueError(f"PagedPrefix table {pre.table.shape}, lengths {pre.lengths.shape} and "
                             f"rows {pre.rows.shape} must be [Pn, pages], [Pn] and [Pn, Gp]")
        if positions is None:
            positions = cache.lengths[:, None] + jnp.arange(input_ids.shape[1], dtype=jnp.int32)[None, :]
        positions = jnp.asarray(positions)
        if positions.shape != input_ids.shape:
            raise ValueError(f"positions shape {positions.shape} != input_ids shape {input_ids.shape}")
        return input_ids, positions, attention_mask

    @staticmethod
    def _default_positions(shape: tuple[int, int], cache_index) -> jax.Array:
        """int32 [B, T]: start..start+T-1 in every row, start = the concrete cache_index (0 without a cache)."""
        if _traced(cache_index):
            raise ValueError("positions are required with a traced cache_index (the first position is not known "
                             "at trace time); pass positions [B, T]")
        start = 0 if cache_index is None else int(cache_index)
        return jnp.broadcast_to(jnp.arange(start, start + shape[1], dtype=jnp.int32), shape)


# ============================================================================ flat views of the parameters
def _flat_param_state(model: nnx.Module) -> dict[str, nnx.Param]:
    state = nnx.state(model, nnx.Param)
    return {"/".join(str(p) for p in path): var for path, var in nnx.to_flat_state(state)}


def flat_params(model: nnx.Module) -> dict[str, jax.Array]:
    """{"layers/0/self_attn/q_proj/kernel": array, ...} for every Param (see the module docstring)."""
    return {name: var.get_value() for name, var in _flat_param_state(model).items()}


def logical_axes(model: nnx.Module) -> dict[str, tuple[str, ...]]:
    """{param name: tuple of logical axis names} (one name per array dimension)."""
    return {name: tuple(var.get_metadata()["out_sharding"]) for name, var in _flat_param_state(model).items()}


def set_flat_params(model: nnx.Module, flat: Mapping[str, Any]) -> None:
    """Replaces every Param of ``model`` in place from ``flat`` (names as in `flat_params`).

    Every name must be present, no extra name is allowed, and every shape must match exactly. Values
    are cast to each Param's existing dtype (``config.param_dtype``).

    Raises:
      KeyError: listing missing and unexpected names.
      ValueError: naming the tensor, the expected and the given shape.
    """
    state = nnx.state(model, nnx.Param)
    flat_state = nnx.to_flat_state(state)
    by_name = {"/".join(str(p) for p in path): var for path, var in flat_state}
    missing = sorted(set(by_name) - set(flat))
    unexpected = sorted(set(flat) - set(by_name))
    if missing or unexpected:
        raise KeyError(f"set_flat_params: missing tensors {missing}; unexpected tensors {unexpected}")
    for name, var in by_name.items():
        value = flat[name]
        if tuple(np.shape(value)) != tuple(var.shape):
            raise ValueError(f"set_flat_params: {name}: expected shape {tuple(var.shape)}, got {tuple(np.shape(value))}")
    for name, var in by_name.items():
        var.set_value(jnp.asarray(flat[name], dtype=var.dtype))
    nnx.update(model, state)


# ============================================================================ parameter counts
def param_counts(config: ModelConfig) -> tuple[int, int]:
    """(total, active_per_token) parameter counts, from the module's abstract shapes (no allocation).

    ``total`` counts every Param (the tied lm_head once). ``active_per_token`` is total minus the
    weights of the experts a token does NOT use: in each MoE layer only ``num_experts_per_tok`` of the
    ``num_experts`` experts count. So it includes the embedding table, attention, norms, routers and
    the lm_head (HF's "A3B / A22B" convention). Qwen3-30B-A3B: 30,532,122,624 / 3,353,032,704
    (= spec 5.1's 3,041,865,728 matmul params + 311,164,928 embedding + 2,048 final norm);
    Qwen3-235B-A22B: 235,093,634,560 / 22,190,763,520.
    """
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)))
    total = inactive = 0
    for name, var in _flat_param_state(abstract).items():
        size = math.prod(var.shape)
        total += size
        if "/mlp/experts/" in name:
            per_expert = size // config.num_experts
            inactive += per_expert * (config.num_experts - config.num_experts_per_tok)
    return total, total - inactive
