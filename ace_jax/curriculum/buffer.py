"""The Evolving Data Buffer: training states, their struct-of-arrays statistics, and pruning.

Every execution the policy triggers (failed ones included) becomes a new *state* (a code snapshot
plus a short execution history) from which later RL steps start. Beside the states the buffer keeps
fixed-capacity NumPy arrays of per-state statistics (``StateStats``, in
``ace_jax.curriculum.state_stats`` with the pruning order; re-exported here); the jitted LP scorer
in ``ace_jax.curriculum.learnability`` reads them as JAX arrays. A state lives in one *slot* (an
index into the arrays); ``valid[slot]`` says whether the slot is in use. Pruned states free their
slot.

Persistence (segments, snapshots, commit marker) is in ``ace_jax.curriculum.buffer_store``; this module only
exposes the delta / full export hooks it needs (``export_delta``, ``export_full``, ``apply``).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any, Iterable, Optional, Sequence

import ml_collections
import numpy as np

from ace_jax.curriculum.state_stats import (NO_STATUS, STAT_FIELDS, STATUS_CODES, PotentialFn,
                                            StateStats, default_potential, pruning_victims)
from sandbox.result import ExecutionResult, Status
from sandbox.tasks.targets import TaskTargets

ORIGINS = ("seed", "rollout", "evaluation")
class BufferError(Exception):
    """Base class of the buffer's typed errors."""


class UnknownStateError(BufferError, KeyError):
    """A state id that is not (or no longer) in the buffer."""


class UnknownTaskError(BufferError, KeyError):
    """A task id the buffer has no ``TaskTargets`` for."""


class BufferFullError(BufferError):
    """Pruning cannot free enough slots (every remaining state is protected or a keeper)."""


def default_config() -> ml_collections.ConfigDict:
    """The ``buffer`` config section (every constant of the buffer lives here)."""
    c = ml_collections.ConfigDict()
    c.capacity = 4096              # fixed number of slots (size of every StateStats array)
    c.history_len = 8              # step summaries kept per state (oldest dropped first)
    c.stderr_tail_chars = 400      # characters of stderr kept per step summary
    # Pruning runs when an insertion does not fit: it frees slots down to prune_to * capacity.
    c.prune_to = 0.9
    c.stale_after_steps = 20       # a state untouched (created/sampled/grouped) this long is stale
    c.protect_recent_steps = 1     # states sampled in [step - this, step] are never pruned
    c.keep_per_task_status = True  # keep >= 1 state per (task, status kind), seeds' "none" included
    # Persistence (ace_jax.curriculum.buffer_store): where, how often to compact, how to retry.
    c.store = ml_collections.ConfigDict()
    c.store.url = ""                 # "" = no persistence; a local dir, gs://bucket/prefix or memory://x
    c.store.snapshot_every = 20      # commits between compacted snapshots (segments in between)
    c.store.keep_manifests = 2       # committed manifests kept after a snapshot (older ones collected)
    c.store.retry_attempts = 5       # tries per storage operation on transient errors
    c.store.retry_initial_s = 0.2    # first backoff, seconds
    c.store.retry_max_s = 10.0       # backoff cap, seconds
    c.store.retry_multiplier = 2.0   # backoff growth per retry
    return c


@dataclasses.dataclass(frozen=True)
class SeedSolution:
    """A reference solution to seed the buffer with: code and its dev score (metric units)."""

    task_id: str
    code: str
    score: Optional[float]


@dataclasses.dataclass(frozen=True)
class Child:
    """One execution under a parent state: the new code, its result and its reward."""

    code: str
    result: ExecutionResult
    reward: float
    action: str = "improve"  # draft | debug | improve (the agent's action kind)


