"""Tests for ace_jax.runtime.sharding on 8 simulated CPU devices (tests/conftest.py sets XLA_FLAGS)."""
import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from ace_jax.runtime import sharding as sh
from tests.numerics import assert_close


def mesh_cfg(**sizes):
    cfg = sh.default_config()
    cfg.fsdp = 1
    for k, v in sizes.items():
        setattr(cfg, k, v)
    return cfg


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() != 8:
        pytest.skip(f"needs the 8 simulated CPU devices of tests/conftest.py, have "
                    f"{jax.device_count()}")


RULES = sh.rules_from_config(sh.DEFAULT_RULES)

MESHES = {
    "fsdp8": dict(fsdp=8),
    "fsdp2_tensor2_expert2": dict(fsdp=2, tensor=2, expert=2),
    "data2_fsdp4": dict(data=2, fsdp=-1),
}


# ------------------------------------------------------------------ mesh

@pytest.mark.parametrize("name", list(MESHES))
def test_meshes_build(name):
    mesh = sh.make_mesh(mesh_cfg(**MESHES[name]))
    assert mesh.axis_names == sh.MESH_AXES
    assert mesh.size == 8
    want = {"fsdp8": (1, 8, 1, 1), "fsdp2_tensor2_expert2": (1, 2, 2, 2),
            "data2_fsdp4": (2, 4, 1, 1)}[name]
    assert tuple(mesh.shape[a] for a in sh.MESH_AXES) == want


def test_default_config_takes_all_devices_on_fsdp():
    assert sh.resolve_mesh_shape(sh.default_config(), 8) == dict(data=1, fsdp=8, tensor=1, expert=1)


def test_mesh_config_errors():
    with pytest.raises(sh.MeshConfigError, match="needs 6 devices, 8 available"):
        sh.resolve_mesh_shape(mesh_cfg(data=2, tensor=3), 8)
    with pytest.raises(sh.MeshConfigError, match="at most one mesh axis may be -1"):
        sh.resolve_mesh_shape(mesh_cfg(data=-1, fsdp=-1), 8)
    with pytest.raises(sh.MeshConfigError, match="do not split"):
        sh.resolve_mesh_shape(mesh_cfg(tensor=3, fsdp=-1), 8)
    with pytest.raises(sh.MeshConfigError, match="positive or -1"):
        sh.resolve_mesh_shape(mesh_cfg(expert=0), 8)


@pytest.fixture
def _restore_cpu_collectives():
    """`maybe_initialize_distributed` switches the CPU collectives to gloo; the rest of the
    session keeps what it had."""
    before = jax.config.jax_cpu_collectives_implementation
    yield
    jax.config.update("jax_cpu_collectives_implementation", before)


def test_maybe_initialize_distributed(_restore_cpu_collectives):
    calls = []
    cfg = sh.default_config()
    no_tpu = dict(on_tpu_vm=lambda: False)
    assert not sh.maybe_initialize_distributed(cfg, environ={}, initialize=calls.append, **no_tpu)
    assert not sh.maybe_initialize_distributed(
        cfg, environ={"TPU_WORKER_HOSTNAMES": "only-one"}, initialize=lambda **k: calls.append(k),
        **no_tpu)
    assert calls == []
    assert sh.maybe_initialize_distributed(
        cfg, environ={"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"},
        initialize=lambda **k: calls.append(k), **no_tpu)
    # a TPU VM reached over ssh: no variable says "multi-process", the chips do; no arguments
    assert sh.maybe_initialize_distributed(cfg, environ={}, initialize=lambda **k: calls.append(k),
                                           on_tpu_vm=lambda: True)
    assert calls.pop() == {}
    cfg.distributed = "always"
    cfg.coordinator_address = "10.0.0.1:1234"
    cfg.num_processes = 4
    cfg.process_id = 2
    assert sh.maybe_initialize_distributed(cfg, environ={}, initialize=lambda **k: calls.append(k))
    assert calls == [{}, dict(coordinator_address="10.0.0.1:1234", num_processes=4, process_id=2)]
    cfg.distributed = "never"
    assert not sh.maybe_initialize_distributed(
        cfg, environ={"JAX_NUM_PROCESSES": "8"}, initialize=lambda **k: calls.append(k),
        on_tpu_vm=lambda: True)
    cfg.distributed = "sometimes"
    with pytest.raises(sh.MeshConfigError, match="auto | always | never"):
        sh.maybe_initialize_distributed(cfg, environ={})


