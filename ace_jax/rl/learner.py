"""The GRPO learner step: one jitted (and, given shardings, sharded) function.

``Learner.step(batch)`` does, inside one ``jax.jit``:

1. group-relative advantages and the zero-variance-group filter from the batch's rewards
   (over the whole batch, so neither minibatches nor microbatches change them), or the
   batch's own ``advantages`` when the host computed them (Reinforce-Ada's global baseline);
2. with ``grpo.minibatches`` = m > 1, the batch split into m minibatches (`microbatch_split`),
   one optimizer step each (PPO's minibatches); under ``grpo.proximal="learner"`` the proximal
   log-probs are computed once for the whole batch by a no-grad forward before the first
   minibatch, so from the second minibatch on r = pi_theta / pi_prox departs from 1 and the
   clip acts (with m = 1 there is no extra forward and r = 1);
3. per minibatch, gradient accumulation (``lax.scan`` over ``optim.microbatches`` row slices),
   every microbatch's numerator divided by the minibatch's aggregation denominator, so the
   accumulated gradient equals the minibatch's gradient for every aggregation mode;
4. global-norm clipping and AdamW with linear warmup and cosine decay (optax);
5. a non-finite guard per optimizer step: if the loss or the gradient norm is not finite the
   update is skipped, parameters and optimizer state stay bitwise intact, and it is counted in
   ``skipped``. ``LearnerState.step`` counts the optimizer steps taken (m per batch when none
   is skipped). With m > 1 the reported ``loss`` and ``grad_norm`` are the minibatches' means,
   ``learning_rate`` the one of the batch's first step, and the token measures cover the whole
   batch (each minibatch measured when its step is taken).

Master weights and optimizer state are kept in the model's ``param_dtype`` (fp32 by default); the
forward runs in ``model.config.dtype`` (bf16 optional), with remat per ``config.remat_policy``.
The router aux loss is added with ``optim.aux_loss_coef`` (0 by default for GRPO, as slime).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import optax
from flax import nnx

from ace_jax.rl import grpo
from ace_jax.rl.advantage_estimators import (compute_advantages, group_rewards,
                                             zero_variance_groups)
from ace_jax.rl.loss_aggregation import aggregation_denominator
from ace_jax.rl.rollout_batch import (completion_logprobs, DEFAULT_CHUNK_TOKENS, placed_on,
                                      TrainBatch)


def default_config() -> ml_collections.ConfigDict:
    """The ``optim`` section: optimizer, schedule, microbatching. The log-prob temperature is
    the sampler's (``sampling.temperature``), passed to `Learner.create` / `jit_learner_step`."""
    cfg = ml_collections.ConfigDict()
    cfg.learning_rate = 1e-5        # peak learning rate
    cfg.warmup_steps = 0            # linear warmup from 0 to the peak
    cfg.decay_steps = 1000          # cosine decay length after warmup (total schedule steps)
    cfg.end_lr_ratio = 0.1          # final lr = peak * end_lr_ratio
    cfg.weight_decay = 0.0
    cfg.b1 = 0.9
    cfg.b2 = 0.999
    cfg.eps = 1e-8
    cfg.max_grad_norm = 1.0         # global-norm clipping (<= 0 disables)
    cfg.microbatches = 1            # gradient accumulation steps per learner step
    cfg.aux_loss_coef = 0.0         # router load-balancing loss coefficient
    cfg.logprob_chunk_tokens = DEFAULT_CHUNK_TOKENS  # completion positions per lm_head chunk:
    #                                 the fp32 [rows, M, vocab] logits are never formed whole
    # Run each group's prompt once per microbatch, not once per row (its completions attend to
    # one KV cache, as in sampling): the same values, a fraction of the prompt work. Needs
    # aux_loss_coef = 0 (the router statistics then come from two calls).
    cfg.share_prompts = False
    # How microbatches hold the groups when prompts are shared (`microbatch_split`): "groups":
    # whole groups (each prompt runs once; the groups must divide by microbatches);
    # "within_groups": G / microbatches rows of every group (each prompt runs once per
    # microbatch; for a device holding one group, as ace30b's 64 groups on 64 chips).
    cfg.prompt_split = "groups"
    return cfg


PROMPT_SPLITS = ("groups", "within_groups")


