"""Tests of models/configs.py: HF rules for layer kinds, config.json I/O, errors, presets, param counts."""
from __future__ import annotations

import dataclasses

import jax
import pytest

from models.configs import (
    RUNTIME_FIELDS,
    LayerGroup,
    ModelConfig,
    UnsupportedConfigError,
    get_model_config,
    model_config_names,
    tiny_dense,
    tiny_moe,
)
from models.qwen3 import param_counts

REAL_PRESETS = ["qwen3_0_6b", "qwen3_1_7b", "qwen3_4b", "qwen3_8b", "qwen3_30b_a3b", "qwen3_235b_a22b"]


# ------------------------------------------------------------------------------------------ layer kinds
def _hf_rule(i: int, num_experts: int, step: int, mlp_only: tuple[int, ...]) -> bool:
    # Written out from Qwen3MoeDecoderLayer.__init__ (transformers 5.24.0).
    return (i not in mlp_only) and (num_experts > 0 and (i + 1) % step == 0)


@pytest.mark.parametrize("step,mlp_only", [(1, ()), (2, ()), (3, ()), (1, (0, 3)), (2, (1,))])
def test_is_moe_layer_follows_hf_rule(step, mlp_only):
    cfg = tiny_moe(num_hidden_layers=6, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    assert [cfg.is_moe_layer(i) for i in range(6)] == [_hf_rule(i, 8, step, mlp_only) for i in range(6)]
    # the groups tile the layers, in order, each a maximal run of one kind
    groups = cfg.layer_groups()
    assert sum(g.count for g in groups) == 6
    assert [g.start for g in groups] == [sum(x.count for x in groups[:j]) for j in range(len(groups))]
    for a, b in zip(groups, groups[1:]):
        assert a.kind != b.kind
    for g in groups:
        assert all(cfg.is_moe_layer(i) == (g.kind == "moe") for i in range(g.start, g.start + g.count))


def test_layer_groups_mixed_kinds():
    assert tiny_moe(num_hidden_layers=4, decoder_sparse_step=2).layer_groups() == [
        LayerGroup("dense", 0, 1), LayerGroup("moe", 1, 1), LayerGroup("dense", 2, 1), LayerGroup("moe", 3, 1)]
    assert tiny_moe(num_hidden_layers=4, mlp_only_layers=[0, 1]).layer_groups() == [
        LayerGroup("dense", 0, 2), LayerGroup("moe", 2, 2)]
    assert tiny_dense(num_hidden_layers=3).layer_groups() == [LayerGroup("dense", 0, 3)]
    with pytest.raises(IndexError):
        tiny_moe().is_moe_layer(2)


@pytest.mark.parametrize("name", REAL_PRESETS)
def test_real_presets_have_one_group(name):
    cfg = get_model_config(name)
    groups = cfg.layer_groups()
    assert len(groups) == 1 and groups[0].count == cfg.num_hidden_layers
    assert groups[0].kind == ("moe" if cfg.num_experts else "dense")


# ------------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(use_sliding_window=True), "use_sliding_window"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope_type='linear'"),
        (dict(rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type='dynamic'"),
        (dict(rope_scaling={"rope_type": "yarn"}), "factor"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0, "low_freq_factor": 1.0}), "low_freq_factor"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok"),
        (dict(mlp_only_layers=(5,)), "mlp_only_layers"),
        (dict(dtype="float16"), "dtype"),
        (dict(moe_dispatch="megablox"), "moe_dispatch"),
        (dict(moe_capacity_factor=0.0), "moe_capacity_factor"),
        (dict(remat_policy="sometimes"), "remat_policy"),
        (dict(hidden_size=0), "hidden_size"),
    ],
)
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(UnsupportedConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
        tiny_moe(**changes)
    assert issubclass(UnsupportedConfigError, ValueError)


@pytest.mark.parametrize(
    "changes,field",
    [
        (dict(use_sliding_window=True, sliding_window=4096), "use_sliding_window"),
        (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3"),
        (dict(rope_theta=None, rope_parameters={"rope_type": "longrope", "rope_theta": 1e6}), "longrope"),
        (dict(model_type="llama"), "model_type"),
        (dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ],
)
def test_from_hf_dict_errors_name_the_field(changes, field):
    d = {**tiny_moe().to_hf_dict(), **changes}
    with pytest.raises(UnsupportedConfigError, match=field):
        ModelConfig.from_hf_dict(d)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(KeyError) as info:
        get_model_config("qwen3_31b")
    for name in REAL_PRESETS + ["tiny_moe", "tiny_dense"]:
        assert name in str(info.value)
    assert sorted(REAL_PRESETS + ["tiny_moe", "tiny_dense"]) == model_config_names()


# ------------------------------------------------------------------------------------------ HF config.json I/O
def test_preset_values_match_spec():
    cfg = get_model_config("qwen3_30b_a3b")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
            cfg.vocab_size, cfg.norm_topk_prob, cfg.tie_word_embeddings, cfg.rope_theta) == (
        2048, 48, 32, 4, 128, 128, 8, 768, 151936, True, False, 1e6)
    assert get_model_config("qwen3_0_6b").tie_word_embeddings and not get_model_config("qwen3_8b").tie_word_embeddings
    assert get_model_config("qwen3_30b_a3b", dtype="float32").dtype == "float32"


@pytest.mark.parametrize("name", REAL_PRESETS + ["tiny_moe", "tiny_dense"])
def test_hf_dict_round_trip(name):
    cfg = get_model_config(name)
    d = cfg.to_hf_dict()
    assert d["model_type"] == ("qwen3_moe" if cfg.num_experts else "qwen3")
    assert "rope_theta" in d and "rope_scaling" in d and "rope_parameters" not in d
    runtime = {f: getattr(cfg, f) for f in RUNTIME_FIELDS}
    assert ModelConfig.from_hf_dict(d, **runtime) == cfg


def test_yarn_round_trip_and_v5_rope_parameters():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    cfg = get_model_config("qwen3_30b_a3b", rope_scaling=yarn, max_position_embeddings=131072)
    d = cfg.to_hf_dict()
    assert d["rope_scaling"] == yarn and d["rope_theta"] == 1e6
    assert ModelConfig.from_hf_dict(d, dtype="bfloat16", remat_policy="full") == cfg
    # transformers v5 form: rope_parameters carries theta and the scaling
    v5 = {k: v for k, v in d.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {"rope_theta": 1e6, **yarn}
    assert ModelConfig.from_hf_dict(v5, dtype="bfloat16", remat_policy="full") == cfg
    v5["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e6}
    assert ModelConfig.from_hf_dict(v5).rope_theta == 5e6 and ModelConfig.from_hf_dict(v5).rope_scaling is None


def test_transformers_config_classes_accept_export_and_load_back():
    from transformers import Qwen3Config, Qwen3MoeConfig

    for cfg, cls in [(tiny_moe(decoder_sparse_step=2, num_hidden_layers=4), Qwen3MoeConfig),
                     (tiny_dense(), Qwen3Config)]:
        hf = cls(**cfg.to_hf_dict())
        assert hf.num_hidden_layers == cfg.num_hidden_layers and hf.head_dim == cfg.head_dim
        back = ModelConfig.from_hf_dict(hf.to_dict())  # v5 dict (rope_parameters)
        assert back == dataclasses.replace(cfg, dtype="float32", param_dtype="float32", moe_dispatch="ragged",
                                           remat_policy="none", scan_layers=True)


def test_config_is_hashable_and_immutable():
    cfg = tiny_moe(rope_scaling={"rope_type": "yarn", "factor": 2.0})
    assert hash(cfg) == hash(tiny_moe(rope_scaling={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 3  # type: ignore[misc]


# ------------------------------------------------------------------------------------------ parameter counts
# (total, active per token). Active = total minus the experts a token does not use (HF's A3B / A22B
# convention, embedding and lm_head included). Spec 5.1: 30B-A3B total 30,532,122,624 and
# 3,041,865,728 matmul params + 311,164,928 embedding + 2,048 final norm = 3,353,032,704 ("3.35B");
# 235B-A22B 235,093,634,560 / 22,190,763,520; dense: 596.0M, 1.721B, 4.022B, 8.191B.
EXPECTED_COUNTS = {
    "qwen3_30b_a3b": (30_532_122_624, 3_041_865_728 + 311_164_928 + 2_048),
    "qwen3_235b_a22b": (235_093_634_560, 22_190_763_520),
}
EXPECTED_DENSE = {"qwen3_0_6b": 596.0e6, "qwen3_1_7b": 1.721e9, "qwen3_4b": 4.022e9, "qwen3_8b": 8.191e9}


@pytest.mark.parametrize("name", REAL_PRESETS)
def test_param_counts_abstract(name):
    before = len(jax.live_arrays())
    total, active = param_counts(get_model_config(name))
    assert len(jax.live_arrays()) <= before + 2  # nothing of model size was allocated (at most rng keys)
    if name in EXPECTED_COUNTS:
        assert (total, active) == EXPECTED_COUNTS[name]
    else:  # dense: every weight is active; the spec rounds to 4 significant digits
        expected = EXPECTED_DENSE[name]
        assert active == total
        assert abs(total - expected) <= 0.5 * 10 ** (len(str(int(expected))) - 4), (total, expected)


@pytest.mark.parametrize("minimal", [
    {"model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4},
    {"model_type": "qwen3", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "intermediate_size": 48},
])
def test_missing_keys_take_the_transformers_class_defaults(minimal):
    from transformers import Qwen3Config, Qwen3MoeConfig

    cls = Qwen3MoeConfig if minimal["model_type"] == "qwen3_moe" else Qwen3Config
    filled = cls(**{k: v for k, v in minimal.items() if k != "model_type"}).to_dict()
    assert ModelConfig.from_hf_dict(minimal) == ModelConfig.from_hf_dict(filled)
