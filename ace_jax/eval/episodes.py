"""Episode records: one policy on one task with one seed, step by step, and their JSONL logs.

``EpisodeStep``, ``FinalSubmission``, ``EpisodeOutcome`` and ``Episode`` are what an episode
(``runner.run_episode``) records; ``EpisodeOutcome`` holds its metrics (``scoring``).

Logs: every episode is written step by step to ``<out>/episodes/<task>__seed<k>.jsonl``
(``episode_log_path``; a header line, one line per step with the prompt messages, completion,
parsed code, status, dev score, stderr tail and advice, a final line with the final submission
and the metrics), so it can be replayed (``load_episode``) and its valid attempts turned into
buffer states (``episodes_to_seed_solutions``, ``episodes_to_seed_states``: origin "evaluation").
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Any, Iterable, Optional, Union

from ace_jax.curriculum import buffer as buffer_lib, seeds
from sandbox.result import Status

NO_VALID = "no_valid_submission"


def finite(x: Optional[float]) -> bool:
    """``x`` is a finite number (a score that counts)."""
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


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
        return self.status == Status.OK.value and finite(self.dev_score)


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
    """The metrics of one episode (``scoring.score_episode``; definitions in ``scoring``).

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



def episode_log_path(out_dir: Union[str, os.PathLike], task_id: str, seed: int) -> pathlib.Path:
    """``<out_dir>/episodes/<task_id>__seed<seed>.jsonl``."""
    return pathlib.Path(out_dir) / "episodes" / f"{task_id}__seed{seed}.jsonl"


class JsonlLog:
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