def check_share_prompts(cfg: ml_collections.ConfigDict, groups: int | None = None,
                        group_size: int | None = None) -> None:
    """ValueError when ``cfg.share_prompts`` is set with the router aux loss or an unknown
    ``cfg.prompt_split``, or (given the batch's ``groups`` and ``group_size``) when its
    microbatches cannot be made that way."""
    if not cfg.get("share_prompts", False):
        return
    split, k = cfg.get("prompt_split", "groups"), cfg.microbatches
    if split not in PROMPT_SPLITS:
        raise ValueError(f"optim.prompt_split must be one of {list(PROMPT_SPLITS)}, got {split!r}")
    if cfg.aux_loss_coef:
        raise ValueError(f"optim.share_prompts needs optim.aux_loss_coef = 0, got "
                         f"{cfg.aux_loss_coef}")
    if split == "groups" and groups is not None and groups % k:
        raise ValueError(f"optim.share_prompts makes microbatches of whole groups: {groups} "
                         f"groups are not divisible by optim.microbatches = {k}")
    if split == "within_groups" and group_size is not None and group_size % k:
        raise ValueError(f"optim.prompt_split='within_groups' splits every group: group size "
                         f"{group_size} is not divisible by optim.microbatches = {k}")


def split_mode(cfg: ml_collections.ConfigDict) -> str:
    """How `microbatch_split` splits the batch: "rows" (prompts not shared), or the
    ``prompt_split`` ("groups" / "within_groups")."""
    return cfg.get("prompt_split", "groups") if cfg.get("share_prompts", False) else "rows"


