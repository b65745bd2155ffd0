"""Tests for ace_jax.rl.grpo: exact policy-gradient checks of the clipped loss, the behaviour
weights and their measures, the config's validation and description."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ace_jax.registry import UnknownNameError
from ace_jax.rl import grpo
from ace_jax.rl.behaviour_weights import tis_lower
from ace_jax.rl.kl_estimators import kl_divergence
from ace_jax.rl.loss_aggregation import aggregation_denominator, loss_mask
from tests.numerics import assert_close


def cfg_with(**overrides):
    cfg = grpo.default_config()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


# ------------------------------------------------------------------ toy categorical policy

N_GROUPS, G, T, K = 2, 3, 6, 4
N = N_GROUPS * G


def toy_batch(seed=0):
    """theta [T, K] position-dependent logits; actions [N, T]; completion mask with a 2-token
    prompt and right padding of varying length; rewards [N] with non-zero group variance."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(size=(T, K)).astype(np.float32)
    probs = np.exp(theta) / np.exp(theta).sum(-1, keepdims=True)
    actions = np.stack([[rng.choice(K, p=probs[t]) for t in range(T)] for _ in range(N)])
    lengths = np.array([4, 2, 3, 1, 4, 3])         # completion tokens after the 2 prompt tokens
    pos = np.arange(T)[None, :]
    mask = ((pos >= 2) & (pos < 2 + lengths[:, None])).astype(np.float32)
    rewards = np.array([1.0, 0.0, 0.5, 2.0, -1.0, 0.0], np.float32)
    return theta, actions, mask, rewards


def token_logprobs(theta, actions):
    logp = jax.nn.log_softmax(theta, axis=-1)                 # [T, K]
    return jnp.take_along_axis(jnp.broadcast_to(logp, (actions.shape[0], T, K)),
                               actions[..., None], axis=-1)[..., 0]


def numpy_advantages(rewards, name, eps, ddof):
    r = rewards.reshape(N_GROUPS, G).astype(np.float64)
    mean = r.mean(-1, keepdims=True)
    if name == "grpo":
        a = (r - mean) / (r.std(-1, ddof=ddof, keepdims=True) + eps)
    elif name == "drgrpo":
        a = r - mean
    else:
        a = r - (r.sum(-1, keepdims=True) - r) / (G - 1)
    return a.reshape(-1)