def test_process_count_and_index_from_the_environment(_restore_cpu_collectives):
    """scripts/tpu_pod_run.sh's local workers set JAX_COORDINATOR_ADDRESS (JAX reads it itself),
    JAX_NUM_PROCESSES and JAX_PROCESS_ID; the config's own values win over them."""
    calls = []
    cfg = sh.default_config()
    env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "1"}
    assert sh.maybe_initialize_distributed(cfg, environ=env, initialize=lambda **k: calls.append(k),
                                           on_tpu_vm=lambda: False)
    assert calls.pop() == dict(num_processes=2, process_id=1)
    cfg.num_processes, cfg.process_id = 4, 3
    assert sh.maybe_initialize_distributed(cfg, environ=env, initialize=lambda **k: calls.append(k),
                                           on_tpu_vm=lambda: False)
    assert calls.pop() == dict(num_processes=4, process_id=3)


def _pci_tree(root, devices):
    """A fake /sys/bus/pci/devices: {slot: (vendor, device)}."""
    for slot, (vendor, device) in devices.items():
        (root / slot).mkdir(parents=True)
        (root / slot / "vendor").write_text(vendor + "\n")
        (root / slot / "device").write_text(device + "\n")
    return str(root)


GVNIC, GOOGLE_NVME = ("0x1ae0", "0x0042"), ("0x1ae0", "0x001f")


def test_tpu_chips_are_found_by_their_pci_vendor_and_device(tmp_path):
    # a plain GCE VM: Google's gVNIC and NVMe, a virtio device; no TPU chip, no distributed init
    vm = _pci_tree(tmp_path / "vm", {"0000:00:04.0": ("0x1af4", "0x1004"),
                                     "0000:00:05.0": GVNIC, "0000:00:06.0": GOOGLE_NVME})
    assert not sh.tpu_chips_present(vm)
    calls = []
    cfg = sh.default_config()
    assert not sh.maybe_initialize_distributed(
        cfg, environ={}, initialize=lambda **k: calls.append(k),
        on_tpu_vm=lambda: sh.tpu_chips_present(vm))
    assert calls == []
    # a v5p TPU VM: the same gVNIC plus four v5p chips
    tpu = _pci_tree(tmp_path / "tpu", {"0000:00:05.0": GVNIC, **{
        f"0000:00:0{i}.0": ("0x1ae0", "0x0062") for i in range(6, 10)}})
    assert sh.tpu_chips_present(tpu)
    for device in ("0x0027", "0x005e", "0x0063", "0x006f"):   # v3, v4, v5e, v6e
        assert sh.tpu_chips_present(_pci_tree(tmp_path / device, {"0000:00:04.0": ("0x1ae0",
                                                                                   device)}))
    assert not sh.tpu_chips_present(_pci_tree(tmp_path / "other", {"0000:00:04.0": ("0x8086",
                                                                                    "0x0062")}))
    assert not sh.tpu_chips_present(str(tmp_path / "missing"))
    # a device without a readable id file is skipped, not fatal
    (tmp_path / "broken" / "0000:00:04.0").mkdir(parents=True)
    (tmp_path / "broken" / "0000:00:04.0" / "vendor").write_text("0x1ae0\n")
    assert not sh.tpu_chips_present(str(tmp_path / "broken"))
    # the list holds every chip of the installed JAX's own table (a private one: when present)
    from jax._src import hardware_utils
    assert set(getattr(hardware_utils, "_TPU_PCI_DEVICE_IDS", {})) <= sh.TPU_PCI_DEVICE_IDS


# ------------------------------------------------------------------ pspecs

def test_pspecs_without_mesh_follow_rules():
    assert sh.logical_to_pspec(("vocab", "embed"), RULES) == P("tensor", ("fsdp", "expert"))
    assert sh.logical_to_pspec(("layers", "experts", "embed", "mlp"), RULES) == \
        P(None, "expert", "fsdp", "tensor")
    assert sh.logical_to_pspec(("layers", "embed", "heads", "head_dim"), RULES) == \
        P(None, ("fsdp", "expert"), "tensor")
    assert sh.logical_to_pspec(("batch", None), RULES) == P(("data", "fsdp", "expert"))
    assert sh.logical_to_pspec((), RULES) == P()


