"""One execution, start to finish, without a pool: compile-check the code, run it on a backend,
classify the ``RawExecution`` (``classify``) and grade its submission into an ``ExecutionResult``
(``execute_and_grade``; ``sandbox.pool.SandboxPool``'s workers call it)."""
from __future__ import annotations

import math
import os
import re
import threading
from typing import Any, Optional

from sandbox import metric_parse
from sandbox.backends import Backend, RawExecution
from sandbox.grading import InvalidSubmissionError
from sandbox.result import ExecutionResult, Status

SPLITS = ("dev", "test")

# The last lines of stderr that mean "out of memory" (Python, numpy, C/C++ allocators, BLAS).
_OOM_PATTERN = re.compile(
    r"MemoryError|Unable to allocate|Cannot allocate memory|std::bad_alloc|out of memory|"
    r"OutOfMemory|failed to allocate|memory allocation failed", re.IGNORECASE)
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Warning)\b.*)$")


def check_syntax(code: str) -> Optional[str]:
    """None if ``code`` compiles, else a one-line reason ("SyntaxError: ... (line 3)")."""
    try:
        compile(code, "solution.py", "exec", dont_inherit=True)
    except SyntaxError as e:
        return f"{type(e).__name__}: {e.msg} (line {e.lineno})"
    except (ValueError, RecursionError, MemoryError, OverflowError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def last_exception_line(stderr: str) -> str:
    """The final ``SomeError: message`` line of a traceback in ``stderr`` ("" if none)."""
    for line in reversed(stderr.strip().splitlines()):
        m = _EXCEPTION_LINE.match(line.strip())
        if m:
            return m.group(1)[:500]
    return ""


def classify(raw: RawExecution) -> tuple[Status, str]:
    """Status and reason of a finished execution, before grading (``OK`` = go and grade)."""
    exc = last_exception_line(raw.stderr)
    if raw.cancelled:
        return Status.SANDBOX_ERROR, "cancelled: the pool was closed during the execution"
    if raw.error:
        return Status.SANDBOX_ERROR, raw.error
    if raw.timed_out:
        return Status.TIMEOUT, "wall-clock time limit exceeded; the process tree was killed"
    if raw.cpu_limit_hit:
        return Status.TIMEOUT, "CPU time limit exceeded (RLIMIT_CPU)"
    if raw.oom_killed:
        return Status.OOM, "killed by the memory limit"
    if raw.disk_limit_hit:
        return Status.RUNTIME_ERROR, "disk limit exceeded: the working dir grew too large; killed"
    if raw.exit_code != 0:
        tail = raw.stderr[-2048:]
        if _OOM_PATTERN.search(tail):
            return Status.OOM, exc or "out of memory"
        if raw.exit_code == -9:  # RLIMIT_AS never kills, so there is no evidence of memory
            return Status.RUNTIME_ERROR, ("killed by SIGKILL, not by the sandbox (the host's OOM "
                                          "killer or the script itself)")
        if raw.exit_code is not None and raw.exit_code < 0:
            return Status.RUNTIME_ERROR, exc or f"killed by signal {-raw.exit_code}"
        return Status.RUNTIME_ERROR, exc or f"exit code {raw.exit_code}"
    if raw.submission_error:
        return Status.INVALID_SUBMISSION, raw.submission_error
    if raw.submission is None:
        return Status.NO_SUBMISSION, "exited 0 but wrote no ./submission/submission.csv"
    return Status.OK, ""


def with_sandbox_facts(reason: str, raw: RawExecution) -> str:
    """``reason`` followed by what the sandbox did besides ending the script, in parentheses:
    the other processes it killed and the backend's notes (a fork bomb then does not read as a
    plain timeout)."""
    facts = list(raw.notes)
    if raw.leftovers_killed:
        facts.insert(0, f"{raw.leftovers_killed} other process(es) killed")
    return f"{reason} ({'; '.join(facts)})" if facts else reason


def _grade(task: Any, submission, split: str) -> float:
    score = task.grade(submission, split)
    if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
        raise ValueError(f"grader returned {score!r} for split {split!r}, not a finite number")
    return float(score)


def execute_and_grade(backend: Backend, task: Any, code: str, *, split: str = "dev",
                      cancel: Optional[threading.Event] = None,
                      max_code_bytes: int = 1 << 20) -> ExecutionResult:
    """One execution, start to finish, without a pool (the pool's workers call this)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if len(code.encode("utf-8", errors="replace")) > max_code_bytes:
        return ExecutionResult(status=Status.RUNTIME_ERROR,
                               error=f"code is larger than {max_code_bytes} bytes; not run")
    syntax = check_syntax(code)
    if syntax is not None:
        return ExecutionResult(status=Status.SYNTAX_ERROR, stderr=syntax, error=syntax)
    raw = backend.execute(task, code, cancel=cancel)
    try:
        status, reason = classify(raw)
        result = ExecutionResult(
            status=status, exit_code=raw.exit_code, wall_s=raw.wall_s, cpu_s=raw.cpu_s,
            peak_memory_mb=raw.peak_memory_mb, stdout=raw.stdout, stderr=raw.stderr,
            reported_metric=metric_parse.parse_reported_metric(raw.stdout),
            error=with_sandbox_facts(reason, raw) if status is not Status.OK else reason,
            notes=tuple(raw.notes), leftovers_killed=raw.leftovers_killed)
        if status is not Status.OK:
            return result
        try:
            result.dev_score = _grade(task, raw.submission, "dev")
            if split == "test":
                result.test_score = _grade(task, raw.submission, "test")
        except InvalidSubmissionError as e:
            result.status, result.error = Status.INVALID_SUBMISSION, str(e)[:1000]
            result.dev_score = result.test_score = None
            return result
        except Exception as e:  # a grader bug is not the agent's fault
            result.status, result.error = Status.GRADER_ERROR, f"{type(e).__name__}: {e}"[:1000]
            result.dev_score = result.test_score = None
            return result
        result.valid_submission = True
        return result
    finally:
        if raw.submission is not None:
            try:
                os.unlink(raw.submission)
            except OSError:
                pass
