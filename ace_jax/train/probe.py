"""The probe: a sampler-neutral measure of the policy, the same for every sampler and config.

What the training curves (``rollout/valid_rate``, ``score/dev_norm_all``) measure depends on the
states the sampler picks: a sampler that moves the batch to easier or harder states changes them
without the policy changing. The probe holds that fixed. It is a set of states built once from
the run's ``seed`` and from data the sampler never chooses from, evaluated with fixed sampling
keys every ``probe.every`` learner updates:

* for each training task and each held-out task (``probe.heldout_tasks``: tasks neither the warm
  start nor RL ever sees), one state per kind of ``probe.kinds``:
  ``draft`` (no code: write a solution) and ``improve`` (a reference solution of the seed corpus,
  chosen by ``seed``, with its measured dev score: improve on it). The buffer never holds these
  states (its roots are empty drafts; reference solutions enter it only with
  ``rl.seed_with_references``, which a probed run should leave off);
* ``probe.samples`` completions per state at the run's temperature, keys from ``seed`` alone;
* each valid action is executed on the test split (the dev score for the normalised score, the
  final-test score for HumanRank), as evaluation does.

So two runs with the same ``seed`` and different samplers (or objectives) are probed on the same
prompts with the same keys; only the parameters differ. Metrics (``metrics.jsonl``; the line of
RL step s holds the probe of the parameters after s updates, measured before that step's
update; the probe after the last update is a line of its own at the run's step count,
``rl.num_steps`` unless ``rl.token_budget`` stopped it earlier):

  probe/valid_rate   share of completions whose script ran and wrote a valid submission
  probe/score        mean normalised dev score (``rewards.normalised_score``), failures 0
  probe/humanrank    mean HumanRank of the final-test score on the task's reference
                     leaderboard, failures 0 (tasks without a leaderboard left out)
  probe/updates      learner updates of the parameters probed
  and the same three with ``_train`` / ``_heldout`` (training / held-out tasks) appended.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import ml_collections
import numpy as np

from ace_jax.curriculum import buffer as buffer_lib, seeds
from ace_jax.env import agent, rewards
from sandbox.result import Status
from sandbox.tasks.targets import task_targets

KINDS = ("draft", "improve")
METRICS = ("valid_rate", "score", "humanrank")
# Added to the run's seed for the probe's sampling keys: a stream no other part of the run draws.
KEY_OFFSET = 7_919


def default_config() -> ml_collections.ConfigDict:
    """The ``probe`` section (read by ``ace_jax.train.trainer``)."""
    c = ml_collections.ConfigDict()
    c.every = 0                  # learner updates between probes; 0 = no probe
    c.heldout_tasks = ()         # task ids of tasks.source that neither SFT nor RL sees
    c.kinds = KINDS              # the states of each task: draft and / or improve
    c.samples = 2                # completions per state
    return c


def validate(cfg: ml_collections.ConfigDict) -> list[str]:
    """What is wrong with a run config's ``probe`` section (empty list: nothing)."""
    p, errors = cfg.probe, []
    if p.every < 0:
        errors.append(f"probe.every={p.every} must be >= 0 (0 = no probe)")
    if p.every and p.samples < 1:
        errors.append(f"probe.samples={p.samples} must be >= 1")
    bad = [k for k in p.kinds if k not in KINDS]
    if bad or (p.every and not p.kinds):
        errors.append(f"probe.kinds={tuple(p.kinds)}: each one of {KINDS}, at least one")
    overlap = set(p.heldout_tasks) & set(cfg.tasks.ids)
    if overlap:
        errors.append(f"probe.heldout_tasks {sorted(overlap)} are also in tasks.ids: a held-out "
                      "task must be one RL never trains on")
    if p.heldout_tasks and not cfg.tasks.ids:
        errors.append("probe.heldout_tasks with tasks.ids=() (every task): nothing is held out; "
                      "list the training tasks in tasks.ids")
    return errors


@dataclasses.dataclass(frozen=True)
class ProbeState:
    """One probe prompt: the buffer-style state it renders and whether its task is held out."""
    state: buffer_lib.State
    heldout: bool

    @property
    def kind(self) -> str:
        return agent.step_kind(self.state)


def build_states(train_tasks: Sequence[Any], heldout_tasks: Sequence[Any], *, seed: int,
                 kinds: Sequence[str] = KINDS, corpus_seed: int = 0) -> list[ProbeState]:
    """The probe's states: per task (training tasks first, then held-out, each in the given
    order), one state per kind. ``improve`` takes the reference solution (seed corpus, measured
    with sweep ``corpus_seed``) that ``random.Random(seed)`` picks among the task's scored ones;
    a task without one gets no improve state. State ids are negative (never a buffer id)."""
    out: list[ProbeState] = []
    for heldout, tasks in ((False, train_tasks), (True, heldout_tasks)):
        refs = seeds.reference_solutions(tasks, corpus_seed) if "improve" in kinds else []
        for task in tasks:
            rng = random.Random(f"{seed}/{task.task_id}")
            for kind in kinds:
                if kind == "draft":
                    code, score = "", None
                else:
                    own = [r for r in refs if r.task_id == task.task_id]
                    if not own:
                        continue
                    ref = rng.choice(own)
                    code, score = ref.code, ref.score
                out.append(ProbeState(buffer_lib.State(
                    state_id=-1 - len(out), task_id=task.task_id, parent_id=None, depth=0,
                    code=code, history=[], score=score, origin="probe", created_step=0),
                    heldout=heldout))
    return out