@pytest.mark.parametrize("name,want", [
    ("fsdp8", {"q": P(None, "fsdp"), "experts": P(None, None, "fsdp"), "embed": P(None, "fsdp"),
               "batch": P("fsdp")}),
    ("fsdp2_tensor2_expert2", {"q": P(None, ("fsdp", "expert"), "tensor"),
                               "experts": P(None, "expert", "fsdp", "tensor"),
                               "embed": P("tensor", ("fsdp", "expert")),
                               "batch": P(("fsdp", "expert"))}),
    ("data2_fsdp4", {"q": P(None, "fsdp"), "experts": P(None, None, "fsdp"),
                     "embed": P(None, "fsdp"), "batch": P(("data", "fsdp"))}),
])
def test_pspecs_on_meshes(name, want):
    mesh = sh.make_mesh(mesh_cfg(**MESHES[name]))
    q = sh.logical_to_pspec(("layers", "embed", "heads", "head_dim"), RULES,
                            shape=(2, 64, 4, 16), mesh=mesh)
    experts = sh.logical_to_pspec(("layers", "experts", "embed", "mlp"), RULES,
                                  shape=(2, 4, 64, 32), mesh=mesh)
    embed = sh.logical_to_pspec(("vocab", "embed"), RULES, shape=(128, 64), mesh=mesh)
    batch = sh.logical_to_pspec(("batch", "length"), RULES, shape=(16, 8), mesh=mesh)
    assert dict(q=q, experts=experts, embed=embed, batch=batch) == want


def test_indivisible_dims_are_replicated_and_warned_once(caplog):
    mesh = sh.make_mesh(mesh_cfg(fsdp=2, tensor=2, expert=2))
    with caplog.at_level(logging.WARNING, logger="ace_jax.runtime.sharding"):
        # kv_heads = 3 is not divisible by tensor = 2 -> replicated
        spec = sh.logical_to_pspec(("embed", "kv_heads", "head_dim"), RULES, shape=(64, 3, 16),
                                   mesh=mesh)
        sh.logical_to_pspec(("embed", "kv_heads", "head_dim"), RULES, shape=(64, 3, 16), mesh=mesh)
    assert spec == P(("fsdp", "expert"))
    warnings = [r for r in caplog.records if "'kv_heads'" in r.getMessage()]
    assert len(warnings) == 1 and "not divisible" in warnings[0].getMessage()
    # a batch of 2 keeps only the first divisible axis of ('data', 'fsdp', 'expert')
    assert sh.logical_to_pspec(("batch",), RULES, shape=(2,), mesh=mesh) == P("fsdp")


def test_a_mesh_axis_is_never_used_twice():
    rules = dict(RULES, embed=("fsdp",), mlp=("fsdp",), heads=("fsdp", "tensor"))
    assert sh.logical_to_pspec(("embed", "mlp"), rules) == P("fsdp")
    assert sh.logical_to_pspec(("embed", "heads"), rules) == P("fsdp", "tensor")
    mesh = sh.make_mesh(mesh_cfg(fsdp=2, tensor=2, expert=2))
    spec = sh.logical_to_pspec(("mlp", "embed", "heads"), rules, shape=(8, 8, 8), mesh=mesh)
    assert spec == P("fsdp", None, "tensor")   # each mesh axis once: embed gave up its fsdp


def test_rule_and_axes_errors():
    with pytest.raises(sh.UnknownLogicalAxisError, match="'embd'.*known: batch"):
        sh.logical_to_pspec(("embd",), RULES)
    with pytest.raises(sh.MeshConfigError, match="unknown mesh axes \\['model'\\]"):
        sh.rules_from_config({"embed": "model"})
    with pytest.raises(ValueError, match="rank 2"):
        sh.logical_to_pspec(("embed", "mlp"), RULES, shape=(4,))