def analytic_gradient(theta, actions, mask, adv, mode, max_len):
    """-(sum over samples and tokens of weight * A * grad log pi), grad log pi = e_a - softmax."""
    probs = np.exp(theta) / np.exp(theta).sum(-1, keepdims=True)
    tokens = mask.sum(-1)
    valid = tokens > 0
    grad = np.zeros_like(theta, dtype=np.float64)
    for i in range(N):
        for t in range(T):
            if not mask[i, t]:
                continue
            if mode == "token_mean":
                w = 1.0 / mask.sum()
            elif mode == "seq_mean_token_mean":
                w = 1.0 / (tokens[i] * valid.sum())
            else:
                w = 1.0 / (max_len * valid.sum())
            glogp = -probs[t].astype(np.float64)
            glogp[actions[i, t]] += 1.0
            grad[t] -= w * adv[i] * glogp
    return grad


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_gradient_equals_analytic_policy_gradient(estimator, mode):
    theta, actions, mask, rewards = toy_batch()
    cfg = cfg_with(advantage_estimator=estimator, loss_agg_mode=mode, max_completion_length=T,
                   advantage_std_ddof=1)
    behaviour = token_logprobs(jnp.asarray(theta), jnp.asarray(actions))   # on-policy: ratio 1

    def loss_fn(th):
        loss, metrics = grpo.grpo_loss(cfg, logprobs=token_logprobs(th, jnp.asarray(actions)),
                                       behaviour_logprobs=behaviour, rewards=rewards,
                                       completion_mask=mask, group_size=G)
        return loss, metrics

    (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(jnp.asarray(theta))
    adv = numpy_advantages(rewards, estimator, cfg.advantage_eps, 1)
    want = analytic_gradient(theta, actions, mask, adv, mode, T)
    assert float(metrics["clip_frac_low"]) == 0.0 and float(metrics["clip_frac_high"]) == 0.0
    assert float(metrics["ratio_mean"]) == 1.0
    assert_close(grad, want, reduction_len=N * T)   # each entry sums over samples and tokens
    assert np.abs(want).max() > 1e-3   # the check is not vacuous


def test_prompt_and_padding_never_contribute():
    theta, actions, mask, rewards = toy_batch(1)
    cfg = cfg_with(beta=0.1, kl_estimator="k3", proximal="learner")
    th0 = jnp.asarray(theta)
    lp0 = token_logprobs(th0, jnp.asarray(actions))
    masked = jnp.asarray(mask) == 0
    # sampler / reference values at prompt & padding positions are garbage (inf, nan)
    behaviour = jnp.where(masked, jnp.nan, lp0 - 0.05)
    ref = jnp.where(masked, -jnp.inf, lp0 + 0.1)
    old = jnp.where(masked, jnp.inf, lp0 - 0.02)

    def loss_fn(th, perturb):
        lp = token_logprobs(th, jnp.asarray(actions))
        # perturbation at masked positions that depends on theta (changes its gradient) and is huge
        lp = jnp.where(masked, lp + perturb * (1e4 + 50.0 * th.sum()), lp)
        return grpo.grpo_loss(cfg, logprobs=lp, behaviour_logprobs=behaviour, rewards=rewards,
                              completion_mask=mask, group_size=G, proximal_logprobs=old,
                              ref_logprobs=ref)[0]

    l0, g0 = jax.jit(jax.value_and_grad(loss_fn))(th0, 0.0)
    l1, g1 = jax.jit(jax.value_and_grad(loss_fn))(th0, 1.0)
    assert np.isfinite(float(l0)) and np.all(np.isfinite(g0))
    assert float(l0) == float(l1)
    np.testing.assert_array_equal(g0, g1)
    assert np.abs(np.asarray(g0)).max() > 1e-4


# ------------------------------------------------------------------ clipping

RATIOS = np.array([0.5, 0.9, 1.0, 1.1, 1.5], np.float32)


def clip_case(eps_low, eps_high):
    behaviour = jnp.log(jnp.full((2, 5), 0.3))
    logprobs = behaviour + jnp.log(jnp.asarray(RATIOS))[None, :]
    adv = jnp.array([1.0, -1.0])
    cfg = cfg_with(epsilon_low=eps_low, epsilon_high=eps_high)

    def loss_fn(lp):
        return grpo.clipped_policy_loss(cfg, logprobs=lp, behaviour_logprobs=behaviour,
                                        advantages=adv, completion_mask=jnp.ones((2, 5)))

    (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(logprobs)
    return np.asarray(grad), metrics


def test_clipping_zeroes_gradient_exactly_where_it_should():
    grad, metrics = clip_case(0.2, 0.2)
    # d loss / d logp = -A * ratio / 10 unless clipped: A > 0 and ratio > 1.2; A < 0 and ratio < 0.8
    want = np.stack([-1.0 * RATIOS / 10, 1.0 * RATIOS / 10])
    want[0, 4] = 0.0      # A = +1, ratio 1.5 > 1.2
    want[1, 0] = 0.0      # A = -1, ratio 0.5 < 0.8
    np.testing.assert_allclose(grad, want, rtol=1e-6)
    assert grad[0, 4] == 0.0 and grad[1, 0] == 0.0
    assert float(metrics["clip_frac_high"]) == pytest.approx(0.1)
    assert float(metrics["clip_frac_low"]) == pytest.approx(0.1)


def test_clip_higher_widens_only_the_upper_bound():
    grad, metrics = clip_case(0.2, 0.6)
    assert grad[0, 4] == pytest.approx(-1.5 / 10, rel=1e-6)   # ratio 1.5 < 1.6 now unclipped
    assert grad[1, 0] == 0.0
    assert float(metrics["clip_frac_high"]) == 0.0
    assert float(metrics["clip_frac_low"]) == pytest.approx(0.1)


# ------------------------------------------------------------------ zero-variance filter

def test_zero_variance_groups_contribute_nothing_when_filtered():
    rng = np.random.default_rng(3)
    rewards = np.array([1.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.0, 2.0, 1.0], np.float32)  # group 1 flat
    n, t = 9, 4
    behaviour = jnp.asarray(rng.normal(size=(n, t)).astype(np.float32) - 1.0)
    logprobs = behaviour + jnp.asarray(rng.normal(scale=0.05, size=(n, t)).astype(np.float32))
    mask = jnp.ones((n, t))
    cfg = cfg_with(filter_zero_variance_groups=True)

    def loss_fn(lp, b, r, m):
        return grpo.grpo_loss(cfg, logprobs=lp, behaviour_logprobs=b, rewards=r,
                              completion_mask=m, group_size=3)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(logprobs, behaviour,
                                                                        rewards, mask)
    keep = np.r_[0:3, 6:9]
    (loss_without, _), grad_without = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(
        logprobs[keep], behaviour[keep], rewards[keep], mask[keep])
    np.testing.assert_array_equal(np.asarray(grad)[3:6], 0.0)
    # the loss sums terms -A * ratio / den (= the gradient entries) that cancel within each group
    assert_close(float(loss), float(loss_without), reduction_len=n * t, scale=np.abs(grad_without).max())
    np.testing.assert_allclose(np.asarray(grad)[keep], grad_without, rtol=1e-6)
    assert float(metrics["frac_zero_variance_groups"]) == pytest.approx(1 / 3)
    assert float(metrics["num_tokens"]) == 24.0 and float(metrics["num_completion_tokens"]) == 36.0

    # unfiltered, the flat group still enters the token_mean denominator
    cfg.filter_zero_variance_groups = False
    loss_unfiltered, m2 = loss_fn(logprobs, behaviour, rewards, mask)
    assert_close(float(loss_unfiltered), float(loss) * 24 / 36, reduction_len=n * t,
                 scale=np.abs(grad_without).max())
    assert float(m2["frac_zero_variance_groups"]) == pytest.approx(1 / 3)


# ------------------------------------------------------------------ TIS, KL term, metrics

def test_truncated_behaviour_weight_scales_gradient_and_is_detached():
    behaviour = jnp.log(jnp.array([[0.2, 0.2, 0.2]]))
    prox = jnp.log(jnp.array([[0.2 * 1.5, 0.2 * 3.0, 0.2 * 0.5]]))    # exp(prox - mu) = 1.5, 3, 0.5
    logprobs = prox + jnp.log(jnp.array([[1.05, 1.0, 0.95]]))
    cfg = cfg_with(tis_cap=2.0, proximal="learner")

    def loss_fn(lp, o):
        return grpo.clipped_policy_loss(cfg, logprobs=lp, behaviour_logprobs=behaviour,
                                        advantages=jnp.array([2.0]), completion_mask=jnp.ones((1, 3)),
                                        proximal_logprobs=o)

    (loss, metrics), (g_lp, g_prox) = jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))(
        logprobs, prox)
    w = np.array([1.5, 2.0, 0.5])
    ratio = np.array([1.05, 1.0, 0.95])
    np.testing.assert_allclose(float(loss), -(w * ratio * 2.0).sum() / 3, rtol=1e-5)
    np.testing.assert_allclose(g_lp[0], -w * ratio * 2.0 / 3, rtol=1e-5)
    np.testing.assert_array_equal(g_prox, 0.0)
    # the measure is the weight before its bound
    np.testing.assert_allclose(float(metrics["offpolicy/behaviour_weight_mean"]), 5 / 3, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["offpolicy/behaviour_weight_max"]), 3.0, rtol=1e-5)
    assert float(metrics["offpolicy/masked_frac"]) == 0.0


