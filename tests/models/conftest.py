"""Fixtures for the HF mapping / parity tests: tiny random-init HF models saved with save_pretrained.

Every checkpoint is built in the test session from a fixed torch seed (no download). All weights
are re-drawn so that a wrong mapping cannot hide behind HF's default init: RMSNorm scales are
1 + 0.1 * N(0, 1) (not all ones), projections N(0, 0.08^2), and router weights N(0, 0.5^2) so that
router logits are spread out (top-k choices are not near-ties).
"""
from __future__ import annotations

import dataclasses
import pathlib

import pytest

# name -> (HF class name, config kwargs). Shapes are tiny (hidden <= 64, 2-3 layers, vocab <= 256).
_COMMON = dict(
    vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
HF_SPECS: dict[str, tuple[str, dict]] = {
    # MoE, renormalised top-k, untied head, 8 experts top-2.
    "moe_norm": ("moe", dict(_COMMON, num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=16,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                             tie_word_embeddings=False)),
    # MoE, raw top-k probabilities (norm_topk_prob false), tied embeddings, 4 experts top-2.
    "moe_raw_tied": ("moe", dict(_COMMON, num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=16,
                                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=False,
                                 tie_word_embeddings=True)),
    # Mixed dense / MoE: decoder_sparse_step=2 -> layers 0, 2 dense and layer 1 MoE (3 groups).
    "moe_mixed": ("moe", dict(_COMMON, num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=16,
                              num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
                              tie_word_embeddings=False)),
    # Mixed by mlp_only_layers: layer 0 dense, layers 1-2 MoE.
    "moe_mlp_only": ("moe", dict(_COMMON, num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=16,
                                 num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0],
                                 tie_word_embeddings=False)),
    "dense_untied": ("dense", dict(_COMMON, num_hidden_layers=2, intermediate_size=64, tie_word_embeddings=False)),
    "dense_tied": ("dense", dict(_COMMON, num_hidden_layers=2, intermediate_size=64, tie_word_embeddings=True)),
}


@dataclasses.dataclass
class HFFixture:
    name: str
    model: object          # the transformers model (fp32, eval mode)
    path: pathlib.Path     # save_pretrained directory (per-expert keys, fp32, one file)


def build_hf_model(kind: str, cfg_kwargs: dict, seed: int = 0):
    """A transformers Qwen3 / Qwen3-MoE with every weight re-drawn from ``seed`` (fp32, eval)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if kind == "moe" else (Qwen3Config, Qwen3ForCausalLM)
    config = cfg_cls(**cfg_kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("mlp.gate.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.08 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="session")
def hf_fixture(tmp_path_factory):
    """Factory: ``hf_fixture(name) -> HFFixture``; built once per session per name."""
    cache: dict[str, HFFixture] = {}

    def get(name: str) -> HFFixture:
        if name not in cache:
            kind, kwargs = HF_SPECS[name]
            model = build_hf_model(kind, kwargs)
            path = tmp_path_factory.mktemp(f"hf_{name}")
            model.save_pretrained(path)
            cache[name] = HFFixture(name, model, path)
        return cache[name]

    return get


def hf_state_dict_numpy(model) -> dict:
    """The model's saved-format (per-expert) tensors as float32 numpy, via a save/load round trip."""
    import tempfile

    from safetensors.numpy import load_file

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        return load_file(str(pathlib.Path(d) / "model.safetensors"))
