"""Expert-parallel MoE dispatch (models/moe_sharding.py) on 8 simulated CPU devices: values and
gradients equal the single-device dense reference on several meshes, with uneven routing and an
expert that no token picks; the router's gradient flows through the expert-parallel layer."""
from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from ace_jax.runtime import sharding as sh
from models import moe_sharding, qwen3
from models.configs import ModelConfig, UnsupportedConfigError

E, K, H, IM = 8, 2, 16, 12


def _mesh(**sizes):
    shape = tuple(sizes.get(a, 1) for a in sh.MESH_AXES)
    return jax.make_mesh(shape, sh.MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 4)


def _problem(n, seed=0, skip_expert=3):
    """x [n, H], uneven top-k routes (experts 0-1 popular, ``skip_expert`` never chosen)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, H)).astype(np.float32)
    logits = rng.normal(size=(n, E)) + np.array([2.0, 1.5] + [0.0] * (E - 2))
    logits[:, skip_expert] = -1e9
    idx = np.argsort(-logits, axis=1)[:, :K].astype(np.int32)
    wts = rng.uniform(0.1, 1.0, size=(n, K)).astype(np.float32)
    ws = [rng.normal(scale=0.3, size=s).astype(np.float32) for s in ((E, H, IM), (E, H, IM), (E, IM, H))]
    return x, idx, wts, ws


def _ep(x, idx, wts, wg, wu, wd, parallelism="expert"):
    return moe_sharding.sharded_dispatch(qwen3.moe_dispatch_ragged, x, idx, wts, wg, wu, wd, jnp.float32,
                                         parallelism=parallelism, platform="cpu")


def _loss(fn):
    def loss(x, wts, wg, wu, wd, idx, probe):
        return jnp.sum(fn(x, idx, wts, wg, wu, wd) * probe)
    return loss


@pytest.mark.parametrize("sizes,n,parallelism", [
    (dict(expert=8), 32, "expert"),               # tokens split over expert only
    (dict(fsdp=2, expert=4), 24, "expert"),       # tokens over fsdp x expert, weights gathered over fsdp
    (dict(data=2, fsdp=2, expert=2), 16, "expert"),
    (dict(fsdp=2, expert=4), 6, "expert"),        # 6 tokens: not split over expert (psum path)
    # experts over expert x tensor, rows the same across tensor: 1 expert per device
    (dict(expert=4, tensor=2), 32, "expert_tensor"),
    (dict(fsdp=2, expert=2, tensor=2), 16, "expert_tensor"),
    (dict(data=4, tensor=2), 8, "expert_tensor"),  # no expert axis: 4 experts per device, sorted
])
def test_expert_parallel_equals_dense(sizes, n, parallelism):
    assert jax.device_count() >= 8, "needs 8 simulated devices (tests/conftest.py)"
    x, idx, wts, (wg, wu, wd) = _problem(n)
    probe = np.random.default_rng(1).normal(size=(n, H)).astype(np.float32)
    dense = lambda x, i, w, a, b, c: qwen3.moe_dispatch_dense(x, i, w, a, b, c, jnp.float32)  # noqa: E731
    want = dense(x, idx, wts, wg, wu, wd)
    want_grads = jax.grad(_loss(dense), argnums=(0, 1, 2, 3, 4))(x, wts, wg, wu, wd, idx, probe)

    mesh = _mesh(**sizes)
    rules = dict(sh.DEFAULT_RULES)
    if parallelism == "expert_tensor":
        rules.update(experts="expert,tensor", mlp="")
    rules = sh.rules_from_config(rules)
    rows = NamedSharding(mesh, sh.logical_to_pspec(("batch", None), rules, shape=(n, H), mesh=mesh))
    wsh = NamedSharding(mesh, sh.logical_to_pspec(("experts", "embed", "mlp"), rules, shape=wg.shape, mesh=mesh))
    args = [jax.device_put(a, rows) for a in (x, wts)] + [jax.device_put(w, wsh) for w in (wg, wu, wd)]
    ep = functools.partial(_ep, parallelism=parallelism)
    with jax.set_mesh(mesh):
        got = jax.jit(ep)(args[0], jax.device_put(idx, rows), args[1], *args[2:])
        grads = jax.jit(jax.grad(_loss(ep), argnums=(0, 1, 2, 3, 4)))(
            *args, jax.device_put(idx, rows), probe)
    scale = float(np.max(np.abs(want)))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * scale)
    for name, g, w in zip(("x", "routing weights", "w_gate", "w_up", "w_down"), grads, want_grads):
        tol = 1e-5 * max(1.0, float(np.max(np.abs(w))))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=tol, err_msg=name)
    # the expert nobody picks gets exactly zero weight gradient; the popular ones do not
    assert float(np.abs(np.asarray(grads[2][3])).max()) == 0.0
    assert float(np.abs(np.asarray(grads[2][0])).max()) > 0.0


def test_expert_parallel_is_tokens_not_weights():
    """The compiled expert-parallel layer moves tokens (all-gather / reduce-scatter of [N, H]
    rows over 'expert') and never gathers the expert weights, which "gather" does."""
    n = 32
    x, idx, wts, (wg, wu, wd) = _problem(n)
    mesh = _mesh(expert=8)
    rows = NamedSharding(mesh, P("expert"))
    wsh = NamedSharding(mesh, P("expert"))
    args = (jax.device_put(x, rows), jax.device_put(idx, rows), jax.device_put(wts, rows),
            *(jax.device_put(w, wsh) for w in (wg, wu, wd)))

    def hlo(parallelism):
        def f(*a):
            return moe_sharding.sharded_dispatch(qwen3.moe_dispatch_ragged, *a, jnp.float32,
                                                 parallelism=parallelism, platform="cpu")
        with jax.set_mesh(mesh):
            return jax.jit(f).lower(*args).compile().as_text()

    ep, gather = hlo("expert"), hlo("gather")
    weight_shape = f"f32[{E},{H},{IM}]"
    assert weight_shape not in " ".join(l for l in ep.splitlines() if "all-gather" in l)
    assert weight_shape in " ".join(l for l in gather.splitlines() if "all-gather" in l)
    assert "reduce-scatter" in ep or "all-reduce" in ep


@pytest.mark.parametrize("first_expert", [0, 2, 6])
def test_local_experts_without_the_sort_equal_the_sorted_buffer(first_expert):
    """`_local_all_experts` (every local expert on every token, E_l <= k) equals `_local_swiglu`
    (sorted dropless buffer) on one device's share: values and gradients, with assignments to
    other devices' experts and (first_expert 2) a local expert nobody picks."""
    n, e_local = 12, 2
    x, idx, wts, ws = _problem(n, seed=4)
    local = [w[first_expert:first_expert + e_local] for w in ws]
    probe = np.random.default_rng(5).normal(size=(n, H)).astype(np.float32)

    def run(fn):
        def f(x, wts, wg, wu, wd):
            return fn(x, idx, wts, wg, wu, wd, jnp.float32, first_expert=first_expert)
        value = f(x, wts, *local)
        grads = jax.grad(lambda *a: jnp.sum(f(*a) * probe), argnums=(0, 1, 2, 3, 4))(x, wts, *local)
        return value, grads

    (want, want_g), (got, got_g) = run(functools.partial(moe_sharding._local_swiglu, gmm=False)), run(
        moe_sharding._local_all_experts)
    scale = max(1.0, float(np.abs(want).max()))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6 * scale)
    for name, g, w in zip(("x", "routing weights", "w_gate", "w_up", "w_down"), got_g, want_g):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5,
                                   atol=1e-6 * max(1.0, float(np.abs(w).max())), err_msg=name)


