"""The rollouts of one RL step, from generation to the learner.

``StepRollouts`` keeps the generator's arrays as they came back (host numpy: tokens, behaviour
log-probs, lengths, finish reasons, prompt index) next to the B prompts that were generated from;
the learner's ``TrainBatch`` is built from them directly (``train_batch``). ``Rollout`` is the
per-completion record the environment fills in: its text, parsed action, sandbox result, reward.
Rows are prompt-major: row ``b * G + g`` is sample g of state b.
"""
from __future__ import annotations

import base64
import dataclasses
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ace_jax.rl import rollout_batch
from ace_jax.runtime import generate
from ace_jax.runtime.engine_programs import NO_ROUTE
from sandbox.result import ExecutionResult


@dataclasses.dataclass
class Rollout:
    """One completion of one state and, once executed, its outcome.

    Attributes:
      state_id / task_id: where it started; state: that buffer ``State`` (set when generated
        and when a resumed step is restored, not stored in a checkpoint).
      text: decoded completion; action: what the environment parsed from it (an
        ``agent.Action`` / ``agent.InvalidAction`` for the code agent).
      policy_version: learner step of the params that generated it (of its oldest token, when
        its tokens span several: partial rollouts; ``StepRollouts.gen.versions`` per token).
      result: the sandbox's ExecutionResult (None when nothing ran).
      reward: from the reward registry.
    """

    state_id: int
    task_id: str
    text: str
    policy_version: int
    action: Any = None
    result: Optional[ExecutionResult] = None
    reward: float = 0.0
    state: Any = None


