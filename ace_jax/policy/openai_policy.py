"""``OpenAIPolicy``: a `interface.ChatPolicy` over any OpenAI-compatible
``/v1/chat/completions`` endpoint (vLLM, a frontier API, or ``launch/serve.py``), over plain HTTP
with a timeout and retries.
"""
from __future__ import annotations

import http.client
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence

from ace_jax.policy.interface import Completion, Conversation


class OpenAIPolicy:
    """An OpenAI-compatible chat endpoint (``POST {base_url}/chat/completions``).

    ``base_url`` ends in ``/v1`` (e.g. ``http://127.0.0.1:8000/v1``). Each conversation is one
    request (conversation i is sent with ``seed + i``); up to ``max_concurrency`` requests are in
    flight at once, so a batching server (``launch/serve.py``, vLLM) can batch them.

    Failures never raise: after ``retries`` further attempts (``backoff_s * 2**attempt`` apart,
    at most 2 s) the reply is ``Completion(error=..., finish_reason="error")`` with ``error``
    starting "timeout after ...", "HTTP <code>: ...", "unreachable: ..." or
    "malformed response: ...". Client errors (HTTP 4xx other than 408 / 429) are not retried.
    """

    def __init__(self, base_url: str, model: str = "default", *, api_key: Optional[str] = None,
                 timeout_s: float = 60.0, retries: int = 1, max_tokens: int = 1024,
                 temperature: float = 0.0, max_concurrency: int = 8, backoff_s: float = 0.25,
                 name: Optional[str] = None):
        if retries < 0 or max_concurrency < 1 or timeout_s <= 0:
            raise ValueError(f"need retries >= 0, max_concurrency >= 1, timeout_s > 0; got "
                             f"{retries}, {max_concurrency}, {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.max_concurrency = int(max_concurrency)
        self.backoff_s = float(backoff_s)
        self.name = name or model

    def _post(self, body: dict) -> Any:
        req = urllib.request.Request(self.base_url + "/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read().decode("utf-8"))

    @staticmethod
    def _parse(data: Any) -> Completion:
        """The Completion of a chat.completion body; raises ValueError when it is not one."""
        if not isinstance(data, dict):
            raise ValueError(f"body is a {type(data).__name__}, not a JSON object")
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError(f"no choices[0] in the body (keys {sorted(data)[:8]})")
        choice = choices[0]
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"choices[0].message.content is {type(text).__name__}, not a string")
        usage = data.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        return Completion(text=text, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          completion_tokens=int(usage.get("completion_tokens") or 0),
                          finish_reason=str(choice.get("finish_reason") or "stop"))

    def complete_one(self, conversation: Conversation, *, seed: int = 0) -> Completion:
        body = {"model": self.model, "messages": [dict(m) for m in conversation],
                "max_tokens": self.max_tokens, "temperature": self.temperature, "seed": seed}
        error = "no attempt"
        for attempt in range(self.retries + 1):
            retryable = True
            try:
                return self._parse(self._post(body))
            except urllib.error.HTTPError as e:
                try:
                    detail = e.read()[:200].decode("utf-8", "replace")
                except Exception:  # the error body itself may be cut off
                    detail = ""
                error = f"HTTP {e.code}: {detail}".rstrip(": ")
                retryable = e.code >= 500 or e.code in (408, 429)
            except urllib.error.URLError as e:
                error = (f"timeout after {self.timeout_s:g} s"
                         if isinstance(e.reason, TimeoutError) else f"unreachable: {e.reason}")
            except TimeoutError:
                error = f"timeout after {self.timeout_s:g} s"
            except (OSError, http.client.HTTPException) as e:  # reset, closed, cut-off body
                error = f"unreachable: {type(e).__name__}: {str(e)[:200]}"
            except (ValueError, TypeError) as e:  # JSON / UTF-8 / schema
                error = f"malformed response: {str(e)[:200]}"
            if attempt < self.retries and retryable:
                time.sleep(min(2.0, self.backoff_s * 2 ** attempt))
            elif not retryable:
                break
        return Completion(text="", error=error, finish_reason="error")

    def complete(self, conversations: Sequence[Conversation], *, seed: int = 0
                 ) -> list[Completion]:
        """One reply per conversation, in order (requests run ``max_concurrency`` at a time)."""
        if len(conversations) <= 1 or self.max_concurrency == 1:
            return [self.complete_one(c, seed=seed + i) for i, c in enumerate(conversations)]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(self.max_concurrency, len(conversations))) as pool:
            return list(pool.map(lambda ic: self.complete_one(ic[1], seed=seed + ic[0]),
                                 enumerate(conversations)))
