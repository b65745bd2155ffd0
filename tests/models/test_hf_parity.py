"""Full-model parity with transformers 5.24 (torch CPU, fp32): HF checkpoint -> Flax logits / aux loss,
and Flax -> HF export reloaded with ``from_pretrained``.

Inputs include a left-padded and a right-padded row; positions are derived from the attention mask
and passed to both models (the sampler's convention). Only real-token logits are compared (HF's
fully-masked query rows are undefined).
"""
import numpy as np
import pytest
from flax import nnx

from models import hf_mapping as M
from models.configs import ModelConfig, tiny_moe
from models.qwen3 import Qwen3ForCausalLM, flat_params
from tests.numerics import assert_close, tolerance

# Flax vs torch fp32: the same math in another order through every layer (ulps of the logits' scale)
ULPS = 16

# [B=3, T=8]: row 0 full, row 1 left-padded by 3, row 2 right-padded by 2 (pad id 0).
_IDS = np.array(
    [[5, 17, 99, 3, 64, 21, 120, 7],
     [0, 0, 0, 44, 9, 101, 33, 2],
     [88, 12, 4, 57, 126, 30, 0, 0]], dtype=np.int32)
_MASK = np.array(
    [[1, 1, 1, 1, 1, 1, 1, 1],
     [0, 0, 0, 1, 1, 1, 1, 1],
     [1, 1, 1, 1, 1, 1, 0, 0]], dtype=np.int32)
_POS = np.maximum(np.cumsum(_MASK, axis=1) - 1, 0).astype(np.int32)


def _hf_forward(model, ids=_IDS, mask=_MASK, pos=_POS, *, moe: bool):
    import torch

    kwargs = dict(attention_mask=torch.tensor(mask), position_ids=torch.tensor(pos, dtype=torch.long))
    if moe:
        labels = torch.tensor(np.where(mask == 1, ids, -100), dtype=torch.long)
        kwargs.update(output_router_logits=True, labels=labels)
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long), **kwargs)
    aux = None if not moe else float(out.aux_loss)
    return out.logits.float().numpy(), aux


def _flax_forward(model, ids=_IDS, mask=_MASK, pos=_POS):
    out = model(ids, pos, attention_mask=mask.astype(bool))
    return np.asarray(out.logits), float(out.aux_loss)


def _max_abs_real(a, b, mask=_MASK):
    real = mask.astype(bool)
    return float(np.max(np.abs(a[real] - b[real])))


@pytest.mark.parametrize(
    "name, dispatch",
    [
        ("moe_norm", "dense"),
        ("moe_norm", "ragged"),
        ("moe_raw_tied", "ragged"),  # norm_topk_prob false + tied embeddings
        ("moe_mixed", "ragged"),  # decoder_sparse_step=2
        ("moe_mlp_only", "dense"),  # mlp_only_layers=[0]
        ("dense_untied", "ragged"),
        ("dense_tied", "ragged"),
    ],
)
def test_hf_checkpoint_logits_and_aux_loss_match_transformers(hf_fixture, name, dispatch):
    fx = hf_fixture(name)
    model = M.load_hf_model(fx.path, moe_dispatch=dispatch)
    assert model.config.moe_dispatch == dispatch and model.config.dtype == "float32"
    moe = model.config.num_experts > 0
    hf_logits, hf_aux = _hf_forward(fx.model, moe=moe)
    logits, aux = _flax_forward(model)
    assert logits.shape == (3, 8, model.config.vocab_size) and logits.dtype == np.float32
    err = _max_abs_real(logits, hf_logits)
    atol = tolerance(hf_logits[_MASK.astype(bool)], reduction_len=model.config.hidden_size, ulps=ULPS)
    assert err < atol, f"{name}: max abs logit diff {err:.2e} > {atol:.2e}"
    # The comparison is not vacuous: logits vary across tokens and padding changes nothing real.
    assert np.std(hf_logits[_MASK.astype(bool)]) > 0.1
    if moe:
        assert hf_aux is not None and abs(aux - hf_aux) < 1e-5, (aux, hf_aux)
        assert aux > model.config.num_experts_per_tok * 0.9  # >= top_k when balanced: non-degenerate value
    else:
        assert aux == 0.0


