"""Tests of the HF <-> Flax table on numpy dicts: layouts, round trips, sharding, fused layout, errors.

Model-level parity (Flax forward vs transformers) is in test_hf_parity.py.
"""
import copy
import json
import pathlib
import shutil

import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from models import hf_mapping as M
from models.configs import UnsupportedConfigError

from .conftest import hf_state_dict_numpy


def _raw_tensors(path: pathlib.Path) -> dict[str, np.ndarray]:
    shapes, get = M.read_safetensors_dir(path)
    return {k: get(k) for k in shapes}


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


# --------------------------------------------------------------------------------------------------
# layouts


@pytest.mark.parametrize("name", ["moe_norm", "moe_raw_tied", "moe_mixed", "moe_mlp_only", "dense_untied", "dense_tied"])
def test_load_shapes_match_table(hf_fixture, name):
    fx = hf_fixture(name)
    config, flat = M.load_hf_checkpoint(fx.path)
    assert {k: v.shape for k, v in flat.items()} == M.flax_param_shapes(config)
    assert all(v.dtype == np.float32 for v in flat.values())
    assert ("lm_head/kernel" in flat) == (not config.tie_word_embeddings)


def test_layouts_are_the_contract(hf_fixture):
    """Each Flax array holds exactly the HF numbers at the documented positions (independent check)."""
    fx = hf_fixture("moe_mixed")  # groups: dense [0], moe [1], dense [2]
    config, flat = M.load_hf_checkpoint(fx.path)
    hf = hf_state_dict_numpy(fx.model)
    assert [(g.kind, g.start, g.count) for g in config.layer_groups()] == [("dense", 0, 1), ("moe", 1, 1), ("dense", 2, 1)]
    d, nq, nkv, E = config.head_dim, config.num_attention_heads, config.num_key_value_heads, config.num_experts
    np.testing.assert_array_equal(flat["embed_tokens/embedding"], hf["model.embed_tokens.weight"])
    np.testing.assert_array_equal(flat["lm_head/kernel"], hf["lm_head.weight"].T)
    np.testing.assert_array_equal(flat["norm/scale"], hf["model.norm.weight"])
    for g, i in ((0, 0), (1, 1), (2, 2)):
        p = f"model.layers.{i}."
        q = hf[p + "self_attn.q_proj.weight"]
        for h in range(nq):
            np.testing.assert_array_equal(flat[f"layers/{g}/self_attn/q_proj/kernel"][0, :, h, :], q[h * d:(h + 1) * d].T)
            np.testing.assert_array_equal(
                flat[f"layers/{g}/self_attn/o_proj/kernel"][0, h],
                hf[p + "self_attn.o_proj.weight"][:, h * d:(h + 1) * d].T,
            )
        for h in range(nkv):
            for kv in ("k", "v"):
                np.testing.assert_array_equal(
                    flat[f"layers/{g}/self_attn/{kv}_proj/kernel"][0, :, h, :],
                    hf[p + f"self_attn.{kv}_proj.weight"][h * d:(h + 1) * d].T,
                )
        np.testing.assert_array_equal(flat[f"layers/{g}/self_attn/q_norm/scale"][0], hf[p + "self_attn.q_norm.weight"])
        np.testing.assert_array_equal(flat[f"layers/{g}/self_attn/k_norm/scale"][0], hf[p + "self_attn.k_norm.weight"])
        np.testing.assert_array_equal(flat[f"layers/{g}/input_layernorm/scale"][0], hf[p + "input_layernorm.weight"])
        np.testing.assert_array_equal(
            flat[f"layers/{g}/post_attention_layernorm/scale"][0], hf[p + "post_attention_layernorm.weight"]
        )
    for g, i in ((0, 0), (2, 2)):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            np.testing.assert_array_equal(flat[f"layers/{g}/mlp/{proj}/kernel"][0], hf[f"model.layers.{i}.mlp.{proj}.weight"].T)
        assert f"layers/{g}/mlp/gate/kernel" not in flat
    np.testing.assert_array_equal(flat["layers/1/mlp/gate/kernel"][0], hf["model.layers.1.mlp.gate.weight"].T)
    for j in range(E):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            np.testing.assert_array_equal(
                flat[f"layers/1/mlp/experts/{proj}"][0, j], hf[f"model.layers.1.mlp.experts.{j}.{proj}.weight"].T
            )
    assert "layers/1/mlp/gate_proj/kernel" not in flat


