"""Running one episode: a policy's implementer steps on one task, advice, the final submission.

An *episode* is one policy on one task with one seed (``run_episode``):

* up to ``max_steps`` implementer steps, or until the wall-clock ``time_budget_s`` (seconds,
  checked before each step; a running step is never cut, the sandbox has its own per-execution
  limit) is spent. The first step drafts from an empty state; each later step *debugs* (after a
  failed execution) or *improves* (after a valid submission) the *current* state, which is the
  best valid attempt so far, or the latest executed attempt while none is valid.
* the running state is a ``buffer.State`` whose history is built exactly as the trainer's buffer
  builds a child's (``StepSummary`` per execution, ``buffer.history_len`` kept, stderr tail of
  ``buffer.stderr_tail_chars``), so the prompts (``agent.render_messages``) are the training ones.
  Steps that execute nothing (an invalid-format completion, a policy error, a help request) add no
  history, as in training, where they make no state.
* a policy error (``Completion.error``), an invalid-format completion and a crashing script are
  that step's outcome (status ``policy_error`` / ``invalid_format`` / the sandbox status); the
  episode goes on.
* the final submission is the step with the best dev score (ties: the earliest step); its script
  is executed again ONCE with ``split="test"`` (the pool grades the final-test half only then).
  That test score is what every metric uses; the dev scores never count.

Advisor (MLE-Ideator) hook: with an ``advice.Advisor``, after step t the runner asks for advice
when the completion held ``advice.SEEK_HELP_TAG`` and no valid code (reason ``seek_help``), or
when the best dev score has not improved for ``stagnation_steps`` consecutive steps (reason
``stagnation``; the counter restarts after each request, and a first valid submission counts as
an improvement). A valid ``Advice.instruction`` goes into the prompt of step t + 1 only. No request
is made after the last step (``max_steps``). Without an advisor a help request is an invalid step.

Seeds: step t of an episode with seed s samples the policy with seed ``s * 10_000 + t``; the
advisor called after step t gets ``s * 10_000 + 5_000 + t``.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any, Callable, Optional, Union

import ml_collections

from ace_jax.curriculum import buffer as buffer_lib
from ace_jax.env import agent
from ace_jax.env.advice import Advice, AdviceRequest, Advisor, Attempt, SEEK_HELP_TAG
from ace_jax.eval.episodes import Episode, EpisodeStep, FinalSubmission, JsonlLog, finite
from ace_jax.eval.scoring import score_episode
from ace_jax.policy.interface import Completion
from sandbox.grading import improves
from sandbox.result import ExecutionResult, Status

SEED_STRIDE = 10_000          # policy seed of step t in episode seed s: s * SEED_STRIDE + t
ADVICE_SEED_OFFSET = 5_000    # advisor seed after step t: s * SEED_STRIDE + ADVICE_SEED_OFFSET + t


def _better(task: Any, a: Optional[float], b: Optional[float]) -> bool:
    """True when score ``a`` is strictly better than ``b`` (a None ``b`` is beaten by any score)."""
    return improves(a, b, task.lower_is_better)


def step_seed(seed: int, step: int) -> int:
    """The policy's sampling seed at ``step`` (1-indexed) of an episode with ``seed``."""
    return int(seed) * SEED_STRIDE + int(step)


def advice_seed(seed: int, step: int) -> int:
    """The advisor's seed for the request made after ``step``."""
    return int(seed) * SEED_STRIDE + ADVICE_SEED_OFFSET + int(step)


def _safe_complete(policy: Any, messages: list[dict[str, str]], seed: int,
                   lock: Optional[threading.Lock]) -> Completion:
    """One completion; a policy that raises becomes a ``Completion`` with ``error`` set."""
    try:
        if lock is None:
            out = policy.complete([messages], seed=seed)
        else:
            with lock:
                out = policy.complete([messages], seed=seed)
        if len(out) != 1:
            raise ValueError(f"policy returned {len(out)} completions for 1 conversation")
        c = out[0]
        if c.error is None and not isinstance(c.text, str):
            raise TypeError(f"completion text is {type(c.text).__name__}, not str")
        return c
    except Exception as e:  # a broken policy is this step's outcome, not the run's end
        return Completion(text="", error=f"{type(e).__name__}: {e}"[:1000], finish_reason="error")


