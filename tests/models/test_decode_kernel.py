"""Tests of models/decode_kernel.py, the Pallas TPU decode-attention kernel.

* in Pallas interpret mode (CPU) it equals the pure-JAX block loop (`attention._decode_stats`,
  "xla"), output and log-sum-exp: one layer or a layer stack, a traced or a concrete fill, a
  cache whose length is not a multiple of the block, masked slots, a row with no visible slot
  (out 0, log-sum-exp MASK_VALUE), fp32 and bf16;
* cascade attention (`decode_attention_shared_prefix`) with the kernel equals it with the loop;
* under a mesh of 8 CPU devices it runs per shard (rows over 'data', KV heads over 'tensor') and
  equals the unsharded result;
* `models.qwen3` picks it for a "splash" model only;
* it lowers and compiles for TPU under a mesh with no all-gather, and XLA's cost analysis reads
  its declared cost: the filled key blocks, not the whole cache (skipped without libtpu);
* the paged variant (`paged_decode_stats`, a decode step of `attention.paged_attention`) equals
  the pure-JAX page loop: rows sharing pages, partial and full last pages, an empty row, a
  layer of a stack, fp32 and bf16; steps of several pages at 1, 2 and 4 KV heads, each filled
  page read once; a model's decode step into a paged cache gives the same logits with it; it
  compiles for TPU (4 pages a step, 4 KV heads and 1) and declares the pages of the table.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models import decode_kernel
from models.attention import (_decode_stats, decode_attention, decode_attention_shared_prefix,
                              paged_attention, paged_attention_shared_prefix)
from tests.numerics import assert_close

_HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _cache(seed, b, s, nkv, d, layers, dtype):
    rng = np.random.RandomState(seed)
    lead = (layers,) if layers else ()
    k, v = (jnp.asarray(rng.randn(*lead, b, s, nkv, d), dtype) for _ in range(2))
    mask = rng.rand(b, s) > 0.2
    mask[-1] = False  # a row with no visible slot
    return k, v, jnp.asarray(mask)


@pytest.mark.parametrize("s,block,filled,layers,dtype,nkv", [
    (256, 128, 200, 0, jnp.float32, 2),    # one layer, two blocks, the second partly filled
    (320, 128, 301, 3, jnp.float32, 2),    # a stack; S not a multiple of the block: a partial last block
    (320, 128, 301, 3, jnp.bfloat16, 4),
    (128, 512, 128, 2, jnp.bfloat16, 1),   # one block of S slots (the block is clipped to S); one
    (256, 128, 0, 0, jnp.bfloat16, 1),     # KV head (the pod's per chip); nothing filled
])
def test_kernel_equals_the_xla_loop(s, block, filled, layers, dtype, nkv):
    b, r, d = 3, 4, 128
    k, v, mask = _cache(filled + s, b, s, nkv, d, layers, dtype)
    q = jnp.asarray(np.random.RandomState(1).randn(b, 1, nkv * r, d), dtype)
    layer = 1 if layers else None
    kw = dict(scaling=d ** -0.5, dtype=dtype, layer=layer, block_kv=block)
    for fill in (filled, jnp.int32(filled)):  # concrete (the dry run's cost model) and traced
        want_out, want_lse = jax.jit(lambda f: _decode_stats(q, k, v, mask, f, **kw))(jnp.int32(filled))
        got_out, got_lse = decode_kernel.decode_stats(q.reshape(b, nkv, r, d), k, v, mask, fill,
                                                      interpret=True, **kw)
        assert got_out.shape == want_out.shape and got_lse.shape == want_lse.shape
        seen = np.asarray(want_lse) > decode_kernel.MASK_VALUE
        assert_close(np.asarray(got_out)[seen], np.asarray(want_out)[seen], reduction_len=s,
                     dtype=dtype)
        assert_close(np.asarray(got_lse)[seen], np.asarray(want_lse)[seen], reduction_len=s,
                     dtype=dtype)
        np.testing.assert_array_equal(np.asarray(got_out)[~seen], 0.0)
        np.testing.assert_array_equal(np.asarray(got_lse)[~seen], decode_kernel.MASK_VALUE)
        assert seen[:-1].all() == (filled > 0) and not seen[-1].any()


def test_decode_attention_with_the_kernel_and_its_errors():
    b, s, nkv, r, d = 2, 256, 2, 2, 128
    k, v, mask = _cache(0, b, s, nkv, d, 0, jnp.float32)
    q = jnp.asarray(np.random.RandomState(2).randn(b, 1, nkv * r, d), jnp.float32)
    run = functools.partial(decode_attention, q, k, v, mask, 190, scaling=0.1, block_kv=128)
    assert_close(run(kernel="pallas_interpret"), run(kernel="xla"), reduction_len=s)
    with pytest.raises(ValueError, match="decode kernel"):
        run(kernel="mosaic")
    with pytest.raises(ValueError, match=r"\[B, nkv, R, d\]"):
        decode_kernel.decode_stats(q, k, v, mask, 3, scaling=0.1, interpret=True)


def test_shared_prefix_decode_with_the_kernel_equals_the_loop():
    b, gs, p, m, nkv, g, d = 2, 4, 256, 128, 2, 2, 128
    n = b * gs
    rng = np.random.RandomState(3)
    q = jnp.asarray(rng.randn(n, 1, nkv * g, d), jnp.float32)
    pk, pv = (jnp.asarray(rng.randn(2, b, p, nkv, d), jnp.float32) for _ in range(2))
    ok, ov = (jnp.asarray(rng.randn(2, n, m, nkv, d), jnp.float32) for _ in range(2))
    prefix_mask = jnp.asarray(rng.rand(b, p) > 0.2)
    own_mask = jnp.asarray(rng.rand(n, m) > 0.1)
    run = functools.partial(decode_attention_shared_prefix, q, ok, ov, own_mask, jnp.int32(70), pk,
                            pv, prefix_mask, scaling=0.1, layer=jnp.int32(1), block_kv=128)
    assert_close(run(kernel="pallas_interpret"), run(kernel="xla"), reduction_len=p + m)


def test_kernel_under_a_mesh_runs_per_shard():
    b, s, nkv, r, d = 8, 256, 2, 4, 128
    k, v, mask = _cache(4, b, s, nkv, d, 2, jnp.float32)
    q = jnp.asarray(np.random.RandomState(5).randn(b, nkv, r, d), jnp.float32)
    run = functools.partial(decode_kernel.decode_stats, scaling=0.1, layer=jnp.int32(1),
                            block_kv=128, interpret=True)
    want = run(q, k, v, mask, jnp.int32(150))
    devices = np.array(jax.devices()[:8]).reshape(4, 1, 2, 1)
    mesh = jax.sharding.Mesh(devices, ("data", "fsdp", "tensor", "expert"))
    P, named = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    rows_heads = named(mesh, P("data", "tensor"))
    cache = named(mesh, P(None, "data", None, "tensor"))
    args = (jax.device_put(q, rows_heads), jax.device_put(k, cache), jax.device_put(v, cache),
            jax.device_put(mask, named(mesh, P("data"))))
    with jax.set_mesh(mesh):
        lowered = jax.jit(lambda q, k, v, m: run(q, k, v, m, jnp.int32(150))).lower(*args)
        got = lowered.compile()(*args)
    assert "all-gather" not in lowered.compile().as_text()
    for g, w in zip(got, want):
        assert_close(g, w, reduction_len=s)


def test_the_model_picks_the_kernel_for_splash_only():
    from models.qwen3 import AttentionMask, _decode_kernel
    ids = jnp.ones((1, 4), jnp.int32)
    pick = lambda impl, platform: _decode_kernel(  # noqa: E731
        AttentionMask(ids, ids, 0, None, impl=impl, platform=platform))
    assert pick("splash", "tpu") == "pallas"
    assert pick("splash", "cpu") == "pallas_interpret"
    assert pick("blockwise", "tpu") == pick("blockwise", "cpu") == "xla"
    assert pick("paged", "tpu") == "pallas" and pick("paged", "cpu") == "xla"


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_LIBTPU, reason="libtpu is not installed: no TPU compiler for ahead-of-time lowering")
def test_kernel_compiles_for_tpu_and_declares_the_filled_blocks():
    from jax.experimental import topologies
    from jax.experimental.layout import Format, Layout
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    mesh = jax.sharding.Mesh(np.array(topology.devices).reshape(8, 1, 1, 1),
                             ("data", "fsdp", "tensor", "expert"))
    P, named = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    layers, b, s, nkv, g, d, filled = 2, 64, 4096, 4, 8, 128, 1000
    sds = lambda shape, dt, spec: jax.ShapeDtypeStruct(shape, dt, sharding=named(mesh, spec))  # noqa: E731
    q = sds((b, 1, nkv * g, d), jnp.bfloat16, P("data"))
    k = v = sds((layers, b, s, nkv, d), jnp.bfloat16, P(None, "data"))
    mask = sds((b, s), jnp.bool_, P("data"))
    # the cache's layout left to the compiler, as the rollout's loop (which makes and carries the
    # cache) leaves it: the kernel reads it heads before slots
    auto = Format(Layout.AUTO, k.sharding)
    with jax.set_mesh(mesh):
        compiled = jax.jit(functools.partial(decode_attention, filled=filled, scaling=d ** -0.5,
                                             layer=1, block_kv=512, kernel="pallas"),
                           in_shardings=(q.sharding, auto, auto, mask.sharding)
                           ).lower(q, k, v, mask).compile()
    hlo = compiled.as_text()
    assert "decode_attention" in hlo and "all-gather" not in hlo
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    rows = b // 8
    filled_kv = 2 * rows * 1024 * nkv * d * 2          # 2 blocks of 512 slots, K and V, bf16
    whole_kv = 2 * layers * rows * s * nkv * d * 2     # what a custom call's operands weigh
    assert filled_kv <= cost["bytes accessed"] < filled_kv * 1.25 < whole_kv
    assert cost["flops"] >= 4 * rows * 1024 * nkv * g * d


# ------------------------------------------------------------------------------------ paged
def _pool(seed, layers, pages, page_size, nkv, d, dtype):
    rng = np.random.RandomState(seed)
    return tuple(jnp.asarray(rng.randn(layers, pages, nkv, page_size, d), dtype) for _ in range(2))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_kernel_equals_the_page_loop(dtype):
    """Rows 0 and 1 share their first two pages (a prompt); row 2 fills its 4 pages; row 3 sees
    one slot; row 4 none. A decode step (T = 1) at slot start[b] sees slots <= start[b]."""
    layers, pages, ps, nkv, r, d = 2, 16, 16, 2, 4, 128
    k, v = _pool(0, layers, pages, ps, nkv, d, dtype)
    table = jnp.asarray([[1, 2, 3, 0], [1, 2, 4, 5], [6, 7, 8, 9], [10, 0, 0, 0], [11, 0, 0, 0]],
                        jnp.int32)
    start = jnp.asarray([40, 33, 4 * ps - 1, 0, -1], jnp.int32)
    q = jnp.asarray(np.random.RandomState(1).randn(5, 1, nkv * r, d), dtype)
    kw = dict(scaling=d ** -0.5, dtype=dtype, block_slots=32)
    want = jax.jit(lambda s, l: paged_attention(q, k, v, l, table, s, **kw))(start, jnp.int32(1))
    got = jax.jit(lambda s, l: paged_attention(q, k, v, l, table, s, kernel="pallas_interpret",
                                               **kw))(start, jnp.int32(1))
    assert got.shape == want.shape == (5, 1, nkv * r, d) and got.dtype == want.dtype
    assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32), reduction_len=4 * ps,
                 dtype=dtype)
    np.testing.assert_array_equal(np.asarray(got[4], np.float32), 0.0)
    out, lse = decode_kernel.paged_decode_stats(q.reshape(5, nkv, r, d), k, v, table, start + 1, 1,
                                                scaling=d ** -0.5, dtype=dtype, interpret=True)
    assert (np.asarray(lse[:4]) > decode_kernel.MASK_VALUE).all()
    np.testing.assert_array_equal(np.asarray(lse[4]), decode_kernel.MASK_VALUE)
    with pytest.raises(ValueError, match="lengths must be"):
        decode_kernel.paged_decode_stats(q.reshape(5, nkv, r, d), k, v, table, start[:2], 1,
                                         scaling=1.0, interpret=True)
    with pytest.raises(ValueError, match="decode kernel"):
        paged_attention(q, k, v, 1, table, start, scaling=1.0, kernel="fast")


@pytest.mark.parametrize("nkv", [1, 2, 4])
def test_paged_kernel_reads_several_pages_per_step(nkv):
    """Steps of 1, 2, 3 and 7 pages over a 7-page table (3 does not divide it): rows filled to
    0, 1, 16 (one whole page), 17, 50, 112 (the whole table) and 33 slots, each equal to the
    pure-JAX page loop, at 1, 2 and 4 KV heads; a step wider than the table is refused."""
    layers, pages, ps, r, d, b = 2, 56, 16, 2, 128, 7
    k, v = _pool(7, layers, pages, ps, nkv, d, jnp.float32)
    rng = np.random.RandomState(8)
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[:b * 7].reshape(b, 7), jnp.int32)
    lengths = jnp.asarray([0, 1, 16, 17, 50, 112, 33], jnp.int32)
    q = jnp.asarray(rng.randn(b, 1, nkv * r, d), jnp.float32)
    kw = dict(scaling=d ** -0.5, dtype=jnp.float32)
    want = paged_attention(q, k, v, 1, table, lengths - 1, block_slots=ps, kernel="xla", **kw)
    for per_step in (1, 2, 3, 7):
        out, lse = decode_kernel.paged_decode_stats(q.reshape(b, nkv, r, d), k, v, table, lengths,
                                                    1, interpret=True, per_step=per_step, **kw)
        assert_close(np.asarray(out.reshape(b, 1, nkv * r, d)), np.asarray(want),
                     reduction_len=112, dtype=jnp.float32)
        np.testing.assert_array_equal(np.asarray(lse[0]), decode_kernel.MASK_VALUE)
    with pytest.raises(ValueError, match="per_step"):
        decode_kernel.paged_decode_stats(q.reshape(b, nkv, r, d), k, v, table, lengths, 1,
                                         interpret=True, per_step=8, **kw)


@pytest.mark.parametrize("nkv", [1, 2, 4])
def test_a_prefill_chunk_through_the_paged_kernel_equals_the_page_loop(nkv):
    """Issue 49 item 2: a chunk of T = 12 tokens per row (a prefill) through the paged kernel,
    causal within the chunk: rows whose chunk starts at slot 0, mid-page (after a cached prefix)
    and on a page boundary, and one at start -1 (its first token sees nothing), equal the page
    loop at 1, 2 and 4 KV heads. With 16 query rows per tile (T x g = 24 or 48 rows: 2 or 3
    tiles, the last padded) each tile reads only the pages its tokens see."""
    layers, pages, ps, g, d, b, t = 2, 40, 16, 2, 128, 4, 12
    k, v = _pool(11, layers, pages, ps, nkv, d, jnp.float32)
    rng = np.random.RandomState(12)
    table = jnp.asarray(rng.permutation(np.arange(1, pages))[:b * 6].reshape(b, 6), jnp.int32)
    start = jnp.asarray([0, 21, 48, -1], jnp.int32)
    q = jnp.asarray(rng.randn(b, t, nkv * g, d), jnp.float32)
    kw = dict(scaling=d ** -0.5, dtype=jnp.float32)
    want = paged_attention(q, k, v, 1, table, start, block_slots=ps, kernel="xla", **kw)
    got = paged_attention(q, k, v, 1, table, start, kernel="pallas_interpret", **kw)
    assert got.shape == want.shape == (b, t, nkv * g, d)
    assert_close(np.asarray(got), np.asarray(want), reduction_len=6 * ps, dtype=jnp.float32)
    qk = jnp.transpose(q.reshape(b, t, nkv, g, d), (0, 2, 1, 3, 4)).reshape(b, nkv, t * g, d)
    for block_q in (16, 512):
        out, lse = decode_kernel.paged_decode_stats(qk, k, v, table, start + t, 1, interpret=True,
                                                    queries=t, block_q=block_q, **kw)
        assert out.shape == (b, nkv, t * g, d) and lse.shape == (b, nkv, t * g)
        assert_close(np.asarray(jnp.swapaxes(out.reshape(b, nkv, t, g, d), 1, 2)).reshape(
            b, t, nkv * g, d), np.asarray(want), reduction_len=6 * ps, dtype=jnp.float32)
        # row 3's first token (slot -1) sees nothing: out 0, log-sum-exp MASK_VALUE
        np.testing.assert_array_equal(np.asarray(lse[3, :, :g]), decode_kernel.MASK_VALUE)
        np.testing.assert_array_equal(np.asarray(out[3, :, :g]), 0.0)
        assert (np.asarray(lse[:3]) > decode_kernel.MASK_VALUE).all()
    with pytest.raises(ValueError, match="queries"):
        decode_kernel.paged_decode_stats(qk, k, v, table, start + t, 1, interpret=True,
                                         queries=5, **kw)


def test_a_multi_page_step_reads_each_filled_page_once():
    """The pages each operand reads step by step (`step_page`): a new page is a DMA, the same
    page as at the step before is not (Pallas skips it). Over a 7-page table a row DMAs each of
    its filled pages once (at least ``n`` pages: a row with fewer re-reads its last one), and
    every filled page is read at the step that folds it in."""
    pages = 7
    for n in (1, 2, 3, 4, 7):
        steps = -(-pages // n)
        for filled_pages in range(1, pages + 1):
            last = jnp.int32(filled_pages - 1)
            seen = [[int(decode_kernel.step_page(jnp.int32(t), jnp.int32(j), last, n))
                     for j in range(steps)] for t in range(n)]
            dmas = sum(1 + sum(a != b for a, b in zip(s, s[1:])) for s in seen)
            assert dmas == max(filled_pages, n), (n, filled_pages, seen)
            for j in range(steps):
                for t in range(n):
                    if j * n + t < filled_pages:
                        assert seen[t][j] == j * n + t


@pytest.mark.parametrize("kernel", ["xla", "pallas_interpret"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_paged_cascade_equals_paged_attention(kernel, dtype):
    """Prefix 0 (pages 1, 2) is shared by rows 0, 2, 3, prefix 1 (page 3) by rows 1 and 5, prefix
    2 is unused; row 4 is in no prefix. Each prefix read once for its rows, then each row's own
    pages, merged: the same as every row reading its whole table."""
    layers, pages, ps, nkv, r, d = 2, 16, 8, 2, 4, 128
    k, v = _pool(2, layers, pages, ps, nkv, d, dtype)
    table = jnp.asarray([[1, 2, 6, 7], [3, 11, 12, 0], [1, 2, 8, 0], [1, 2, 9, 10], [14, 15, 0, 0],
                         [3, 13, 0, 0]], jnp.int32)
    start = jnp.asarray([20, 10, 16, 31, 12, 8], jnp.int32)   # rows 2 and 5: their first own slot
    prefix_table = jnp.asarray([[1, 2], [3, 0], [0, 0]], jnp.int32)
    prefix_lengths = jnp.asarray([2 * ps, ps, 0], jnp.int32)
    prefix_rows = jnp.asarray([[0, 2, 3], [1, 5, -1], [-1, -1, -1]], jnp.int32)
    q = jnp.asarray(np.random.RandomState(3).randn(6, 1, nkv * r, d), dtype)
    kw = dict(scaling=d ** -0.5, dtype=dtype, block_slots=16, kernel=kernel)
    want = jax.jit(lambda s: paged_attention(q, k, v, 1, table, s, **kw))(start)
    got = jax.jit(lambda s, pt, pl_, pr: paged_attention_shared_prefix(
        q, k, v, 1, table, s, pt, pl_, pr, **kw))(start, prefix_table, prefix_lengths, prefix_rows)
    assert got.shape == want.shape == (6, 1, nkv * r, d) and got.dtype == want.dtype
    assert_close(np.asarray(got, np.float32), np.asarray(want, np.float32), reduction_len=4 * ps,
                 dtype=dtype)
    # a prefix's keys come from the prefix table: pointing prefix 0 at other pages moves its
    # rows 0, 2, 3 and no other row
    other = paged_attention_shared_prefix(q, k, v, 1, table, start, prefix_table.at[0].set(
        jnp.asarray([4, 5], jnp.int32)), prefix_lengths, prefix_rows, **kw)
    moved = np.abs(np.asarray(other, np.float32) - np.asarray(got, np.float32)).max(axis=(1, 2, 3))
    assert (moved[[0, 2, 3]] > 0.1).all() and (moved[[1, 4, 5]] < 1e-3).all()  # O(1) vs rounding
    with pytest.raises(ValueError, match="one token per row"):
        paged_attention_shared_prefix(jnp.concatenate([q, q], 1), k, v, 1, table, start,
                                      prefix_table, prefix_lengths, prefix_rows, scaling=1.0)


@pytest.mark.parametrize("kernel", ["xla", "pallas_interpret"])
def test_paged_ops_under_a_mesh_run_per_shard(kernel):
    """Rows and the pool's pages split over 'data' (4 shards: 2 rows, 5 pages each), KV heads
    over 'tensor' (2): a row's page ids index its own shard's pages. The write, the decode
    attention and the cascade (one shared prefix per shard) equal each shard computed alone,
    and nothing is gathered across shards."""
    from models.attention import paged_write

    layers, shards, per, ps, nkv, r, d = 2, 4, 5, 8, 2, 4, 128
    k, v = _pool(5, layers, shards * per, ps, nkv, d, jnp.float32)
    rng = np.random.RandomState(6)
    table = jnp.asarray([[1, 2, 3], [1, 2, 4]] * shards, jnp.int32)       # rows share pages 1, 2
    start = jnp.asarray(rng.randint(2 * ps, 3 * ps - 1, size=2 * shards), jnp.int32)
    q = jnp.asarray(rng.randn(2 * shards, 1, nkv * r, d), jnp.float32)
    new_k = jnp.asarray(rng.randn(2 * shards, 1, nkv, d), jnp.float32)
    prefix = (jnp.asarray([[1, 2]] * shards, jnp.int32), jnp.full((shards,), 2 * ps, jnp.int32),
              jnp.asarray([[0, 1]] * shards, jnp.int32))
    kw = dict(scaling=d ** -0.5, block_slots=16, kernel=kernel)

    def step(k, v, q, new_k, table, start, pt, pl_, pr):
        k, v = paged_write(k, v, new_k, new_k, 1, table, start, jnp.ones_like(start)[:, None])
        return (k, paged_attention(q, k, v, 1, table, start, **kw),
                paged_attention_shared_prefix(q, k, v, 1, table, start, pt, pl_, pr, **kw))

    want = [step(k[:, i * per:(i + 1) * per], v[:, i * per:(i + 1) * per], q[2 * i:2 * i + 2],
                 new_k[2 * i:2 * i + 2], table[:2], start[2 * i:2 * i + 2],
                 *(x[i:i + 1] for x in prefix)) for i in range(shards)]
    devices = np.array(jax.devices()[:8]).reshape(4, 2)
    mesh = jax.sharding.Mesh(devices, ("data", "tensor"))
    P, named = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    pool, rows = named(mesh, P(None, "data", "tensor")), named(mesh, P("data"))
    heads = named(mesh, P("data", None, "tensor"))
    args = (jax.device_put(k, pool), jax.device_put(v, pool), jax.device_put(q, heads),
            jax.device_put(new_k, heads), jax.device_put(table, rows), jax.device_put(start, rows),
            *(jax.device_put(x, rows) for x in prefix))
    with jax.set_mesh(mesh):
        compiled = jax.jit(step).lower(*args).compile()
        got_k, got, got_cascade = compiled(*args)
    assert "all-gather" not in compiled.as_text()
    for i, (wk, w, wc) in enumerate(want):
        np.testing.assert_array_equal(np.asarray(got_k[:, i * per:(i + 1) * per]), np.asarray(wk))
        assert_close(np.asarray(got[2 * i:2 * i + 2]), np.asarray(w), reduction_len=3 * ps)
        assert_close(np.asarray(got_cascade[2 * i:2 * i + 2]), np.asarray(wc), reduction_len=3 * ps)
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="does not split over the 4 row shards"):
        jax.jit(step).lower(k[:, :18], v[:, :18], *args[2:])
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="3 shared prefixes do not split"):
        jax.jit(step).lower(*args[:6], *(x[:3] for x in prefix))


def test_paged_write_of_a_decode_step_equals_the_chunk_write():
    """A decode step's write (one token per row, row by row in place) puts each valid row's
    token where the chunk write (a scatter) puts it, and leaves the rest of the pool as it was:
    an invalid row, and a row whose slot is past its table."""
    from models.attention import paged_write

    layers, pages, ps, nkv, d = 2, 8, 4, 2, 16
    k, v = _pool(7, layers, pages, ps, nkv, d, jnp.float32)
    rng = np.random.RandomState(8)
    table = jnp.asarray([[1, 2], [3, 4], [5, 6], [7, 0]], jnp.int32)
    start = jnp.asarray([5, 0, 3, 8], jnp.int32)            # row 3: slot 8 is past its 2 pages
    valid = jnp.asarray([[1], [0], [1], [1]], jnp.int32)     # row 1: nothing to write
    new = jnp.asarray(rng.randn(4, 2, nkv, d), jnp.float32)
    got = jax.jit(paged_write)(k, v, new[:, :1], -new[:, :1], 1, table, start, valid)
    # the chunk path: two tokens per row, the second never valid
    want = jax.jit(paged_write)(k, v, new, -new, 1, table, start,
                                jnp.concatenate([valid, jnp.zeros_like(valid)], 1))
    for g, w, before in zip(got, want, (k, v)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        changed = np.argwhere(np.asarray(g != before).any(axis=(2, 4)))
        assert changed.tolist() == [[1, 2, 1], [1, 5, 3]]   # (layer, page, offset) of rows 0, 2


def test_read_pages_bounds_the_table_and_keeps_the_result():
    """``read_pages``: attention reads only the table's first pages; when no row reads past
    them the result is the whole table's, with the page loop, the kernel and the cascade."""
    layers, pages, ps, nkv, r, d = 1, 12, 8, 2, 2, 128
    k, v = _pool(9, layers, pages, ps, nkv, d, jnp.float32)
    table = jnp.asarray([[1, 2, 3, 4, 0, 0], [1, 2, 5, 0, 0, 0]], jnp.int32)
    start = jnp.asarray([3 * ps + 2, 2 * ps + 5], jnp.int32)  # rows read 4 and 3 pages
    q = jnp.asarray(np.random.RandomState(10).randn(2, 1, nkv * r, d), jnp.float32)
    prefix = (jnp.asarray([[1, 2]], jnp.int32), jnp.asarray([2 * ps], jnp.int32),
              jnp.asarray([[0, 1]], jnp.int32))
    for kernel in ("xla", "pallas_interpret"):
        kw = dict(scaling=d ** -0.5, block_slots=16, kernel=kernel)
        want = paged_attention(q, k, v, 0, table, start, **kw)
        assert_close(np.asarray(paged_attention(q, k, v, 0, table, start, read_pages=4, **kw)),
                     np.asarray(want), reduction_len=4 * ps)
        # the cascade's own pages: past the 2 prefix pages, 2 and 1
        assert_close(np.asarray(paged_attention_shared_prefix(q, k, v, 0, table, start, *prefix,
                                                              read_pages=2, **kw)),
                     np.asarray(want), reduction_len=4 * ps)
        # a bound below what a row reads drops its last page: the bound is the caller's promise
        short = paged_attention(q, k, v, 0, table, start, read_pages=3, **kw)
        assert np.abs(np.asarray(short[0]) - np.asarray(want[0])).max() > 1e-2
        assert_close(np.asarray(short[1]), np.asarray(want[1]), reduction_len=4 * ps)
    with pytest.raises(ValueError, match="read_pages must be >= 1"):
        paged_attention(q, k, v, 0, table, start, scaling=1.0, read_pages=0)