def test_hf_shapes_table_matches_transformers(hf_fixture):
    for name in ("moe_mlp_only", "dense_tied"):
        fx = hf_fixture(name)
        config, _ = M.load_hf_checkpoint(fx.path)
        hf = hf_state_dict_numpy(fx.model)
        assert M.hf_param_shapes(config) == {k: v.shape for k, v in hf.items()}


def test_qwen3_30b_a3b_tensor_count():
    from models.configs import get_model_config

    cfg = get_model_config("qwen3_30b_a3b")
    shapes = M.hf_param_shapes(cfg)
    assert len(shapes) == 18867  # spec §2.1
    assert shapes["model.layers.47.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert sum(int(np.prod(s)) for s in shapes.values()) == 30_532_122_624
    assert M.flax_param_shapes(cfg)["layers/0/mlp/experts/gate_proj"] == (48, 128, 2048, 768)


# --------------------------------------------------------------------------------------------------
# round trips, formats


@pytest.mark.parametrize("name", ["moe_norm", "moe_raw_tied", "moe_mixed", "dense_tied"])
def test_fp32_round_trip_exact(hf_fixture, tmp_path, name):
    fx = hf_fixture(name)
    config, flat = M.load_hf_checkpoint(fx.path)
    out = M.export_hf(flat, config, tmp_path / "out", dtype="float32")
    src, dst = _raw_tensors(fx.path), _raw_tensors(out)
    assert sorted(src) == sorted(dst)
    for k in src:
        assert dst[k].dtype == src[k].dtype and np.array_equal(dst[k], src[k]), k
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float32"


def test_bf16_round_trip_bit_exact(hf_fixture, tmp_path):
    import torch

    fx = hf_fixture("moe_norm")
    bf_dir = tmp_path / "bf16"
    copy.deepcopy(fx.model).to(torch.bfloat16).save_pretrained(bf_dir)  # never touch the shared fixture
    config, flat = M.load_hf_checkpoint(bf_dir)
    assert all(v.dtype == ml_dtypes.bfloat16 for v in flat.values())
    out = M.export_hf(flat, config, tmp_path / "out", dtype="bfloat16")
    src, dst = _raw_tensors(bf_dir), _raw_tensors(out)
    assert sorted(src) == sorted(dst)
    for k in src:
        assert src[k].dtype == dst[k].dtype == ml_dtypes.bfloat16, k
        assert src[k].tobytes() == dst[k].tobytes(), k
    # fp32 -> bf16 export rounds like torch (round to nearest even), not through float16.
    _, flat32 = M.load_hf_checkpoint(fx.path)
    out2 = M.export_hf(flat32, config, tmp_path / "out2", dtype="bfloat16")
    ref = {k: v.to(torch.bfloat16).view(torch.int16).numpy() for k, v in fx.model.state_dict().items()
           if k == "model.embed_tokens.weight"}
    got = _raw_tensors(out2)["model.embed_tokens.weight"]
    assert np.array_equal(got.view(np.int16), ref["model.embed_tokens.weight"])


def test_export_layout_and_metadata(hf_fixture, tmp_path):
    fx = hf_fixture("moe_norm")
    config, flat = M.load_hf_checkpoint(fx.path)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    (tok_dir / "tokenizer_config.json").write_text("{}")
    out = M.export_hf(flat, config, tmp_path / "out", max_shard_bytes=40_000, tokenizer_dir=tok_dir,
                      generation_config={"temperature": 0.6})
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    for f in files:
        assert (out / f).stat().st_size <= 40_000 + 20_000  # payload bound + header
        with safe_open(str(out / f), framework="numpy") as h:
            assert h.metadata() == {"format": "pt"}
            assert all(index["weight_map"][k] == f for k in h.keys())
    keys = set(index["weight_map"])
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    assert len(keys) == len(M.hf_param_shapes(config))
    # the default dtype is the model's param_dtype (fp32 here)
    assert index["metadata"]["total_size"] == sum(4 * int(np.prod(s)) for s in M.hf_param_shapes(config).values())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["torch_dtype"] == "float32"
    assert cfg["rope_theta"] == 10000.0 and cfg["rope_scaling"] is None and "rope_parameters" not in cfg
    assert cfg["num_experts"] == 8 and cfg["norm_topk_prob"] is True
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "temperature": 0.6}
    assert (out / "tokenizer.json").read_text() == "{}" and (out / "tokenizer_config.json").is_file()


