"""The agent evaluation harness: episodes of a policy on MLE tasks, metrics, reports.

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

Metrics (``score_episode``, one value per episode; ``summarize`` gives mean and standard error):

* valid: the final submission is valid on the final-test split (1/0).
* above_median / any_medal / gold / silver / bronze: MLE-bench's flags of the final-test score on
  the task's reference leaderboard (``Task.medal``; medals inclusive, above-median strict).
  An invalid final submission gets 0 for all.
* human_rank: MLE-Dojo's HumanRank (N - p + 1) / N on the reference leaderboard of N entries,
  where p is the 1-indexed position the score would take: p = 1 + #(entries strictly better than
  the score), so a tie takes the best of the tied positions (the first entry, best first, that the
  score beats or ties); a score worse than every entry has p = N + 1 and HumanRank 0; an invalid
  final submission has HumanRank 0. Equivalently 1 - #(strictly better) / N
  (``sandbox.grading.position_score``). The offline suite's leaderboards are our own baseline
  sweep, not human teams.
* A task without a reference leaderboard (e.g. an MLE-bench competition with no
  ``leaderboard.csv``) is still evaluated: its medal flags and HumanRank are None (not
  available, printed "n/a"), with a note; the overall medal and HumanRank figures then average
  over the tasks that have a leaderboard.
* steps_to_first_valid: the 1-indexed step of the first valid dev submission (None if never;
  averaged only over episodes that reached one) and never_valid (1/0): the fraction that never did.
* test_score: the final-test score in metric units (valid episodes only; per task only).

Aggregation: per task, the mean over its seeds and the standard error sd / sqrt(n) with the
sample standard deviation (ddof = 1); SE is None for n < 2. Overall (MLE-bench's convention): for
each seed, the mean over tasks, then mean and SE of those per-seed values over seeds.

Logs: every episode is written step by step to ``<out>/episodes/<task>__seed<k>.jsonl``
(a header line, one line per step with the prompt messages, completion, parsed code, status,
dev score, stderr tail and advice, a final line with the final submission and the metrics), so it
can be replayed (``load_episode``) and its valid attempts turned into buffer states
(``episodes_to_seed_solutions``, ``episodes_to_seed_states``: origin "evaluation").

Nothing here runs at import time; JAX and matplotlib are imported only where needed.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import math
import os
import pathlib
import statistics
import threading
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import ml_collections

from ace_jax.curriculum import buffer as buffer_lib, seeds
from ace_jax.env import agent
from ace_jax.env.advice import Advice, AdviceRequest, Advisor, Attempt, SEEK_HELP_TAG
from ace_jax.policy.policy import Completion
from sandbox.result import ExecutionResult, Status

SEED_STRIDE = 10_000          # policy seed of step t in episode seed s: s * SEED_STRIDE + t
ADVICE_SEED_OFFSET = 5_000    # advisor seed after step t: s * SEED_STRIDE + ADVICE_SEED_OFFSET + t
NO_VALID = "no_valid_submission"
FLAG_METRICS = ("valid", "above_median", "any_medal", "gold", "silver", "bronze")
METRICS = FLAG_METRICS + ("human_rank", "steps_to_first_valid", "never_valid", "test_score")
OVERALL_METRICS = tuple(m for m in METRICS if m != "test_score")  # test scores mix units
METRIC_LABELS = {
    "valid": "valid %", "above_median": ">median %", "any_medal": "medal %", "gold": "gold %",
    "silver": "silver %", "bronze": "bronze %", "human_rank": "HumanRank",
    "steps_to_first_valid": "steps->valid", "never_valid": "never valid %",
    "test_score": "test score"}
PERCENT_METRICS = FLAG_METRICS + ("never_valid",)
#: The metrics that need a reference leaderboard (None, printed "n/a", for a task without one).
LEADERBOARD_METRICS = ("above_median", "any_medal", "gold", "silver", "bronze", "human_rank")
NOT_AVAILABLE = "n/a"


class EvaluationError(RuntimeError):
    """A setup problem of the evaluation (bad policy spec, missing module, unknown task)."""


# ------------------------------------------------------------------------------------ records


@dataclasses.dataclass
class EpisodeStep:
    """One implementer step of an episode (times in seconds, scores in the task's metric units).

    Attributes:
      step: 1-indexed step number.
      kind: "draft" | "debug" | "improve" (``agent.step_kind`` of the state prompted from).
      prompt: the chat messages sent to the policy.
      policy_seed: the sampling seed of this step.
      completion: the policy's text ("" on a policy error).
      completion_error: the policy's error, else None.
      finish_reason: "stop" | "length" | "error".
      completion_tokens: tokens generated (0 where the policy does not say).
      code: the parsed script (None when nothing was executed).
      idea: an ``Idea: ...`` paragraph before the code block, if any.
      invalid_reason: ``agent.InvalidReason`` value of an invalid-format completion.
      seek_help: the completion asked for help (``SEEK_HELP_TAG``) without valid code.
      status: an ExecutionResult status, or "policy_error" / "invalid_format" / "seek_help"
        ("seek_help" only when an advisor is attached; without one the step is "invalid_format").
      dev_score: dev-split score of a valid submission, else None.
      reported_metric: the VALIDATION_METRIC the script printed, else None.
      exec_wall_s: wall seconds of the execution (0 when nothing ran).
      stderr_tail: the last ``buffer.stderr_tail_chars`` of stderr.
      error: a short reason for any non-ok outcome.
      improved: the step improved the episode's best dev score (a first valid one counts).
      best_dev_so_far: the best dev score after this step (None while no valid submission).
      advice_in_prompt: the advisor instruction this step's prompt carried, else None.
      advice_reason: why advice was requested after this step ("seek_help" | "stagnation").
      advice: the advisor's answer (``advice.Advice`` as a dict), else None.
      elapsed_s: seconds since the episode started, at the end of this step.
    """
    step: int
    kind: str
    prompt: list[dict[str, str]]
    policy_seed: int
    completion: str = ""
    completion_error: Optional[str] = None
    finish_reason: str = "stop"
    completion_tokens: int = 0
    code: Optional[str] = None
    idea: Optional[str] = None
    invalid_reason: Optional[str] = None
    seek_help: bool = False
    status: str = "invalid_format"
    dev_score: Optional[float] = None
    reported_metric: Optional[float] = None
    exec_wall_s: float = 0.0
    stderr_tail: str = ""
    error: str = ""
    improved: bool = False
    best_dev_so_far: Optional[float] = None
    advice_in_prompt: Optional[str] = None
    advice_reason: Optional[str] = None
    advice: Optional[dict[str, Any]] = None
    elapsed_s: float = 0.0

    @property
    def valid(self) -> bool:
        """A valid dev submission (status ok and a finite dev score)."""
        return self.status == Status.OK.value and _finite(self.dev_score)


@dataclasses.dataclass
class FinalSubmission:
    """The episode's final submission, executed once on the final-test split.

    Attributes:
      step: the chosen step (best dev score, earliest on ties); None when no step was valid.
      code: its script.
      dev_score: its dev score during the episode (what chose it).
      status: status of the final-test execution, or "no_valid_submission".
      test_score: the final-test score (None unless that execution was valid).
      rerun_dev_score: the dev score of the final execution (a check of determinism).
      error: the reason of a failed final execution.
      stderr_tail: its stderr tail.
    """
    step: Optional[int] = None
    code: Optional[str] = None
    dev_score: Optional[float] = None
    status: str = NO_VALID
    test_score: Optional[float] = None
    rerun_dev_score: Optional[float] = None
    error: str = ""
    stderr_tail: str = ""


@dataclasses.dataclass
class EpisodeOutcome:
    """The metrics of one episode (see the module docstring for definitions).

    Flags are bools (None when the task has no reference leaderboard); human_rank in [0, 1];
    steps_to_first_valid is a 1-indexed step or None; scores in the task's metric units.
    """
    valid: bool
    above_median: Optional[bool]
    any_medal: Optional[bool]
    gold: Optional[bool]
    silver: Optional[bool]
    bronze: Optional[bool]
    human_rank: Optional[float]
    steps_to_first_valid: Optional[int]
    never_valid: bool
    test_score: Optional[float]
    best_dev_score: Optional[float]
    grader_errors: int = 0
    policy_errors: int = 0
    invalid_format: int = 0
    advice_requests: int = 0
    note: str = ""

    def value(self, metric: str) -> Optional[float]:
        """``metric`` as a float for averaging (bools -> 0/1), None when undefined."""
        v = getattr(self, metric)
        return None if v is None else float(v)


@dataclasses.dataclass
class Episode:
    """One policy on one task with one seed.

    Attributes:
      task_id, metric, lower_is_better: the task.
      seed: the episode seed.
      policy: the policy's name.
      max_steps: the step budget; time_budget_s: the wall-clock budget (None: none), seconds.
      steps: the steps, in order.
      final: the final submission.
      stopped_by: "max_steps" | "time_budget" | "error".
      wall_s: wall seconds of the whole episode (final execution included).
      error: a harness failure that aborted the episode ("Type: message"), else None.
      outcome: the episode's metrics (``score_episode``).
      log_path: the episode's JSONL log, if written.
    """
    task_id: str
    seed: int
    policy: str
    metric: str = ""
    lower_is_better: bool = False
    max_steps: int = 0
    time_budget_s: Optional[float] = None
    steps: list[EpisodeStep] = dataclasses.field(default_factory=list)
    final: FinalSubmission = dataclasses.field(default_factory=FinalSubmission)
    stopped_by: str = "max_steps"
    wall_s: float = 0.0
    error: Optional[str] = None
    outcome: Optional[EpisodeOutcome] = None
    log_path: Optional[str] = None

    def best_dev_curve(self) -> list[Optional[float]]:
        """Best dev score so far after each step (None before the first valid one)."""
        return [s.best_dev_so_far for s in self.steps]

    def to_dict(self, *, with_steps: bool = True) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if not with_steps:
            d.pop("steps")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Episode":
        d = dict(d)
        d["steps"] = [EpisodeStep(**s) for s in d.get("steps", [])]
        d["final"] = FinalSubmission(**d.get("final", {}))
        d["outcome"] = EpisodeOutcome(**d["outcome"]) if d.get("outcome") else None
        return cls(**d)


@dataclasses.dataclass
class Stat:
    """Mean and standard error of ``n`` values (None when undefined: n = 0, or SE with n < 2)."""
    mean: Optional[float]
    se: Optional[float]
    n: int


@dataclasses.dataclass
class TaskSummary:
    """Metrics of one task over its seeds (or of all tasks: task_id "overall").

    Attributes:
      task_id: the task, or "overall".
      n_episodes: episodes counted.
      stats: metric name -> Stat (see ``METRICS``; "overall" holds ``OVERALL_METRICS``).
      grader_errors: executions whose grader raised (an environment bug, not the agent's).
      harness_errors: episodes aborted by a harness failure.
      notes: what a reader must know (broken grader, no leaderboard, aborted episodes).
    """
    task_id: str
    n_episodes: int
    stats: dict[str, Stat]
    grader_errors: int = 0
    harness_errors: int = 0
    notes: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class EvaluationResult:
    """Everything one evaluation produced (``evaluate``)."""
    policy: str
    config: dict[str, Any]
    episodes: list[Episode]
    tasks: list[TaskSummary]
    overall: TaskSummary
    notes: list[str]
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "config": self.config, "wall_s": self.wall_s,
                "notes": self.notes, "overall": dataclasses.asdict(self.overall),
                "tasks": [dataclasses.asdict(t) for t in self.tasks],
                "episodes": [e.to_dict(with_steps=False) for e in self.episodes]}


# ------------------------------------------------------------------------------------ helpers


def _finite(x: Optional[float]) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _better(task: Any, a: Optional[float], b: Optional[float]) -> bool:
    """True when score ``a`` is strictly better than ``b`` (a None ``b`` is beaten by any score)."""
    if not _finite(a):
        return False
    if not _finite(b):
        return True
    return a < b if task.lower_is_better else a > b


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


class _JsonlLog:
    """Append-only JSONL writer (one flushed line per record); a no-op without a path."""

    def __init__(self, path: Optional[Union[str, os.PathLike]]):
        self.path = None if path is None else pathlib.Path(path)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def write(self, record: dict[str, Any]) -> None:
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record, default=str) + "\n")


# ------------------------------------------------------------------------------------ episodes


class _EpisodeRunner:
    """The mutable state of one episode; ``run_episode`` is its public face."""

    def __init__(self, policy: Any, task: Any, pool: Any, *, seed: int, max_steps: int,
                 time_budget_s: Optional[float], advisor: Optional[Advisor],
                 stagnation_steps: int, agent_cfg: ml_collections.ConfigDict,
                 buffer_cfg: ml_collections.ConfigDict, log: _JsonlLog,
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
        self._add_child(state, rec)

    def _record_execution(self, rec: EpisodeStep, result: ExecutionResult) -> None:
        rec.status = result.status.value
        ok = result.status is Status.OK and _finite(result.dev_score)
        rec.dev_score = float(result.dev_score) if ok else None
        rec.reported_metric = result.reported_metric
        rec.exec_wall_s = float(result.wall_s or 0.0)
        rec.stderr_tail = result.stderr[-self.tail_chars:] if self.tail_chars > 0 else ""
        rec.error = result.error or ""

    def _add_child(self, parent: buffer_lib.State, rec: EpisodeStep) -> None:
        """The executed attempt as a buffer-style child state; moves ``current``."""
        summary = buffer_lib.StepSummary(action=rec.kind, status=rec.status,
                                         score=rec.dev_score, stderr_tail=rec.stderr_tail)
        parent_score = parent.score
        score = rec.dev_score if _better(self.task, rec.dev_score, parent_score) else parent_score
        child = buffer_lib.State(
            state_id=self.next_id, task_id=parent.task_id, parent_id=parent.state_id,
            depth=parent.depth + 1, code=rec.code or "",
            history=(parent.history + [summary])[-self.history_len:], score=score,
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
        ok = res.status is Status.OK and _finite(res.test_score)
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
                            log=_JsonlLog(log_path), policy_lock=policy_lock, clock=clock)
    return runner.run()


# ------------------------------------------------------------------------------------ metrics


def score_episode(episode: Episode, task: Any) -> EpisodeOutcome:
    """The metrics of one episode from its final-test score and the task's leaderboard.

    A task without a reference leaderboard gets None for the medal flags and HumanRank (and a
    note); every other failure of the leaderboard helpers propagates (a harness bug).
    """
    test = episode.final.test_score if _finite(episode.final.test_score) else None
    first = next((s.step for s in episode.steps if s.valid), None)
    statuses = [s.status for s in episode.steps] + [episode.final.status]
    out = EpisodeOutcome(
        valid=test is not None, above_median=None, any_medal=None, gold=None, silver=None,
        bronze=None, human_rank=None, steps_to_first_valid=first, never_valid=first is None,
        test_score=test,
        best_dev_score=next((s.best_dev_so_far for s in reversed(episode.steps)), None),
        grader_errors=statuses.count(Status.GRADER_ERROR.value),
        policy_errors=statuses.count("policy_error"),
        invalid_format=statuses.count("invalid_format"),
        advice_requests=sum(s.advice_reason is not None for s in episode.steps))
    if not getattr(task, "leaderboard", None):
        out.note = (f"task {episode.task_id} has no reference leaderboard: medals and HumanRank "
                    f"{NOT_AVAILABLE} (not counted in the overall figures)")
        return out
    medal = task.medal(test)
    out.above_median, out.gold, out.silver, out.bronze = (
        medal.above_median, medal.gold, medal.silver, medal.bronze)
    out.any_medal = medal.any_medal
    out.human_rank = float(task.position_score(test))
    return out


def mean_se(values: Iterable[Optional[float]]) -> Stat:
    """Mean and standard error (sample sd, ddof = 1, over sqrt(n)) of the non-None values."""
    vals = [float(v) for v in values if v is not None]
    n = len(vals)
    if n == 0:
        return Stat(None, None, 0)
    mean = sum(vals) / n
    se = statistics.stdev(vals) / math.sqrt(n) if n >= 2 else None
    return Stat(mean, se, n)


def _outcomes(episodes: Sequence[Episode]) -> list[EpisodeOutcome]:
    missing = [f"{e.task_id}/seed{e.seed}" for e in episodes if e.outcome is None]
    if missing:
        raise ValueError(f"episodes without an outcome (run score_episode first): {missing}")
    return [e.outcome for e in episodes]


def _notes_for(task_id: str, episodes: Sequence[Episode]) -> tuple[int, int, list[str]]:
    grader = sum(e.outcome.grader_errors for e in episodes)
    aborted = [e for e in episodes if e.error]
    notes = []
    if grader:
        notes.append(f"task {task_id}: the grader raised in {grader} execution(s) (an "
                     "environment bug, not the agent's); those submissions count as invalid")
    for e in aborted:
        notes.append(f"task {task_id} seed {e.seed}: episode aborted by a harness error: "
                     f"{e.error}")
    leaderboard_notes = {e.outcome.note for e in episodes if e.outcome.note}
    notes += sorted(leaderboard_notes)
    return grader, len(aborted), notes


def summarize_task(task_id: str, episodes: Sequence[Episode]) -> TaskSummary:
    """Mean and SE over the episodes (one per seed) of one task."""
    outs = _outcomes(episodes)
    stats = {m: mean_se(o.value(m) for o in outs) for m in METRICS}
    grader, aborted, notes = _notes_for(task_id, episodes)
    return TaskSummary(task_id, len(episodes), stats, grader, aborted, notes)


def summarize_overall(episodes: Sequence[Episode]) -> TaskSummary:
    """Per seed the mean over tasks, then mean and SE over seeds (MLE-bench's convention).

    ``steps_to_first_valid`` of a seed is the mean over its episodes that reached a valid
    submission; a seed with none contributes no value.
    """
    _outcomes(episodes)
    by_seed: dict[int, list[Episode]] = {}
    for e in episodes:
        by_seed.setdefault(e.seed, []).append(e)
    stats = {}
    for m in OVERALL_METRICS:
        per_seed = [mean_se(e.outcome.value(m) for e in eps).mean
                    for _, eps in sorted(by_seed.items())]
        stats[m] = mean_se(per_seed)
    grader = sum(e.outcome.grader_errors for e in episodes)
    aborted = sum(bool(e.error) for e in episodes)
    return TaskSummary("overall", len(episodes), stats, grader, aborted, [])


def summarize(episodes: Sequence[Episode]) -> tuple[list[TaskSummary], TaskSummary, list[str]]:
    """(per-task summaries in first-seen task order, the overall summary, all notes)."""
    order: dict[str, list[Episode]] = {}
    for e in episodes:
        order.setdefault(e.task_id, []).append(e)
    tasks = [summarize_task(t, sorted(eps, key=lambda e: e.seed)) for t, eps in order.items()]
    notes = [n for t in tasks for n in t.notes]
    return tasks, summarize_overall(episodes), notes


# ------------------------------------------------------------------------------------ evaluation


def episode_log_path(out_dir: Union[str, os.PathLike], task_id: str, seed: int) -> pathlib.Path:
    """``<out_dir>/episodes/<task_id>__seed<seed>.jsonl``."""
    return pathlib.Path(out_dir) / "episodes" / f"{task_id}__seed{seed}.jsonl"


def evaluate(policy: Any, tasks: Sequence[Any], pool: Any, *, seeds: Sequence[int] = (0,),
             max_steps: int = 4, time_budget_s: Optional[float] = None,
             advisor: Optional[Advisor] = None, stagnation_steps: int = 2,
             agent_cfg: Optional[ml_collections.ConfigDict] = None,
             buffer_cfg: Optional[ml_collections.ConfigDict] = None,
             out_dir: Optional[Union[str, os.PathLike]] = None, episode_workers: int = 1,
             serialize_policy: bool = True, progress: bool = False) -> EvaluationResult:
    """Runs one episode per (task, seed) and aggregates the metrics.

    Args:
      policy, pool, max_steps, time_budget_s, advisor, stagnation_steps, agent_cfg, buffer_cfg:
        as in ``run_episode``.
      tasks: the tasks (unique ids).
      seeds: episode seeds; every task runs once per seed.
      out_dir: where the episode logs go (``episode_log_path``); None: no logs.
      episode_workers: episodes run concurrently in threads (the pool's workers are shared).
      serialize_policy: one policy call at a time across threads (a JAX policy needs it; an HTTP
        policy does not).
      progress: a tqdm bar over episodes.

    Returns:
      an ``EvaluationResult``; episodes ordered by task (as given) then seed. A failure of one
      episode (even a broken grader or task) is recorded and the others still run.
    """
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise EvaluationError(f"duplicate task ids: {ids}")
    if not seeds:
        raise EvaluationError("no seeds given")
    if episode_workers < 1:
        raise ValueError(f"episode_workers must be >= 1, got {episode_workers}")
    lock = threading.Lock() if serialize_policy and episode_workers > 1 else None
    jobs = [(t, int(s)) for t in tasks for s in seeds]
    t0 = time.monotonic()

    def one(job: tuple[Any, int]) -> Episode:
        task, seed = job
        log = None if out_dir is None else episode_log_path(out_dir, task.task_id, seed)
        return run_episode(policy, task, pool, seed=seed, max_steps=max_steps,
                           time_budget_s=time_budget_s, advisor=advisor,
                           stagnation_steps=stagnation_steps, agent_cfg=agent_cfg,
                           buffer_cfg=buffer_cfg, log_path=log, policy_lock=lock)

    episodes = _run_jobs(one, jobs, episode_workers, progress)
    task_summaries, overall, notes = summarize(episodes)
    config = {"tasks": ids, "seeds": [int(s) for s in seeds], "max_steps": max_steps,
              "time_budget_s": time_budget_s, "stagnation_steps": stagnation_steps,
              "advisor": None if advisor is None else type(advisor).__name__,
              "agent": (agent_cfg or agent.default_config()).to_dict()}
    return EvaluationResult(policy=str(getattr(policy, "name", type(policy).__name__)),
                            config=config, episodes=episodes, tasks=task_summaries,
                            overall=overall, notes=notes, wall_s=time.monotonic() - t0)


def _run_jobs(fn: Callable[[Any], Episode], jobs: list, workers: int,
              progress: bool) -> list[Episode]:
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), desc="episodes", unit="ep", disable=not progress)
    try:
        if workers == 1:
            out = []
            for j in jobs:
                out.append(fn(j))
                bar.update(1)
            return out
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="episode") as ex:
            futures = [ex.submit(fn, j) for j in jobs]
            for _ in concurrent.futures.as_completed(futures):
                bar.update(1)
            return [f.result() for f in futures]
    finally:
        bar.close()


# ------------------------------------------------------------------------------------ replay


def load_episode(path: Union[str, os.PathLike]) -> Episode:
    """Reads an episode back from its JSONL log (a log cut short gives the steps it holds)."""
    lines = [json.loads(x) for x in pathlib.Path(path).read_text().splitlines() if x.strip()]
    if not lines or lines[0].get("type") != "header":
        raise ValueError(f"{path}: not an episode log (no header line)")
    h = lines[0]
    ep = Episode(task_id=h["task_id"], seed=int(h["seed"]), policy=h["policy"],
                 metric=h.get("metric", ""), lower_is_better=bool(h.get("lower_is_better")),
                 max_steps=int(h.get("max_steps", 0)), time_budget_s=h.get("time_budget_s"),
                 log_path=str(path))
    fields = {f.name for f in dataclasses.fields(EpisodeStep)}
    for rec in lines[1:]:
        if rec.get("type") == "step":
            ep.steps.append(EpisodeStep(**{k: v for k, v in rec.items() if k in fields}))
        elif rec.get("type") == "final":
            ep.final = FinalSubmission(**rec["final"])
            ep.stopped_by, ep.wall_s, ep.error = rec["stopped_by"], rec["wall_s"], rec["error"]
            ep.outcome = EpisodeOutcome(**rec["outcome"]) if rec.get("outcome") else None
    return ep


def load_episodes(out_dir: Union[str, os.PathLike]) -> list[Episode]:
    """Every episode log under ``<out_dir>/episodes``, sorted by file name."""
    return [load_episode(p) for p in sorted((pathlib.Path(out_dir) / "episodes").glob("*.jsonl"))]


EpisodeLike = Union[Episode, str, os.PathLike]


def _as_episodes(items: Iterable[EpisodeLike]) -> list[Episode]:
    return [e if isinstance(e, Episode) else load_episode(e) for e in items]


def episodes_to_seed_solutions(episodes: Iterable[EpisodeLike]) -> list[buffer_lib.SeedSolution]:
    """Every valid attempt (status ok, finite dev score) of the episodes as a ``SeedSolution``.

    Attempts with the same code in one task (``buffer.code_hash``) are merged, keeping the best
    dev score; order: first appearance.
    """
    out: dict[tuple[str, str], buffer_lib.SeedSolution] = {}
    for ep in _as_episodes(episodes):
        lower = ep.lower_is_better
        for s in ep.steps:
            if not s.valid or not s.code:
                continue
            key = (ep.task_id, buffer_lib.code_hash(s.code))
            old = out.get(key)
            if old is None or (s.dev_score < old.score if lower else s.dev_score > old.score):
                out[key] = buffer_lib.SeedSolution(ep.task_id, s.code, float(s.dev_score))
    return list(out.values())


def episodes_to_seed_states(buffer: buffer_lib.EvolvingBuffer, episodes: Iterable[EpisodeLike],
                            *, step: int = 0, skip_unknown_tasks: bool = False) -> list[int]:
    """Adds the episodes' valid attempts to ``buffer`` as root states (origin "evaluation").

    Returns the state ids (a root already present with the same code is merged by the buffer).
    Raises ``buffer.UnknownTaskError`` for a task the buffer does not know, unless
    ``skip_unknown_tasks``.
    """
    return seeds.add_seed_states(buffer, episodes_to_seed_solutions(episodes), step=step,
                           skip_unknown_tasks=skip_unknown_tasks)


# ------------------------------------------------------------------------------------ reports


def _fmt(stat: Stat, metric: str) -> str:
    """mean±SE in the metric's display units; "n/a" for a leaderboard metric with no value (no
    reference leaderboard), "-" for any other metric with none."""
    if stat.mean is None:
        return NOT_AVAILABLE if metric in LEADERBOARD_METRICS else "-"
    scale, digits = (100.0, 0) if metric in PERCENT_METRICS else (1.0, 3)
    if metric == "steps_to_first_valid":
        digits = 1
    text = f"{stat.mean * scale:.{digits}f}"
    if stat.se is not None:
        text += f"±{stat.se * scale:.{digits}f}"
    return text


TABLE_METRICS = ("valid", "above_median", "any_medal", "gold", "silver", "bronze", "human_rank",
                 "steps_to_first_valid", "never_valid")


def _rows(result: EvaluationResult) -> tuple[list[str], list[list[str]]]:
    head = ["task", "n"] + [METRIC_LABELS[m] for m in TABLE_METRICS] + ["grader err"]
    rows = []
    for s in result.tasks + [result.overall]:
        rows.append([s.task_id, str(s.n_episodes)] + [_fmt(s.stats[m], m) for m in TABLE_METRICS]
                    + [str(s.grader_errors)])
    return head, rows


def format_table(result: EvaluationResult) -> str:
    """A fixed-width terminal table: one row per task and one "overall" row (mean±SE)."""
    head, rows = _rows(result)
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    sep = "-" * len(line(head))
    out = [line(head), sep] + [line(r) for r in rows[:-1]] + [sep, line(rows[-1])]
    if result.notes:
        out += ["", "notes:"] + [f"  - {n}" for n in result.notes]
    return "\n".join(out)


def format_markdown(result: EvaluationResult, figures: Sequence[str] = ()) -> str:
    """The markdown report: set-up, the per-task table, definitions, notes, figures."""
    cfg = result.config
    head, rows = _rows(result)
    md = [f"# Evaluation of `{result.policy}`", "",
          f"- tasks: {', '.join(cfg['tasks'])}", f"- seeds: {cfg['seeds']}",
          f"- max steps: {cfg['max_steps']}; time budget per episode: "
          + (f"{cfg['time_budget_s']:g} s" if cfg['time_budget_s'] is not None else "none"),
          f"- advisor: {cfg['advisor'] or 'none'} (stagnation steps: {cfg['stagnation_steps']})",
          f"- episodes: {len(result.episodes)}; wall time {result.wall_s:.0f} s", "",
          "## Results (mean ± standard error over seeds)", "",
          "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    md += ["| " + " | ".join(r) + " |" for r in rows[:-1]]
    md += ["| **" + rows[-1][0] + "** | " + " | ".join(rows[-1][1:]) + " |", ""]
    md += ["## Definitions", "",
           "- The final submission of an episode is its step with the best dev score (earliest "
           "on ties), executed once on the hidden final-test split; all metrics use that score.",
           "- valid: the final submission is valid on final-test. Medals and >median: "
           "MLE-bench thresholds on the task's reference leaderboard (medals inclusive, median "
           "strict); invalid counts as no medal.",
           "- HumanRank = (N - p + 1) / N (MLE-Dojo), N leaderboard entries, p = 1 + number of "
           "entries strictly better than the score (ties take the best tied position); invalid "
           "= 0. The offline leaderboards are our baseline sweep, not human teams.",
           f"- {NOT_AVAILABLE}: not available, the task has no reference leaderboard; the overall "
           "medal and HumanRank figures average over the tasks that have one.",
           "- steps->valid: mean 1-indexed step of the first valid dev submission over the "
           "episodes that reached one; never valid: the fraction that never did.",
           "- Per task: mean over seeds, SE = sample sd / sqrt(n). Overall: per seed the mean "
           "over tasks, then mean and SE over seeds.", ""]
    if result.notes:
        md += ["## Notes", ""] + [f"- {n}" for n in result.notes] + [""]
    for f in figures:
        md += [f"![{pathlib.Path(f).stem}]({pathlib.Path(f).name})", ""]
    return "\n".join(md)


def plot_per_task(result: EvaluationResult, path: Union[str, os.PathLike]) -> pathlib.Path:
    """Bars per task (and overall) with SE error bars: rates on the left, HumanRank right."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    summaries = result.tasks + [result.overall]
    names = [s.task_id for s in summaries]
    x = np.arange(len(names))
    rates = ("valid", "above_median", "any_medal")
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(names) + 4), 4.2))
    width = 0.8 / len(rates)
    for i, m in enumerate(rates):
        means = [s.stats[m].mean or 0.0 for s in summaries]
        errs = [s.stats[m].se or 0.0 for s in summaries]
        ax1.bar(x + (i - 1) * width, means, width, yerr=errs, capsize=3,
                label=METRIC_LABELS[m].replace(" %", ""))
    ax1.set_ylim(0, 1.05)
    ax1.set_ylabel("rate")
    ax1.legend(fontsize=8)
    ax2.bar(x, [s.stats["human_rank"].mean or 0.0 for s in summaries],
            yerr=[s.stats["human_rank"].se or 0.0 for s in summaries], capsize=3,
            color="tab:purple")
    ax2.set_ylim(0, 1.05)
    ax2.set_ylabel("HumanRank")
    for j, s in enumerate(summaries):  # no leaderboard: say so rather than draw a zero bar
        if s.stats["human_rank"].mean is None:
            ax2.text(x[j], 0.02, NOT_AVAILABLE, ha="center", fontsize=8)
    for ax in (ax1, ax2):
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    fig.suptitle(f"{result.policy}: mean ± SE over seeds")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_best_dev(episodes: Sequence[Episode], path: Union[str, os.PathLike]) -> pathlib.Path:
    """Best dev score so far per step, one panel per task, one line per seed (metric units)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    by_task: dict[str, list[Episode]] = {}
    for e in episodes:
        by_task.setdefault(e.task_id, []).append(e)
    n = max(1, len(by_task))
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
    for ax, (task_id, eps) in zip(axes.ravel(), by_task.items()):
        for e in sorted(eps, key=lambda e: e.seed):
            pts = [(s.step, s.best_dev_so_far) for s in e.steps if s.best_dev_so_far is not None]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=f"seed {e.seed}")
        direction = "lower" if eps[0].lower_is_better else "higher"
        ax.set_title(f"{task_id} ({eps[0].metric}, {direction} is better)", fontsize=9)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlim(0.5, max([e.max_steps for e in eps] + [len(e.steps) for e in eps] + [1]) + 0.5)
        ax.set_ylabel("best dev score so far")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no valid submission", ha="center", va="center",
                    transform=ax.transAxes)
    for ax in axes.ravel()[len(by_task):]:
        ax.axis("off")
    fig.tight_layout()
    path = pathlib.Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_reports(result: EvaluationResult, out_dir: Union[str, os.PathLike]) -> dict[str, str]:
    """Writes results.json, report.md, per_task.png, best_dev.png and seed_solutions.jsonl.

    Returns {kind: path}.
    """
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"per_task_plot": plot_per_task(result, out / "per_task.png"),
             "best_dev_plot": plot_best_dev(result.episodes, out / "best_dev.png")}
    paths["json"] = out / "results.json"
    paths["json"].write_text(json.dumps(result.to_dict(), indent=1, default=str) + "\n")
    paths["markdown"] = out / "report.md"
    paths["markdown"].write_text(format_markdown(
        result, [paths["per_task_plot"], paths["best_dev_plot"]]))
    paths["seed_solutions"] = seeds.write_seed_solutions(
        episodes_to_seed_solutions(result.episodes), out / "seed_solutions.jsonl")
    return {k: str(v) for k, v in paths.items()}


# ------------------------------------------------------------------------------------ policies


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``ace_jax.policy.policy.parse_policy_spec``, raising EvaluationError (with the accepted forms)."""
    from ace_jax.policy import policy as policy_lib

    try:
        return policy_lib.parse_policy_spec(spec)
    except policy_lib.PolicySpecError as e:
        raise EvaluationError(str(e)) from e


