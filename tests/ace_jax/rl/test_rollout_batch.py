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


# ------------------------------------------------------------------ the routing record, per shard

def _routed_generation(seed: int = 0, g: int = 2, m: int = 5, layers: int = 3, k: int = 2):
    """4 prompts of lengths 3, 7, 1, 5 (bucket 4 -> P = 8) with G samples each and a made-up
    routing record: prompt b's routes all b * 10 + layer, completion routes random expert ids
    (< 64) up to each row's length, NO_ROUTE past it."""
    from ace_jax.runtime import generate
    from ace_jax.runtime.engine_programs import NO_ROUTE

    rng = np.random.RandomState(seed)
    prompts = [list(rng.randint(1, 100, n)) for n in (3, 7, 1, 5)]
    n = len(prompts) * g
    lengths = rng.randint(1, m + 1, n)
    routes = np.full((n, m, layers, k), NO_ROUTE, np.uint8)
    for i, n_tok in enumerate(lengths):
        routes[i, :n_tok] = rng.randint(0, 64, (n_tok, layers, k))
    prompt_routes = tuple(
        np.broadcast_to((b * 10 + np.arange(layers))[None, :, None], (len(p), layers, k))
        .astype(np.uint8) for b, p in enumerate(prompts))
    gen = generate.GenerationResult(
        tokens=rng.randint(1, 100, (n, m)).astype(np.int32),
        logprobs=rng.randn(n, m).astype(np.float32), lengths=lengths.astype(np.int32),
        finish_reason=np.zeros(n, np.int32),
        prompt_index=np.repeat(np.arange(len(prompts), dtype=np.int32), g),
        routes=routes, prompt_routes=prompt_routes)
    return prompts, gen


def _dense_routes(prompts, gen, p: int) -> np.ndarray:
    """The record as make_train_batch built it before it went per shard: every prompt's routes
    left-padded to P, gathered per row, then the completion routes."""
    from ace_jax.runtime.engine_programs import NO_ROUTE

    padded = np.full((len(prompts), p) + gen.routes.shape[2:], NO_ROUTE, np.uint8)
    for b, r in enumerate(gen.prompt_routes):
        padded[b, p - len(r):] = r
    return np.concatenate([padded[np.asarray(gen.prompt_index)], gen.routes], axis=1)


@pytest.mark.parametrize("sizes", [dict(fsdp=8), dict(fsdp=4, tensor=2)])
def test_routes_are_built_per_shard_from_host_memory(sizes, monkeypatch):
    """With the learner's batch shardings (rows over fsdp; replicated over tensor in the second
    case) every array of the batch arrives sharded: each device's shard of the routing record
    [N, P + M, L, k] holds its rows of the old dense construction, and the record is assembled
    only block by block, never whole (no call builds more rows than a shard has). The other
    fields equal the unsharded batch's."""
    if jax.device_count() < 8:
        pytest.skip("needs 8 devices (tests/conftest.py simulates them on CPU)")
    from ace_jax.runtime import placement as pl, sharding as sh

    cfg = sh.default_config()
    cfg.fsdp, cfg.tensor = sizes.get("fsdp", 1), sizes.get("tensor", 1)
    place = pl.Placement.create(sh.make_mesh(cfg, jax.devices()[:8]),
                                sh.rules_from_config(sh.DEFAULT_RULES))
    prompts, gen = _routed_generation(g=4)                  # N = 16 rows
    n, row_shards = 16, sizes["fsdp"]
    rewards = np.arange(n, dtype=np.float32)
    built_rows = []
    block = rollout_batch.RouteRecord.block

    def spy(self, index=()):
        out = block(self, index)
        built_rows.append(out.shape[0])
        return out

    monkeypatch.setattr(rollout_batch.RouteRecord, "block", spy)
    batch = rollout_batch.make_train_batch(prompts, gen, rewards, prompt_bucket=4, pad_id=0,
                                           shardings=place.batch)
    monkeypatch.undo()
    assert built_rows and max(built_rows) == n // row_shards, built_rows
    want = _dense_routes(prompts, gen, 8)
    assert batch.routes.shape == want.shape == (n, 8 + 5, 3, 2)
    assert batch.routes.dtype == jnp.uint8
    target = place.batch(batch)
    assert batch.routes.sharding.is_equivalent_to(target.routes, 4)
    for shard in batch.routes.addressable_shards:
        assert shard.data.shape == (n // row_shards, 13, 3, 2)
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    np.testing.assert_array_equal(np.asarray(batch.routes), want)
    assert rollout_batch.placed_on(batch, place.batch)

    dense = rollout_batch.make_train_batch(prompts, gen, rewards, prompt_bucket=4, pad_id=0)
    np.testing.assert_array_equal(np.asarray(dense.routes), want)
    assert not rollout_batch.placed_on(dense, place.batch)
    assert batch.advantages is None and dense.advantages is None   # the learner computes them
    for name in rollout_batch.TrainBatch._fields[:-1]:
        got, ref = getattr(batch, name), getattr(dense, name)
        assert got.dtype == ref.dtype, name
        assert got.sharding.is_equivalent_to(getattr(target, name), got.ndim), name
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref), err_msg=name)