def sampling_key(seed: int) -> jax.Array:
    """The probe's sampling key: the run's seed alone (the same at every probe of a run)."""
    return jax.random.key(seed + KEY_OFFSET)


@dataclasses.dataclass
class Probe:
    """The probe of one run: its states, tasks and targets (see the module doc).

    ``run`` generates ``samples`` completions per state with ``generate(prompts, key, n)``,
    parses and executes them on ``pool`` and returns the ``probe/*`` metrics."""
    states: list[ProbeState]
    tasks: Mapping[str, Any]          # task id -> Task, training and held-out
    targets: Mapping[str, Any]        # task id -> its TaskTargets (sandbox.tasks.targets)
    samples: int
    seed: int
    every: int

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict, train_tasks: Sequence[Any],
                    heldout_tasks: Sequence[Any]) -> Optional["Probe"]:
        """The run's probe, or None when ``probe.every`` is 0."""
        p = cfg.probe
        if not p.every:
            return None
        states = build_states(train_tasks, heldout_tasks, seed=int(cfg.seed),
                              kinds=tuple(p.kinds), corpus_seed=int(cfg.tasks.seed))
        tasks = {t.task_id: t for t in (*train_tasks, *heldout_tasks)}
        return cls(states, tasks, {i: task_targets(t) for i, t in tasks.items()},
                   int(p.samples), int(cfg.seed), int(p.every))

    def due(self, updates: int) -> bool:
        """Whether the parameters after ``updates`` learner updates are probed on the way:
        every ``every`` updates (the trainer probes after the last update too)."""
        return updates % self.every == 0

    def run(self, prompt_ids: Callable[[ProbeState], list[int]],
            generate: Callable[[list[list[int]], jax.Array, int], Any], pool: Any,
            decode: Callable[[Sequence[int]], str], *, max_code_chars: int,
            rewards_cfg: ml_collections.ConfigDict) -> dict[str, float]:
        """One probe of the current parameters; returns the ``probe/*`` metrics (no
        ``probe/updates``: the caller knows it)."""
        prompts = [prompt_ids(s) for s in self.states]
        gen = generate(prompts, sampling_key(self.seed), self.samples)
        tokens, lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
        rows = []   # (probe state, future or None)
        for i in range(tokens.shape[0]):
            ps = self.states[int(np.asarray(gen.prompt_index)[i])]
            action = agent.parse_action(decode(tokens[i, :lengths[i]].tolist()),
                                        max_code_chars=max_code_chars)
            task = self.tasks[ps.state.task_id]
            rows.append((ps, pool.submit(task, action.code, split="test")
                         if action.valid else None))
        outcomes = []
        for ps, fut in rows:
            res = None if fut is None else fut.result()
            ok = res is not None and res.status is Status.OK and res.dev_score is not None
            task = self.tasks[ps.state.task_id]
            norm = (rewards.normalised_score(
                res.dev_score, self.targets[task.task_id], clip_low=rewards_cfg.norm_clip_low,
                clip_high=rewards_cfg.norm_clip_high) if ok else 0.0)
            rank = (float(task.position_score(res.test_score if ok else None))
                    if task.has_leaderboard else None)
            outcomes.append((ps.heldout, float(ok), norm, rank))
        return summarize(outcomes)


def summarize(outcomes: Sequence[tuple[bool, float, float, Optional[float]]]
              ) -> dict[str, float]:
    """``probe/*`` metrics from per-completion (heldout, valid 0/1, normalised score,
    HumanRank or None): means over all, over training and over held-out tasks (a group with
    no completion, or HumanRank with no leaderboard, is left out)."""
    m: dict[str, float] = {}
    groups = {"": outcomes, "_train": [o for o in outcomes if not o[0]],
              "_heldout": [o for o in outcomes if o[0]]}
    for suffix, rows in groups.items():
        if not rows:
            continue
        m[f"probe/valid_rate{suffix}"] = float(np.mean([o[1] for o in rows]))
        m[f"probe/score{suffix}"] = float(np.mean([o[2] for o in rows]))
        ranks = [o[3] for o in rows if o[3] is not None]
        if ranks:
            m[f"probe/humanrank{suffix}"] = float(np.mean(ranks))
    return m