def read_run_config(workdir: Union[str, os.PathLike]) -> dict[str, Any]:
    """``<workdir>/config.json`` of a training run as a dict (EvaluationError if absent)."""
    path = pathlib.Path(workdir) / "config.json"
    if not path.exists():
        raise EvaluationError(f"{workdir!r} is not a training run directory: no config.json")
    return json.loads(path.read_text())


def _section(defaults: ml_collections.ConfigDict,
             values: Optional[dict]) -> ml_collections.ConfigDict:
    """``defaults`` with the scalar keys of ``values`` it knows (unknown keys ignored)."""
    cfg = ml_collections.ConfigDict(defaults.to_dict())
    for k, v in (values or {}).items():
        if k in cfg and not isinstance(cfg[k], ml_collections.ConfigDict):
            cfg[k] = v
    return cfg


def run_agent_config(workdir: Union[str, os.PathLike]) -> ml_collections.ConfigDict:
    """The ``agent`` section a run trained with (so evaluation prompts match its training)."""
    return _section(agent.default_config(), read_run_config(workdir).get("agent"))


def run_buffer_config(workdir: Union[str, os.PathLike]) -> ml_collections.ConfigDict:
    """The ``buffer`` section a run trained with (history length, stderr tail)."""
    return _section(buffer_lib.default_config(), read_run_config(workdir).get("buffer"))


