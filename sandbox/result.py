"""The record of one execution of agent-written code: ``ExecutionResult`` and its status enum."""
from __future__ import annotations

import dataclasses
import enum
import json
from typing import Any, Optional


class Status(str, enum.Enum):
    """How one execution ended. Values are stable strings (they are persisted in the buffer)."""

    OK = "ok"                                  # ran, wrote a valid submission, graded
    SYNTAX_ERROR = "syntax_error"              # the script does not compile
    RUNTIME_ERROR = "runtime_error"            # non-zero exit / uncaught exception
    TIMEOUT = "timeout"                        # wall-clock budget exceeded, process group killed
    OOM = "oom"                                # memory limit hit (MemoryError or killed by the limit)
    NO_SUBMISSION = "no_submission"            # exited 0 but wrote no ./submission/submission.csv
    INVALID_SUBMISSION = "invalid_submission"  # grader raised InvalidSubmissionError
    GRADER_ERROR = "grader_error"              # the grader itself failed (not the agent's fault)
    SANDBOX_ERROR = "sandbox_error"            # the sandbox could not run the script at all

    @property
    def is_valid(self) -> bool:
        return self is Status.OK


@dataclasses.dataclass
class ExecutionResult:
    """Outcome of one sandboxed execution.

    Attributes:
      status: how it ended.
      exit_code: process exit code (negative: killed by that signal); None if it never started.
      wall_s: wall-clock seconds of the script (not counting grading).
      cpu_s: CPU seconds of the script and what it waited for (None: not measured, or an older
        record).
      peak_memory_mb: peak resident memory of the process tree in MiB (best effort; None if unknown).
      stdout, stderr: bounded head + tail of each stream (a marker shows what was cut).
      valid_submission: a submission file existed and passed the grader's format checks.
      dev_score: the score on the hidden dev-test split (None unless valid).
      test_score: the score on the hidden final-test split (evaluation only; None in training).
      reported_metric: the validation metric the script printed, parsed from stdout (None if absent).
      error: a short human-readable reason for any non-ok status.
      notes: what the sandbox itself saw and did, as the backend reported it (e.g.
        "pid limit (64) refused 812 new processes or threads"); empty when nothing happened.
      leftovers_killed: processes of the execution other than the script itself that the sandbox
        killed: still alive when the script ended, or when it was killed (timeout, disk limit,
        cancel). A fork bomb shows here; a fork or thread bomb in ``notes`` too (where a pids
        cgroup counts the refusals). Under bwrap what is left when the script ends dies with its
        PID namespace, uncounted; what a timeout kills is counted.
    """

    status: Status
    exit_code: Optional[int] = None
    wall_s: float = 0.0
    cpu_s: Optional[float] = None
    peak_memory_mb: Optional[float] = None
    stdout: str = ""
    stderr: str = ""
    valid_submission: bool = False
    dev_score: Optional[float] = None
    test_score: Optional[float] = None
    reported_metric: Optional[float] = None
    error: str = ""
    notes: tuple[str, ...] = ()
    leftovers_killed: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["status"] = self.status.value
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ExecutionResult":
        """The inverse of ``to_dict``; a record written before ``notes`` / ``leftovers_killed`` /
        ``cpu_s`` existed gets their defaults."""
        d = dict(d)
        d["status"] = Status(d["status"])
        notes = d.get("notes", ())
        if not isinstance(notes, (list, tuple)) or not all(isinstance(n, str) for n in notes):
            raise TypeError(f"ExecutionResult notes must be a list of strings, got {notes!r}")
        d["notes"] = tuple(notes)
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, s: str) -> "ExecutionResult":
        return cls.from_dict(json.loads(s))
