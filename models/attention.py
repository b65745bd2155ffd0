"""Attention kernels for long rows that never form a [T, S] array, and their mask convention.

Shapes: q [B, T, nq, d], k / v [B, S, nkv, d]; query head j uses kv head ``j // (nq // nkv)`` (GQA,
HF ``repeat_kv``); outputs are [B, T, nq, d] in the compute dtype ``dtype``.

Mask convention (one for every kernel here), with int32 segment ids instead of a [T, S] mask:
``q_segment_ids`` [B, T] and ``kv_segment_ids`` [B, S] (0 = padding) and a causal ``offset``
(the cache slot of query 0; 0 for self-attention). Query t of row b SEES key s iff::

    s <= t + offset  and  q_segment_ids[b, t] == kv_segment_ids[b, s] != 0

With ids 1 for real tokens and 0 for padding (`segment_mask` builds the equivalent dense mask),
a real query sees exactly today's keys of `models.qwen3` (key t' iff t' <= t and
attention_mask[b, t']); ids > 1 pack several sequences into one row. Rows are left-padded.
A PADDING query row (segment id 0) is garbage in every kernel (every loss masks it out); it
stays finite in the forward and the backward: `blockwise_attention` and `decode_attention`
return 0 there (no visible key), `splash_attention` attends among padding keys.

Kernels:
  * `segment_mask`: the convention as a dense bool [B, T, S] mask, for the exact
    ``models.qwen3.dot_product_attention`` (the HF-parity reference; [T, S] memory: short rows,
    tests).
  * `blockwise_attention`: pure JAX flash attention for CPU and GPU: loops over query blocks and
    key blocks with an online softmax, and a ``jax.custom_vjp`` whose backward recomputes the
    block probabilities from the saved output and log-sum-exp. Memory O(T x block) in the
    forward and the backward (residuals: q, k, v, out and an fp32 [B, nq, T] log-sum-exp); key
    blocks entirely above the causal diagonal are never visited.
  * `splash_attention`: the Pallas TPU kernel (``jax.experimental.pallas.ops.tpu.
    splash_attention``) with a causal mask and segment ids; under a mesh it runs in
    ``jax.shard_map`` (batch over the data-parallel axes, heads over 'tensor'); on CPU it runs in
    interpret mode (tests).
  * `decode_attention`: one query per row against a KV cache whose filled prefix length is a
    traced scalar (the decode loop's index): reads only the ceil(filled / block) filled key
    blocks, with an online softmax; `decode_attention_shared_prefix`: the same for rows whose
    keys start with a prefix shared by a group (cascade attention). ``kernel="xla"`` runs the
    block loop in pure JAX; ``"pallas"`` runs `models.decode_kernel` (TPU: each key block's
    scores stay on chip, its cost is declared to XLA).
  * `paged_write` / `paged_attention`: a PAGED cache (fixed-size pages in a pool shared by all
    rows, a page table per row; `models.qwen3.PagedKVCache`): T new tokens per row written at
    the row's own fill, and T queries per row (a decode step: T = 1; a prefill chunk: T > 1)
    against the row's filled pages only, block by block, with an online softmax. On TPU both
    run `models.decode_kernel.paged_decode_stats` (``kernel="pallas"``), which reads each page
    in place from the stacked pool by its id (a prefill chunk causal within it). The pool is
    [L, P, nkv, page_size, d]: the minor dims (page_size, d) tile without padding at any nkv,
    and the kernel reads the stored layout (no conversion of the pool on entry, exit or per
    layer; `ace_jax.train.dry_run_engine` reads the compiled call for such copies). jax's
    ``ragged_paged_attention`` takes one layer's pool with K and V interleaved, which this
    layer-stacked layout would have to copy out every step.

Which platform picks which kernel (`resolve_attention_impl`, ``ModelConfig.attention_impl``
"auto"): "splash" on TPU; elsewhere "dot" (the exact [B, T, S] path) up to `DOT_MAX_KEYS` keys and
"blockwise" above. A decode step (one query, traced cache index) of a blockwise / splash model
uses `decode_attention`: XLA's block loop for "blockwise", the Pallas decode kernel for "splash"
(`models.qwen3._decode_kernel`; interpret mode off TPU, as splash).

Numerics. ``dot_product_attention`` (HF eager order): scores q.k accumulated in fp32 and rounded
to ``dtype``, times head_dim**-0.5 in ``dtype``, softmax in fp32, probabilities rounded to
``dtype``, p.v accumulated in fp32, output rounded to ``dtype``.
  * blockwise / decode: the same scores (rounded to ``dtype``, then scaled in ``dtype``); the
    softmax is taken online in fp32, and the UNNORMALISED block probabilities exp(s - running
    max) are rounded to ``dtype`` before p.v (fp32 accumulation), then divided by the fp32 sum.
    In fp32 this equals the reference to rounding; in bf16 each probability carries one bf16
    rounding of a different value (relative error ~2^-8 per term, as in the reference).
  * splash: q is scaled first (q * head_dim**-0.5 rounded to ``dtype``), the scores stay in fp32,
    and the probabilities are not rounded (the kernel multiplies fp32 p by v cast to fp32).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.configs import ATTENTION_IMPLS
from models.kernel_mesh import mesh_specs, row_split

__all__ = [
    "ATTENTION_IMPLS",
    "DOT_MAX_KEYS",
    "resolve_attention_impl",
    "segment_mask",
    "blockwise_attention",
    "splash_attention",
    "DECODE_KERNELS",
    "decode_attention",
    "decode_attention_shared_prefix",
    "paged_write",
    "paged_attention",
]

_F32 = jnp.float32
_MASK_VALUE = float(np.finfo(np.float32).min)  # a finite "minus infinity" for the running max
DECODE_KERNELS = ("xla", "pallas", "pallas_interpret")  # `decode_attention`'s ``kernel``
DOT_MAX_KEYS = 2048  # "auto" off TPU: the exact [B, T, S] path up to this many keys, blockwise above
_SPLASH_LANES = 128  # splash block sizes must be multiples of the TPU lane width


# ============================================================================ choice of kernel
def resolve_attention_impl(impl: str, platform: str, num_keys: int) -> str:
    """The kernel "dot" | "blockwise" | "splash" that ``impl`` selects for ``num_keys`` keys.

    "auto": "splash" when ``platform`` is "tpu"; otherwise "dot" for num_keys <= `DOT_MAX_KEYS`
    (today's exact path, fastest for short rows) and "blockwise" above. Other values are returned
    as they are.
    """
    if impl not in ATTENTION_IMPLS:
        raise ValueError(f"attention_impl={impl!r}; valid: {list(ATTENTION_IMPLS)}")
    if impl != "auto":
        return impl
    if platform == "tpu":
        return "splash"
    return "dot" if num_keys <= DOT_MAX_KEYS else "blockwise"


# ============================================================================ the mask convention
def _visible(q_seg: jax.Array, kv_seg: jax.Array, q_pos: jax.Array, kv_pos: jax.Array, offset: jax.Array,
             causal: bool) -> jax.Array:
    """bool [B, Tq, Sk]: the mask convention for query positions q_pos [Tq] and key slots kv_pos [Sk]."""
    same = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
    if not causal:
        return same
    return same & (kv_pos[None, None, :] <= q_pos[None, :, None] + offset)


def segment_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, offset: jax.Array | int = 0, *,
                 causal: bool = True) -> jax.Array:
    """bool [B, T, S]: query t sees key s (the module's mask convention, as a dense mask).

    q_segment_ids int [B, T], kv_segment_ids int [B, S] (0 = padding); offset: int scalar, the slot
    of query 0 (query t sees slots s <= t + offset when ``causal``).
    """
    q_seg, kv_seg = jnp.asarray(q_segment_ids, jnp.int32), jnp.asarray(kv_segment_ids, jnp.int32)
    t, s = q_seg.shape[1], kv_seg.shape[1]
    return _visible(q_seg, kv_seg, jnp.arange(t), jnp.arange(s), jnp.asarray(offset, jnp.int32), causal)


def _check_qkv(q, k, v, q_segment_ids, kv_segment_ids) -> tuple[jax.Array, jax.Array]:
    """Validates the shapes of the common arguments; returns the segment ids as int32."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError(f"q, k, v must be [B, T, n, d]; got shapes {q.shape}, {k.shape}, {v.shape}")
    b, t, nq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {k.shape} / v {v.shape} do not match q {q.shape} (want [B, S, nkv, d])")
    if nq % k.shape[2]:
        raise ValueError(f"query heads {nq} are not a multiple of kv heads {k.shape[2]}")
    segs = []
    for name, seg, want, dims in (("q_segment_ids", q_segment_ids, (b, t), "[B, T]"),
                                  ("kv_segment_ids", kv_segment_ids, (b, k.shape[1]), "[B, S]")):
        seg = jnp.asarray(seg)
        if seg.shape != want:
            raise ValueError(f"{name} must be {dims} = {want}, got {seg.shape}")
        if not (jnp.issubdtype(seg.dtype, jnp.integer) or seg.dtype == jnp.bool_):
            raise TypeError(f"{name} must be integer (or bool), got {seg.dtype}")
        segs.append(seg.astype(jnp.int32))
    return segs[0], segs[1]


def _int_scalar(value, name: str) -> jax.Array:
    """``value`` (an int or an int array of shape ()) as int32; TypeError otherwise."""
    value = jnp.asarray(value)
    if value.ndim != 0 or not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer scalar, got {value.dtype} of shape {value.shape}")
    return value.astype(jnp.int32)


def _pad_axis(x: jax.Array, axis: int, size: int) -> jax.Array:
    """x zero-padded at the end of ``axis`` to ``size``."""
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


# ============================================================================ blockwise (flash) attention
def _scores(q_blk: jax.Array, k_blk: jax.Array, scaling: float, dtype: Any) -> jax.Array:
    """fp32 [B, nkv, G, bq, bk] scores of q_blk [B, bq, nkv, G, d] and k_blk [B, bk, nkv, d], rounded
    to ``dtype`` and scaled in ``dtype`` (the reference's order)."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_blk.astype(dtype), k_blk.astype(dtype), preferred_element_type=_F32)
    return (s.astype(dtype) * scaling).astype(_F32)


def _online_softmax_step(carry, s: jax.Array, visible: jax.Array, v_blk: jax.Array, dtype: Any):
    """One key block of the online softmax.

    carry (m [B,nkv,G,bq] running max, l [B,nkv,G,bq] running sum, acc fp32 [B,nkv,G,bq,d]);
    s fp32 [B,nkv,G,bq,bk] scores; visible bool [B,1,1,bq,bk]; v_blk [B,bk,nkv,d].
    Invisible keys contribute exactly 0; a row with no visible key so far keeps l = acc = 0.
    """
    m, l, acc = carry
    s = jnp.where(visible, s, _MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))
    p = jnp.where(visible, jnp.exp(s - m_new[..., None]), 0.0)
    alpha = jnp.exp(m - m_new)  # both finite: 1 while the row has seen nothing
    l = alpha * l + jnp.sum(p, axis=-1)
    pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(dtype), v_blk.astype(dtype), preferred_element_type=_F32)
    return m_new, l, alpha[..., None] * acc + pv


def _finish(m: jax.Array, l: jax.Array, acc: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(acc / l, log-sum-exp); 0 and 0 for rows with no visible key (finite garbage)."""
    seen = l > 0
    out = acc / jnp.where(seen, l, 1.0)[..., None]
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), 0.0)
    return out, lse


