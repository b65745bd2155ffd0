"""The contract between an implementer episode and an advisor (MLE-Ideator).

An episode (``ace_jax.eval.runner``) asks its advisor for help when the implementer emits
``<seek_help>`` or when its score stagnates; the advisor (``ace_jax.ideator.advisor.Ideator``) answers with
one idea, which the next implementer prompt carries (``agent.render_messages(..., advice=)``).
Only plain data lives here, so the episode runner and the ideator do not import each other.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional, Protocol

SEEK_HELP_TAG = "<seek_help>"
REASONS = ("seek_help", "stagnation")


@dataclasses.dataclass
class Attempt:
    """One implementer step as the advisor sees it (scores in the task's metric units)."""
    step: int
    kind: str                      # "draft" | "debug" | "improve"
    code: str
    status: str                    # an ExecutionResult status, or "invalid_format" / "policy_error"
    dev_score: Optional[float]
    stderr_tail: str = ""


@dataclasses.dataclass
class AdviceRequest:
    """What the implementer sends: the task, its attempts so far, the goal.

    Attributes:
      task: a ``sandbox.tasks.base.Task``.
      attempts: the episode's steps so far, oldest first.
      current_score: the best valid dev score so far (None: no valid submission yet).
      current_code: the script of that best attempt (or the latest, if none is valid).
      reason: "seek_help" (the implementer asked) or "stagnation" (the score stopped improving).
    """
    task: Any
    attempts: list[Attempt]
    current_score: Optional[float]
    current_code: str
    reason: str = "seek_help"


@dataclasses.dataclass
class Advice:
    """The advisor's answer.

    Attributes:
      instruction: the text handed to the implementer (None when the answer was unusable).
      valid: the answer followed the required structure.
      error: why it is unusable (format error, endpoint timeout, ...), else None.
      category: the idea category ("feature_engineering", "data_preparation", "model_choice",
        "hyperparameters", "ensembling", "other"), None when invalid.
      raw: the advisor's raw text.
    """
    instruction: Optional[str]
    valid: bool
    error: Optional[str] = None
    category: Optional[str] = None
    raw: str = ""


class Advisor(Protocol):
    def advise(self, request: AdviceRequest, *, seed: int = 0) -> Advice: ...