def load_tasks(ids: Sequence[str], run_cfg: Optional[dict[str, Any]] = None, *,
               cache_dir: str = "", task_seed: int = 0, exec_time_limit_s: float = 0.0) -> list:
    """The offline tasks to evaluate on, prepared into the cache if missing.

    Args:
      ids: task ids; empty: the run's ``tasks.ids``, else the whole offline suite.
      run_cfg: a run's config dict (``read_run_config``) or None.
      cache_dir: prepared tasks; empty: the run's ``tasks.cache_dir``, else ``cache/tasks``.
      task_seed: the seed the tasks were prepared with (its reference leaderboard must exist).
      exec_time_limit_s: per-execution limit (s); 0: the run's ``sandbox.max_time_limit_s`` (or
        ``tasks.time_limit_s`` of older runs), else the task's own.

    Raises:
      EvaluationError: an unknown task id (the message lists the available ones).
    """
    from sandbox.tasks import registry

    run_tasks = (run_cfg or {}).get("tasks") or {}
    known = registry.list_tasks()
    ids = list(ids) or list(run_tasks.get("ids") or []) or known
    unknown = sorted(set(ids) - set(known))
    if unknown:
        raise EvaluationError(f"unknown task ids {unknown}; available: {known}")
    tasks = registry.load_suite(cache_dir or run_tasks.get("cache_dir") or "cache/tasks",
                                task_seed, ids)
    run_sandbox = (run_cfg or {}).get("sandbox") or {}
    limit = exec_time_limit_s or float(run_sandbox.get("max_time_limit_s")
                                       or run_tasks.get("time_limit_s") or 0.0)  # older runs
    if limit > 0:
        for t in tasks:
            t.time_limit_s = min(float(t.time_limit_s), limit)
    return tasks


