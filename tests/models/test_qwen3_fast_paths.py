"""The CPU fast paths of models/qwen3.py equal the reference paths they replace.

* "ragged" MoE dispatch on CPU: `moe_dispatch_blocked` (blocked grouped matmuls, custom VJP) and
  `moe_dispatch_all_experts` (a decode step's few tokens) give the dense dispatch's outputs and
  gradients;
* `causal_attention` (query blocks that skip the masked upper triangle) equals
  `dot_product_attention` on every row that has a visible key, gradients included;
* the "decode" KV-cache layout (per-layer k^T / v buffers, unrolled layers, hoisted per-layer
  weights) reproduces a full forward token by token, like the "standard" layout;
* a concrete ``cache_index`` (attention over the filled slots only) equals a traced one.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.configs import tiny_moe
from models.qwen3 import (
    Qwen3ForCausalLM,
    cache_shapes,
    causal_attention,
    dot_product_attention,
    init_cache,
    moe_block_size,
    moe_dispatch_all_experts,
    moe_dispatch_blocked,
    moe_dispatch_dense,
    moe_dispatch_dropless,
)
from tests.numerics import assert_close

F32 = jnp.float32


def _moe_inputs(n, e=8, k=2, h=32, im=16, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(n, h).astype(np.float32)
    # skewed routing: expert 0 is popular, some experts get nothing
    logits = rng.randn(n, e) + np.where(np.arange(e) == 0, 2.0, 0.0) - np.where(np.arange(e) >= e - 2, 5.0, 0.0)
    idx = np.argsort(-logits, axis=1)[:, :k].astype(np.int32)
    w = rng.rand(n, k).astype(np.float32)
    ws = [(0.3 * rng.randn(*s)).astype(np.float32) for s in ((e, h, im), (e, h, im), (e, im, h))]
    ct = rng.randn(n, h).astype(np.float32)
    return x, idx, w, ws, ct


def _value_and_grads(fn, x, idx, w, ws, ct):
    def loss(x, w, wg, wu, wd):
        return jnp.sum(fn(x, idx, w, wg, wu, wd, F32) * ct)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))(x, w, *ws)


@pytest.mark.parametrize("n, block", [(5, None), (40, 8), (300, None), (300, 16), (1024, None)])
def test_blocked_dispatch_equals_dense(n, block):
    x, idx, w, ws, ct = _moe_inputs(n)
    want_v, want_g = _value_and_grads(moe_dispatch_dense, x, idx, w, ws, ct)
    blocked = lambda *a: moe_dispatch_blocked(*a, block_size=block)  # noqa: E731
    got_v, got_g = _value_and_grads(blocked, x, idx, w, ws, ct)
    assert_close(got_v, want_v, reduction_len=x.size)
    for name, a, b in zip(("x", "weights", "gate", "up", "down"), got_g, want_g):
        assert_close(a, b, reduction_len=max(n, x.shape[1]), err_msg=name)  # sums over tokens / hidden
    out = jax.jit(lambda *a: blocked(*a, F32))(x, idx, w, *ws)
    assert_close(out, moe_dispatch_dense(x, idx, w, *ws, F32), reduction_len=x.shape[1])


def test_block_size_and_padding_bound():
    assert moe_block_size(8192, 8) == 128 and moe_block_size(32, 8) == 8 and moe_block_size(1000, 8) == 16
    # the worst case for padding: every expert gets one assignment more than a whole block
    n, e, k, bs = 36, 4, 2, 8  # 72 assignments = 4 experts x (2 blocks + 2 rows)
    idx = np.repeat(np.arange(e), n * k // e).reshape(n, k).astype(np.int32)
    x, _, w, ws, _ = _moe_inputs(n, e=e, k=k)
    assert_close(moe_dispatch_blocked(x, idx, w, *ws, F32, block_size=bs),
                 moe_dispatch_dense(x, idx, w, *ws, F32), reduction_len=x.shape[1])


@pytest.mark.parametrize("n", [1, 16])
def test_all_experts_dispatch_equals_dense(n):
    x, idx, w, ws, ct = _moe_inputs(n, seed=1)
    want_v, want_g = _value_and_grads(moe_dispatch_dense, x, idx, w, ws, ct)
    got_v, got_g = _value_and_grads(moe_dispatch_all_experts, x, idx, w, ws, ct)
    assert_close(got_v, want_v, reduction_len=x.size)
    for a, b in zip(got_g, want_g):
        assert_close(a, b, reduction_len=max(n, x.shape[1]))
    assert_close(moe_dispatch_dropless(x, idx, w, *ws, F32, platform="cpu"),
                 moe_dispatch_dense(x, idx, w, *ws, F32),
                 reduction_len=x.shape[1])


@pytest.mark.parametrize("t", [64, 200])
def test_causal_attention_equals_dot_product_attention(t):
    b, nq, nkv, d = 3, 4, 2, 8
    rng = np.random.RandomState(t)
    q, k, v = (rng.randn(b, t, n, d).astype(np.float32) for n in (nq, nkv, nkv))
    real = np.ones((b, t), bool)
    real[1, :7] = False
    real[2, :90] = False
    idx = np.arange(t)
    mask = jnp.asarray((idx[None, :, None] >= idx[None, None, :]) & real[:, None, :])
    ct = rng.randn(b, t, nq, d).astype(np.float32) * real[:, :, None, None]

    def loss(fn):
        return jax.jit(jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v, mask, 0.3, F32) * ct),
                                          argnums=(0, 1, 2)))(q, k, v)

    cpu_causal = functools.partial(causal_attention, platform="cpu")  # the CPU query-block path
    (want, want_g), (got, got_g) = loss(dot_product_attention), loss(cpu_causal)
    assert_close(got, want, reduction_len=ct.size)
    for a, b_ in zip(got_g, want_g):
        assert_close(a, b_, reduction_len=t)  # sums over the t keys / queries
    out = cpu_causal(q, k, v, mask, 0.3, F32)
    assert_close(np.asarray(out)[real], np.asarray(dot_product_attention(q, k, v, mask, 0.3, F32))[real],
                 reduction_len=t)


def _tiny(**kw):
    return Qwen3ForCausalLM(tiny_moe(**kw), rngs=nnx.Rngs(3))


@pytest.mark.parametrize("kw", [dict(), dict(num_hidden_layers=3, mlp_only_layers=(1,), remat_policy="full")])
def test_decode_layout_cache_matches_full_forward(kw):
    model = _tiny(**kw)
    cfg = model.config
    b, total, prefill = 3, 11, 6
    rng = np.random.RandomState(0)
    ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (b, total)), jnp.int32)
    mask = np.ones((b, total), bool)
    mask[1, :2] = False
    mask[2, :4] = False
    pos = jnp.asarray(np.clip(np.cumsum(mask, 1) - 1, 0, None), jnp.int32)
    mask = jnp.asarray(mask)
    full = model(ids, pos, attention_mask=mask).logits
    graphdef, state = nnx.split(model)

    @jax.jit
    def prefill_fn(state, ids, pos, mask, cache):
        out = nnx.merge(graphdef, state)(ids, pos, attention_mask=mask, cache=cache, cache_index=0)
        return out.logits, out.cache

    @jax.jit
    def step_fn(state, ids, pos, mask, cache, index):
        model = nnx.merge(graphdef, state)
        out = model(ids, pos, attention_mask=mask, cache=cache, cache_index=index, layer_params=model.layer_params())
        return out.logits, out.cache

    for layout in ("decode", "standard"):
        cache = init_cache(cfg, b, total + 3, layout=layout)
        assert [(k.shape, v.shape) for k, v in zip(cache.k, cache.v)] == cache_shapes(cfg, b, total + 3, layout)
        logits, cache = prefill_fn(state, ids[:, :prefill], pos[:, :prefill], mask[:, :prefill], cache)
        got = [logits]
        for t in range(prefill, total):
            logits, cache = step_fn(state, ids[:, t:t + 1], pos[:, t:t + 1], mask[:, t:t + 1], cache, jnp.int32(t))
            got.append(logits)
        assert cache.layout == layout
        got = np.asarray(jnp.concatenate(got, axis=1))
        real = np.asarray(mask)
        assert_close(got[real], np.asarray(full)[real], reduction_len=cfg.hidden_size, err_msg=layout)
        np.testing.assert_array_equal(cache.kv_mask[:, :total], mask)


def test_concrete_cache_index_equals_traced():
    model = _tiny()
    cfg = model.config
    rng = np.random.RandomState(1)
    ids = jnp.asarray(rng.randint(0, cfg.vocab_size, (2, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    cache = init_cache(cfg, 2, 16)
    cache = model(ids[:, :5], pos[:, :5], cache=cache, cache_index=0).cache
    concrete = model(ids[:, 5:], pos[:, 5:], cache=cache, cache_index=5)  # reads slots [0, 9) only
    graphdef, state = nnx.split(model)
    traced = jax.jit(lambda s, c, i: nnx.merge(graphdef, s)(ids[:, 5:], pos[:, 5:], cache=c, cache_index=i))(
        state, cache, jnp.int32(5))
    assert_close(concrete.logits, traced.logits, reduction_len=cfg.hidden_size)
    for a, b in zip(jax.tree.leaves(concrete.cache), jax.tree.leaves(traced.cache)):
        assert_close(a, b, reduction_len=cfg.hidden_size)


def test_bad_cache_layout_is_clear():
    cfg = tiny_moe()
    with pytest.raises(ValueError, match="unknown KV-cache layout"):
        init_cache(cfg, 2, 8, layout="transposed")
    model = _tiny()
    ids = jnp.zeros((2, 3), jnp.int32)
    cache = init_cache(cfg, 2, 8, layout="decode")
    bad = type(cache)(k=cache.k[:1], v=cache.v[:1], kv_mask=cache.kv_mask, layout="decode")
    with pytest.raises(ValueError, match="'decode' cache has 1 layers"):
        model(ids, ids, cache=bad, cache_index=0)
