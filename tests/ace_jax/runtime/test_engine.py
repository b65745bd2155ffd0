"""The paged, continuously batched engine against the static generator (the oracle): the same
tokens and behaviour log-probs, greedy and sampled; pages shared and returned; fixed shapes;
clear errors for requests that cannot fit."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ace_jax.runtime import engine, engine_config, generate, sampler
from models import configs, qwen3
from tests.numerics import assert_close

PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [5] * 20]


@pytest.fixture(scope="module")
def model():
    return qwen3.Qwen3ForCausalLM(configs.tiny_moe(num_hidden_layers=3, mlp_only_layers=(1,)),
                                  rngs=nnx.Rngs(0))


def _sampling(**kw):
    base = dict(max_new_tokens=12, group_size=3, temperature=1.0, prompt_bucket=8, eos_ids=(7,))
    return generate.SamplingConfig(**{**base, **kw})


def _engine(model, sampling, record_routes=False, **kw):
    base = dict(slots=4, page_size=4, max_context=40, prefill_chunk=8, sync_every=3)
    return engine.Engine(model, sampling, engine_config.EngineConfig(**{**base, **kw}),
                         record_routes=record_routes)


def _assert_same(ref, out):
    for f in ("tokens", "lengths", "finish_reason", "prompt_index"):
        np.testing.assert_array_equal(np.asarray(getattr(out, f)), np.asarray(getattr(ref, f)), f)
    assert_close(np.asarray(out.logprobs), np.asarray(ref.logprobs), reduction_len=64, scale=10.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_generates_what_the_static_generator_does(model, temperature):
    """4 prompts x 3 samples through 4 slots (rows enter as others finish), pages of 4 (prompt
    pages shared, the partial page copied), prefill in chunks of 8 (the 20-token prompt takes
    3), 3 decode steps per host round trip: the rows equal the static generator's."""
    s = _sampling(temperature=temperature)
    ref = generate.Generator(model, s).generate(PROMPTS, jax.random.key(3))
    eng = _engine(model, s)
    out = eng.generate(PROMPTS, jax.random.key(3))
    _assert_same(ref, out)
    distinct = len(set(map(tuple, np.asarray(out.tokens).tolist())))
    assert distinct == len(PROMPTS) if temperature == 0 else distinct > len(PROMPTS)
    assert eng.stats["prefill_calls"] == 1 + 1 + 2 + 3                  # each prompt once
    assert eng._page_refs == {} and sum(map(len, eng._free_pages)) == eng.config.pool_pages - 1


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shared_prefixes_read_once_decode_what_the_static_generator_does(model, temperature):
    """Cascade decode (`engine.shared_prefixes`): a request's full prompt pages read once per
    step for its running samples. With 2 entries of 2 rows, some requests and samples find no
    room and read their whole tables: every row still equals the static generator's, and all
    entries come back free."""
    s = _sampling(temperature=temperature)
    ref = generate.Generator(model, s).generate(PROMPTS, jax.random.key(3))
    eng = _engine(model, s, shared_prefixes=2, prefix_rows=2)
    rid = eng.submit(PROMPTS[3], n=3, key=jax.random.key(9))
    eng.step()                              # 20 tokens = 5 full pages, shared by 2 of 3 slots
    pre = eng._prefix
    entry = eng._requests[rid].prefix
    assert pre.lengths[entry] == 5 * 4 and sorted(pre.rows[entry].tolist()) == [0, 1]
    assert pre.table[entry, :5].tolist() == eng._requests[rid].prompt_pages[:5]
    assert eng._slot_prefix[2] is None      # the third sample: no row position left
    eng.drain()
    _assert_same(ref, eng.generate(PROMPTS, jax.random.key(3)))
    assert sorted(eng._free_prefixes[0]) == [0, 1] and (pre.rows == -1).all() and not pre.lengths.any()
    assert eng._page_refs == {} and sum(map(len, eng._free_pages)) == eng.config.pool_pages - 1
    with pytest.raises(ValueError, match="engine.prefix_rows must be >= 1"):
        engine_config.EngineConfig(prefix_rows=0)


