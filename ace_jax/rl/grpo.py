"""GRPO building blocks: advantage estimators, loss aggregation, KL estimators, the clipped loss.

Vocabulary follows TRL and verl so recipes port by name. Every part that changes the gradient
scale is a registry entry picked by name in the config (`default_config()`); a new variant is one
small registered function, not a fork:

    @register_advantage_estimator("my_estimator")
    def my_estimator(rewards, *, eps, std_ddof): ...   # [num_groups, G] -> [num_groups, G]

Registries (`ace_jax.registry.Registry`; unknown names raise `UnknownNameError`, which lists the
valid names):

- advantage estimators, rewards [num_groups, G] -> advantages [num_groups, G]:
  `grpo`   (r - mean) / (std + eps), std with `std_ddof` (default 1 = unbiased, as TRL and verl's
           `torch.std`; 0 = biased, as `jnp.std`);
  `drgrpo` r - mean (Dr.GRPO: no std scaling);
  `rloo`   r - mean of the other G - 1 rewards (= G / (G - 1) * (r - mean)).
  Whatever the estimator, a group whose rewards agree within `zero_variance_atol` gets advantage
  exactly 0 (float rounding in the mean is never amplified by 1 / (std + eps)); with
  `filter_zero_variance_groups` its tokens also leave every loss denominator.
- loss aggregation modes, per-token loss [N, T] and loss mask [N, T] -> (numerator, denominator);
  loss = numerator / denominator. The denominator depends on the mask only, so for gradient
  accumulation compute `aggregation_denominator(loss_mask(...))` once on the full batch and pass
  it as `loss_denominator` to every micro-batch: the micro-batch losses and gradients then sum to
  the full-batch ones exactly (up to float summation order):
  `token_mean`               sum of all loss tokens / number of loss tokens (verl's default);
  `seq_mean_token_mean`      mean over sequences of (per-sequence token mean) (tunix's default);
  `seq_mean_token_sum_norm`  mean over sequences of (per-sequence token sum / max_completion_length)
                             (Dr.GRPO; the same normaliser as TRL's `dr_grpo`).
  "Sequences" are the rows with at least one loss token: padding rows and filtered groups do not
  count in any denominator.
- KL estimators of KL(pi || pi_ref) per token, from log-probs of the sampled tokens:
  `k1` logp - ref, `k2` (logp - ref)^2 / 2, `k3` exp(ref - logp) - (ref - logp) - 1,
  `low_var_kl` k3 with verl's clamps (log-ratio to [-20, 20], result to [-10, 10]).
- behaviour weights, log w [N, T] (log pi_prox - log mu, nats, already at its level and
  clamped to [-20, 20]) and the bounds -> `BoundedWeight` (weight, high, low, masked) [N, T]:
  `truncate` min(w, cap) (verl's / slime's TIS, TRL's `token_truncate`; no lower bound);
  `mask` w where lower <= w <= cap, else 0 and the token counted as masked (MIS: AReaL's
  `behav_imp_weight_cap` above, verl's rejection sampling on both sides, TRL's `*_mask`);
  `none` w itself (plain importance sampling).
- behaviour weight levels, log w per token [N, T] and completion mask [N, T] -> log w [N, T]:
  `token` each token's own; `sequence` the sum over the sequence's completion tokens (w = the
  product), applied to each; `geometric` the mean over them (w = the geometric mean of the
  token weights, exp(mean log w)), applied to each.

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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
from ml_collections import config_dict

from ace_jax.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "LOSS_AGGREGATIONS",
    "KL_ESTIMATORS",
    "BEHAVIOUR_WEIGHTS",
    "register_advantage_estimator",
    "register_loss_aggregation",
    "register_kl_estimator",
    "register_behaviour_weight",
    "BEHAVIOUR_WEIGHT_LEVELS",
    "register_behaviour_weight_level",
    "BoundedWeight",
    "LOG_W_CLAMP",
    "tis_lower",
    "default_config",
    "validate_config",
    "describe",
    "group_rewards",
    "compute_advantages",
    "zero_variance_groups",
    "aggregate_loss",
    "aggregation_denominator",
    "loss_mask",
    "kl_divergence",
    "clipped_policy_loss",
    "grpo_loss",
]


ADVANTAGE_ESTIMATORS: Registry = Registry("advantage estimator")
LOSS_AGGREGATIONS: Registry = Registry("loss aggregation mode")
KL_ESTIMATORS: Registry = Registry("KL estimator")
BEHAVIOUR_WEIGHTS: Registry = Registry("behaviour weight")

register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
register_loss_aggregation = LOSS_AGGREGATIONS.register
register_kl_estimator = KL_ESTIMATORS.register
register_behaviour_weight = BEHAVIOUR_WEIGHTS.register
BEHAVIOUR_WEIGHT_LEVELS: Registry = Registry("behaviour weight level")
register_behaviour_weight_level = BEHAVIOUR_WEIGHT_LEVELS.register

PROXIMAL_POLICIES = ("behaviour", "learner")
ROUTING_REPLAY = ("none", "R3")
LOG_W_CLAMP = 20.0   # |log w| bound (nats) before any exp: e^20 ~ 4.9e8, as verl's clamp


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
# Advantage estimators: rewards [num_groups, G] -> advantages [num_groups, G]
# ----------------------------------------------------------------------------------------------

def group_rewards(rewards: jax.Array, group_size: int | None = None) -> jax.Array:
    """Rewards as [num_groups, G]: 2-D input is returned as is; flat [N] input needs `group_size`."""
    rewards = jnp.asarray(rewards)
    if rewards.ndim == 2:
        if group_size is not None and rewards.shape[1] != group_size:
            raise ValueError(f"rewards have group size {rewards.shape[1]}, group_size={group_size}")
        grouped = rewards
    elif rewards.ndim == 1:
        if group_size is None:
            raise ValueError("flat rewards [N] need group_size")
        if group_size < 1 or rewards.shape[0] % group_size:
            raise ValueError(f"{rewards.shape[0]} rewards do not split into groups of {group_size}")
        grouped = rewards.reshape(-1, group_size)
    else:
        raise ValueError(f"rewards must be [num_groups, G] or [N], got shape {rewards.shape}")
    if grouped.shape[1] < 2:
        raise ValueError(f"GRPO needs at least 2 completions per group, got G={grouped.shape[1]}")
    return grouped


@register_advantage_estimator("grpo")
def grpo_advantages(rewards: jax.Array, *, eps: float, std_ddof: int) -> jax.Array:
    """(r - mean) / (std + eps) per group; std with `std_ddof` (1 unbiased, 0 biased)."""
    mean = rewards.mean(axis=-1, keepdims=True)
    std = rewards.std(axis=-1, keepdims=True, ddof=std_ddof)
    return (rewards - mean) / (std + eps)


@register_advantage_estimator("drgrpo")
def drgrpo_advantages(rewards: jax.Array, *, eps: float, std_ddof: int) -> jax.Array:
    """r - mean per group (Dr.GRPO removes the std scaling); eps and std_ddof are unused."""
    del eps, std_ddof
    return rewards - rewards.mean(axis=-1, keepdims=True)


@register_advantage_estimator("rloo")
def rloo_advantages(rewards: jax.Array, *, eps: float, std_ddof: int) -> jax.Array:
    """r_i - mean_{j != i} r_j (leave-one-out baseline); eps and std_ddof are unused."""
    del eps, std_ddof
    g = rewards.shape[-1]
    others_mean = (rewards.sum(axis=-1, keepdims=True) - rewards) / (g - 1)
    return rewards - others_mean


def zero_variance_groups(rewards: jax.Array, atol: float) -> jax.Array:
    """bool [num_groups]: groups whose rewards all agree within `atol` (max - min <= atol).

    A range test, not `std != 0`: float noise in rewards would defeat an exact test."""
    return (rewards.max(axis=-1) - rewards.min(axis=-1)) <= atol


def compute_advantages(rewards: jax.Array, cfg: ml_collections.ConfigDict,
                       group_size: int | None = None) -> jax.Array:
    """Advantages for rewards [num_groups, G] (or flat [N] with `group_size`), same shape as input.

    The estimator is `cfg.advantage_estimator`. Groups whose rewards agree within
    `cfg.zero_variance_atol` get advantage exactly 0 (whatever the estimator, filtered or not)."""
    rewards = jnp.asarray(rewards, jnp.float32)
    grouped = group_rewards(rewards, group_size)
    fn = ADVANTAGE_ESTIMATORS.get(cfg.advantage_estimator)
    adv = fn(grouped, eps=cfg.advantage_eps, std_ddof=cfg.advantage_std_ddof)
    # Groups whose rewards agree within zero_variance_atol carry no signal: their advantage is
    # exactly 0, so float rounding in the mean is never amplified by 1 / (std + eps).
    flat = zero_variance_groups(grouped, cfg.zero_variance_atol)
    adv = jnp.where(flat[:, None], 0.0, adv)
    return adv.reshape(rewards.shape)


# ----------------------------------------------------------------------------------------------
# Loss aggregation: (per-token loss [N, T], mask [N, T]) -> (numerator, denominator)
# ----------------------------------------------------------------------------------------------

def _masked(loss: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.where(mask > 0, loss * mask, 0.0)


@register_loss_aggregation("token_mean")
def token_mean(loss: jax.Array, mask: jax.Array, *, max_completion_length: int):
    """Sum over all loss tokens / number of loss tokens."""
    del max_completion_length
    return _masked(loss, mask).sum(), mask.sum()


@register_loss_aggregation("seq_mean_token_mean")
def seq_mean_token_mean(loss: jax.Array, mask: jax.Array, *, max_completion_length: int):
    """Mean over sequences with >= 1 loss token of that sequence's token mean."""
    del max_completion_length
    tokens = mask.sum(axis=-1)
    has_tokens = tokens > 0
    per_seq = _masked(loss, mask).sum(axis=-1) / jnp.where(has_tokens, tokens, 1.0)
    return jnp.where(has_tokens, per_seq, 0.0).sum(), has_tokens.sum().astype(loss.dtype)


