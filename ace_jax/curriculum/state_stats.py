"""The Evolving Data Buffer's per-slot statistics (``StateStats``) and its pruning order.

``StateStats`` is struct-of-arrays: fixed-capacity NumPy arrays, one row per buffer *slot*, read
on the host by the buffer and, as JAX arrays, by the jitted LP scorer
(``ace_jax.curriculum.learnability``). Pruning is host-side NumPy on these arrays:
``pruning_victims`` picks the slots to free given a *potential* per slot (higher = more worth
keeping). Which potential is the caller's choice: ``default_potential`` (a sampler-agnostic proxy)
or the configured sampler's own LP (``learnability.pruning_potential``), so that pruning drops the
states selection would pick least.

The states themselves, de-duplication and persistence hooks are in ``ace_jax.curriculum.buffer``.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np

from sandbox.result import Status

# Status codes stored in ``StateStats.status``: -1 = no execution yet (a seed), else the index of
# the sandbox status in this tuple (stable: persisted).
STATUS_CODES: tuple[str, ...] = tuple(s.value for s in Status)
NO_STATUS = -1
NEVER = -1  # ``last_sampled`` of a state that was never sampled

# name -> (dtype, fill value of an empty slot)
STAT_FIELDS: dict[str, tuple[Any, Any]] = {
    "valid": (np.bool_, False),          # slot holds a live state
    "state_id": (np.int64, -1),          # id of the state in the slot
    "task": (np.int32, -1),              # task index (order of registration)
    "status": (np.int8, NO_STATUS),      # STATUS_CODES index of the producing execution
    "visits": (np.int32, 0),             # number of groups of children recorded
    "last_sampled": (np.int32, NEVER),   # step of the latest selection
    "last_active": (np.int32, 0),        # latest of created / sampled / grouped step
    "reward_mean": (np.float32, 0.0),    # mean reward of the latest group
    "reward_var": (np.float32, 0.0),     # population variance of the latest group's rewards
    "best_child_score": (np.float32, np.nan),  # best valid dev score among children (metric units)
    "headroom": (np.float32, 1.0),       # clip((gold - score) / spread, 0, 1)
    "prior_std": (np.float32, np.nan),   # reward std of the group that created the state (NaN: root)
}


class StateStats:
    """Struct-of-arrays statistics, one row per slot, shape ``[capacity]`` each (NumPy, host).

    Fields and dtypes are ``STAT_FIELDS``: valid, state_id, task (index), status (code), visits,
    last_sampled (step, -1 = never), last_active (step), reward_mean / reward_var (reward units,
    latest group), best_child_score (metric units, NaN = none), headroom ([0, 1]), prior_std
    (reward units). The LP scorer reads them as jax arrays (``learnability.lp_inputs``).
    """

    def __init__(self, capacity: int):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        for name, (dtype, fill) in STAT_FIELDS.items():
            setattr(self, name, np.full(self.capacity, fill, dtype=dtype))

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name) for name in STAT_FIELDS}

    def clear(self, slots) -> None:
        for name, (dtype, fill) in STAT_FIELDS.items():
            getattr(self, name)[slots] = fill

    def rows(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        return {name: getattr(self, name)[slots].copy() for name in STAT_FIELDS}

    def set_rows(self, slots: np.ndarray, rows: dict[str, np.ndarray]) -> None:
        for name, (dtype, _) in STAT_FIELDS.items():
            getattr(self, name)[slots] = np.asarray(rows[name], dtype=dtype)


PotentialFn = Callable[[StateStats], np.ndarray]


def default_potential(stats: StateStats) -> np.ndarray:
    """A sampler-agnostic pruning potential, float32[capacity]: sqrt(reward_var) * headroom, with
    sqrt(reward_var) taken as 1 for an unvisited state (no group yet: worth trying).

    ``EvolvingBuffer`` prunes by it unless given a ``potential_fn``; the trainer passes
    ``learnability.pruning_potential(cfg.lp)`` (the configured sampler's LP) instead.
    """
    u = np.where(stats.visits > 0, np.sqrt(np.maximum(stats.reward_var, 0.0)), 1.0)
    return (u * stats.headroom).astype(np.float32)


def pruning_victims(stats: StateStats, potential: np.ndarray, step: int, excess: int, *,
                    protect_slots: Iterable[int] = (), protect_recent_steps: int,
                    stale_after_steps: int, keep_per_task_status: bool) -> np.ndarray:
    """The (at most ``excess``) live slots to free, in removal order, int64.

    Order: stale slots (``last_active`` more than ``stale_after_steps`` before ``step``) before
    fresh ones, then lowest ``potential`` (float[capacity]; non-finite counts as -inf) first, then
    oldest (lowest state id) first. Never chosen: slots sampled within ``protect_recent_steps`` of
    ``step``, ``protect_slots``, and (if ``keep_per_task_status``) per (task, status) pair an
    already protected slot if any, else the best-potential one (ties: newest). Fewer than
    ``excess`` when only protected slots are left.
    """
    s = stats
    pot = np.asarray(potential, dtype=np.float64)
    if pot.shape != (s.capacity,):
        raise ValueError(f"pruning potential must have shape ({s.capacity},), got {pot.shape}")
    pot = np.where(np.isfinite(pot), pot, -np.inf)
    live = np.flatnonzero(s.valid)
    protected = np.zeros(s.capacity, dtype=bool)
    protected[live] = (s.last_sampled[live] >= step - protect_recent_steps) & \
        (s.last_sampled[live] != NEVER)
    protected[np.asarray(list(protect_slots), dtype=np.int64)] = True
    if keep_per_task_status:
        # Per (task, status): an already protected slot if any, else the best potential (ties:
        # newest state).
        order = np.lexsort((-s.state_id[live], -pot[live], ~protected[live], s.status[live],
                            s.task[live]))
        srt = live[order]
        grp = s.task[srt].astype(np.int64) * 256 + (s.status[srt].astype(np.int64) + 1)
        first = np.ones(srt.size, dtype=bool)
        first[1:] = grp[1:] != grp[:-1]
        protected[srt[first]] = True
    cand = live[~protected[live]]
    stale = (step - s.last_active[cand]) > stale_after_steps
    # lexsort: last key is primary -> stale first (~stale False sorts first), low potential, old.
    order = np.lexsort((s.state_id[cand], pot[cand], ~stale))
    return cand[order[:max(int(excess), 0)]].astype(np.int64)