@pytest.mark.parametrize("mode,level,weights,masked", [
    ("truncate", "token", [1.5, 2.0, 0.5, 1.0], 0.0),
    ("mask", "token", [1.5, 0.0, 0.5, 1.0], 0.25),
    ("none", "token", [1.5, 3.0, 0.5, 1.0], 0.0),
    # row 0's sequence weight 1.5 x 3 = 4.5, row 1's 0.5 x 1 = 0.5
    ("truncate", "sequence", [2.0, 2.0, 0.5, 0.5], 0.0),
    ("mask", "sequence", [0.0, 0.0, 0.5, 0.5], 0.5),
])
def test_behaviour_weight_modes_and_levels(mode, level, weights, masked):
    """With one update per batch (pi_prox = the theta pass under stop_gradient) the ratio is 1
    and the gradient of each token's log-prob is -W A / tokens."""
    behaviour = jnp.log(jnp.full((2, 2), 0.2))
    logprobs = behaviour + jnp.log(jnp.array([[1.5, 3.0], [0.5, 1.0]]))
    cfg = cfg_with(tis_cap=2.0, proximal="learner", behaviour_weight=mode,
                   behaviour_weight_level=level)
    fn = lambda lp: grpo.clipped_policy_loss(  # noqa: E731
        cfg, logprobs=lp, behaviour_logprobs=behaviour, advantages=jnp.array([1.0, 1.0]),
        completion_mask=jnp.ones((2, 2)))
    (_, m), g = jax.value_and_grad(fn, has_aux=True)(logprobs)
    np.testing.assert_allclose(np.asarray(g).ravel(), -np.array(weights) / 4, rtol=1e-5)
    assert float(m["offpolicy/masked_frac"]) == masked
    assert float(m["offpolicy/clip_frac"]) == 0.0 and float(m["ratio_mean"]) == 1.0


