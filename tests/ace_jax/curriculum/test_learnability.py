"""LP scorer, schedule, cooling, registry and selection (property tests with hypothesis)."""
import importlib.util
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from scipy import stats as sps

from ace_jax.curriculum import learnability as L, state_stats
from ace_jax.registry import UnknownNameError
from sandbox.tasks.targets import TaskTargets

ROOT = pathlib.Path(__file__).resolve().parents[3]
N = 64  # fixed size: every property test reuses one compilation per spec


def _load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench_sampler = _load("bench_sampler")


def spec_of(name="lp", **over):
    cfg = L.default_config()
    for k, v in over.items():
        cfg[k] = v
    return L.get_spec(cfg, name)


def rand_stats(seed, n=N, p_valid=0.8, step=50):
    rng = np.random.default_rng(seed)
    visited = rng.random(n) < 0.6
    return {"valid": rng.random(n) < p_valid,
            "visits": np.where(visited, rng.integers(1, 4, n), 0).astype(np.int32),
            "last_sampled": np.where(rng.random(n) < 0.5, -1, rng.integers(0, step + 1, n)).astype(np.int32),
            "reward_var": (rng.random(n) * 0.3).astype(np.float32),
            "headroom": rng.random(n).astype(np.float32),
            "prior_std": np.where(rng.random(n) < 0.3, np.nan, rng.random(n) * 0.5).astype(np.float32)}


def jx(stats):
    return {k: jnp.asarray(v) for k, v in stats.items()}


def test_registry_variants_are_configs():
    assert set(L.SAMPLERS) >= {"lp", "uniform", "lp_no_cooling", "variance_only", "headroom_only"}
    base = spec_of("lp")
    assert spec_of("uniform").kind == "uniform" and not spec_of("uniform").use_cooling
    assert spec_of("lp_no_cooling") == L.SamplerSpec(**{**base.__dict__, "use_cooling": False})
    assert not spec_of("variance_only").use_headroom and spec_of("variance_only").use_variance
    assert not spec_of("headroom_only").use_variance and spec_of("headroom_only").use_headroom
    with pytest.raises(KeyError, match="unknown sampler"):
        spec_of("nope")
    with pytest.raises(ValueError, match="already registered"):
        L.register_sampler("lp")(lambda c: base)
    with pytest.raises(ValueError, match="rho_end"):
        spec_of("lp", rho_end=0.0)
    with pytest.raises(ValueError, match="prior"):
        spec_of("lp", prior="magic")


def test_schedule_anneals_from_exploration_to_exploitation():
    s = spec_of("lp", explore_steps=10, anneal_steps=20, temperature_start=1.0, temperature_end=0.1,
                rho_start=1.0, rho_end=0.04)
    temps, rhos = zip(*[tuple(map(float, L.schedule(t, s))) for t in (0, 10, 20, 30, 100)])
    assert temps[0] == temps[1] == pytest.approx(1.0) and temps[3] == temps[4] == pytest.approx(0.1)
    assert rhos[0] == pytest.approx(1.0) and rhos[4] == pytest.approx(0.04)
    assert temps[2] == pytest.approx(math.sqrt(0.1), rel=1e-5)  # geometric midpoint
    assert all(a >= b for a, b in zip(temps, temps[1:])) and all(a >= b for a, b in zip(rhos, rhos[1:]))


def test_potential_matches_definition():
    stats = rand_stats(0)
    s = spec_of("lp", alpha=2.0, beta=0.5, r_scale=0.4, u0=0.7, prior="constant")
    lp = np.asarray(L.potential(jx(stats), s))
    u = np.where(stats["visits"] > 0, np.sqrt(stats["reward_var"]) / 0.4, 0.7)
    want = np.where(stats["valid"], u ** 2 * stats["headroom"] ** 0.5, 0)
    np.testing.assert_allclose(lp, want, rtol=1e-5, atol=1e-7)
    lp_v = np.asarray(L.potential(jx(stats), spec_of("variance_only", prior="constant")))
    np.testing.assert_allclose(lp_v, np.where(stats["valid"], np.where(stats["visits"] > 0,
                               np.sqrt(stats["reward_var"]) / 0.5, 1.0), 0), rtol=1e-5)
    lp_h = np.asarray(L.potential(jx(stats), spec_of("headroom_only")))
    np.testing.assert_allclose(lp_h, np.where(stats["valid"], stats["headroom"], 0), rtol=1e-6)
    # parent prior: an unvisited child of a zero-variance group scores below u0
    sp = spec_of("lp", prior="parent", prior_shrink=0.25)
    one = {k: v[:2].copy() for k, v in stats.items()}
    one.update(valid=np.array([True, True]), visits=np.array([0, 0], np.int32),
               headroom=np.ones(2, np.float32), prior_std=np.array([0.0, np.nan], np.float32))
    np.testing.assert_allclose(np.asarray(L.potential(jx(one), sp)), [0.25, 1.0], rtol=1e-6)


