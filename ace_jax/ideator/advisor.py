"""The MLE-Ideator as an ``advice.Advisor``: ``Ideator(policy, cfg)`` over any
``interface.ChatPolicy`` renders the ideator's prompt, asks the policy for one reply and parses the
idea; a policy error, a reply cut by the token budget or a malformed idea give
``Advice(valid=False, error=...)``."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import ml_collections

from ace_jax.env.advice import Advice, AdviceRequest
from ace_jax.ideator.ideator import ADVICE_MODES, default_config, idea_category, parse_idea
from ace_jax.ideator.prompts import render_ideator_messages


class Ideator:
    """An ``advice.Advisor`` over any ``interface.ChatPolicy`` (a JAX policy, an OpenAI endpoint).

    ``advise(request, seed=)`` renders ``render_ideator_messages``, asks the policy for one reply
    and parses it. Never raises for the policy's behaviour: a Completion with ``error``, an
    exception from the policy, a reply cut by the token budget (``finish_reason == "length"``)
    or a malformed idea all give ``Advice(instruction=None, valid=False, error=...)``.
    """

    def __init__(self, policy: Any, cfg: Optional[ml_collections.ConfigDict] = None):
        self.policy = policy
        self.cfg = cfg or default_config()
        if self.cfg.advice_text not in ADVICE_MODES:
            raise ValueError(f"ideator.advice_text must be one of {ADVICE_MODES}, "
                             f"got {self.cfg.advice_text!r}")

    def messages(self, request: AdviceRequest) -> list[dict[str, str]]:
        return render_ideator_messages(request, self.cfg)

    def advise(self, request: AdviceRequest, *, seed: int = 0) -> Advice:
        return self.advise_batch([request], seed=seed)[0]

    def advise_batch(self, requests: Sequence[AdviceRequest], *, seed: int = 0) -> list[Advice]:
        """``advise`` for several requests in one policy call (one batch for a JAX policy)."""
        if not requests:
            return []
        try:
            completions = self.policy.complete([self.messages(r) for r in requests], seed=seed)
            if len(completions) != len(requests):
                raise RuntimeError(f"the policy returned {len(completions)} replies for "
                                   f"{len(requests)} conversations")
        except Exception as e:  # noqa: BLE001 - an advisor must not crash the episode
            err = f"policy error: {type(e).__name__}: {str(e)[:200]}"
            return [Advice(instruction=None, valid=False, error=err) for _ in requests]
        return [self.advice_from_completion(c) for c in completions]

    def advice_from_completion(self, completion: Any) -> Advice:
        """The ``Advice`` of one ``interface.Completion``."""
        if getattr(completion, "error", None):
            return Advice(instruction=None, valid=False, error=f"policy error: {completion.error}",
                          raw=completion.text or "")
        text = completion.text or ""
        parsed = parse_idea(text, self.cfg,
                            truncated=getattr(completion, "finish_reason", "stop") == "length")
        if not parsed.valid:
            return Advice(instruction=None, valid=False, error=f"format: {parsed}", raw=text)
        return Advice(instruction=parsed.advice(self.cfg.advice_text), valid=True,
                      category=idea_category(parsed), raw=text)