def _num_kv_blocks(i, bq: int, bk: int, nkb: int, offset, causal: bool):
    """Key blocks query block i can see: all of them, or those not entirely above the diagonal."""
    if not causal:
        return nkb
    last_visible = (i + 1) * bq - 1 + offset  # the largest slot any query of the block may see
    return jnp.clip(last_visible // bk + 1, 0, nkb)


def _first_q_block(j, bq: int, bk: int, nqb: int, offset, causal: bool):
    """The first query block that sees any key of key block j."""
    if not causal:
        return 0
    return jnp.clip((j * bk - offset) // bq, 0, nqb)


def _slice(x: jax.Array, start, size: int, axis: int = 1) -> jax.Array:
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


def _blockwise_forward(q5, k, v, q_seg, kv_seg, offset, static):
    """(out [B,Tp,nkv,G,d] in dtype, lse fp32 [B,nkv,G,Tp]) over padded inputs (Tp % bq == Sp % bk == 0)."""
    scaling, dtype, causal, bq, bk = static
    b, tp, nkv, g, d = q5.shape
    nqb, nkb = tp // bq, k.shape[1] // bk

    def query_block(i):
        q_blk, q_seg_blk = _slice(q5, i * bq, bq), _slice(q_seg, i * bq, bq)
        q_pos = i * bq + jnp.arange(bq)

        def key_block(j, carry):
            s = _scores(q_blk, _slice(k, j * bk, bk), scaling, dtype)
            vis = _visible(q_seg_blk, _slice(kv_seg, j * bk, bk), q_pos, j * bk + jnp.arange(bk), offset, causal)
            return _online_softmax_step(carry, s, vis[:, None, None], _slice(v, j * bk, bk), dtype)

        init = (jnp.full((b, nkv, g, bq), _MASK_VALUE, _F32), jnp.zeros((b, nkv, g, bq), _F32),
                jnp.zeros((b, nkv, g, bq, d), _F32))
        m, l, acc = jax.lax.fori_loop(0, _num_kv_blocks(i, bq, bk, nkb, offset, causal), key_block, init)
        out, lse = _finish(m, l, acc)
        return jnp.moveaxis(out, 3, 1).astype(dtype), lse  # [B,bq,nkv,G,d], [B,nkv,G,bq]

    outs, lses = jax.lax.map(query_block, jnp.arange(nqb))  # [nqb, B, bq, nkv, G, d], [nqb, B, nkv, G, bq]
    out = jnp.moveaxis(outs, 0, 1).reshape(b, tp, nkv, g, d)
    lse = jnp.moveaxis(lses, 0, 3).reshape(b, nkv, g, tp)
    return out, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _blockwise(q5, k, v, q_seg, kv_seg, offset, static):
    return _blockwise_forward(q5, k, v, q_seg, kv_seg, offset, static)[0]


def _blockwise_fwd(q5, k, v, q_seg, kv_seg, offset, static):
    out, lse = _blockwise_forward(q5, k, v, q_seg, kv_seg, offset, static)
    return out, (q5, k, v, q_seg, kv_seg, offset, out, lse)


def _blockwise_bwd(static, res, d_out):
    """Flash-attention backward: per key block j (a scan), a loop over the query blocks that see it
    recomputes p = exp(s - lse) and accumulates dk_j, dv_j; dq is accumulated in place."""
    scaling, dtype, causal, bq, bk = static
    q5, k, v, q_seg, kv_seg, offset, out, lse = res
    b, tp, nkv, g, d = q5.shape
    nqb, nkb = tp // bq, k.shape[1] // bk
    d_out = d_out.astype(dtype)
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out.astype(_F32), out.astype(_F32))  # rowsum(dO * O)

    def key_block(dq, j):
        k_blk, v_blk = _slice(k, j * bk, bk).astype(dtype), _slice(v, j * bk, bk).astype(dtype)
        kv_seg_blk, kv_pos = _slice(kv_seg, j * bk, bk), j * bk + jnp.arange(bk)

        def query_block(i, carry):
            dq, dk, dv = carry
            q_blk, do_blk = _slice(q5, i * bq, bq).astype(dtype), _slice(d_out, i * bq, bq)
            vis = _visible(_slice(q_seg, i * bq, bq), kv_seg_blk, i * bq + jnp.arange(bq), kv_pos, offset, causal)
            s = _scores(q_blk, k_blk, scaling, dtype)
            p = jnp.where(vis[:, None, None], jnp.exp(s - _slice(lse, i * bq, bq, axis=3)[..., None]), 0.0)
            dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p.astype(dtype), do_blk, preferred_element_type=_F32)
            dp = jnp.einsum("bqkgd,bskd->bkgqs", do_blk, v_blk, preferred_element_type=_F32)
            ds = (p * (dp - _slice(delta, i * bq, bq, axis=3)[..., None]) * scaling).astype(dtype)
            dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, q_blk, preferred_element_type=_F32)
            dq_blk = jnp.einsum("bkgqs,bskd->bqkgd", ds, k_blk, preferred_element_type=_F32)
            dq = jax.lax.dynamic_update_slice_in_dim(dq, _slice(dq, i * bq, bq) + dq_blk, i * bq, 1)
            return dq, dk, dv

        zeros = jnp.zeros((b, bk, nkv, d), _F32)
        dq, dk, dv = jax.lax.fori_loop(_first_q_block(j, bq, bk, nqb, offset, causal), nqb, query_block,
                                       (dq, zeros, zeros))
        return dq, (dk, dv)

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(q5.shape, _F32), jnp.arange(nkb))
    dk = jnp.moveaxis(dk, 0, 1).reshape(k.shape)
    dv = jnp.moveaxis(dv, 0, 1).reshape(v.shape)
    return dq.astype(q5.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_blockwise.defvjp(_blockwise_fwd, _blockwise_bwd)


def blockwise_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array,
                        kv_segment_ids: jax.Array, offset: jax.Array | int = 0, *, scaling: float,
                        dtype: Any = None, causal: bool = True, block_q: int = 512,
                        block_kv: int = 512) -> jax.Array:
    """Flash attention in pure JAX (online softmax over key blocks; custom VJP that recomputes).

    Args:
      q: [B, T, nq, d]; k, v: [B, S, nkv, d] (nq a multiple of nkv).
      q_segment_ids: int [B, T]; kv_segment_ids: int [B, S] (0 = padding); see the module docstring.
      offset: int scalar (may be traced), the slot of query 0: query t sees slots s <= t + offset.
      scaling: the score scale (head_dim**-0.5).
      dtype: compute dtype (default q.dtype); causal: apply the s <= t + offset rule.
      block_q / block_kv: rows per query / key block (clipped to T / S); T and S are padded to a
        multiple of the block inside.

    Returns:
      [B, T, nq, d] in ``dtype``; rows with no visible key (padding queries) are 0.

    Memory: the forward keeps one [B, nq, block_q, block_kv] score block live; the backward
    recomputes the probabilities block by block from the saved output and fp32 log-sum-exp
    [B, nq, T]. Key blocks entirely above the diagonal are skipped (a loop bounded per block).
    """
    q_seg, kv_seg = _check_qkv(q, k, v, q_segment_ids, kv_segment_ids)
    offset = _int_scalar(offset, "offset")
    if block_q < 1 or block_kv < 1:
        raise ValueError(f"block sizes must be positive, got block_q={block_q}, block_kv={block_kv}")
    dtype = jnp.dtype(dtype or q.dtype)
    b, t, nq, d = q.shape
    s, nkv = k.shape[1], k.shape[2]
    bq, bk = min(block_q, t), min(block_kv, s)
    tp, sp = _round_up(t, bq), _round_up(s, bk)
    q5 = _pad_axis(q, 1, tp).reshape(b, tp, nkv, nq // nkv, d)
    out = _blockwise(q5, _pad_axis(k, 1, sp), _pad_axis(v, 1, sp), _pad_axis(q_seg, 1, tp),
                     _pad_axis(kv_seg, 1, sp), offset, (float(scaling), dtype, bool(causal), bq, bk))
    return out.reshape(b, tp, nq, d)[:, :t]


# ============================================================================ decode
DECODE_BLOCK_KV = 512   # cache slots per key block of a decode step (its reads are whole blocks)


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_mask: jax.Array,
                     filled: jax.Array | int, *, scaling: float, dtype: Any = None,
                     layer: jax.Array | int | None = None, block_kv: int = DECODE_BLOCK_KV,
                     kernel: str = "xla") -> jax.Array:
    """One query per row against the filled prefix of a KV cache, block by block.

    Args:
      q: [B, 1, nq, d], the query of the token at slot ``filled - 1``.
      k_cache, v_cache: [B, S, nkv, d], or a layer stack [L, B, S, nkv, d] read at ``layer``.
      kv_mask: bool or int [B, S], nonzero where the slot holds a real token (the cache's kv_mask).
      filled: int scalar (may be traced): the query sees slots s < filled with kv_mask[b, s].
      scaling, dtype: as `blockwise_attention`.
      layer: index into a layer stack (None: k_cache is one layer).
      block_kv: slots per block (clipped to S).
      kernel: "xla" (a pure-JAX block loop: CPU, GPU) | "pallas" (`models.decode_kernel`: the
        TPU kernel that keeps the scores on chip) | "pallas_interpret" (it, off TPU: tests).

    Returns:
      [B, 1, nq, d] in ``dtype`` (0 for a row with no visible slot).

    Only the ceil(filled / block_kv) blocks that hold filled slots are read (a while loop; the
    last block of a cache whose S is not a multiple of the block is read shifted back so that it
    stays in bounds, its already-read slots masked). Forward only (the loop bound is traced).
    """
    b, _, nq, d = q.shape
    out, _ = _decode_stats(q, k_cache, v_cache, kv_mask, filled, scaling=scaling, dtype=dtype,
                           layer=layer, block_kv=block_kv, kernel=kernel)
    return out.reshape(b, 1, nq, d).astype(jnp.dtype(dtype or q.dtype))