@pytest.mark.parametrize("name", ["lp", "uniform", "lp_no_cooling", "variance_only", "headroom_only"])
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), step=st.integers(0, 300))
def test_probabilities_form_a_distribution(name, seed, step):
    stats = rand_stats(seed, step=step)
    p = np.asarray(L.probabilities(jx(stats), jnp.int32(step), spec_of(name), 1))
    assert np.all(p >= 0) and np.all(np.isfinite(p))
    assert p.sum() == pytest.approx(1.0, abs=1e-5)
    assert np.all(p[~stats["valid"]] == 0)
    # parity with the plain NumPy oracle of the benchmark
    want = np.exp(bench_sampler.np_log_probs(stats, step, spec_of(name), 1))
    np.testing.assert_allclose(p, want, rtol=2e-4, atol=1e-7)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), step=st.integers(0, 300), batch=st.sampled_from([1, 4, 8]))
def test_selection_is_distinct_and_never_picks_masked_or_ineligible(seed, step, batch):
    stats = rand_stats(seed, step=step)
    s = spec_of("lp")
    p = np.asarray(L.probabilities(jx(stats), jnp.int32(step), s, batch))
    idx, n_elig = L.select_slots(jax.random.key(seed), jx(stats), jnp.int32(step), s, batch)
    idx = np.asarray(idx)
    assert int(n_elig) == int((p > 0).sum())
    if int(n_elig) >= batch:
        assert len(set(idx.tolist())) == batch
        assert stats["valid"][idx].all() and (p[idx] > 0).all()
        # a state sampled at this very step has cooling 0: never chosen again this step
        assert not (stats["last_sampled"][idx] == step).any()


def _capped_reference(order, eligible, child, batch, cap):
    """Sequential draw in perturbed-score order that stops taking children after ``cap`` (the
    skipped children fill the batch last, in order, when roots run out)."""
    taken, skipped, n_child = [], [], 0
    for i in order:
        if not eligible[i]:
            continue
        if child[i] and n_child >= cap:
            skipped.append(i)
            continue
        taken.append(i)
        n_child += bool(child[i])
    return (taken + skipped)[:batch]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), step=st.integers(0, 300), batch=st.sampled_from([4, 8]),
       frac=st.sampled_from([0.0, 0.25, 0.5, 0.75]), name=st.sampled_from(["lp", "uniform"]))
def test_child_cap_is_the_sequential_draw_that_stops_taking_children(seed, step, batch, frac, name):
    stats = rand_stats(seed, step=step)
    s = spec_of(name, max_child_frac=frac)
    key = jax.random.key(seed)
    idx, n_elig = L.select_slots(key, jx(stats), jnp.int32(step), s, batch)
    if int(n_elig) < batch:
        return
    logit = np.asarray(L.logits(jx(stats), jnp.int32(step), s, batch))
    g = np.asarray(jax.random.gumbel(key, logit.shape, jnp.float32))
    order = np.argsort(-(logit + g), kind="stable")
    child = ~np.isnan(stats["prior_std"])
    want = _capped_reference(order, np.isfinite(logit), child, batch, int(frac * batch))
    assert sorted(np.asarray(idx).tolist()) == sorted(want)
    n_root = int((np.isfinite(logit) & ~child).sum())
    assert child[np.asarray(idx)].sum() <= max(int(frac * batch), batch - n_root)


