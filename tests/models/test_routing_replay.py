"""MoE routing record and replay (R3): a forward returns each MoE layer's top-k expert ids; a
forward given routes dispatches by them with the live router's gate weights, so the router
keeps its gradient."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import configs, qwen3


@pytest.fixture(scope="module")
def model():
    # layer 1 dense: the routes skip it (L_moe = 2 of 3 layers)
    cfg = configs.tiny_moe(num_hidden_layers=3, mlp_only_layers=(1,))
    return qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0))


IDS = jnp.asarray([[5, 9, 14, 3, 7, 21], [8, 8, 2, 30, 11, 4]], jnp.int32)


def test_routes_are_recorded_per_token_and_moe_layer(model):
    cfg = model.config
    out = model(IDS, return_routes=True, return_router_logits=True)
    assert out.routes.shape == (2, 6, cfg.num_moe_layers, cfg.num_experts_per_tok) == (2, 6, 2, 2)
    # they are the top-k of the router logits of each MoE group
    moe_logits = [x for x in out.router_logits if x is not None]          # [Lg, B*T, E] each
    want = np.concatenate([np.asarray(jax.lax.top_k(jax.nn.softmax(x.astype(jnp.float32)),
                                                    cfg.num_experts_per_tok)[1]) for x in moe_logits])
    np.testing.assert_array_equal(np.moveaxis(np.asarray(out.routes).reshape(12, 2, 2), 1, 0), want)
    assert model(IDS).routes is None


def test_replaying_the_own_routes_changes_nothing_and_other_routes_change_the_output(model):
    base = model(IDS, return_routes=True)
    same = model(IDS, routes=base.routes)
    np.testing.assert_array_equal(np.asarray(same.logits), np.asarray(base.logits))
    other = (base.routes + 1) % model.config.num_experts                 # distinct ids still
    moved = model(IDS, routes=other, return_routes=True)
    assert not np.allclose(np.asarray(moved.logits), np.asarray(base.logits))
    # the routers' own choice is still what is reported
    np.testing.assert_array_equal(np.asarray(moved.routes)[:, :1], np.asarray(base.routes)[:, :1])
    # rows of -1 keep the router's choice: replaying -1 everywhere is the plain forward
    free = model(IDS, routes=jnp.full(base.routes.shape, -1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(free.logits), np.asarray(base.logits))


def test_the_router_keeps_its_gradient_under_replay(model):
    graphdef, params = nnx.split(model, nnx.Param)
    routes = (model(IDS, return_routes=True).routes + 1) % model.config.num_experts

    def loss(p):
        return jnp.mean(nnx.merge(graphdef, p)(IDS, routes=routes).logits ** 2)

    grads = jax.grad(loss)(params)
    gate = [np.abs(np.asarray(g)).max() for path, g in jax.tree_util.tree_leaves_with_path(grads)
            if "['mlp']['gate']" in jax.tree_util.keystr(path)]           # the routers
    assert len(gate) == 2 and min(gate) > 0, gate


def test_bad_route_shapes_are_refused(model):
    with pytest.raises(ValueError, match=r"routes must be \[B, T, L_moe, k\] = \[2, 6, 2, k\]"):
        model(IDS, routes=jnp.zeros((2, 6, 3, 2), jnp.int32))