def test_padding_does_not_change_real_token_logits(hf_fixture):
    """Row 1 of the padded batch equals the same tokens run unpadded (positions 0..4)."""
    model = M.load_hf_model(hf_fixture("moe_norm").path)
    padded, _ = _flax_forward(model)
    ids = _IDS[1:2, 3:]
    alone = np.asarray(model(ids, np.arange(5, dtype=np.int32)[None]).logits)
    assert_close(padded[1, 3:], alone[0], reduction_len=model.config.hidden_size)


def test_router_top_k_is_not_degenerate(hf_fixture):
    """Guards the fixtures: router logits are spread, so top-k parity actually tests routing."""
    import torch

    fx = hf_fixture("moe_norm")
    with torch.no_grad():
        out = fx.model(torch.tensor(_IDS, dtype=torch.long), output_router_logits=True)
    for layer_logits in out.router_logits:
        probs = torch.softmax(layer_logits.float(), dim=-1)
        top = torch.topk(probs, 3, dim=-1).values
        gap = (top[:, 1] - top[:, 2]).min().item()  # margin between the 2nd (kept) and 3rd expert
        assert gap > 1e-4
        assert len(set(torch.topk(probs, 2, dim=-1).indices.flatten().tolist())) >= 4


@pytest.mark.parametrize("tied", [False, True])
def test_flax_export_reloads_in_transformers(tmp_path, tied):
    """A Flax-initialised model, exported (fp32), gives the same logits in transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = tiny_moe(num_hidden_layers=3, decoder_sparse_step=2, vocab_size=128, tie_word_embeddings=tied,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0, moe_dispatch="dense")
    model = Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(7))
    # Spread the router weights so top-2 choices are clear (default init gives near-ties).
    flat = {k: np.asarray(v) for k, v in flat_params(model).items()}
    rng = np.random.default_rng(0)
    for k in flat:
        if k.endswith("mlp/gate/kernel"):
            flat[k] = rng.normal(0, 0.5, flat[k].shape).astype(np.float32)
        elif k.endswith("/scale"):
            flat[k] = (1 + 0.1 * rng.normal(size=flat[k].shape)).astype(np.float32)
    from models.qwen3 import set_flat_params

    set_flat_params(model, flat)
    out = M.export_hf(model, cfg, tmp_path / "export", dtype="float32", max_shard_bytes=60_000)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    assert hf.config.norm_topk_prob is True and hf.config.decoder_sparse_step == 2
    assert hf.config.tie_word_embeddings is tied
    hf_logits, hf_aux = _hf_forward(hf, moe=True)
    logits, aux = _flax_forward(model)
    err = _max_abs_real(logits, hf_logits)
    atol = tolerance(hf_logits[_MASK.astype(bool)], reduction_len=cfg.hidden_size, ulps=ULPS)
    assert err < atol, f"max abs logit diff {err:.2e} > {atol:.2e}"
    assert abs(aux - hf_aux) < 1e-5
    # And the round trip back into Flax gives the same parameters.
    cfg2, flat2 = M.load_hf_checkpoint(out)
    assert cfg2.replace(moe_dispatch="dense") == cfg
    for k in flat:
        np.testing.assert_array_equal(flat2[k], flat[k])


def test_load_hf_model_param_dtype(hf_fixture):
    import jax.numpy as jnp

    fx = hf_fixture("dense_tied")
    model = M.load_hf_model(fx.path, param_dtype="bfloat16", dtype="bfloat16", rngs=nnx.Rngs(3))
    assert isinstance(model.config, ModelConfig) and model.config.param_dtype == "bfloat16"
    assert model.config.dtype == "bfloat16"
    params = flat_params(model)
    assert all(v.dtype == jnp.bfloat16 for v in params.values())
    _, flat = M.load_hf_checkpoint(fx.path, dtype="bfloat16")
    for k in flat:  # the values are the checkpoint's (rounded to bf16), not the random init
        assert np.asarray(params[k]).tobytes() == flat[k].tobytes(), k
    logits = np.asarray(model(_IDS, _POS, attention_mask=_MASK.astype(bool)).logits)
    assert logits.dtype == np.float32 and np.isfinite(logits[_MASK.astype(bool)]).all()
