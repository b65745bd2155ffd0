"""Greedy decoding of the tiny parity model matches transformers' greedy ``generate``."""
import jax
import numpy as np
import pytest

from ace_jax.runtime.generate import FinishReason, Generator, SamplingConfig
from models import hf_mapping
from tests.models.conftest import HF_SPECS, build_hf_model

NEW_TOKENS = 40


@pytest.mark.parametrize("name", ["moe_norm", "dense_tied"])
def test_greedy_matches_transformers(name, tmp_path):
    torch = pytest.importorskip("torch")
    kind, kwargs = HF_SPECS[name]
    hf = build_hf_model(kind, dict(kwargs, max_position_embeddings=256))
    hf.save_pretrained(tmp_path)
    model = hf_mapping.load_hf_model(tmp_path)
    prompts = [[5, 17, 33, 9, 60, 61], [7, 8, 99]]
    ours = Generator(model, SamplingConfig(max_new_tokens=NEW_TOKENS, temperature=0.0,
                                           prompt_bucket=8)).generate(prompts, jax.random.key(0))
    assert np.all(np.asarray(ours.finish_reason) == FinishReason.LENGTH)
    for i, p in enumerate(prompts):  # one prompt at a time: no padding on the HF side
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              do_sample=False, eos_token_id=None, pad_token_id=0)
        np.testing.assert_array_equal(np.asarray(ours.tokens)[i], ref[0, len(p):].numpy())
