"""Dynamic sampling: more generation rounds for an RL step whose groups carry no gradient
(``rl.dynamic_sampling`` = ``"dapo"`` | ``"reinforce_ada"``, ``rl.dynamic_sampling_rounds`` = R),
before the learner learns on it (``Trainer._refill``)."""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import numpy as np

from ace_jax.curriculum import learnability
from ace_jax.train.rollouts import StepRollouts

log = logging.getLogger("ace_jax.train.dynamic_sampling")


def refill(s: StepRollouts, *, kind: str, rounds: int, batch_states: int, group_size: int,
           atol: float, draw: Callable[[int], list], roll_out: Callable[[list], StepRollouts],
           eps: float = 1e-6, std_ddof: int = 1, normalise: bool = True) -> StepRollouts:
    """What the learner learns on for step ``s`` (rewarded, B = ``batch_states`` groups of
    G = ``group_size`` rows): ``s`` itself when ``rounds`` is 0.

    A group whose rewards all agree (within ``grpo.zero_variance_atol``) carries no
    gradient. For at most R rounds (fewer when the sampler has no state left that this step
    has not drawn), with the current policy:

    * ``rl.dynamic_sampling="dapo"``: while fewer than B groups are informative, the missing
      number of new states is drawn, generated, executed and rewarded; the learner gets the
      informative groups first, then zero-variance ones to keep B.
    * ``"reinforce_ada"``: each of the step's states whose samples so far all agree gets G
      more; a state that found a spread learns on G of its samples balanced between its
      best (ceil(G/2)) and worst (floor(G/2)) rewards, the others on their first G. As in
      Reinforce-Ada, the advantages are computed from the global statistics of every sample of
      the state (`global_advantages`), not from the G kept: the learner takes them as they are
      (``StepRollouts.advantages``).

    Every round's rows are appended to ``s`` (``StepRollouts.extend``): their executions
    grow the buffer and are logged like the step's own, and ``s.gen_tokens`` counts them.

    Args:
      kind: "dapo" | "reinforce_ada"; atol: ``grpo.zero_variance_atol``.
      eps / std_ddof / normalise: Reinforce-Ada's advantage, (r - mean) / (std + eps) with
        ``normalise`` (GRPO's estimator), r - mean without (Dr.GRPO's).
      draw: n -> n new buffer states for this step (``learnability.InsufficientStatesError``
        when the sampler has none left).
      roll_out: states -> their G completions each for this step, generated with the current
        policy, executed and rewarded (a ``StepRollouts``).
    """
    b, g = batch_states, group_size
    ada = kind == "reinforce_ada"
    own = {i: [i * g + j for j in range(g)] for i in range(b)}   # a state's rows (ada)

    def spread(rows) -> bool:
        r = s.rewards()[rows]
        return r.max() - r.min() > atol

    def informative() -> list[int]:
        return [i for i in range(len(s.prompts)) if spread(range(i * g, (i + 1) * g))]

    s.refill_rounds = 0
    while s.refill_rounds < rounds:
        if ada:
            again = [i for i in range(b) if not spread(own[i])]
            if not again:
                break
            states = [s.rollouts[i * g].state for i in again]
        else:
            if len(informative()) >= b:
                break
            try:
                states = draw(b - len(informative()))
            except learnability.InsufficientStatesError as e:
                log.info("dynamic sampling of step %d stopped after %d rounds: %s", s.step,
                         s.refill_rounds, e)
                break
        more = roll_out(states)
        first = len(s.rollouts)
        s.extend(more)
        if ada:
            for k, i in enumerate(again):
                own[i] += [first + k * g + j for j in range(g)]
        s.refill_rounds += 1
    if len(s.prompts) == b:
        return s
    if ada:
        rewards = s.rewards()
        groups = [balanced_group(own[i], rewards, g, atol) for i in range(b)]
        out = s.select_rows(groups)
        out.advantages = np.concatenate([
            global_advantages(rewards, own[i], grp, atol=atol, eps=eps, std_ddof=std_ddof,
                              normalise=normalise) for i, grp in enumerate(groups)])
        return out
    keep = informative()
    chosen = sorted((keep + [i for i in range(len(s.prompts)) if i not in keep])[:b])
    return s.select_groups(chosen, g)

def balanced_group(rows: Sequence[int], rewards: np.ndarray, group_size: int,
                   atol: float) -> list[int]:
    """G of a state's sample ``rows`` (Reinforce-Ada's balanced group): when their
    ``rewards`` spread by more than ``atol``, the ceil(G/2) best and floor(G/2) worst (ties
    by row order), else the first G; in row order."""
    r = np.asarray(rewards)[list(rows)]
    if r.max() - r.min() <= atol:
        return list(rows[:group_size])
    ranked = sorted(rows, key=lambda i: (-rewards[i], i))
    return sorted(ranked[:(group_size + 1) // 2] + ranked[len(ranked) - group_size // 2:])


def global_advantages(rewards: np.ndarray, rows: Sequence[int], kept: Sequence[int], *,
                      atol: float, eps: float, std_ddof: int, normalise: bool = True
                      ) -> np.ndarray:
    """float32 [len(kept)]: the advantages of a state's ``kept`` rows with Reinforce-Ada's
    global baseline: the mean (and, with ``normalise``, the std with ``std_ddof``) of the
    rewards of all its sample ``rows`` (every round's), not of the kept ones alone; 0 when all
    its rewards agree within ``atol`` (no signal, as the learner's zero-variance rule)."""
    r = np.asarray(rewards, np.float64)
    every, k = r[list(rows)], r[list(kept)]
    if every.max() - every.min() <= atol:
        return np.zeros(len(kept), np.float32)
    adv = k - every.mean()
    if normalise:
        adv = adv / (every.std(ddof=std_ddof) + eps)
    return adv.astype(np.float32)
