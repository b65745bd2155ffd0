"""The interface every chat policy implements: anything that turns conversations into
assistant replies.

The evaluation harness, the MLE-Ideator loop and the OpenAI-compatible server all talk to a policy
through one small interface, ``ChatPolicy.complete``:

    conversations: a list of N chat conversations, each a list of {"role", "content"} dicts
    returns:       a list of N ``Completion``s, in order; a policy that cannot answer one
                   conversation (timeout, garbage, server error) returns a Completion with
                   ``error`` set and empty text, never raises for it.

Its implementations: ``policy.JaxPolicy`` (our model) and ``openai_policy.OpenAIPolicy`` (an
HTTP endpoint); ``PolicyError`` is what building one raises.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Protocol, Sequence

Conversation = Sequence[Mapping[str, Any]]


class PolicyError(RuntimeError):
    """A policy that cannot be built (missing run directory, no checkpoint, mismatched sizes)."""


@dataclasses.dataclass
class Completion:
    """One assistant reply.

    Attributes:
      text: the reply (special tokens removed); "" when ``error`` is set.
      error: why the policy gave no reply (e.g. "timeout after 30.0 s"), else None.
      prompt_tokens / completion_tokens: token counts where the policy knows them (0 otherwise).
      finish_reason: "stop" (EOS / stop sequence), "length" (token budget spent) or "error".
      token_ids: the sampled token ids (the EOS included, ``completion_tokens`` of them) where
        the policy has them (``JaxPolicy``), else None.
    """
    text: str
    error: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    token_ids: Optional[list[int]] = None

    @property
    def ok(self) -> bool:
        return self.error is None


class ChatPolicy(Protocol):
    """What the harness needs of a policy (see the module docstring)."""

    name: str

    def complete(self, conversations: Sequence[Conversation], *, seed: int = 0
                 ) -> list[Completion]: ...