def test_export_dtype_defaults_to_the_param_dtype(hf_fixture, tmp_path):
    config, flat = M.load_hf_checkpoint(hf_fixture("dense_tied").path)
    assert config.param_dtype == "float32"

    def stored(out):
        with safe_open(str(next(out.glob("model-*.safetensors"))), framework="numpy") as f:
            dtypes = {str(f.get_slice(k).get_dtype()) for k in f.keys()}
        return dtypes, json.loads((out / "config.json").read_text())["torch_dtype"]

    out = M.export_hf(flat, config, tmp_path / "fp32")  # an fp32 model exports fp32, exactly
    assert stored(out) == ({"F32"}, "float32")
    assert all(np.array_equal(v, flat[k]) for k, v in M.load_hf_checkpoint(out)[1].items())
    bf16_config = config.replace(param_dtype="bfloat16")
    assert stored(M.export_hf(flat, bf16_config, tmp_path / "bf16")) == ({"BF16"}, "bfloat16")
    assert stored(M.export_hf(flat, config, tmp_path / "asked", dtype="bfloat16")) == ({"BF16"}, "bfloat16")
    assert stored(M.export_hf(flat, bf16_config, tmp_path / "asked32", dtype="float32")) == ({"F32"}, "float32")
    assert {x.dtype for _, x in M.flax_to_hf(flat, bf16_config)} == {np.dtype(ml_dtypes.bfloat16)}