def test_child_cap_of_one_changes_nothing_and_bad_values_are_refused():
    stats = jx(rand_stats(3))
    a, _ = L.select_slots(jax.random.key(0), stats, jnp.int32(9), spec_of("lp"), 8)
    b, _ = L.select_slots(jax.random.key(0), stats, jnp.int32(9), spec_of("lp", max_child_frac=1.0), 8)
    np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="max_child_frac"):
        spec_of("lp", max_child_frac=1.5)


def test_child_cap_restricts_roots_and_children_to_their_own_top_rho():
    n, batch = 40, 4
    stats = {"valid": np.ones(n, bool), "visits": np.ones(n, np.int32),
             "last_sampled": np.full(n, -1, np.int32),
             "reward_var": np.linspace(0.01, 0.2, n).astype(np.float32),  # LP rises with the slot
             "headroom": np.ones(n, np.float32),
             "prior_std": np.full(n, 0.3, np.float32)}
    stats["prior_std"][:6] = np.nan  # six roots, all below every child in LP
    late = jnp.int32(10_000)         # end of the anneal: rho = rho_end
    capped = np.isfinite(np.asarray(L.logits(jx(stats), late, spec_of("lp", max_child_frac=0.5),
                                             batch)))
    free = np.isfinite(np.asarray(L.logits(jx(stats), late, spec_of("lp"), batch)))
    assert not free[:6].any()               # one top-rho set: no root is selectable
    assert capped[:6].sum() == 2            # the roots' quota (B - cap): their best two
    assert capped[4:6].all() and capped[6:].sum() == 2  # children: the cap, their best two
    assert capped[-2:].all()
    idx, _ = L.select_slots(jax.random.key(0), jx(stats), late, spec_of("lp", max_child_frac=0.5),
                            batch)
    assert sorted(np.asarray(idx).tolist()) == [4, 5, n - 2, n - 1]


def test_cooling_lowers_recently_sampled_states():
    n = 8
    stats = {"valid": np.ones(n, bool), "visits": np.ones(n, np.int32), "last_sampled": np.full(n, -1, np.int32),
             "reward_var": np.full(n, 0.2, np.float32), "headroom": np.ones(n, np.float32),
             "prior_std": np.full(n, np.nan, np.float32)}
    stats["last_sampled"][0] = 9    # sampled one step ago
    stats["last_sampled"][1] = 5    # five steps ago
    stats["last_sampled"][2] = -1   # never
    p = np.asarray(L.probabilities(jx(stats), jnp.int32(10), spec_of("lp", tau=2.0), 1))
    assert p[0] < p[1] < p[2]
    assert p[0] / p[2] == pytest.approx(1 - math.exp(-0.5), rel=1e-4)
    p_nc = np.asarray(L.probabilities(jx(stats), jnp.int32(10), spec_of("lp_no_cooling"), 1))
    np.testing.assert_allclose(p_nc, 1 / n, rtol=1e-5)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), rho_end=st.sampled_from([0.05, 0.2, 0.5]), batch=st.sampled_from([1, 4]))
def test_top_rho_restriction_holds_in_exploitation(seed, rho_end, batch):
    stats = rand_stats(seed)
    stats["valid"][:4] = True
    s = spec_of("lp_no_cooling", rho_end=rho_end, explore_steps=0, anneal_steps=1)
    p = np.asarray(L.probabilities(jx(stats), jnp.int32(5), s, batch))
    lp = np.asarray(L.potential(jx(stats), s))
    n_valid = int(stats["valid"].sum())
    k = max(math.ceil(np.float32(rho_end) * n_valid), batch)
    kth = np.sort(lp[stats["valid"]])[::-1][k - 1]
    np.testing.assert_array_equal(p > 0, stats["valid"] & (lp >= kth))
    assert (p > 0).sum() >= k
    idx, _ = L.select_slots(jax.random.key(seed), jx(stats), jnp.int32(5), s, batch)
    assert (lp[np.asarray(idx)] >= kth).all()


def test_uniform_is_uniform_chi_square():
    n, batch, draws = 30, 5, 600
    stats = rand_stats(1, n=n, p_valid=1.0)
    stats["valid"][-10:] = False  # 20 valid states
    s = spec_of("uniform")
    keys = jax.random.split(jax.random.key(1234), draws)
    idx, _ = jax.vmap(lambda k: L.select_slots(k, jx(stats), jnp.int32(7), s, batch))(keys)
    idx = np.asarray(idx)
    assert all(len(set(r)) == batch for r in idx.tolist())
    counts = np.bincount(idx.ravel(), minlength=n)
    assert counts[-10:].sum() == 0
    chi = sps.chisquare(counts[:20])
    assert chi.pvalue > 0.001, (counts[:20], chi)


