"""The sampler's own layout (ace_jax/runtime/sampler_layout.py) on 8 simulated CPU devices:
experts kept over the expert axis, dense weights replicated, weights resharded (and cast) from
the learner's FSDP layout; its rollouts equal the shared layout's; bad settings are refused."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ace_jax.runtime import generate, placement as pl, sampler_layout, sharding as sh
from ace_jax.runtime.generate import Generator, SamplingConfig
from models import configs, qwen3
from tests.numerics import assert_close

PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37], [41, 42, 43]]
SAMPLING = SamplingConfig(max_new_tokens=8, group_size=4, temperature=1.0, prompt_bucket=8)


@pytest.fixture(scope="module")
def learner_side():
    if jax.device_count() < 8:
        pytest.skip("needs 8 simulated devices (tests/conftest.py)")
    mesh_cfg = sh.default_config()
    mesh_cfg.fsdp, mesh_cfg.expert = 2, 4
    placement = pl.Placement.from_config(mesh_cfg)
    mc = configs.get_model_config("tiny_moe")
    model = placement.init_model(lambda: qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))
    return placement, model


def _own(**changes):
    c = sampler_layout.default_config()
    c.layout = "own"
    for k, v in changes.items():
        c[k] = v
    return c


def test_own_layout_places_experts_and_replicates_dense(learner_side):
    placement, model = learner_side
    layout = sampler_layout.SamplerLayout.from_config(_own(), placement, model.config)
    assert dict(layout.placement.mesh.shape)["expert"] == 8
    assert layout.model_config.moe_parallelism == "expert"
    # the learner's device order is kept (one jitted resharding program)
    assert list(layout.placement.mesh.devices.flat) == list(placement.mesh.devices.flat)
    params = layout.resharder(nnx.state(model, nnx.Param))(nnx.state(model, nnx.Param))
    flat = dict(jax.tree_util.tree_leaves_with_path(params))
    spec = {jax.tree_util.keystr(k): v.sharding.spec for k, v in flat.items()}
    experts = [s for k, s in spec.items() if "experts" in k]
    assert experts and all(s == P(None, "expert") for s in experts)
    dense = [s for k, s in spec.items() if "q_proj" in k or "embed_tokens" in k or "lm_head" in k]
    assert dense and all(s == P() for s in dense)


def test_own_layout_rollout_equals_shared(learner_side):
    placement, model = learner_side
    key = jax.random.key(3)
    shared = Generator(model, SAMPLING, placement=placement).generate(PROMPTS, key)
    layout = sampler_layout.SamplerLayout.from_config(_own(), placement, model.config)
    gen = Generator(model, SAMPLING, layout=layout)
    own = gen.generate(PROMPTS, key)
    np.testing.assert_array_equal(np.asarray(own.tokens), np.asarray(shared.tokens))
    assert_close(np.asarray(own.logprobs), np.asarray(shared.logprobs), reduction_len=32)
    # after an update, the sampler decodes with the new weights (resharded again)
    params = nnx.state(model, nnx.Param)
    scaled = jax.tree.map(lambda x: x * 1.5, params)
    gen.update_weights(scaled)
    shared_gen = Generator(model, SAMPLING, placement=placement)
    shared_gen.update_weights(scaled)
    np.testing.assert_array_equal(np.asarray(gen.generate(PROMPTS, key).tokens),
                                  np.asarray(shared_gen.generate(PROMPTS, key).tokens))


def test_accelerator_path_per_layer_weights_and_tokens_equal_shared(learner_side):
    """The pod's code paths (a "standard" cache, blockwise decode attention, expert-parallel MoE;
    platform "gpu" runs them on CPU): the own layout's per-layer weights (sliced out before the
    decode loop) carry each stack's sharding less its layers axis, and it samples the same
    tokens as the shared layout."""
    placement, model = learner_side
    mc = model.config.replace(platform="gpu", attention_impl="blockwise")
    accel = placement.init_model(lambda: qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))
    layout = sampler_layout.SamplerLayout.from_config(_own(), placement, mc)
    assert generate.cache_layout(mc) == "standard" and layout.model_config.scan_layers
    params = nnx.state(accel, nnx.Param)
    per_layer = layout.abstract_layer_params(layout.graphdef(nnx.graphdef(accel)), params)
    assert len(per_layer) == len(accel.layers) and sum(len(g) for g in per_layer) == mc.num_hidden_layers
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(per_layer)}
    gate = [v for k, v in flat.items() if "gate_proj" in k]
    assert gate and all(v.shape == (mc.num_experts, mc.hidden_size, mc.moe_intermediate_size)
                        and v.sharding.spec == P("expert") for v in gate)
    key = jax.random.key(5)
    shared = Generator(accel, SAMPLING, placement=placement).generate(PROMPTS, key)
    own = Generator(accel, SAMPLING, layout=layout).generate(PROMPTS, key)
    np.testing.assert_array_equal(np.asarray(own.tokens), np.asarray(shared.tokens))
    assert_close(np.asarray(own.logprobs), np.asarray(shared.logprobs), reduction_len=32)


def test_weights_cast_to_the_compute_dtype(learner_side):
    placement, model = learner_side
    mc = model.config.replace(dtype="bfloat16")
    layout = sampler_layout.SamplerLayout.from_config(_own(), placement, mc)
    params = nnx.state(model, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(layout.abstract_params(params))} == {jnp.dtype("bfloat16")}
    keep = sampler_layout.SamplerLayout.from_config(_own(weight_dtype="param"), placement, mc)
    assert {x.dtype for x in jax.tree.leaves(keep.abstract_params(params))} == {jnp.dtype("float32")}


def test_shared_layout_is_the_learners(learner_side):
    placement, model = learner_side
    layout = sampler_layout.SamplerLayout.from_config(sampler_layout.default_config(), placement,
                                                     model.config)
    assert layout.shared and layout.placement is placement and layout.model_config is model.config


@pytest.mark.parametrize("changes,match", [
    (dict(layout="separate"), "sampler_mesh.layout"),
    (dict(expert=3), "needs|split"),
])
def test_bad_settings_are_refused(learner_side, changes, match):
    placement, model = learner_side
    with pytest.raises((ValueError, sh.MeshConfigError), match=match):
        sampler_layout.SamplerLayout.from_config(_own(**changes), placement, model.config)