def decode_attention_shared_prefix(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                                   kv_mask: jax.Array, filled: jax.Array | int,
                                   prefix_k: jax.Array, prefix_v: jax.Array, prefix_mask: jax.Array,
                                   *, scaling: float, dtype: Any = None,
                                   layer: jax.Array | int | None = None,
                                   block_kv: int = DECODE_BLOCK_KV, kernel: str = "xla") -> jax.Array:
    """`decode_attention` for rows whose keys are a prefix SHARED by groups of rows followed by
    each row's own slots (a prompt and its G samples' completions): cascade attention. The
    prefix is read once per group, its G x nq queries together (G x nq / nkv query rows per KV
    head), the own slots once per row, and the two softmaxes are merged by their log-sum-exps.

    Args:
      q: [N, 1, nq, d], N = B x G rows, rows [g*G, (g+1)*G) sharing prefix g.
      k_cache, v_cache, kv_mask, filled: the rows' own slots, as `decode_attention` ([N, S, ...]
        or a layer stack [L, N, S, ...]).
      prefix_k, prefix_v: [B, P, nkv, d] or a layer stack [L, B, P, nkv, d]; prefix_mask [B, P]:
        every query sees every real prefix slot.
      scaling, dtype, layer, block_kv, kernel: as `decode_attention` (``layer`` indexes both
        stacks).

    Returns [N, 1, nq, d] in ``dtype``: what `decode_attention` gives on each row's prefix and
    own slots laid end to end, up to rounding. The prefix's block loop unrolls when ``filled`` is
    a Python int (the dry run's cost model), as the own slots' does.
    """
    n, _, nq, d = q.shape
    b, p, nkv = prefix_k.shape[-4], prefix_k.shape[-3], prefix_k.shape[-2]
    if n % b or prefix_mask.shape != (b, p):
        raise ValueError(f"{n} rows do not split into groups over the {b} prefixes of {prefix_k.shape} "
                         f"(prefix_mask {prefix_mask.shape})")
    gs, g = n // b, nq // nkv
    own, own_lse = _decode_stats(q, k_cache, v_cache, kv_mask, filled, scaling=scaling, dtype=dtype,
                                 layer=layer, block_kv=block_kv, kernel=kernel)  # [N, nkv, g, d]
    # a group's queries as the query heads of one row, kv-head major: [B, 1, nkv * G * g, d]
    qg = jnp.transpose(q.reshape(b, gs, nkv, g, d), (0, 2, 1, 3, 4)).reshape(b, 1, nkv * gs * g, d)
    # the prefix is read whole; its block loop unrolls or loops as the own slots' does
    whole = filled * 0 + p if isinstance(filled, jax.core.Tracer) else p
    pre, pre_lse = _decode_stats(qg, prefix_k, prefix_v, prefix_mask, whole, scaling=scaling,
                                 dtype=dtype, layer=layer, block_kv=block_kv,
                                 kernel=kernel)                                  # [B, nkv, G*g, d]
    pre = jnp.transpose(pre.reshape(b, nkv, gs, g, d), (0, 2, 1, 3, 4)).reshape(n, nkv, g, d)
    pre_lse = jnp.transpose(pre_lse.reshape(b, nkv, gs, g), (0, 2, 1, 3)).reshape(n, nkv, g)
    m = jnp.maximum(own_lse, pre_lse)
    w_own, w_pre = jnp.exp(own_lse - m), jnp.exp(pre_lse - m)
    out = (own * w_own[..., None] + pre * w_pre[..., None]) / (w_own + w_pre)[..., None]
    return out.reshape(n, 1, nq, d).astype(jnp.dtype(dtype or q.dtype))


