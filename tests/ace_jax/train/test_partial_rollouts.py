"""Partial rollouts over the paged engine: a step takes complete groups while the others keep
decoding under new weights; per-token versions; staleness bounded per token; a checkpoint's
groups resume with nothing lost or repeated."""
import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from ace_jax.runtime import engine, engine_config, generate
from ace_jax.train import partial_rollouts as pr
from models import configs, qwen3

G = 2


@dataclasses.dataclass
class _State:
    state_id: int


@pytest.fixture(scope="module")
def model():
    return qwen3.Qwen3ForCausalLM(configs.tiny_moe(num_hidden_layers=2), rngs=nnx.Rngs(0))


def _engine(model, version=0):
    s = generate.SamplingConfig(max_new_tokens=40, temperature=1.0, eos_ids=())  # no early stop
    return engine.Engine(model, s, engine_config.EngineConfig(
        slots=4, page_size=4, max_context=48, prefill_chunk=8, sync_every=2), version=version)


def _draw(budgets, start):
    """Groups of states start, start+1, ... whose samples stop at the given budgets (no EOS:
    a sample's length is its budget), as `PartialRollouts.top_up` wants them."""
    it = iter(range(start, 10 ** 6))

    def draw(n):
        out = []
        for _ in range(n):
            i = next(it)
            out.append(pr.NewGroup(_State(i), [3 + i % 5, 4, 5], budgets[i % len(budgets)]))
        return out
    return draw


def _run(rollouts, eng, params, draw, steps, version):
    """``steps`` RL steps of collect -> an update of the weights; returns [(version learned
    at, groups)]."""
    out = []
    for step in range(steps):
        rollouts.top_up(draw, step)
        groups = rollouts.collect(learn_version=version)
        out.append((version, groups))
        version += 1
        eng.update_weights(jax.tree.map(lambda x: x * (1 + 0.01 * version), params), version)
    return out


def _check(rollouts, steps, budgets_of, bound):
    seen = set()
    for version, groups in steps:
        for g in groups:
            assert g.seq not in seen, f"group {g.seq} taken twice"
            seen.add(g.seq)
            comps = rollouts.completions(g)
            assert [len(c.tokens) for c in comps] == budgets_of(g), "a sample lost tokens"
            for c in comps:
                assert len(c.logprobs) == len(c.versions) == len(c.tokens)
                assert version - int(c.versions.min()) <= bound, "staleness past the bound"
    return seen


def test_steps_take_complete_groups_while_long_ones_decode_on(model):
    """One long sample per pair of groups: steps take the short groups first; the long one
    decodes on under new versions (its versions span several), is taken no later than the bound
    allows, and no sample loses or repeats a token."""
    budgets = [[36, 4], [4, 6], [5, 3]]
    eng = _engine(model)
    params = nnx.state(model, nnx.Param)
    rollouts = pr.PartialRollouts(eng, group_size=G, batch_groups=1, factor=3,
                                  max_token_staleness=2, key=jax.random.key(0))
    steps = _run(rollouts, eng, params, _draw(budgets, 0), 8, 0)
    seen = _check(rollouts, steps, lambda g: budgets[g.state.state_id % 3], bound=2)
    assert len(seen) == 8
    order = [g.seq for _, gs in steps for g in gs]
    assert order[0] != 0, "the first step waited for the long group"
    long = [c for _, gs in steps for g in gs for c in rollouts.completions(g) if len(c.tokens) == 36]
    assert any(len(set(c.versions.tolist())) > 1 for c in long), "no sample spanned versions"
    assert rollouts.stats["forced_groups"] >= 1


def test_a_checkpoint_of_groups_in_flight_resumes_with_nothing_lost_or_repeated(model):
    """Groups in flight (finished samples, running ones, queued ones) go through JSON into a
    fresh engine; each running sample continues from its tokens so far: every group comes out
    once, its samples whole, the tokens before the checkpoint unchanged."""
    budgets = [[30, 5], [6, 28], [4, 4]]
    eng = _engine(model)
    params = nnx.state(model, nnx.Param)
    kw = dict(group_size=G, batch_groups=1, factor=3, max_token_staleness=3)
    rollouts = pr.PartialRollouts(eng, key=jax.random.key(1), **kw)
    draw = _draw(budgets, 0)
    first = _run(rollouts, eng, params, draw, 2, 0)
    saved = json.loads(json.dumps(rollouts.to_json()))
    running = {g["seq"]: g["samples"] for g in saved["groups"]}
    assert any(s is not None and s["finish_reason"] is None and s["tokens"]
               for ss in running.values() for s in ss), "no sample was mid-way"

    eng2 = _engine(model, version=2)
    again = pr.PartialRollouts(eng2, key=jax.random.key(1), **kw)
    again.restore(saved, _State)
    rest = _run(again, eng2, params, _draw(budgets, saved["next_seq"]), 4, 2)
    seqs = [g.seq for _, gs in first + rest for g in gs]
    assert len(seqs) == len(set(seqs)) == 6
    assert sorted(seqs) == list(range(6))
    for _, gs in rest:
        for g in gs:
            comps = again.completions(g)
            assert [len(c.tokens) for c in comps] == budgets[g.state.state_id % 3]
            for i, c in enumerate(comps):
                before = running.get(g.seq, [None] * G)[i]
                if before is not None:
                    assert c.tokens[:len(before["tokens"])] == before["tokens"]
                    np.testing.assert_array_equal(c.versions[:len(before["versions"])],
                                                  before["versions"])


def test_factor_and_bound_are_checked(model):
    eng = _engine(model)
    with pytest.raises(ValueError, match="partial_factor"):
        pr.PartialRollouts(eng, group_size=G, batch_groups=1, factor=0.5, max_token_staleness=2,
                           key=jax.random.key(0))
    with pytest.raises(ValueError, match="max_token_staleness"):
        pr.PartialRollouts(eng, group_size=G, batch_groups=1, factor=2, max_token_staleness=0,
                           key=jax.random.key(0))