@dataclasses.dataclass
class StepSummary:
    """One line of a state's execution history."""

    action: str
    status: str
    score: Optional[float]
    stderr_tail: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def valid_dev_score(result: ExecutionResult) -> Optional[float]:
    """The execution's dev score when it counts (status ok and a finite value), else None."""
    dev = result.dev_score
    if result.status is Status.OK and dev is not None and math.isfinite(dev):
        return dev
    return None


def step_summary(action: str, result: ExecutionResult, stderr_tail_chars: int) -> StepSummary:
    """The history line of one execution: its action, status, valid dev score
    (``valid_dev_score``) and the last ``stderr_tail_chars`` characters of stderr ("" if <= 0)."""
    tail = result.stderr[-stderr_tail_chars:] if stderr_tail_chars > 0 else ""
    return StepSummary(action=action, status=result.status.value, score=valid_dev_score(result),
                       stderr_tail=tail)


def child_history(parent_history: Sequence[StepSummary], action: str, result: ExecutionResult, *,
                  history_len: int, stderr_tail_chars: int) -> list[StepSummary]:
    """The execution history of a child state: the parent's plus this execution's
    ``step_summary``, truncated to the newest ``history_len`` entries (oldest dropped first).

    The one definition of a child's history, shared by ``EvolvingBuffer.add_children`` and the
    evaluation episodes, so prompts rendered from either are the same. The last entry is this
    execution's summary (its ``score`` is the valid dev score, its ``stderr_tail`` the tail).
    ``history_len`` and ``stderr_tail_chars`` are the ``buffer`` config's.
    """
    if history_len < 1:
        raise ValueError(f"history_len must be >= 1, got {history_len}")
    return (list(parent_history) + [step_summary(action, result, stderr_tail_chars)])[-history_len:]


@dataclasses.dataclass
class State:
    """One buffer entry (JSON-serialisable through ``to_dict`` / ``from_dict``).

    Attributes:
      state_id: unique, monotonically assigned integer id.
      task_id: the task this state belongs to.
      parent_id: id of the state it was derived from (None for roots).
      depth: 0 for roots, parent depth + 1 otherwise.
      code: the solution file (may be empty: a fresh draft).
      history: bounded list of ``StepSummary`` (oldest first).
      score: best valid dev score along this lineage so far (metric units), or None.
      origin: "seed" | "rollout" | "evaluation".
      created_step: RL step at which the state was created.
    """

    state_id: int
    task_id: str
    parent_id: Optional[int]
    depth: int
    code: str
    history: list[StepSummary]
    score: Optional[float]
    origin: str
    created_step: int

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["history"] = [h.to_dict() for h in self.history]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "State":
        d = dict(d)
        d["history"] = [StepSummary(**h) for h in d["history"]]
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str) -> "State":
        return cls.from_dict(json.loads(s))

    @property
    def status(self) -> Optional[str]:
        """Status of the execution that produced this state (None for a seed)."""
        return self.history[-1].status if self.history else None


def code_hash(code: str) -> str:
    """Identity of a code snapshot for de-duplication (trailing whitespace per line ignored)."""
    norm = "\n".join(line.rstrip() for line in code.strip().splitlines())
    return hashlib.sha256(norm.encode()).hexdigest()