def test_eos_stop_sequences_and_budgets_end_rows_as_in_the_static_generator(model):
    greedy = generate.Generator(model, _sampling(temperature=0.0, eos_ids=())).generate(
        PROMPTS, jax.random.key(0))
    toks = np.asarray(greedy.tokens)
    eos, stop = int(toks[0, 4]), (int(toks[3, 2]), int(toks[3, 3]))  # tokens some row produces
    s = _sampling(temperature=0.0, eos_ids=(eos,), stop_sequences=(stop,))
    ref = generate.Generator(model, s).generate(PROMPTS, jax.random.key(0))
    assert {generate.FinishReason.EOS, generate.FinishReason.STOP} <= set(
        np.asarray(ref.finish_reason).tolist())
    _assert_same(ref, _engine(model, s).generate(PROMPTS, jax.random.key(0)))


def test_requests_have_their_own_budgets_and_finish_as_they_finish(model):
    s = _sampling(temperature=1.0, eos_ids=())
    eng = _engine(model, s, slots=2, sync_every=2)
    long_id = eng.submit(PROMPTS[0], n=1, key=jax.random.key(1), max_new_tokens=12)
    short_id = eng.submit(PROMPTS[1], n=2, key=jax.random.key(2), max_new_tokens=3)
    done = eng.drain()
    assert [len(c.tokens) for c in done if c.request == short_id] == [3, 3]
    assert [len(c.tokens) for c in done if c.request == long_id] == [12]
    # the short request's samples finished first, and its second sample took a freed slot
    assert done[0].request == short_id and done[-1].request == long_id
    # the same rows as the static generator's with the same keys (prompt key, then sample)
    ref = generate.Generator(model, _sampling(temperature=1.0, eos_ids=(), group_size=2,
                                              max_new_tokens=3)).generate([PROMPTS[1]],
                                                                          jax.random.key(9))
    got = {c.sample: c.tokens for c in done if c.request == short_id}
    key_of_prompt0 = jax.random.fold_in(jax.random.key(9), 0)
    eng2 = _engine(model, s)
    rid = eng2.submit(PROMPTS[1], n=2, key=key_of_prompt0, max_new_tokens=3)
    again = {c.sample: c.tokens for c in eng2.drain() if c.request == rid}
    assert [again[g] for g in (0, 1)] == np.asarray(ref.tokens).tolist()
    assert got != again                                                  # other keys, other draws


def test_requests_have_their_own_temperature(model):
    """A greedy and a sampled request decoded side by side each draw what the static generator
    draws at their own temperature (the server mixes them in one engine)."""
    s = _sampling(temperature=1.0, eos_ids=(), group_size=2, max_new_tokens=6)
    eng = _engine(model, s, slots=4)
    keys = [jax.random.fold_in(jax.random.key(4), b) for b in range(2)]
    hot = eng.submit(PROMPTS[0], n=2, key=keys[0], max_new_tokens=6, temperature=1.0)
    cold = eng.submit(PROMPTS[1], n=2, key=keys[1], max_new_tokens=6, temperature=0.0)
    done = {(c.request, c.sample): c.tokens for c in eng.drain()}
    for rid, b, t in ((hot, 0, 1.0), (cold, 1, 0.0)):
        ref = generate.Generator(model, dataclasses.replace(s, temperature=t)).generate(
            PROMPTS[:2], jax.random.key(4))
        assert [done[rid, g] for g in (0, 1)] == np.asarray(ref.tokens)[2 * b:2 * b + 2].tolist()
    assert done[cold, 0] == done[cold, 1] and done[hot, 0] != done[hot, 1]
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        eng.submit(PROMPTS[0], key=keys[0], temperature=-1.0)


def test_cancel_frees_slots_and_pages_and_leaves_the_others_alone(model):
    """One sample cancelled while it runs (as the server does at a stop string), a whole
    request cancelled while it waits: the rest decode exactly as alone, every page returns,
    and ``progress`` shows a running sample's tokens so far."""
    s = _sampling(temperature=1.0, eos_ids=(), max_new_tokens=9)
    alone = _engine(model, s, slots=2)
    want = alone.submit(PROMPTS[2], n=2, key=jax.random.key(1))
    want = {c.sample: c.tokens for c in alone.drain() if c.request == want}
    eng = _engine(model, s, slots=2)
    a = eng.submit(PROMPTS[2], n=2, key=jax.random.key(1))
    b = eng.submit(PROMPTS[3], n=3, key=jax.random.key(2))            # waits: both slots taken
    assert eng.step() == [] and eng.progress(b) == {}
    seen = eng.progress(a)
    assert sorted(seen) == [0, 1] and seen[1] == want[1][:3]            # sync_every = 3
    eng.cancel(a, sample=1)
    eng.cancel(b)
    eng.cancel(12345)                                                   # unknown: ignored
    assert eng.progress(a).keys() == {0}
    done = eng.drain()
    assert [(c.request, c.sample, c.tokens) for c in done] == [(a, 0, want[0])]
    assert eng._requests == {} and eng._page_refs == {}
    assert sum(map(len, eng._free_pages)) == eng.config.pool_pages - 1


