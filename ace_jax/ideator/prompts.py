"""The MLE-Ideator's prompt: the chat messages the ideator is asked with, and the implementer's
messages carrying an idea.

* ``render_ideator_messages(request, cfg)``: the chat messages for the ideator: the task brief
  (``agent.describe_task``), the implementer's attempts (kind, status, score, stderr tail), the
  current score and script, the goal and the required answer format (last, so a prompt cut from
  the left keeps it).
* ``request_from_state(state, task)``: the ``AdviceRequest`` of a buffer ``State``.
* ``implementer_prompt_with_idea(state, task, idea, agent_cfg)``: the implementer's next-step
  messages carrying the idea (``agent.render_messages(..., advice=)``).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import ml_collections

from ace_jax.env import agent
from ace_jax.env.advice import AdviceRequest, Attempt
from ace_jax.ideator.ideator import Idea, default_config

REASON_TEXT = {
    "seek_help": "The implementer asked for help.",
    "stagnation": "The implementer's score stopped improving.",
}

SYSTEM_PROMPT = (
    "You are an expert machine learning engineer advising an implementer agent that writes and "
    "runs Python solutions for a prediction task. You do not write the script: you give ONE idea "
    "for the implementer's next step that should improve the dev score.")

FORMAT_INSTRUCTIONS = (
    "Answer with exactly these three labelled lines, in this order, and nothing else:\n"
    "Analysis: <refine|revert>: <one or two sentences>\n"
    "Action: <one concrete instruction or code change>\n"
    "Rationale: <why it should improve the dev score>\n"
    "Use refine to build on the current script, revert to go back to an earlier, better one.")


def score_text(score: Optional[float]) -> str:
    """A score as the prompt shows it: 4 significant digits, "none" when there is none."""
    return "none" if score is None else f"{score:.4g}"


def _attempt_lines(attempts: Sequence[Attempt], cfg: ml_collections.ConfigDict) -> str:
    if cfg.max_attempts <= 0 or not attempts:
        return ""
    shown = list(attempts)[-cfg.max_attempts:]
    first = len(attempts) - len(shown) + 1
    lines = []
    for n, a in enumerate(shown, start=first):
        line = f"{n}. {a.kind}: {a.status}"
        if a.dev_score is not None:
            line += f", score {score_text(a.dev_score)}"
        tail = (a.stderr_tail or "").strip()
        if a.status != "ok" and tail and cfg.stderr_tail_chars > 0:
            line += "\n   " + tail[-cfg.stderr_tail_chars:].replace("\n", " | ")
        lines.append(line)
    return "\n".join(lines)


def _code_block(code: str, max_chars: int) -> str:
    code = code.strip("\n")
    if max_chars > 0 and len(code) > max_chars:
        head = code[:max_chars]
        if "\n" in head:
            head = head[: head.rindex("\n")]
        code = head + "\n# ... (cut)"
    return f"{agent.FENCE}python\n{code}\n{agent.FENCE}"


def render_ideator_messages(request: AdviceRequest, cfg: Optional[ml_collections.ConfigDict] = None
                            ) -> list[dict[str, str]]:
    """The ideator's chat messages for ``request``.

    User turn, in order: the task brief, the goal (metric and direction, current best score), the
    implementer's attempts (oldest first, at most ``cfg.max_attempts``: kind, status, score, the
    stderr tail of failures), the current script, why help is asked, and the required answer
    format (last).

    Args:
      request: the ``advice.AdviceRequest`` (its ``task`` is a ``sandbox.tasks.base.Task``).
      cfg: the ``ideator`` section (``default_config()`` when None).

    Returns:
      [system (if cfg.show_system), user] message dicts.

    Raises:
      agent.AgentError: the config names an unknown description mode.
    """
    cfg = cfg or default_config()
    task = request.task
    direction = "lower is better" if task.lower_is_better else "higher is better"
    parts = [agent.describe_task(task, cfg),
             f"Goal: improve the dev score ({task.metric}, {direction}). "
             f"Current best score: {score_text(request.current_score)}."]
    hist = _attempt_lines(request.attempts, cfg)
    if hist:
        parts.append(f"Implementer's attempts:\n{hist}")
    if request.current_code.strip():
        parts.append(f"Current script:\n{_code_block(request.current_code, cfg.max_code_chars)}")
    else:
        parts.append("Current script: none yet.")
    parts.append(REASON_TEXT.get(request.reason, f"Reason for help: {request.reason}."))
    parts.append(FORMAT_INSTRUCTIONS)
    messages = []
    if cfg.show_system:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": "\n\n".join(parts)})
    return messages


def request_from_state(state: Any, task: Any, reason: str = "stagnation") -> AdviceRequest:
    """An ``AdviceRequest`` for a buffer ``State``: its history as attempts (their code is not
    stored in the buffer, so ``Attempt.code`` is empty), its best score and its (latest) code."""
    attempts = [Attempt(step=i, kind=h.action, code="", status=h.status, dev_score=h.score,
                        stderr_tail=h.stderr_tail or "")
                for i, h in enumerate(getattr(state, "history", None) or [])]
    return AdviceRequest(task=task, attempts=attempts, current_score=state.score,
                         current_code=state.code, reason=reason)


def implementer_prompt_with_idea(state: Any, task: Any, idea: Union[Idea, str],
                                 agent_cfg: Optional[ml_collections.ConfigDict] = None, *,
                                 advice_text: str = "action") -> list[dict[str, str]]:
    """The implementer's messages for its next step from ``state``, carrying ``idea`` (an
    ``Idea``, rendered per ``advice_text``, or an instruction string) as the expert advice."""
    text = idea if isinstance(idea, str) else idea.advice(advice_text)
    return agent.render_messages(state, task, agent_cfg, advice=text)
