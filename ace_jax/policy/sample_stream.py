"""A sample's text while it is decoded (``SampleStream``: token ids in, text pieces out, stop
strings, EOS and budget), and the same for a reply sampled whole: cut at stop strings
(``apply_stop``) and split at token boundaries (``text_pieces``)."""
from __future__ import annotations

import dataclasses
from typing import Optional

from ace_jax.policy.interface import Completion

# A decoded tail that ends inside a multi-byte character is held back for at most this many
# tokens (a UTF-8 character has at most 4 bytes, a byte-level token at least 1).
_MAX_PARTIAL_TOKENS = 4


def apply_stop(completion: Completion, stop: tuple) -> Completion:
    """Cuts a finished reply before the earliest stop string (finish_reason "stop"); token counts
    and ids are left as sampled. For policies sampled whole (``CompletionEngine``)."""
    cuts = [i for i in (completion.text.find(s) for s in stop) if i >= 0]
    if not cuts:
        return completion
    return dataclasses.replace(completion, text=completion.text[:min(cuts)],
                               finish_reason="stop")


def text_pieces(text: str, token_ids: Optional[list], tokenizer) -> list[str]:
    """``text`` split at token boundaries (pieces that concatenate to ``text``): the prefix
    decodes of ``token_ids`` that ``text`` starts with, skipping those that end inside a
    multi-byte character. One piece when there are no token ids or tokenizer."""
    if not text:
        return []
    if not token_ids or tokenizer is None:
        return [text]
    pieces, emitted = [], 0
    for k in range(1, len(token_ids) + 1):
        prefix = tokenizer.decode(token_ids[:k], skip_special_tokens=True)
        if len(prefix) >= len(text):
            break
        if len(prefix) > emitted and not prefix.endswith("\ufffd") and text.startswith(prefix):
            pieces.append(text[emitted:len(prefix)])
            emitted = len(prefix)
    if emitted < len(text):
        pieces.append(text[emitted:])
    return pieces



class SampleStream:
    """The text of one sample while it is decoded: token ids in, text pieces out.

    The sample finishes at an EOS id (finish_reason "stop"; the EOS is counted, has no text), at
    the token that completes a stop string ("stop"; the text ends before the string), or when it
    has ``max_tokens`` tokens ("length"). Tokens after the finish are ignored. ``pop_text``
    returns the text not handed out yet, holding back a tail that could begin a stop string or
    ends inside a multi-byte character; once finished, everything that is left.

    Text is decoded incrementally (only the tokens since the last clean character boundary), so
    a sample of L tokens costs O(L) decoding; the finished text is the tokenizer's decode of all
    the ids (what ``JaxPolicy.complete`` returns) unless a stop string cut it.
    """

    def __init__(self, tokenizer, *, max_tokens: int, stop: tuple = (), eos_ids: tuple = ()):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self.stop = tuple(stop)
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.token_ids: list[int] = []
        self.finish_reason: Optional[str] = None
        self._text = ""        # decode of token_ids[:self._decoded] (cut at a stop string)
        self._decoded = 0
        self._sent = 0         # characters of the text handed out by pop_text
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token_id: int) -> None:
        """Appends one sampled token (ignored once finished)."""
        if self.finished:
            return
        token_id = int(token_id)
        self.token_ids.append(token_id)
        if token_id in self.eos_ids:
            self._finish("stop")
            return
        self._decode_tail()
        if not self.finished and len(self.token_ids) >= self.max_tokens:
            self._finish("length")

    def _decode_tail(self) -> None:
        tail = self.tokenizer.decode(self.token_ids[self._decoded:], skip_special_tokens=True)
        if tail.endswith("\ufffd") and len(self.token_ids) - self._decoded < _MAX_PARTIAL_TOKENS:
            return  # inside a multi-byte character: wait for its other bytes
        searched = len(self._text)
        self._text += tail
        self._decoded = len(self.token_ids)
        if self.stop:
            start = max(0, searched - self._longest_stop + 1)
            hits = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self._text = self._text[:min(hits)]
                self.finish_reason = "stop"

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self._text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        self._decoded = len(self.token_ids)

    def _held_back(self) -> int:
        """Characters at the end of the text that could begin a stop string."""
        for k in range(min(self._longest_stop - 1, len(self._text)), 0, -1):
            if any(s.startswith(self._text[-k:]) for s in self.stop):
                return k
        return 0

    @property
    def text(self) -> str:
        """The text decoded so far (the final text once finished)."""
        return self._text

    def pop_text(self) -> str:
        """The text not handed out yet (see the class docstring); may be ""."""
        end = len(self._text) if self.finished else len(self._text) - self._held_back()
        piece = self._text[self._sent:end] if end > self._sent else ""
        self._sent = max(self._sent, end)
        return piece

    def completion(self, prompt_tokens: int) -> Completion:
        """The finished sample as a Completion (``completion_tokens`` = tokens generated)."""
        return Completion(text=self._text, prompt_tokens=int(prompt_tokens),
                          completion_tokens=len(self.token_ids),
                          finish_reason=self.finish_reason or "length",
                          token_ids=list(self.token_ids))
