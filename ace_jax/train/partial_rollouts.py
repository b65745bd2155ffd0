"""Partial rollouts: the engine holds more groups than a step consumes, and a step takes the
first groups that complete, so no step waits for its longest sample.

``rl.partial_rollouts = True`` (off: each step submits its B groups and drains them) keeps
``ceil(rl.partial_factor * B)`` groups of G samples in the paged engine
(`ace_jax.runtime.engine.Engine`). A step (``collect``) steps the engine until B groups are
complete, and takes them oldest first;
the others keep decoding, under the new weights once the learner has updated (their pages kept,
each token stamped with the policy version that sampled it and its behaviour log-prob, its
routes when recorded), and ``top_up`` refills the engine with new groups. The engine admits
samples in submission order: the oldest unfinished work is always decoded first, so a long,
hard task is never starved by the short ones that keep arriving (AReaL's interruptible
rollouts and slime's ``--partial-rollout`` carry unfinished work over the same way).

Staleness is bounded per token: a token sampled by policy version v and learned on by the
update from version V has staleness V - v. ``collect(learn_version=V)`` returns every group whose
oldest token would otherwise be learned on past ``max_token_staleness`` at the next step (it
waits for them to complete), then the oldest complete groups up to B. So every token of every
step is learned on at staleness <= the bound, and no work is dropped: the price is that a step
waits for such an old group, which with a bound of k + 1 or more (k = ``rl.max_staleness``)
happens only to the longest samples.

Exactly once: ``to_json`` keeps every group in flight (its finished samples whole, its running
ones as far as they got: tokens, behaviour log-probs, versions, routes); ``restore`` resubmits
the running part of each as a continuation (its prompt followed by the tokens so far, the rest
of its budget) that is appended to what it had, so a resumed run neither loses nor repeats a
sample. A continuation's draws are not the uninterrupted run's (its keys restart), and its
earlier tokens' keys and values are recomputed by the prefill under the resumed parameters.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, NamedTuple, Optional, Sequence

import jax
import numpy as np

from ace_jax.runtime import engine as engine_lib, generate
from ace_jax.runtime.completions import Completion, generation_result
from ace_jax.train import rollouts as rollouts_lib


class NewGroup(NamedTuple):
    """What ``top_up``'s ``draw`` returns per group: its ``state`` (anything with ``state_id``),
    the ``prompt`` token ids, and optionally one completion budget per sample (default the
    engine's ``max_new_tokens``)."""

    state: Any
    prompt: list
    budgets: Optional[Sequence[int]] = None


@dataclasses.dataclass
class Group:
    """G samples of one prompt in flight.

    Attributes:
      seq: submission order: the group's id in the rollouts log and the checkpoint.
      state: the state it answers (``state_id`` is what a checkpoint keeps).
      prompt: token ids. budgets: max new tokens per sample. sampled_at: the RL step that drew it.
      done: each sample's finished `completions.Completion` (None while it runs).
      prefix: each sample's part from before a resume (an unfinished `Completion`, or None).
      prompt_routes: the prompt's routing record, uint8 [len(prompt), L_moe, k] (recorded
        routes only; else None).
    """

    seq: int
    state: Any
    prompt: list
    budgets: list
    sampled_at: int
    done: list
    prefix: list
    prompt_routes: Optional[np.ndarray] = None

    @property
    def complete(self) -> bool:
        return all(c is not None for c in self.done)

    def oldest_version(self, running: Sequence[int]) -> Optional[int]:
        """The policy version of the group's oldest token (of its finished samples, the parts
        before a resume and ``running``: its running samples' first versions); None before its
        first token."""
        parts = [c for c in self.done + self.prefix if c is not None and len(c.tokens)]
        versions = [int(c.versions.min()) for c in parts] + list(running)
        return min(versions) if versions else None


class PartialRollouts:
    """Groups in flight over one `engine.Engine` (see the module docstring).

    Args:
      engine: the paged engine (its weights and versions are the trainer's to update).
      group_size: G. batch_groups: B, the groups a step takes. factor: groups held per B.
      max_token_staleness: the bound on a learned token's staleness (>= 1), in versions.
      key: PRNG key; group ``seq`` samples with ``fold_in(key, seq)``.
      versions_per_step: policy versions one learned step advances (the learner's optimizer
        steps per batch, ``grpo.minibatches``).
    """

    def __init__(self, engine: engine_lib.Engine, *, group_size: int, batch_groups: int,
                 factor: float, max_token_staleness: int, key: jax.Array,
                 versions_per_step: int = 1):
        if factor < 1:
            raise ValueError(f"rl.partial_factor must be >= 1 (groups held per group a step "
                             f"takes), got {factor}")
        if max_token_staleness < 1:
            raise ValueError(f"rl.max_token_staleness must be >= 1, got {max_token_staleness}")
        self.engine, self.group_size, self.batch_groups = engine, group_size, batch_groups
        self.capacity = math.ceil(factor * batch_groups)
        self.bound, self.per_step = max_token_staleness, versions_per_step
        self.key = key
        self.groups: dict[int, Group] = {}        # seq -> group in flight, in submission order
        self._owner: dict[tuple[int, int], tuple[int, int]] = {}  # (request, j) -> (seq, g)
        self._next_seq = 0
        # groups submitted, taken only to finish others (a step past the bound), engine steps
        self.stats = dict(submitted=0, forced_groups=0, engine_steps=0)

    # ------------------------------------------------------------------ filling and taking
    def top_up(self, draw: Callable[[int], Sequence[NewGroup]], step: int) -> int:
        """Submits ``draw(n)``'s groups (n: what the engine lacks of ``capacity``), marked as
        drawn at RL ``step``; returns how many."""
        n = self.capacity - len(self.groups)
        if n <= 0:
            return 0
        new = list(draw(n))
        for g in new:
            self._submit(g, step)
        return len(new)

    def collect(self, learn_version: int) -> list[Group]:
        """Steps the engine until B groups are complete and every group that must be learned on
        now (its oldest token would pass the bound at the next step's version, ``learn_version
        + versions_per_step``) is complete; returns those, then the oldest complete groups up
        to B, oldest first."""
        self._take_finished()
        while True:
            first = self._first_versions()
            forced = [g for s, g in self.groups.items()
                      if (v := g.oldest_version(first.get(s, ()))) is not None
                      and learn_version + self.per_step - v > self.bound]
            complete = [g for g in self.groups.values() if g.complete]
            if all(g.complete for g in forced) and len(complete) >= self.batch_groups:
                break
            if not self.engine.busy and not any(not g.complete for g in self.groups.values()):
                if not complete:
                    raise RuntimeError("collect: no group in flight (call top_up first)")
                break
            for c in self.engine.step():
                self._take(c)
            self.stats["engine_steps"] += 1
        take = sorted(forced, key=lambda g: g.seq)
        self.stats["forced_groups"] += len(take)
        rest = [g for g in complete if g not in take]
        take += rest[:max(0, self.batch_groups - len(take))]
        for g in take:
            del self.groups[g.seq]
        return sorted(take, key=lambda g: g.seq)

    def cancel_all(self) -> None:
        """Drops every group in flight (the run is over); their requests leave the engine."""
        for rid in {rid for rid, _ in self._owner}:
            self.engine.cancel(rid)
        self.groups.clear()
        self._owner.clear()

    def completions(self, g: Group) -> list[Completion]:
        """The group's G finished samples, each whole: the part before a resume (if any)
        followed by the rest."""
        return [_join(p, c) if p is not None else c for p, c in zip(g.prefix, g.done)]

    # ------------------------------------------------------------------ in a checkpoint
    def to_json(self) -> dict:
        """Every group in flight, its running samples as far as they got (`Engine.snapshot`)."""
        self._take_finished()
        running = self._running()
        out = []
        for s, g in self.groups.items():
            parts = []
            for i, (before, done) in enumerate(zip(g.prefix, g.done)):
                now = done if done is not None else running.get(s, {}).get(i)
                c = before if now is None else now if before is None else _join(before, now)
                parts.append(None if c is None else _completion_json(c))
            out.append(dict(seq=s, state_id=g.state.state_id, prompt=g.prompt, budgets=g.budgets,
                            sampled_at=g.sampled_at, samples=parts,
                            prompt_routes=_array_json(g.prompt_routes)))
        return dict(next_seq=self._next_seq, groups=out)

    def restore(self, d: dict, state_of: Callable[[int], Any]) -> None:
        """Resubmits the groups of a `to_json` (``state_of``: state id -> state), oldest first:
        finished samples kept, running ones continued from where they were."""
        self._next_seq = int(d["next_seq"])
        for gd in d["groups"]:
            parts = [None if p is None else _completion_from_json(p) for p in gd["samples"]]
            g = Group(int(gd["seq"]), state_of(int(gd["state_id"])), list(gd["prompt"]),
                      list(gd["budgets"]), int(gd["sampled_at"]),
                      [p if p is not None and p.finish_reason is not None else None
                       for p in parts], [None] * len(parts),
                      _array_from_json(gd.get("prompt_routes")))
            self.groups[g.seq] = g
            key = jax.random.fold_in(self.key, g.seq)
            for i, p in enumerate(parts):
                if g.done[i] is not None:
                    continue
                so_far = [] if p is None else p.tokens
                if p is not None and len(so_far):
                    g.prefix[i] = p
                rid = self.engine.submit(g.prompt + list(so_far), n=1,
                                         key=jax.random.fold_in(jax.random.fold_in(key, i),
                                                                len(so_far)),
                                         max_new_tokens=g.budgets[i] - len(so_far))
                self._owner[rid, 0] = (g.seq, i)

    # ------------------------------------------------------------------ inside
    def _submit(self, new: NewGroup, step: int) -> None:
        g = self.group_size
        budgets = [int(b) for b in (new.budgets if new.budgets is not None
                                    else [self.engine.sampling.max_new_tokens] * g)]
        grp = Group(self._next_seq, new.state, list(map(int, new.prompt)), budgets, step,
                    [None] * g, [None] * g)
        rid = self.engine.submit(grp.prompt, n=g, key=jax.random.fold_in(self.key, grp.seq),
                                 max_new_tokens=budgets)
        for j in range(g):
            self._owner[rid, j] = (grp.seq, j)
        self.groups[grp.seq] = grp
        self._next_seq += 1
        self.stats["submitted"] += 1

    def _take_finished(self) -> None:
        """Samples that finished inside someone's `Engine.generate` (the probe's, a refill's)."""
        for c in self.engine.finished():
            self._take(c)

    def _take(self, c: Completion) -> None:
        seq, i = self._owner.pop((c.request, c.sample))
        g = self.groups[seq]
        g.done[i] = c
        if g.prompt_routes is None and c.prompt_routes is not None:
            g.prompt_routes = c.prompt_routes[:len(g.prompt)]

    def _first_versions(self) -> dict[int, list[int]]:
        """{group seq: its running samples' first-token versions}."""
        out: dict[int, list[int]] = {}
        for rid in {rid for rid, _ in self._owner}:
            for j, v in self.engine.first_versions(rid).items():
                out.setdefault(self._owner[rid, j][0], []).append(v)
        return out

    def _running(self) -> dict[int, dict[int, Completion]]:
        """{group seq: {sample: its snapshot}} of the samples now in a slot."""
        out: dict[int, dict[int, Completion]] = {}
        for rid in {rid for rid, _ in self._owner}:
            for c in self.engine.snapshot(rid):
                seq, i = self._owner[rid, c.sample]
                out.setdefault(seq, {})[i] = c
        return out


def _join(a: Completion, b: Completion) -> Completion:
    """Sample part ``a`` (before a resume) followed by ``b`` (its continuation): b's finish
    reason; the prompt's routes are ``b``'s first ones (its prompt is a's prompt + a's tokens)."""
    cat = lambda x, y: None if x is None or y is None else np.concatenate([x, y])  # noqa: E731
    prompt_routes = (None if b.prompt_routes is None
                     else b.prompt_routes[:len(b.prompt_routes) - len(a.tokens)])
    return Completion(b.request, b.sample, list(a.tokens) + list(b.tokens),
                      cat(a.logprobs, b.logprobs), b.finish_reason, cat(a.routes, b.routes),
                      prompt_routes, cat(a.versions, b.versions))


def _array_json(a: Optional[np.ndarray]) -> Optional[dict]:
    """A routing record as JSON (`rollouts_lib.uint8_json`), None as None."""
    return None if a is None else rollouts_lib.uint8_json(a)


def _array_from_json(d: Optional[dict]) -> Optional[np.ndarray]:
    return None if d is None else rollouts_lib.uint8_from_json(d)


def _completion_json(c: Completion) -> dict:
    return dict(tokens=list(map(int, c.tokens)), logprobs=np.asarray(c.logprobs).tolist(),
                versions=np.asarray(c.versions).tolist(), finish_reason=c.finish_reason,
                routes=_array_json(c.routes))


def _completion_from_json(d: dict) -> Completion:
    return Completion(-1, -1, list(d["tokens"]), np.asarray(d["logprobs"], np.float32),
                      d["finish_reason"], _array_from_json(d.get("routes")), None,
                      np.asarray(d["versions"], np.int32))


def generation(rollouts: PartialRollouts, groups: Sequence[Group], *, max_new_tokens: int,
               pad_id: int) -> generate.GenerationResult:
    """The taken ``groups`` as one `generate.GenerationResult` (host numpy, rows group-major:
    row ``b * G + g`` is sample g of group b), the per-token ``versions`` filled, the routing
    record when the engine kept one (`completions.generation_result`)."""
    done = [c._replace(request=b, sample=s, prompt_routes=g.prompt_routes)
            for b, g in enumerate(groups) for s, c in enumerate(rollouts.completions(g))]
    return generation_result(done, {b: b for b in range(len(groups))}, len(groups),
                             rollouts.group_size, max_new_tokens, pad_id)