@pytest.mark.parametrize("expert,sorted_buffer", [(8, False), (4, False), (2, True)])
def test_the_sort_runs_only_when_a_device_holds_more_experts_than_k(expert, sorted_buffer):
    """E / expert local experts against k = 2: with E_l <= k the dropless buffer is N x E_l rows
    either way and the compiled layer has no sort (a decode step's case: 2 of 128 experts per
    chip, k = 8); with E_l > k it sorts the assignments."""
    x, idx, wts, (wg, wu, wd) = _problem(32)
    mesh = _mesh(expert=expert)
    rows, wsh = NamedSharding(mesh, P("expert")), NamedSharding(mesh, P("expert"))
    args = (*(jax.device_put(a, rows) for a in (x, idx, wts)),
            *(jax.device_put(w, wsh) for w in (wg, wu, wd)))
    with jax.set_mesh(mesh):
        text = jax.jit(_ep).lower(*args).as_text()
    assert ("sort" in text) == sorted_buffer


def test_router_gradient_flows_under_expert_parallelism():
    """A whole Qwen3MoeSparseMoeBlock: the router kernel's gradient is non-zero and equals the
    single-device (unsharded) gradient."""
    cfg = ModelConfig(vocab_size=32, hidden_size=H, intermediate_size=24, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=IM,
                      num_experts=E, num_experts_per_tok=K, norm_topk_prob=True, moe_parallelism="expert")
    block = qwen3.Qwen3MoeSparseMoeBlock(cfg, num_layers=None, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(4, 8, H)), jnp.float32)
    graphdef, params = nnx.split(block, nnx.Param)

    def loss(params, x):
        out, _, _ = nnx.merge(graphdef, params)(x)
        return jnp.sum(out ** 2)

    want = jax.grad(loss)(params, x)
    mesh = _mesh(expert=8)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x.reshape(32, 1, H), NamedSharding(mesh, P("expert")))
        got = jax.jit(jax.grad(loss))(params, xs)
    router = np.asarray(got["gate"]["kernel"][...])
    assert np.abs(router).max() > 0
    np.testing.assert_allclose(router, np.asarray(want["gate"]["kernel"][...]), rtol=1e-4,
                               atol=1e-5 * np.abs(router).max())


@pytest.mark.parametrize("parallelism,sizes", [("expert", dict(expert=8)),
                                               ("expert_tensor", dict(expert=4, tensor=2))])