def test_sampler_is_deterministic_and_resumable():
    stats = rand_stats(3)
    cfg = L.default_config()
    a, b = L.Sampler.from_config(cfg), L.Sampler.from_config(cfg)
    np.testing.assert_array_equal(a.select(stats, 10, 8, 2), b.select(stats, 10, 8, 2))
    saved = a.state_dict()
    nxt = a.select(stats, 11, 8)
    c = L.Sampler.from_config(cfg)
    c.load_state_dict(saved)
    np.testing.assert_array_equal(c.select(stats, 11, 8), nxt)
    assert c.calls == a.calls == 2
    cfg.seed = 1
    assert not np.array_equal(L.Sampler.from_config(cfg).select(stats, 10, 8), b.select(stats, 10, 8))


def test_batch_checks_and_insufficient_states():
    stats = rand_stats(4)
    smp = L.Sampler.from_config(L.default_config())
    with pytest.raises(ValueError, match="multiple of the data-parallel size"):
        smp.select(stats, 1, 6, data_parallel_size=4)
    few = {k: v.copy() for k, v in stats.items()}
    few["valid"][:] = False
    few["valid"][:3] = True
    few["last_sampled"][:3] = -1
    with pytest.raises(L.InsufficientStatesError, match="only 3 selectable"):
        smp.select(few, 1, 4)
    with pytest.raises(L.InsufficientStatesError, match="capacity"):
        smp.select(few, 1, 128)
    with pytest.raises(ValueError, match="lack fields"):
        smp.select({k: v for k, v in few.items() if k != "headroom"}, 1, 2)
    with pytest.raises(ValueError, match="one length"):
        smp.select({**few, "visits": few["visits"][:10]}, 1, 2)
    cfg = L.default_config()
    cfg.allow_repeats = True
    rep = L.Sampler.from_config(cfg).select(few, 1, 8)
    assert rep.shape == (8,) and set(rep.tolist()) <= {0, 1, 2}


def test_sampler_reads_buffer_stats_directly():
    from ace_jax.curriculum import buffer as B
    cfg = B.default_config()
    cfg.capacity = 32
    buf = B.EvolvingBuffer(cfg, [TaskTargets("t", 1.0, 0.5, 0.0)])
    buf.seed([B.SeedSolution("t", f"s{i}", 0.6) for i in range(5)])
    slots = L.Sampler.from_config(L.default_config()).select(buf.stats, 0, 4)
    assert len(set(buf.ids_for_slots(slots))) == 4


def test_tiny_yield_simulation_lp_beats_uniform():
    sim = _load("bench_lp_yield").simulate
    kw = dict(steps=24, batch=8, n_tasks=2, init_per_task=30, capacity=1024, seed=0,
              lp_overrides={"explore_steps": 4, "anneal_steps": 12})
    lp, uni = sim("lp", **kw), sim("uniform", **kw)
    assert lp["groups"] == uni["groups"] == 24 * 8
    assert lp["yield"] > uni["yield"], (lp, uni)


