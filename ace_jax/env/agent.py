"""The agent environment: how a buffer state becomes a prompt, and a completion becomes an action.

One RL sample is one agent *step* from a buffer ``State``:

* ``step_kind(state)``: ``"draft"`` (no code yet), ``"debug"`` (the latest execution failed) or
  ``"improve"`` (the latest execution produced a valid submission).
* ``render_messages(state, task, cfg)`` / ``render_prompt(state, task, cfg)``: a system turn with the
  rules of the sandbox (read ``./input``, write ``./submission/submission.csv``, print
  ``VALIDATION_METRIC: <float>``, answer with one fenced python block), and a user turn with the
  task (full markdown page or a brief summary), the current code, the recent execution history and
  the kind of step asked for. ``render_prompt`` renders them in the Qwen3 chat format with the
  thinking block disabled (``models.tokenizer.render_chat``), ready to tokenise.
* ``parse_action(completion_text)``: the completion must hold exactly one fenced python block with the
  whole new file (``Action``); anything else is a typed ``InvalidAction`` with a reason, never an
  exception. Format rule (decided here): the closing fence is REQUIRED. A completion cut by the
  token budget ends inside its block and is therefore ``InvalidAction(UNCLOSED_BLOCK)``: the
  script would be truncated anyway, and the format reward teaches the policy to finish. Text
  before the block is free (reasoning); an ``Idea: ...`` paragraph there is returned as
  ``Action.idea`` (room for MLE-Ideator); text after the block is ignored.
* ``completion_target(code, idea=None)``: the exact assistant text the parser accepts, used by the
  warm-start SFT so the policy learns the format.

Nothing here imports JAX; everything is plain Python on the host.
"""
from __future__ import annotations

import dataclasses
import enum
import pathlib
import re
from typing import Any, Optional, Union

import ml_collections

from models.tokenizer import ENDOFTEXT, IM_END, render_chat

STEP_KINDS = ("draft", "debug", "improve")
DESCRIPTION_MODES = ("full", "brief")
FENCE = "```"
PYTHON_TAGS = ("python", "py", "python3", "")  # accepted info strings of the opening fence


class AgentError(ValueError):
    """A state, task or agent config that cannot be rendered (names what is wrong)."""


def default_config() -> ml_collections.ConfigDict:
    """The ``agent`` config section (prompt rendering and action parsing)."""
    c = ml_collections.ConfigDict()
    c.description = "brief"        # "full" (the task's markdown page) | "brief" (id, metric, columns)
    c.max_history = 3              # most recent execution-history entries shown (0: none)
    c.stderr_tail_chars = 160      # characters of each history entry's stderr tail shown
    c.max_code_chars = 4000        # current code longer than this is cut at a line (marker added);
    #                                a completion whose code is longer is an InvalidAction(TOO_LONG)
    c.max_columns_chars = 80       # brief mode: feature / submission column lists are cut to this
    c.show_system = True           # include the system turn (the sandbox rules; ~70 tokens)
    return c


# --------------------------------------------------------------------------------------------------
# Step kinds


def step_kind(state: Any) -> str:
    """What the next step from ``state`` is: "draft" | "debug" | "improve".

    draft: the state holds no code (a fresh root). debug: it holds code whose latest execution
    failed (any non-ok status). improve: its latest execution produced a valid submission, or it is
    a seed with code but no execution history (a reference solution to improve on).
    """
    code = getattr(state, "code", None)
    if code is None:
        raise AgentError(f"state {getattr(state, 'state_id', '?')} has no 'code' attribute")
    if not code.strip():
        return "draft"
    history = getattr(state, "history", None) or []
    if not history:
        return "improve"
    return "improve" if history[-1].status == "ok" else "debug"


# --------------------------------------------------------------------------------------------------
# Task descriptions

_NUMBERED = re.compile(r"^(.*?)(\d+)$")


def compress_columns(columns: list[str], max_chars: int) -> str:
    """A short, readable column list: runs like ``pixel_0..pixel_63`` collapse to one item.

    Args:
      columns: column names in file order.
      max_chars: the result is cut to this many characters (``...`` marks a cut; <= 0: no limit).
    """
    items: list[str] = []
    i = 0
    while i < len(columns):
        m = _NUMBERED.match(columns[i])
        j = i
        if m:
            prefix, start = m.group(1), int(m.group(2))
            while j + 1 < len(columns):
                m2 = _NUMBERED.match(columns[j + 1])
                if not (m2 and m2.group(1) == prefix and int(m2.group(2)) == start + (j + 1 - i)):
                    break
                j += 1
        if j - i >= 2:
            items.append(f"{columns[i]}..{columns[j]} ({j - i + 1} columns)")
        else:
            items.extend(columns[i:j + 1])
        i = j + 1
    text = ", ".join(items)
    if max_chars > 0 and len(text) > max_chars:
        text = text[: max(0, max_chars - 3)].rstrip(", ") + "..."
    return text