@dataclasses.dataclass
class StepRollouts:
    """The B * G rollouts of RL step ``step``, their generation arrays and, while their
    executions run, the sandbox futures (one per row; None where nothing was submitted).

    Attributes:
      prompts: the B prompts (token ids, after the ``rl.max_prompt_tokens`` cut).
      gen: the generator's result as host numpy arrays (``generate.GenerationResult``).
      rollouts: one ``Rollout`` per row.
      gen_seconds / gen_tokens: generation time and completion tokens (perf metrics).
      truncated: prompts cut to ``rl.max_prompt_tokens``.
      learner_version: the learner's step when it learned on these rollouts (None before).
      refill_rounds: the extra generation rounds dynamic sampling appended (``extend``).
      group_ids: with partial rollouts, each group's id (`partial_rollouts.Group.seq`, one
        per prompt): what the rollouts log names a sample by; None otherwise.
    """

    step: int
    prompts: list[list[int]]
    gen: generate.GenerationResult
    rollouts: list[Rollout]
    gen_seconds: float = 0.0
    gen_tokens: int = 0
    truncated: int = 0
    futures: list = dataclasses.field(default_factory=list)
    learner_version: Optional[int] = None
    refill_rounds: int = 0     # dynamic sampling's extra generation rounds (Trainer._refill)
    group_ids: Optional[list[int]] = None
    advantages: Optional[np.ndarray] = None   # float32 [rows]: the host's (Reinforce-Ada)

    @classmethod
    def from_generation(cls, step: int, states: Sequence[Any], prompts: list[list[int]],
                        gen: generate.GenerationResult, gen_seconds: float, *, version: int,
                        decode: Callable[[list[int]], str]) -> "StepRollouts":
        """The rollouts of generation ``gen`` (host arrays) of the ``states``' ``prompts``:
        texts by ``decode``; a row's policy version is that of its oldest token (``version``,
        the generator's, when ``gen`` has no per-token versions)."""
        rollouts = []
        for i in range(gen.tokens.shape[0]):
            st, n = states[int(gen.prompt_index[i])], int(gen.lengths[i])
            oldest = version if gen.versions is None or n == 0 else int(gen.versions[i, :n].min())
            rollouts.append(Rollout(state_id=st.state_id, task_id=st.task_id, state=st,
                                    policy_version=oldest, text=decode(gen.tokens[i, :n].tolist())))
        return cls(step, prompts, gen, rollouts, gen_seconds=gen_seconds,
                   gen_tokens=int(gen.lengths.sum()))

    @property
    def policy_version(self) -> int:
        """The oldest policy version that sampled any of these rollouts."""
        return min(r.policy_version for r in self.rollouts)

    @property
    def staleness(self) -> int:
        """Learner updates between the oldest policy that generated these rollouts and the one
        that learned on them (at most ``rl.max_staleness``; with partial rollouts at most
        ``rl.max_token_staleness``)."""
        return self.learner_version - self.policy_version

    def token_staleness(self) -> np.ndarray:
        """int [completion tokens]: each generated token's staleness when learned on (the
        learner's version minus the version that sampled it; a row's ``policy_version`` when
        the generator records no per-token versions)."""
        n = self.gen.lengths
        if self.gen.versions is None:
            v = np.repeat([r.policy_version for r in self.rollouts], n)
        else:
            v = np.concatenate([self.gen.versions[i, :n[i]] for i in range(len(n))] or [[]])
        return self.learner_version - np.asarray(v, np.int64)

    def completion(self, i: int) -> np.ndarray:
        """Row i's completion token ids (its true length)."""
        return self.gen.tokens[i, :self.gen.lengths[i]]

    def cut_by_budget(self, i: int) -> bool:
        """Row i ran out of ``max_new_tokens`` (no EOS / stop sequence ended it)."""
        return int(self.gen.finish_reason[i]) == int(generate.FinishReason.LENGTH)

    def rewards(self) -> np.ndarray:
        return np.asarray([r.reward for r in self.rollouts], np.float32)

    def train_batch(self, *, prompt_bucket: int, pad_id: int,
                    shardings: rollout_batch.BatchShardings | None = None
                    ) -> rollout_batch.TrainBatch:
        """The learner's batch: the prompts left-padded as the sampler padded them, followed by
        the generated arrays, and the rewards (``shardings``: built per shard from host memory
        in the learner's shardings, `rollout_batch.make_train_batch`)."""
        return rollout_batch.make_train_batch(self.prompts, self.gen, self.rewards(),
                                              prompt_bucket=prompt_bucket, pad_id=pad_id,
                                              advantages=self.advantages, shardings=shardings)

    # ------------------------------------------------------------------ dynamic sampling

    def extend(self, more: "StepRollouts") -> None:
        """Appends the groups of ``more`` (another generation for the same RL step, e.g. a
        dynamic-sampling refill) after this step's: prompts, rows (its prompt indices shifted),
        rollouts and futures; generation time and tokens add up."""
        if self.gen.tokens.shape[1] != more.gen.tokens.shape[1]:
            raise ValueError("extend: the generations have different max_new_tokens")
        if (self.gen.routes is None) != (more.gen.routes is None):
            raise ValueError("extend: one generation has a routing record, the other not")
        b = len(self.prompts)
        cat = lambda a, c: np.concatenate([np.asarray(a), np.asarray(c)])  # noqa: E731
        self.gen = generate.GenerationResult(
            cat(self.gen.tokens, more.gen.tokens), cat(self.gen.logprobs, more.gen.logprobs),
            cat(self.gen.lengths, more.gen.lengths),
            cat(self.gen.finish_reason, more.gen.finish_reason),
            cat(self.gen.prompt_index, np.asarray(more.gen.prompt_index) + b),
            None if self.gen.routes is None else cat(self.gen.routes, more.gen.routes),
            None if self.gen.prompt_routes is None
            else tuple(self.gen.prompt_routes) + tuple(more.gen.prompt_routes),
            None if self.gen.versions is None or more.gen.versions is None
            else cat(self.gen.versions, more.gen.versions))
        if self.group_ids is not None:   # a refill's groups are not partial rollouts' groups
            self.group_ids = list(self.group_ids) + [None] * len(more.prompts)
        self.prompts = list(self.prompts) + list(more.prompts)
        self.rollouts = list(self.rollouts) + list(more.rollouts)
        self.futures = list(self.futures) + list(more.futures)
        self.gen_seconds += more.gen_seconds
        self.gen_tokens += more.gen_tokens
        self.truncated += more.truncated

    def select_groups(self, groups: Sequence[int], group_size: int) -> "StepRollouts":
        """The step restricted to ``groups`` (indices of prompts, in the given order): what the
        learner learns on when dynamic sampling dropped some groups. Rows stay group-major."""
        return self.select_rows([[b * group_size + g for g in range(group_size)]
                                 for b in groups])

    def select_rows(self, groups: Sequence[Sequence[int]]) -> "StepRollouts":
        """A step of the given groups of rows (each group's rows answer one prompt text, e.g. a
        state's samples gathered over several generation rounds), group-major in the given
        order. A group keeps one prompt entry per round its rows came from (equal token ids;
        each row's ``prompt_index`` points at its own round's), so each row keeps its own
        round's prompt routes (the routing record of the prompt's forward in that round).

        Raises:
          ValueError: a group is empty or its rows answer prompts of different token ids.
        """
        rows = [i for grp in groups for i in grp]
        index = np.asarray(self.gen.prompt_index)
        prompts, prompt_index = [], []      # per (group, round) its prompt; per row its entry
        for grp in groups:
            owners = sorted({int(index[i]) for i in grp})
            if not grp or any(self.prompts[o] != self.prompts[owners[0]] for o in owners):
                raise ValueError(f"a group's rows must answer one prompt, got prompts {owners}")
            prompt_index += [len(prompts) + owners.index(int(index[i])) for i in grp]
            prompts += owners
        take = lambda a: None if a is None else np.asarray(a)[rows]  # noqa: E731
        gen = generate.GenerationResult(
            take(self.gen.tokens), take(self.gen.logprobs), take(self.gen.lengths),
            take(self.gen.finish_reason), np.asarray(prompt_index, np.int32),
            take(self.gen.routes), None if self.gen.prompt_routes is None
            else tuple(self.gen.prompt_routes[b] for b in prompts), take(self.gen.versions))
        out = StepRollouts(self.step, [self.prompts[b] for b in prompts], gen,
                           [self.rollouts[i] for i in rows], gen_seconds=self.gen_seconds,
                           gen_tokens=self.gen_tokens, truncated=self.truncated)
        out.learner_version = self.learner_version
        return out

    # ------------------------------------------------------------------ in a checkpoint

    def to_json(self) -> dict:
        """The generation of this step (not its execution: resubmitted on resume)."""
        n = len(self.rollouts)
        return dict(step=self.step, prompts=[list(map(int, p)) for p in self.prompts],
                    completions=[self.completion(i).tolist() for i in range(n)],
                    logprobs=[self.gen.logprobs[i, :self.gen.lengths[i]].astype(float).tolist()
                              for i in range(n)],
                    finish_reason=self.gen.finish_reason.tolist(),
                    prompt_index=self.gen.prompt_index.tolist(),
                    **_routes_json(self.gen),
                    **({} if self.gen.versions is None else dict(versions=[
                        self.gen.versions[i, :self.gen.lengths[i]].tolist() for i in range(n)])),
                    **({} if self.group_ids is None else dict(group_ids=self.group_ids)),
                    rollouts=[dict(state_id=r.state_id, task_id=r.task_id, text=r.text,
                                   policy_version=r.policy_version) for r in self.rollouts],
                    gen_seconds=self.gen_seconds, gen_tokens=self.gen_tokens,
                    truncated=self.truncated)

    @classmethod
    def from_json(cls, d: dict, *, max_new_tokens: int, pad_id: int,
                  eos_ids: Sequence[int] = (), group_size: int = 1) -> "StepRollouts":
        """Inverse of ``to_json``; also reads the older per-rollout form (``rollouts`` holding
        ``prompt`` / ``completion`` / ``logprobs``, no finish reasons: EOS when the last token
        is one of ``eos_ids``)."""
        rows = d["rollouts"]
        if "completions" in d:
            comps, lps, reason = d["completions"], d["logprobs"], d["finish_reason"]
            prompts, index = d["prompts"], d["prompt_index"]
        else:   # older checkpoints
            comps = [r["completion"] for r in rows]
            lps = [r["logprobs"] for r in rows]
            reason = [int(generate.FinishReason.EOS if c and c[-1] in set(eos_ids)
                          else generate.FinishReason.LENGTH) for c in comps]
            prompts = [rows[b * group_size]["prompt"] for b in range(len(rows) // group_size)]
            index = [i // group_size for i in range(len(rows))]
        n, m = len(rows), max_new_tokens
        tokens = np.full((n, m), pad_id, np.int32)
        logprobs = np.zeros((n, m), np.float32)
        lengths = np.zeros((n,), np.int32)
        for i, (c, lp) in enumerate(zip(comps, lps)):
            tokens[i, :len(c)] = c
            logprobs[i, :len(c)] = lp
            lengths[i] = len(c)
        versions = None
        if "versions" in d:
            versions = np.zeros((n, m), np.int32)
            for i, v in enumerate(d["versions"]):
                versions[i, :len(v)] = v
        gen = generate.GenerationResult(tokens, logprobs, lengths, np.asarray(reason, np.int32),
                                        np.asarray(index, np.int32), *_routes_from_json(d, m),
                                        versions)
        rollouts = [Rollout(state_id=r["state_id"], task_id=r["task_id"], text=r["text"],
                            policy_version=r["policy_version"]) for r in rows]
        return cls(int(d["step"]), [list(p) for p in prompts], gen, rollouts,
                   gen_seconds=float(d.get("gen_seconds", 0.0)),
                   gen_tokens=int(d.get("gen_tokens", 0)), truncated=int(d.get("truncated", 0)),
                   group_ids=d.get("group_ids"))


def uint8_json(a: np.ndarray) -> dict:
    """A uint8 array (a routing record) as JSON: its shape and its bytes in base64."""
    return dict(shape=list(a.shape),
                data=base64.b64encode(np.ascontiguousarray(a, np.uint8)).decode())


def uint8_from_json(d: dict) -> np.ndarray:
    """Inverse of `uint8_json`."""
    return np.frombuffer(base64.b64decode(d["data"]), np.uint8).reshape(d["shape"])


def _routes_json(gen: generate.GenerationResult) -> dict:
    """The MoE routing record (if any) as JSON (`uint8_json`; the completion routes cut to
    each row's length)."""
    if gen.routes is None:
        return {}
    pack = uint8_json
    return dict(routes=[pack(gen.routes[i, :gen.lengths[i]]) for i in range(len(gen.lengths))],
                prompt_routes=[pack(r) for r in gen.prompt_routes])


def _routes_from_json(d: dict, max_new_tokens: int) -> tuple:
    """(routes uint8 [N, M, L, k] or None, prompt_routes tuple or None) from `_routes_json`."""
    if "routes" not in d:
        return None, None
    unpack = uint8_from_json
    rows = [unpack(x) for x in d["routes"]]
    out = np.full((len(rows), max_new_tokens) + rows[0].shape[1:], NO_ROUTE, np.uint8)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out, tuple(unpack(x) for x in d["prompt_routes"])
