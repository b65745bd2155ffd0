"""The probe: fixed states and keys, the same for every sampler and config. Two parts: an
in-distribution probe on the training tasks and a held-out probe on tasks neither SFT nor RL sees.

What the training curves (``rollout/valid_rate``, ``score/dev_norm_all``) measure depends on the
states the sampler picks: a sampler that moves the batch to easier or harder states changes them
without the policy changing. The probe holds the states fixed: a set of states built once from
the run's ``seed``, evaluated with fixed sampling keys every ``probe.every`` learner updates.
Fixed is not unseen: on the training tasks the probe is in-distribution (below).

* for each probed training task (``probe.train_tasks``, default every task of ``tasks.ids``) and
  each held-out task (``probe.heldout_tasks``: tasks neither the warm start nor RL ever sees), one
  state per kind of ``probe.kinds``: ``draft`` (no code: write a solution) and ``improve`` (a
  reference solution of the seed corpus, chosen by ``seed``, with its measured dev score:
  improve on it). A task without seed scripts gets no improve state: a held-out procedural
  instance has none (``sandbox.seed_corpus.list_scripts`` refuses it), so its one state is its
  draft, whose prompt is rendered from its own task page alone;
* ``probe.samples`` completions per training-task state and ``probe.heldout_samples`` (0: the
  same) per held-out state, at the run's temperature, keys from ``seed`` alone;
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
  and the same three with ``_train`` (training tasks: IN-DISTRIBUTION) and ``_heldout``
  (held-out tasks) appended. ``probe/<metric>`` without a suffix mixes both parts, weighted by
  their completions: quote ``_train`` (in-distribution) or the held-out keys.

The held-out probe (issue 51) writes the same three over the held-out states:

  probe/heldout_<metric>            every held-out state (the same numbers as the older name
                                    ``probe/<metric>_heldout``, still written for the tables)
  probe/heldout_instances_<metric>  held-out instances of the procedural family's training
                                    kinds (``sandbox.tasks.procedural`` split "heldout")
  probe/heldout_family_<metric>     the held-out family (split "heldout_family": a generator
                                    kind no training instance has)

(a group with no state writes nothing). ``validate`` refuses a procedural held-out instance in
``tasks.ids`` and a procedural training instance in ``probe.heldout_tasks``; the run's buffer,
SFT examples and training batches hold training tasks only (``tests/ace_jax/train/
test_heldout.py`` checks a whole run).

What the in-distribution part measures. On the training tasks the ``_train`` metrics are
performance on training prompts, scored as in training:

* a ``draft`` state (no code, no history) renders the same prompt as the buffer's root of its
  task, an empty draft the sampler may draw at any step (with ``lp.max_child_frac = 0.3`` most
  of a step's rollouts are on these roots), and as the SFT stage's draft prompt;
* an ``improve`` state holds a seed-corpus reference script, the scripts SFT trains the policy
  to write (the buffer holds it only with ``rl.seed_with_references``, which a probed run should
  leave off);
* ``probe/score`` is the normalised dev score, the signal the training reward is made of.

Resolution of the held-out probe. A probe's rate over n completions has a sampling standard error
of at most sqrt(p (1 - p) / n) (fixed states with per-state rates p_i: mean p_i (1 - p_i) / n is
smaller still). A change is a difference of two probes, so its standard error is
sqrt(2 p (1 - p) / n) (an upper bound: two probes at one seed share states and keys, common random
numbers that make a paired difference less noisy). ``configs/local.py:procedural`` probes every
held-out draft, 41 held-out instances and 48 held-out-family instances, with
``heldout_samples = 8``: n = 328, 384 and 712 together. For a valid rate near 0.3 to 0.5:

  n = 712 (probe/heldout_*)       one probe difference: SE 0.024-0.027, 95% half-width
                                   0.048-0.052; the mean of 5 seeds: SE 0.011-0.012, 95% Student-t
                                   half-width 0.030-0.033, 80%-power detectable 0.040-0.044
  n = 328 (heldout_instances_*)   one difference: SE 0.036-0.039 (half-width 0.070-0.077);
                                   5 seeds: half-width 0.044-0.048, detectable 0.059-0.065
  n = 384 (heldout_family_*)      one difference: SE 0.033-0.036 (half-width 0.065-0.071);
                                   5 seeds: half-width 0.041-0.045, detectable 0.055-0.060

(detectable = (t(0.975, 4) + t(0.8, 4)) SE, as ``ace_jax.experiments.tables.detectable_effect``.)
So a 0.05 change in ``probe/heldout_valid_rate`` is resolved by the 5-seed mean with 80% power and
about at the 95% level by a single probe difference; per group a 0.05 change is resolved at the
95% level by the 5-seed mean (power 0.6-0.7); ``heldout_samples = 16`` brings the per-group
detectable change to 0.042-0.046. These are the probe's own sampling noise: seed-to-seed
variation of the trained policy adds to it (the tables' intervals use the observed spread). The
default ``configs/local.py``'s held-out part (2 offline tasks, 4 states x 2 samples = 8
completions) has a single-difference SE of 0.25 and resolves nothing.
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
# Groups of probe states: the training tasks (in-distribution) and the held-out ones; a held-out
# procedural instance is also in the group of its split (``heldout_group``).
TRAIN, HELDOUT = "train", "heldout"
HELDOUT_GROUPS = {"heldout": "heldout_instances", "heldout_family": "heldout_family"}
# Added to the run's seed for the probe's sampling keys: a stream no other part of the run draws.
KEY_OFFSET = 7_919


def default_config() -> ml_collections.ConfigDict:
    """The ``probe`` section (read by ``ace_jax.train.trainer``)."""
    c = ml_collections.ConfigDict()
    c.every = 0                  # learner updates between probes; 0 = no probe
    c.heldout_tasks = ()         # task ids of tasks.source that neither SFT nor RL sees
    c.train_tasks = ()           # the training tasks probed in-distribution; () = all tasks.ids
    c.kinds = KINDS              # the states of each task: draft and / or improve
    c.samples = 2                # completions per state of a training task
    c.heldout_samples = 0        # completions per held-out state; 0 = samples
    # Probe the parameters before the first update (after 0 updates). False skips it: a run
    # started from another run's checkpoint whose own last probe measured the same parameters
    # with the same states and keys (an experiment's shared warm start, whose run with
    # rl.num_steps=0 probes them once for all its arms).
    c.at_start = True
    return c


def heldout_group(task_id: str) -> str:
    """The held-out group of a held-out task: "heldout_instances" / "heldout_family" for a
    procedural instance of split "heldout" / "heldout_family", else "heldout"."""
    from sandbox.tasks import procedural

    if procedural.is_procedural(task_id):
        return HELDOUT_GROUPS.get(procedural.instance_split(task_id), HELDOUT)
    return HELDOUT


def validate(cfg: ml_collections.ConfigDict) -> list[str]:
    """What is wrong with a run config's ``probe`` section, or with the held-out split of its
    tasks (empty list: nothing)."""
    from sandbox.tasks import procedural

    p, errors = cfg.probe, []
    if p.every < 0:
        errors.append(f"probe.every={p.every} must be >= 0 (0 = no probe)")
    if p.every and p.samples < 1:
        errors.append(f"probe.samples={p.samples} must be >= 1")
    if p.heldout_samples < 0:
        errors.append(f"probe.heldout_samples={p.heldout_samples} must be >= 0 (0 = "
                      "probe.samples)")
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
    not_trained = [t for t in p.train_tasks if cfg.tasks.ids and t not in cfg.tasks.ids]
    if not_trained:
        errors.append(f"probe.train_tasks {not_trained} are not in tasks.ids: the "
                      "in-distribution probe takes training tasks only")
    # The procedural family's split is fixed by the ids (sandbox.tasks.procedural): whatever the
    # probe measures, its held-out instances are never trained on, and its training instances
    # (in the SFT corpus) are never called held out.
    held = [t for t in cfg.tasks.ids if procedural.is_procedural(t)
            and procedural.instance_split(t) != "train"]
    if held:
        errors.append(f"tasks.ids holds held-out procedural instances {held} (split "
                      f"{sorted({procedural.instance_split(t) for t in held})}): they are never "
                      "trained on; train on procedural.split_ids('train') and probe these with "
                      "probe.heldout_tasks")
    seen = [t for t in p.heldout_tasks if procedural.is_training_instance(t)]
    if seen:
        errors.append(f"probe.heldout_tasks {seen} are procedural training instances (in the SFT "
                      "corpus), not held out: take held-out ones from "
                      "procedural.split_ids('heldout') / ('heldout_family')")
    return errors


@dataclasses.dataclass(frozen=True)
class ProbeState:
    """One probe prompt: the buffer-style state it renders, whether its task is held out and its
    held-out group (``heldout_group``; "train" for a training task)."""
    state: buffer_lib.State
    heldout: bool
    group: str = ""

    def __post_init__(self):
        if not self.group:
            object.__setattr__(self, "group", HELDOUT if self.heldout else TRAIN)

    @property
    def kind(self) -> str:
        return agent.step_kind(self.state)


def build_states(train_tasks: Sequence[Any], heldout_tasks: Sequence[Any], *, seed: int,
                 kinds: Sequence[str] = KINDS, corpus_seed: int = 0) -> list[ProbeState]:
    """The probe's states: per task (training tasks first, then held-out, each in the given
    order), one state per kind. ``improve`` takes the reference solution (seed corpus, measured
    with sweep ``corpus_seed``) that ``random.Random(seed)`` picks among the task's scored ones;
    a task without one (a held-out procedural instance: no seed scripts) gets no improve state.
    State ids are negative (never a buffer id)."""
    out: list[ProbeState] = []
    for heldout, tasks in ((False, train_tasks), (True, heldout_tasks)):
        refs = seeds.reference_solutions(tasks, corpus_seed) if "improve" in kinds else []
        for task in tasks:
            rng = random.Random(f"{seed}/{task.task_id}")
            group = heldout_group(task.task_id) if heldout else TRAIN
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
                    heldout=heldout, group=group))
    return out


def sampling_key(seed: int) -> jax.Array:
    """The probe's sampling key: the run's seed alone (the same at every probe of a run)."""
    return jax.random.key(seed + KEY_OFFSET)


def heldout_key(seed: int) -> jax.Array:
    """The held-out states' key when they are sampled apart (``probe.heldout_samples`` differs
    from ``probe.samples``): a stream of ``sampling_key``'s own."""
    return jax.random.fold_in(sampling_key(seed), 1)