def _overview_line(description: str) -> str:
    """The first sentence of the ``## Overview`` section (or of the first paragraph)."""
    lines = description.splitlines()
    body: list[str] = []
    in_overview = False
    for line in lines:
        if line.startswith("## "):
            if in_overview:
                break
            in_overview = line.strip().lower() == "## overview"
            continue
        if in_overview and line.strip():
            body.append(line.strip())
        elif in_overview and body:
            break
    if not body:  # no Overview section: first non-heading paragraph
        for line in lines:
            if line.strip() and not line.startswith("#"):
                body = [line.strip()]
                break
    text = " ".join(body)
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return m.group(1) if m else text


def _csv_header(task: Any, name: str) -> Optional[list[str]]:
    public = getattr(task, "public_dir", None)
    if public is None:
        return None
    try:
        with (pathlib.Path(public) / name).open() as f:
            header = f.readline().strip()
    except OSError:
        return None
    return [c.strip() for c in header.split(",")] if header else None


def brief_description(task: Any, cfg: ml_collections.ConfigDict) -> str:
    """A few lines: task id, what to predict, metric and direction, the train.csv target column(s)
    (the train columns missing from test.csv), a short feature list, the submission columns."""
    direction = "lower is better" if task.lower_is_better else "higher is better"
    lines = [f"Task: {task.task_id}", _overview_line(task.description),
             f"Metric: {task.metric} ({direction})."]
    train, test = _csv_header(task, "train.csv"), _csv_header(task, "test.csv")
    if train:
        test_set = set(test or ())
        targets = [c for c in train if c not in test_set] if test else []
        features = [c for c in train if c in test_set and c != task.id_column] if test else \
            [c for c in train if c != task.id_column]
        if targets:
            lines.append(f"train.csv target: {', '.join(targets)}")
        if features:
            lines.append(f"features ({len(features)}): {compress_columns(features, cfg.max_columns_chars)}")
    sub_cols = [task.id_column, *task.target_columns]
    lines.append(f"submission.csv columns: {compress_columns(sub_cols, cfg.max_columns_chars)}")
    if getattr(task, "labels", None):
        lines.append(f"labels: {', '.join(task.labels)}")
    return "\n".join(lines)


def describe_task(task: Any, cfg: ml_collections.ConfigDict) -> str:
    """The task text shown in the prompt, per ``cfg.description`` ("full" | "brief")."""
    if cfg.description == "full":
        return task.description.strip()
    if cfg.description == "brief":
        return brief_description(task, cfg)
    raise AgentError(f"agent.description must be one of {DESCRIPTION_MODES}, got {cfg.description!r}")


# --------------------------------------------------------------------------------------------------
# Prompts

SYSTEM_PROMPT = (
    "You are a machine learning engineer. The data is in ./input (train.csv, test.csv, "
    "sample_submission.csv). Write one complete Python script that trains a model, prints "
    "VALIDATION_METRIC: <float> for a hold-out split, and writes ./submission/submission.csv. "
    "Answer with the whole file in one ```python block.")

STEP_INSTRUCTIONS = {
    "draft": "Write a first solution.",
    "debug": "The last run failed. Fix the script.",
    "improve": "Improve the score of the script.",
}


def _format_score(score: Optional[float]) -> str:
    return "none" if score is None else f"{score:.4g}"


def _history_text(state: Any, cfg: ml_collections.ConfigDict) -> str:
    history = list(getattr(state, "history", None) or [])
    if cfg.max_history <= 0 or not history:
        return ""
    shown = history[-cfg.max_history:]
    first = len(history) - len(shown) + 1
    lines = []
    for n, h in enumerate(shown, start=first):
        line = f"{n}. {h.action}: {h.status}"
        if h.status == "ok":
            line += f", score {_format_score(h.score)}"
        tail = (h.stderr_tail or "").strip()
        if h.status != "ok" and tail and cfg.stderr_tail_chars > 0:
            tail = tail[-cfg.stderr_tail_chars:].replace("\n", " | ")
            line += f"\n   {tail}"
        lines.append(line)
    return "\n".join(lines)


