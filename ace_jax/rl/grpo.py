"""GRPO's objective: the `grpo` config section and the clipped policy loss over the registries.

Vocabulary follows TRL and verl so recipes port by name. Every part that changes the gradient
scale is a registry entry picked by name in the config (`default_config()`); a new variant is one
small registered function in its registry's module, not a fork (`ace_jax.registry.Registry`;
unknown names raise `UnknownNameError`, which lists the valid names):

- `ace_jax.rl.advantage_estimators`: `ADVANTAGE_ESTIMATORS` (`grpo`, `drgrpo`, `rloo`), rewards
  [num_groups, G] -> advantages [num_groups, G], and the zero-variance group test;
- `ace_jax.rl.loss_aggregation`: `LOSS_AGGREGATIONS` (`token_mean`, `seq_mean_token_mean`,
  `seq_mean_token_sum_norm`), per-token loss [N, T] and loss mask [N, T] -> (numerator,
  denominator), and the full-batch denominator for gradient accumulation;
- `ace_jax.rl.kl_estimators`: `KL_ESTIMATORS` (`k1`, `k2`, `k3`, `low_var_kl`), per-token
  KL(pi || pi_ref) from log-probs of the sampled tokens;
- `ace_jax.rl.behaviour_weights`: `BEHAVIOUR_WEIGHTS` (`truncate`, `mask`, `none`) and
  `BEHAVIOUR_WEIGHT_LEVELS` (`token`, `sequence`, `geometric`), the weight pi_prox / mu.

Three policies (decoupled PPO: Hilton et al. 2021, AReaL's `use_decoupled_loss`): the behaviour
policy mu (the sampler; its log-probs recorded at generation time), the proximal policy pi_prox
(the learner's parameters before this update) and pi_theta (being updated). The loss
(`clipped_policy_loss`, or `grpo_loss` which also computes advantages from rewards):

    r_t    = pi_theta / pi_prox                   (the clip's ratio)
    W_t    = weight(pi_prox / mu)                 (detached; `behaviour_weight`, `tis_cap`,
                                                  `tis_lower`, `behaviour_weight_level`)
    loss_t = -W_t * min(r_t * A, clip(r_t, 1 - epsilon_low, 1 + epsilon_high) * A)
             + beta * KL_t(logp_t, ref_t)
    loss   = aggregate(loss_t over loss tokens)

`proximal` picks pi_prox: "behaviour" sets pi_prox = mu (W = 1: the plain GRPO / PPO objective,
the clip absorbs both policy lag and sampler-vs-learner mismatch); "learner" takes the learner's
own log-probs before the update: ``proximal_logprobs`` when given (the learner's no-grad forward
before the first of `minibatches` > 1 optimizer steps per batch), else the theta pass's values
under `stop_gradient` (exact with one optimizer step per batch: no extra forward; r_t is then 1
in value, the clip never acts, and the update is W_t * A * grad log pi_theta, the behaviour
weight doing all the off-policy correction). log w is clamped to [-20, 20] (as verl) after its
level and before any exp, so no mode yields inf or NaN.

Loss tokens are completion tokens (`completion_mask`) of sequences that survive the zero-variance
group filter. Prompt tokens and padding are removed with `jnp.where` BEFORE any exp, so their
log-probs (even inf or nan in non-differentiated inputs) change neither the loss nor its gradient.

Shapes: N = number of sequences (num_groups * G, group-major: rows [g*G, (g+1)*G) are group g),
T = completion length in tokens. Log-probs are natural-log probabilities (nats).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from ace_jax.rl.advantage_estimators import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    group_rewards,
    zero_variance_groups,
)
from ace_jax.rl.behaviour_weights import (
    BEHAVIOUR_WEIGHT_LEVELS,
    BEHAVIOUR_WEIGHTS,
    LOG_W_CLAMP,
    BoundedWeight,
    bounded_weight,
    level_log_weight,
    tis_lower,
)
from ace_jax.rl.kl_estimators import KL_ESTIMATORS, kl_divergence
from ace_jax.rl.loss_aggregation import LOSS_AGGREGATIONS, safe_divide

__all__ = [
    "clipped_policy_loss",
    "default_config",
    "describe",
    "grpo_loss",
    "validate_config",
]


PROXIMAL_POLICIES = ("behaviour", "learner")
ROUTING_REPLAY = ("none", "R3")


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

def default_config() -> ml_collections.ConfigDict:
    """The GRPO section of a config; every knob that changes the gradient is explicit here."""
    cfg = ml_collections.ConfigDict()
    cfg.advantage_estimator = "grpo"      # grpo | drgrpo | rloo
    cfg.advantage_eps = 1e-6              # grpo: (r - mean) / (std + eps)
    cfg.advantage_std_ddof = 1            # 1: unbiased group std (TRL, verl); 0: biased (jnp.std)
    cfg.loss_agg_mode = "token_mean"      # token_mean | seq_mean_token_mean | seq_mean_token_sum_norm
    cfg.max_completion_length = 0         # seq_mean_token_sum_norm divisor, tokens; must be > 0 there
    cfg.epsilon_low = 0.2                 # ratio clipped below at 1 - epsilon_low
    cfg.epsilon_high = 0.2                # ratio clipped above at 1 + epsilon_high (DAPO: 0.28)
    cfg.kl_estimator = "k3"               # k1 | k2 | k3 | low_var_kl; used only when beta > 0
    cfg.beta = 0.0                        # KL coefficient; 0 means no reference model is needed
    cfg.filter_zero_variance_groups = True
    cfg.zero_variance_atol = 1e-6         # a group is zero-variance when max(r) - min(r) <= atol
    cfg.proximal = "behaviour"            # behaviour | learner: the policy the clip's ratio is against
    cfg.behaviour_weight = "truncate"     # truncate | mask | none: pi_prox / mu (proximal="learner")
    cfg.behaviour_weight_level = "token"  # token | sequence | geometric
    cfg.tis_cap = 2.0                     # upper bound of the weight (truncate / mask), > 0
    # mask's lower bound, in [0, 1]: tokens with w below it are masked too; None: 1 / tis_cap;
    # 0: no lower bound (unused by truncate and none)
    cfg.tis_lower = config_dict.placeholder(float)
    cfg.minibatches = 1                   # optimizer steps per batch (PPO minibatches), >= 1
    cfg.routing_replay = "none"           # none | R3: MoE tokens dispatched by the sampler's record
    return cfg


def validate_config(cfg: ml_collections.ConfigDict) -> None:
    """Raise `UnknownNameError` / `ValueError` naming the bad field of a GRPO config section."""
    ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)
    LOSS_AGGREGATIONS.get(cfg.loss_agg_mode)
    if cfg.beta:
        KL_ESTIMATORS.get(cfg.kl_estimator)
    if cfg.beta < 0:
        raise ValueError(f"grpo.beta must be >= 0, got {cfg.beta}")
    if not (0 <= cfg.epsilon_low < 1):
        raise ValueError(f"grpo.epsilon_low must be in [0, 1), got {cfg.epsilon_low}")
    if cfg.epsilon_high < 0:
        raise ValueError(f"grpo.epsilon_high must be >= 0, got {cfg.epsilon_high}")
    if cfg.advantage_std_ddof not in (0, 1):
        raise ValueError(f"grpo.advantage_std_ddof must be 0 or 1, got {cfg.advantage_std_ddof}")
    if cfg.proximal not in PROXIMAL_POLICIES:
        raise ValueError(f"grpo.proximal must be one of {list(PROXIMAL_POLICIES)}, got "
                         f"{cfg.proximal!r}")
    BEHAVIOUR_WEIGHTS.get(cfg.behaviour_weight)
    if cfg.behaviour_weight_level not in BEHAVIOUR_WEIGHT_LEVELS:
        raise ValueError(f"grpo.behaviour_weight_level must be one of "
                         f"{BEHAVIOUR_WEIGHT_LEVELS.names()}, got {cfg.behaviour_weight_level!r}")
    if cfg.routing_replay not in ROUTING_REPLAY:
        raise ValueError(f"grpo.routing_replay must be one of {list(ROUTING_REPLAY)}, got "
                         f"{cfg.routing_replay!r} (R2, replaying the proximal pass's routes in "
                         "the theta pass, is 'none' here: with one update per batch they are "
                         "the same pass)")
    if not (isinstance(cfg.tis_cap, (int, float)) and cfg.tis_cap > 0):
        raise ValueError(f"grpo.tis_cap must be a number > 0, got {cfg.tis_cap!r} (to apply no "
                         "weight bound use grpo.behaviour_weight='none')")
    lower = cfg.get("tis_lower")
    if lower is not None and not (isinstance(lower, (int, float)) and 0 <= lower <= 1):
        raise ValueError(f"grpo.tis_lower must be None (= 1 / grpo.tis_cap) or a number in "
                         f"[0, 1] (0: no lower bound), got {lower!r}")
    if cfg.behaviour_weight == "mask" and not tis_lower(cfg) < cfg.tis_cap:
        raise ValueError(f"grpo.tis_lower ({tis_lower(cfg):g}) must be below grpo.tis_cap "
                         f"({cfg.tis_cap:g}): behaviour_weight='mask' would mask every token")
    mb = cfg.get("minibatches", 1)
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
        raise ValueError(f"grpo.minibatches must be an int >= 1 (optimizer steps per batch), "
                         f"got {mb!r}")
    if cfg.loss_agg_mode == "seq_mean_token_sum_norm" and not cfg.max_completion_length > 0:
        raise ValueError("grpo.loss_agg_mode='seq_mean_token_sum_norm' needs "
                         f"grpo.max_completion_length > 0, got {cfg.max_completion_length}")


def describe(cfg: ml_collections.ConfigDict) -> str:
    """One line stating the GRPO mode (logged once at start)."""
    adv = cfg.advantage_estimator
    if adv == "grpo":
        adv += f"[(r-mean)/(std_ddof{cfg.advantage_std_ddof}+{cfg.advantage_eps:g})]"
    agg = cfg.loss_agg_mode
    if agg == "seq_mean_token_sum_norm":
        agg += f"[L={cfg.max_completion_length}]"
    kl = f"kl={cfg.kl_estimator} beta={cfg.beta:g}" if cfg.beta else "kl=off (beta=0, no reference)"
    if cfg.proximal == "behaviour":
        tis = "clip on pi/mu (proximal=behaviour: the sampler), no behaviour weight"
    else:
        bound = "" if cfg.behaviour_weight == "none" else f" at {cfg.tis_cap:g}"
        lower = tis_lower(cfg)
        if cfg.behaviour_weight == "mask" and lower > 0:
            bound_low = f", lower bound {lower:g}"
        else:
            bound_low = ""
        tis = (f"decoupled: clip on pi/pi_prox (the learner before the update), behaviour weight "
               f"pi_prox/mu {cfg.behaviour_weight}{bound} per {cfg.behaviour_weight_level}"
               f"{bound_low}")
        if cfg.get("minibatches", 1) == 1:
            tis += ", one optimizer step per batch (r = 1: the clip does not act)"
    if cfg.get("minibatches", 1) > 1:
        tis += f", {cfg.minibatches} minibatches (optimizer steps) per batch"
    if cfg.routing_replay != "none":
        tis += f", MoE routing replay {cfg.routing_replay}"
    zv = (f"filter_zero_variance_groups(atol={cfg.zero_variance_atol:g})"
          if cfg.filter_zero_variance_groups else "zero-variance groups kept")
    return (f"GRPO: adv={adv} agg={agg} clip=[1-{cfg.epsilon_low:g}, 1+{cfg.epsilon_high:g}] "
            f"{kl} {tis} {zv}")


# ----------------------------------------------------------------------------------------------
# The clipped policy loss
# ----------------------------------------------------------------------------------------------

def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return safe_divide(jnp.where(mask, x, 0.0).sum(), mask.sum().astype(x.dtype))


def _behaviour_weight_measures(level: jax.Array, bound: BoundedWeight, completion: jax.Array,
                               keep: jax.Array) -> dict[str, jax.Array]:
    """The `offpolicy/*` measures of the behaviour weight (see `clipped_policy_loss`).

    ``level``: log w [N, T] at its level before the clamp; ``bound``: what the mode made of it
    (no flags under proximal="behaviour"); ``completion`` / ``keep``: bool [N, T] completion
    and loss tokens. Also returns ``behaviour_weight_sum`` / ``behaviour_weight_sq_sum`` (sums
    of w and w^2 over completion tokens), from which a microbatched learner combines `ess`."""
    dtype = jnp.float32
    w = jnp.exp(jnp.clip(level, -LOG_W_CLAMP, LOG_W_CLAMP))
    wc = jnp.where(completion, w, 0.0)
    n = completion.sum().astype(dtype)
    w_sum, w_sq_sum = wc.sum(), jnp.square(wc).sum()

    def frac(flags):
        return _masked_mean(flags.astype(dtype), completion)

    return {
        "offpolicy/behaviour_weight_mean": _masked_mean(w, completion),
        "offpolicy/behaviour_weight_max": jnp.max(wc),
        "offpolicy/behaviour_weight_min": jnp.where(
            n > 0, jnp.min(jnp.where(completion, w, jnp.inf)), 0.0),
        # (sum w)^2 / (n sum w^2) = mean(w)^2 / mean(w^2)
        "offpolicy/ess": safe_divide(jnp.square(safe_divide(w_sum, n)),
                                      safe_divide(w_sq_sum, n)),
        "offpolicy/truncated_frac": frac(bound.high | bound.low),
        "offpolicy/truncated_frac_high": frac(bound.high),
        "offpolicy/truncated_frac_low": frac(bound.low),
        "offpolicy/masked_frac": _masked_mean(bound.masked.astype(dtype), keep),
        "behaviour_weight_sum": w_sum,
        "behaviour_weight_sq_sum": w_sq_sum,
    }


def _check_shapes(**arrays: jax.Array | None) -> tuple[int, int]:
    shape = arrays["logprobs"].shape
    if len(shape) != 2:
        raise ValueError(f"logprobs must be [N, T], got shape {shape}")
    for name, x in arrays.items():
        if x is not None and x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}, expected {shape} like logprobs")
    return shape


def clipped_policy_loss(
    cfg: ml_collections.ConfigDict,
    *,
    logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    advantages: jax.Array,
    completion_mask: jax.Array,
    sequence_mask: jax.Array | None = None,
    proximal_logprobs: jax.Array | None = None,
    ref_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
    loss_denominator: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped-ratio policy loss with given advantages (the formula: the module docstring).

    Args:
      cfg: the GRPO config section (`default_config()`).
      logprobs: [N, T] learner log-probs of the sampled tokens (differentiated).
      behaviour_logprobs: [N, T] sampler log-probs recorded at generation.
      advantages: [N] per sequence or [N, T] per token.
      completion_mask: [N, T], 1 on completion tokens, 0 on prompt tokens and padding.
      sequence_mask: [N] bool, False drops the whole sequence (zero-variance filter); None keeps all.
      proximal_logprobs: [N, T] the learner's log-probs before this update, when they differ
        from the theta pass's own values (several updates per batch); used only with
        ``cfg.proximal == "learner"``, default ``stop_gradient(logprobs)``.
      ref_logprobs: [N, T] frozen reference log-probs; required iff cfg.beta > 0.
      entropy: [N, T] per-token policy entropy (nats), only reported.
      loss_denominator: scalar; when given, loss = numerator / loss_denominator instead of the
        batch's own denominator. For gradient accumulation pass the full batch's
        `aggregation_denominator(...)` to every micro-batch: the micro-batch losses (and
        gradients) then sum exactly to the full-batch ones.

    Returns:
      (scalar loss, metrics). Metrics (all detached): `clip_frac_low` / `clip_frac_high` (fraction of
      loss tokens whose gradient the lower / upper clip zeroes), `ratio_mean`, `logprob_diff_mean`
      (learner - sampler) and `logprob_diff_max_abs` over all completion tokens, `num_tokens`
      (loss tokens), `num_completion_tokens`, `kl` (when beta > 0), `entropy` (when given), and
      the off-policy measures, whatever the mode (w = pi_prox / mu at the configured level,
      log w clamped to [-20, 20], pi_prox the learner's log-probs before the update: under
      proximal="behaviour" the theta pass's own, detached, so w is the learner-vs-sampler
      ratio): `offpolicy/clip_frac` (low + high), over completion tokens
      `offpolicy/behaviour_weight_mean` / `_max` / `_min` (w before its bound; max and min 0
      when there are no completion tokens) and `offpolicy/ess` (the normalised effective sample
      size of w, (sum w)^2 / (n sum w^2), in (0, 1]: 1 when every w is equal, about 1/n when one
      token carries all the weight; 0 without completion tokens), `offpolicy/truncated_frac`
      (the share of completion tokens whose weight the bound changed, truncated or masked,
      above the cap or below the lower bound or by the +-20 clamp; 0 under
      proximal="behaviour", where no weight is applied) = `offpolicy/truncated_frac_high` +
      `offpolicy/truncated_frac_low`, `offpolicy/masked_frac` (loss tokens whose weight the
      mask mode set to 0), `offpolicy/mismatch_k3` (k3 estimate of KL(mu || pi_prox) from the
      sampled tokens: the sampler-vs-learner mismatch plus the policy lag); and
      `behaviour_weight_sum` / `behaviour_weight_sq_sum` (sums of w and w^2 over completion
      tokens: `ess` of several microbatches is mean(w)^2 / mean(w^2) of their sums).
    """
    _check_shapes(logprobs=logprobs, behaviour_logprobs=behaviour_logprobs,
                  completion_mask=completion_mask, proximal_logprobs=proximal_logprobs,
                  ref_logprobs=ref_logprobs, entropy=entropy)
    n, t = logprobs.shape
    if cfg.beta and ref_logprobs is None:
        raise ValueError(f"grpo.beta={cfg.beta} needs ref_logprobs")
    if advantages.shape == (n,):
        advantages = jnp.broadcast_to(advantages[:, None], (n, t))
    elif advantages.shape != (n, t):
        raise ValueError(f"advantages must be [N]={n} or [N, T]={(n, t)}, got {advantages.shape}")
    if sequence_mask is not None and sequence_mask.shape != (n,):
        raise ValueError(f"sequence_mask must be [N]={(n,)}, got {sequence_mask.shape}")

    dtype = jnp.float32
    completion = completion_mask > 0
    keep = completion if sequence_mask is None else completion & sequence_mask[:, None]
    # Sanitise every masked position before any arithmetic: no inf/nan can reach exp or the
    # gradient from prompt tokens or padding.
    logp = jnp.where(keep, logprobs.astype(dtype), 0.0)
    behaviour = jax.lax.stop_gradient(jnp.where(completion, behaviour_logprobs.astype(dtype), 0.0))
    adv = jax.lax.stop_gradient(jnp.where(keep, advantages.astype(dtype), 0.0))
    sg = jax.lax.stop_gradient
    # pi_prox: the learner before this update (measured in every mode; used with "learner")
    prox = sg(jnp.where(completion, (logprobs if proximal_logprobs is None
                                     else proximal_logprobs).astype(dtype), 0.0))
    level = level_log_weight(cfg, prox - behaviour, completion)
    if cfg.proximal == "learner":
        base = prox
        bound = bounded_weight(cfg, level, completion)
    else:   # no weight: the bound acts on nothing
        none = jnp.zeros(keep.shape, bool)
        base, bound = behaviour, BoundedWeight(jnp.ones_like(behaviour), none, none, none)
    weight = bound.weight

    log_ratio = jnp.where(keep, logp - base, 0.0)
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high)
    per_token = -weight * jnp.minimum(ratio * adv, clipped_ratio * adv)
    metrics: dict[str, jax.Array] = {}
    if cfg.beta:
        ref = jax.lax.stop_gradient(jnp.where(keep, ref_logprobs.astype(dtype), 0.0))
        kl = kl_divergence(logp, ref, cfg.kl_estimator)
        per_token = per_token + cfg.beta * kl
        metrics["kl"] = _masked_mean(jax.lax.stop_gradient(kl), keep)

    numerator, denominator = LOSS_AGGREGATIONS.get(cfg.loss_agg_mode)(
        per_token, keep.astype(dtype), max_completion_length=cfg.max_completion_length)
    if loss_denominator is not None:
        denominator = jnp.asarray(loss_denominator, dtype)
    loss = safe_divide(numerator, denominator)
    metrics["loss_denominator"] = jax.lax.stop_gradient(denominator)

    r = sg(ratio)
    metrics["clip_frac_low"] = _masked_mean(((r < 1.0 - cfg.epsilon_low) & (adv < 0)).astype(dtype),
                                            keep)
    metrics["clip_frac_high"] = _masked_mean(((r > 1.0 + cfg.epsilon_high) & (adv > 0)).astype(dtype),
                                             keep)
    metrics["ratio_mean"] = _masked_mean(r, keep)
    metrics["offpolicy/clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    # Sampler-vs-learner diagnostics over ALL completion tokens (filtered groups included).
    learner = sg(jnp.where(completion, logprobs.astype(dtype), 0.0))
    diff = jnp.where(completion, learner - behaviour, 0.0)
    metrics.update(_behaviour_weight_measures(level, bound, completion, keep))
    # k3 with the behaviour policy as the sampling distribution: KL(mu || pi_prox) ~
    # E_mu[w - 1 - log w], w = pi_prox / mu, per token.
    d = prox - behaviour
    metrics["offpolicy/mismatch_k3"] = _masked_mean(jnp.exp(d) - d - 1.0, completion)
    metrics["logprob_diff_mean"] = _masked_mean(diff, completion)
    metrics["logprob_diff_max_abs"] = jnp.max(jnp.abs(diff))
    metrics["num_tokens"] = keep.sum().astype(dtype)
    metrics["num_completion_tokens"] = completion.sum().astype(dtype)
    if entropy is not None:
        metrics["entropy"] = _masked_mean(sg(entropy.astype(dtype)), completion)
    return loss, metrics


def grpo_loss(
    cfg: ml_collections.ConfigDict,
    *,
    logprobs: jax.Array,
    behaviour_logprobs: jax.Array,
    rewards: jax.Array,
    completion_mask: jax.Array,
    group_size: int,
    proximal_logprobs: jax.Array | None = None,
    ref_logprobs: jax.Array | None = None,
    entropy: jax.Array | None = None,
    loss_denominator: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO loss from rewards: advantages, zero-variance filter, then `clipped_policy_loss`.

    Args:
      rewards: [N] per sequence, group-major (rows [g*G, (g+1)*G) form group g), N = num_groups*G.
        A micro-batch must therefore hold whole groups (or compute advantages on the full batch
        and call `clipped_policy_loss`).
      group_size: G.
      Other arguments as in `clipped_policy_loss`.

    Returns:
      (loss, metrics): the metrics of `clipped_policy_loss` plus `frac_zero_variance_groups` (the
      fraction of groups whose rewards all agree, whether or not they were filtered),
      `reward_mean`, `reward_std` (over the batch, biased) and `advantage_abs_mean`.
    """
    n = logprobs.shape[0]
    rewards = jnp.asarray(rewards, jnp.float32)
    if rewards.shape != (n,):
        raise ValueError(f"rewards must be [N]={(n,)}, got {rewards.shape}")
    grouped = group_rewards(rewards, group_size)
    advantages = compute_advantages(grouped, cfg).reshape(n)
    zero_var = zero_variance_groups(grouped, cfg.zero_variance_atol)
    sequence_mask = None
    if cfg.filter_zero_variance_groups:
        sequence_mask = jnp.repeat(~zero_var, group_size)
    loss, metrics = clipped_policy_loss(
        cfg, logprobs=logprobs, behaviour_logprobs=behaviour_logprobs, advantages=advantages,
        completion_mask=completion_mask, sequence_mask=sequence_mask,
        proximal_logprobs=proximal_logprobs,
        ref_logprobs=ref_logprobs, entropy=entropy, loss_denominator=loss_denominator)
    metrics["frac_zero_variance_groups"] = zero_var.mean(dtype=jnp.float32)
    metrics["reward_mean"] = rewards.mean()
    metrics["reward_std"] = rewards.std()
    metrics["advantage_abs_mean"] = jnp.abs(advantages).mean()
    return loss, metrics