def test_the_routing_record_is_what_the_full_forward_routes(model):
    """Each prompt token's and each generated token's (the last included) MoE routes, as the
    engine recorded them, are the top-k of the full-sequence forward (fp32: no ties moved)."""
    s = _sampling(temperature=1.0, eos_ids=(), max_new_tokens=7, group_size=2)
    out = _engine(model, s, record_routes=True).generate(PROMPTS[2:], jax.random.key(5))
    cfg = model.config
    assert out.routes.shape == (4, 7, cfg.num_moe_layers, cfg.num_experts_per_tok)
    for row in range(4):
        b = int(out.prompt_index[row])
        seq = PROMPTS[2 + b] + np.asarray(out.tokens[row]).tolist()
        want = np.asarray(model(jnp.asarray([seq]), return_routes=True).routes[0])
        p = len(PROMPTS[2 + b])
        np.testing.assert_array_equal(out.prompt_routes[b], want[:p])
        np.testing.assert_array_equal(out.routes[row], want[p:])
    # a dense policy records nothing
    dense = qwen3.Qwen3ForCausalLM(configs.tiny_dense(num_hidden_layers=2), rngs=nnx.Rngs(0))
    res = _engine(dense, s, record_routes=True).generate(PROMPTS[:1], jax.random.key(5))
    assert res.routes is None and res.prompt_routes is None
    # nor does an MoE policy unless asked (R3 and the routing metrics ask)
    res = _engine(model, s).generate(PROMPTS[:1], jax.random.key(5))
    assert res.routes is None and res.prompt_routes is None


def test_tokens_carry_the_version_that_sampled_them_and_rows_decode_on_after_an_update(model):
    """A weight update in the middle of a sample: the sample goes on (its pages kept), its
    tokens before the update carry the old version and after it the new one; a `generate`
    call meanwhile waits for its own requests only, the other's completions come out of the
    next `step`; `snapshot` shows the running sample so far."""
    s = _sampling(eos_ids=(), max_new_tokens=12)
    eng = _engine(model, s)
    rid = eng.submit(PROMPTS[0], n=1, key=jax.random.key(0), max_new_tokens=12)
    assert eng.step() == []                          # 3 tokens at version 0
    snap = eng.snapshot(rid)
    assert [len(c.tokens) for c in snap] == [3] and snap[0].finish_reason is None
    np.testing.assert_array_equal(snap[0].versions, [0, 0, 0])
    params = nnx.state(model, nnx.Param)
    eng.update_weights(jax.tree.map(lambda x: x * 1.01, params), version=5)
    out = eng.generate([PROMPTS[1]], jax.random.key(1), dataclasses.replace(s, group_size=1,
                                                                            max_new_tokens=3))
    np.testing.assert_array_equal(out.versions[0, :int(out.lengths[0])], 5)
    assert eng.busy                                  # the first request is still running
    rest = eng.drain()
    assert [(c.request, len(c.tokens)) for c in rest] == [(rid, 12)]
    v = rest[0].versions
    assert v[0] == 0 and v[-1] == 5 and list(v) == sorted(v) and set(v) == {0, 5}
    assert rest[0].tokens[:3] == snap[0].tokens
    assert eng.snapshot(rid) == [] and not eng.busy


def test_shapes_are_fixed_nothing_compiles_after_the_first_run(model):
    """After one run, other prompts (lengths, counts), group sizes (so other numbers of samples
    entering at once), budgets and temperature trace and compile nothing: not the engine's
    programs, not a host-side op."""
    import jax.monitoring

    eng = _engine(model, _sampling(temperature=1.0))
    eng.generate(PROMPTS, jax.random.key(0))
    events = []
    listener = lambda name, secs, **kw: events.append(name)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        eng.generate([[1, 2, 3, 4, 5, 6, 7, 8, 9], [4] * 27, [3]], jax.random.key(1),
                     _sampling(temperature=0.5, group_size=2, max_new_tokens=7))
        eng.submit([9] * 13, n=1, key=jax.random.key(2), max_new_tokens=[5])
        eng.drain()
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert not [e for e in events if "compile" in e or "trace" in e], events


