"""The OpenAI chat-completions schema of the server (``ace_jax.policy.serving``): a request body
parsed and validated into a ``ChatRequest`` (``parse_chat_request``; a ``RequestError`` names what
is wrong, with its HTTP status and OpenAI error type), and the reply objects: ``chat.completion``
(``completion_response``), ``usage`` (``usage_of``) and the error body (``error_body``)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from ace_jax.policy.interface import Completion

ROLES = ("system", "user", "assistant", "tool")
MAX_STOP_STRINGS = 4


class RequestError(ValueError):
    """A request the server refuses; ``status`` is the HTTP status, ``type`` the OpenAI error type."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: Optional[str] = None):
        super().__init__(message)
        self.status, self.type, self.param = status, type, param


@dataclasses.dataclass
class ChatRequest:
    """A validated ``/v1/chat/completions`` request.

    Attributes:
      messages: the conversation (list of dicts with "role" and "content").
      max_tokens: decode budget per sample in tokens, 1 <= max_tokens <= the server's
        max_new_tokens.
      temperature: softmax temperature, >= 0 (0 = greedy).
      seed: the PRNG seed, or None (the server picks one).
      stop: strings that end a sample (its text ends before the first occurrence).
      stream: answer with Server-Sent Events.
      include_usage: send a usage chunk when streaming (``stream_options.include_usage``).
      n: samples of this prompt (choices of the reply).
    """
    messages: list
    max_tokens: int
    temperature: float
    seed: Optional[int] = None
    stop: tuple = ()
    stream: bool = False
    include_usage: bool = False
    n: int = 1


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of {role, content} objects",
                           param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object", param="messages")
        if m.get("role") not in ROLES:
            raise RequestError(f"messages[{i}].role is {m.get('role')!r}; expected one of "
                               f"{list(ROLES)}", param="messages")
        if m.get("content") is not None and not isinstance(m.get("content"), str):
            raise RequestError(f"messages[{i}].content must be a string (content parts are not "
                               "supported)", param="messages")
    from models import tokenizer as tok_lib

    try:  # the exact check the policy's prompt rendering makes
        tok_lib.render_chat(messages, add_generation_prompt=True)
    except (tok_lib.TokenizerError, KeyError, TypeError) as e:
        raise RequestError(f"'messages' cannot be rendered: {e}", param="messages") from None


def _parse_max_tokens(data: dict, max_new_tokens: int) -> int:
    key = "max_tokens" if data.get("max_tokens") is not None else "max_completion_tokens"
    max_tokens = data.get(key)
    if max_tokens is None:
        return int(max_new_tokens)
    if not _is_int(max_tokens) or max_tokens < 1:
        raise RequestError(f"'{key}' must be a positive integer, got {max_tokens!r}", param=key)
    if max_tokens > max_new_tokens:
        raise RequestError(f"{key} is too large: {max_tokens}. This model supports at most "
                           f"{max_new_tokens} completion tokens, whereas you provided "
                           f"{max_tokens}.", param=key)
    return int(max_tokens)


def parse_chat_request(body: bytes, *, max_new_tokens: int, default_temperature: float = 0.0,
                       max_n: int = 32) -> ChatRequest:
    """Parses and validates a request body; raises RequestError (HTTP 400) naming the problem.

    ``max_new_tokens`` is the server's largest reply (tokens per sample) and ``max_n`` its
    largest ``n``."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the body must be a JSON object, got {type(data).__name__}")
    messages = data.get("messages")
    _check_messages(messages)
    max_tokens = _parse_max_tokens(data, max_new_tokens)
    temperature = data.get("temperature")
    if temperature is None:
        temperature = default_temperature
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) \
            or not 0 <= temperature < float("inf"):
        raise RequestError(f"'temperature' must be a number >= 0, got {temperature!r}",
                           param="temperature")
    seed = data.get("seed")
    if seed is not None and not _is_int(seed):
        raise RequestError(f"'seed' must be an integer, got {seed!r}", param="seed")
    n = data.get("n")
    n = 1 if n is None else n
    if not _is_int(n) or not 1 <= n <= max_n:
        raise RequestError(f"'n' must be an integer from 1 to {max_n}, got {n!r}", param="n")
    stop = data.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOP_STRINGS \
            or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"'stop' must be a non-empty string or a list of at most "
                           f"{MAX_STOP_STRINGS} of them", param="stop")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be a boolean, got {stream!r}", param="stream")
    opts = data.get("stream_options")
    include_usage = bool(isinstance(opts, dict) and opts.get("include_usage"))
    return ChatRequest(messages=messages, max_tokens=max_tokens, temperature=float(temperature),
                       seed=None if seed is None else int(seed), stop=tuple(stop), stream=stream,
                       include_usage=include_usage, n=int(n))


def error_body(message: str, type_: str, param: Optional[str] = None) -> dict:
    """The OpenAI error object ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


def usage_of(choices: list[Completion]) -> dict:
    """OpenAI ``usage`` of the choices of one prompt: the prompt counted once, the completion
    tokens of every choice summed."""
    prompt = choices[0].prompt_tokens if choices else 0
    completion = sum(c.completion_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def completion_response(choices: list[Completion], *, request_id: str, model: str,
                        created: int) -> dict:
    """The OpenAI ``chat.completion`` object of the choices of one request (choice i at
    index i)."""
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                     "logprobs": None, "finish_reason": c.finish_reason}
                    for i, c in enumerate(choices)],
        "usage": usage_of(choices),
    }