def prompt_rows(cfg: ml_collections.ConfigDict, group_size: int) -> int:
    """Rows per prompt in a microbatch: 1 (prompts not shared), G (whole groups) or G / k."""
    return {"rows": 1, "groups": group_size,
            "within_groups": group_size // cfg.microbatches}[split_mode(cfg)]

def make_optimizer(cfg: ml_collections.ConfigDict) -> tuple[optax.GradientTransformation,
                                                             optax.Schedule]:
    """AdamW with warmup + cosine decay and global-norm clipping; returns (optimizer, schedule)."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0 if cfg.warmup_steps else cfg.learning_rate, peak_value=cfg.learning_rate,
        warmup_steps=cfg.warmup_steps, decay_steps=max(cfg.decay_steps, cfg.warmup_steps + 1),
        end_value=cfg.learning_rate * cfg.end_lr_ratio)
    parts = []
    if cfg.max_grad_norm and cfg.max_grad_norm > 0:
        parts.append(optax.clip_by_global_norm(cfg.max_grad_norm))
    parts.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*parts), schedule


class LearnerState(NamedTuple):
    params: Any        # nnx.State of nnx.Param leaves (master weights)
    opt_state: Any     # optax state
    step: jax.Array    # int32 scalar: completed (not skipped) optimizer steps


class MissingReferenceLogprobsError(ValueError):
    """``grpo.beta > 0`` with a batch that carries no reference log-probs (``ref_logprobs``
    None, or all zero on the completion tokens: `rollout_batch.make_train_batch`'s filler when
    it was given none)."""


def minibatches(grpo_cfg: ml_collections.ConfigDict) -> int:
    """``grpo.minibatches``: optimizer steps per batch (1 when the key is absent)."""
    return int(grpo_cfg.get("minibatches", 1))


def check_minibatches(grpo_cfg: ml_collections.ConfigDict, optim_cfg: ml_collections.ConfigDict,
                      rows: int, group_size: int) -> None:
    """ValueError naming the knobs when a batch of ``rows`` rows (groups of ``group_size``)
    cannot be split into ``grpo.minibatches`` minibatches of ``optim.microbatches``
    microbatches each (for ``optim.share_prompts``: `check_share_prompts` per minibatch)."""
    m, k = minibatches(grpo_cfg), optim_cfg.microbatches
    if rows % (m * k):
        raise ValueError(f"batch of {rows} rows is not divisible by grpo.minibatches x "
                         f"optim.microbatches = {m} x {k}")
    if rows % group_size:
        raise ValueError(f"batch of {rows} rows is not divisible by group_size={group_size}")
    groups = rows // group_size
    split = split_mode(optim_cfg)
    if split == "groups" and groups % m:
        raise ValueError(f"optim.share_prompts makes minibatches of whole groups: {groups} "
                         f"groups are not divisible by grpo.minibatches = {m}")
    if split == "within_groups" and group_size % m:
        raise ValueError(f"optim.prompt_split='within_groups' splits every group: group size "
                         f"{group_size} is not divisible by grpo.minibatches = {m}")
    check_share_prompts(optim_cfg, groups // m if split == "groups" else groups,
                        group_size // m if split == "within_groups" else group_size)


@jax.jit
def _has_reference(ref_logprobs: jax.Array, completion_mask: jax.Array) -> jax.Array:
    return jnp.any((ref_logprobs != 0) & (completion_mask > 0))


def check_reference_logprobs(grpo_cfg: ml_collections.ConfigDict, batch: TrainBatch) -> None:
    """`MissingReferenceLogprobsError` when ``grpo.beta > 0`` and ``batch`` carries no reference
    log-probs. The learner keeps no reference model: the KL term's log-probs come only with the
    batch, so the check is made on each batch (one scalar read back, only when beta > 0). All
    zeros on the completion tokens counts as none: a reference policy never gives every sampled
    token probability 1."""
    if not grpo_cfg.beta:
        return
    if batch.ref_logprobs is None or not bool(_has_reference(batch.ref_logprobs,
                                                             batch.completion_mask)):
        raise MissingReferenceLogprobsError(
            f"grpo.beta={grpo_cfg.beta:g} needs reference log-probs in the batch "
            "(TrainBatch.ref_logprobs), but it carries none (None or all zero on the completion "
            "tokens); the learner keeps no reference model: pass ref_logprobs to "
            "make_train_batch, or use grpo.beta=0")


def jit_learner_step(graphdef, grpo_cfg, optim_cfg, group_size: int, placement=None,
                     params: Any = None, *, temperature: float = 1.0):
    """THE jitted GRPO update ``(LearnerState, TrainBatch) -> (LearnerState, metrics)`` that the
    trainer runs and the dry run compiles (donates its state).

    ``temperature``: the sampler's (``sampling.temperature``; 0 = greedy counts as 1): the
    policy's log-probs are recomputed at it, as the behaviour log-probs were recorded.

    With a `placement.Placement` (and the Param state ``params``, arrays or abstract, to read the
    shardings from) the state's in / out shardings are pinned to the placement's; the batch keeps
    the sharding it arrives with (`Learner.step` places it by the 'batch' rule).

    Raises ValueError for ``optim.share_prompts`` with the router aux loss
    (`check_share_prompts`)."""
    check_share_prompts(optim_cfg)
    tx, schedule = make_optimizer(optim_cfg)
    step_fn = functools.partial(_learner_step, graphdef, tx, schedule, grpo_cfg, optim_cfg,
                                group_size, float(temperature))
    if placement is None:
        return jax.jit(step_fn, donate_argnums=(0,))
    state_sh = state_shardings(placement, params, optim_cfg)
    return jax.jit(step_fn, donate_argnums=(0,), in_shardings=(state_sh, None),
                   out_shardings=(state_sh, None))


def state_shardings(placement: Any, params: Any, optim_cfg: ml_collections.ConfigDict
                    ) -> LearnerState:
    """Shardings of a ``LearnerState`` laid out by ``placement`` (a `placement.Placement`) for
    the optimizer of ``optim_cfg``; ``params``: the Param state (arrays or abstract)."""
    params = params if isinstance(params, nnx.State) else nnx.state(params, nnx.Param)
    tx, _ = make_optimizer(optim_cfg)
    return LearnerState(placement.params(params), placement.optimizer_state(tx, params),
                        jax.sharding.NamedSharding(placement.mesh, jax.sharding.PartitionSpec()))


@dataclasses.dataclass
class Learner:
    """Owns the policy's parameters and optimizer state and runs GRPO updates.

    Attributes:
      graphdef: the policy's static structure (``nnx.split``).
      state: ``LearnerState``.
      grpo_cfg / optim_cfg: the ``grpo`` and ``optim`` config sections.
      temperature: the sampler's temperature (``sampling.temperature``), see `jit_learner_step`.
      placement: None (one device, or wherever the params live) or the `placement.Placement`
        whose shardings the state keeps and whose 'batch' rule splits the batch rows.
    """

    graphdef: Any
    state: LearnerState
    grpo_cfg: ml_collections.ConfigDict
    optim_cfg: ml_collections.ConfigDict
    group_size: int
    placement: Any = None
    temperature: float = 1.0

    @classmethod
    def create(cls, model: nnx.Module, grpo_cfg, optim_cfg, *, group_size: int,
               placement: Any = None, temperature: float = 1.0) -> "Learner":
        """Builds the learner from a policy module (its current parameters are the start). With
        a ``placement`` the parameters and the optimizer state are laid out by its rules (the
        optimizer state is created in place, never replicated first)."""
        grpo.validate_config(grpo_cfg)
        graphdef, params = nnx.split(model, nnx.Param)
        tx, _ = make_optimizer(optim_cfg)
        if placement is None:
            # The step donates its state: own a copy, so the caller's module stays usable.
            params = jax.tree.map(jnp.copy, params)
            state = LearnerState(params, tx.init(params), jnp.zeros((), jnp.int32))
        else:
            state_sh = state_shardings(placement, params, optim_cfg)
            state = jax.jit(lambda p: LearnerState(jax.tree.map(jnp.copy, p), tx.init(p),
                                                   jnp.zeros((), jnp.int32)),
                            out_shardings=state_sh)(params)
        learner = cls(graphdef, state, grpo_cfg, optim_cfg, group_size, placement,
                      float(temperature))
        learner._step = jit_learner_step(graphdef, grpo_cfg, optim_cfg, group_size, placement,
                                         params, temperature=temperature)
        return learner

    @property
    def params(self):
        return self.state.params

    def model(self) -> nnx.Module:
        """A module view of the current parameters (e.g. for evaluation)."""
        return nnx.merge(self.graphdef, self.state.params)

    def step(self, batch: TrainBatch) -> dict[str, jax.Array]:
        """One GRPO update on ``batch`` (``grpo.minibatches`` optimizer steps); returns the
        step's metrics (device scalars).

        Raises ValueError when the batch does not split into the minibatches and microbatches
        (`check_minibatches`), and `MissingReferenceLogprobsError` when ``grpo.beta > 0`` and
        the batch carries no reference log-probs (`check_reference_logprobs`)."""
        n = batch.input_ids.shape[0]
        mb = self.optim_cfg.microbatches
        if n % mb:
            raise ValueError(f"batch of {n} rows is not divisible by optim.microbatches={mb}")
        check_minibatches(self.grpo_cfg, self.optim_cfg, n, self.group_size)
        check_reference_logprobs(self.grpo_cfg, batch)
        if self.placement is None:
            self.state, metrics = self._step(self.state, batch)
            return metrics
        if not placed_on(batch, self.placement.batch):   # built per shard already (trainer)
            batch = self.placement.place_batch(batch)
        with self.placement.context():
            self.state, metrics = self._step(self.state, batch)
        return metrics


def _microbatch_loss(graphdef, grpo_cfg, optim_cfg, temperature, group_size, params,
                     mb: TrainBatch, advantages, sequence_mask, proximal, loss_denominator):
    """This microbatch's share of its minibatch's loss (its numerator over the minibatch's
    denominator), plus its share of the router aux loss. ``group_size``: rows per group in the
    minibatch; ``proximal``: float32 [rows, M] log-probs before the update, or None (the theta
    pass's own, detached)."""
    model = nnx.merge(graphdef, params)
    replay = grpo_cfg.routing_replay == "R3"
    logprobs, entropy, aux, routes = completion_logprobs(
        model, mb, temperature,
        chunk_tokens=optim_cfg.get("logprob_chunk_tokens", DEFAULT_CHUNK_TOKENS),
        group_size=prompt_rows(optim_cfg, group_size), replay_routes=replay,
        return_route_stats=True)
    loss, metrics = grpo.clipped_policy_loss(
        grpo_cfg, logprobs=logprobs, behaviour_logprobs=mb.behaviour_logprobs,
        advantages=advantages, completion_mask=mb.completion_mask, sequence_mask=sequence_mask,
        proximal_logprobs=proximal,
        ref_logprobs=mb.ref_logprobs if grpo_cfg.beta else None, entropy=entropy,
        loss_denominator=loss_denominator)
    total = loss + optim_cfg.aux_loss_coef * aux / optim_cfg.microbatches
    metrics["aux_loss"] = aux
    if routes is not None:   # the sampler recorded its MoE routes
        disagree = routes.disagree / jnp.maximum(routes.records, 1.0)
        metrics["route_records"] = routes.records
        metrics["offpolicy/router_disagreement_frac"] = disagree
        # what this pass dispatched vs the record: the record itself under replay
        metrics["offpolicy/routing_mismatch_frac"] = jnp.zeros_like(disagree) if replay else disagree
    return total, metrics


def _learner_step(graphdef, tx, schedule, grpo_cfg, optim_cfg, group_size, temperature,
                  state: LearnerState, batch: TrainBatch):
    n = batch.input_ids.shape[0]
    m = minibatches(grpo_cfg)
    grouped = group_rewards(batch.rewards, group_size)
    advantages = (compute_advantages(grouped, grpo_cfg).reshape(n)
                  if batch.advantages is None else batch.advantages)   # the host's (Reinforce-Ada)
    zero_var = zero_variance_groups(grouped, grpo_cfg.zero_variance_atol)
    if grpo_cfg.filter_zero_variance_groups:
        sequence_mask = jnp.repeat(~zero_var, group_size)
    else:
        sequence_mask = jnp.ones((n,), bool)
    split = split_mode(optim_cfg)
    # Rows per group inside a minibatch ("within_groups" gives each minibatch G / m of each).
    mini_group = group_size // m if split == "within_groups" else group_size
    mini = jax.tree.map(functools.partial(microbatch_split, k=m, group_size=group_size,
                                          split=split), (batch, advantages, sequence_mask))
    update = functools.partial(_minibatch_update, graphdef, tx, grpo_cfg, optim_cfg, mini_group,
                               temperature)
    start = state.step
    if m == 1:
        state, out = update(state, jax.tree.map(lambda x: x[0], mini) + (None,))
        out = jax.tree.map(lambda x: x[None], out)
    else:
        proximal = None
        if grpo_cfg.proximal == "learner":   # pi_prox: the parameters before the first step
            proximal = _proximal_logprobs(graphdef, grpo_cfg, optim_cfg, mini_group,
                                          temperature, state.params, mini[0])
        state, out = jax.lax.scan(update, state, mini + (proximal,))
    micro_metrics, losses, grad_norms, finite = out    # [m, k] metrics; [m] the rest
    micro_metrics = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), micro_metrics)

    metrics = _reduce_micro_metrics(micro_metrics)
    metrics.update(
        loss=jnp.mean(losses), grad_norm=jnp.mean(grad_norms),
        skipped=m - jnp.sum(finite.astype(jnp.int32)),
        learning_rate=schedule(start),
        frac_zero_variance_groups=zero_var.mean(dtype=jnp.float32),
        reward_mean=batch.rewards.mean(), reward_std=batch.rewards.std(),
        advantage_abs_mean=jnp.abs(advantages).mean(),
        tokens=jnp.sum(batch.attention_mask).astype(jnp.float32))
    return state, metrics


