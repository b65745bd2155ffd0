"""Completion log-probs and entropy in chunks of M: the same values and gradients (wrt the hidden
states and the lm_head, tied and untied) as autodiff through the full fp32 [N, M, V] logits, for
lengths that are not multiples of the chunk, and temporaries bounded by the chunk, not by M."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ace_jax.rl import rollout_batch
from models import configs, qwen3

N, M, H, V = 3, 10, 16, 64
TEMPERATURE = 0.8
EPS32 = float(np.finfo(np.float32).eps)


def _assert_close(got, want, terms: int, what: str = "") -> None:
    """|got - want| <= 16 eps * terms * max|want|: fp32 rounding of reductions of ``terms``
    summands (the two sides round and order their sums differently)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    atol = 16 * EPS32 * terms * max(np.max(np.abs(want)), 1.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=what)


def _inputs(tied: bool, seed: int = 0):
    """h [N, M, H], lm_head w ([H, V], or [V, H] tied), tokens [N, M], cotangent weights [N, M]."""
    rng = np.random.RandomState(seed)
    h = jnp.asarray(rng.randn(N, M, H), jnp.float32)
    w = jnp.asarray(rng.randn(*((V, H) if tied else (H, V))) / np.sqrt(H) * 3, jnp.float32)
    tokens = jnp.asarray(rng.randint(0, V, (N, M)), jnp.int32)
    a = jnp.asarray(rng.randn(N, M), jnp.float32)
    b = jnp.asarray(rng.randn(N, M), jnp.float32)
    return h, w, tokens, a, b


def _reference(h, w, tokens, dtype, tied):
    """The unchunked math through autodiff: full fp32 logits, log_softmax, gather, entropy."""
    logits = rollout_batch._head_logits(h, w, dtype, tied)
    return (rollout_batch.token_logprobs(logits, tokens, TEMPERATURE),
            rollout_batch.token_entropy(logits, TEMPERATURE))


def _fused(chunk_tokens):
    def f(h, w, tokens, dtype, tied):
        return rollout_batch._fused_logprobs(h, w, tokens, TEMPERATURE, dtype, tied, chunk_tokens)
    return f


def _values_and_grads(fn, h, w, tokens, a, b, dtype, tied):
    def loss(h, w):
        lp, ent = fn(h, w, tokens, dtype, tied)
        return jnp.sum(lp * a) + 0.3 * jnp.sum(ent * b), (lp, ent)
    (_, (lp, ent)), (dh, dw) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(h, w)
    return lp, ent, dh, dw


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_equals_unchunked_autodiff_reference(tied):
    """Chunks of 4 (M = 10 pads to 12: three chunks, the last one partial) and one chunk of all M
    give the reference's log-probs, entropies and gradients wrt h and w."""
    h, w, tokens, a, b = _inputs(tied)
    want = _values_and_grads(_reference, h, w, tokens, a, b, jnp.float32, tied)
    assert np.all(np.asarray(want[0]) < 0) and np.all(np.asarray(want[1]) > 0)
    for chunk in (4, None):
        got = _values_and_grads(_fused(chunk), h, w, tokens, a, b, jnp.float32, tied)
        for name, g, r, terms in zip(("lp", "entropy", "dh", "dw"), got, want, (V, V, V, N * M)):
            assert g.shape == r.shape and g.dtype == r.dtype, name
            _assert_close(g, r, terms, f"{name} chunk={chunk} tied={tied}")


def test_chunking_changes_no_result_in_bf16_compute():
    """bf16 compute (logits from bf16 operands, fp32 accumulation; logit gradient cast to bf16):
    chunks of 3 give what one chunk gives; only dw's sum over positions is split."""
    h, w, tokens, a, b = _inputs(tied=False, seed=1)
    h = h.astype(jnp.bfloat16)
    want = _values_and_grads(_fused(None), h, w, tokens, a, b, jnp.bfloat16, False)
    got = _values_and_grads(_fused(3), h, w, tokens, a, b, jnp.bfloat16, False)
    assert got[2].dtype == jnp.bfloat16 and got[3].dtype == jnp.float32
    for name, g, r, terms in zip(("lp", "entropy", "dh", "dw"), got, want, (1, 1, 1, N * M)):
        _assert_close(g, r, terms, name)


@pytest.mark.parametrize("chunk", [0, -2, 2.5, True, "8"])
def test_bad_chunk_tokens_is_a_clear_error(chunk):
    h, w, tokens, _, _ = _inputs(tied=False)
    with pytest.raises(ValueError, match="chunk_tokens"):
        rollout_batch._fused_logprobs(h, w, tokens, TEMPERATURE, jnp.float32, False, chunk)