def test_route_record_blocks_and_bad_records():
    """`RouteRecord.block` of any row range equals the dense record's rows; parts that do not
    fit (a prompt's routes longer than P, another width, non-uint8) are named."""
    prompts, gen = _routed_generation(seed=3)
    rec = rollout_batch.RouteRecord.create(gen.prompt_routes, gen.routes, gen.prompt_index, 8)
    want = _dense_routes(prompts, gen, 8)
    assert rec.shape == want.shape
    np.testing.assert_array_equal(rec.block(), want)
    np.testing.assert_array_equal(rec.block((slice(3, 6),)), want[3:6])
    np.testing.assert_array_equal(rec.block((slice(1, 2), slice(6, 10))), want[1:2, 6:10])
    with pytest.raises(ValueError, match="prompt 1's routes"):
        rollout_batch.RouteRecord.create(gen.prompt_routes, gen.routes, gen.prompt_index, 6)
    with pytest.raises(ValueError, match="uint8"):
        rollout_batch.RouteRecord.create(gen.prompt_routes, gen.routes.astype(np.int32),
                                         gen.prompt_index, 8)
    with pytest.raises(ValueError, match="one prompt_routes entry per prompt"):
        rollout_batch.make_train_batch(prompts, gen._replace(prompt_routes=gen.prompt_routes[:3]),
                                       np.zeros(8), prompt_bucket=4, pad_id=0)


@pytest.mark.parametrize("experts,ok", [(255, True), (256, False), (300, False)])
def test_uint8_route_record_refuses_too_many_experts(experts, ok):
    """The engine's prefill program, traced (as jit traces it when the engine builds it) for a
    tiny MoE of ``experts`` experts with the routing record on: 255 experts (ids 0..254) fit
    the uint8 record below its "no record" id 255; 256 or more are refused by name instead of
    wrapping (expert 256 -> 0) or reading as "no record" (expert 255). Without the record the
    program builds at any expert count."""
    from ace_jax.runtime import engine_programs

    assert engine_programs.NO_ROUTE == 255
    cfg = configs.tiny_moe(num_experts=experts, num_hidden_layers=1)
    model = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model, nnx.Param)
    cache = jax.eval_shape(lambda: qwen3.init_paged_cache(cfg, 1, num_pages=4, page_size=4,
                                                          pages_per_row=2))
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731

    def trace(record: bool):
        return jax.eval_shape(
            lambda p, pools, ids, rows, start, n: engine_programs.prefill(
                graphdef, p, pools, ids, rows, start, n, record_routes=record),
            params, (cache.k, cache.v), i32(1, 4), i32(1, 2), i32(1), i32(1))

    assert trace(False)[2] is None
    if ok:
        assert trace(True)[2].shape == (1, 4, 1, 2) and trace(True)[2].dtype == jnp.uint8
    else:
        with pytest.raises(engine_programs.RouteRecordError, match=f"{experts} experts"):
            trace(True)
    assert engine_programs.check_route_record(8) is None