def _proximal_logprobs(graphdef, grpo_cfg, optim_cfg, group_size, temperature, params,
                       mini: TrainBatch) -> jax.Array:
    """float32 [m, k, rows, M]: the completion log-probs of every microbatch of every minibatch
    (``mini``: the minibatches [m, N / m, ...]) under ``params``, by a forward without gradient
    (its memory is a forward's; laid out as `_minibatch_update` splits each minibatch)."""
    k = optim_cfg.microbatches
    params = jax.lax.stop_gradient(params)
    split = functools.partial(microbatch_split, k=k, group_size=group_size,
                              split=split_mode(optim_cfg))

    def micro(_, mb):
        model = nnx.merge(graphdef, params)
        lp, _, _ = completion_logprobs(
            model, mb, temperature,
            chunk_tokens=optim_cfg.get("logprob_chunk_tokens", DEFAULT_CHUNK_TOKENS),
            group_size=prompt_rows(optim_cfg, group_size),
            replay_routes=grpo_cfg.routing_replay == "R3")
        return None, jax.lax.stop_gradient(lp)

    def minibatch(_, mb):
        return jax.lax.scan(micro, None, jax.tree.map(split, mb))

    return jax.lax.scan(minibatch, None, mini)[1]


def _minibatch_update(graphdef, tx, grpo_cfg, optim_cfg, group_size, temperature,
                      state: LearnerState, xs):
    """One optimizer step on one minibatch: ``xs`` = (TrainBatch rows, advantages [rows],
    sequence mask [rows], proximal log-probs [k, rows / k, M] or None); ``group_size``: rows
    per group in it. Returns (new state, (microbatch metrics [k], loss, grad norm, finite))."""
    batch, advantages, sequence_mask, proximal = xs
    k = optim_cfg.microbatches
    keep = batch.completion_mask * sequence_mask[:, None].astype(jnp.float32)
    micro = jax.tree.map(functools.partial(microbatch_split, k=k, group_size=group_size,
                                           split=split_mode(optim_cfg)),
                         (batch, advantages, sequence_mask))
    # One denominator for the whole minibatch: the microbatch losses then sum to its loss.
    den_total = aggregation_denominator(
        keep, grpo_cfg.loss_agg_mode, max_completion_length=grpo_cfg.max_completion_length)

    grad_fn = jax.value_and_grad(
        lambda p, mb, adv, sm, prox: _microbatch_loss(graphdef, grpo_cfg, optim_cfg, temperature,
                                                      group_size, p, mb, adv, sm, prox,
                                                      den_total),
        has_aux=True)

    def accumulate(carry, xs):
        grads, loss = carry
        mb, adv, sm, prox = xs
        (l, metrics), g = grad_fn(state.params, mb, adv, sm, prox)
        grads = jax.tree.map(jnp.add, grads, g)
        return (grads, loss + l), metrics

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grads, loss), micro_metrics = jax.lax.scan(accumulate, (zeros, jnp.zeros((), jnp.float32)),
                                                micro + (proximal,))
    grad_norm = optax.global_norm(grads)
    updates, new_opt = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep_old = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_state = LearnerState(keep_old(new_params, state.params), keep_old(new_opt, state.opt_state),
                             state.step + finite.astype(jnp.int32))
    return new_state, (micro_metrics, loss, grad_norm, finite)