def test_mismatched_tokens_is_a_clear_error():
    h, w, tokens, _, _ = _inputs(tied=False)
    with pytest.raises(ValueError, match=r"\[N, M\]"):
        rollout_batch._fused_logprobs(h, w, tokens[:, 1:], TEMPERATURE, jnp.float32, False, 4)


@pytest.mark.parametrize("tied", [False, True])
def test_completion_logprobs_in_chunks_equal_logits_path(tied):
    """Through the policy (a completion of 7 in chunks of 3): the values of
    completion_logits + token_logprobs / token_entropy; ``chunk_tokens`` reaches the chunking
    (a bad one is refused). Gradients through the model: tests/ace_jax/rl/test_learner.py."""
    model = qwen3.Qwen3ForCausalLM(configs.tiny_dense(num_hidden_layers=1, tie_word_embeddings=tied),
                                   rngs=nnx.Rngs(0))
    rng = np.random.RandomState(0)
    n, p, m = 2, 5, 7
    ids = rng.randint(1, 256, (n, p + m)).astype(np.int32)
    batch = rollout_batch.TrainBatch(
        input_ids=jnp.asarray(ids), positions=jnp.asarray(np.tile(np.arange(p + m), (n, 1)), jnp.int32),
        attention_mask=jnp.ones((n, p + m), bool), completion_mask=jnp.ones((n, m), jnp.float32),
        behaviour_logprobs=jnp.zeros((n, m), jnp.float32), rewards=jnp.zeros((n,), jnp.float32),
        ref_logprobs=jnp.zeros((n, m), jnp.float32))

    def reference(mdl):
        logits, aux = rollout_batch.completion_logits(mdl, batch)
        tokens = batch.input_ids[:, p:]
        return (rollout_batch.token_logprobs(logits, tokens, TEMPERATURE),
                rollout_batch.token_entropy(logits, TEMPERATURE), aux)

    want_lp, want_ent, want_aux = nnx.jit(reference)(model)
    got_lp, got_ent, got_aux = nnx.jit(
        lambda mdl: rollout_batch.completion_logprobs(mdl, batch, TEMPERATURE, chunk_tokens=3))(model)
    assert got_lp.shape == got_ent.shape == (n, m)
    _assert_close(got_lp, want_lp, 256, "lp")
    _assert_close(got_ent, want_ent, 256, "entropy")
    assert float(got_aux) == float(want_aux)
    with pytest.raises(ValueError, match="chunk_tokens"):
        rollout_batch.completion_logprobs(model, batch, TEMPERATURE, chunk_tokens=0)


def _temp_bytes(fn, n, m, h, v) -> int:
    """Per-device temporaries of jit(grad wrt (h, w)) of sum(lp) + sum(entropy), compiled only."""
    def loss(hs, w, tokens):
        lp, ent = fn(hs, w, tokens, jnp.float32, False)
        return jnp.sum(lp) + jnp.sum(ent)
    args = (jax.ShapeDtypeStruct((n, m, h), jnp.float32), jax.ShapeDtypeStruct((h, v), jnp.float32),
            jax.ShapeDtypeStruct((n, m), jnp.int32))
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_temporaries_are_bounded_by_the_chunk_not_by_m():
    """N * M = 8192 positions, V = 32768: one fp32 [N, M, V] array is 1 GiB. The unchunked loss
    needs more than that in temporaries; chunks of 256 positions ([2, 256, V] fp32 = 64 MiB) keep
    them under a few chunk arrays, and doubling M does not grow them beyond the O(N M H) terms."""
    n, m, h, v = 2, 4096, 16, 32768
    full_logits = n * m * v * 4
    chunk_logits = n * 256 * v * 4
    unchunked = _temp_bytes(_fused(None), n, m, h, v)
    chunked = _temp_bytes(_fused(256), n, m, h, v)
    chunked_2m = _temp_bytes(_fused(256), n, 2 * m, h, v)
    assert unchunked > full_logits, (unchunked, full_logits)
    assert chunked < 4 * chunk_logits, (chunked, chunk_logits)
    assert chunked < full_logits / 4, (chunked, full_logits)
    assert chunked_2m - chunked < chunk_logits / 2, (chunked_2m, chunked)


