"""Learnability Potential (LP): the jitted state scorer, its schedule, cooling, and the samplers.

Our definition (DESIGN.md; the paper's exact formula is not public, every constant is config):

  u(x)   = std(rewards of x's latest group) / r_scale          (a prior if x has no group yet:
           u0, or with ``prior="parent"`` shrink*u0 + (1-shrink)*std(group that created x)/r_scale)
  h(x)   = clip((gold - best(x)) / (gold - median), 0, 1)      (direction-aware; in StateStats)
  LP(x)  = u(x)^alpha * h(x)^beta
  p_t(x) ∝ exp(LP(x) / T_t) * cool_t(x),  restricted to the top rho_t fraction of valid states by LP
  cool_t(x) = 1 - exp(-(t - last_sampled(x)) / tau)           (1 if never sampled)

A batch holds at most floor(max_child_frac * B) child states (depth >= 1) while roots are left to
draw: the draw stops taking children once that many are in (children past the cap fill the batch
only when too few roots are selectable), and the top-rho restriction is taken within roots and
within children apart, so that the reserved roots stay selectable. 1.0 = no cap.

T_t and rho_t stay at their start values for ``explore_steps``, then move geometrically to their
end values over ``anneal_steps``. A batch is drawn WITHOUT replacement by Gumbel-top-k on log p
(exactly sampling the Plackett-Luce / successive-sampling distribution), deterministic for a key.

A sampler variant is a function ``ConfigDict -> SamplerSpec`` registered in ``SAMPLERS`` (an
``ace_jax.registry.Registry``; ``register_sampler``):
``lp``, ``uniform``, ``lp_no_cooling``, ``variance_only``, ``headroom_only``.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ace_jax import config_utils
from ace_jax.curriculum import state_stats
from ace_jax.registry import Registry

LP_FIELDS = ("valid", "visits", "last_sampled", "reward_var", "headroom", "prior_std")
PRIORS = ("constant", "parent")


class InsufficientStatesError(ValueError):
    """Fewer selectable states than the requested batch (and repeats are not allowed)."""


def default_config() -> ml_collections.ConfigDict:
    """The ``lp`` config section (every LP constant lives here)."""
    c = ml_collections.ConfigDict()
    c.sampler = "lp"             # a name in SAMPLERS
    c.u0 = 1.0                   # uncertainty prior of a state without a group yet
    # "constant": an unvisited state has u = u0. "parent": u = shrink * u0 + (1 - shrink) *
    # std(the group that created it) / r_scale (roots: u0), i.e. children of a zero-variance
    # group start less promising than children of a mixed group.
    c.prior = "parent"
    c.prior_shrink = 0.25
    c.alpha = 1.0                # exponent of u
    c.beta = 1.0                 # exponent of h
    c.r_scale = 0.5              # reward units: u = std / r_scale
    c.tau = 2.0                  # cooling time constant, RL steps
    c.temperature_start = 1.0    # T during exploration (LP units)
    c.temperature_end = 0.05     # T at the end of the anneal
    c.rho_start = 1.0            # fraction of valid states eligible during exploration
    c.rho_end = 0.05             # fraction eligible at the end of the anneal (top few percent)
    c.explore_steps = 20         # steps at the start values
    c.anneal_steps = 100         # steps of geometric anneal to the end values
    c.allow_repeats = False      # fewer eligible states than the batch: error (False) or draw with replacement
    # At most this share of a batch on child states (depth >= 1) while roots are selectable; the
    # rest are drafts of the tasks. 1.0 = no cap (children compete with roots on LP alone).
    c.max_child_frac = 1.0
    c.seed = 0                   # sampler RNG seed (a run's config: -1 = the run's seed)
    return c


@dataclasses.dataclass(frozen=True)
class SamplerSpec:
    """Static description of one sampler (hashable: a jit static argument)."""

    kind: str = "lp"             # "lp" (scored) or "uniform"
    use_variance: bool = True
    use_headroom: bool = True
    use_cooling: bool = True
    u0: float = 1.0
    prior: str = "parent"
    prior_shrink: float = 0.25
    alpha: float = 1.0
    beta: float = 1.0
    r_scale: float = 0.5
    tau: float = 2.0
    temperature_start: float = 1.0
    temperature_end: float = 0.05
    rho_start: float = 1.0
    rho_end: float = 0.05
    explore_steps: int = 20
    anneal_steps: int = 100
    allow_repeats: bool = False
    max_child_frac: float = 1.0

    def __post_init__(self):
        if self.kind not in ("lp", "uniform"):
            raise ValueError(f"SamplerSpec.kind must be 'lp' or 'uniform', got {self.kind!r}")
        if self.prior not in PRIORS:
            raise ValueError(f"lp.prior must be one of {PRIORS}, got {self.prior!r}")
        if not 0 <= self.prior_shrink <= 1:
            raise ValueError(f"lp.prior_shrink must be in [0, 1], got {self.prior_shrink}")
        for name in ("r_scale", "tau", "temperature_start", "temperature_end"):
            if not getattr(self, name) > 0:
                raise ValueError(f"lp.{name} must be > 0, got {getattr(self, name)}")
        for name in ("rho_start", "rho_end"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"lp.{name} must be in (0, 1], got {getattr(self, name)}")
        if not 0 <= self.max_child_frac <= 1:
            raise ValueError(f"lp.max_child_frac must be in [0, 1], got {self.max_child_frac}")
        for name in ("u0", "alpha", "beta"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"lp.{name} must be >= 0, got {getattr(self, name)}")
        if self.explore_steps < 0 or self.anneal_steps < 0:
            raise ValueError("lp.explore_steps and lp.anneal_steps must be >= 0")

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict, **overrides) -> "SamplerSpec":
        kw = {f.name: cfg[f.name] for f in dataclasses.fields(cls) if f.name in cfg}
        kw.update(overrides)
        return cls(**kw)


# ---------------------------------------------------------------------------- registry
SAMPLERS: Registry[Callable[[ml_collections.ConfigDict], SamplerSpec]] = Registry("sampler")


def register_sampler(name: str):
    """Decorator: registers ``fn(lp_config) -> SamplerSpec`` under ``name`` (taken: ValueError)."""
    return SAMPLERS.register(name)


@register_sampler("lp")
def _lp(cfg):
    return SamplerSpec.from_config(cfg)


@register_sampler("uniform")
def _uniform(cfg):
    return SamplerSpec.from_config(cfg, kind="uniform", use_cooling=False)


@register_sampler("lp_no_cooling")
def _lp_no_cooling(cfg):
    return SamplerSpec.from_config(cfg, use_cooling=False)


@register_sampler("variance_only")
def _variance_only(cfg):
    return SamplerSpec.from_config(cfg, use_headroom=False)


@register_sampler("headroom_only")
def _headroom_only(cfg):
    return SamplerSpec.from_config(cfg, use_variance=False)


def get_spec(cfg: ml_collections.ConfigDict, name: Optional[str] = None) -> SamplerSpec:
    """The ``SamplerSpec`` of sampler ``name`` (default ``cfg.sampler``); an unknown name raises
    ``UnknownNameError`` (a KeyError) listing the registered samplers."""
    return SAMPLERS.get(name or cfg.sampler)(cfg)


# ---------------------------------------------------------------------------- scorer (pure jnp)
def schedule(step, spec: SamplerSpec):
    """(T_t, rho_t) at RL step ``step`` (scalars, float32)."""
    step = jnp.asarray(step, jnp.float32)
    f = jnp.clip((step - spec.explore_steps) / max(spec.anneal_steps, 1), 0.0, 1.0)
    if spec.anneal_steps == 0:
        f = (step >= spec.explore_steps).astype(jnp.float32)
    temp = spec.temperature_start * (spec.temperature_end / spec.temperature_start) ** f
    rho = spec.rho_start * (spec.rho_end / spec.rho_start) ** f
    return temp, rho


def potential(stats: Mapping[str, Any], spec: SamplerSpec) -> jax.Array:
    """LP(x) = u^alpha * h^beta per slot, float32[N] (0 for empty slots)."""
    visited = jnp.asarray(stats["visits"]) > 0
    std = jnp.sqrt(jnp.maximum(jnp.asarray(stats["reward_var"], jnp.float32), 0.0))
    if spec.prior == "parent":
        pstd = jnp.asarray(stats["prior_std"], jnp.float32)
        prior = jnp.where(jnp.isnan(pstd), spec.u0,
                          spec.prior_shrink * spec.u0 + (1 - spec.prior_shrink) * pstd / spec.r_scale)
    else:
        prior = jnp.full_like(std, spec.u0)
    u = jnp.where(visited, std / spec.r_scale, prior)
    h = jnp.clip(jnp.asarray(stats["headroom"], jnp.float32), 0.0, 1.0)
    lp = jnp.ones_like(u)
    if spec.use_variance:
        lp = lp * u ** spec.alpha
    if spec.use_headroom:
        lp = lp * h ** spec.beta
    return jnp.where(jnp.asarray(stats["valid"]) & jnp.isfinite(lp), lp, 0.0)


def cooling(stats: Mapping[str, Any], step, spec: SamplerSpec) -> jax.Array:
    """cool(x) = 1 - exp(-(t - last_sampled)/tau), 1 if never sampled; float32[N] in [0, 1]."""
    last = jnp.asarray(stats["last_sampled"], jnp.int32)
    dt = (jnp.asarray(step, jnp.int32) - last).astype(jnp.float32)
    c = -jnp.expm1(-jnp.maximum(dt, 0.0) / spec.tau)
    return jnp.where(last < 0, 1.0, c)


def _top_fraction_threshold(lp: jax.Array, valid: jax.Array, k: jax.Array) -> jax.Array:
    """Largest t with #{valid x: lp(x) >= t} >= k, exactly (requires lp >= 0 and k <= #valid).

    Radix select on the float bits (non-negative float32 bit patterns are ordered like their
    values): three histogram passes over 12, 12 and 8 bits, each narrowing to the bucket that
    holds the k-th largest value. O(3 N) instead of a sort. Returns a float32 scalar; all states
    tied at t are kept.
    """
    bits = jnp.where(valid, jax.lax.bitcast_convert_type(lp, jnp.int32), -1)
    prefix, need = jnp.int32(0), k.astype(jnp.int32)
    for shift, width in ((20, 12), (8, 12), (0, 8)):
        n_buckets = 1 << width
        if shift + width >= 31:
            in_bucket = bits >= 0
        else:
            high = ~((1 << (shift + width)) - 1)
            in_bucket = (bits >= 0) & ((bits & high) == prefix)
        key = jnp.where(in_bucket, (bits >> shift) & (n_buckets - 1), n_buckets)
        hist = jnp.zeros(n_buckets, jnp.int32).at[key].add(1, mode="drop")
        at_least = jnp.cumsum(hist[::-1])[::-1]          # at_least[b] = #{key >= b}
        b = jnp.sum(at_least >= need).astype(jnp.int32) - 1  # largest b with at_least[b] >= need
        above = jnp.where(b + 1 < n_buckets, at_least[jnp.minimum(b + 1, n_buckets - 1)], 0)
        need = need - above
        prefix = prefix | (b << shift)
    return jax.lax.bitcast_convert_type(prefix, jnp.float32)


def _child_cap(spec: SamplerSpec, batch_size: int) -> int:
    """The most children a batch of ``batch_size`` may hold while roots are selectable:
    floor(max_child_frac * batch_size) (``batch_size`` or more: no cap)."""
    return int(spec.max_child_frac * batch_size)


def _is_root(stats) -> jax.Array:
    """bool[N]: the slot holds (or would hold) a root, a state without a creating group
    (``prior_std`` NaN, depth 0)."""
    return jnp.isnan(jnp.asarray(stats["prior_std"], jnp.float32))


def _top_rho(lp: jax.Array, pool: jax.Array, rho: jax.Array, keep) -> jax.Array:
    """The states of ``pool`` (bool[N]) in its top ``rho`` fraction by ``lp``, at least ``keep``
    of them (all of the pool if it has fewer); bool[N]. Ties at the threshold are all kept."""
    n = jnp.sum(pool)
    k = jnp.minimum(jnp.maximum(jnp.ceil(rho * n).astype(jnp.int32), keep), n)
    thr = jax.lax.cond(k >= n, lambda: jnp.float32(0.0),  # exploration: no restriction
                       lambda: _top_fraction_threshold(lp, pool, jnp.maximum(k, 1)))
    return pool & (lp >= thr)


def logits(stats: Mapping[str, Any], step, spec: SamplerSpec, min_keep: int = 1) -> jax.Array:
    """Unnormalised log p_t(x) per slot, float32[N]; -inf where ineligible.

    ``min_keep``: the top-rho set keeps at least this many states (the batch size), so the
    restriction never leaves fewer candidates than the batch needs. With a child cap
    (``max_child_frac`` < 1), roots and children are two pools, each restricted to its own top
    rho fraction and keeping at least its share of the batch (``min_keep - cap`` roots, ``cap``
    children, more of one pool where the other is too small), so the roots the cap reserves room
    for stay selectable however the children's LP compares with theirs.
    """
    valid = jnp.asarray(stats["valid"])
    if spec.kind == "uniform":
        logit = jnp.where(valid, 0.0, -jnp.inf)
    else:
        lp = potential(stats, spec)
        temp, rho = schedule(step, spec)
        cap = _child_cap(spec, min_keep)
        if cap >= min_keep:
            allowed = _top_rho(lp, valid, rho, min_keep)
        else:
            root = valid & _is_root(stats)
            child = valid & ~root
            n_root, n_child = jnp.sum(root), jnp.sum(child)
            allowed = (_top_rho(lp, root, rho, jnp.maximum(min_keep - cap, min_keep - n_child))
                       | _top_rho(lp, child, rho, jnp.maximum(cap, min_keep - n_root)))
        logit = jnp.where(allowed, lp / temp, -jnp.inf)
    if spec.use_cooling:
        logit = logit + jnp.log(cooling(stats, step, spec))
    return logit.astype(jnp.float32)


def log_probs(stats: Mapping[str, Any], step, spec: SamplerSpec, min_keep: int = 1) -> jax.Array:
    """log p_t(x) per slot, float32[N], normalised over eligible slots; -inf where ineligible."""
    logit = logits(stats, step, spec, min_keep)
    m = jnp.max(logit)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.exp(logit - m))
    lse = m + jnp.log(jnp.where(total > 0, total, 1.0))
    return logit - lse


@functools.partial(jax.jit, static_argnames=("spec", "min_keep"))
def probabilities(stats, step, spec: SamplerSpec, min_keep: int = 1) -> jax.Array:
    """p_t(x) per slot, float32[N] (sums to 1 over eligible slots)."""
    return jnp.exp(log_probs(stats, step, spec, min_keep))


@functools.partial(jax.jit, static_argnames=("spec", "batch_size"))
def select_slots(key, stats, step, spec: SamplerSpec, batch_size: int):
    """Gumbel-top-k: ``batch_size`` distinct slots ~ p_t without replacement.

    Returns (slots int32[batch_size], n_eligible int32[]); when n_eligible < batch_size the tail
    of ``slots`` is meaningless and the caller must not use it (``Sampler.select`` checks).
    """
    logit = logits(stats, step, spec, batch_size)  # top-k is invariant to the normaliser
    g = jax.random.gumbel(key, logit.shape, jnp.float32)
    score = _cap_children(logit + g, stats, spec, batch_size)
    _, idx = jax.lax.top_k(score, batch_size)
    return idx.astype(jnp.int32), jnp.sum(jnp.isfinite(logit)).astype(jnp.int32)


def _cap_children(score: jax.Array, stats, spec: SamplerSpec, batch_size: int) -> jax.Array:
    """Perturbed scores (float32[N]) reordered so that top-``batch_size`` takes at most
    ``c = floor(max_child_frac * batch_size)`` children while roots remain.

    Gumbel-top-k is sequential sampling without replacement in score order; stopping to take
    children once c are in keeps the c best-scored children and every root in that order, and
    moves the other children below the lowest finite score (their own order kept), so they are
    drawn only after every selectable root.
    """
    cap = _child_cap(spec, batch_size)
    if cap >= batch_size:
        return score
    child = ~_is_root(stats)
    if cap > 0:
        kth = jax.lax.top_k(jnp.where(child, score, -jnp.inf), cap)[0][-1]
        over = child & (score < kth)
    else:
        over = child
    finite = jnp.isfinite(score)
    hi = jnp.max(jnp.where(finite, score, -jnp.inf))
    lo = jnp.min(jnp.where(finite, score, jnp.inf))
    shift = jnp.where(jnp.any(finite), hi - lo + 1.0, 0.0)
    return jnp.where(over & finite, score - shift, score)


@functools.partial(jax.jit, static_argnames=("spec", "batch_size"))
def _select_with_repeats(key, stats, step, spec: SamplerSpec, batch_size: int):
    logp = log_probs(stats, step, spec, batch_size)
    return jax.random.categorical(key, logp, shape=(batch_size,)).astype(jnp.int32)


def lp_inputs(stats) -> dict[str, jax.Array]:
    """The arrays the scorer reads, from a ``buffer.StateStats`` (or a mapping), as jax arrays."""
    if isinstance(stats, Mapping):
        missing = [n for n in LP_FIELDS if n not in stats]
        get = stats.__getitem__
    else:
        missing = [n for n in LP_FIELDS if not hasattr(stats, n)]
        get = lambda n: getattr(stats, n)  # noqa: E731
    if missing:
        raise ValueError(f"LP statistics lack fields {missing} (need {LP_FIELDS})")
    out = {n: jnp.asarray(get(n)) for n in LP_FIELDS}
    shapes = {n: a.shape for n, a in out.items()}
    if len(set(shapes.values())) != 1 or len(out["valid"].shape) != 1:
        raise ValueError(f"LP statistics must be 1-D arrays of one length, got shapes {shapes}")
    return out


_jit_potential = jax.jit(potential, static_argnames=("spec",))


def pruning_potential(cfg: ml_collections.ConfigDict,
                      name: Optional[str] = None) -> state_stats.PotentialFn:
    """The buffer's pruning order for sampler ``name`` (default ``cfg.sampler``): a function
    ``StateStats -> float32[capacity]``, higher = keep, to pass as ``EvolvingBuffer``'s
    ``potential_fn`` so that pruning drops first the states selection would pick least.

    * A scored sampler (``lp``, ``lp_no_cooling``, ``variance_only``, ``headroom_only``): its own
      LP (``potential`` with its spec, jitted; 0 on empty slots). Temperature and the top-rho
      restriction are monotone in LP, so LP alone is selection's order; cooling is left out on
      purpose: it is transient (a just-sampled state is cool for ~tau steps, then as likely as
      its LP says), and pruning is permanent and already protects recently sampled states.
    * ``uniform``: ``state_stats.default_potential``. Uniform selection ranks no state above
      another, so any order is consistent with it; the sampler-agnostic proxy (reward spread x
      headroom) keeps informative states rather than a merely arbitrary set, and is what the
      buffer used before pruning followed the sampler (the uniform arm of the ablation keeps its
      behaviour).

    Host cost: one jitted call (compiled once per capacity) plus a device -> host copy.
    """
    spec = get_spec(cfg, name)
    if spec.kind == "uniform":
        return state_stats.default_potential

    def lp_pruning_potential(stats: state_stats.StateStats) -> np.ndarray:
        return np.asarray(_jit_potential(lp_inputs(stats), spec), dtype=np.float32)

    return lp_pruning_potential


class Sampler:
    """A registered sampler plus its RNG state; ``select`` returns buffer slots.

    The key is split once per ``select``; ``state_dict`` / ``load_state_dict`` persist it exactly,
    so every host (same seed, same calls) draws the same batch.
    """

    def __init__(self, spec: SamplerSpec, seed: int = 0):
        self.spec = spec
        self._key_data = np.asarray(jax.random.key_data(jax.random.key(seed)), dtype=np.uint32)
        self.calls = 0

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict, name: Optional[str] = None) -> "Sampler":
        return cls(get_spec(cfg, name), seed=config_utils.section_seed(cfg.seed, "lp.seed"))

    def _next_key(self):
        key = jax.random.wrap_key_data(jnp.asarray(self._key_data))
        key, sub = jax.random.split(key)
        self._key_data = np.asarray(jax.random.key_data(key), dtype=np.uint32)
        self.calls += 1
        return sub

    def select(self, stats, step: int, batch_size: int, data_parallel_size: int = 1, *,
               minimum: Optional[int] = None) -> np.ndarray:
        """``batch_size`` distinct slots (int64[batch_size]) for RL step ``step``; with
        ``minimum``, as many as are eligible when that is fewer, but at least ``minimum``
        (partial rollouts top the engine up with what there is).

        Raises ValueError if ``batch_size`` is not a positive multiple of ``data_parallel_size``
        and InsufficientStatesError if fewer states are eligible than the batch (or
        ``minimum``; unless ``allow_repeats``: then the batch is drawn with replacement from
        p_t).
        """
        if batch_size <= 0 or data_parallel_size <= 0 or batch_size % data_parallel_size:
            raise ValueError(f"batch_size ({batch_size}) must be a positive multiple of the "
                             f"data-parallel size ({data_parallel_size})")
        arrays = lp_inputs(stats)
        n = arrays["valid"].shape[0]
        if batch_size > n:
            raise InsufficientStatesError(f"batch_size {batch_size} exceeds buffer capacity {n}")
        key = self._next_key()
        idx, n_eligible = select_slots(key, arrays, jnp.int32(step), self.spec, batch_size)
        n_eligible = int(n_eligible)
        if n_eligible >= batch_size:
            return np.asarray(idx, dtype=np.int64)
        if minimum is not None and n_eligible >= minimum and not self.spec.allow_repeats:
            return np.asarray(idx[:n_eligible], dtype=np.int64)   # the eligible ones lead
        if self.spec.allow_repeats and n_eligible > 0:
            return np.asarray(_select_with_repeats(key, arrays, jnp.int32(step), self.spec, batch_size),
                              dtype=np.int64)
        raise InsufficientStatesError(
            f"only {n_eligible} selectable states (valid, not sampled at step {step}) for a batch "
            f"of {batch_size}; grow the buffer, shrink the batch or set lp.allow_repeats")

    def state_dict(self) -> dict[str, np.ndarray]:
        """Exact RNG state: {"key_data": uint32[...], "calls": int64[]}."""
        return {"key_data": self._key_data.copy(), "calls": np.asarray(self.calls, dtype=np.int64)}

    def load_state_dict(self, d: Mapping[str, np.ndarray]) -> None:
        kd = np.asarray(d["key_data"], dtype=np.uint32)
        if kd.shape != self._key_data.shape:
            raise ValueError(f"key_data shape {kd.shape} != expected {self._key_data.shape}")
        self._key_data = kd.copy()
        self.calls = int(d["calls"])
