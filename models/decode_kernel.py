"""A Pallas TPU kernel for one decode step's attention: a query block per row against the filled
blocks of a KV cache, the scores kept on chip.

`decode_stats` computes what `models.attention._decode_stats` computes (the pure-JAX block loop,
the reference and the CPU / GPU path): for each row b and KV head h, the R query vectors that
share that KV head (R = nq / nkv for a row's own slots; G x nq / nkv for a prefix shared by a
group of G rows, cascade attention) against the row's filled cache slots, with an online softmax;
it returns the normalised output and the log-sum-exp, which cascade attention needs to merge the
prefix's softmax with the own slots'.

Why a kernel: XLA's fusions of the pure-JAX loop write each block's scores to HBM and read them
back; with the 64 query rows per KV head of a group's prefix the scores of a block (fp32) weigh as
much as its keys and values. Here a grid step (row b, key block j) DMAs the block's K and V
([nkv, bk, d] each: the cache read heads before slots, so one KV head is not padded to two by
the TPU's tiling) into VMEM, and its scores, probabilities and running statistics never leave
it. The kernel declares its cost (``pl.CostEstimate``), which XLA's cost analysis reads in place
of a custom call's operand sizes: the K / V blocks it DMAs (the filled ones: the key block index
is clamped to the last filled block, and Pallas does not copy a block again when consecutive grid
steps map to the same one), its queries, mask and outputs; FLOPs 4 x R x d per key and KV head.
With a traced fill (the rollout's loop) the grid covers the whole cache and the declared cost is
its upper bound; the dry run's cost model passes a concrete fill, and the figure is exact.

Numerics equal the reference's block loop: scores accumulated in fp32, rounded to ``dtype`` and
scaled in ``dtype``; the unnormalised probabilities exp(s - running max) rounded to ``dtype``
before p.v (fp32 accumulation); masked keys contribute exactly 0; a row with no visible key gets
out 0 and log-sum-exp ``MASK_VALUE``.

Shapes: q [B, nkv, R, d] (KV-head major); k_cache / v_cache [B, S, nkv, d] or a layer stack
[L, B, S, nkv, d] read at ``layer``; kv_mask [B, S] (nonzero: a real token). Under a mesh the
kernel runs in ``jax.shard_map``, rows over the batch axes and KV heads over 'tensor' as
`models.attention.splash_attention` splits them; off TPU it runs in Pallas interpret mode
(``interpret=True``: the tests).

`paged_decode_stats` is the same online softmax over a PAGED cache (the rollout engine's:
`models.attention.paged_attention`), for a decode step or a prefill chunk (T tokens per row,
causal within it): grid (row, query tile, step over the row's table), a step reading several
pages, each DMA'd from the stacked pool by its id (scalar-prefetched page table, lengths, layer
and each tile's reach), on one device.
"""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from models.kernel_mesh import mesh_specs

__all__ = ["MASK_VALUE", "LANES", "PAGED_STEP_SLOTS", "decode_stats", "paged_decode_stats",
           "pages_per_step", "step_page", "declared_cost"]

MASK_VALUE = float(np.finfo(np.float32).min)   # as models.attention: a finite "minus infinity"
LANES = 128                                    # TPU lane width: the key block's multiple
PAGED_STEP_SLOTS = 512                         # slots a paged grid step reads (4 pages of 128)
PAGED_BLOCK_Q = 512                            # query rows a paged grid step holds (a prefill's tile)
_F32 = jnp.float32