def test_partials_in_the_compute_dtype(parallelism, sizes):
    """``partials="compute"`` in bf16: the devices' partial outputs are reduce-scattered (and
    summed over 'tensor') in bf16, half the bytes of fp32, and the result stays within the bf16
    rounding of the k = 2 partials of the fp32 sum (each term rounded once, then summed in bf16:
    a few bf16 ulps of the largest output)."""
    n = 32
    x, idx, wts, ws = _problem(n, seed=7)
    mesh = _mesh(**sizes)
    rules = dict(sh.DEFAULT_RULES, experts="expert,tensor" if parallelism == "expert_tensor" else "expert")
    rules = sh.rules_from_config(rules)
    rows = NamedSharding(mesh, sh.logical_to_pspec(("batch", None), rules, shape=(n, H), mesh=mesh))
    wsh = NamedSharding(mesh, sh.logical_to_pspec(("experts", "embed", "mlp"), rules, shape=ws[0].shape,
                                                  mesh=mesh))
    args = (*(jax.device_put(a, rows) for a in (x, idx, wts)), *(jax.device_put(w, wsh) for w in ws))

    def run(partials):
        def f(*a):
            return moe_sharding.sharded_dispatch(qwen3.moe_dispatch_ragged, *a, jnp.bfloat16,
                                                 parallelism=parallelism, platform="cpu", partials=partials)
        with jax.set_mesh(mesh):
            lowered = jax.jit(f).lower(*args)
            return np.asarray(lowered.compile()(*args)), lowered.as_text()

    # the lowered program's (XLA:CPU computes a bf16 collective in fp32; a TPU does not)
    (exact, exact_hlo), (half, half_hlo) = run("float32"), run("compute")
    assert half.dtype == np.float32 and half.shape == (n, H)

    def summed_dtypes(text):  # operand dtypes of the cross-device sums over [rows, H]
        return {m.group(2) for m in re.finditer(
            r'"stablehlo\.(reduce_scatter|all_reduce)".*?\}\) : \(tensor<\d+x%dx(\w+)>\)' % H, text, re.S)}

    assert summed_dtypes(exact_hlo) == {"f32"}, summed_dtypes(exact_hlo)
    assert summed_dtypes(half_hlo) == {"bf16"}, summed_dtypes(half_hlo)
    scale = float(np.abs(exact).max())
    np.testing.assert_allclose(half, exact, rtol=0, atol=4 * 2.0 ** -8 * scale)
    assert not np.array_equal(half, exact)   # it did round
    with pytest.raises(ValueError, match="partials"):
        moe_sharding.expert_parallel_dispatch(*args, jnp.bfloat16, platform="cpu", partials="bf16")


def test_moe_parallelism_is_validated():
    with pytest.raises(UnsupportedConfigError, match="moe_parallelism"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=8, moe_parallelism="tokens")
    with pytest.raises(UnsupportedConfigError, match="moe_partials"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=1, num_key_value_heads=1, head_dim=8, moe_partials="bf16")


def test_receive_buffer_bound():
    # a token's k experts are distinct: at most min(k, E_local) of them are on one device
    assert moe_sharding.local_expert_rows(512, 8, 2, gmm=False) == 1024
    assert moe_sharding.local_expert_rows(100, 8, 32, gmm=False) == 800
    assert moe_sharding.local_expert_rows(100, 8, 2, gmm=True) == 512   # padded to gmm's row tile


def test_gmm_only_at_training_token_counts():
    assert moe_sharding.use_gmm("tpu", 4 * 12288, 8, 128)        # learner microbatch, 4-way EP
    assert not moe_sharding.use_gmm("tpu", 512, 8, 128)          # a decode step over 64 chips
    assert not moe_sharding.use_gmm("cpu", 4 * 12288, 8, 128)


def test_gmm_skips_rows_past_the_groups():
    """The TPU grouped matmul (megablox gmm, interpreted on CPU) with rows past the device's own
    groups equals ragged_dot (those rows zero), values and gradients."""
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.normal(size=(256, 128)), jnp.float32)
    rhs = jnp.asarray(rng.normal(size=(2, 128, 128)), jnp.float32)
    sizes = jnp.asarray([70, 0], jnp.int32)   # 70 own rows, an empty expert, 186 rows of others

    def f(gmm):
        return lambda a, b: moe_sharding.grouped_matmul(a, b, sizes, gmm=gmm, dtype=jnp.float32, interpret=True)

    want, got = f(False)(lhs, rhs), f(True)(lhs, rhs)
    assert float(jnp.abs(got[70:]).max()) == 0.0
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-3)
    gw = jax.grad(lambda a, b: jnp.sum(f(False)(a, b) ** 2), argnums=(0, 1))(lhs, rhs)
    gg = jax.grad(lambda a, b: jnp.sum(f(True)(a, b) ** 2), argnums=(0, 1))(lhs, rhs)
    for a, b in zip(gg, gw):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * float(jnp.abs(b).max()))