def test_export_reloads_in_transformers_with_same_logits(hf_fixture, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    for name in ("moe_mixed", "dense_tied"):
        fx = hf_fixture(name)
        config, flat = M.load_hf_checkpoint(fx.path)
        out = M.export_hf(flat, config, tmp_path / name, dtype="float32", max_shard_bytes=50_000)
        reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        ids = torch.tensor([[3, 17, 99, 5, 64, 1, 120, 7]])
        with torch.no_grad():
            a = fx.model(ids).logits
            b = reloaded(ids).logits
        assert torch.equal(a, b), name


def test_sharded_and_fused_layouts_load_identically(hf_fixture, tmp_path):
    fx = hf_fixture("moe_mlp_only")
    _, ref = M.load_hf_checkpoint(fx.path)
    sharded = tmp_path / "sharded"
    fx.model.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    fused = tmp_path / "fused"
    fx.model.save_pretrained(fused, save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in load_file(str(fused / "model.safetensors"))
    for path in (sharded, fused):
        _, flat = M.load_hf_checkpoint(path)
        assert sorted(flat) == sorted(ref)
        for k in ref:
            np.testing.assert_array_equal(flat[k], ref[k], err_msg=f"{path.name}: {k}")


def test_dtype_and_overrides(hf_fixture):
    fx = hf_fixture("dense_untied")
    config, flat = M.load_hf_checkpoint(fx.path, dtype="bfloat16", config_overrides={"dtype": "bfloat16",
                                                                                     "moe_dispatch": "dense"})
    assert config.dtype == "bfloat16" and config.moe_dispatch == "dense"
    assert all(v.dtype == ml_dtypes.bfloat16 for v in flat.values())


def test_fsspec_memory_round_trip(hf_fixture):
    import fsspec

    fx = hf_fixture("moe_raw_tied")
    config, flat = M.load_hf_checkpoint(fx.path)
    url = "memory://ace_h2_test/export"
    M.export_hf(flat, config, url, dtype="float32")
    fs = fsspec.filesystem("memory")
    assert fs.exists("/ace_h2_test/export/model.safetensors.index.json")
    config2, flat2 = M.load_hf_checkpoint(url)
    assert config2 == config
    for k in flat:
        np.testing.assert_array_equal(flat2[k], flat[k])
    fs.rm("/ace_h2_test", recursive=True)


# --------------------------------------------------------------------------------------------------
# bad input


def _rewrite(path: pathlib.Path, fn) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor(hf_fixture, tmp_path):
    p = _copy(hf_fixture("moe_norm").path, tmp_path / "c")
    _rewrite(p, lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"))
    with pytest.raises(M.CheckpointMismatchError, match=r"missing.*model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        M.load_hf_checkpoint(p)


def test_unexpected_tensor(hf_fixture, tmp_path):
    p = _copy(hf_fixture("dense_untied").path, tmp_path / "c")
    _rewrite(p, lambda t: t.__setitem__("model.layers.0.self_attn.q_proj.bias", np.zeros(64, np.float32)))
    with pytest.raises(M.CheckpointMismatchError, match=r"unexpected.*q_proj\.bias.*\(64,\)"):
        M.load_hf_checkpoint(p)


def test_wrong_shape(hf_fixture, tmp_path):
    p = _copy(hf_fixture("moe_norm").path, tmp_path / "c")
    _rewrite(p, lambda t: t.__setitem__("model.layers.0.self_attn.k_norm.weight", np.ones(8, np.float32)))
    with pytest.raises(M.CheckpointMismatchError, match=r"model\.layers\.0\.self_attn\.k_norm\.weight.*\(8,\).*\(16,\)"):
        M.load_hf_checkpoint(p)


def _edit_config(path: pathlib.Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_config_disagrees_with_weights(hf_fixture, tmp_path):
    src = hf_fixture("moe_norm").path
    p = _copy(src, tmp_path / "a")
    _edit_config(p, moe_intermediate_size=24)
    with pytest.raises(M.CheckpointMismatchError, match=r"experts\.0\.(down|gate|up)_proj\.weight.*shape.*\(24|24\)"):
        M.load_hf_checkpoint(p)
    p = _copy(src, tmp_path / "b")
    _edit_config(p, num_hidden_layers=1)
    with pytest.raises(M.CheckpointMismatchError, match=r"unexpected.*model\.layers\.1\."):
        M.load_hf_checkpoint(p)
    p = _copy(src, tmp_path / "c")
    _edit_config(p, num_local_experts=6)
    with pytest.raises(M.CheckpointMismatchError, match=r"mlp\.gate\.weight.*\(8, 32\).*\(6, 32\)"):
        M.load_hf_checkpoint(p)
    p = _copy(src, tmp_path / "d")
    _edit_config(p, tie_word_embeddings=True)  # the checkpoint has its own (different) lm_head
    with pytest.raises(M.CheckpointMismatchError, match="tie_word_embeddings"):
        M.load_hf_checkpoint(p)
    # A tied checkpoint that still stores lm_head.weight is fine when it is exactly the embedding.
    p = _copy(src, tmp_path / "e")
    _edit_config(p, tie_word_embeddings=True)
    _rewrite(p, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"].copy()))
    config, flat = M.load_hf_checkpoint(p)
    assert config.tie_word_embeddings and "lm_head/kernel" not in flat


def test_unsupported_config_features(hf_fixture, tmp_path):
    src = hf_fixture("dense_untied").path
    p = _copy(src, tmp_path / "a")
    _edit_config(p, use_sliding_window=True, sliding_window=16)
    with pytest.raises(UnsupportedConfigError, match="sliding_window"):
        M.load_hf_checkpoint(p)
    p = _copy(src, tmp_path / "b")
    _edit_config(p, rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0})
    with pytest.raises(UnsupportedConfigError, match="longrope"):
        M.load_hf_checkpoint(p)


def test_missing_files_and_bad_index(hf_fixture, tmp_path):
    with pytest.raises(M.CheckpointError, match="does not exist"):
        M.load_hf_checkpoint(tmp_path / "nope")
    p = _copy(hf_fixture("dense_tied").path, tmp_path / "a")
    (p / "model.safetensors").unlink()
    with pytest.raises(M.CheckpointError, match="no weights"):
        M.load_hf_checkpoint(p)
    p = tmp_path / "sh"
    hf_fixture("dense_tied").model.save_pretrained(p, max_shard_size="20KB")
    shard = sorted(p.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(M.CheckpointError, match=f"shard '{shard.name}'.*missing"):
        M.load_hf_checkpoint(p)


def test_export_rejects_wrong_params(hf_fixture, tmp_path):
    config, flat = M.load_hf_checkpoint(hf_fixture("moe_norm").path)
    bad = dict(flat)
    bad["layers/0/mlp/experts/up_proj"] = bad["layers/0/mlp/experts/up_proj"][:, :4]
    with pytest.raises(M.CheckpointMismatchError, match=r"layers/0/mlp/experts/up_proj.*\(2, 4, 32, 16\).*\(2, 8, 32, 16\)"):
        M.export_hf(bad, config, tmp_path / "x")
    good = M.export_hf(flat, config, tmp_path / "y", dtype="float32")
    before = sorted(p.name for p in good.iterdir())
    bad = dict(flat)
    del bad["norm/scale"]
    with pytest.raises(M.CheckpointMismatchError, match="missing.*norm/scale"):
        M.export_hf(bad, config, good)
    assert sorted(p.name for p in good.iterdir()) == before  # a failed export leaves the old one intact
    with pytest.raises(M.CheckpointMismatchError, match="missing.*norm/scale"):
        M.flax_to_hf(bad, config)  # validated at call time, not lazily
    bad = dict(flat, **{"layers/0/mlp/gate_proj/kernel": np.zeros((2, 32, 48), np.float32)})
    with pytest.raises(M.CheckpointMismatchError, match="unexpected.*layers/0/mlp/gate_proj/kernel"):
        M.export_hf(bad, config, tmp_path / "z")