def _block(s: int, block_kv: int) -> int:
    """Slots per key block: ``block_kv`` rounded down to the lane width, or S when S is smaller."""
    if s <= block_kv:
        return s
    return max(LANES, block_kv // LANES * LANES)


def declared_cost(b: int, nkv: int, r: int, d: int, blocks: int, bk: int, kv_itemsize: int,
                  q_itemsize: int) -> dict[str, int]:
    """The kernel's cost for ``blocks`` key blocks of ``bk`` slots per row (the filled ones):
    flops, transcendentals (one exp per score) and bytes (K and V blocks, queries, mask, outputs)."""
    keys = b * blocks * bk
    return dict(flops=4 * keys * nkv * r * d, transcendentals=keys * nkv * r,
                bytes_accessed=(2 * keys * nkv * d * kv_itemsize + b * nkv * r * d * q_itemsize
                                + keys * 4 + b * nkv * r * (d + LANES) * 4))


def _init(m_sc, l_sc, acc_sc):
    m_sc[...] = jnp.full(m_sc.shape, MASK_VALUE, _F32)
    l_sc[...] = jnp.zeros(l_sc.shape, _F32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)


def _accumulate(q_ref, k_ref, v_ref, visible, v_valid, m_sc, l_sc, acc_sc, *, nkv: int,
                scaling: float, dtype: Any):
    """One key block into the running statistics, per KV head: q_ref [nkv, R, d], k_ref / v_ref
    [nkv, bk, d] (heads before slots: a block of the cache, or a page of the paged pool),
    ``visible`` bool [1, bk] or [R, bk] (per query row); ``v_valid`` bool [bk, 1] or None (slots
    whose values are defined: a partial last block's tail is not)."""
    for h in range(nkv):
        k = k_ref[h].astype(dtype)                                         # [bk, d]
        v = v_ref[h].astype(dtype)
        if v_valid is not None:
            v = jnp.where(v_valid, v, jnp.zeros_like(v))
        sc = jax.lax.dot_general(q_ref[h].astype(dtype), k, (((1,), (1,)), ((), ())),
                                 preferred_element_type=_F32)               # [R, bk]
        sc = (sc.astype(dtype) * scaling).astype(_F32)
        sc = jnp.where(visible, sc, MASK_VALUE)
        m_prev = jnp.max(m_sc[h], axis=1, keepdims=True)                   # [R, 1]
        m_new = jnp.maximum(m_prev, jnp.max(sc, axis=1, keepdims=True))
        p = jnp.where(visible, jnp.exp(sc - m_new), 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_new = alpha * jnp.max(l_sc[h], axis=1, keepdims=True) + jnp.sum(p, axis=1, keepdims=True)
        pv = jnp.dot(p.astype(dtype), v, preferred_element_type=_F32)      # [R, d]
        acc_sc[h] = alpha * acc_sc[h] + pv
        m_sc[h] = jnp.broadcast_to(m_new, m_sc.shape[1:])
        l_sc[h] = jnp.broadcast_to(l_new, l_sc.shape[1:])


def _write(out_ref, lse_ref, m_sc, l_sc, acc_sc, *, nkv: int):
    for h in range(nkv):
        l = l_sc[h]                                                          # [R, LANES]
        seen = l > 0
        l_col = jnp.max(jnp.where(seen, l, 1.0), axis=1, keepdims=True)   # [R, 1]
        out_ref[h] = acc_sc[h] / l_col
        lse_ref[h] = jnp.where(seen, m_sc[h] + jnp.log(jnp.where(seen, l, 1.0)), MASK_VALUE)


def _grid_step(j, bk: int, filled, last: int, visibility, refs, scratch, *, nkv: int,
               scaling: float, dtype: Any):
    """Grid step j over a row's key blocks of ``bk`` slots, ``filled`` of them real, ``len(kv)``
    blocks per step: reset the statistics at step 0, fold in each block t (block j x len(kv) + t)
    that holds filled slots (``visibility(pos)`` -> (visible [1 or R, bk], v_valid [bk, 1] or
    None) for the block's slot positions pos [1, bk]), write out / lse at step ``last``. refs =
    (q, kv, out, lse), kv a tuple of (k, v) block refs; scratch = (m, l, acc)."""
    q_ref, kv, out_ref, lse_ref = refs

    @pl.when(j == 0)
    def _start():
        _init(*scratch)

    for t, (k_ref, v_ref) in enumerate(kv):
        start = (j * len(kv) + t) * bk

        @pl.when(start < filled)
        def _block_step(start=start, k_ref=k_ref, v_ref=v_ref):
            visible, v_valid = visibility(start + jax.lax.broadcasted_iota(jnp.int32, (1, bk), 1))
            _accumulate(q_ref, k_ref, v_ref, visible, v_valid, *scratch, nkv=nkv,
                        scaling=scaling, dtype=dtype)

    @pl.when(j == last)
    def _finish():
        _write(out_ref, lse_ref, *scratch, nkv=nkv)


def _kernel(filled_ref, layer_ref, q_ref, k_ref, v_ref, mask_ref, out_ref, lse_ref, m_sc, l_sc,
            acc_sc, *, bk: int, s: int, nkv: int, scaling: float, dtype: Any, last: int):
    """One grid step (row b, key block j). q_ref [nkv, R, d]; k_ref / v_ref [nkv, bk, d]; mask_ref
    [1, bk]; out_ref [nkv, R, d] and lse_ref [nkv, R, LANES] (written at the last block); scratch
    m_sc / l_sc [nkv, R, LANES] (lane-replicated running max and sum), acc_sc [nkv, R, d]."""
    del layer_ref  # used by the index maps only
    filled = filled_ref[0]

    def visibility(pos):
        # a partial last block: the slots past S hold undefined values
        return ((mask_ref[...] != 0) & (pos < filled) & (pos < s),
                jnp.transpose(pos < s) if s % bk else None)

    _grid_step(pl.program_id(2), bk, filled, last, visibility,
               (q_ref, ((k_ref, v_ref),), out_ref, lse_ref), (m_sc, l_sc, acc_sc), nkv=nkv,
               scaling=scaling, dtype=dtype)


def _pallas_call(kernel, name: str, scalars: int, steps: int, kv_specs: list,
                 q_shape: tuple[int, int, int, int], cost: dict, interpret: bool,
                 block_q: int | None = None):
    """The pallas_call the kernels share: grid (row, query tile, step), ``scalars``
    scalar-prefetch operands, then q [B, nkv, R, d] (a row's tile of ``block_q`` query rows per
    grid point; default all R) and the ``kv_specs`` operands (index maps of (row, tile, step,
    *scalars)) -> (out fp32 [B, nkv, R, d], log-sum-exp fp32 [B, nkv, R]), with the running
    statistics in VMEM scratch."""
    b, nkv, r, d = q_shape
    bq = block_q or r
    rows = lambda i, qi, j, *_: (i, 0, qi, 0)  # noqa: E731

    def call(*args):
        out, lse = pl.pallas_call(
            kernel,
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=scalars, grid=(b, r // bq, steps),
                in_specs=[pl.BlockSpec((None, nkv, bq, d), rows), *kv_specs],
                out_specs=[pl.BlockSpec((None, nkv, bq, d), rows),
                           pl.BlockSpec((None, nkv, bq, LANES), rows)],
                scratch_shapes=[pltpu.VMEM((nkv, bq, LANES), _F32),
                                pltpu.VMEM((nkv, bq, LANES), _F32), pltpu.VMEM((nkv, bq, d), _F32)]),
            out_shape=[jax.ShapeDtypeStruct((b, nkv, r, d), _F32),
                       jax.ShapeDtypeStruct((b, nkv, r, LANES), _F32)],
            compiler_params=pltpu.CompilerParams(
                dimension_semantics=("parallel", "parallel", "arbitrary")),
            cost_estimate=pl.CostEstimate(**cost),
            interpret=interpret,
            name=name,
        )(*args)
        return out, lse[..., 0]

    return call


def _local(filled, layer, q, k_cache, v_cache, mask, *, static_filled: int | None, scaling: float,
           dtype: Any, block_kv: int, interpret: bool):
    """The pallas_call on one device's shard: q [B, nkv, R, d], caches [L, B, S, nkv, d], mask
    [B, 1, S] int32, filled / layer int32 [1] -> (out fp32 [B, nkv, R, d], lse fp32 [B, nkv, R]).

    The kernel reads the caches heads before slots ([L, B, nkv, S, d], a transposed view): its
    blocks' minor dims (slots, d) then tile without padding whatever nkv is, and the compiler
    can lay the cache out so that the view is free (where the cache is [.., S, nkv, d] in
    memory, one KV head per chip pads every slot's head to two under ``T(2,128)``)."""
    b, nkv, r, d = q.shape
    s = k_cache.shape[2]
    k_cache, v_cache = jnp.swapaxes(k_cache, 2, 3), jnp.swapaxes(v_cache, 2, 3)
    bk = _block(s, block_kv)
    total = -(-s // bk)
    blocks = total if static_filled is None else min(max(-(-static_filled // bk), 1), total)

    def kv_map(i, qi, j, filled_ref, layer_ref):
        # lax.div (truncating; the fill is >= 0): jnp's floor division lowers through `sign`,
        # which needs a real TPU's generation to lower
        last_filled = jnp.maximum(jax.lax.div(filled_ref[0] + bk - 1, bk) - 1, 0)
        return layer_ref[0], i, 0, jnp.minimum(j, last_filled), 0

    def mask_map(i, qi, j, filled_ref, layer_ref):
        return i, 0, kv_map(i, qi, j, filled_ref, layer_ref)[3]

    kv_spec = pl.BlockSpec((None, None, nkv, bk, d), kv_map)
    mask_spec = pl.BlockSpec((None, 1, bk), mask_map)
    cost = declared_cost(b, nkv, r, d, blocks, bk, k_cache.dtype.itemsize, q.dtype.itemsize)
    kernel = functools.partial(_kernel, bk=bk, s=s, nkv=nkv, scaling=float(scaling), dtype=dtype,
                               last=blocks - 1)
    return _pallas_call(kernel, "decode_attention", 2, blocks, [kv_spec, kv_spec, mask_spec],
                        (b, nkv, r, d), cost, interpret)(filled, layer, q, k_cache, v_cache, mask)


def decode_stats(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, kv_mask: jax.Array,
                 filled: jax.Array | int, *, scaling: float, dtype: Any = None,
                 layer: jax.Array | int | None = None, block_kv: int = 512,
                 interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """(out fp32 [B, nkv, R, d], log-sum-exp fp32 [B, nkv, R]) of q [B, nkv, R, d] against the
    slots s < ``filled`` with kv_mask[b, s] of k_cache / v_cache ([B, S, nkv, d], or a layer
    stack [L, B, S, nkv, d] at ``layer``). ``filled``: a Python int (the grid then covers exactly
    the filled blocks) or a traced int32 scalar. ``block_kv``: slots per key block (rounded down
    to a multiple of 128; S when S is smaller). ``interpret``: Pallas interpret mode (off TPU)."""
    if (layer is None) != (k_cache.ndim == 4):
        raise ValueError(f"k_cache of shape {k_cache.shape} needs layer={'None' if k_cache.ndim == 4 else 'an index'}")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {k_cache.shape} and v_cache {v_cache.shape} differ")
    if layer is None:
        k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
    _, b, s, nkv, d = k_cache.shape
    if q.ndim != 4 or q.shape[0] != b or q.shape[1] != nkv or q.shape[3] != d:
        raise ValueError(f"q must be [B, nkv, R, d] = [{b}, {nkv}, R, {d}], got {q.shape}")
    if kv_mask.shape != (b, s):
        raise ValueError(f"kv_mask must be [B, S] = {(b, s)}, got {kv_mask.shape}")
    static = None if isinstance(filled, jax.core.Tracer) else int(filled)
    scalar = lambda x: jnp.asarray(x, jnp.int32).reshape(1)  # noqa: E731
    mask = (kv_mask != 0).astype(jnp.int32).reshape(b, 1, s)
    local = functools.partial(_local, static_filled=static, scaling=scaling,
                              dtype=jnp.dtype(dtype or q.dtype), block_kv=block_kv,
                              interpret=interpret)
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty:
        batch_axes, head_axis = mesh_specs(mesh, b, nkv)  # as the splash kernel splits them
        P = jax.sharding.PartitionSpec
        local = jax.shard_map(
            local, mesh=mesh, check_vma=False,
            in_specs=(P(), P(), P(batch_axes, head_axis), P(None, batch_axes, None, head_axis),
                      P(None, batch_axes, None, head_axis), P(batch_axes)),
            out_specs=(P(batch_axes, head_axis), P(batch_axes, head_axis)))
    return local(scalar(filled), scalar(layer), q, k_cache, v_cache, mask)


# ============================================================================ paged cache
def _paged_kernel(table_ref, lengths_ref, layer_ref, tile_ref, q_ref, offsets_ref, *refs,
                  page_size: int, nkv: int, scaling: float, dtype: Any, last: int):
    """One grid step (row b, query tile qi, step j over its page table): q_ref [nkv, bq, d] the
    tile's query rows, offsets_ref int32 [bq, 1] their offsets (query row r sees the row's slots
    s < lengths[b] + offsets[r]); tile_ref [tiles]: each tile's largest offset (no row of the
    tile sees a slot from lengths[b] + that offset on, so those pages are not read); refs =
    (k_0 .. k_{n-1}, v_0 .. v_{n-1}, out, lse, m, l, acc), k_t / v_t [nkv, page_size, d] the
    step's page t."""
    del table_ref, layer_ref  # used by the index maps only
    n = (len(refs) - 5) // 2
    kv = tuple(zip(refs[:n], refs[n:2 * n]))
    out_ref, lse_ref, *scratch = refs[2 * n:]
    length = lengths_ref[pl.program_id(0)]
    limit = length + offsets_ref[...]                                      # [bq, 1]
    _grid_step(pl.program_id(2), page_size, length + tile_ref[pl.program_id(1)], last,
               lambda pos: (pos < limit, None), (q_ref, kv, out_ref, lse_ref), tuple(scratch),
               nkv=nkv, scaling=scaling, dtype=dtype)


def pages_per_step(pages: int, page_size: int) -> int:
    """Pages a grid step of `paged_decode_stats` reads: ``PAGED_STEP_SLOTS`` slots' worth, at
    least one, at most the table's ``pages``."""
    return max(1, min(pages, PAGED_STEP_SLOTS // page_size))


def step_page(t, j, last_page, n: int):
    """The table index that operand ``t`` of ``n`` reads at grid step ``j`` (int32 scalars) for
    a row whose last filled page is ``last_page``: page j x n + t while filled, else the page
    it read at its last filled step (no new DMA), and ``last_page`` for t > last_page."""
    held = t + n * jnp.minimum(j, jax.lax.div(jnp.maximum(last_page - t, 0), n))
    return jnp.where(t <= last_page, held, last_page)


def paged_decode_stats(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array,
                       page_table: jax.Array, lengths: jax.Array, layer: jax.Array | int, *,
                       scaling: float, dtype: Any = None, interpret: bool = False,
                       per_step: int | None = None, queries: int = 1,
                       block_q: int = PAGED_BLOCK_Q) -> tuple[jax.Array, jax.Array]:
    """(out fp32 [B, nkv, R, d], log-sum-exp fp32 [B, nkv, R]) of q [B, nkv, R, d] against the
    first ``lengths[b]`` slots of row b in a PAGED cache: pools ``k_pages`` / ``v_pages``
    [L, P, nkv, page_size, d] read at ``layer``, slot s of row b at page
    ``page_table[b, s // page_size]`` [B, pages_per_row], offset ``s % page_size``
    (`models.attention.paged_attention`'s layout, on one device: the rollout engine's).

    ``queries`` T > 1: a chunk of T consecutive tokens per row (a prefill), R = T x g query rows,
    t major (row r is token r // g); token t sees the slots s < lengths[b] - (T - 1 - t), i.e. up
    to its own (``lengths[b]``: the chunk's last slot + 1), causally.

    Grid (row, query tile, step): a tile is ``block_q`` query rows (all R when fewer; R is padded
    to whole tiles with rows that see nothing); a step reads ``per_step`` pages (default
    `pages_per_step`) of K and of V, each its own operand, which Pallas double-buffers (the
    next step's pages are DMA'd while this step computes); the page ids, lengths and each tile's
    reach are scalar-prefetched (SMEM). Only the pages in use are read: page t of a step past
    the last page the tile's rows see maps to the page that operand held at the step before,
    which Pallas does not copy again (a row with fewer pages than ``per_step`` reads its last
    page for the missing ones). Each tile reads its row's pages anew. The declared cost is every
    page of the table for every tile (the fills are traced: an upper bound; ``read_pages`` of
    `models.attention.paged_attention` narrows the table to the pages read). A query row that
    sees no slot gets out 0 and log-sum-exp ``MASK_VALUE``. ``interpret``: Pallas interpret
    mode (off TPU)."""
    if k_pages.ndim != 5 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} must be the same "
                         "[L, P, nkv, page_size, d]")
    _, _, nkv, page_size, d = k_pages.shape
    b, pages = page_table.shape
    if q.ndim != 4 or q.shape[0] != b or q.shape[1] != nkv or q.shape[3] != d:
        raise ValueError(f"q must be [B, nkv, R, d] = [{b}, {nkv}, R, {d}], got {q.shape}")
    if lengths.shape != (b,):
        raise ValueError(f"lengths must be [B] = [{b}], got {lengths.shape}")
    r = q.shape[2]
    if queries < 1 or r % queries:
        raise ValueError(f"queries={queries} must divide q's {r} query rows (T x g)")
    n = per_step or pages_per_step(pages, page_size)
    if not 1 <= n <= pages:
        raise ValueError(f"per_step must be in [1, {pages}] (the table's pages), got {n}")
    steps = -(-pages // n)
    # query row r is token r // g of the chunk; it sees lengths[b] + offset[r] slots
    offsets = jnp.arange(r, dtype=jnp.int32) // (r // queries) - (queries - 1)
    bq = r if r <= block_q else block_q
    tiles = -(-r // bq)
    pad = tiles * bq - r                      # padded rows see nothing
    offsets = jnp.pad(offsets, (0, pad), constant_values=-(pages * page_size + queries))
    q = jnp.pad(q, ((0, 0), (0, 0), (0, pad), (0, 0)))

    def kv_map(t: int):
        def index(i, qi, j, table_ref, lengths_ref, layer_ref, tile_ref):
            # lax.div (truncating; operands >= 0): jnp's floor division lowers through `sign`,
            # which needs a real TPU's generation to lower (see `_local`)
            seen = jnp.maximum(lengths_ref[i] + tile_ref[qi], 0)
            last_page = jnp.maximum(jax.lax.div(seen + page_size - 1, page_size) - 1, 0)
            return layer_ref[0], table_ref[i * pages + step_page(t, j, last_page, n)], 0, 0, 0
        return pl.BlockSpec((None, None, nkv, page_size, d), index)

    specs = [kv_map(t) for t in range(n)]
    offsets_spec = pl.BlockSpec((bq, 1), lambda i, qi, j, *_: (qi, 0))
    cost = declared_cost(b * tiles, nkv, bq, d, pages, page_size, k_pages.dtype.itemsize,
                         q.dtype.itemsize)
    kernel = functools.partial(_paged_kernel, page_size=page_size, nkv=nkv, scaling=float(scaling),
                               dtype=jnp.dtype(dtype or q.dtype), last=steps - 1)
    out, lse = _pallas_call(kernel, "paged_decode_attention", 4, steps,
                            [offsets_spec] + specs + specs, (b, nkv, tiles * bq, d), cost,
                            interpret, block_q=bq)(
        page_table.astype(jnp.int32).reshape(-1), lengths.astype(jnp.int32),
        jnp.asarray(layer, jnp.int32).reshape(1), offsets.reshape(tiles, bq).max(axis=1), q,
        offsets.reshape(-1, 1), *(k_pages,) * n, *(v_pages,) * n)
    return out[:, :, :r], lse[:, :, :r]