def test_rules_from_config_strings_and_overrides():
    cfg = sh.default_config()
    cfg.rules.embed = "data,fsdp"
    cfg.rules.head_dim = "tensor"
    rules = sh.rules_from_config(cfg.rules)
    assert rules["embed"] == ("data", "fsdp") and rules["head_dim"] == ("tensor",)
    assert rules["layers"] is None
    assert sh.logical_to_pspec(("embed", "head_dim"), cfg.rules) == P(("data", "fsdp"), "tensor")


# ------------------------------------------------------------------ a sharded MLP equals 1 device

D, H, E, V, B = 16, 32, 4, 64, 16

AXES = {
    "embedding": ("vocab", "embed"),
    "w1": ("embed", "mlp"),
    "b1": ("mlp",),
    "experts": ("experts", "embed", "mlp"),
    "w2": ("mlp", "embed"),
    "norm": ("embed",),
}


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    shapes = {"embedding": (V, D), "w1": (D, H), "b1": (H,), "experts": (E, D, H),
              "w2": (H, D), "norm": (D,)}
    return {k: (rng.normal(size=s) / np.sqrt(s[-1])).astype(np.float32) for k, s in shapes.items()}


def mlp_loss(params, tokens, targets):
    x = params["embedding"][tokens]                                   # [B, D]
    h = jax.nn.gelu(x @ params["w1"] + params["b1"])                  # [B, H]
    h = h + jnp.einsum("bd,edh->bh", x, params["experts"]) / E        # an all-experts "MoE"
    y = (h @ params["w2"]) * params["norm"]                           # [B, D]
    logits = y @ params["embedding"].T                                # [B, V]
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, targets[:, None], axis=-1).mean()


@pytest.fixture(scope="module")
def reference():
    params = init_params()
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, V, size=B).astype(np.int32)
    targets = rng.integers(0, V, size=B).astype(np.int32)
    one = jax.devices()[0]
    p1 = jax.device_put(params, one)
    loss, grads = jax.jit(jax.value_and_grad(mlp_loss))(p1, jax.device_put(tokens, one),
                                                      jax.device_put(targets, one))
    return params, tokens, targets, float(loss), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("name", list(MESHES))
def test_sharded_mlp_loss_and_grad_equal_single_device(name, reference):
    params, tokens, targets, ref_loss, ref_grads = reference
    mesh = sh.make_mesh(mesh_cfg(**MESHES[name]))
    shardings = sh.shardings_for(AXES, params, mesh, RULES)
    placed = sh.place(params, shardings)
    batch = sh.shard_batch({"tokens": tokens, "targets": targets}, mesh, RULES)
    # params really are split over devices as the rules say
    assert placed["w1"].sharding.spec == shardings["w1"].spec
    if name == "fsdp2_tensor2_expert2":
        assert placed["experts"].sharding.spec == P("expert", "fsdp", "tensor")
        assert placed["experts"].addressable_shards[0].data.shape == (E // 2, D // 2, H // 2)
        assert batch["tokens"].addressable_shards[0].data.shape == (B // 4,)
    else:
        assert placed["w1"].addressable_shards[0].data.shape[0] < D
    step = jax.jit(jax.value_and_grad(mlp_loss), out_shardings=(sh.replicated(mesh), shardings))
    loss, grads = step(placed, batch["tokens"], batch["targets"])
    assert_close(float(loss), ref_loss, reduction_len=B * V)   # a mean over tokens of log-softmaxes
    for k in params:
        assert grads[k].sharding.spec == shardings[k].spec
        assert_close(np.asarray(grads[k]), ref_grads[k], reduction_len=B * V, err_msg=k)  # tokens x vocab


def test_optimizer_state_follows_param_shardings():
    mesh = sh.make_mesh(mesh_cfg(fsdp=2, tensor=2, expert=2))
    params = init_params()
    shardings = sh.shardings_for(AXES, params, mesh, RULES)
    placed = sh.place(params, shardings)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    state = sh.init_sharded_optimizer_state(tx, placed, shardings, mesh)
    adam = state[1][0]
    for k in params:
        assert adam.mu[k].sharding.spec == shardings[k].spec
        assert adam.nu[k].sharding.spec == shardings[k].spec
    assert adam.count.sharding.spec == P()
    ref = tx.init(params)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 state, ref)


def test_kv_cache_placement_both_layouts():
    """The one definition of the KV-cache shardings (placement.KV_CACHE_AXES), both layouts."""
    from ace_jax.runtime import placement as pl
    from models import configs, qwen3

    place = pl.Placement.create(sh.make_mesh(mesh_cfg(data=2, fsdp=2, tensor=2)), RULES)
    mc = configs.tiny_moe()                                  # nkv = 2 kv heads
    std = jax.eval_shape(lambda: qwen3.init_cache(mc, 8, 16, layout="standard"))
    got = place.kv_cache(std)                                # k / v [Lg, B, S, nkv, d]
    assert got.k[0].spec == P(None, ("data", "fsdp"), None, "tensor")
    assert got.kv_mask.spec == P(("data", "fsdp"))
    dec = jax.eval_shape(lambda: qwen3.init_cache(mc, 8, 16, layout="decode"))
    got = place.kv_cache(dec)                                # k [B, nkv, d, S], v [B, nkv, S, d]
    assert len(got.k) == mc.num_hidden_layers
    assert got.k[0].spec == P(("data", "fsdp"), "tensor") == got.v[0].spec
    placed = jax.device_put(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), std), place.kv_cache(std))
    assert placed.k[0].addressable_shards[0].data.shape == (mc.num_hidden_layers, 2, 16, 1, mc.head_dim)