def test_the_host_round_trip_of_each_decode_call_is_timed(model):
    """``host_gather_s`` sums the host's gathers of the decode calls' results (after the device
    finished them); `generation.engine_metrics` reports the mean per call in ms."""
    from ace_jax.train import generation

    eng = _engine(model, _sampling(temperature=1.0))
    assert generation.engine_metrics(eng) == {"engine/decode_calls": 0.0,
                                              "engine/host_gather_ms": 0.0}
    eng.generate(PROMPTS, jax.random.key(0))
    calls, gather = eng.stats["decode_calls"], eng.stats["host_gather_s"]
    assert calls >= 4 and gather > 0          # 12 new tokens at 3 steps per call
    m = generation.engine_metrics(eng)
    assert m["engine/decode_calls"] == calls
    assert m["engine/host_gather_ms"] == pytest.approx(1e3 * gather / calls)


def test_prompt_pages_are_shared_and_all_pages_return(model):
    """G samples of a 20-token prompt (5 full pages of 4) hold the 5 prompt pages once: the
    peak is 5 + G x (own pages) pages, not G x the whole row."""
    s = _sampling(temperature=1.0, eos_ids=(), max_new_tokens=8, group_size=4)
    eng = _engine(model, s, slots=4)
    eng.generate([[5] * 20], jax.random.key(0))
    assert eng.stats["peak_pages"] == 5 + 4 * 2
    assert eng._page_refs == {} and sum(map(len, eng._free_pages)) == eng.config.pool_pages - 1


def test_a_small_pool_makes_rows_wait_not_fail(model):
    s = _sampling(temperature=0.0)
    ref = generate.Generator(model, s).generate(PROMPTS, jax.random.key(0))
    eng = _engine(model, s, num_pages=16)        # room for ~2 rows of the longest request
    _assert_same(ref, eng.generate(PROMPTS, jax.random.key(0)))
    assert eng.stats["peak_pages"] <= 15


def test_requests_that_cannot_fit_are_refused_by_name(model):
    eng = _engine(model, _sampling(), max_context=16, num_pages=5)     # page 0 + 4
    with pytest.raises(engine_config.EngineCapacityError, match="engine.max_context = 16"):
        eng.submit([1] * 10, key=jax.random.key(0), max_new_tokens=8)
    with pytest.raises(engine_config.EngineCapacityError,
                       match=r"needs 5 pages, the pool has 4 \(engine.num_pages\)"):
        eng.submit([1] * 9, key=jax.random.key(0), max_new_tokens=7)
    with pytest.raises(ValueError, match="at least one token"):
        eng.submit([], key=jax.random.key(0))
    with pytest.raises(ValueError, match="engine.page_size must be >= 1"):
        engine_config.EngineConfig(page_size=0)
    # nothing was queued by the refusals
    assert eng.drain() == []


def test_update_weights_changes_what_is_sampled(model):
    s = _sampling(temperature=0.0)
    eng = _engine(model, s)
    before = np.asarray(eng.generate(PROMPTS[:2], jax.random.key(0)).tokens)
    params = nnx.state(model, nnx.Param)
    eng.update_weights(jax.tree.map(lambda x: x * 1.5, params))
    after = np.asarray(eng.generate(PROMPTS[:2], jax.random.key(0)).tokens)
    assert (before != after).any()
    with pytest.raises(ValueError, match="another structure"):
        eng.update_weights({"w": jnp.zeros(3)})


def test_kind_resolution_and_the_trainer_factory(model):
    assert engine_config.resolve_kind("auto", 1) == "paged"
    assert engine_config.resolve_kind("auto", 8) == "static"
    assert engine_config.resolve_kind("paged", 8) == "paged"
    with pytest.raises(ValueError, match="engine.kind must be one of"):
        engine_config.resolve_kind("vllm", 1)
    from ace_jax.runtime import sampler_layout

    cfg = engine_config.default_config()
    s = _sampling()
    # what the trainer passes on one device: the learner's own ("shared") layout -> the engine
    shared = sampler_layout.SamplerLayout(None, model.config, True)
    for layout in (None, shared):
        assert isinstance(sampler.make_sampler(model, s, cfg, max_context=64, layout=layout),
                          engine.Engine)
    cfg.kind = "static"
    assert isinstance(sampler.make_sampler(model, s, cfg, max_context=64, layout=shared),
                      generate.Generator)