def test_chunks_keep_row_and_vocab_sharding():
    """Rows sharded over 'data' (4) and the head's vocab over 'model' (2): chunks along M give the
    unsharded values and gradients, the gradients keep the inputs' shardings, and each device's
    temporaries stay within a few of its [N / 4, chunk, V / 2] fp32 chunk arrays."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py simulates them on CPU)")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "model"))
    rows, head = NamedSharding(mesh, P("data")), NamedSharding(mesh, P(None, "model"))
    n = 4
    h, w, tokens, a, b = _inputs(tied=False)
    h, tokens = jnp.tile(h, (2, 1, 1))[:n], jnp.tile(tokens, (2, 1))[:n]
    a, b = jnp.tile(a, (2, 1))[:n], jnp.tile(b, (2, 1))[:n]
    want = _values_and_grads(_fused(None), h, w, tokens, a, b, jnp.float32, False)
    got = _values_and_grads(_fused(4), jax.device_put(h, rows), jax.device_put(w, head),
                            jax.device_put(tokens, rows), jax.device_put(a, rows),
                            jax.device_put(b, rows), jnp.float32, False)
    for name, g, r, terms in zip(("lp", "entropy", "dh", "dw"), got, want, (V, V, V, n * M)):
        _assert_close(g, r, terms, name)
    assert got[2].sharding.is_equivalent_to(rows, 3) and got[3].sharding.is_equivalent_to(head, 2)

    n, m, hd, v, chunk = 8, 4096, 16, 32768, 256
    args = (jax.ShapeDtypeStruct((n, m, hd), jnp.float32, sharding=rows),
            jax.ShapeDtypeStruct((hd, v), jnp.float32, sharding=head),
            jax.ShapeDtypeStruct((n, m), jnp.int32, sharding=rows))

    def loss(hs, w, tokens):
        lp, ent = _fused(chunk)(hs, w, tokens, jnp.float32, False)
        return jnp.sum(lp) + jnp.sum(ent)
    temp = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(*args).compile().memory_analysis()
    chunk_logits_per_device = (n // 4) * chunk * (v // 2) * 4
    assert temp.temp_size_in_bytes < 4 * chunk_logits_per_device, temp.temp_size_in_bytes


@pytest.mark.parametrize("moe_dispatch", ["ragged", "dense"])
def test_shared_prompts_give_the_full_row_values_and_gradients(moe_dispatch):
    """``group_size`` = G: each group's prompt runs once into a KV cache its G completions attend
    to. A real grouped batch (prompts of 3 lengths left-padded to a bucket, completions of
    different lengths, one of length 1): the log-probs, the entropy and the gradient of the
    policy equal those of the full rows (G = 1) to fp32 rounding."""
    from ace_jax.runtime import generate

    model = qwen3.Qwen3ForCausalLM(configs.tiny_moe(moe_dispatch=moe_dispatch), rngs=nnx.Rngs(1))
    rng = np.random.RandomState(1)
    g, m = 3, 6
    prompts = [list(rng.randint(1, 256, k)) for k in (5, 9, 2)]
    lengths = np.array([6, 1, 4, 2, 6, 5, 3, 6, 1])
    tokens = rng.randint(1, 256, (len(lengths), m)).astype(np.int32)
    gen = generate.GenerationResult(
        tokens=tokens, logprobs=np.zeros(tokens.shape, np.float32), lengths=lengths,
        finish_reason=np.zeros(len(lengths), np.int32),
        prompt_index=np.repeat(np.arange(len(prompts)), g))
    batch = rollout_batch.make_train_batch(prompts, gen, np.zeros(len(lengths)), prompt_bucket=4,
                                           pad_id=0)

    def run(group_size):
        def loss(mdl):
            lp, ent, _ = rollout_batch.completion_logprobs(mdl, batch, TEMPERATURE,
                                                           group_size=group_size)
            keep = batch.completion_mask
            return jnp.sum((lp + 0.1 * ent) * keep), (lp * keep, ent * keep)
        (_, (lp, ent)), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
        return lp, ent, nnx.to_flat_state(grads)

    lp1, ent1, g1 = run(1)
    lp3, ent3, g3 = run(g)
    terms = batch.input_ids.shape[1] * 32        # keys x hidden width per reduction
    _assert_close(lp3, lp1, terms, "logprobs")
    _assert_close(ent3, ent1, terms, "entropy")
    for (path, a), (_, b) in zip(g3, g1):
        _assert_close(a.get_value(), b.get_value(), terms * len(lengths), str(path))
    with pytest.raises(ValueError, match="groups of 4"):
        rollout_batch.completion_logprobs(model, batch, TEMPERATURE, group_size=4)
