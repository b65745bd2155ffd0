"""Tests of models/attention.py and its wiring into models/qwen3.py.

* every kernel equals the reference ``dot_product_attention`` (with the dense mask of the same
  convention, `segment_mask`) in values and in gradients wrt q, k, v on the real query rows:
  padding, odd lengths, lengths not a multiple of the block, GQA, a causal offset, fp32 and bf16;
  padding rows stay finite forward and backward;
* blockwise attention never forms a [T, S] array (compiled temporaries at T = S = 4096) and never
  touches key blocks above the diagonal; decode attention reads only the filled cache blocks;
* splash attention (Pallas interpret mode on CPU) equals the reference, and lowers and compiles
  for TPU v5p:2x2x2 ahead of time under a mesh (skipped without libtpu);
* the model with attention_impl="blockwise" equals "dot" (logits, loss gradients, a KV-cache
  decode); ``positions`` defaults; the config fields and `target_platform`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.attention import (
    DOT_MAX_KEYS,
    blockwise_attention,
    decode_attention,
    decode_attention_shared_prefix,
    resolve_attention_impl,
    segment_mask,
    splash_attention,
)
from models.configs import (
    RUNTIME_FIELDS,
    ModelConfig,
    UnsupportedConfigError,
    target_platform,
    tiny_dense,
    tiny_moe,
)
from models.qwen3 import Qwen3ForCausalLM, dot_product_attention, flat_params, init_cache, set_flat_params
from tests.numerics import assert_close

F32 = jnp.float32
_HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None


def _inputs(b, t, s, nq, nkv, d, offset, pads, seed=0):
    """q, k, v (fp32 numpy), segment ids (1 real / 0 left padding) and a cotangent that is zero on
    padding query rows. ``pads``: padding slots per row (keys; the queries are the last T slots
    when S == T + offset, else all real)."""
    rng = np.random.RandomState(seed)
    q = rng.randn(b, t, nq, d).astype(np.float32)
    k = rng.randn(b, s, nkv, d).astype(np.float32)
    v = rng.randn(b, s, nkv, d).astype(np.float32)
    kv_seg = np.ones((b, s), np.int32)
    for row, p in enumerate(pads):
        kv_seg[row, :p] = 0
    q_seg = kv_seg[:, offset:offset + t] if s == t + offset else np.ones((b, t), np.int32)
    ct = rng.randn(b, t, nq, d).astype(np.float32) * (q_seg != 0)[:, :, None, None]
    return q, k, v, q_seg, kv_seg, ct


def _out_and_grads(fn, q, k, v, ct):
    """fn(q, k, v) and the gradients of sum(fn(q, k, v) * ct) wrt q, k, v (one compiled program)."""
    @jax.jit
    def run(q, k, v):
        out, vjp = jax.vjp(fn, q, k, v)
        return out, vjp(ct.astype(out.dtype))

    return run(q, k, v)


def _assert_matches_reference(fn, args, dtype, scaling):
    q, k, v, q_seg, kv_seg, ct, offset = args
    mask = segment_mask(q_seg, kv_seg, offset)
    want_out, want_g = _out_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask, scaling, dtype),
                                      q, k, v, ct)
    got_out, got_g = _out_and_grads(fn, q, k, v, ct)
    real = q_seg != 0
    s = k.shape[1]
    # outputs and gradients are sums over the S keys (dk, dv over the T queries; T <= S here)
    assert_close(np.asarray(got_out, np.float32)[real], np.asarray(want_out, np.float32)[real], reduction_len=s,
                 dtype=dtype)
    assert np.isfinite(np.asarray(got_out, np.float32)).all()  # padding rows included
    for name, got, want in zip("qkv", got_g, want_g):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        if name == "q":
            got, want = got[real], want[real]  # padding rows' gradients are garbage (0 here)
        assert_close(got, want, reduction_len=s, dtype=dtype, err_msg=f"d{name}")


# ------------------------------------------------------------------------------------------ blockwise
@pytest.mark.parametrize("shape, dtype", [
    # b, t, s, nq, nkv, d, offset, pads, block_q, block_kv
    ((2, 37, 37, 4, 2, 8, 0, (12, 5), 8, 16), F32),           # odd T, not a multiple of a block, GQA
    ((2, 37, 37, 4, 2, 8, 0, (12, 5), 8, 16), jnp.bfloat16),
    ((2, 13, 45, 4, 2, 8, 32, (20, 3), 8, 8), F32),            # queries at slots [32, 45) (offset)
    ((1, 64, 64, 2, 2, 16, 0, (0,), 64, 16), F32),             # MHA, one query block, no padding
], ids=["odd_gqa_fp32", "odd_gqa_bf16", "offset_fp32", "mha_fp32"])
def test_blockwise_equals_dot_product_attention(shape, dtype):
    b, t, s, nq, nkv, d, offset, pads, bq, bk = shape
    q, k, v, q_seg, kv_seg, ct = _inputs(b, t, s, nq, nkv, d, offset, pads)
    scaling = d ** -0.5

    def fn(q, k, v):
        return blockwise_attention(q, k, v, q_seg, kv_seg, offset, scaling=scaling, dtype=dtype, block_q=bq,
                                   block_kv=bk)

    _assert_matches_reference(fn, (q, k, v, q_seg, kv_seg, ct, offset), dtype, scaling)


def test_blockwise_padding_rows_are_finite_forward_and_backward():
    q, k, v, q_seg, kv_seg, _ = _inputs(2, 21, 21, 4, 2, 8, 0, (9, 2), seed=1)
    ct = np.random.RandomState(2).randn(*q.shape).astype(np.float32)  # non-zero on padding rows too
    fn = lambda q, k, v: blockwise_attention(q, k, v, q_seg, kv_seg, scaling=0.3, block_q=4, block_kv=8)  # noqa: E731
    out, grads = _out_and_grads(fn, q, k, v, ct)
    assert np.isfinite(np.asarray(out)).all() and all(np.isfinite(np.asarray(g)).all() for g in grads)
    np.testing.assert_array_equal(np.asarray(out)[q_seg == 0], 0.0)  # no visible key: 0


def test_blockwise_skips_key_blocks_above_the_diagonal():
    # NaN values in slots [40, 48): a computed block multiplies them by p = 0 and gives NaN, so the
    # queries before slot 40 stay finite only if their query blocks never visit that key block
    q, k, v, q_seg, kv_seg, _ = _inputs(1, 48, 48, 2, 1, 8, 0, (0,))
    v[:, 40:] = np.nan
    ct = np.zeros(q.shape, np.float32)
    ct[:, :40] = 1.0
    fn = lambda q, k, v: blockwise_attention(q, k, v, q_seg, kv_seg, scaling=0.3, block_q=8, block_kv=8)  # noqa: E731
    out, (dq, _, _) = _out_and_grads(fn, q, k, v, ct)
    out, dq = np.asarray(out), np.asarray(dq)
    assert np.isfinite(out[:, :40]).all() and np.isnan(out[:, 40:]).all()
    assert np.isfinite(dq[:, :40]).all()  # the backward skips them too
    dense = np.asarray(dot_product_attention(q, k, v, segment_mask(q_seg, kv_seg), 0.3, F32))
    assert np.isnan(dense[:, :40]).any()  # the reference does compute them (the check can fail)


def test_blockwise_memory_has_no_t_by_s_intermediate():
    t = s = 4096
    q = jax.ShapeDtypeStruct((1, t, 2, 16), F32)
    kv = jax.ShapeDtypeStruct((1, s, 1, 16), F32)
    seg = jnp.ones((1, t), jnp.int32)

    def compiled_temp_bytes(attn):
        loss = lambda q, k, v: jnp.sum(attn(q, k, v))  # noqa: E731
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    blockwise = compiled_temp_bytes(lambda q, k, v: blockwise_attention(q, k, v, seg, seg, scaling=0.25,
                                                                        block_q=256, block_kv=256))
    dense = compiled_temp_bytes(lambda q, k, v: dot_product_attention(q, k, v, segment_mask(seg, seg), 0.25, F32))
    ts_bytes = t * s * 4  # one fp32 [T, S] array
    assert dense >= ts_bytes  # the measurement sees a [T, S] array when there is one
    assert blockwise < ts_bytes / 8, (blockwise, ts_bytes)  # O(T x block): ~4 MB measured


def test_bad_arguments_are_clear():
    q, k, v, q_seg, kv_seg, _ = _inputs(1, 8, 8, 4, 2, 8, 0, (0,))
    with pytest.raises(ValueError, match="not a multiple of kv heads"):
        blockwise_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2), q_seg, kv_seg, scaling=1.0)
    with pytest.raises(ValueError, match="kv_segment_ids must be"):
        blockwise_attention(q, k, v, q_seg, kv_seg[:, :5], scaling=1.0)
    with pytest.raises(TypeError, match="must be integer"):
        blockwise_attention(q, k, v, q_seg.astype(np.float32), kv_seg, scaling=1.0)
    with pytest.raises(TypeError, match="concrete int offset"):
        jax.jit(lambda o: splash_attention(q, k, v, q_seg, kv_seg, o, scaling=1.0, interpret=True))(jnp.int32(0))
    with pytest.raises(ValueError, match="multiples of 128"):
        splash_attention(q, k, v, q_seg, kv_seg, scaling=1.0, block_q=100, interpret=True)
    with pytest.raises(ValueError, match="attention_impl"):
        resolve_attention_impl("flash", "cpu", 10)


# ------------------------------------------------------------------------------------------ decode
_decode_stack = jax.jit(functools.partial(decode_attention, scaling=0.3, block_kv=8))


@pytest.mark.parametrize("filled", [9, 16, 37])
def test_decode_attention_equals_dot_product_attention(filled):
    b, s, nq, nkv, d = 2, 37, 4, 2, 8  # S not a multiple of the block (8): the last block is shifted
    rng = np.random.RandomState(filled)
    q = rng.randn(b, 1, nq, d).astype(np.float32)
    k, v = (rng.randn(3, b, s, nkv, d).astype(np.float32) for _ in range(2))  # a stack of 3 layers
    kv_mask = np.ones((b, s), bool)
    kv_mask[1, :5] = False
    kv_mask[:, filled:] = False  # unfilled slots (a cache holds zeros there)
    visible = kv_mask & (np.arange(s) < filled)
    want = dot_product_attention(q, k[1], v[1], jnp.asarray(visible[:, None, :]), 0.3, F32)
    got = _decode_stack(q, k, v, kv_mask, jnp.int32(filled), layer=jnp.int32(1))  # traced length and layer
    real = visible.any(axis=1)
    assert_close(np.asarray(got)[real], np.asarray(want)[real], reduction_len=s)
    if filled == 37:  # one layer, a concrete length
        one_layer = decode_attention(q, k[1], v[1], kv_mask, filled, scaling=0.3, block_kv=8)
        assert_close(one_layer, got, reduction_len=s)


def test_decode_attention_reads_only_the_filled_blocks():
    b, s, nkv, d = 1, 64, 1, 8
    rng = np.random.RandomState(0)
    q = rng.randn(b, 1, 2, d).astype(np.float32)
    k, v = rng.randn(b, s, nkv, d).astype(np.float32), rng.randn(b, s, nkv, d).astype(np.float32)
    v[:, 24:] = np.nan  # blocks 3.. of 8 slots: never read while filled <= 24
    kv_mask = np.ones((b, s), bool)
    out = jax.jit(lambda f: decode_attention(q, k, v, kv_mask, f, scaling=0.3, block_kv=8))(jnp.int32(20))
    assert np.isfinite(np.asarray(out)).all()


@pytest.mark.parametrize("filled", [1, 9, 20])
def test_shared_prefix_decode_equals_the_prefix_copied_per_row(filled):
    """Cascade attention: G rows per prefix read it once; equals `decode_attention` on each row's
    prefix and own slots laid end to end (padded prefix slots, a row whose own slots are all
    padding, traced and concrete lengths, a layer stack)."""
    b, gs, p, m, nkv, g, d = 3, 4, 37, 20, 2, 3, 8
    n = b * gs
    rng = np.random.RandomState(filled)
    q = rng.randn(n, 1, nkv * g, d).astype(np.float32)
    pk, pv = (rng.randn(2, b, p, nkv, d).astype(np.float32) for _ in range(2))
    ok, ov = (rng.randn(2, n, m, nkv, d).astype(np.float32) for _ in range(2))
    prefix_mask = rng.rand(b, p) > 0.2
    prefix_mask[:, -1] = True
    own_mask = rng.rand(n, m) > 0.1
    own_mask[5] = False
    whole_k = np.concatenate([np.repeat(pk, gs, axis=1), ok], axis=2)
    whole_v = np.concatenate([np.repeat(pv, gs, axis=1), ov], axis=2)
    whole_mask = np.concatenate([np.repeat(prefix_mask, gs, axis=0), own_mask], axis=1)
    want = _decode_stack(q, whole_k, whole_v, whole_mask, jnp.int32(p + filled), layer=jnp.int32(1))
    cascade = jax.jit(functools.partial(decode_attention_shared_prefix, scaling=0.3, block_kv=8))
    got = cascade(q, ok, ov, own_mask, jnp.int32(filled), pk, pv, prefix_mask, layer=jnp.int32(1))
    assert_close(got, want, reduction_len=p + m)
    concrete = decode_attention_shared_prefix(q, ok[1], ov[1], own_mask, filled, pk[1], pv[1],
                                              prefix_mask, scaling=0.3, block_kv=8)
    assert_close(concrete, want, reduction_len=p + m)
    with pytest.raises(ValueError, match="groups"):
        decode_attention_shared_prefix(q[:5], ok[1, :5], ov[1, :5], own_mask[:5], filled, pk[1],
                                       pv[1], prefix_mask, scaling=0.3)


# ------------------------------------------------------------------------------------------ splash
def test_splash_equals_dot_product_attention_interpreted():
    # 60 queries at slots [40, 100): T and S padded to one 128 block each, GQA 2 / 1, left padding
    q, k, v, q_seg, kv_seg, ct = _inputs(2, 60, 100, 2, 1, 32, 40, (50, 7), seed=3)
    scaling = 32 ** -0.5

    def fn(q, k, v):
        return splash_attention(q, k, v, q_seg, kv_seg, 40, scaling=scaling, dtype=F32, interpret=True)

    _assert_matches_reference(fn, (q, k, v, q_seg, kv_seg, ct, 40), F32, scaling)
    out = np.asarray(fn(q, k, v))
    assert np.isfinite(out).all()  # padding rows included


def _tpu_mesh():
    from jax.experimental import topologies

    topology = topologies.get_topology_desc(platform="tpu", topology_name="v5p:2x2x2")
    return jax.sharding.Mesh(np.array(topology.devices).reshape(1, 4, 2, 1), ("data", "fsdp", "tensor", "expert"))


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_LIBTPU, reason="libtpu is not installed: no TPU compiler for ahead-of-time lowering")
def test_splash_compiles_for_tpu_under_a_mesh():
    mesh = _tpu_mesh()
    P, named = jax.sharding.PartitionSpec, jax.sharding.NamedSharding
    b, t, nq, nkv, d = 8, 4000, 8, 2, 128  # T padded to 4096 inside
    heads, segs = named(mesh, P("fsdp", None, "tensor", None)), named(mesh, P("fsdp", None))
    args = [jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16, sharding=heads) for n in (nq, nkv, nkv)]
    args += [jax.ShapeDtypeStruct((b, t), jnp.int32, sharding=segs)] * 2

    def loss(q, k, v, q_seg, kv_seg):
        return jnp.sum(splash_attention(q, k, v, q_seg, kv_seg, 0, scaling=d ** -0.5).astype(F32))

    with jax.set_mesh(mesh):  # the wrapper runs the kernel in shard_map over this mesh
        compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    hlo = compiled.as_text()
    assert hlo.count("tpu_custom_call") >= 3  # the forward, dq and dkv kernels
    assert "all-gather" not in hlo  # every device runs on its own batch / head shard
    # per device, one fp32 [T, S] per local head: 537 MB; the kernel's temporaries are O(T) (fp32
    # log-sum-exp residuals padded to 128 lanes, gradient buffers): 55 MB measured
    local_scores = (b // 4) * (nq // 2) * 4096 * 4096 * 4
    assert compiled.memory_analysis().temp_size_in_bytes < local_scores / 4


@pytest.mark.slow
@pytest.mark.skipif(not _HAS_LIBTPU, reason="libtpu is not installed: no TPU compiler for ahead-of-time lowering")
def test_model_with_platform_tpu_compiles_splash_for_tpu():
    mesh = _tpu_mesh()
    cfg = tiny_moe(platform="tpu", num_hidden_layers=1, remat_policy="full")  # "auto" -> splash
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated), state)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp", None))
    ids = jax.ShapeDtypeStruct((8, 256), jnp.int32, sharding=rows)
    mask = jax.ShapeDtypeStruct((8, 256), jnp.bool_, sharding=rows)

    def loss(state, ids, mask):
        return jnp.sum(nnx.merge(graphdef, state)(ids, attention_mask=mask).logits[..., 0] * mask)

    with jax.set_mesh(mesh):
        compiled = jax.jit(jax.grad(loss)).lower(state, ids, mask).compile()
    assert "tpu_custom_call" in compiled.as_text()


# ------------------------------------------------------------------------------------------ choice, config
def test_resolve_attention_impl_and_config_fields():
    assert resolve_attention_impl("auto", "tpu", 8) == "splash"
    assert resolve_attention_impl("auto", "cpu", DOT_MAX_KEYS) == "dot"
    assert resolve_attention_impl("auto", "gpu", DOT_MAX_KEYS + 1) == "blockwise"
    assert resolve_attention_impl("dot", "tpu", 10 ** 5) == "dot"
    cfg = tiny_moe(attention_impl="blockwise", platform="tpu")
    assert target_platform(cfg) == "tpu" and target_platform(tiny_moe()) == jax.default_backend()
    assert "attention_impl" in RUNTIME_FIELDS and "platform" in RUNTIME_FIELDS
    d = cfg.to_hf_dict()
    assert "attention_impl" not in d and "platform" not in d
    assert ModelConfig.from_hf_dict(d, **{f: getattr(cfg, f) for f in RUNTIME_FIELDS}) == cfg
    with pytest.raises(UnsupportedConfigError, match="attention_impl='flash'"):
        tiny_moe(attention_impl="flash")
    with pytest.raises(UnsupportedConfigError, match="platform='metal'"):
        tiny_moe(platform="metal")


# ------------------------------------------------------------------------------------------ the model
def _model(cfg: ModelConfig, seed: int = 0) -> Qwen3ForCausalLM:
    """Weights with non-trivial attention (spread-out scores) from NumPy, no RNG kernels."""
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.RandomState(seed)
    flat = {}
    for name, value in flat_params(model).items():
        noise = rng.randn(*value.shape).astype(np.float32)
        flat[name] = 1.0 + 0.1 * noise if name.endswith("/scale") else (0.5 if "embed" in name else 0.15) * noise
    set_flat_params(model, flat)
    return model


def _with_impl(model: Qwen3ForCausalLM, impl: str) -> Qwen3ForCausalLM:
    other = nnx.eval_shape(lambda: Qwen3ForCausalLM(dataclasses.replace(model.config, attention_impl=impl),
                                                    rngs=nnx.Rngs(0)))
    set_flat_params(other, flat_params(model))
    return other


def _left_padded(cfg, b, t, pads, seed=0):
    ids = np.random.RandomState(seed).randint(0, cfg.vocab_size, (b, t)).astype(np.int32)
    mask = np.ones((b, t), bool)
    for row, p in enumerate(pads):
        mask[row, :p] = False
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)


@pytest.fixture(scope="module")
def dot_model():
    # "dense" MoE dispatch: the cheapest to compile; both kernels see the same layers
    return _model(tiny_moe(attention_impl="dot", moe_dispatch="dense"))


def _logits(model, ids, pos=None, **kw):
    """model(ids, pos, **kw).logits under jit (``kw`` closed over: a cache_index stays concrete)."""
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(lambda s, ids, pos: nnx.merge(graphdef, s)(ids, pos, **kw).logits)(state, ids, pos))


def test_model_blockwise_equals_dot_logits_and_loss_gradients(dot_model):
    ids, pos, mask = _left_padded(dot_model.config, 3, 11, (0, 4, 7))

    def run(model):
        def loss(model):
            out = model(ids, pos, attention_mask=mask)
            return jnp.sum(jax.nn.log_softmax(out.logits)[..., 5] * mask) + out.aux_loss, out.logits

        graphdef, state = nnx.split(model)
        (_, logits), grads = jax.jit(lambda s: nnx.value_and_grad(loss, has_aux=True)(nnx.merge(graphdef, s)))(state)
        return np.asarray(logits), flat_params(grads)

    want_logits, want_grads = run(dot_model)
    got_logits, got_grads = run(_with_impl(dot_model, "blockwise"))
    real = np.asarray(mask)
    # a chain of reductions: the longest is the vocab / hidden contraction or the 11 tokens x hidden
    # of a weight gradient
    reduction_len = 11 * dot_model.config.hidden_size
    assert_close(got_logits[real], want_logits[real], reduction_len=reduction_len)
    for name, want in want_grads.items():
        want = np.asarray(want)
        assert np.abs(want).max() > 0, name
        assert_close(got_grads[name], want, reduction_len=reduction_len, err_msg=name)


def test_model_blockwise_cache_decode_matches_full_forward(dot_model):
    model = _with_impl(dot_model, "blockwise")
    cfg = model.config
    b, total, prefill = 3, 10, 4
    ids, pos, mask = _left_padded(cfg, b, total, (0, 2, 5), seed=1)
    full = _logits(dot_model, ids, pos, attention_mask=mask)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, pos, mask, cache, index):  # a traced cache index: decode_attention for T == 1
        out = nnx.merge(graphdef, state)(ids, pos, attention_mask=mask, cache=cache, cache_index=index)
        return out.logits, out.cache

    cache = init_cache(cfg, b, total + 3)
    got = []
    for lo, hi in [(0, prefill), (prefill, prefill + 2)] + [(t, t + 1) for t in range(prefill + 2, total)]:
        logits, cache = step(state, ids[:, lo:hi], pos[:, lo:hi], mask[:, lo:hi], cache, jnp.int32(lo))
        got.append(logits)
    got = np.asarray(jnp.concatenate(got, axis=1))
    real = np.asarray(mask)
    assert_close(got[real], full[real], reduction_len=total * cfg.hidden_size)
    np.testing.assert_array_equal(got.argmax(-1)[real], full.argmax(-1)[real])  # the same greedy tokens


def test_positions_default_to_the_slot_index():
    # a default that ignored the slot (or the cache index) would rotate the keys / queries differently
    model = _model(tiny_dense(num_hidden_layers=1))
    cfg = model.config
    ids = jnp.asarray(np.random.RandomState(4).randint(0, cfg.vocab_size, (2, 9)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    assert_close(_logits(model, ids), _logits(model, ids, pos))  # the same math, positions a constant or not
    cache = model(ids[:, :5], pos[:, :5], cache=init_cache(cfg, 2, 12), cache_index=0).cache
    assert_close(_logits(model, ids[:, 5:], cache=cache, cache_index=5),
                 _logits(model, ids[:, 5:], pos[:, 5:], cache=cache, cache_index=5))
    graphdef, state = nnx.split(model)
    with pytest.raises(ValueError, match="positions are required with a traced cache_index"):
        jax.jit(lambda s, i: nnx.merge(graphdef, s)(ids[:, 5:], cache=cache, cache_index=i).logits)(state, 5)