@pytest.mark.parametrize("mode,level", [("truncate", "token"), ("mask", "token"),
                                        ("truncate", "sequence")])
def test_decoupled_update_equals_the_old_one_without_lag_or_mismatch(mode, level):
    """k = 0 and a sampler that is the learner: behaviour = the theta pass's log-probs, so the
    decoupled loss (weight 1, ratio 1) gives the plain objective's loss and gradient exactly."""
    theta, actions, mask, rewards = toy_batch(3)
    th0 = jnp.asarray(theta)
    behaviour = token_logprobs(th0, jnp.asarray(actions))

    def loss_fn(th, cfg):
        lp = token_logprobs(th, jnp.asarray(actions))
        return grpo.grpo_loss(cfg, logprobs=lp, behaviour_logprobs=behaviour, rewards=rewards,
                              completion_mask=mask, group_size=G)[0]

    old = jax.value_and_grad(loss_fn)(th0, cfg_with())
    new = jax.value_and_grad(loss_fn)(th0, cfg_with(proximal="learner", behaviour_weight=mode,
                                                    behaviour_weight_level=level))
    assert float(old[0]) == float(new[0])
    np.testing.assert_array_equal(np.asarray(old[1]), np.asarray(new[1]))
    assert np.abs(np.asarray(old[1])).max() > 1e-4


def test_describe_states_the_objective():
    assert "clip on pi/mu (proximal=behaviour: the sampler), no behaviour weight" in \
        grpo.describe(cfg_with())
    line = grpo.describe(cfg_with(proximal="learner", behaviour_weight="mask", tis_cap=3.0,
                                  behaviour_weight_level="sequence"))
    assert "decoupled: clip on pi/pi_prox" in line and "mask at 3 per sequence" in line