@dataclasses.dataclass
class Probe:
    """The probe of one run: its states, tasks and targets (see the module doc).

    ``run`` generates ``samples`` completions per training-task state and ``heldout_samples``
    (0: ``samples``) per held-out state with ``generate(prompts, key, n)``, parses and executes
    them on ``pool`` and returns the ``probe/*`` metrics."""
    states: list[ProbeState]
    tasks: Mapping[str, Any]          # task id -> Task, training and held-out
    targets: Mapping[str, Any]        # task id -> its TaskTargets (sandbox.tasks.targets)
    samples: int
    seed: int
    every: int
    heldout_samples: int = 0
    at_start: bool = True

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict, train_tasks: Sequence[Any],
                    heldout_tasks: Sequence[Any]) -> Optional["Probe"]:
        """The run's probe, or None when ``probe.every`` is 0. ``train_tasks``: the run's
        training tasks (``probe.train_tasks`` picks among them); ``heldout_tasks``: those of
        ``probe.heldout_tasks``."""
        p = cfg.probe
        if not p.every:
            return None
        if p.train_tasks:
            by_id = {t.task_id: t for t in train_tasks}
            missing = [i for i in p.train_tasks if i not in by_id]
            if missing:
                raise ValueError(f"probe.train_tasks {missing} are not training tasks of this "
                                 f"run ({sorted(by_id)})")
            train_tasks = [by_id[i] for i in p.train_tasks]
        states = build_states(train_tasks, heldout_tasks, seed=int(cfg.seed),
                              kinds=tuple(p.kinds), corpus_seed=int(cfg.tasks.seed))
        tasks = {t.task_id: t for t in (*train_tasks, *heldout_tasks)}
        return cls(states, tasks, {i: task_targets(t) for i, t in tasks.items()},
                   int(p.samples), int(cfg.seed), int(p.every), int(p.heldout_samples),
                   bool(p.at_start))

    def due(self, updates: int) -> bool:
        """Whether the parameters after ``updates`` learner updates are probed on the way:
        every ``every`` updates, the first (0 updates) only ``at_start`` (the trainer probes
        after the last update too)."""
        return updates % self.every == 0 and (updates > 0 or self.at_start)

    def batches(self) -> list[tuple[list[int], int, jax.Array]]:
        """The generation calls of one probe: (state indices, completions per state, key).
        One call over every state with ``sampling_key`` while held-out states take ``samples``
        (so a config without ``heldout_samples`` is probed exactly as before); otherwise the
        training-task states with ``sampling_key`` and the held-out ones with ``heldout_key``."""
        n_held = self.heldout_samples or self.samples
        if n_held == self.samples:
            return [(list(range(len(self.states))), self.samples, sampling_key(self.seed))]
        train = [i for i, s in enumerate(self.states) if not s.heldout]
        held = [i for i, s in enumerate(self.states) if s.heldout]
        return [(idx, n, key) for idx, n, key in (
            (train, self.samples, sampling_key(self.seed)),
            (held, n_held, heldout_key(self.seed))) if idx]

    def run(self, prompt_ids: Callable[[ProbeState], list[int]],
            generate: Callable[[list[list[int]], jax.Array, int], Any], pool: Any,
            decode: Callable[[Sequence[int]], str], *, max_code_chars: int,
            rewards_cfg: ml_collections.ConfigDict) -> dict[str, float]:
        """One probe of the current parameters; returns the ``probe/*`` metrics (no
        ``probe/updates``: the caller knows it)."""
        rows = []   # (probe state, future or None)
        for idx, n, key in self.batches():
            gen = generate([prompt_ids(self.states[i]) for i in idx], key, n)
            tokens, lengths = np.asarray(gen.tokens), np.asarray(gen.lengths)
            index = np.asarray(gen.prompt_index)
            for i in range(tokens.shape[0]):
                ps = self.states[idx[int(index[i])]]
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
            outcomes.append((ps.group, float(ok), norm, rank))
        return summarize(outcomes)