@register_loss_aggregation("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(loss: jax.Array, mask: jax.Array, *, max_completion_length: int):
    """Dr.GRPO: mean over sequences with >= 1 loss token of (token sum / max_completion_length)."""
    if not max_completion_length > 0:
        raise ValueError("seq_mean_token_sum_norm needs max_completion_length > 0, "
                         f"got {max_completion_length}")
    has_tokens = mask.sum(axis=-1) > 0
    numerator = _masked(loss, mask).sum() / max_completion_length
    return numerator, has_tokens.sum().astype(loss.dtype)


def aggregate_loss(loss: jax.Array, mask: jax.Array, mode: str, *,
                   max_completion_length: int = 0) -> jax.Array:
    """Scalar loss from per-token loss [N, T] and loss mask [N, T] with aggregation `mode`.

    Returns 0 when the mask selects nothing."""
    if loss.shape != mask.shape or loss.ndim != 2:
        raise ValueError(f"loss {loss.shape} and mask {mask.shape} must both be [N, T]")
    num, den = LOSS_AGGREGATIONS.get(mode)(loss, mask.astype(loss.dtype),
                                          max_completion_length=max_completion_length)
    return _safe_divide(num, den)


def aggregation_denominator(loss_mask: jax.Array, mode: str, *,
                            max_completion_length: int = 0) -> jax.Array:
    """The denominator `mode` uses for loss mask [N, T] (it depends on the mask only).

    For micro-batching, compute it once on the full batch's loss mask (completion mask times the
    zero-variance filter, see `loss_mask`) and pass it as `loss_denominator` to every micro-batch."""
    mask = jnp.asarray(loss_mask, jnp.float32)
    return LOSS_AGGREGATIONS.get(mode)(jnp.zeros_like(mask), mask,
                                       max_completion_length=max_completion_length)[1]


def loss_mask(completion_mask: jax.Array, rewards: jax.Array, group_size: int,
              cfg: ml_collections.ConfigDict) -> jax.Array:
    """float [N, T]: the tokens `grpo_loss` trains on (completion tokens of kept groups)."""
    keep = completion_mask > 0
    if cfg.filter_zero_variance_groups:
        grouped = group_rewards(jnp.asarray(rewards, jnp.float32), group_size)
        keep = keep & jnp.repeat(~zero_variance_groups(grouped, cfg.zero_variance_atol),
                                 group_size)[:, None]
    return keep.astype(jnp.float32)


def _safe_divide(num: jax.Array, den: jax.Array) -> jax.Array:
    return jnp.where(den > 0, num / jnp.where(den > 0, den, 1.0), 0.0)


# ----------------------------------------------------------------------------------------------
# KL estimators: per-token KL(pi || pi_ref) from log-probs of the sampled tokens
# ----------------------------------------------------------------------------------------------

@register_kl_estimator("k1")
def kl_k1(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """logp - ref (unbiased, high variance, can be negative)."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2")
def kl_k2(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """(logp - ref)^2 / 2 (biased, low variance, >= 0)."""
    return 0.5 * jnp.square(logprobs - ref_logprobs)


@register_kl_estimator("k3")
def kl_k3(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """exp(ref - logp) - (ref - logp) - 1 (unbiased, low variance, >= 0; Schulman's k3)."""
    d = ref_logprobs - logprobs
    return jnp.exp(d) - d - 1.0


@register_kl_estimator("low_var_kl")
def kl_low_var(logprobs: jax.Array, ref_logprobs: jax.Array) -> jax.Array:
    """k3 with verl's clamps: log-ratio clipped to [-20, 20], the estimate to [-10, 10]."""
    d = jnp.clip(ref_logprobs - logprobs, -20.0, 20.0)
    return jnp.clip(jnp.exp(d) - d - 1.0, -10.0, 10.0)


def kl_divergence(logprobs: jax.Array, ref_logprobs: jax.Array, estimator: str) -> jax.Array:
    """Per-token KL estimate, same shape as the inputs, by registered `estimator` name."""
    return KL_ESTIMATORS.get(estimator)(logprobs, ref_logprobs)


# ----------------------------------------------------------------------------------------------
# Behaviour weights: log w = log pi_prox - log mu [N, T] -> per-level log w -> bounded weight
# ----------------------------------------------------------------------------------------------

class BoundedWeight(NamedTuple):
    """What a behaviour-weight mode makes of log w [N, T].

    Attributes:
      weight: float32 [N, T] the weight W_t that multiplies the token's loss.
      high: bool [N, T] tokens whose w the upper bound changed (truncated or masked).
      low: bool [N, T] tokens whose w the lower bound changed (masked).
      masked: bool [N, T] tokens whose weight is 0 (they stay in the loss denominator).
    """

    weight: jax.Array
    high: jax.Array
    low: jax.Array
    masked: jax.Array


def tis_lower(cfg: ml_collections.ConfigDict) -> float:
    """The lower bound of ``behaviour_weight="mask"``: ``cfg.tis_lower``, or 1 / ``cfg.tis_cap``
    when it is None (0: no lower bound)."""
    lower = cfg.get("tis_lower")
    return 1.0 / cfg.tis_cap if lower is None else float(lower)


def _no_flags(log_w: jax.Array) -> jax.Array:
    return jnp.zeros(log_w.shape, bool)


@register_behaviour_weight("truncate")
def truncated_weight(log_w: jax.Array, *, cap: float, lower: float) -> BoundedWeight:
    """min(w, cap): truncated importance sampling (nothing is masked; ``lower`` is unused)."""
    del lower
    high = log_w > jnp.log(cap)
    return BoundedWeight(jnp.exp(jnp.minimum(log_w, jnp.log(cap))), high, _no_flags(log_w),
                         _no_flags(log_w))


@register_behaviour_weight("mask")
def masked_weight(log_w: jax.Array, *, cap: float, lower: float) -> BoundedWeight:
    """w where lower <= w <= cap, else 0 (masked importance sampling, MIS); masked tokens stay in
    the loss denominator. ``lower`` = 0: no lower bound."""
    high = log_w > jnp.log(cap)
    low = (log_w < jnp.log(lower)) if lower > 0 else _no_flags(log_w)
    masked = high | low
    return BoundedWeight(jnp.where(masked, 0.0, jnp.exp(log_w)), high, low, masked)


@register_behaviour_weight("none")
def plain_weight(log_w: jax.Array, *, cap: float, lower: float) -> BoundedWeight:
    """w: untruncated importance sampling (the bounds are unused)."""
    del cap, lower
    return BoundedWeight(jnp.exp(log_w), _no_flags(log_w), _no_flags(log_w), _no_flags(log_w))


@register_behaviour_weight_level("token")
def token_level(log_w: jax.Array, completion: jax.Array) -> jax.Array:
    """Each completion token's own log w [N, T] (0 elsewhere)."""
    return jnp.where(completion, log_w, 0.0)


@register_behaviour_weight_level("sequence")
def sequence_level(log_w: jax.Array, completion: jax.Array) -> jax.Array:
    """The sum of log w over the row's completion tokens (w = the product), on each of them."""
    total = jnp.where(completion, log_w, 0.0).sum(axis=-1, keepdims=True)
    return jnp.where(completion, total, 0.0)


@register_behaviour_weight_level("geometric")
def geometric_level(log_w: jax.Array, completion: jax.Array) -> jax.Array:
    """The mean of log w over the row's completion tokens (w = the geometric mean of the token
    weights), on each of them; length-normalised, so a long sequence's weight does not explode."""
    total = jnp.where(completion, log_w, 0.0).sum(axis=-1, keepdims=True)
    count = completion.sum(axis=-1, keepdims=True).astype(log_w.dtype)
    return jnp.where(completion, total / jnp.maximum(count, 1.0), 0.0)


def level_log_weight(cfg: ml_collections.ConfigDict, log_w: jax.Array,
                     completion: jax.Array) -> jax.Array:
    """Token log w [N, T] (nats) at ``cfg.behaviour_weight_level`` (0 off the completion tokens,
    not yet clamped)."""
    return BEHAVIOUR_WEIGHT_LEVELS.get(cfg.behaviour_weight_level)(log_w, completion)


def bounded_weight(cfg: ml_collections.ConfigDict, level: jax.Array,
                   completion: jax.Array) -> BoundedWeight:
    """The weight ``cfg.behaviour_weight`` makes of log w [N, T] at its level
    (`level_log_weight`): clamped to [-LOG_W_CLAMP, LOG_W_CLAMP], then bounded. A token the
    clamp changed counts as changed high / low too; flags are False off ``completion``."""
    clamped = jnp.clip(level, -LOG_W_CLAMP, LOG_W_CLAMP)
    b = BEHAVIOUR_WEIGHTS.get(cfg.behaviour_weight)(clamped, cap=cfg.tis_cap,
                                                    lower=tis_lower(cfg))
    return BoundedWeight(b.weight, (b.high | (level > LOG_W_CLAMP)) & completion,
                         (b.low | (level < -LOG_W_CLAMP)) & completion, b.masked & completion)


# ----------------------------------------------------------------------------------------------
# The clipped policy loss
# ----------------------------------------------------------------------------------------------

def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    return _safe_divide(jnp.where(mask, x, 0.0).sum(), mask.sum().astype(x.dtype))


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
        "offpolicy/ess": _safe_divide(jnp.square(_safe_divide(w_sum, n)),
                                      _safe_divide(w_sq_sum, n)),
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
    loss = _safe_divide(numerator, denominator)
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