def test_kl_term_gradient_k1_and_k3():
    logprobs = jnp.log(jnp.array([[0.5, 0.25]]))
    ref = jnp.log(jnp.array([[0.25, 0.5]]))
    for name, dkl in [("k1", np.array([1.0, 1.0])),
                      ("k3", 1.0 - np.array([0.5, 2.0]))]:   # d/dlogp k3 = 1 - exp(ref - logp)
        cfg = cfg_with(beta=0.5, kl_estimator=name)

        def loss_fn(lp):
            return grpo.clipped_policy_loss(cfg, logprobs=lp, behaviour_logprobs=logprobs,
                                            advantages=jnp.array([0.0]),
                                            completion_mask=jnp.ones((1, 2)), ref_logprobs=ref)

        (loss, metrics), g = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(logprobs)
        np.testing.assert_allclose(g[0], 0.5 * dkl / 2, rtol=1e-5, atol=1e-7)
        kl = np.asarray(kl_divergence(logprobs, ref, name))
        np.testing.assert_allclose(float(loss), 0.5 * kl.mean(), rtol=1e-5)
        np.testing.assert_allclose(float(metrics["kl"]), kl.mean(), rtol=1e-5)


def test_sampler_learner_diagnostics_by_hand():
    behaviour = jnp.array([[-1.0, -2.0, -3.0, 0.0]])
    logprobs = jnp.array([[-1.1, -1.8, -3.0, 0.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    _, m = grpo.clipped_policy_loss(cfg_with(), logprobs=logprobs, behaviour_logprobs=behaviour,
                                    advantages=jnp.array([1.0]), completion_mask=mask,
                                    entropy=jnp.array([[1.0, 2.0, 3.0, 100.0]]))
    d = np.array([-0.1, 0.2, 0.0])
    np.testing.assert_allclose(float(m["logprob_diff_mean"]), d.mean(), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(float(m["logprob_diff_max_abs"]), 0.2, rtol=1e-5)
    np.testing.assert_allclose(float(m["offpolicy/mismatch_k3"]), np.mean(np.exp(d) - d - 1),
                               rtol=1e-4)
    np.testing.assert_allclose(float(m["ratio_mean"]), np.mean(np.exp(d)), rtol=1e-5)
    np.testing.assert_allclose(float(m["entropy"]), 2.0, rtol=1e-6)
    assert float(m["num_tokens"]) == 3.0


# ------------------------------------------------------------------ config, errors, jit

def test_config_validation_and_describe():
    cfg = grpo.default_config()
    grpo.validate_config(cfg)
    line = grpo.describe(cfg)
    assert "adv=grpo" in line and "agg=token_mean" in line and "beta=0" in line
    assert "\n" not in line
    assert "kl=k3 beta=0.04" in grpo.describe(cfg_with(beta=0.04))
    with pytest.raises(ValueError, match="max_completion_length"):
        grpo.validate_config(cfg_with(loss_agg_mode="seq_mean_token_sum_norm"))
    with pytest.raises(UnknownNameError, match="k1, k2, k3, low_var_kl"):
        grpo.validate_config(cfg_with(beta=0.1, kl_estimator="k4"))
    with pytest.raises(ValueError, match="epsilon_low"):
        grpo.validate_config(cfg_with(epsilon_low=1.5))
    with pytest.raises(ValueError, match="grpo.proximal must be one of"):
        grpo.validate_config(cfg_with(proximal="old"))
    with pytest.raises(UnknownNameError, match="mask, none, truncate"):
        grpo.validate_config(cfg_with(behaviour_weight="clip"))
    with pytest.raises(ValueError, match="behaviour_weight_level must be one of"):
        grpo.validate_config(cfg_with(behaviour_weight_level="batch"))
    with pytest.raises(ValueError, match="behaviour_weight='none'"):
        grpo.validate_config(cfg_with(tis_cap=None))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        grpo.clipped_policy_loss(cfg_with(beta=0.1), logprobs=jnp.zeros((1, 2)),
                                 behaviour_logprobs=jnp.zeros((1, 2)), advantages=jnp.zeros(1),
                                 completion_mask=jnp.ones((1, 2)))
    with pytest.raises(ValueError, match="behaviour_logprobs has shape"):
        grpo.clipped_policy_loss(cfg, logprobs=jnp.zeros((1, 2)),
                                 behaviour_logprobs=jnp.zeros((1, 3)), advantages=jnp.zeros(1),
                                 completion_mask=jnp.ones((1, 2)))


def test_grpo_loss_jits():
    theta, actions, mask, rewards = toy_batch()
    lp = token_logprobs(jnp.asarray(theta), jnp.asarray(actions))
    cfg = cfg_with()
    f = jax.jit(lambda lp, b, r, m: grpo.grpo_loss(cfg, logprobs=lp, behaviour_logprobs=b,
                                                   rewards=r, completion_mask=m, group_size=G))
    loss, metrics = f(lp, lp - 0.01, rewards, mask)
    eager, _ = grpo.grpo_loss(cfg, logprobs=lp, behaviour_logprobs=lp - 0.01, rewards=rewards,
                              completion_mask=mask, group_size=G)
    # terms |A * ratio| / den <= 1 (group-normalised advantages) that cancel within each group
    assert_close(float(loss), float(eager), reduction_len=mask.size, scale=1.0)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_with_global_denominator_sum_to_full_batch(mode):
    theta, actions, mask, _ = toy_batch(2)
    rewards = np.array([1.0, 1.0, 1.0, 2.0, -1.0, 0.0], np.float32)   # group 0 is zero-variance
    cfg = cfg_with(loss_agg_mode=mode, max_completion_length=T)
    behaviour = token_logprobs(jnp.asarray(theta), jnp.asarray(actions)) - 0.03
    den = aggregation_denominator(loss_mask(mask, rewards, G, cfg), mode,
                                  max_completion_length=T)

    def loss_and_grad(th, rows, denominator):
        a, b, r, m = jnp.asarray(actions[rows]), behaviour[rows], rewards[rows], mask[rows]

        def f(th):
            return grpo.grpo_loss(cfg, logprobs=token_logprobs(th, a), behaviour_logprobs=b,
                                  rewards=r, completion_mask=m, group_size=G,
                                  loss_denominator=denominator)[0]
        return jax.jit(jax.value_and_grad(f))(th)

    full_loss, full_grad = jax.jit(jax.value_and_grad(
        lambda th: grpo.grpo_loss(cfg, logprobs=token_logprobs(th, jnp.asarray(actions)),
                                  behaviour_logprobs=behaviour, rewards=rewards,
                                  completion_mask=mask, group_size=G)[0]))(jnp.asarray(theta))
    parts = [loss_and_grad(jnp.asarray(theta), np.arange(0, G), den),
             loss_and_grad(jnp.asarray(theta), np.arange(G, 2 * G), den)]
    assert_close(sum(float(p[0]) for p in parts), float(full_loss), reduction_len=mask.size,
                 scale=1.0)   # terms |A * ratio| / den <= 1 that cancel within each group
    assert_close(sum(np.asarray(p[1]) for p in parts), full_grad, reduction_len=mask.size)
    assert np.abs(np.asarray(full_grad)).max() > 1e-4


# ------------------------------------------------------------------ off-policy measures, MIS, clamp

def weighted_case(w, mask, *, advantages=None, **overrides):
    """Loss, metrics and d loss / d logprobs for behaviour weights ``w`` [N, T] (pi_prox / mu
    with pi_prox the theta pass: r = 1), the config ``cfg_with(**overrides)``."""
    w = np.asarray(w, np.float32)
    behaviour = jnp.full(w.shape, -2.0)
    logprobs = behaviour + jnp.log(jnp.asarray(w))
    adv = jnp.ones(w.shape[0]) if advantages is None else jnp.asarray(advantages)
    cfg = cfg_with(**overrides)
    fn = lambda lp: grpo.clipped_policy_loss(  # noqa: E731
        cfg, logprobs=lp, behaviour_logprobs=behaviour, advantages=adv,
        completion_mask=jnp.asarray(mask, jnp.float32))
    (loss, m), g = jax.value_and_grad(fn, has_aux=True)(logprobs)
    return float(loss), {k: float(v) for k, v in m.items()}, np.asarray(g)


# row 0: 1.5, 3 (above the cap 2), 0.5; row 1: 5 (above), 1, and a padding token whose w (40)
# must count nowhere
W = [[1.5, 3.0, 0.5], [5.0, 1.0, 40.0]]
W_MASK = [[1, 1, 1], [1, 1, 0]]


def test_truncated_frac_counts_the_tokens_the_cap_changed():
    _, m, g = weighted_case(W, W_MASK, proximal="learner", tis_cap=2.0)
    assert m["offpolicy/truncated_frac"] == pytest.approx(2 / 5)
    assert m["offpolicy/truncated_frac_high"] == pytest.approx(2 / 5)
    assert m["offpolicy/truncated_frac_low"] == 0.0
    assert m["offpolicy/masked_frac"] == 0.0          # truncated, not masked
    # the weights the loss used: min(w, 2); token_mean over 5 loss tokens
    np.testing.assert_allclose(g[np.array(W_MASK) > 0],
                               -np.array([1.5, 2.0, 0.5, 2.0, 1.0]) / 5, rtol=1e-5)
    # proximal="behaviour": no weight is applied, so no bound acts; w is still measured
    _, mb, _ = weighted_case(W, W_MASK, tis_cap=2.0)
    assert mb["offpolicy/truncated_frac"] == 0.0
    assert mb["offpolicy/behaviour_weight_max"] == pytest.approx(5.0, rel=1e-5)


def test_ess_and_weight_min_equal_the_closed_form():
    w = np.array([1.5, 3.0, 0.5, 5.0, 1.0])            # the completion tokens of W
    want = w.sum() ** 2 / (len(w) * np.square(w).sum())
    for proximal in ("behaviour", "learner"):
        _, m, _ = weighted_case(W, W_MASK, proximal=proximal)
        assert m["offpolicy/ess"] == pytest.approx(want, rel=1e-5)
        assert m["offpolicy/behaviour_weight_min"] == pytest.approx(0.5, rel=1e-5)
        assert m["offpolicy/behaviour_weight_mean"] == pytest.approx(w.mean(), rel=1e-5)
        assert m["behaviour_weight_sum"] == pytest.approx(w.sum(), rel=1e-5)
        assert m["behaviour_weight_sq_sum"] == pytest.approx(np.square(w).sum(), rel=1e-5)
    _, m, _ = weighted_case(np.full((2, 3), 1.7), W_MASK)
    assert m["offpolicy/ess"] == pytest.approx(1.0, rel=1e-6)   # equal weights: ess 1


def test_mask_lower_bound_masks_a_token_with_w_0_3_at_cap_2():
    w, mask = [[0.3, 1.0, 1.2, 2.5]], [[1, 1, 1, 1]]
    _, m, g = weighted_case(w, mask, proximal="learner", behaviour_weight="mask", tis_cap=2.0)
    # default lower bound 1 / 2: 0.3 is masked below, 2.5 above
    np.testing.assert_allclose(g[0], -np.array([0.0, 1.0, 1.2, 0.0]) / 4, rtol=1e-5)
    assert g[0, 0] == 0.0 and g[0, 3] == 0.0
    assert m["offpolicy/truncated_frac_low"] == 0.25
    assert m["offpolicy/truncated_frac_high"] == 0.25
    assert m["offpolicy/truncated_frac"] == 0.5 and m["offpolicy/masked_frac"] == 0.5
    for lower in (0.0, 0.2):   # no lower bound, or one below 0.3: the token keeps its weight
        _, m, g = weighted_case(w, mask, proximal="learner", behaviour_weight="mask",
                                tis_cap=2.0, tis_lower=lower)
        assert g[0, 0] == pytest.approx(-0.3 / 4, rel=1e-5)
        assert m["offpolicy/truncated_frac_low"] == 0.0
    # truncate has no lower bound
    _, m, g = weighted_case(w, mask, proximal="learner", tis_cap=2.0)
    assert g[0, 0] == pytest.approx(-0.3 / 4, rel=1e-5) and m["offpolicy/truncated_frac_low"] == 0.0


def test_geometric_level_is_exp_of_the_mean_log_weight():
    _, m, g = weighted_case(W, W_MASK, proximal="learner", behaviour_weight="none",
                            behaviour_weight_level="geometric")
    row0 = np.exp(np.mean(np.log([1.5, 3.0, 0.5])))
    row1 = np.exp(np.mean(np.log([5.0, 1.0])))          # the padding token is not in the mean
    np.testing.assert_allclose(g[0], -row0 / 5, rtol=1e-5)
    np.testing.assert_allclose(g[1, :2], -row1 / 5, rtol=1e-5)
    assert g[1, 2] == 0.0
    assert m["offpolicy/behaviour_weight_max"] == pytest.approx(row1, rel=1e-5)
    # bounded like any level: row 1's 2.236 is above a cap of 2
    _, m, g = weighted_case(W, W_MASK, proximal="learner", behaviour_weight="truncate",
                            behaviour_weight_level="geometric", tis_cap=2.0)
    np.testing.assert_allclose(g[1, :2], -2.0 / 5, rtol=1e-5)
    assert m["offpolicy/truncated_frac_high"] == pytest.approx(2 / 5)


def test_log_weight_clamp_keeps_a_long_sequence_finite():
    """200 tokens x 0.5 nat at sequence level: log w = 100, e^100 overflows float32; clamped
    to 20 the loss, gradient and measures are finite."""
    w = np.full((2, 200), np.exp(0.5), np.float32)
    loss, m, g = weighted_case(w, np.ones((2, 200)), advantages=[1.0, -1.0], proximal="learner",
                               behaviour_weight="none", behaviour_weight_level="sequence")
    assert np.isfinite(loss) and np.isfinite(g).all()
    assert all(np.isfinite(v) for v in m.values()), m
    np.testing.assert_allclose(g[0], -np.exp(20.0) / 400, rtol=1e-5)   # W = e^20, A = +1
    assert m["offpolicy/behaviour_weight_max"] == pytest.approx(np.exp(20.0), rel=1e-5)
    assert m["offpolicy/truncated_frac_high"] == 1.0     # the clamp changed every weight
    # and the low side: w = e^-100 becomes e^-20, not 0
    _, m, g = weighted_case(1.0 / w, np.ones((2, 200)), proximal="learner",
                            behaviour_weight="none", behaviour_weight_level="sequence")
    np.testing.assert_allclose(g[0], -np.exp(-20.0) / 400, rtol=1e-5)
    assert m["offpolicy/truncated_frac_low"] == 1.0


def test_off_policy_knobs_are_validated_and_described():
    with pytest.raises(ValueError, match=r"grpo.tis_lower must be None .* \[0, 1\]"):
        grpo.validate_config(cfg_with(tis_lower=1.5))
    with pytest.raises(ValueError, match="grpo.tis_lower .* must be below grpo.tis_cap"):
        grpo.validate_config(cfg_with(behaviour_weight="mask", tis_cap=0.8, tis_lower=0.9))
    with pytest.raises(ValueError, match="grpo.minibatches must be an int >= 1"):
        grpo.validate_config(cfg_with(minibatches=0))
    with pytest.raises(ValueError, match="geometric"):
        grpo.validate_config(cfg_with(behaviour_weight_level="batch"))
    grpo.validate_config(cfg_with(behaviour_weight_level="geometric", tis_lower=0.0))
    assert tis_lower(cfg_with(tis_cap=4.0)) == 0.25
    line = grpo.describe(cfg_with(proximal="learner", behaviour_weight="mask"))
    assert "mask at 2 per token, lower bound 0.5" in line
    assert "one optimizer step per batch (r = 1: the clip does not act)" in line
    line = grpo.describe(cfg_with(proximal="learner", minibatches=4))
    assert "4 minibatches (optimizer steps) per batch" in line and "r = 1" not in line