def microbatch_split(x: jax.Array, *, k: int, group_size: int, split: str = "rows") -> jax.Array:
    """[N, ...] rows (groups of G consecutive rows) -> [k, N / k, ...] microbatches.

    ``split`` "rows": microbatch i takes rows i, k + i, 2k + i, ...; "groups": groups i, k + i,
    2k + i, ..., each group's G rows together and in order; "within_groups": rows
    [i G/k, (i+1) G/k) of every group, together and in order. With the rows split over devices
    in contiguous blocks (the 'batch' rule) every device keeps its own rows in every microbatch,
    so the split moves no data ("groups": when each device holds a multiple of k groups;
    "within_groups": when it holds whole groups). Advantages are computed before the split, so
    row order is free."""
    n = x.shape[0]
    if split == "within_groups":
        x = x.reshape((n // group_size, k, group_size // k) + x.shape[1:])
    else:
        unit = group_size if split == "groups" else 1
        x = x.reshape((n // (k * unit), k, unit) + x.shape[1:])
    return jnp.swapaxes(x, 0, 1).reshape((k, n // k) + x.shape[3:])


def _reduce_micro_metrics(micro: dict[str, jax.Array]) -> dict:
    """Combines per-microbatch metrics [k] into batch values (token-weighted means, max, sums)."""
    w_keep = micro["num_tokens"]
    w_comp = micro["num_completion_tokens"]
    wmean = lambda x, w: jnp.sum(x * w) / jnp.maximum(jnp.sum(w), 1.0)
    out = {}
    for name, x in micro.items():
        if name in ("num_tokens", "num_completion_tokens", "route_records"):
            out[name] = jnp.sum(x)
        elif name in ("offpolicy/router_disagreement_frac", "offpolicy/routing_mismatch_frac"):
            out[name] = wmean(x, micro["route_records"])
        elif name in ("logprob_diff_max_abs", "offpolicy/behaviour_weight_max"):
            out[name] = jnp.max(x)
        elif name == "offpolicy/behaviour_weight_min":   # over microbatches with tokens
            low = jnp.min(jnp.where(w_comp > 0, x, jnp.inf))
            out[name] = jnp.where(jnp.isfinite(low), low, 0.0)
        elif name == "offpolicy/ess":   # (sum w)^2 / (n sum w^2) of the whole batch
            tokens = jnp.maximum(jnp.sum(w_comp), 1.0)
            mean_w = jnp.sum(micro["behaviour_weight_sum"]) / tokens
            mean_w2 = jnp.sum(micro["behaviour_weight_sq_sum"]) / tokens
            out[name] = jnp.where(mean_w2 > 0, jnp.square(mean_w) / jnp.where(mean_w2 > 0,
                                                                               mean_w2, 1.0), 0.0)
        elif name in ("behaviour_weight_sum", "behaviour_weight_sq_sum"):
            continue                                     # consumed by offpolicy/ess
        elif name in ("clip_frac_low", "clip_frac_high", "ratio_mean", "kl",
                      "offpolicy/clip_frac", "offpolicy/masked_frac"):   # over loss tokens
            out[name] = wmean(x, w_keep)
        elif name == "aux_loss":
            out[name] = jnp.mean(x)
        else:  # logprob_diff_mean, entropy, offpolicy/behaviour_weight_mean, offpolicy/mismatch_k3,
            out[name] = wmean(x, w_comp)  # offpolicy/truncated_frac*: over completion tokens
    return out
