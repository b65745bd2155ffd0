"""The jitted GRPO learner step: microbatching is exact, non-finite steps are skipped, an update
moves probability towards rewarded completions, and bf16 compute keeps fp32 master weights."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ace_jax.rl import grpo, learner, rollout_batch
from ace_jax.rl.advantage_estimators import compute_advantages
from ace_jax.runtime.generate import Generator, SamplingConfig
from models import configs, qwen3
from tests.numerics import assert_close

PROMPTS = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34]]
G = 4


def _setup(seed=0, **model_overrides):
    model = qwen3.Qwen3ForCausalLM(configs.tiny_moe(**model_overrides), rngs=nnx.Rngs(seed))
    sampling = SamplingConfig(max_new_tokens=8, group_size=G, temperature=1.0, prompt_bucket=8)
    out = Generator(model, sampling).generate(PROMPTS, jax.random.key(seed))
    # Reward: 1 when the first completion token is even; a group-dependent, non-trivial signal.
    rewards = (np.asarray(out.tokens)[:, 0] % 2 == 0).astype(np.float32)
    rewards[:G] = np.arange(G)  # make sure group 0 has variance
    batch = rollout_batch.make_train_batch(PROMPTS, out, rewards, prompt_bucket=8, pad_id=0)
    return model, batch


def _cfgs(**optim):
    g = grpo.default_config()
    o = learner.default_config()
    o.learning_rate = 1e-2
    o.update(optim)
    return g, o


@pytest.mark.parametrize("optim", [
    dict(microbatches=3),
    dict(microbatches=3, share_prompts=True),                                # whole groups
    dict(microbatches=2, share_prompts=True, prompt_split="within_groups"),  # half of each group
], ids=["rows", "shared-groups", "shared-within-groups"])
def test_microbatching_is_exact(optim):
    """Microbatched updates (by rows, or with each prompt run once per microbatch) equal the
    unshared one-microbatch update."""
    model, batch = _setup()
    # A large Adam eps keeps the update linear in the gradient, so float noise in near-zero
    # gradient entries is not amplified to +-lr by Adam's sign-like first step.
    g, o1 = _cfgs(microbatches=1, eps=1e-2)
    _, ok = _cfgs(eps=1e-2, **optim)
    l1 = learner.Learner.create(model, g, o1, group_size=G)
    lk = learner.Learner.create(model, g, ok, group_size=G)
    m1, mk = l1.step(batch), lk.step(batch)
    tokens = int(np.sum(batch.completion_mask))
    # the loss sums terms |A * ratio| / den <= 1 that cancel within each group (scale 1)
    assert_close(m1["loss"], mk["loss"], reduction_len=tokens, scale=1.0)
    np.testing.assert_allclose(m1["grad_norm"], mk["grad_norm"], rtol=1e-4)
    for a, b in zip(jax.tree.leaves(l1.params), jax.tree.leaves(lk.params)):
        assert_close(np.asarray(a), np.asarray(b), reduction_len=tokens)


def test_shared_prompt_microbatches_that_do_not_divide_are_refused():
    model, batch = _setup()                                 # 3 groups of 4
    g, o = _cfgs(microbatches=2, share_prompts=True)
    with pytest.raises(ValueError, match="3 groups are not divisible by optim.microbatches = 2"):
        learner.Learner.create(model, g, o, group_size=G).step(batch)
    _, o = _cfgs(microbatches=3, share_prompts=True, prompt_split="within_groups")
    with pytest.raises(ValueError, match="group size 4 is not divisible by optim.microbatches = 3"):
        learner.Learner.create(model, g, o, group_size=G).step(batch)


def test_microbatch_split_keeps_groups_whole():
    rows = jnp.arange(12)
    by_row = learner.microbatch_split(rows, k=3, group_size=2, split="rows")
    np.testing.assert_array_equal(by_row, [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]])
    by_group = learner.microbatch_split(rows, k=3, group_size=2, split="groups")
    np.testing.assert_array_equal(by_group, [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]])
    within = learner.microbatch_split(rows, k=2, group_size=4, split="within_groups")
    np.testing.assert_array_equal(within, [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 10, 11]])


def test_on_policy_first_step_metrics():
    model, batch = _setup()
    g, o = _cfgs()
    m = learner.Learner.create(model, g, o, group_size=G).step(batch)
    assert abs(float(m["ratio_mean"]) - 1.0) < 1e-4
    assert float(m["logprob_diff_max_abs"]) < 1e-4
    assert float(m["clip_frac_low"]) == 0.0 and float(m["clip_frac_high"]) == 0.0
    assert int(m["skipped"]) == 0 and float(m["grad_norm"]) > 0
    assert float(m["tokens"]) == float(jnp.sum(batch.attention_mask))
    assert float(m["entropy"]) > 0
    for k, v in m.items():
        assert np.isfinite(np.asarray(v)).all(), k


def test_update_raises_logprob_of_advantaged_completions():
    model, batch = _setup(seed=1)
    g, o = _cfgs(learning_rate=3e-3)
    lrn = learner.Learner.create(model, g, o, group_size=G)

    def seq_logprob(mdl):
        logits, _ = rollout_batch.completion_logits(mdl, batch)
        lp = rollout_batch.token_logprobs(logits, batch.input_ids[:, batch.prompt_len:], 1.0)
        return np.asarray(jnp.sum(lp * batch.completion_mask, axis=1))

    before = seq_logprob(model)
    lrn.step(batch)
    after = seq_logprob(lrn.model())
    adv = np.asarray(compute_advantages(batch.rewards.reshape(-1, G), g)).reshape(-1)
    delta = after - before
    assert np.mean(delta[adv > 0]) > np.mean(delta[adv < 0])


def test_non_finite_step_is_skipped_and_params_intact():
    model, batch = _setup()
    g, o = _cfgs()
    lrn = learner.Learner.create(model, g, o, group_size=G)
    before = jax.tree.map(np.asarray, lrn.params)
    bad = batch._replace(behaviour_logprobs=batch.behaviour_logprobs.at[0, 0].set(jnp.nan))
    m = lrn.step(bad)
    assert int(m["skipped"]) == 1
    assert int(lrn.state.step) == 0
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(lrn.params)):
        np.testing.assert_array_equal(a, np.asarray(b))
    m = lrn.step(batch)  # a good step afterwards still works
    assert int(m["skipped"]) == 0 and int(lrn.state.step) == 1


def test_bf16_compute_keeps_fp32_master_weights_and_remat():
    model, batch = _setup(dtype="bfloat16", remat_policy="full")
    g, o = _cfgs()
    lrn = learner.Learner.create(model, g, o, group_size=G)
    m = lrn.step(batch)
    assert int(m["skipped"]) == 0
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(lrn.params))
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(lrn.state.opt_state)
               if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating))


def test_bad_batch_is_clear():
    model, batch = _setup()
    g, o = _cfgs(microbatches=5)
    lrn = learner.Learner.create(model, g, o, group_size=G)
    with pytest.raises(ValueError, match="microbatches"):
        lrn.step(batch)


def test_completion_logprobs_equal_logits_path_with_gradients():
    """`completion_logprobs` (hand-written backward through the lm_head) = completion_logits +
    token_logprobs / token_entropy, values and parameter gradients, untied and tied heads."""
    for tied in (False, True):
        model, batch = _setup(tie_word_embeddings=tied)
        tokens = batch.input_ids[:, batch.prompt_len:]
        w = jnp.asarray(np.random.RandomState(0).randn(*tokens.shape), jnp.float32)

        def reference(mdl):
            logits, aux = rollout_batch.completion_logits(mdl, batch)
            return (rollout_batch.token_logprobs(logits, tokens, 0.8),
                    rollout_batch.token_entropy(logits, 0.8), aux)

        def fused(mdl):
            return rollout_batch.completion_logprobs(mdl, batch, 0.8)

        for fn in (reference, fused):
            lp, ent, _ = nnx.jit(fn)(model)
            if fn is reference:
                want_lp, want_ent = lp, ent
        assert_close(lp, want_lp, reduction_len=model.config.vocab_size)   # log-softmax over the vocab
        assert_close(ent, want_ent, reduction_len=model.config.vocab_size)

        def loss(fn):
            def f(mdl):
                lp, ent, _ = fn(mdl)
                return jnp.sum(lp * w) + 0.3 * jnp.sum(ent * w)
            return qwen3.flat_params(nnx.jit(nnx.grad(f))(model))

        want, got = loss(reference), loss(fused)
        for name in want:
            assert_close(got[name], want[name], reduction_len=tokens.size * model.config.vocab_size,
                         err_msg=f"{name} tied={tied}")   # sums over tokens of vocab-long sums


def _recorded_batch():
    """A batch from the paged engine, asked to keep the MoE routing record."""
    from ace_jax.runtime import engine, engine_config

    model = qwen3.Qwen3ForCausalLM(configs.tiny_moe(), rngs=nnx.Rngs(0))
    sampling = SamplingConfig(max_new_tokens=8, group_size=G, temperature=1.0, prompt_bucket=8)
    eng = engine.Engine(model, sampling, engine_config.EngineConfig(slots=4, page_size=4,
                                                                    max_context=24),
                        record_routes=True)
    out = eng.generate(PROMPTS, jax.random.key(0))
    rewards = np.arange(len(PROMPTS) * G, dtype=np.float32) % 3
    return model, out, rollout_batch.make_train_batch(PROMPTS, out, rewards, prompt_bucket=8,
                                                      pad_id=0)


def test_the_routing_record_is_laid_out_as_the_tokens():
    model, out, batch = _recorded_batch()
    cfg = model.config
    n, s = batch.input_ids.shape
    routes = np.asarray(batch.routes)
    assert routes.shape == (n, s, cfg.num_moe_layers, cfg.num_experts_per_tok)
    p = batch.prompt_len
    for row in range(n):
        b, length = int(out.prompt_index[row]), int(out.lengths[row])
        np.testing.assert_array_equal(routes[row, p - len(PROMPTS[b]):p], out.prompt_routes[b])
        np.testing.assert_array_equal(routes[row, p:p + length], out.routes[row, :length])
        assert (routes[row, :p - len(PROMPTS[b])] == 255).all()          # prompt padding
        assert (routes[row, p + length:] == 255).all()                   # past the completion


@pytest.mark.parametrize("optim", [dict(), dict(microbatches=3, share_prompts=True)],
                         ids=["rows", "shared-prompts"])
def test_routing_replay_dispatches_by_the_record_and_measures_the_mismatch(optim):
    """fp32, same parameters: the record is the learner's own routing, so replaying it (R3) is
    the plain update and nothing disagrees. A record moved to other experts: every route
    disagrees; R3 dispatches by it (another update, mismatch 0), 'none' does not (mismatch 1)."""
    model, _, batch = _recorded_batch()

    def run(b, replay):
        g, o = _cfgs(**optim)
        g.routing_replay = replay
        lrn = learner.Learner.create(model, g, o, group_size=G)
        m = lrn.step(b)
        return m, [np.asarray(x) for x in jax.tree.leaves(lrn.params)]

    plain, plain_p = run(batch, "none")
    same, same_p = run(batch, "R3")
    assert float(plain["offpolicy/router_disagreement_frac"]) == 0.0
    assert float(same["offpolicy/routing_mismatch_frac"]) == 0.0
    for a, b in zip(plain_p, same_p):
        np.testing.assert_array_equal(a, b)
    rec = np.asarray(batch.routes)
    moved = batch._replace(routes=jnp.asarray(
        np.where(rec == 255, 255, (rec + 1) % model.config.num_experts).astype(np.uint8)))
    m_none, none_p = run(moved, "none")
    m_r3, r3_p = run(moved, "R3")
    assert float(m_none["offpolicy/router_disagreement_frac"]) == 1.0
    assert float(m_none["offpolicy/routing_mismatch_frac"]) == 1.0
    assert float(m_r3["offpolicy/router_disagreement_frac"]) == 1.0
    assert float(m_r3["offpolicy/routing_mismatch_frac"]) == 0.0
    assert all(np.array_equal(a, b) for a, b in zip(none_p, plain_p))
    assert not all(np.allclose(a, b) for a, b in zip(r3_p, plain_p))


# ---------------------------------------------------------- minibatches, reference, measures

@pytest.mark.parametrize("optim", [dict(microbatches=2),
                                   dict(microbatches=2, share_prompts=True,
                                        prompt_split="within_groups")],
                         ids=["rows", "shared-within-groups"])
def test_minibatch_proximal_logprobs_line_up_with_the_theta_pass(optim):
    """grpo.minibatches = 2 under proximal=learner with a learning rate of 0: the proximal
    forward's log-probs are the theta pass's (r = 1 to float rounding, for every row of both
    minibatches and their microbatches), and two optimizer steps are counted."""
    model, batch = _setup()
    g, o = _cfgs(learning_rate=0.0, **optim)
    g.proximal, g.minibatches = "learner", 2
    lrn = learner.Learner.create(model, g, o, group_size=G)
    m = lrn.step(batch)
    assert int(lrn.state.step) == 2 and int(m["skipped"]) == 0
    assert abs(float(m["ratio_mean"]) - 1.0) < 1e-5
    assert float(m["offpolicy/clip_frac"]) == 0.0
    for k, v in m.items():
        assert np.isfinite(np.asarray(v)).all(), k


def test_minibatches_make_the_learner_clip_act():
    """proximal=learner: one step per batch has r = 1 exactly (no trust region); with two
    minibatches the second is taken after the first update, r departs from 1 and the clip acts."""
    model, batch = _setup()
    g, o = _cfgs(learning_rate=1e-2)
    g.proximal, g.epsilon_low, g.epsilon_high = "learner", 0.01, 0.01
    one = learner.Learner.create(model, g, o, group_size=G).step(batch)
    assert float(one["ratio_mean"]) == 1.0 and float(one["offpolicy/clip_frac"]) == 0.0
    g.minibatches = 2
    lrn = learner.Learner.create(model, g, o, group_size=G)
    two = lrn.step(batch)
    assert int(lrn.state.step) == 2
    assert float(two["offpolicy/clip_frac"]) > 0.0
    assert abs(float(two["ratio_mean"]) - 1.0) > 1e-4


def test_minibatches_that_do_not_divide_are_refused():
    model, batch = _setup()                                 # 12 rows, 3 groups of 4
    g, o = _cfgs()
    g.minibatches = 5
    with pytest.raises(ValueError, match=r"grpo.minibatches x optim.microbatches = 5 x 1"):
        learner.Learner.create(model, g, o, group_size=G).step(batch)
    g.minibatches = 2
    _, o = _cfgs(share_prompts=True)
    with pytest.raises(ValueError, match="3 groups are not divisible by grpo.minibatches = 2"):
        learner.Learner.create(model, g, o, group_size=G).step(batch)


def test_beta_without_reference_logprobs_is_refused():
    """The learner keeps no reference model: with beta > 0 a batch whose ref_logprobs are the
    zeros make_train_batch fills in (or None) is refused at the step; real ones are used."""
    model, batch = _setup()
    g, o = _cfgs()
    g.beta = 0.1
    lrn = learner.Learner.create(model, g, o, group_size=G)
    with pytest.raises(learner.MissingReferenceLogprobsError, match="grpo.beta=0.1 needs"):
        lrn.step(batch)
    with pytest.raises(learner.MissingReferenceLogprobsError):
        lrn.step(batch._replace(ref_logprobs=None))
    assert int(lrn.state.step) == 0
    m = lrn.step(batch._replace(ref_logprobs=batch.behaviour_logprobs - 0.1))
    assert int(m["skipped"]) == 0 and float(m["kl"]) > 0


def test_microbatch_measures_combine_to_the_batch_values():
    """ess is (sum w)^2 / (n sum w^2) of the whole batch (not the mean of the microbatches'),
    the weight minimum ignores microbatches without completion tokens, truncated_frac is
    completion-token weighted, and the sums behind ess are not reported."""
    w = [np.array([1.0, 2.0]), np.array([4.0]), np.array([])]
    n = np.array([len(x) for x in w], np.float32)
    micro = {
        "num_tokens": jnp.asarray(n), "num_completion_tokens": jnp.asarray(n),
        "behaviour_weight_sum": jnp.asarray([x.sum() for x in w], jnp.float32),
        "behaviour_weight_sq_sum": jnp.asarray([np.square(x).sum() for x in w], jnp.float32),
        "offpolicy/ess": jnp.asarray([0.9, 1.0, 0.0]),
        "offpolicy/behaviour_weight_min": jnp.asarray([1.0, 4.0, 0.0]),
        "offpolicy/truncated_frac": jnp.asarray([0.5, 1.0, 0.0]),
    }
    out = learner._reduce_micro_metrics(micro)
    assert float(out["offpolicy/ess"]) == pytest.approx(49 / 63, rel=1e-6)
    assert float(out["offpolicy/behaviour_weight_min"]) == 1.0
    assert float(out["offpolicy/truncated_frac"]) == pytest.approx(2 / 3, rel=1e-6)
    assert "behaviour_weight_sum" not in out and "behaviour_weight_sq_sum" not in out


def test_learner_step_writes_the_off_policy_measures():
    model, batch = _setup()
    g, o = _cfgs(microbatches=3)
    g.proximal = "learner"
    lagged = batch._replace(behaviour_logprobs=batch.behaviour_logprobs
                            - 1.0 * batch.completion_mask * (np.arange(8)[None, :] % 2))
    m = learner.Learner.create(model, g, o, group_size=G).step(lagged)
    for name in ("truncated_frac", "truncated_frac_high", "truncated_frac_low", "ess",
                 "behaviour_weight_min", "masked_frac", "clip_frac"):
        assert f"offpolicy/{name}" in m, name
    # every other position has w = e (> cap 2) under the theta pass: truncated, high
    mask = np.asarray(batch.completion_mask)
    want = mask[:, 1::2].sum() / mask.sum()
    assert float(m["offpolicy/truncated_frac_high"]) == pytest.approx(want, rel=1e-5)
    assert float(m["offpolicy/truncated_frac"]) == pytest.approx(want, rel=1e-5)
    assert 0 < float(m["offpolicy/ess"]) < 1


def test_the_batch_own_advantages_replace_the_group_ones():
    """A batch carrying advantages (Reinforce-Ada's global baseline) is learned on with them:
    the group advantages passed explicitly give the same update as none, and other
    advantages another."""
    model, batch = _setup(seed=2)
    g, o = _cfgs()
    adv = compute_advantages(batch.rewards.reshape(-1, G), g).reshape(-1)

    def loss(b):
        return float(learner.Learner.create(model, g, o, group_size=G).step(b)["loss"])

    base = loss(batch)
    assert loss(batch._replace(advantages=adv)) == pytest.approx(base, rel=1e-5, abs=1e-7)
    assert loss(batch._replace(advantages=2 * adv)) == pytest.approx(2 * base, rel=1e-4)
