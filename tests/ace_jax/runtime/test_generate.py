"""Grouped generation: determinism, EOS / stop sequences, sharing the prompt cache, padding
invariance, and behaviour log-probs equal to the learner's teacher-forced log-probs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ace_jax.rl import rollout_batch
from ace_jax.runtime import generate
from ace_jax.runtime.generate import FinishReason, Generator, SamplingConfig
from models import configs, qwen3
from tests.numerics import assert_close

PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37, 38, 39]]


@pytest.fixture(scope="module")
def model():
    return qwen3.Qwen3ForCausalLM(configs.tiny_moe(), rngs=nnx.Rngs(3))


def _gen(model, prompts=PROMPTS, key=0, **kw):
    kw.setdefault("prompt_bucket", 8)
    kw.setdefault("max_new_tokens", 12)
    return Generator(model, SamplingConfig(**kw)).generate(prompts, jax.random.key(key))


def test_shapes_and_determinism(model):
    a = _gen(model, group_size=4)
    b = _gen(model, group_size=4)
    c = _gen(model, group_size=4, key=1)
    assert a.tokens.shape == (12, 12) and a.logprobs.shape == (12, 12)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.tokens, c.tokens)
    np.testing.assert_array_equal(a.prompt_index, np.repeat(np.arange(3), 4))
    assert np.all(np.asarray(a.finish_reason) == FinishReason.LENGTH)
    assert np.all(np.asarray(a.lengths) == 12)
    # Samples of one group differ (temperature 1 over a random-init model).
    assert len({tuple(r) for r in np.asarray(a.tokens[:4])}) > 1


def test_greedy_group_shares_prompt_and_is_padding_invariant(model):
    grouped = _gen(model, temperature=0.0, group_size=3)
    toks = np.asarray(grouped.tokens).reshape(3, 3, -1)
    for b in range(3):
        for g in range(1, 3):
            np.testing.assert_array_equal(toks[b, 0], toks[b, g])
        alone = _gen(model, prompts=[PROMPTS[b]], temperature=0.0, prompt_bucket=16)
        np.testing.assert_array_equal(np.asarray(alone.tokens)[0], toks[b, 0])


def test_top_k_one_and_tiny_top_p_are_greedy(model):
    greedy = np.asarray(_gen(model, temperature=0.0).tokens)
    np.testing.assert_array_equal(np.asarray(_gen(model, top_k=1, key=5).tokens), greedy)
    np.testing.assert_array_equal(np.asarray(_gen(model, top_p=1e-6, key=6).tokens), greedy)


def test_a_static_truncation_choice_samples_what_the_run_time_choice_does():
    """`sample_token`'s ``truncate`` (the dry run's cost model) compiles only the branch the
    knobs take; the tokens and log-probs are those of the run-time ``lax.cond``."""
    rng = np.random.RandomState(0)
    logits = jnp.asarray(rng.randn(4, 50) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(1), 4)
    for top_k, top_p, truncate in ((0, 1.0, False), (5, 0.9, True)):
        knobs = generate.SamplingKnobs.from_config(SamplingConfig(temperature=0.7, top_k=top_k, top_p=top_p))
        want = generate.sample_token(keys, logits, knobs)
        got = generate.sample_token(keys, logits, knobs, truncate)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    hlo = jax.jit(lambda l: generate.sample_token(keys, l, knobs, False)).lower(logits).as_text()
    assert "stablehlo.sort" not in hlo and "stablehlo.case" not in hlo


def test_eos_and_stop_sequences(model):
    greedy = np.asarray(_gen(model, temperature=0.0).tokens)
    eos = int(greedy[0, 2])
    out = _gen(model, temperature=0.0, eos_ids=(eos,), pad_id=0)
    first_eos = int(np.argmax(greedy[0] == eos))
    assert int(out.lengths[0]) == first_eos + 1
    assert int(out.finish_reason[0]) == FinishReason.EOS
    np.testing.assert_array_equal(np.asarray(out.tokens)[0, :first_eos + 1], greedy[0, :first_eos + 1])
    assert np.all(np.asarray(out.tokens)[0, first_eos + 1:] == 0)
    assert np.all(np.asarray(out.logprobs)[0, first_eos + 1:] == 0)

    stop = tuple(int(t) for t in greedy[1, 3:6])
    out = _gen(model, temperature=0.0, stop_sequences=((999_999,), stop))
    row = np.asarray(out.tokens)[1]
    assert int(out.finish_reason[1]) == FinishReason.STOP
    end = int(out.lengths[1])
    assert tuple(row[end - 3:end]) == stop and end <= 6


def test_behaviour_logprobs_match_teacher_forcing(model):
    """The sampler's log-probs equal the learner's recomputation on the same rows (fp32)."""
    cfg = SamplingConfig(max_new_tokens=10, group_size=2, temperature=0.7, prompt_bucket=8,
                         eos_ids=(7,))
    out = Generator(model, cfg).generate(PROMPTS, jax.random.key(2))
    batch = rollout_batch.make_train_batch(PROMPTS, out, np.zeros(6), prompt_bucket=8, pad_id=0)
    logits, _ = rollout_batch.completion_logits(model, batch)
    lp = rollout_batch.token_logprobs(logits, batch.input_ids[:, batch.prompt_len:], 0.7)
    mask = np.asarray(batch.completion_mask) > 0
    assert_close(np.asarray(lp)[mask], np.asarray(out.logprobs)[mask], reduction_len=model.config.vocab_size)


def test_update_weights_changes_samples(model):
    gen = Generator(model, SamplingConfig(max_new_tokens=6, temperature=0.0, prompt_bucket=8))
    before = np.asarray(gen.generate(PROMPTS, jax.random.key(0)).tokens)
    params = jax.tree.map(lambda x: x * 1.5, gen.params)
    gen.update_weights(params)
    after = np.asarray(gen.generate(PROMPTS, jax.random.key(0)).tokens)
    assert not np.array_equal(before, after)
    with pytest.raises(ValueError, match="structure"):
        gen.update_weights({"a": jnp.zeros(3)})


def test_bad_input_is_clear():
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingConfig(max_new_tokens=0)
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="at least one token"):
        generate.left_pad([[1], []], 8, 0)


def test_eos_defaults_to_the_models_own():
    """SamplingConfig.eos_ids=None (the default) stops at the model's config.eos_token_id; ()
    turns EOS off."""
    base = qwen3.Qwen3ForCausalLM(configs.tiny_moe(), rngs=nnx.Rngs(3))
    free = _gen(base, temperature=0.0, eos_ids=())
    first = int(np.asarray(free.tokens)[0, 0])            # greedy: the first token of prompt 0
    assert int(free.lengths[0]) == 12
    model = qwen3.Qwen3ForCausalLM(configs.tiny_moe(eos_token_id=first), rngs=nnx.Rngs(3))
    out = _gen(model, temperature=0.0)                    # eos_ids not given: the model's EOS
    assert int(out.lengths[0]) == 1 and int(out.finish_reason[0]) == FinishReason.EOS
    np.testing.assert_array_equal(np.asarray(out.tokens)[0, 0], first)
    assert int(_gen(model, temperature=0.0, eos_ids=()).lengths[0]) == 12