def _safe_advise(advisor: Advisor, request: AdviceRequest, seed: int) -> Advice:
    try:
        adv = advisor.advise(request, seed=seed)
        if not isinstance(adv, Advice):
            raise TypeError(f"advisor returned {type(adv).__name__}, not Advice")
        return adv
    except Exception as e:  # an advisor failure is recorded; the episode goes on
        return Advice(instruction=None, valid=False, error=f"{type(e).__name__}: {e}"[:1000])



class _EpisodeRunner:
    """The mutable state of one episode; ``run_episode`` is its public face."""

    def __init__(self, policy: Any, task: Any, pool: Any, *, seed: int, max_steps: int,
                 time_budget_s: Optional[float], advisor: Optional[Advisor],
                 stagnation_steps: int, agent_cfg: ml_collections.ConfigDict,
                 buffer_cfg: ml_collections.ConfigDict, log: JsonlLog,
                 policy_lock: Optional[threading.Lock], clock: Callable[[], float]):
        self.policy, self.task, self.pool = policy, task, pool
        self.seed, self.max_steps, self.time_budget_s = int(seed), int(max_steps), time_budget_s
        self.advisor, self.stagnation_steps = advisor, int(stagnation_steps)
        self.agent_cfg, self.log, self.lock, self.clock = agent_cfg, log, policy_lock, clock
        self.history_len = int(buffer_cfg.history_len)
        self.tail_chars = int(buffer_cfg.stderr_tail_chars)
        self.root = buffer_lib.State(state_id=0, task_id=task.task_id, parent_id=None, depth=0,
                                     code="", history=[], score=None, origin="evaluation",
                                     created_step=0)
        self.current = self.root            # the state the next step is prompted from
        self.best_state: Optional[buffer_lib.State] = None
        self.best: Optional[float] = None
        self.next_id = 1
        self.since_improvement = 0
        self.t0 = clock()
        self.episode = Episode(task_id=task.task_id, seed=self.seed,
                               policy=str(getattr(policy, "name", type(policy).__name__)),
                               metric=str(getattr(task, "metric", "")),
                               lower_is_better=bool(task.lower_is_better),
                               max_steps=self.max_steps, time_budget_s=time_budget_s,
                               log_path=None if log.path is None else str(log.path))

    def elapsed(self) -> float:
        return self.clock() - self.t0

    # -- one step --------------------------------------------------------------------------

    def step(self, n: int, advice: Optional[str]) -> EpisodeStep:
        state = self.current
        messages = agent.render_messages(state, self.task, self.agent_cfg, advice=advice)
        rec = EpisodeStep(step=n, kind=agent.step_kind(state), prompt=messages,
                          policy_seed=step_seed(self.seed, n), advice_in_prompt=advice)
        c = _safe_complete(self.policy, messages, rec.policy_seed, self.lock)
        rec.completion, rec.completion_error = c.text or "", c.error
        rec.finish_reason, rec.completion_tokens = c.finish_reason, int(c.completion_tokens)
        if c.error is not None:
            rec.status, rec.error = "policy_error", c.error
        else:
            self._act(rec, state)
        rec.improved = rec.valid and _better(self.task, rec.dev_score, self.best)
        if rec.improved:
            self.best = rec.dev_score
        rec.best_dev_so_far = self.best
        return rec

    def _act(self, rec: EpisodeStep, state: buffer_lib.State) -> None:
        action = agent.parse_action(rec.completion, max_code_chars=self.agent_cfg.max_code_chars)
        if isinstance(action, agent.InvalidAction):
            rec.invalid_reason, rec.error = action.reason.value, action.detail
            rec.seek_help = SEEK_HELP_TAG in rec.completion
            rec.status = "seek_help" if rec.seek_help and self.advisor is not None \
                else "invalid_format"
            return
        rec.code, rec.idea = action.code, action.idea
        result = self.pool.run(self.task, action.code, split="dev")
        self._record_execution(rec, result)
        self._add_child(state, rec, result)

    def _record_execution(self, rec: EpisodeStep, result: ExecutionResult) -> None:
        rec.status = result.status.value
        dev = buffer_lib.valid_dev_score(result)
        rec.dev_score = None if dev is None else float(dev)
        rec.reported_metric = result.reported_metric
        rec.exec_wall_s = float(result.wall_s or 0.0)
        rec.stderr_tail = result.stderr[-self.tail_chars:] if self.tail_chars > 0 else ""
        rec.error = result.error or ""

    def _add_child(self, parent: buffer_lib.State, rec: EpisodeStep,
                   result: ExecutionResult) -> None:
        """The executed attempt as a child state built as the buffer builds one
        (``buffer.child_history``); moves ``current``."""
        history = buffer_lib.child_history(parent.history, rec.kind, result,
                                           history_len=self.history_len,
                                           stderr_tail_chars=self.tail_chars)
        parent_score = parent.score
        score = rec.dev_score if _better(self.task, rec.dev_score, parent_score) else parent_score
        child = buffer_lib.State(
            state_id=self.next_id, task_id=parent.task_id, parent_id=parent.state_id,
            depth=parent.depth + 1, code=rec.code or "", history=history, score=score,
            origin="evaluation", created_step=rec.step)
        self.next_id += 1
        if rec.valid and (self.best_state is None
                          or _better(self.task, rec.dev_score, self.best_state.score)):
            self.best_state = child
        self.current = self.best_state if self.best_state is not None else child

    # -- advice ----------------------------------------------------------------------------

    def maybe_advise(self, rec: EpisodeStep, is_last: bool) -> Optional[str]:
        """Asks the advisor after ``rec`` when due; returns the instruction for the next step."""
        self.since_improvement = 0 if rec.improved else self.since_improvement + 1
        if self.advisor is None or is_last:
            return None
        if rec.seek_help:
            reason = "seek_help"
        elif 0 < self.stagnation_steps <= self.since_improvement:
            reason = "stagnation"
        else:
            return None
        self.since_improvement = 0
        request = AdviceRequest(task=self.task, attempts=self.attempts(),
                                current_score=self.best, current_code=self.current.code,
                                reason=reason)
        adv = _safe_advise(self.advisor, request, advice_seed(self.seed, rec.step))
        rec.advice_reason, rec.advice = reason, dataclasses.asdict(adv)
        return adv.instruction if adv.valid and adv.instruction else None

    def attempts(self) -> list[Attempt]:
        return [Attempt(step=s.step, kind=s.kind, code=s.code or "", status=s.status,
                        dev_score=s.dev_score, stderr_tail=s.stderr_tail)
                for s in self.episode.steps]

    # -- final -----------------------------------------------------------------------------

    def final(self) -> FinalSubmission:
        """Best dev step (earliest on ties), executed once on the final-test split."""
        chosen: Optional[EpisodeStep] = None
        for s in self.episode.steps:
            if s.valid and (chosen is None or _better(self.task, s.dev_score, chosen.dev_score)):
                chosen = s
        if chosen is None:
            return FinalSubmission()
        res = self.pool.run(self.task, chosen.code, split="test")
        ok = res.status is Status.OK and finite(res.test_score)
        return FinalSubmission(
            step=chosen.step, code=chosen.code, dev_score=chosen.dev_score,
            status=res.status.value, test_score=float(res.test_score) if ok else None,
            rerun_dev_score=res.dev_score, error=res.error or "",
            stderr_tail=res.stderr[-self.tail_chars:] if self.tail_chars > 0 else "")

    # -- the loop --------------------------------------------------------------------------

    def header(self) -> dict[str, Any]:
        return {"type": "header", "task_id": self.episode.task_id, "seed": self.seed,
                "policy": self.episode.policy, "metric": self.episode.metric,
                "lower_is_better": self.episode.lower_is_better, "max_steps": self.max_steps,
                "time_budget_s": self.time_budget_s, "stagnation_steps": self.stagnation_steps,
                "advisor": None if self.advisor is None else type(self.advisor).__name__,
                "started_at": time.time()}

    def run(self) -> Episode:
        ep = self.episode
        self.log.write(self.header())
        advice: Optional[str] = None
        try:
            for n in range(1, self.max_steps + 1):
                if self.time_budget_s is not None and self.elapsed() >= self.time_budget_s:
                    ep.stopped_by = "time_budget"
                    break
                rec = self.step(n, advice)
                ep.steps.append(rec)
                advice = self.maybe_advise(rec, is_last=n == self.max_steps)
                rec.elapsed_s = self.elapsed()
                self.log.write({"type": "step", **dataclasses.asdict(rec)})
            ep.final = self.final()
        except Exception as e:  # a harness failure: recorded, the evaluation carries on
            ep.error, ep.stopped_by = f"{type(e).__name__}: {e}"[:2000], "error"
        ep.wall_s = self.elapsed()
        ep.outcome = score_episode(ep, self.task)
        self.log.write({"type": "final", "final": dataclasses.asdict(ep.final),
                        "stopped_by": ep.stopped_by, "wall_s": ep.wall_s, "error": ep.error,
                        "outcome": dataclasses.asdict(ep.outcome)})
        return ep