def test_a_paged_decode_step_of_the_model_with_the_kernel(monkeypatch):
    """A small model prefills two prompts into a paged cache, then decodes one token: the logits
    are the same whether the step's attention is the page loop or the kernel."""
    from flax import nnx

    from models import configs as model_configs, qwen3

    mc = model_configs.get_model_config("tiny_moe", dtype="float32", param_dtype="float32")
    mc = mc.replace(head_dim=128)
    model = qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0))
    cache = qwen3.init_paged_cache(mc, 2, num_pages=9, page_size=8, pages_per_row=4)
    cache = dataclasses.replace(cache, page_table=jnp.asarray([[1, 2, 3, 4], [5, 6, 7, 8]], jnp.int32))
    ids = jnp.asarray(np.random.RandomState(0).randint(1, mc.vocab_size, (2, 13)), jnp.int32)
    mask = jnp.asarray([[1] * 13, [1] * 9 + [0] * 4], bool)
    cache = model(ids, attention_mask=mask, cache=cache).cache
    assert np.asarray(cache.lengths).tolist() == [13, 9]
    step = lambda: model(ids[:, :1], attention_mask=jnp.ones((2, 1), bool), cache=cache).logits  # noqa: E731
    want = step()
    monkeypatch.setattr(qwen3, "_decode_kernel",
                        lambda mask: "pallas_interpret" if mask.impl == "paged" else "xla")
    got = step()
    assert_close(np.asarray(got), np.asarray(want), reduction_len=mc.hidden_size, dtype=jnp.float32)
    # the model's cascade path: row 0 reads its first page through a prefix entry, row 1 its table
    prefix = qwen3.PagedPrefix(jnp.asarray([[1]], jnp.int32), jnp.asarray([8], jnp.int32),
                               jnp.asarray([[0]], jnp.int32))
    cache = dataclasses.replace(cache, prefix=prefix)
    assert_close(np.asarray(step()), np.asarray(want), reduction_len=mc.hidden_size,
                 dtype=jnp.float32)
    cache = dataclasses.replace(cache, prefix=dataclasses.replace(prefix, lengths=jnp.asarray([8, 8])))
    with pytest.raises(ValueError, match="PagedPrefix table"):
        step()


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_LIBTPU, reason="libtpu is not installed: no TPU compiler for ahead-of-time lowering")
def test_paged_kernel_compiles_for_tpu_and_declares_the_table_pages():
    from jax.experimental import topologies
    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x1")
    sh = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",)),
                                    jax.sharding.PartitionSpec())
    layers, pages, ps, nkv, g, d, b, per_row = 4, 256, 128, 4, 8, 128, 16, 8
    sds = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    args = (sds((b, 1, nkv * g, d), jnp.bfloat16), sds((layers, pages, nkv, ps, d), jnp.bfloat16),
            sds((layers, pages, nkv, ps, d), jnp.bfloat16), sds((b, per_row), jnp.int32),
            sds((b,), jnp.int32))
    compiled = jax.jit(lambda q, k, v, t, s: paged_attention(
        q, k, v, 2, t, s, scaling=d ** -0.5, kernel="pallas")).lower(*args).compile()
    assert "paged_decode_attention" in compiled.as_text()
    # 4 pages of 128 a grid step (`pages_per_step`), also at the pod's one KV head per chip
    assert decode_kernel.pages_per_step(per_row, ps) == 4
    one_head = [sds((b, 1, g, d), jnp.bfloat16), *(sds((layers, pages, 1, ps, d), jnp.bfloat16),) * 2,
                args[3], args[4]]
    assert "paged_decode_attention" in jax.jit(lambda q, k, v, t, s: paged_attention(
        q, k, v, 2, t, s, scaling=d ** -0.5, kernel="pallas")).lower(*one_head).compile().as_text()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    table_kv = 2 * b * per_row * ps * nkv * d * 2        # every page of the table, K and V, bf16
    assert table_kv <= cost["bytes accessed"] < table_kv * 1.25 < 2 * layers * pages * ps * nkv * d * 2
    # read_pages = 3: the kernel's grid and declared cost are the 3 pages a row reads
    compiled = jax.jit(lambda q, k, v, t, s: paged_attention(
        q, k, v, 2, t, s, scaling=d ** -0.5, kernel="pallas", read_pages=3)).lower(*args).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    read_kv = table_kv * 3 // per_row
    assert read_kv <= cost["bytes accessed"] < read_kv * 1.25, (cost["bytes accessed"], read_kv)
    # a decode step's write moves its rows' slots, not the pool: in place, row by row
    from models.attention import paged_write
    new = sds((b, 1, nkv, d), jnp.bfloat16)
    compiled = jax.jit(lambda k, v, n, t, s: paged_write(
        k, v, n, n, 2, t, s, jnp.ones((b, 1), bool)), donate_argnums=(0, 1)).lower(
        args[1], args[2], new, args[3], args[4]).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    pool = layers * pages * ps * nkv * d * 2
    # ~1% of the pool (each (row, head) update touches its slot's tile); a layout conversion of
    # the pool around the write (what an update of all of a row's heads at once compiles to)
    # would read and write it twice over
    assert cost["bytes accessed"] < pool / 50, (cost["bytes accessed"], pool)
    from ace_jax.runtime import tpu_compile
    assert tpu_compile.large_copies(compiled.as_text(), pool) == []