def _group(g: Any) -> str:
    """An outcome's group: a group name, or a bool (held out or not: "heldout" / "train")."""
    if isinstance(g, (bool, np.bool_)):
        return HELDOUT if g else TRAIN
    return str(g)


def summarize(outcomes: Sequence[tuple[Any, float, float, Optional[float]]]
              ) -> dict[str, float]:
    """``probe/*`` metrics from per-completion (group, valid 0/1, normalised score, HumanRank or
    None); the group is "train", "heldout" or a held-out group of ``HELDOUT_GROUPS`` (or a bool:
    held out or not). Means over all (``probe/<m>``), over training tasks (``probe/<m>_train``),
    over held-out ones (``probe/<m>_heldout`` and ``probe/heldout_<m>``) and per held-out group
    (``probe/<group>_<m>``); a group with no completion, or HumanRank with no leaderboard, is
    left out."""
    m: dict[str, float] = {}
    rows = [(_group(o[0]), *o[1:]) for o in outcomes]
    held = [o for o in rows if o[0] != TRAIN]
    groups = [("probe/{}", rows), ("probe/{}_train", [o for o in rows if o[0] == TRAIN]),
              ("probe/{}_heldout", held), ("probe/heldout_{}", held)]
    groups += [(f"probe/{g}_{{}}", [o for o in rows if o[0] == g])
               for g in HELDOUT_GROUPS.values()]
    for name, part in groups:
        if not part:
            continue
        m[name.format("valid_rate")] = float(np.mean([o[1] for o in part]))
        m[name.format("score")] = float(np.mean([o[2] for o in part]))
        ranks = [o[3] for o in part if o[3] is not None]
        if ranks:
            m[name.format("humanrank")] = float(np.mean(ranks))
    return m
