"""HF weights load straight into sharded arrays (models.hf_mapping.load_hf_params_sharded /
load_hf_model(shardings=...)) on the 8 simulated CPU devices of tests/conftest.py.

Each device's block is read on its own from the safetensors (local: ``safe_open`` slices; remote:
byte ranges), so the tests check the values (bit-exact against the whole-tensor load), the
shardings, and what was read (`ReadStats`, one record per read).
"""
import json
import shutil
import uuid

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors.numpy import load_file, save_file

from ace_jax.runtime import placement as pl, sharding as sh
from models import hf_mapping as M
from models.configs import tiny_moe
from models.qwen3 import Qwen3ForCausalLM, flat_params
from tests.ace_jax.conftest import gcs_emulator  # noqa: F401  (the GCS emulator fixture)


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() != 8:
        pytest.skip(f"needs the 8 simulated CPU devices of tests/conftest.py, have {jax.device_count()}")


class RecordingStats(M.ReadStats):
    """`ReadStats` that also keeps every read: (HF key, bytes)."""

    def __init__(self):
        super().__init__()
        self.log = []

    def add(self, key, nbytes, requests=1):
        self.log.append((key, nbytes))
        super().add(key, nbytes, requests)


CONFIG = tiny_moe()  # 2 MoE layers, 8 experts, H=32, Im=16, heads 4/2 x 16, untied


def _random_flat(config, seed=0):
    """Every parameter drawn from N(0, 1) (norms too), so that a wrong block cannot match by chance."""
    rng = np.random.default_rng(seed)
    return {name: rng.standard_normal(shape).astype(np.float32)
            for name, shape in M.flax_param_shapes(config).items()}