class EvolvingBuffer:
    """States + ``StateStats`` + de-duplication + pruning.

    Args:
      config: the ``buffer`` section (``default_config()``).
      targets: the tasks' ``TaskTargets``; their order fixes the task index in the stats.
      potential_fn: ``StateStats -> float[capacity]``, higher = more worth keeping: the pruning
        order (``prune``). None: ``default_potential``, a sampler-agnostic proxy
        (sqrt(reward_var) * headroom). The trainer passes
        ``learnability.pruning_potential(cfg.lp)``: the configured sampler's own LP, so pruning
        drops first the states selection would pick least (for the ``uniform`` sampler, which
        ranks no state above another, that is ``default_potential`` again).
    """

    def __init__(self, config: ml_collections.ConfigDict, targets: Sequence[TaskTargets],
                 potential_fn: Optional[PotentialFn] = None):
        self.config = config
        if not 0.0 < config.prune_to <= 1.0:
            raise ValueError(f"buffer.prune_to must be in (0, 1], got {config.prune_to}")
        if config.history_len < 1:
            raise ValueError(f"buffer.history_len must be >= 1, got {config.history_len}")
        self.targets: dict[str, TaskTargets] = {}
        self.task_ids: list[str] = []
        for t in targets:
            if t.task_id in self.targets:
                raise ValueError(f"duplicate TaskTargets for task {t.task_id!r}")
            self.targets[t.task_id] = t
            self.task_ids.append(t.task_id)
        self.stats = StateStats(config.capacity)
        self.potential_fn = potential_fn or default_potential
        self.states: dict[int, State] = {}
        self.slot_of: dict[int, int] = {}
        self._children_by_code: dict[tuple[Optional[int], str, str], int] = {}
        self.next_id = 0
        # Changes since the last ``export_delta`` (for the store's append-only segments).
        self._dirty: set[int] = set()
        self._removed: set[int] = set()
        self._dirty_slots: set[int] = set()

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self.states)

    def __contains__(self, state_id: int) -> bool:
        return state_id in self.states

    def get(self, state_id: int) -> State:
        try:
            return self.states[state_id]
        except KeyError:
            raise UnknownStateError(f"state {state_id} is not in the buffer (never added or pruned)") from None

    def ids_for_slots(self, slots: Iterable[int]) -> list[int]:
        """State ids of the given slots (e.g. the sampler's selection); errors on an empty slot."""
        out = []
        for s in np.asarray(list(slots) if not isinstance(slots, np.ndarray) else slots).tolist():
            if not (0 <= s < self.stats.capacity) or not self.stats.valid[s]:
                raise UnknownStateError(f"slot {s} holds no state")
            out.append(int(self.stats.state_id[s]))
        return out

    def slots_for_ids(self, ids: Iterable[int]) -> np.ndarray:
        return np.asarray([self.slot_of[self.get(i).state_id] for i in ids], dtype=np.int64)

    def task_index(self, task_id: str) -> int:
        if task_id not in self.targets:
            raise UnknownTaskError(f"no TaskTargets for task {task_id!r}; known: {self.task_ids}")
        return self.task_ids.index(task_id)

    def metrics(self) -> dict[str, float]:
        """Scalar summaries for the metric writers: size, fill, visited share, mean latest-group
        reward std of visited states (reward units), mean headroom, counts per status kind."""
        s = self.stats
        v = s.valid
        n = int(v.sum())
        visited = v & (s.visits > 0)
        out = {"buffer/size": float(n), "buffer/fill": n / s.capacity,
               "buffer/visited_frac": float(visited.sum()) / max(n, 1),
               "buffer/reward_std_visited": float(np.sqrt(np.maximum(s.reward_var[visited], 0)).mean())
               if visited.any() else 0.0,
               "buffer/headroom_mean": float(s.headroom[v].mean()) if n else 0.0}
        codes, counts = np.unique(s.status[v], return_counts=True)
        for c, k in zip(codes.tolist(), counts.tolist()):
            out[f"buffer/status/{'none' if c == NO_STATUS else STATUS_CODES[c]}"] = float(k)
        return out

    # ------------------------------------------------------------------ insertion
    def _free_slots(self, n: int, step: int, protect: Iterable[int] = ()) -> np.ndarray:
        free = np.flatnonzero(~self.stats.valid)
        if free.size < n:
            target = min(int(self.config.prune_to * self.stats.capacity), self.stats.capacity - n)
            self.prune(step, target_size=max(target, 0), protect=protect)
            free = np.flatnonzero(~self.stats.valid)
            if free.size < n:
                raise BufferFullError(f"need {n} free slots, have {free.size} after pruning")
        return free[:n]

    def _insert(self, state: State, slot: int, status_code: int) -> None:
        tgt = self.targets[state.task_id]
        self.states[state.state_id] = state
        self.slot_of[state.state_id] = slot
        self._children_by_code[(state.parent_id, state.task_id, code_hash(state.code))] = state.state_id
        row = {name: fill for name, (_, fill) in STAT_FIELDS.items()}
        row.update(valid=True, state_id=state.state_id, task=self.task_index(state.task_id),
                   status=status_code, last_active=state.created_step,
                   headroom=tgt.headroom(state.score))
        self.stats.set_rows(np.asarray([slot]), {k: [v] for k, v in row.items()})
        self._dirty.add(state.state_id)
        self._dirty_slots.add(slot)

    def add_root(self, task_id: str, code: str, score: Optional[float], origin: str = "seed",
                 step: int = 0) -> int:
        """Adds a parentless state (a draft when ``code`` is empty); returns its id.

        A root with the same task and code as an existing root is merged: its score becomes the
        better of the two and the existing id is returned.
        """
        if origin not in ORIGINS:
            raise ValueError(f"origin must be one of {ORIGINS}, got {origin!r}")
        if score is not None and not math.isfinite(score):
            raise ValueError(f"a root's score must be finite or None, got {score!r}")
        self.task_index(task_id)
        key = (None, task_id, code_hash(code))
        if key in self._children_by_code and self._children_by_code[key] in self.states:
            sid = self._children_by_code[key]
            self._update_score(sid, score)
            return sid
        slot = int(self._free_slots(1, step)[0])
        state = State(state_id=self.next_id, task_id=task_id, parent_id=None, depth=0, code=code,
                      history=[], score=score, origin=origin, created_step=step)
        self.next_id += 1
        self._insert(state, slot, NO_STATUS)
        return state.state_id

    def seed(self, references: Sequence[SeedSolution] = (), step: int = 0) -> list[int]:
        """An empty-draft state for every task plus one state per reference solution; returns ids."""
        ids = [self.add_root(t, "", None, "seed", step) for t in self.task_ids]
        ids += [self.add_root(r.task_id, r.code, r.score, "seed", step) for r in references]
        return ids

    def _update_score(self, state_id: int, score: Optional[float]) -> None:
        st = self.states[state_id]
        new = self.targets[st.task_id].better(st.score, score)
        if new != st.score:
            st.score = new
            slot = self.slot_of[state_id]
            self.stats.headroom[slot] = self.targets[st.task_id].headroom(new)
            self._dirty.add(state_id)
            self._dirty_slots.add(slot)

    def add_children(self, parent_id: int, children: Sequence[Child], step: int,
                     origin: str = "rollout", extra_rewards: Sequence[float] = ()) -> list[int]:
        """Records one group of executions under ``parent_id``; returns one state id per child.

        Every execution (failed ones included) becomes a child state whose history is the parent's
        plus this step, and whose score is the better of the parent's score and this execution's
        valid dev score (a dev score counts only with status ok and a finite value). Each new
        child's ``prior_std`` is the std of this group's rewards. The parent's statistics are
        replaced by this group's: reward mean and population variance over ALL ``len(children)``
        rewards plus ``extra_rewards`` (group members that produced no execution, e.g. an
        invalid-format completion: they count in the statistics but make no state), visits += 1,
        best child score, ``last_active = step``. One call = one group.

        Merging: a child whose code equals (``code_hash``) that of an existing child of the same
        parent is not stored again. Its reward still counts in the parent's group statistics; the
        existing child keeps its id, history and stats, its score becomes the better of the two,
        and that existing id is returned in the child's position.
        """
        if not children and not extra_rewards:
            raise ValueError("add_children needs at least one child or reward (one group)")
        if origin not in ORIGINS:
            raise ValueError(f"origin must be one of {ORIGINS}, got {origin!r}")
        parent = self.get(parent_id)
        tgt = self.targets[parent.task_id]
        pslot = self.slot_of[parent_id]
        rewards = np.asarray([float(c.reward) for c in children] + [float(r) for r in extra_rewards],
                             dtype=np.float64)
        if not np.all(np.isfinite(rewards)):
            raise ValueError(f"child rewards must be finite, got {rewards.tolist()}")
        # How many genuinely new states this group brings (dedupe within the group too).
        keys, new_keys, merged = [], [], [parent_id]
        for c in children:
            k = (parent_id, parent.task_id, code_hash(c.code))
            keys.append(k)
            if k in self._children_by_code and self._children_by_code[k] in self.states:
                merged.append(self._children_by_code[k])
            elif k not in new_keys:
                new_keys.append(k)
        free = list(self._free_slots(len(new_keys), step, protect=merged))
        if parent_id not in self.states:  # pruning may not remove it (protected) but stay safe
            raise UnknownStateError(f"parent {parent_id} was pruned while adding its children")
        ids: list[int] = []
        best_child: Optional[float] = None
        for c, k in zip(children, keys):
            res = c.result
            dev = valid_dev_score(res)
            best_child = tgt.better(best_child, dev)
            existing = self._children_by_code.get(k)
            if existing is not None and existing in self.states:
                self._update_score(existing, dev)
                ids.append(existing)
                continue
            history = child_history(parent.history, c.action, res,
                                    history_len=self.config.history_len,
                                    stderr_tail_chars=self.config.stderr_tail_chars)
            state = State(state_id=self.next_id, task_id=parent.task_id, parent_id=parent_id,
                          depth=parent.depth + 1, code=c.code, history=history,
                          score=tgt.better(parent.score, dev), origin=origin, created_step=step)
            self.next_id += 1
            slot = int(free.pop(0))
            self._insert(state, slot, STATUS_CODES.index(res.status.value))
            self.stats.prior_std[slot] = rewards.std()
            ids.append(state.state_id)
        s = self.stats
        s.reward_mean[pslot] = rewards.mean()
        s.reward_var[pslot] = rewards.var()
        s.visits[pslot] += 1
        if best_child is not None:
            old = None if np.isnan(s.best_child_score[pslot]) else float(s.best_child_score[pslot])
            s.best_child_score[pslot] = tgt.better(old, best_child)
        s.last_active[pslot] = max(int(s.last_active[pslot]), step)
        self._dirty_slots.add(pslot)
        return ids

    def mark_sampled(self, ids: Iterable[int], step: int) -> None:
        """Records that these states were selected at ``step`` (cooling, pruning protection)."""
        for i in ids:
            slot = self.slot_of[self.get(i).state_id]
            self.stats.last_sampled[slot] = step
            self.stats.last_active[slot] = max(int(self.stats.last_active[slot]), step)
            self._dirty_slots.add(slot)

    # ------------------------------------------------------------------ pruning
    def prune(self, step: int, target_size: Optional[int] = None, protect: Iterable[int] = ()) -> list[int]:
        """Removes states until at most ``target_size`` remain; returns the removed ids.

        Order of removal (``state_stats.pruning_victims``): stale states (untouched for more than
        ``stale_after_steps``) before fresh ones, then lowest ``potential_fn`` first, then oldest
        first. Never removed: states sampled
        within ``protect_recent_steps`` of ``step``, the ids in ``protect``, and (if
        ``keep_per_task_status``) the best-potential state of every (task, status) pair, which
        keeps at least one state per task and per failure kind per task. Removes fewer if only
        protected states are left.
        """
        s = self.stats
        cfg = self.config
        if target_size is None:
            target_size = int(cfg.prune_to * s.capacity)
        live = np.flatnonzero(s.valid)
        excess = live.size - int(target_size)
        if excess <= 0:
            return []
        victims = pruning_victims(
            s, self.potential_fn(s), step, excess,
            protect_slots=[self.slot_of[i] for i in protect if i in self.slot_of],
            protect_recent_steps=cfg.protect_recent_steps,
            stale_after_steps=cfg.stale_after_steps,
            keep_per_task_status=cfg.keep_per_task_status)
        removed = [int(s.state_id[v]) for v in victims]
        self._remove(removed)
        return removed

    def _remove(self, ids: Sequence[int]) -> None:
        for i in ids:
            st = self.states.pop(i)
            slot = self.slot_of.pop(i)
            k = (st.parent_id, st.task_id, code_hash(st.code))
            if self._children_by_code.get(k) == i:
                del self._children_by_code[k]
            self.stats.clear(slot)
            self._dirty.discard(i)
            self._removed.add(i)
            self._dirty_slots.add(slot)

    # ------------------------------------------------------------------ persistence hooks
    def _meta(self) -> dict[str, Any]:
        return {"next_id": self.next_id, "capacity": self.stats.capacity, "task_ids": self.task_ids}

    def export_delta(self) -> dict[str, Any]:
        """Changes since the previous export (and clears them): new/updated states, removed ids,
        full stats rows of every touched slot, and counters. Apply with ``apply``."""
        slots = np.asarray(sorted(self._dirty_slots), dtype=np.int64)
        d = {"kind": "delta", "meta": self._meta(),
             "states": [self.states[i].to_dict() for i in sorted(self._dirty)],
             "removed": sorted(self._removed),
             "slots": slots, "rows": self.stats.rows(slots)}
        self._dirty.clear(); self._removed.clear(); self._dirty_slots.clear()
        return d

    def export_full(self) -> dict[str, Any]:
        """Everything (a compacted snapshot); also clears the pending delta."""
        slots = np.arange(self.stats.capacity, dtype=np.int64)
        d = {"kind": "full", "meta": self._meta(),
             "states": [self.states[i].to_dict() for i in sorted(self.states)],
             "removed": [], "slots": slots, "rows": self.stats.rows(slots)}
        self._dirty.clear(); self._removed.clear(); self._dirty_slots.clear()
        return d

    @property
    def has_pending_changes(self) -> bool:
        return bool(self._dirty or self._removed or self._dirty_slots)

    def apply(self, d: dict[str, Any]) -> None:
        """Applies an ``export_delta`` / ``export_full`` record (restore path)."""
        meta = d["meta"]
        if meta["capacity"] != self.stats.capacity:
            raise ValueError(f"stored capacity {meta['capacity']} != configured {self.stats.capacity}")
        if list(meta["task_ids"]) != self.task_ids:
            raise ValueError(f"stored task ids {meta['task_ids']} != configured {self.task_ids}")
        if d["kind"] == "full":
            self.states.clear(); self.slot_of.clear(); self._children_by_code.clear()
            self.stats = StateStats(self.stats.capacity)
        for i in d["removed"]:
            if i in self.states:
                st = self.states.pop(i)
                self.slot_of.pop(i)
                k = (st.parent_id, st.task_id, code_hash(st.code))
                if self._children_by_code.get(k) == i:
                    del self._children_by_code[k]
        slots = np.asarray(d["slots"], dtype=np.int64)
        self.stats.set_rows(slots, d["rows"])
        for sd in d["states"]:
            st = State.from_dict(sd)
            self.states[st.state_id] = st
            self._children_by_code[(st.parent_id, st.task_id, code_hash(st.code))] = st.state_id
        # Slot map from the authoritative stats rows.
        self.slot_of = {int(self.stats.state_id[s]): int(s) for s in np.flatnonzero(self.stats.valid)}
        if set(self.slot_of) != set(self.states):
            raise ValueError("stored states and stats rows disagree (ids "
                             f"{sorted(set(self.slot_of) ^ set(self.states))[:10]})")
        self.next_id = int(meta["next_id"])
        self._dirty.clear(); self._removed.clear(); self._dirty_slots.clear()
