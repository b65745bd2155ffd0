"""Tests of models/qwen3.py: parameter tree, dispatch agreement, KV cache, remat, scan, aux loss, RoPE.

HF parity of whole forwards is tested in test_hf_mapping (H2); here each property is checked against
an independent statement of it (NumPy formula, a second code path of the same model, the jaxpr).
All shapes are tiny (hidden 32, <= 4 layers, vocab 256), fp32 unless stated.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.configs import ModelConfig, tiny_dense, tiny_moe
from models.qwen3 import (
    KVCache,
    Qwen3ForCausalLM,
    expert_capacity,
    moe_dispatch_capacity,
    moe_dispatch_dense,
    moe_dispatch_ragged,
    flat_params,
    init_cache,
    load_balancing_loss,
    logical_axes,
    rope_inv_freq,
    router_load_stats,
    set_flat_params,
)
from tests.numerics import assert_close


def _random_flat(cfg: ModelConfig, seed: int = 0, router_std: float = 1.0) -> dict[str, np.ndarray]:
    """NumPy weights for every Param: spread-out router (top-k choices are not near-ties), non-unit norms."""
    abstract = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.RandomState(seed + 100)
    flat = {}
    for name, value in flat_params(abstract).items():
        noise = rng.randn(*value.shape).astype(np.float32)
        if name.endswith("mlp/gate/kernel"):
            flat[name] = router_std * noise
        elif name.endswith("/scale"):
            flat[name] = 1.0 + 0.1 * noise
        elif name == "embed_tokens/embedding":
            flat[name] = 0.5 * noise
        else:
            flat[name] = 0.08 * noise
    return flat


def _model(cfg: ModelConfig, seed: int = 0, router_std: float = 1.0, flat=None) -> Qwen3ForCausalLM:
    """A concrete model built abstractly then filled from NumPy (no RNG kernels to compile: fast on CPU)."""
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    set_flat_params(model, _random_flat(cfg, seed, router_std) if flat is None else flat)
    return model


def _with_config(model: Qwen3ForCausalLM, **changes) -> Qwen3ForCausalLM:
    """The same weights under a changed runtime config (dispatch, remat, scan, dtype)."""
    return _model(dataclasses.replace(model.config, **changes), flat=flat_params(model))


def _batch(cfg: ModelConfig, b: int = 2, t: int = 6, pad: tuple[int, ...] = (0, 2), seed: int = 0):
    """Left-padded batch: ids [B,T], positions [B,T] (0 at the first real token), mask bool [B,T]."""
    ids = np.random.RandomState(seed).randint(0, cfg.vocab_size, (b, t)).astype(np.int32)
    mask = np.ones((b, t), bool)
    for row, p in enumerate(pad):
        mask[row, :p] = False
    pos = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int32)
    return jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)


def _forward(model, ids, pos, mask, **kw):
    graphdef, state = nnx.split(model)

    @jax.jit
    def f(state, ids, pos, mask):
        return nnx.merge(graphdef, state)(ids, pos, attention_mask=mask, **kw)

    return f(state, ids, pos, mask)


@pytest.fixture(scope="module")
def moe_model():
    return _model(tiny_moe())


@pytest.fixture(scope="module")
def dense_model():
    return _model(tiny_dense())


# ------------------------------------------------------------------------------------------ parameter tree
def _expected_tree(cfg: ModelConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    h, nq, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    i, im, e, v = cfg.intermediate_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.vocab_size
    tree = {"embed_tokens/embedding": ((v, h), ("vocab", "embed")), "norm/scale": ((h,), ("embed",))}
    if not cfg.tie_word_embeddings:
        tree["lm_head/kernel"] = ((h, v), ("embed", "vocab"))
    for g, grp in enumerate(cfg.layer_groups()):
        L, p = grp.count, f"layers/{g}/"
        tree.update({
            p + "input_layernorm/scale": ((L, h), ("layers", "embed")),
            p + "post_attention_layernorm/scale": ((L, h), ("layers", "embed")),
            p + "self_attn/q_proj/kernel": ((L, h, nq, d), ("layers", "embed", "heads", "head_dim")),
            p + "self_attn/k_proj/kernel": ((L, h, nkv, d), ("layers", "embed", "kv_heads", "head_dim")),
            p + "self_attn/v_proj/kernel": ((L, h, nkv, d), ("layers", "embed", "kv_heads", "head_dim")),
            p + "self_attn/o_proj/kernel": ((L, nq, d, h), ("layers", "heads", "head_dim", "embed")),
            p + "self_attn/q_norm/scale": ((L, d), ("layers", "head_dim")),
            p + "self_attn/k_norm/scale": ((L, d), ("layers", "head_dim")),
        })
        if grp.kind == "dense":
            tree.update({
                p + "mlp/gate_proj/kernel": ((L, h, i), ("layers", "embed", "mlp")),
                p + "mlp/up_proj/kernel": ((L, h, i), ("layers", "embed", "mlp")),
                p + "mlp/down_proj/kernel": ((L, i, h), ("layers", "mlp", "embed")),
            })
        else:
            tree.update({
                p + "mlp/gate/kernel": ((L, h, e), ("layers", "embed", "router")),
                p + "mlp/experts/gate_proj": ((L, e, h, im), ("layers", "experts", "embed", "mlp")),
                p + "mlp/experts/up_proj": ((L, e, h, im), ("layers", "experts", "embed", "mlp")),
                p + "mlp/experts/down_proj": ((L, e, im, h), ("layers", "experts", "mlp", "embed")),
            })
    return tree


@pytest.mark.parametrize("cfg", [
    tiny_moe(), tiny_dense(), tiny_moe(num_hidden_layers=4, decoder_sparse_step=2, tie_word_embeddings=True),
    tiny_moe(num_hidden_layers=3, mlp_only_layers=(0,)),
], ids=["moe", "dense_tied", "moe_alternating", "moe_mlp_only"])
def test_param_tree_is_the_contract(cfg):
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    expected = _expected_tree(cfg)
    got = {k: tuple(v.shape) for k, v in flat_params(model).items()}
    assert got == {k: s for k, (s, _) in expected.items()}
    axes = logical_axes(model)
    assert axes == {k: a for k, (_, a) in expected.items()}
    assert all(len(axes[k]) == len(s) for k, s in got.items())
    # the names are nnx metadata, readable as partition specs by sharding code
    specs = nnx.get_partition_spec(nnx.state(model, nnx.Param))
    spec_leaves = {"/".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(specs)}
    assert {k: tuple(v) for k, v in spec_leaves.items()} == axes


def test_set_flat_params_validates_names_and_shapes():
    model = _model(tiny_moe())
    flat = {k: np.asarray(v) for k, v in flat_params(model).items()}
    bad = dict(flat)
    bad["layers/0/mlp/gate/kernel"] = np.zeros((2, 32, 7), np.float32)
    with pytest.raises(ValueError, match=r"layers/0/mlp/gate/kernel: expected shape \(2, 32, 8\), got \(2, 32, 7\)"):
        set_flat_params(model, bad)
    missing = {k: v for k, v in flat.items() if k != "norm/scale"}
    with pytest.raises(KeyError, match="norm/scale"):
        set_flat_params(model, missing)
    with pytest.raises(KeyError, match="lm_head/bias"):
        set_flat_params(model, {**flat, "lm_head/bias": np.zeros(3)})
    # a good update is applied and cast to the param dtype
    flat["norm/scale"] = np.full((32,), 2.0, np.float64)
    set_flat_params(model, flat)
    assert flat_params(model)["norm/scale"].dtype == jnp.float32
    np.testing.assert_array_equal(flat_params(model)["norm/scale"], 2.0)


# ------------------------------------------------------------------------------------------ MoE dispatch
def _loss_and_grads(model):
    ids, pos, mask = _batch(model.config)

    def loss(model):
        out = model(ids, pos, attention_mask=mask)
        return jnp.mean(jax.nn.log_softmax(out.logits)[..., 0] * mask) + 0.1 * out.aux_loss, out

    (_, out), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    return out, flat_params(grads)


@pytest.fixture(scope="module")
def dense_dispatch_reference(moe_model):
    return _loss_and_grads(_with_config(moe_model, moe_dispatch="dense"))


@pytest.mark.parametrize("other", ["ragged", "capacity"])
def test_dispatch_strategies_agree_with_dense_reference(moe_model, dense_dispatch_reference, other):
    out_d, g_d = dense_dispatch_reference
    # capacity factor E / k gives C = N slots per expert: nothing can be dropped
    out_r, g_r = _loss_and_grads(_with_config(moe_model, moe_dispatch=other, moe_capacity_factor=4.0))
    assert_close(out_r.logits, out_d.logits, reduction_len=moe_model.config.hidden_size)
    np.testing.assert_allclose(out_r.aux_loss, out_d.aux_loss, rtol=1e-6)
    for name in g_d:
        # a weight's gradient sums over the tokens what backprop summed over the hidden size
        assert_close(g_r[name], g_d[name], reduction_len=out_d.logits[..., 0].size * moe_model.config.hidden_size,
                     err_msg=name)
    assert float(jnp.abs(g_r["layers/0/mlp/experts/down_proj"]).max()) > 0


def test_capacity_dispatch_drops_late_assignments_beyond_capacity():
    rng = np.random.RandomState(3)
    n, k, e, h, im = 12, 2, 4, 8, 6
    x = rng.randn(n, h).astype(np.float32)
    idx = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
    w = rng.rand(n, k).astype(np.float32)
    wg, wu, wd = (rng.randn(*s).astype(np.float32) * 0.3 for s in ((e, h, im), (e, h, im), (e, im, h)))
    assert expert_capacity(n, k, e, 1.0) == 6 and expert_capacity(n, k, e, 100.0) == n
    capacity_fn = jax.jit(moe_dispatch_capacity, static_argnums=(6, 7))
    dense_fn = jax.jit(moe_dispatch_dense, static_argnums=(6,))
    for capacity in (1, 2, 3, n):
        # admitted in token order: the first `capacity` assignments of each expert survive
        seen = np.zeros(e, int)
        kept_w = np.zeros_like(w)
        for t in range(n):
            for j in range(k):
                if seen[idx[t, j]] < capacity:
                    kept_w[t, j] = w[t, j]
                seen[idx[t, j]] += 1
        got = capacity_fn(x, idx, w, wg, wu, wd, jnp.float32, capacity)
        want = dense_fn(x, idx, kept_w, wg, wu, wd, jnp.float32)
        assert_close(got, want, reduction_len=h, err_msg=f"capacity={capacity}")
        if capacity < 3:
            assert (kept_w == 0).any()  # the case really drops something
    ragged_fn = jax.jit(moe_dispatch_ragged, static_argnums=(6,))
    assert_close(ragged_fn(x, idx, w, wg, wu, wd, jnp.float32),
                 dense_fn(x, idx, w, wg, wu, wd, jnp.float32), reduction_len=h)


# ------------------------------------------------------------------------------------------ KV cache
@pytest.mark.parametrize("kind", ["moe", "dense", "mixed_unrolled"])
def test_cache_prefill_and_decode_match_full_forward(kind, moe_model, dense_model):
    if kind == "mixed_unrolled":  # 3 layer groups (3 cache groups), python loop over layers, remat
        model = _model(tiny_moe(num_hidden_layers=3, mlp_only_layers=(1,), scan_layers=False, remat_policy="full"))
    else:
        model = moe_model if kind == "moe" else dense_model
    cfg = model.config
    total, prefill = 9, 4
    ids, pos, mask = _batch(cfg, b=3, t=total, pad=(0, 2, 3), seed=1)
    full = _forward(model, ids, pos, mask).logits

    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, ids, pos, mask, cache, index):
        out = nnx.merge(graphdef, state)(ids, pos, attention_mask=mask, cache=cache, cache_index=index)
        return out.logits, out.cache

    cache = init_cache(cfg, batch=3, max_len=total + 2)  # spare slots stay masked out
    got = []
    # prefill the left-padded prompts, one 2-token chunk, then token by token
    chunks = [(0, prefill), (prefill, prefill + 2)] + [(t, t + 1) for t in range(prefill + 2, total)]
    for a, b in chunks:
        logits, cache = step(state, ids[:, a:b], pos[:, a:b], mask[:, a:b], cache, jnp.int32(a))
        got.append(logits)
    got = jnp.concatenate(got, axis=1)
    real = np.asarray(mask)
    assert_close(np.asarray(got)[real], np.asarray(full)[real], reduction_len=cfg.hidden_size)
    np.testing.assert_array_equal(cache.kv_mask[:, :total], mask)
    assert not bool(cache.kv_mask[:, total:].any())
    # the cached keys of padding slots are never read: changing them leaves the next logits unchanged
    nxt = (ids[:, :1], pos[:, -1:] + 1, jnp.ones((3, 1), bool))
    poison = lambda a: a.at[:, 1, :2].set(1e4).at[:, 2, :3].set(-1e4)  # noqa: E731 (rows 1, 2 are padded 2, 3)
    poisoned = KVCache(k=tuple(map(poison, cache.k)), v=tuple(map(poison, cache.v)), kv_mask=cache.kv_mask)
    a, _ = step(state, *nxt, cache, jnp.int32(total))
    b, _ = step(state, *nxt, poisoned, jnp.int32(total))
    assert_close(a, b, reduction_len=cfg.hidden_size)


def test_cache_rejects_bad_inputs(moe_model):
    cfg = moe_model.config
    ids, pos, mask = _batch(cfg)
    with pytest.raises(ValueError, match="together"):
        moe_model(ids, pos, cache=init_cache(cfg, 2, 8))
    with pytest.raises(ValueError, match="do not fit"):
        moe_model(ids, pos, cache=init_cache(cfg, 2, 4), cache_index=0)
    with pytest.raises(ValueError, match=r"tokens \[5, 11\) do not fit a cache of 8 slots"):
        moe_model(ids, pos, cache=init_cache(cfg, 2, 8), cache_index=5)
    with pytest.raises(ValueError, match="expected"):
        moe_model(ids, pos, cache=init_cache(cfg, 3, 8), cache_index=0)
    with pytest.raises(ValueError, match="positions shape"):
        moe_model(ids, pos[:, :3])
    with pytest.raises(ValueError, match=r"input_ids must be \[B, T\]"):
        moe_model(ids[0], pos[0])


# ------------------------------------------------------------------------------------------ remat and scan
def test_remat_policies_and_unrolled_layers_give_identical_logits_and_grads(moe_model):
    ids, pos, mask = _batch(moe_model.config)

    def run(model):
        def loss(model):
            out = model(ids, pos, attention_mask=mask)
            return jnp.sum(jax.nn.log_softmax(out.logits)[..., 3] * mask) + out.aux_loss, out.logits

        graphdef, state = nnx.split(model)

        @jax.jit
        def f(state):
            return nnx.value_and_grad(loss, has_aux=True)(nnx.merge(graphdef, state))

        (_, logits), grads = f(state)
        return logits, flat_params(grads)

    ref_logits, ref_grads = run(moe_model)
    # Recomputation may fuse differently, so fp32 results agree to rounding, not bit for bit.
    for changes in (dict(remat_policy="full"), dict(remat_policy="dots_saveable"), dict(scan_layers=False)):
        logits, grads = run(_with_config(moe_model, **changes))
        assert_close(logits, ref_logits, reduction_len=moe_model.config.hidden_size, err_msg=str(changes))
        for name in ref_grads:
            scale = float(np.abs(ref_grads[name]).max())
            assert scale > 0, name
            np.testing.assert_allclose(grads[name], ref_grads[name], rtol=1e-5, atol=1e-5 * scale,
                                       err_msg=f"{changes} {name}")


def _count_primitives(jaxpr, name: str) -> list:
    """Every equation of primitive ``name`` in ``jaxpr`` and, recursively, in its sub-jaxprs."""
    found = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == name]
    for sub in jax.extend.core.subjaxprs(jaxpr):
        found += _count_primitives(sub, name)
    return found


def _scans(cfg: ModelConfig) -> list:
    model = nnx.eval_shape(lambda: Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    ids = jnp.zeros((1, 4), jnp.int32)

    def f(state, ids):
        return nnx.merge(graphdef, state)(ids, ids).logits

    return _count_primitives(jax.make_jaxpr(f)(state, ids).jaxpr, "scan")


def test_one_scan_per_layer_group_regardless_of_depth():
    for layers in (1, 2, 4):
        for cfg in (tiny_moe(num_hidden_layers=layers), tiny_dense(num_hidden_layers=layers),
                    tiny_moe(num_hidden_layers=layers, remat_policy="full")):
            scans = _scans(cfg)
            assert len(scans) == 1, (cfg.num_hidden_layers, len(scans))
            assert scans[0].params["length"] == layers
    mixed = tiny_moe(num_hidden_layers=4, mlp_only_layers=(0, 1))  # dense x2, moe x2
    assert [s.params["length"] for s in _scans(mixed)] == [2, 2]
    assert len(_scans(tiny_moe(num_hidden_layers=4, decoder_sparse_step=2))) == 4
    assert _scans(tiny_moe(num_hidden_layers=4, scan_layers=False)) == []


# ------------------------------------------------------------------------------------------ aux loss
def _numpy_hf_aux_loss(router_logits: list[np.ndarray], num_experts: int, top_k: int, mask: np.ndarray | None):
    """HF load_balancing_loss_func (transformers 5.24.0), restated in NumPy, float64."""
    tokens_per_expert = np.zeros(num_experts)
    prob_sum = np.zeros(num_experts)
    rows = 0.0
    flat_mask = np.ones(router_logits[0].shape[0]) if mask is None else mask.reshape(-1).astype(np.float64)
    for logits in router_logits:
        logits = logits.astype(np.float64)
        p = np.exp(logits - logits.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        selected = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
        for n in range(p.shape[0]):
            tokens_per_expert[selected[n]] += flat_mask[n]
        prob_sum += (p * flat_mask[:, None]).sum(0)
        rows += flat_mask.sum()
    return num_experts * np.sum((tokens_per_expert / rows) * (prob_sum / rows))


def test_aux_loss_matches_numpy_hf_formula():
    model = _model(tiny_moe(num_hidden_layers=3, mlp_only_layers=(1,)))  # two MoE groups, pooled
    ids, pos, mask = _batch(model.config, b=2, t=5, pad=(0, 2))
    for m in (None, mask):
        out = _forward(model, ids, pos, m, return_router_logits=True)
        assert out.router_logits[1] is None  # the dense group
        per_layer = [np.asarray(layer) for g in (0, 2) for layer in out.router_logits[g]]
        assert len(per_layer) == 2 and per_layer[0].shape == (10, 8)
        expected = _numpy_hf_aux_loss(per_layer, 8, 2, None if m is None else np.asarray(m))
        np.testing.assert_allclose(float(out.aux_loss), expected, rtol=1e-5)
    assert float(_forward(_model(tiny_dense()), ids, pos, mask).aux_loss) == 0.0


def test_aux_loss_is_top_k_for_balanced_routing():
    num_experts, top_k, n = 8, 2, 16
    # token j strongly prefers experts j, j+1 (mod 8): every expert chosen equally often, and the
    # mean router probability is uniform by symmetry
    logits = np.full((n, num_experts), -4.0, np.float32)
    for j in range(n):
        logits[j, [j % num_experts, (j + 1) % num_experts]] = 4.0
    counts, prob_sum = router_load_stats(jnp.asarray(logits), jnp.ones(n), top_k)
    np.testing.assert_array_equal(counts, np.full(num_experts, n * top_k / num_experts))
    np.testing.assert_allclose(load_balancing_loss(counts, prob_sum, jnp.float32(n)), top_k, rtol=1e-6)
    # collapsed routing (everyone picks experts 0 and 1) is penalised
    collapsed = np.full((n, num_experts), -4.0, np.float32)
    collapsed[:, :2] = 4.0
    c, p = router_load_stats(jnp.asarray(collapsed), jnp.ones(n), top_k)
    assert float(load_balancing_loss(c, p, jnp.float32(n))) > 3.9 * top_k
    # end to end: a zero router gives uniform probabilities -> aux == top_k exactly, any mask
    model = _model(tiny_moe(), router_std=0.0)
    ids, pos, mask = _batch(model.config)
    np.testing.assert_allclose(_forward(model, ids, pos, mask).aux_loss, top_k, rtol=1e-6)


# ------------------------------------------------------------------------------------------ RoPE, dtypes
@pytest.mark.parametrize("rope_scaling,head_dim,theta", [
    (None, 16, 1e4),
    (None, 128, 1e6),  # the real Qwen3 setting
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}, 16, 1e4),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 128, 1e6),
    ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16,
      "mscale": 1.0, "mscale_all_dim": 0.5}, 16, 1e4),
])
def test_rope_inv_freq_matches_transformers(rope_scaling, head_dim, theta):
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    cfg = tiny_dense(rope_scaling=rope_scaling, head_dim=head_dim, rope_theta=theta, max_position_embeddings=131072)
    hf_cfg = Qwen3Config(**cfg.to_hf_dict())
    if rope_scaling is None:
        inv_freq, scaling = Qwen3RotaryEmbedding.compute_default_rope_parameters(hf_cfg)
    else:
        inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    ours, our_scaling = rope_inv_freq(cfg)
    np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=2e-7, atol=0)
    assert our_scaling == pytest.approx(float(scaling), rel=1e-12)


def test_bf16_compute_is_close_to_fp32(moe_model):
    ids, pos, mask = _batch(moe_model.config)
    ref = _forward(moe_model, ids, pos, mask).logits
    bf16 = _forward(_with_config(moe_model, dtype="bfloat16"), ids, pos, mask).logits
    assert bf16.dtype == jnp.float32  # logits are fp32-accumulated and never rounded to bf16
    real = np.asarray(mask)
    err = np.abs(np.asarray(bf16) - np.asarray(ref))[real]
    assert np.isfinite(err).all() and err.max() < 0.1 * np.abs(np.asarray(ref)[real]).max()


def test_hidden_states_give_the_logits_in_chunks(dense_model):
    ids, pos, mask = _batch(dense_model.config)
    full = _forward(dense_model, ids, pos, mask)
    lean = _forward(dense_model, ids, pos, mask, compute_logits=False)
    assert lean.logits is None and lean.hidden_states.shape == (2, 6, dense_model.config.hidden_size)
    chunks = [dense_model.lm_logits(lean.hidden_states[:, a:a + 3]) for a in (0, 3)]
    assert_close(jnp.concatenate(chunks, axis=1), full.logits, reduction_len=dense_model.config.hidden_size)
