"""The sharded runtime equals the single-device one on 8 simulated CPU devices.

For three meshes (fsdp=8; fsdp=2 x tensor=2 x expert=2; data=2 x fsdp=4) and a tiny fp32
Qwen3-MoE placed by the logical-axis rules (`ace_jax.runtime.placement`): the forward pass (logits, router
aux loss), a full GRPO `Learner` step (metrics and updated params) and grouped generation (tokens
and behaviour log-probs under the same key) match the unsharded run, and params, optimizer state,
batch and KV cache really are split over the devices as the rules say.
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ace_jax.rl import grpo, learner, rollout_batch
from ace_jax.runtime import placement as pl, sharding as sh
from ace_jax.runtime.generate import Generator, SamplingConfig
from models import configs, qwen3
from tests.numerics import assert_close

PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37], [41, 42, 43]]
G = 4            # 4 prompts x 4 samples = 16 rows: divisible by every batch split below
SAMPLING = SamplingConfig(max_new_tokens=8, group_size=G, temperature=1.0, prompt_bucket=8)

# The rules under test (fixed here, so the expectations below do not move with the defaults):
# hidden size FSDP-sharded over fsdp and expert, experts over expert, heads / mlp / vocab over tensor.
RULES = dict(batch="data,fsdp,expert", length="", cache_length="", embed="fsdp,expert",
             vocab="tensor", heads="tensor", kv_heads="tensor", head_dim="", mlp="tensor",
             experts="expert", router="expert", layers="")

# mesh sizes -> expected PartitionSpecs of a few leaves (tiny_moe: V=256, H=32, nq=4, nkv=2,
# d=16, Im=16, E=8, 2 layers; a TrainBatch of 16 rows).
MESHES = {
    "fsdp8": (dict(fsdp=8), dict(
        experts=P(None, None, "fsdp"), q_proj=P(None, "fsdp"), embedding=P(None, "fsdp"),
        rows=P("fsdp"), cache_k=P(None, "fsdp"))),
    "fsdp2_tensor2_expert2": (dict(fsdp=2, tensor=2, expert=2), dict(
        experts=P(None, "expert", "fsdp", "tensor"), q_proj=P(None, ("fsdp", "expert"), "tensor"),
        embedding=P("tensor", ("fsdp", "expert")), rows=P(("fsdp", "expert")),
        cache_k=P(None, ("fsdp", "expert"), None, "tensor"))),
    "data2_fsdp4": (dict(data=2, fsdp=4), dict(
        experts=P(None, None, "fsdp"), q_proj=P(None, "fsdp"), embedding=P(None, "fsdp"),
        rows=P(("data", "fsdp")), cache_k=P(None, ("data", "fsdp")))),
}
EXPERTS = "layers/0/mlp/experts/gate_proj"
Q_PROJ = "layers/0/self_attn/q_proj/kernel"
EMBED = "embed_tokens/embedding"


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip(f"needs 8 (simulated) devices, found {jax.device_count()}: run under "
                    "tests/conftest.py (XLA_FLAGS=--xla_force_host_platform_device_count=8)")


def _mesh(**sizes):
    cfg = sh.default_config()
    cfg.fsdp = 1
    for k, v in sizes.items():
        setattr(cfg, k, v)
    return sh.make_mesh(cfg)


def _cfgs():
    g, o = grpo.default_config(), learner.default_config()
    # A large Adam eps keeps the first update linear in the gradient, so float-reordering noise in
    # near-zero gradient entries is not amplified to +-lr by Adam's sign-like first step.
    o.learning_rate, o.eps = 1e-2, 1e-2
    return g, o


def _flat(state):
    return {"/".join(str(p) for p in path): v for path, v in nnx.to_flat_state(state)}


def _forward(model, batch):
    out = model(batch.input_ids, batch.positions, attention_mask=batch.attention_mask)
    return out.logits, out.aux_loss


@pytest.fixture(scope="module")
def reference():
    """Everything computed on one device: the model, a batch, forward, a learner step, samples."""
    model = qwen3.Qwen3ForCausalLM(configs.tiny_moe(), rngs=nnx.Rngs(7))
    gen = Generator(model, SAMPLING).generate(PROMPTS, jax.random.key(3))
    rewards = (np.asarray(gen.tokens)[:, 0] % 3).astype(np.float32)
    rewards[:G] = np.arange(G)  # group 0 surely has variance
    batch = rollout_batch.make_train_batch(PROMPTS, gen, rewards, prompt_bucket=8, pad_id=0)
    logits, aux = nnx.jit(_forward)(model, batch)
    g, o = _cfgs()
    lrn = learner.Learner.create(model, g, o, group_size=G)
    metrics = lrn.step(batch)
    return dict(model=model, batch=batch, gen=jax.tree.map(np.asarray, gen),
                logits=np.asarray(logits), aux=float(aux),
                metrics={k: np.asarray(v) for k, v in metrics.items()},
                params={k: np.asarray(v.get_value()) for k, v in _flat(lrn.params).items()})


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_runtime_equals_single_device(name, reference):
    sizes, want = MESHES[name]
    place = pl.Placement.create(_mesh(**sizes), RULES)
    model = nnx.clone(reference["model"])
    params = place.place_params(model)
    flat = _flat(params)
    # params are split as the rules say, and really smaller per device
    assert flat[EXPERTS].get_value().sharding.spec == want["experts"]
    assert flat[Q_PROJ].get_value().sharding.spec == want["q_proj"]
    assert flat[EMBED].get_value().sharding.spec == want["embedding"]
    expert_w = flat[EXPERTS].get_value()
    assert expert_w.addressable_shards[0].data.size * 4 <= expert_w.size

    batch = place.place_batch(reference["batch"])
    assert batch.input_ids.sharding.spec == want["rows"]
    assert batch.rewards.sharding.spec == want["rows"]

    # forward: logits and router aux loss
    logits, aux = nnx.jit(_forward)(model, batch)
    assert_close(np.asarray(logits), reference["logits"], reduction_len=model.config.hidden_size)
    np.testing.assert_allclose(float(aux), reference["aux"], rtol=1e-6)

    # one GRPO learner step with sharded state and batch
    g, o = _cfgs()
    lrn = learner.Learner.create(model, g, o, group_size=G, placement=place)
    metrics = lrn.step(batch)
    tokens = int(np.sum(reference["batch"].completion_mask))
    for k, ref in reference["metrics"].items():   # O(1) terms summed (the loss cancels toward 0)
        assert_close(np.asarray(metrics[k]), ref, reduction_len=tokens, scale=max(1.0, np.abs(ref).max()),
                     err_msg=k)
    new = _flat(lrn.params)
    assert set(new) == set(reference["params"])
    for k, ref in reference["params"].items():
        got = new[k].get_value()
        assert got.sharding.spec == flat[k].get_value().sharding.spec, k
        assert_close(np.asarray(got), ref, reduction_len=tokens, err_msg=k)
    mu = _flat(optax.tree_utils.tree_get(lrn.state.opt_state, "mu"))
    assert mu[EXPERTS].get_value().sharding.spec == want["experts"]
    assert mu[Q_PROJ].get_value().sharding.spec == want["q_proj"]
    counts = optax.tree_utils.tree_get_all_with_path(lrn.state.opt_state, "count")
    assert counts and all(c.sharding.spec == P() for _, c in counts)

    # grouped generation with sharded params, prompts and KV cache: same samples, same key
    gen = Generator(model, SAMPLING, placement=place).generate(PROMPTS, jax.random.key(3))
    ref_gen = reference["gen"]
    np.testing.assert_array_equal(np.asarray(gen.tokens), ref_gen.tokens)
    np.testing.assert_array_equal(np.asarray(gen.lengths), ref_gen.lengths)
    assert_close(np.asarray(gen.logprobs), ref_gen.logprobs, reduction_len=model.config.vocab_size)

    # the KV-cache layout the generator constrains its cache to
    cache = jax.eval_shape(lambda: qwen3.init_cache(model.config, len(PROMPTS) * G, 24))
    cache_sh = place.kv_cache(cache)
    assert cache_sh.k[0].spec == want["cache_k"]
    assert cache_sh.kv_mask.spec == P(*want["rows"])


def test_placement_errors_are_clear():
    place = pl.Placement.create(_mesh(fsdp=8), RULES)
    with pytest.raises(TypeError, match="nnx.Module"):
        place.params({"w": jnp.zeros((8, 8))})
    with pytest.raises(TypeError, match="Mesh"):
        pl.Placement.create("not a mesh")
    model = qwen3.Qwen3ForCausalLM(configs.tiny_moe(), rngs=nnx.Rngs(0))
    with pytest.raises(sh.UnknownLogicalAxisError, match="experts"):
        pl.param_shardings(model, place.mesh, {k: v for k, v in RULES.items() if k != "experts"})
    # a Placement is hashable (a static jit argument) and equal for equal inputs
    assert place == pl.Placement.create(place.mesh, dict(RULES))
    assert hash(place) == hash(pl.Placement.create(place.mesh, dict(RULES)))