def _code_text(code: str, cfg: ml_collections.ConfigDict) -> str:
    code = code.strip("\n")
    if cfg.max_code_chars > 0 and len(code) > cfg.max_code_chars:
        head = code[: cfg.max_code_chars]
        if "\n" in head:  # cut at a line boundary
            head = head[: head.rindex("\n")]
        code = head + "\n# ... (cut)"
    return code


def render_messages(state: Any, task: Any, cfg: Optional[ml_collections.ConfigDict] = None,
                    *, advice: Optional[str] = None) -> list[dict[str, str]]:
    """The chat messages for one agent step from ``state`` on ``task``.

    Args:
      state: an ``ace_jax.curriculum.buffer.State`` (task_id, code, history, score).
      task: a ``sandbox.tasks.base.Task`` (task_id, description, metric, lower_is_better, columns).
      cfg: the ``agent`` section (``default_config()`` when None).
      advice: an advisor's instruction for this step (MLE-Ideator), shown before the step line.

    Returns:
      [system (if cfg.show_system), user] message dicts.

    Raises:
      AgentError: the state belongs to another task, or the config names an unknown mode.
    """
    cfg = cfg or default_config()
    if getattr(state, "task_id", task.task_id) != task.task_id:
        raise AgentError(f"state {getattr(state, 'state_id', '?')} is for task {state.task_id!r}, "
                         f"not {task.task_id!r}")
    kind = step_kind(state)
    parts = [describe_task(task, cfg)]
    if kind != "draft":
        parts.append(f"Current script:\n{FENCE}python\n{_code_text(state.code, cfg)}\n{FENCE}")
        hist = _history_text(state, cfg)
        if hist:
            parts.append(f"History:\n{hist}")
        score = getattr(state, "score", None)
        if score is not None:
            parts.append(f"Best score so far: {_format_score(score)}")
    if advice:
        parts.append(f"Advice from an expert (follow it in this step):\n{advice.strip()}")
    parts.append(f"Step: {kind}. {STEP_INSTRUCTIONS[kind]}")
    messages = []
    if cfg.show_system:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": "\n\n".join(parts)})
    return messages


def render_prompt(state: Any, task: Any, cfg: Optional[ml_collections.ConfigDict] = None, *,
                  advice: Optional[str] = None) -> str:
    """``render_messages`` in the Qwen3 chat format, generation prompt added, thinking disabled."""
    return render_chat(render_messages(state, task, cfg, advice=advice), add_generation_prompt=True,
                       enable_thinking=False)


# --------------------------------------------------------------------------------------------------
# Actions


class InvalidReason(str, enum.Enum):
    """Why a completion is not a valid action (stable strings, safe to log)."""

    NO_BLOCK = "no_block"                # no fenced code block at all
    MULTIPLE_BLOCKS = "multiple_blocks"  # more than one fenced block
    UNCLOSED_BLOCK = "unclosed_block"    # the block never closes (e.g. cut by the token budget)
    EMPTY_CODE = "empty_code"            # the block holds only whitespace
    NOT_PYTHON = "not_python"            # the block's info string is another language
    TOO_LONG = "too_long"                # the code exceeds max_code_chars


@dataclasses.dataclass(frozen=True)
class Action:
    """A well-formed step: the whole new solution file, and an optional idea (MLE-Ideator)."""

    code: str
    idea: Optional[str] = None

    @property
    def valid(self) -> bool:
        return True


@dataclasses.dataclass(frozen=True)
class InvalidAction:
    """A completion that does not follow the format; ``reason`` says how, ``detail`` in words."""

    reason: InvalidReason
    detail: str = ""

    @property
    def valid(self) -> bool:
        return False


ParsedAction = Union[Action, InvalidAction]

_OPEN = re.compile(r"^```[ \t]*([A-Za-z0-9_+-]*)[ \t]*$")
_CLOSE = re.compile(r"^```[ \t]*$")
_IDEA = re.compile(r"^\s*idea\s*:\s*(.*)$", re.IGNORECASE)
_TRAILING_SPECIALS = (IM_END, ENDOFTEXT)