def test_paged_forward_equals_the_uncached_forward(model):
    """The model with a PagedKVCache (pages in shuffled order, a prefill chunk right-padded,
    then one token per call) gives the logits of the plain forward."""
    cfg = model.config
    ids = jax.random.randint(jax.random.key(1), (3, 13), 1, cfg.vocab_size)
    ref = np.asarray(model(ids).logits)
    cache = qwen3.init_paged_cache(cfg, 3, num_pages=20, page_size=4, pages_per_row=5)
    table = np.random.RandomState(0).permutation(np.arange(1, 20))[:15].reshape(3, 5)
    cache = qwen3.PagedKVCache(cache.k, cache.v, jnp.asarray(table, jnp.int32), cache.lengths)
    chunk = jnp.pad(ids[:, :7], ((0, 0), (0, 1)))
    out = model(chunk, attention_mask=jnp.broadcast_to(jnp.arange(8) < 7, (3, 8)), cache=cache)
    assert_close(np.asarray(out.logits[:, :7]), ref[:, :7], reduction_len=13, scale=10.0)
    c = out.cache
    assert np.asarray(c.lengths).tolist() == [7, 7, 7]
    for t in range(7, 13):
        o = model(ids[:, t:t + 1], cache=c)
        assert_close(np.asarray(o.logits[:, 0]), ref[:, t], reduction_len=13, scale=10.0)
        c = o.cache
    with pytest.raises(ValueError, match="pass no cache_index"):
        model(ids[:, :1], cache=c, cache_index=0)


SHARD_RULES = dict(batch="data,fsdp,expert", length="", cache_length="", embed="fsdp,expert",
                   vocab="tensor", heads="tensor", kv_heads="tensor", head_dim="", mlp="tensor",
                   experts="expert", router="expert", layers="")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_sharded_engine_decodes_what_the_static_generator_does(model, temperature):
    """On 8 devices (data 2 x fsdp 2 x tensor 2, params placed by the rules): 8 slots in 4 row
    shards of 2, each shard with its own pages, free list and shared-prefix entry, KV heads over
    'tensor'; prompts prefilled one per shard in one call. Every row equals the static
    generator's on one device, the state stays split, and every page and entry comes back."""
    from ace_jax.runtime import placement as pl, sharding as sh

    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices (tests/conftest.py)")
    s = _sampling(temperature=temperature)
    ref = generate.Generator(model, s).generate(PROMPTS, jax.random.key(3))
    mesh_cfg = sh.default_config()
    mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor, mesh_cfg.expert = 2, 2, 2, 1
    place = pl.Placement.create(sh.make_mesh(mesh_cfg), SHARD_RULES)
    placed = nnx.clone(model)
    place.place_params(placed)
    eng = engine.Engine(placed, s, engine_config.EngineConfig(
        slots=8, page_size=4, max_context=40, prefill_chunk=8, sync_every=3, shared_prefixes=4,
        prefix_rows=2), placement=place)
    assert eng._shards == 4 and eng._pool_pages % 4 == 0
    _assert_same(ref, eng.generate(PROMPTS, jax.random.key(3)))
    spec = eng._state.pools[0][0].sharding.spec
    assert tuple(spec)[:3] == (None, ("data", "fsdp"), "tensor"), spec
    assert eng._state.page_table.sharding.spec[0] == ("data", "fsdp")
    # the decode program reads each shard's pages where they are: no collective gathers a pool
    import re
    with eng._context():
        text = eng._decode.lower(eng.graphdef, 3, eng.params, eng._layers, eng._knobs, eng._state,
                                 jax.tree.map(jnp.asarray, eng._prefix)).compile().as_text()
    gathered = re.findall(r"= \w+\[([\d,]*)\][^=]*? all-gather\(", text)
    assert gathered and not [g for g in gathered if str(eng._pool_pages) in g.split(",")], gathered
    # the 4 prompts went to 4 shards, prefilled together: as many calls as the longest's chunks
    assert eng.stats["prefill_calls"] == 3
    assert eng._page_refs == {} and all(len(f) == eng._pool_pages // 4 - 1 for f in eng._free_pages)
    assert [sorted(f) for f in eng._free_prefixes] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="engine.shared_prefixes = 2 does not split over the 4 row"):
        engine.Engine(placed, s, engine_config.EngineConfig(slots=8, shared_prefixes=2),
                      placement=place)
    with pytest.raises(ValueError, match="engine.num_pages = 30 does not split over the 4 row shards"):
        engine.Engine(placed, s, engine_config.EngineConfig(slots=8, num_pages=30),
                      placement=place)
    with pytest.raises(engine_config.EngineCapacityError,
                       match="needs 5 pages, the pool has 4 in each of its 4 row shards"):
        engine.Engine(placed, s, engine_config.EngineConfig(slots=8, page_size=4, num_pages=20),
                      placement=place).submit([1] * 9, key=jax.random.key(0), max_new_tokens=7)