def _fuse_experts(src, dst):
    """Rewrite a per-expert checkpoint (one file) in transformers v5's fused expert layout."""
    shutil.copytree(src, dst)
    (dst / "model.safetensors.index.json").unlink()
    tensors = {}
    for f in sorted(dst.glob("model-*.safetensors")):
        tensors.update(load_file(str(f)))
        f.unlink()
    E = CONFIG.num_experts
    for i in range(CONFIG.num_hidden_layers):
        p = f"model.layers.{i}.mlp.experts."
        gate = np.stack([tensors.pop(f"{p}{j}.gate_proj.weight") for j in range(E)])
        up = np.stack([tensors.pop(f"{p}{j}.up_proj.weight") for j in range(E)])
        tensors[p + "gate_up_proj"] = np.concatenate([gate, up], axis=1)        # [E, 2*Im, H]
        tensors[p + "down_proj"] = np.stack([tensors.pop(f"{p}{j}.down_proj.weight") for j in range(E)])
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(per-expert dir in several shards, fused-expert dir, the flat params written)."""
    base = tmp_path_factory.mktemp("sharded_load")
    flat = _random_flat(CONFIG)
    per_expert = M.export_hf(flat, CONFIG, base / "per_expert", dtype="float32", max_shard_bytes=40_000)
    assert len(list(per_expert.glob("model-*.safetensors"))) > 2
    return per_expert, _fuse_experts(per_expert, base / "fused"), flat


@pytest.fixture(scope="module")
def mesh():
    cfg = sh.default_config()
    cfg.fsdp, cfg.tensor, cfg.expert = 2, 2, 2
    return sh.make_mesh(cfg)


def _abstract(config):
    return nnx.eval_shape(lambda: Qwen3ForCausalLM(config, rngs=nnx.Rngs(0)))


def _rule_shardings(mesh, config=CONFIG):
    """{flat name: NamedSharding} from the logical axes and the default rules (what the trainer uses)."""
    state = pl.param_shardings(_abstract(config), mesh, sh.DEFAULT_RULES)
    return {"/".join(str(p) for p in path): var.get_value() for path, var in nnx.to_flat_state(state)}


def _every_axis_shardings(config=CONFIG):
    """Shard every dim that a mesh axis of size 2 divides, last dims first (head_dim, layers and
    vocab included), over a ("a", "b", "c") mesh: blocks that no rule table would produce."""
    m = jax.make_mesh((2, 2, 2), ("a", "b", "c"))
    out = {}
    for name, shape in M.flax_param_shapes(config).items():
        spec, free = [None] * len(shape), ["a", "b", "c"]
        for d in reversed(range(len(shape))):
            if free and shape[d] % 2 == 0:
                spec[d] = free.pop(0)
        out[name] = NamedSharding(m, P(*spec))
    return out


def _assert_equal_params(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


# --------------------------------------------------------------------------------------------------
# values and shardings


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("shardings", ["rules", "every_axis"])
def test_sharded_load_equals_whole_load(ckpt, mesh, layout, shardings):
    path = ckpt[0] if layout == "per_expert" else ckpt[1]
    want = {k: np.asarray(v) for k, v in flat_params(M.load_hf_model(ckpt[0])).items()}
    _assert_equal_params(want, ckpt[2])  # the unsharded load is the written model
    spec = _rule_shardings(mesh) if shardings == "rules" else _every_axis_shardings()
    got = M.load_hf_params_sharded(path, CONFIG, spec)
    _assert_equal_params(got, want)
    for name, arr in got.items():
        assert arr.sharding == spec[name], name
        assert arr.dtype == np.float32
    if shardings == "rules":  # the expert weights are really split (not replicated by a fallback)
        assert spec["layers/0/mlp/experts/gate_proj"].spec == P(None, "expert", "fsdp", "tensor")


def test_load_hf_model_installs_the_placement_shardings(ckpt, mesh):
    path = ckpt[0]
    model = M.load_hf_model(path, shardings=lambda m: pl.param_shardings(m, mesh, sh.DEFAULT_RULES),
                            param_dtype="bfloat16")
    ref = M.load_hf_model(path, param_dtype="bfloat16")
    want_shardings = _rule_shardings(mesh, model.config)
    got, want = flat_params(model), flat_params(ref)
    _assert_equal_params(got, want)
    for name, arr in got.items():
        assert arr.sharding == want_shardings[name] and arr.dtype == jax.numpy.bfloat16, name


# --------------------------------------------------------------------------------------------------
# what is read


def _hf_nbytes(path):
    shapes, get = M.read_safetensors_dir(path)
    return {k: get(k).nbytes for k in shapes}


def test_each_device_reads_only_its_block(ckpt, mesh):
    path = ckpt[0]
    stats = RecordingStats()
    spec = _rule_shardings(mesh)
    M.load_hf_params_sharded(path, CONFIG, spec, stats=stats)
    nbytes = _hf_nbytes(path)
    # Every tensor is read exactly once in total: devices holding the same block (replicas) share
    # one read, and no read goes beyond the block.
    assert stats.by_key == nbytes
    assert stats.tensor_bytes == sum(nbytes.values())
    # gate_proj [L, E, H, Im] over (expert, fsdp, tensor) = 2 x 2 x 2: a device's block holds
    # 4 of the 8 experts of both layers, and of each HF tensor [Im, H] half the rows, half the columns.
    key = "model.layers.1.mlp.experts.5.gate_proj.weight"
    reads = [n for k, n in stats.log if k == key]
    assert reads == [nbytes[key] // 4] * 4
    # q_proj [L, H, nq, d] over (fsdp x expert, tensor): 8 distinct blocks, each 1/8 of the tensor.
    key = "model.layers.0.self_attn.q_proj.weight"
    assert [n for k, n in stats.log if k == key] == [nbytes[key] // 8] * 8
    # a replicated parameter (q_norm [L, d]: no rule shards it) is read once, not once per device
    assert [k for k, _ in stats.log].count("model.layers.0.self_attn.q_norm.weight") == 1


def test_a_partial_head_dim_block_reads_whole_heads(ckpt):
    """q_proj [L, H, nq, d] with d split: a head's rows are read whole and cut after the transform."""
    path = ckpt[0]
    m = jax.make_mesh((2, 4), ("a", "b"))
    spec = {name: NamedSharding(m, P()) for name in M.flax_param_shapes(CONFIG)}
    spec["layers/0/self_attn/q_proj/kernel"] = NamedSharding(m, P(None, None, "b", "a"))  # nq/4, d/2
    stats = RecordingStats()
    got = M.load_hf_params_sharded(path, CONFIG, spec, stats=stats)
    np.testing.assert_array_equal(np.asarray(got["layers/0/self_attn/q_proj/kernel"]),
                                  ckpt[2]["layers/0/self_attn/q_proj/kernel"])
    key = "model.layers.0.self_attn.q_proj.weight"
    reads = [n for k, n in stats.log if k == key]
    assert reads == [_hf_nbytes(path)[key] // 4] * 8  # 8 blocks, each reads its head (1 of 4)


# --------------------------------------------------------------------------------------------------
# remote: byte ranges (memory:// for the byte counts, gs:// through the GCS emulator)


@pytest.fixture(scope="module")
def memory_ckpt(ckpt):
    import fsspec

    fs = fsspec.filesystem("memory")
    root = f"/ace_sharded_load_{uuid.uuid4().hex[:8]}"
    for layout, local in (("per_expert", ckpt[0]), ("fused", ckpt[1])):
        for f in sorted(local.iterdir()):
            fs.pipe_file(f"{root}/{layout}/{f.name}", f.read_bytes())
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_remote_load_reads_only_the_blocks_bytes(ckpt, mesh, memory_ckpt, layout):
    local = ckpt[0] if layout == "per_expert" else ckpt[1]
    spec = _rule_shardings(mesh)
    want = M.load_hf_params_sharded(local, CONFIG, spec)
    exact = RecordingStats()
    got = M.load_hf_params_sharded(f"{memory_ckpt}/{layout}", CONFIG, spec, max_gap_bytes=0, stats=exact)
    _assert_equal_params(got, want)
    nbytes = _hf_nbytes(local)
    # max_gap_bytes=0: exactly the blocks' bytes travel, each tensor once in total.
    assert exact.by_key == nbytes
    assert 0 < exact.header_bytes < 20_000
    if layout == "per_expert":
        key = "model.layers.1.mlp.experts.5.gate_proj.weight"
        assert [n for k, n in exact.log if k == key] == [nbytes[key] // 4] * 4
    # the default merges runs that are close: fewer requests, each within its tensor
    merged = RecordingStats()
    got = M.load_hf_params_sharded(f"{memory_ckpt}/{layout}", CONFIG, spec, stats=merged)
    _assert_equal_params(got, want)
    assert merged.requests < exact.requests
    for key, n in merged.log:
        assert n <= nbytes[key], key


def test_gcs_load(ckpt, mesh, gcs_emulator):  # noqa: F811
    fs = gcs_emulator.fs()
    root = gcs_emulator.prefix()
    for layout, local in (("per_expert", ckpt[0]), ("fused", ckpt[1])):
        for f in sorted(local.iterdir()):
            fs.put(str(f), f"{root}/{layout}/{f.name}")
    # batch_size=1: one range request at a time (the emulator serves concurrent requests slowly)
    opts = {"endpoint_url": gcs_emulator.endpoint, "token": "anon", "project": "test", "batch_size": 1}
    url = f"gs://{root}"
    stats = RecordingStats()
    model = M.load_hf_model(f"{url}/per_expert", storage_options=opts, stats=stats,
                            shardings=lambda m: pl.param_shardings(m, mesh, sh.DEFAULT_RULES))
    assert model.config == CONFIG and stats.header_bytes > 0
    nbytes = _hf_nbytes(ckpt[0])
    for key, n in stats.log:
        assert n <= nbytes[key], key
    _assert_equal_params(flat_params(model), ckpt[2])
    for name, arr in flat_params(model).items():
        assert arr.sharding == _rule_shardings(mesh)[name], name
    config, flat = M.load_hf_checkpoint(f"{url}/fused", storage_options=opts)
    assert config == CONFIG
    _assert_equal_params(flat, ckpt[2])
    with pytest.raises(M.CheckpointError, match="does not exist"):
        M.load_hf_model(f"{url}/nothing_here", storage_options=opts)


# --------------------------------------------------------------------------------------------------
# bad input


def test_checkpoint_that_does_not_match_the_config(ckpt, mesh, tmp_path):
    path = ckpt[0]
    spec = _rule_shardings(mesh)
    other = tiny_moe(moe_intermediate_size=24)
    with pytest.raises(M.CheckpointMismatchError,
                       match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight.*\(16, 32\).*\(24, 32\)"):
        M.load_hf_params_sharded(path, other, _rule_shardings(mesh, other))
    # a tensor missing from its shard (and from the index): named, before any data is read
    bad = tmp_path / "missing"
    shutil.copytree(path, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    key = "model.layers.1.mlp.experts.3.up_proj.weight"
    shard = bad / index["weight_map"].pop(key)
    tensors = load_file(str(shard))
    del tensors[key]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    stats = M.ReadStats()
    with pytest.raises(M.CheckpointMismatchError, match=r"missing.*experts\.3\.up_proj\.weight"):
        M.load_hf_params_sharded(bad, CONFIG, spec, stats=stats)
    assert stats.tensor_bytes == 0
    # a config.json that disagrees with the weights, through the model-level entry
    fewer = shutil.copytree(path, tmp_path / "fewer_layers")
    cfg = json.loads((fewer / "config.json").read_text())
    cfg["num_hidden_layers"] = 1
    (fewer / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(M.CheckpointMismatchError, match=r"unexpected.*model\.layers\.1\."):
        M.load_hf_model(fewer, shardings=lambda m: pl.param_shardings(m, mesh, sh.DEFAULT_RULES))


def test_shardings_must_match_the_parameters(ckpt, mesh):
    path = ckpt[0]
    spec = _rule_shardings(mesh)
    with pytest.raises(ValueError, match=r"missing norm/scale"):
        M.load_hf_params_sharded(path, CONFIG, {k: v for k, v in spec.items() if k != "norm/scale"})
    with pytest.raises(ValueError, match=r"unexpected layers/9/x"):
        M.load_hf_params_sharded(path, CONFIG, dict(spec, **{"layers/9/x": spec["norm/scale"]}))
    with pytest.raises(TypeError, match=r"shardings\['norm/scale'\] is a P(artitionSpec)?, not"):
        M.load_hf_params_sharded(path, CONFIG, dict(spec, **{"norm/scale": P()}))
    with pytest.raises(TypeError, match="nnx.State or a flat"):
        M.load_hf_model(path, shardings=lambda m: [1, 2])


def test_byte_runs_of_a_block():
    # [4, 6] float32: rows 1:3, cols 2:5 -> 2 runs of 3 floats at (1*6+2)*4 and (2*6+2)*4
    starts, length = M._byte_runs((4, 6), ((1, 3), (2, 5)), 4)
    assert starts.tolist() == [32, 56] and length == 12
    # whole trailing axes make one run per leading index: [2, 3, 4] block [0:2, 0:3, 0:4] is one run
    starts, length = M._byte_runs((2, 3, 4), ((0, 2), (0, 3), (0, 4)), 2)
    assert starts.tolist() == [0] and length == 48
    starts, length = M._byte_runs((2, 3, 4), ((0, 2), (1, 3), (0, 4)), 1)
    assert starts.tolist() == [4, 16] and length == 8
    # runs at most max_gap bytes apart are one range: [0, 4) and [10, 14) (gap 6), not [100, 104)
    assert M._merge_runs(np.array([0, 10, 100]), 4, 6) == [(0, 14, [0, 10]), (100, 104, [100])]
    assert M._merge_runs(np.array([0, 10, 100]), 4, 5) == [(0, 4, [0]), (10, 14, [10]), (100, 104, [100])]


def test_remote_reader_reads_bf16_blocks_and_rejects_a_bad_header(ckpt, memory_ckpt, tmp_path):
    import fsspec

    bf16 = M.export_hf(ckpt[2], CONFIG, tmp_path / "bf16", dtype="bfloat16")
    fs = fsspec.filesystem("memory")
    url = f"{memory_ckpt}/bf16"
    for f in sorted(bf16.iterdir()):
        fs.pipe_file(f"{url[len('memory://'):]}/{f.name}", f.read_bytes())
    local, remote = M.SafetensorsReader(bf16), M.SafetensorsReader(url, max_gap_bytes=0)
    assert remote.shapes == local.shapes
    key = "model.layers.0.self_attn.q_proj.weight"   # [64, 32]
    for box in (None, (slice(3, 40), slice(5, 6)), (slice(0, 64), slice(30, 32)), (slice(7, 7), slice(None))):
        a, b = local.read(key, box), remote.read(key, box)
        assert a.dtype == b.dtype == ml_dtypes.bfloat16 and a.tobytes() == b.tobytes(), box
    with pytest.raises(ValueError, match="step"):
        remote.read(key, (slice(0, 8, 2), slice(None)))
    shard = sorted(p.name for p in bf16.glob("model-*.safetensors"))[0]
    fs.pipe_file(f"{url[len('memory://'):]}/{shard}", (10**9).to_bytes(8, "little") + b"{}")
    with pytest.raises(M.CheckpointError, match=f"{shard}.*not a safetensors file"):
        M.SafetensorsReader(url)