def _strip_specials(text: str) -> str:
    text = text.rstrip()
    changed = True
    while changed:
        changed = False
        for s in _TRAILING_SPECIALS:
            if text.endswith(s):
                text = text[: -len(s)].rstrip()
                changed = True
    return text


def _parse_idea(preamble: str) -> Optional[str]:
    lines = preamble.splitlines()
    for i, line in enumerate(lines):
        m = _IDEA.match(line)
        if m:
            rest = [m.group(1)]
            for nxt in lines[i + 1:]:
                if not nxt.strip():
                    break
                rest.append(nxt.strip())
            idea = " ".join(r.strip() for r in rest).strip()
            return idea or None
    return None


def parse_action(completion_text: str, *, max_code_chars: Optional[int] = None) -> ParsedAction:
    """Parses a completion into an ``Action`` or an ``InvalidAction`` (never raises on content).

    Rules: fences are lines starting with three backticks. The opening fence's info string must be
    python / py / python3 or empty; exactly one block, closed by a bare fence line; its code must
    not be blank. A trailing ``<|im_end|>`` / ``<|endoftext|>`` is ignored, as is text after the
    block. An ``Idea: ...`` paragraph before the block becomes ``Action.idea``.

    Args:
      completion_text: the decoded completion (special tokens may or may not be stripped).
      max_code_chars: when given, code longer than this is ``InvalidAction(TOO_LONG)``.

    Raises:
      TypeError: ``completion_text`` is not a str (a caller bug, not a policy outcome).
    """
    if not isinstance(completion_text, str):
        raise TypeError(f"completion_text must be str, got {type(completion_text).__name__}")
    text = _strip_specials(completion_text)
    lines = text.split("\n")
    blocks: list[tuple[int, int, str]] = []  # (open line, close line, info string)
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m:
            if lines[i].startswith(FENCE):  # e.g. "```python import os": not a usable fence
                return InvalidAction(InvalidReason.NO_BLOCK, f"malformed fence line {i + 1}: {lines[i][:40]!r}")
            i += 1
            continue
        info = m.group(1).lower()
        j = i + 1
        while j < len(lines) and not _CLOSE.match(lines[j]):
            j += 1
        if j >= len(lines):
            if blocks:
                return InvalidAction(InvalidReason.MULTIPLE_BLOCKS,
                                     f"{len(blocks) + 1} blocks, the last one unclosed")
            return InvalidAction(InvalidReason.UNCLOSED_BLOCK, f"the block opened on line {i + 1} never closes")
        blocks.append((i, j, info))
        i = j + 1
    if not blocks:
        return InvalidAction(InvalidReason.NO_BLOCK, "no ```python block in the completion")
    if len(blocks) > 1:
        return InvalidAction(InvalidReason.MULTIPLE_BLOCKS, f"{len(blocks)} fenced blocks; exactly one expected")
    start, end, info = blocks[0]
    if info not in PYTHON_TAGS:
        return InvalidAction(InvalidReason.NOT_PYTHON, f"the block is tagged {info!r}, not python")
    code = "\n".join(lines[start + 1:end])
    if not code.strip():
        return InvalidAction(InvalidReason.EMPTY_CODE, "the python block is empty")
    code = code.strip("\n") + "\n"
    if max_code_chars is not None and max_code_chars > 0 and len(code) > max_code_chars:
        return InvalidAction(InvalidReason.TOO_LONG, f"{len(code)} code characters > {max_code_chars}")
    return Action(code=code, idea=_parse_idea("\n".join(lines[:start])))


def completion_target(code: str, idea: Optional[str] = None) -> str:
    """The assistant text for ``code`` in the format ``parse_action`` accepts (no EOS token).

    ``parse_action(completion_target(code, idea))`` returns ``Action(code', idea)`` where ``code'``
    is ``code`` with leading/trailing blank lines removed and one final newline.

    Raises:
      AgentError: blank code, code containing a fence line (it would end the block early), or an
        idea spanning several paragraphs.
    """
    body = code.strip("\n")
    if not body.strip():
        raise AgentError("completion_target needs non-blank code")
    if any(line.startswith(FENCE) for line in body.split("\n")):
        raise AgentError("code contains a line starting with ``` and cannot be fenced")
    head = ""
    if idea is not None:
        idea = " ".join(idea.split())
        if not idea:
            raise AgentError("idea must not be blank when given")
        head = f"Idea: {idea}\n\n"
    return f"{head}{FENCE}python\n{body}\n{FENCE}"