@pytest.mark.parametrize("temperature,tensor", [(0.0, 1), (1.0, 2)])
def test_the_engine_decodes_in_the_samplers_own_layout(model, temperature, tensor):
    """The sampler's own layout on 8 devices, the learner FSDP 2 x expert 4: every chip on
    'expert' (experts kept in place, dense weights replicated), or ace30b's shape, 'expert' 4 x
    'tensor' 2 with the experts over both ("expert_tensor") and KV heads over 'tensor'. The
    trainer's factory gives the engine for engine.kind='paged'; its weights are resharded into
    the own layout, its 8 slots split into 8 / tensor row shards over 'expert', and its rows
    equal the static generator's on one device, before and after `update_weights`."""
    from ace_jax.runtime import placement as pl, sampler_layout, sharding as sh

    if jax.device_count() < 8:
        pytest.skip("needs 8 (simulated) devices (tests/conftest.py)")
    mesh_cfg = sh.default_config()
    mesh_cfg.fsdp, mesh_cfg.expert = 2, 4
    learner = pl.Placement.from_config(mesh_cfg)
    placed = nnx.clone(model)
    learner.place_params(placed)
    own = sampler_layout.default_config()
    own.layout, own.tensor = "own", tensor
    if tensor > 1:
        own.moe_parallelism, own.rules.experts = "expert_tensor", "expert,tensor"
    layout = sampler_layout.SamplerLayout.from_config(own, learner, model.config)
    cfg = engine_config.default_config()
    cfg.update(kind="paged", slots=8, page_size=4, max_context=40, prefill_chunk=8, sync_every=3,
               shared_prefixes=8, prefix_rows=2)
    s = _sampling(temperature=temperature)
    eng = sampler.make_sampler(placed, s, cfg, max_context=40, placement=learner, layout=layout)
    assert isinstance(eng, engine.Engine) and eng._shards == 8 // tensor
    assert eng.placement is layout.placement and eng.graphdef is not nnx.graphdef(placed)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(eng.params)}
    experts = ("expert", "tensor") if tensor > 1 else "expert"
    assert [v for k, v in flat.items() if "experts" in k]
    for k, v in flat.items():
        if "experts" in k:
            assert tuple(v.sharding.spec)[:2] == (None, experts), (k, v.sharding)
        elif tensor == 1:                         # dense weights replicated
            assert v.sharding.spec == jax.sharding.PartitionSpec(), (k, v.sharding)
    assert eng._state.page_table.sharding.spec[0] in ("expert", ("expert",))
    pool = tuple(eng._state.pools[0][0].sharding.spec) + (None,) * 3
    assert pool[2] == ("tensor" if tensor > 1 else None), pool
    _assert_same(generate.Generator(model, s).generate(PROMPTS, jax.random.key(3)),
                 eng.generate(PROMPTS, jax.random.key(3)))
    scaled = jax.tree.map(lambda x: x * 1.5, nnx.state(placed, nnx.Param))
    eng.update_weights(scaled)
    ref = generate.Generator(model, s)
    ref.update_weights(jax.device_get(scaled))
    _assert_same(ref.generate(PROMPTS, jax.random.key(4)), eng.generate(PROMPTS, jax.random.key(4)))
    assert eng._page_refs == {} and all(len(f) == eng._pool_pages // eng._shards - 1
                                   for f in eng._free_pages)