def _decode_stats(q, k_cache, v_cache, kv_mask, filled, *, scaling, dtype, layer, block_kv,
                  kernel="xla"):
    """The block loop of `decode_attention` (same arguments): (out fp32 [B, nkv, g, d], log-sum-exp
    fp32 [B, nkv, g]; `_MASK_VALUE` for a row with no visible slot, whose out is 0). ``kernel``:
    "xla" (this pure-JAX loop), "pallas" (`models.decode_kernel`, the TPU kernel) or
    "pallas_interpret" (that kernel in Pallas interpret mode: tests off TPU)."""
    if (layer is None) != (k_cache.ndim == 4):
        raise ValueError(f"k_cache of shape {k_cache.shape} needs layer={'None' if k_cache.ndim == 4 else 'an index'}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    b, s, nkv, d = k_cache.shape[-4:]
    if q.ndim != 4 or q.shape[0] != b or q.shape[1] != 1 or q.shape[3] != d or q.shape[2] % nkv:
        raise ValueError(f"q must be [B, 1, nq, d] with B={b}, d={d}, nq a multiple of {nkv}; got {q.shape}")
    if kv_mask.shape != (b, s):
        raise ValueError(f"kv_mask must be [B, S] = {(b, s)}, got {kv_mask.shape}")
    static = not isinstance(filled, jax.core.Tracer)   # a cost model of one step: the loop unrolls
    if not static:
        filled = _int_scalar(filled, "filled")
    dtype = jnp.dtype(dtype or q.dtype)
    nq = q.shape[2]
    g = nq // nkv
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"decode kernel {kernel!r}; valid: {list(DECODE_KERNELS)}")
    if kernel != "xla":
        from models import decode_kernel  # local: Pallas only where the kernel runs
        return decode_kernel.decode_stats(q.reshape(b, nkv, g, d), k_cache, v_cache, kv_mask,
                                          filled, scaling=scaling, dtype=dtype, layer=layer,
                                          block_kv=block_kv, interpret=kernel == "pallas_interpret")
    bk = min(block_kv, s)
    q5 = q.reshape(b, 1, nkv, g, d)
    lead = () if layer is None else (layer,)

    def read(cache, start):  # -> [B, bk, nkv, d]
        block = jax.lax.dynamic_slice(cache, (*lead, 0, start, 0, 0), (*(1,) * len(lead), b, bk, nkv, d))
        return block.reshape(b, bk, nkv, d)

    # The caches ride in the loop's carry, unchanged: a buffer that a while loop only closes
    # over is copied by XLA when it is also the program's (donated, updated) output, i.e. the
    # whole cache once per decode step; a pass-through carry element is aliased instead.
    def key_block(j, carry):
        stats, (kc, vc) = carry
        start = jnp.minimum(j * bk, s - bk)  # the last block is shifted back into bounds
        pos = start + jnp.arange(bk)
        vis = (_slice(kv_mask, start, bk) != 0) & (pos >= j * bk)[None] & (pos < filled)[None]  # [B, bk]
        sc = _scores(q5, read(kc, start), scaling, dtype)
        return _online_softmax_step(stats, sc, vis[:, None, None, None, :], read(vc, start), dtype), (kc, vc)

    init = (jnp.full((b, nkv, g, 1), _MASK_VALUE, _F32), jnp.zeros((b, nkv, g, 1), _F32),
            jnp.zeros((b, nkv, g, 1, d), _F32))
    carry = (init, (k_cache, v_cache))
    if static:  # unrolled, so that XLA's cost analysis counts every block (it counts a loop body once)
        for j in range(min(max((int(filled) + bk - 1) // bk, 0), -(-s // bk))):
            carry = key_block(j, carry)
        stats = carry[0]
    else:
        num_blocks = jnp.clip((filled + bk - 1) // bk, 0, -(-s // bk))
        stats, _ = jax.lax.fori_loop(0, num_blocks, key_block, carry)
    out, lse = _finish(*stats)
    lse = jnp.where(stats[1] > 0, lse, _MASK_VALUE)
    return out.reshape(b, nkv, g, d), lse.reshape(b, nkv, g)


# ============================================================================ paged cache
def _page_slots(page_table: jax.Array, start: jax.Array, t: int, page_size: int):
    """(page int32 [B, T], offset int32 [B, T], in_table bool [B, T]) of slots start[b] + 0..T-1."""
    pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    index = pos // page_size
    in_table = index < page_table.shape[1]
    page = jnp.take_along_axis(page_table, jnp.minimum(index, page_table.shape[1] - 1), axis=1)
    return page, pos % page_size, in_table


def _page_shards(batch: int, nkv: int, num_pages: int):
    """How a paged op splits under the tracing mesh: None without a mesh (or with nothing to
    split), else (mesh, batch axes, head axis, row shards) as `kernel_mesh.row_split` splits
    the Pallas kernels. Rows AND the pool's pages are split over the batch axes, KV heads over
    'tensor': each device holds its rows' pages, and a row's page ids index the pages of its own
    shard (`ace_jax.runtime.engine.Engine` keeps a free list per shard)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    batch_axes, head_axis, shards = row_split(mesh, batch, nkv)
    if batch_axes is None and head_axis is None:
        return None
    if num_pages % shards:
        raise ValueError(f"a page pool of {num_pages} pages does not split over the {shards} row "
                         f"shards of mesh axes {batch_axes}: make engine.num_pages a multiple")
    return mesh, batch_axes, head_axis, shards


def _on_page_shards(local, batch: int, nkv: int, num_pages: int, args, kinds, out_kinds):
    """``local(*args)``, per shard under the tracing mesh (`_page_shards`) or as is. ``kinds``
    / ``out_kinds`` name each operand's split: "pool" [L, P, nkv, page, d], "heads" [B, T, H, d]
    (H over the head axis), "stats" [B, nkv, ...], "rows" [B, ...], "entries" [Pn, ...] (the
    shared prefixes: over the batch axes as the rows), "all" (replicated)."""
    split = _page_shards(batch, nkv, num_pages)
    if split is None:
        return local(*args)
    mesh, rows, heads, shards = split
    for x, kind in zip(args, kinds):
        if kind == "entries" and x.shape[0] % shards:
            raise ValueError(f"{x.shape[0]} shared prefixes do not split over the {shards} row "
                             f"shards of mesh axes {rows}: make engine.shared_prefixes a multiple")
    P = jax.sharding.PartitionSpec
    specs = dict(pool=P(None, rows, heads), heads=P(rows, None, heads), stats=P(rows, heads),
                 rows=P(rows), entries=P(rows), all=P())
    return jax.shard_map(local, mesh=mesh, check_vma=False,
                         in_specs=tuple(specs[k] for k in kinds),
                         out_specs=tuple(specs[k] for k in out_kinds))(*args)


def paged_write(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, layer,
                page_table: jax.Array, start: jax.Array, valid: jax.Array):
    """Writes the keys / values of T new tokens per row into a page pool.

    Args:
      k_pages, v_pages: a layer stack's pool [L, num_pages, nkv, page_size, d].
      k, v: [B, T, nkv, d], token t of row b going to the row's slot ``start[b] + t``, i.e. page
        ``page_table[b, (start[b] + t) // page_size]`` at offset ``(start[b] + t) % page_size``.
      layer: int scalar (may be traced), the layer of the stack.
      page_table: int32 [B, pages_per_row] page ids.
      start: int32 [B], the slots already filled in each row.
      valid: bool or int [B, T], nonzero for real tokens; the others (and slots past the page
        table) are not written.

    Returns the updated (k_pages, v_pages). Rows must not share the pages they write into (the
    engine copies a shared partial page before a row writes to it). Under a mesh the pool's
    pages are split with the rows (`_page_shards`): page ids are each shard's own.
    """
    layer = jnp.asarray(layer, jnp.int32)
    return _on_page_shards(_paged_write_local, k.shape[0], k.shape[2], k_pages.shape[1],
                           (k_pages, v_pages, k, v, layer, page_table, start, valid),
                           ("pool", "pool", "heads", "heads", "all", "rows", "rows", "rows"),
                           ("pool", "pool"))


def _paged_write_local(k_pages, v_pages, k, v, layer, page_table, start, valid):
    num_pages, page_size = k_pages.shape[1], k_pages.shape[3]
    page, offset, in_table = _page_slots(page_table, start, k.shape[1], page_size)
    if k.shape[1] == 1:
        return _write_rows_in_place(k_pages, v_pages, k, v, layer, page[:, 0], offset[:, 0],
                                    (valid[:, 0] != 0) & in_table[:, 0])
    page = jnp.where((valid != 0) & in_table, page, num_pages)    # out of bounds: dropped
    # one scatter per KV head (each update a row of d): one of all heads at once, a strided
    # [nkv, d] window, makes the TPU compiler convert the pool to a heads-minor layout and back
    for h in range(k_pages.shape[2]):
        k_pages = k_pages.at[layer, page, h, offset].set(k[:, :, h].astype(k_pages.dtype),
                                                         mode="drop")
        v_pages = v_pages.at[layer, page, h, offset].set(v[:, :, h].astype(v_pages.dtype),
                                                         mode="drop")
    return k_pages, v_pages


def _write_rows_in_place(k_pages, v_pages, k, v, layer, page, offset, write):
    """A decode step's write: row b's one token into slot ``offset[b]`` of page ``page[b]``
    (where ``write[b]``; elsewhere the slot keeps its value), one ``dynamic_update_slice`` per
    row and KV head. The pools are updated in place and each write moves one slot: XLA's cost
    analysis counts a scatter's whole operand (the pool), the dry run's decode cost reads it.
    (One update of a row's nkv heads at once, a strided [nkv, 1, d] slice, makes the TPU
    compiler convert the whole pool to a heads-minor layout and back around it.)"""
    pools = []
    for pool, new in ((k_pages, k), (v_pages, v)):
        _, _, nkv, _, d = pool.shape
        new = new.astype(pool.dtype).reshape(-1, nkv, 1, 1, 1, 1, d)  # [B, nkv, 1, 1, 1, 1, d]
        for b in range(new.shape[0]):
            for h in range(nkv):
                at = (layer, page[b], h, offset[b], 0)
                old = jax.lax.dynamic_slice(pool, at, (1, 1, 1, 1, d))
                pool = jax.lax.dynamic_update_slice(pool, jnp.where(write[b], new[b, h], old), at)
        pools.append(pool)
    return tuple(pools)


def paged_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer,
                    page_table: jax.Array, start: jax.Array, *, scaling: float, dtype: Any = None,
                    block_slots: int = 512, kernel: str = "xla",
                    read_pages: int | None = None) -> jax.Array:
    """T queries per row against the row's pages of a paged cache (after `paged_write`).

    Args:
      q: [B, T, nq, d]; query t of row b sits at slot ``start[b] + t`` and sees the row's slots
        s <= start[b] + t (the cache's earlier tokens and the chunk's causal prefix).
      k_pages, v_pages: [L, num_pages, nkv, page_size, d]; layer: the stack index (may be traced).
      page_table: int32 [B, pages_per_row]; start: int32 [B].
      scaling, dtype: as `blockwise_attention`.
      block_slots: slots read per step of the loop (rounded to whole pages).
      kernel: as `decode_attention`'s; "pallas" / "pallas_interpret" run
        `models.decode_kernel.paged_decode_stats` (the TPU kernel: several pages per grid step,
        each read in place by its page id), a decode step (T == 1) or a prefill chunk (T > 1,
        causal within it); "xla" the page loop.
      read_pages: None, or a static bound on the pages any row reads: only the first
        ``read_pages`` columns of the table are read, so the kernel's grid and its declared cost
        cover those (`qwen3.PagedKVCache.read_pages`; the caller promises the bound).

    Returns [B, T, nq, d] in ``dtype``. Reads only the blocks of pages up to the largest row's
    last visible slot (a ``fori_loop`` with a traced bound; forward only), each block gathered
    from the pool by page id. Same numerics as `decode_attention`.
    """
    b, t, nq, d = q.shape
    local = functools.partial(_paged_stats, scaling=scaling, dtype=dtype, block_slots=block_slots,
                              kernel=kernel, read_pages=read_pages)
    out, _ = _on_page_shards(local, b, k_pages.shape[2], k_pages.shape[1],
                             (q, k_pages, v_pages, jnp.asarray(layer, jnp.int32), page_table, start),
                             ("heads", "pool", "pool", "all", "rows", "rows"),
                             ("stats", "stats"))                            # [B, nkv, g, T, d]
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(b, t, nq, d).astype(jnp.dtype(dtype or q.dtype))


def paged_attention_shared_prefix(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, layer,
                                  page_table: jax.Array, start: jax.Array,
                                  prefix_table: jax.Array, prefix_lengths: jax.Array,
                                  prefix_rows: jax.Array, *, scaling: float, dtype: Any = None,
                                  block_slots: int = 512, kernel: str = "xla",
                                  read_pages: int | None = None) -> jax.Array:
    """`paged_attention` of a decode step (T == 1) for rows that share the first pages of their
    tables (a prompt's full pages, shared by its samples): cascade attention over pages. Each
    prefix's pages are read ONCE for the queries of all its rows, each row's own pages (from the
    end of its prefix on) once per row, and the two softmaxes merged by their log-sum-exps; the
    per-row paged kernel would read a prompt's pages once per sample.

    Args:
      q, k_pages, v_pages, layer, page_table, start, scaling, dtype, block_slots, kernel: as
        `paged_attention` with T == 1 (a row's table lists its prefix's pages first).
      read_pages: as `paged_attention`'s, for each row's own pages (past its prefix); a row in
        no prefix reads that many of its table. The prefixes' reads are ``prefix_table``'s width.
      prefix_table: int32 [Pn, prefix_pages], each prefix's pages.
      prefix_lengths: int32 [Pn], each prefix's slots: a whole number of pages, the first
        ``prefix_lengths[p] // page_size`` entries of each of its rows' tables (0: an unused
        entry).
      prefix_rows: int32 [Pn, Gp], the rows sharing prefix p (-1: none); a row in at most one
        prefix. A row in none reads its whole table as `paged_attention` does.

    Returns [B, 1, nq, d] in ``dtype``: `paged_attention`'s, up to rounding. Under a mesh the
    prefixes are split with the rows and pages (`_page_shards`): entry e of shard i holds that
    shard's page ids and row indices.
    """
    b, t, nq, d = q.shape
    pn = prefix_rows.shape[0]
    if t != 1 or prefix_table.shape[0] != pn or prefix_lengths.shape != (pn,):
        raise ValueError(f"paged_attention_shared_prefix: q {q.shape} (one token per row), "
                         f"prefix_table {prefix_table.shape}, prefix_lengths {prefix_lengths.shape} "
                         f"and prefix_rows {prefix_rows.shape} do not agree")
    local = functools.partial(_cascade_local, scaling=scaling, dtype=dtype,
                              block_slots=block_slots, kernel=kernel, read_pages=read_pages)
    out, = _on_page_shards(local, b, k_pages.shape[2], k_pages.shape[1],
                           (q, k_pages, v_pages, jnp.asarray(layer, jnp.int32), page_table, start,
                            prefix_table, prefix_lengths, prefix_rows),
                           ("heads", "pool", "pool", "all", "rows", "rows", "entries", "entries",
                            "entries"), ("heads",))
    return out


def _cascade_local(q, k_pages, v_pages, layer, page_table, start, prefix_table, prefix_lengths,
                   prefix_rows, *, scaling, dtype, block_slots, kernel, read_pages):
    """`paged_attention_shared_prefix` on one shard (or one device) -> ([B, 1, nq, d],)."""
    b, _, nq, d = q.shape
    nkv, page_size = k_pages.shape[2:4]
    pn, gp = prefix_rows.shape
    g = nq // nkv
    rows = jnp.where(prefix_rows >= 0, prefix_rows, b).reshape(-1)          # -1 -> dropped
    shared = jnp.zeros((b,), jnp.int32).at[rows].set(
        jnp.repeat(prefix_lengths.astype(jnp.int32), gp), mode="drop")     # [B] prefix slots
    # each row's own slots: its table from the end of its prefix on
    pages = page_table.shape[1]
    shift = jnp.arange(pages, dtype=jnp.int32)[None, :] + (shared // page_size)[:, None]
    own_table = jnp.take_along_axis(page_table, jnp.minimum(shift, pages - 1), axis=1)
    kw = dict(scaling=scaling, dtype=dtype, block_slots=block_slots, kernel=kernel)
    own, own_lse = _paged_stats(q, k_pages, v_pages, layer, own_table, start - shared,
                                read_pages=read_pages, **kw)
    # a prefix's rows' queries as the query heads of one row, kv-head major: [Pn, 1, nkv*Gp*g, d]
    qg = q[jnp.minimum(rows, b - 1), 0].reshape(pn, gp, nkv, g, d)
    qg = jnp.transpose(qg, (0, 2, 1, 3, 4)).reshape(pn, 1, nkv * gp * g, d)
    pre, pre_lse = _paged_stats(qg, k_pages, v_pages, layer, prefix_table,
                                prefix_lengths.astype(jnp.int32) - 1, read_pages=None, **kw)
    pre = jnp.transpose(pre.reshape(pn, nkv, gp, g, d), (0, 2, 1, 3, 4)).reshape(pn * gp, nkv, g, d)
    pre_lse = jnp.transpose(pre_lse.reshape(pn, nkv, gp, g), (0, 2, 1, 3)).reshape(pn * gp, nkv, g)
    pre = jnp.zeros((b, nkv, g, d), _F32).at[rows].set(pre, mode="drop")
    pre_lse = jnp.full((b, nkv, g), _MASK_VALUE, _F32).at[rows].set(pre_lse, mode="drop")
    own, own_lse = own[:, :, :, 0], own_lse[..., 0]
    m = jnp.maximum(own_lse, pre_lse)
    w_own, w_pre = jnp.exp(own_lse - m), jnp.exp(pre_lse - m)
    out = (own * w_own[..., None] + pre * w_pre[..., None]) / (w_own + w_pre)[..., None]
    return (out.reshape(b, 1, nq, d).astype(jnp.dtype(dtype or q.dtype)),)


def _paged_stats(q, k_pages, v_pages, layer, page_table, start, *, scaling, dtype, block_slots,
                 kernel, read_pages=None):
    """The softmax statistics of `paged_attention` (same arguments) on one shard (or device):
    (out fp32 [B, nkv, g, T, d], log-sum-exp fp32 [B, nkv, g, T]; `_MASK_VALUE` where a query
    sees no slot, its out 0)."""
    if read_pages is not None:
        if read_pages < 1:
            raise ValueError(f"read_pages must be >= 1 (a bound on the pages a row reads), got {read_pages}")
        page_table = page_table[:, :read_pages]
    b, t, nq, d = q.shape
    _, _, nkv, page_size, _ = k_pages.shape
    if nq % nkv or k_pages.shape != v_pages.shape or page_table.shape[0] != b or start.shape != (b,):
        raise ValueError(f"paged_attention: q {q.shape}, pages {k_pages.shape} / {v_pages.shape}, "
                         f"page_table {page_table.shape}, start {start.shape} do not agree")
    dtype = jnp.dtype(dtype or q.dtype)
    g = nq // nkv
    if kernel not in DECODE_KERNELS:
        raise ValueError(f"decode kernel {kernel!r}; valid: {list(DECODE_KERNELS)}")
    if kernel != "xla":   # the kernel, a row's T tokens as T x g query rows per KV head, t major
        from models import decode_kernel  # local: Pallas only where the kernel runs
        qk = jnp.transpose(q.reshape(b, t, nkv, g, d), (0, 2, 1, 3, 4)).reshape(b, nkv, t * g, d)
        out, lse = decode_kernel.paged_decode_stats(
            qk, k_pages, v_pages, page_table, start + t, layer, scaling=scaling, dtype=dtype,
            interpret=kernel == "pallas_interpret", queries=t)
        return (jnp.swapaxes(out.reshape(b, nkv, t, g, d), 2, 3),
                jnp.swapaxes(lse.reshape(b, nkv, t, g), 2, 3))
    pages_per_block = max(1, min(block_slots // page_size, page_table.shape[1]))
    blocks = -(-page_table.shape[1] // pages_per_block)
    table = _pad_axis(page_table, 1, blocks * pages_per_block)
    bk = pages_per_block * page_size
    q5 = q.reshape(b, t, nkv, g, d)
    last = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]        # [B, T]

    def read(pool, ids):  # [B, pages_per_block, nkv, page_size, d] -> [B, bk, nkv, d]
        return jnp.swapaxes(pool[layer, ids], 2, 3).reshape(b, bk, nkv, d)

    def key_block(j, carry):  # the pools ride in the carry unchanged (see decode_attention)
        stats, (kp, vp) = carry
        ids = jax.lax.dynamic_slice_in_dim(table, j * pages_per_block, pages_per_block, axis=1)
        pos = j * bk + jnp.arange(bk, dtype=jnp.int32)
        vis = pos[None, None, :] <= last[:, :, None]                        # [B, T, bk]
        sc = _scores(q5, read(kp, ids), scaling, dtype)
        return _online_softmax_step(stats, sc, vis[:, None, None], read(vp, ids), dtype), (kp, vp)

    init = (jnp.full((b, nkv, g, t), _MASK_VALUE, _F32), jnp.zeros((b, nkv, g, t), _F32),
            jnp.zeros((b, nkv, g, t, d), _F32))
    num_blocks = jnp.clip(jnp.max(last) // bk + 1, 0, blocks)
    stats, _ = jax.lax.fori_loop(0, num_blocks, key_block, (init, (k_pages, v_pages)))
    out, lse = _finish(*stats)                                              # [B, nkv, G, T, d]
    return out, jnp.where(stats[1] > 0, lse, _MASK_VALUE)


# ============================================================================ splash (Pallas TPU)
def _splash_local(q, k, v, q_seg, kv_seg, *, offset: int, block_q: int, block_kv: int, interpret: bool):
    """The kernel on one device's shard: q [B, nq, Tp, d] (pre-scaled), k / v [B, nkv, Sp, d],
    segment ids [B, Tp] / [B, Sp] -> [B, nq, Tp, d]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

    nq, tp, sp = q.shape[1], q.shape[2], k.shape[2]
    causal = mask_lib.CausalMask((tp, sp), offset=offset)
    mask = mask_lib.MultiHeadMask([causal] * nq)
    blocks = kernel_lib.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                                   block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                                   block_q_dq=block_q, block_kv_dq=block_kv)
    kernel = kernel_lib.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                        interpret=interpret)
    return jax.vmap(kernel)(q, k, v, kernel_lib.SegmentIds(q=q_seg, kv=kv_seg))


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array,
                     kv_segment_ids: jax.Array, offset: int = 0, *, scaling: float, dtype: Any = None,
                     block_q: int = 512, block_kv: int = 512, interpret: bool = False) -> jax.Array:
    """Causal GQA attention with the Pallas TPU splash kernel (``make_splash_mha``).

    Args:
      q, k, v, q_segment_ids, kv_segment_ids: as `blockwise_attention`.
      offset: a CONCRETE int >= 0 (the kernel's causal mask is static): query t sees s <= t + offset.
      scaling: applied to q before the kernel (which does not scale).
      dtype: compute dtype (default q.dtype).
      block_q / block_kv: kernel tiles (multiples of 128, clipped to the padded lengths); T and S
        are padded to a multiple of the tile inside (padding slots get segment id 0).
      interpret: run the kernel in Pallas interpret mode (required off TPU; tests on CPU).

    Returns:
      [B, T, nq, d] in ``dtype``. Padding query rows attend among the padding keys (the kernel
      needs a visible key in every row; left padding provides it), finite garbage.

    Under a mesh (``jax.sharding.get_abstract_mesh()`` non-empty, e.g. traced inside
    ``jax.set_mesh(mesh)``) the kernel runs in ``jax.shard_map``: batch over the axes of
    ('data', 'fsdp', 'expert') that divide B (greedy), heads over 'tensor' if it divides nkv;
    without a mesh it is called directly.
    """
    q_seg, kv_seg = _check_qkv(q, k, v, q_segment_ids, kv_segment_ids)
    if isinstance(offset, jax.core.Tracer) or not isinstance(offset, (int, np.integer)) or offset < 0:
        raise TypeError(f"splash_attention needs a concrete int offset >= 0 (a static mask), got {offset!r}")
    if block_q % _SPLASH_LANES or block_kv % _SPLASH_LANES or block_q < 1 or block_kv < 1:
        raise ValueError(f"splash block sizes must be positive multiples of {_SPLASH_LANES}, "
                         f"got block_q={block_q}, block_kv={block_kv}")
    dtype = jnp.dtype(dtype or q.dtype)
    b, t, nq, d = q.shape
    s, nkv = k.shape[1], k.shape[2]
    bq = min(block_q, _round_up(t, _SPLASH_LANES))
    bk = min(block_kv, _round_up(s, _SPLASH_LANES))
    tp, sp = _round_up(t, bq), _round_up(s, bk)
    q_t = jnp.swapaxes(_pad_axis((q.astype(dtype) * scaling).astype(dtype), 1, tp), 1, 2)  # [B, nq, Tp, d]
    k_t = jnp.swapaxes(_pad_axis(k.astype(dtype), 1, sp), 1, 2)
    v_t = jnp.swapaxes(_pad_axis(v.astype(dtype), 1, sp), 1, 2)
    q_seg, kv_seg = _pad_axis(q_seg, 1, tp), _pad_axis(kv_seg, 1, sp)
    local = functools.partial(_splash_local, offset=int(offset), block_q=bq, block_kv=bk, interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        batch_axes, head_axis = mesh_specs(mesh, b, nkv)
        P = jax.sharding.PartitionSpec
        heads, segs = P(batch_axes, head_axis, None, None), P(batch_axes, None)
        local = jax.shard_map(local, mesh=mesh, in_specs=(heads, heads, heads, segs, segs), out_specs=heads,
                              check_vma=False)
    out = local(q_t, k_t, v_t, q_seg, kv_seg)
    return jnp.swapaxes(out, 1, 2)[:, :t].astype(dtype)