@pytest.mark.parametrize("values", [
    np.zeros(N, np.float32),                                   # all tied
    np.repeat(np.float32([0.0, 0.25, 0.5, 3.0]), N // 4),       # heavy ties
    np.geomspace(1e-30, 1e30, N).astype(np.float32),           # every exponent range
])
@pytest.mark.parametrize("k", [1, 2, 17, N - 5])
def test_top_fraction_threshold_is_exact(values, k):
    valid = np.ones(N, bool)
    valid[::7] = False
    if k >= valid.sum():
        k = int(valid.sum()) - 1
    thr = float(jax.jit(L._top_fraction_threshold)(jnp.asarray(values), jnp.asarray(valid), jnp.int32(k)))
    want = np.sort(values[valid])[::-1][k - 1]
    assert thr == want
    assert (values[valid] >= thr).sum() >= k


def test_pruned_states_are_never_chosen():
    from ace_jax.curriculum import buffer as B
    from sandbox.result import ExecutionResult, Status
    cfg = B.default_config()
    cfg.capacity, cfg.protect_recent_steps = 32, 0
    buf = B.EvolvingBuffer(cfg, [TaskTargets("t", 1.0, 0.5, 0.0)])
    root = buf.seed()[0]
    buf.add_children(root, [B.Child(f"c{i}", ExecutionResult(Status.OK, dev_score=0.6), float(i % 2))
                            for i in range(20)], step=0)
    removed = set(buf.prune(step=50, target_size=8))
    assert len(removed) == 13 and len(buf) == 8
    smp = L.Sampler.from_config(L.default_config())
    for step in range(1, 6):
        chosen = buf.ids_for_slots(smp.select(buf.stats, step, 8))  # every live state, each step
        assert set(chosen) == set(buf.states) and not set(chosen) & removed


def _pruning_tree(potential_fn=None):
    """A buffer where the LP and ``default_potential`` disagree (every headroom is 1):

    root (group rewards 0, 0: visited, std 0)
      a: visited, group rewards 0, 0.8 -> std 0.4:  LP u = 0.4 / r_scale = 0.8, default 0.4
        c, d: unvisited, prior std 0.4:              LP u = .25 + .75 * 0.8 = 0.85, default 1
      b: unvisited child of a zero-variance group:   LP u = .25 (prior),          default 1
    """
    from ace_jax.curriculum import buffer as B
    from sandbox.result import ExecutionResult, Status
    cfg = B.default_config()
    cfg.capacity = 16
    buf = B.EvolvingBuffer(cfg, [TaskTargets("t", gold=0.9, median=0.7, baseline=0.5)],
                           potential_fn=potential_fn)
    fail = ExecutionResult(Status.RUNTIME_ERROR, exit_code=1)
    root = buf.seed()[0]
    a, b = buf.add_children(root, [B.Child("a", fail, 0.0), B.Child("b", fail, 0.0)], step=1)
    c, d = buf.add_children(a, [B.Child("c", fail, 0.0), B.Child("d", fail, 0.8)], step=1)
    return buf, dict(root=root, a=a, b=b, c=c, d=d)


def test_pruning_follows_the_configured_lp():
    lp_cfg = L.default_config()
    fn = L.pruning_potential(lp_cfg)
    buf, ids = _pruning_tree(fn)
    pot = fn(buf.stats)                             # NumPy StateStats in, host float32 out
    assert isinstance(pot, np.ndarray) and pot.dtype == np.float32 and pot.shape == (16,)
    want = np.asarray(L.potential(L.lp_inputs(buf.stats), L.get_spec(lp_cfg)))
    np.testing.assert_array_equal(pot, want)
    slot = {k: buf.slot_of[i] for k, i in ids.items()}
    np.testing.assert_allclose([pot[slot[k]] for k in "abcd"], [0.8, 0.25, 0.85, 0.85], rtol=1e-6)
    dflt = state_stats.default_potential(buf.stats)
    np.testing.assert_allclose([dflt[slot[k]] for k in "abcd"], [0.4, 1.0, 1.0, 1.0], rtol=1e-6)
    assert pot[~buf.stats.valid].max() == 0

    # One state must go (the root is protected): by the LP it is b (high default potential, low
    # LP) and a (high LP, low default potential) stays; the default order does the opposite.
    assert buf.prune(step=2, target_size=4, protect=[ids["root"]]) == [ids["b"]]
    plain, ids2 = _pruning_tree()
    assert plain.potential_fn is state_stats.default_potential
    assert plain.prune(step=2, target_size=4, protect=[ids2["root"]]) == [ids2["a"]]

    # A variant prunes by its own potential: headroom_only ignores the spread (all ties here,
    # so the oldest unprotected state goes first).
    ho, ids3 = _pruning_tree(L.pruning_potential(lp_cfg, "headroom_only"))
    assert ho.prune(step=2, target_size=4, protect=[ids3["root"]]) == [ids3["a"]]


def test_uniform_prunes_by_the_default_potential():
    cfg = L.default_config()
    cfg.sampler = "uniform"
    assert L.pruning_potential(cfg) is state_stats.default_potential
    with pytest.raises(UnknownNameError, match="valid names: headroom_only, lp"):
        L.pruning_potential(cfg, "nope")