def test_with_logical_constraint_inside_jit():
    mesh = sh.make_mesh(mesh_cfg(fsdp=8))
    f = jax.jit(lambda x: sh.with_logical_constraint(x * 2, ("batch", "embed"), mesh, RULES))
    out = f(jnp.ones((8, 4)))
    assert out.sharding.spec == P("fsdp")
    np.testing.assert_array_equal(out, 2 * np.ones((8, 4)))


def test_shardings_for_structure_mismatch_is_clear():
    mesh = sh.make_mesh(mesh_cfg(fsdp=8))
    with pytest.raises(ValueError, match="differ in structure"):
        sh.shardings_for({"a": ("embed",)}, {"b": np.zeros(8)}, mesh, RULES)


# ------------------------------------------------------------------ the real model's axes

def _abstract_model(name):
    qwen3 = pytest.importorskip("models.qwen3")
    configs = pytest.importorskip("models.configs")
    from flax import nnx
    cfg = configs.get_model_config(name)
    model = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    return qwen3.logical_axes(model), qwen3.flat_params(model)


def _per_device_elements(shapes, shardings, mesh_shape):
    total = 0
    for k, x in shapes.items():
        ways = 1
        for part in shardings[k].spec:
            for a in (part,) if isinstance(part, str) else (part or ()):
                ways *= mesh_shape[a]
        total += int(np.prod(x.shape)) // ways
    return total


def test_tiny_moe_params_place_on_the_test_mesh():
    axes, params = _abstract_model("tiny_moe")
    mesh = sh.make_mesh(mesh_cfg(fsdp=2, tensor=2, expert=2))
    shardings = sh.shardings_for(axes, params, mesh, RULES)   # every logical name has a rule
    experts = [k for k in axes if k.endswith("experts/gate_proj")]
    assert experts and shardings[experts[0]].spec == P(None, "expert", "fsdp", "tensor")
    assert shardings["embed_tokens/embedding"].spec == P("tensor", ("fsdp", "expert"))


def test_qwen3_30b_a3b_on_a_256_chip_fsdp_x_expert_mesh_is_fully_sharded(caplog):
    """Production layout check without hardware: an AbstractMesh of 256 chips (fsdp=32 x
    expert=8); no dim may fall back to replication, and per-chip parameters stay within 1% of
    total / 256 (the norms' replicated copies are the only excess)."""
    from jax.sharding import AbstractMesh
    axes, params = _abstract_model("qwen3_30b_a3b")
    mesh = AbstractMesh((1, 32, 1, 8), sh.MESH_AXES)
    with caplog.at_level(logging.WARNING, logger="ace_jax.runtime.sharding"):
        shardings = sh.shardings_for(axes, params, mesh, RULES)
    assert not [r for r in caplog.records if "not divisible" in r.getMessage()]
    total = sum(int(np.prod(x.shape)) for x in params.values())
    assert total == 30_532_122_624
    per_chip = _per_device_elements(params, shardings, dict(mesh.shape))
    assert total / 256 <= per_chip <= 1.01 * total / 256, per_chip / (total / 256)