def policy_from_spec(spec: str, *, max_new_tokens: Optional[int] = None,
                     temperature: Optional[float] = None,
                     max_prompt_tokens: Optional[int] = None) -> Any:
    """Builds the ``ChatPolicy`` a spec names (see ``parse_policy_spec``).

    For ``run:`` the sampling settings default to the run's (``sampling.*``,
    ``rl.max_prompt_tokens``); the arguments given here override them.
    """
    from ace_jax.policy import policy as policy_lib

    kind, args = parse_policy_spec(spec)
    if kind == "openai":
        kw: dict[str, Any] = {}
        if max_new_tokens is not None:
            kw["max_tokens"] = int(max_new_tokens)
        if temperature is not None:
            kw["temperature"] = float(temperature)
        return policy_lib.OpenAIPolicy(args["base_url"], args["model"], **kw)
    kw = {}
    if kind == "run":
        cfg = read_run_config(args["workdir"])
        sampling = cfg.get("sampling") or {}
        for key in ("max_new_tokens", "temperature", "top_k", "top_p", "prompt_bucket"):
            if key in sampling:
                kw[key] = sampling[key]
        if (cfg.get("rl") or {}).get("max_prompt_tokens"):
            kw["max_prompt_tokens"] = int(cfg["rl"]["max_prompt_tokens"])
    for key, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                       ("max_prompt_tokens", max_prompt_tokens)):
        if value is not None:
            kw[key] = value
    if kind == "run":
        return policy_lib.JaxPolicy.from_run(args["workdir"], step=args["step"], **kw)
    return policy_lib.JaxPolicy.from_hf(args["path"], **kw)


def advisor_from_spec(spec: str, **policy_kwargs: Any) -> Advisor:
    """``ace_jax.ideator.ideator.Ideator(policy_from_spec(spec))``; EvaluationError if that module is
    not in this checkout (an ImportError raised inside it propagates unchanged)."""
    try:
        from ace_jax.ideator import ideator
    except ModuleNotFoundError as e:
        if e.name != "ace_jax.ideator.ideator":
            raise
        raise EvaluationError("--ideator needs ace_jax/ideator/ideator.py (MLE-Ideator's Ideator), which "
                              "this checkout does not have; run without --ideator") from None
    return ideator.Ideator(policy_from_spec(spec, **policy_kwargs))