def run_episode(policy: Any, task: Any, pool: Any, *, seed: int = 0, max_steps: int = 4,
                time_budget_s: Optional[float] = None, advisor: Optional[Advisor] = None,
                stagnation_steps: int = 2,
                agent_cfg: Optional[ml_collections.ConfigDict] = None,
                buffer_cfg: Optional[ml_collections.ConfigDict] = None,
                log_path: Optional[Union[str, os.PathLike]] = None,
                policy_lock: Optional[threading.Lock] = None,
                clock: Callable[[], float] = time.monotonic) -> Episode:
    """Runs one episode of ``policy`` on ``task`` (see the module docstring for the rules).

    Args:
      policy: a ``ChatPolicy`` (``complete(conversations, seed=) -> list[Completion]``).
      task: a ``sandbox.tasks.base.Task`` (anything the pool and ``agent`` accept).
      pool: a ``SandboxPool`` (``run(task, code, split=)``).
      seed: the episode seed (policy seeds derive from it, see ``step_seed``).
      max_steps: implementer steps at most (>= 0).
      time_budget_s: wall-clock budget in seconds, checked before each step; None = none.
      advisor: an ``advice.Advisor`` (MLE-Ideator), or None.
      stagnation_steps: consecutive non-improving steps that trigger an advice request (<= 0:
        never on stagnation).
      agent_cfg: the ``agent`` config section used by the trainer (default: agent defaults).
      buffer_cfg: the ``buffer`` section (history_len, stderr_tail_chars; default: defaults).
      log_path: where to write the episode's JSONL log (None: no log).
      policy_lock: serialises policy calls when episodes run in threads.
      clock: monotonic seconds (tests may pass a fake clock).

    Returns:
      the ``Episode`` (its ``outcome`` filled). Never raises for policy, script, grader or
      harness failures: they are recorded in the episode.
    """
    if max_steps < 0:
        raise ValueError(f"max_steps must be >= 0, got {max_steps}")
    if time_budget_s is not None and time_budget_s < 0:
        raise ValueError(f"time_budget_s must be >= 0 or None, got {time_budget_s}")
    runner = _EpisodeRunner(policy, task, pool, seed=seed, max_steps=max_steps,
                            time_budget_s=time_budget_s, advisor=advisor,
                            stagnation_steps=stagnation_steps,
                            agent_cfg=agent_cfg or agent.default_config(),
                            buffer_cfg=buffer_cfg or buffer_lib.default_config(),
                            log=JsonlLog(log_path), policy_lock=policy_lock, clock=clock)
    return runner.run()

