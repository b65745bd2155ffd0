"""The sampler's CPU fast paths change no result: the argmax / Gumbel-max sampling equals
``jax.random.categorical`` draw for draw, and the "decode" KV-cache layout (per-layer buffers in the
attention matmuls' layouts, unrolled layers) generates exactly what the "standard" layout does."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ace_jax.runtime import generate
from ace_jax.runtime.generate import Generator, sample_token, SamplingConfig, SamplingKnobs
from models import configs, qwen3
from tests.numerics import assert_close

PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37, 38, 39]]


def test_argmax_last_matches_argmax_with_ties_and_masked_entries():
    rng = np.random.RandomState(0)
    x = rng.randint(0, 5, (64, 37)).astype(np.float32)  # many ties: the first maximum wins
    x[rng.rand(*x.shape) < 0.3] = -np.inf
    x[3] = -np.inf
    x[4, 10] = np.inf
    np.testing.assert_array_equal(generate._argmax_last(jnp.asarray(x)), np.argmax(x, axis=-1))


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_sample_token_equals_categorical(temperature):
    logits = 3.0 * jax.random.normal(jax.random.key(1), (16, 300))
    knobs = SamplingKnobs.from_config(SamplingConfig(temperature=temperature, top_k=0, top_p=1.0))
    for i in range(5):
        keys = jax.random.split(jax.random.key(10 + i), logits.shape[0])   # one key per row
        tok, lp = jax.jit(sample_token)(keys, logits, knobs)
        t = temperature if temperature > 0 else 1.0
        want = (jnp.argmax(logits, -1) if temperature == 0 else jnp.stack(
            [jax.random.categorical(k, row / t) for k, row in zip(keys, logits)]))
        np.testing.assert_array_equal(tok, want)
        logp = jax.nn.log_softmax(logits / t, axis=-1)
        assert_close(lp, jnp.take_along_axis(logp, want[:, None], -1)[:, 0], reduction_len=logits.shape[-1])


def test_decode_layout_generates_what_the_standard_layout_does(monkeypatch):
    model = qwen3.Qwen3ForCausalLM(configs.tiny_moe(num_hidden_layers=3, mlp_only_layers=(1,)),
                                   rngs=nnx.Rngs(3))
    outs = {}
    for layout in ("standard", "decode"):
        monkeypatch.setattr(generate, "cache_layout", lambda config, layout=layout: layout)
        for temperature in (0.0, 1.0):
            cfg = SamplingConfig(max_new_tokens=10, group_size=2, temperature=temperature,
                                 prompt_bucket=8, eos_ids=(7,))
            outs[layout, temperature] = Generator(model, cfg).generate(PROMPTS, jax.random.key(4))
    for temperature in (0.0, 1.0):
        a, b = outs["standard", temperature], outs["decode", temperature]
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_array_equal(a.lengths, b.lengths)
        np.testing.assert_array_equal(a.finish_reason, b.finish_reason)
        assert_close(a.logprobs, b.logprobs, reduction_len=model.config.vocab_size)


def test_shared_prompt_prefix_generates_what_per_row_copies_do(monkeypatch):
    """The accelerator rollout (a "standard" cache, blockwise decode; platform "gpu" runs it on
    CPU) keeps each prompt's keys once, shared by its G samples (cascade attention), and samples
    what the per-row copies of the prompt (`share_cache`) sample."""
    mc = configs.tiny_moe(num_hidden_layers=3, mlp_only_layers=(1,), platform="gpu",
                          attention_impl="blockwise")
    model = qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(3))
    cfg = SamplingConfig(max_new_tokens=10, group_size=3, temperature=1.0, prompt_bucket=8, eos_ids=(7,))
    assert generate.shared_prefix_decode(mc, 3, 10)
    assert not generate.shared_prefix_decode(mc, 1, 10)              # nothing to share
    assert not generate.shared_prefix_decode(mc.replace(platform="cpu"), 3, 10)   # "decode" cache
    shared = Generator(model, cfg).generate(PROMPTS, jax.random.key(4))
    monkeypatch.setattr(generate, "shared_prefix_decode", lambda *a: False)
    jax.clear_caches()  # the rollout is traced again, now copying the prompt per row
    copied = Generator(model, cfg).generate(PROMPTS, jax.random.key(4))
    np.testing.assert_array_equal(shared.tokens, copied.tokens)
    np.testing.assert_array_equal(shared.lengths, copied.lengths)
    assert_close(shared.logprobs, copied.logprobs, reduction_len=mc.vocab_size)
