"""An OpenAI-compatible HTTP server in front of a ``JaxPolicy`` (stdlib only).

Endpoints (JSON bodies, UTF-8):

* ``POST /v1/chat/completions``: ``model`` (ignored: the server has one model), ``messages``
  (list of ``{"role", "content"}``, roles system / user / assistant / tool), ``max_tokens`` (or
  ``max_completion_tokens``; clamped to the server's ``max_new_tokens``), ``temperature`` (>= 0;
  default: the policy's), ``seed``, ``n`` (only 1), ``stop`` (a string or up to 4; the reply is
  cut before the first one), ``stream``. Other fields are ignored. The reply follows the OpenAI
  ``chat.completion`` schema; with ``stream`` it is Server-Sent Events: ``data: {chunk}`` lines of
  ``chat.completion.chunk`` objects (role, then the text one token at a time, then an empty delta
  with ``finish_reason`` and ``usage``) and ``data: [DONE]``. Streaming only frames the reply: the
  chunks are sent once the whole reply is sampled.
* ``GET /v1/models``: the one model. ``GET /health``: status and batching counters.

Errors have the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` for an unparsable or invalid body, 404 for an unknown path, 500
``server_error`` when sampling fails, 503 while shutting down. A bad request never stops the server.

Batching: handler threads parse and validate requests and put them on a queue; one worker thread
takes the first waiting request, collects whatever else arrives within ``batch_window_ms`` (up to
``max_batch_size``), and samples each group of requests with equal ``(temperature, max_tokens)``
in one ``policy.complete`` call. Greedy replies (temperature 0) are what ``policy.complete`` gives
for the conversation alone; a sampled request with an explicit ``seed`` is run alone (key =
``seed``), so it reproduces ``policy.complete([conversation], seed=seed)``; unseeded sampled
requests share a batch and a server-chosen key.

``start_server(policy, host, port)`` runs all of this in-process (``port=0`` picks a free port);
``shutdown(server)`` stops it. ``launch/serve.py`` is the command-line entry point.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from ace_jax.policy import Completion

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
MAX_BODY_BYTES = 16 * 1024 * 1024
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
      max_tokens: decode budget in tokens, 1 <= max_tokens <= the server's max_new_tokens.
      temperature: softmax temperature, >= 0 (0 = greedy).
      seed: the PRNG seed, or None (the server picks one).
      stop: strings that end the reply (the reply is cut before the first occurrence).
      stream: answer with Server-Sent Events.
      include_usage: send a usage chunk when streaming (``stream_options.include_usage``).
    """
    messages: list
    max_tokens: int
    temperature: float
    seed: Optional[int] = None
    stop: tuple = ()
    stream: bool = False
    include_usage: bool = False


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def parse_chat_request(body: bytes, *, max_new_tokens: int,
                       default_temperature: float = 0.0) -> ChatRequest:
    """Parses and validates a request body; raises RequestError (HTTP 400) naming the problem."""
    try:
        data = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise RequestError(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise RequestError(f"the body must be a JSON object, got {type(data).__name__}")
    messages = data.get("messages")
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

    max_tokens = data.get("max_tokens", data.get("max_completion_tokens"))
    if max_tokens is None:
        max_tokens = max_new_tokens
    if not _is_int(max_tokens) or max_tokens < 1:
        raise RequestError(f"'max_tokens' must be a positive integer, got {max_tokens!r}",
                           param="max_tokens")
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
    n = data.get("n", 1)
    if n is not None and n != 1:
        raise RequestError(f"only n=1 is supported, got n={n!r}", param="n")
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
    return ChatRequest(messages=messages, max_tokens=min(int(max_tokens), int(max_new_tokens)),
                       temperature=float(temperature), seed=None if seed is None else int(seed),
                       stop=tuple(stop), stream=stream, include_usage=include_usage)


def apply_stop(completion: Completion, stop: tuple) -> Completion:
    """Cuts the reply before the earliest stop string (finish_reason "stop"); token counts and
    ids are left as sampled."""
    cuts = [i for i in (completion.text.find(s) for s in stop) if i >= 0]
    if not cuts:
        return completion
    return dataclasses.replace(completion, text=completion.text[:min(cuts)],
                               finish_reason="stop")


# --------------------------------------------------------------------------------------- batching


class _Pending:
    """One queued request and, once sampled, its reply (or the error that prevented it)."""

    def __init__(self, request: ChatRequest):
        self.request = request
        self.done = threading.Event()
        self.completion: Optional[Completion] = None
        self.error: Optional[RequestError] = None


_STOP = object()


class Batcher:
    """Collects requests for ``window_s`` after the first one and samples them in groups.

    Counters (``stats()``): ``batches`` (``policy.complete`` calls), ``requests`` (requests
    answered), ``max_batch`` (the largest group sampled together).
    """

    def __init__(self, policy, *, window_s: float = 0.02, max_batch_size: int = 32):
        if window_s < 0 or max_batch_size < 1:
            raise ValueError(f"need window_s >= 0 and max_batch_size >= 1, got {window_s}, "
                             f"{max_batch_size}")
        self.policy = policy
        self.window_s = float(window_s)
        self.max_batch_size = int(max_batch_size)
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._lock = threading.Lock()
        self._stats = {"batches": 0, "requests": 0, "max_batch": 0}
        self._seeds = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ace-serve-batcher", daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def submit(self, request: ChatRequest) -> _Pending:
        p = _Pending(request)
        with self._lock:  # no put after close, so nothing waits forever
            if self._closed:
                p.error = RequestError("the server is shutting down", status=503,
                                       type="server_error")
                p.done.set()
            else:
                self._queue.put(p)
        return p

    def close(self, timeout_s: float = 30.0) -> None:
        """Finishes the batch in progress, fails what is still queued (503), stops the worker."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout_s)
        while True:
            try:
                p = self._queue.get_nowait()
            except queue.Empty:
                break
            if isinstance(p, _Pending):
                p.error = RequestError("the server is shutting down", status=503,
                                       type="server_error")
                p.done.set()

    def _collect(self) -> tuple[list[_Pending], bool]:
        first = self._queue.get()
        if first is _STOP:
            return [], True
        batch, deadline = [first], time.monotonic() + self.window_s
        while len(batch) < self.max_batch_size:
            remaining = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=remaining) if remaining > 0 else \
                    self._queue.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                self._queue.put(_STOP)  # seen again after this batch
                break
            batch.append(item)
        return batch, False

    def _run(self) -> None:
        while True:
            batch, stop = self._collect()
            if stop:
                return
            groups: dict[tuple, list[_Pending]] = {}
            for p in batch:
                r = p.request
                alone = r.temperature > 0 and r.seed is not None
                key = (r.temperature, r.max_tokens, id(p) if alone else None)
                groups.setdefault(key, []).append(p)
            for (temperature, max_tokens, alone), group in groups.items():
                if temperature == 0:
                    seed = 0
                elif alone is not None:
                    seed = group[0].request.seed
                else:
                    seed = next(self._seeds)
                self._sample(group, seed=seed, temperature=temperature, max_tokens=max_tokens)

    def _sample(self, group: list[_Pending], *, seed: int, temperature: float,
                max_tokens: int) -> None:
        try:
            out = self.policy.complete([p.request.messages for p in group], seed=seed,
                                       max_new_tokens=max_tokens, temperature=temperature)
            if len(out) != len(group):
                raise RuntimeError(f"the policy returned {len(out)} replies for {len(group)}")
        except Exception as e:  # noqa: BLE001 - one failing batch must not stop the server
            logger.exception("sampling a batch of %d failed", len(group))
            err = RequestError(f"sampling failed: {type(e).__name__}: {e}", status=500,
                               type="server_error")
            for p in group:
                p.error = err
                p.done.set()
            return
        with self._lock:
            self._stats["batches"] += 1
            self._stats["requests"] += len(group)
            self._stats["max_batch"] = max(self._stats["max_batch"], len(group))
        for p, c in zip(group, out):
            p.completion = apply_stop(c, p.request.stop)
            p.done.set()


# --------------------------------------------------------------------------------------- HTTP


def _error_body(message: str, type_: str, param: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": None}}


def completion_response(c: Completion, *, request_id: str, model: str, created: int) -> dict:
    """The OpenAI ``chat.completion`` object of one reply."""
    return {
        "id": request_id, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                     "logprobs": None, "finish_reason": c.finish_reason}],
        "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                  "total_tokens": c.prompt_tokens + c.completion_tokens},
    }


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


class PolicyServer(ThreadingHTTPServer):
    """The HTTP server: one handler thread per connection, one ``Batcher`` behind them.

    Attributes:
      policy, batcher, model_name, max_new_tokens, default_temperature, request_timeout_s.
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], policy, *, batch_window_ms: float = 20.0,
                 max_batch_size: int = 32, max_new_tokens: Optional[int] = None,
                 model_name: Optional[str] = None, request_timeout_s: float = 3600.0):
        sampling = getattr(policy, "sampling", None)
        self.policy = policy
        self.model_name = model_name or getattr(policy, "name", None) or "ace-jax"
        self.max_new_tokens = int(max_new_tokens or getattr(sampling, "max_new_tokens", 256))
        self.default_temperature = float(getattr(sampling, "temperature", 0.0))
        self.request_timeout_s = float(request_timeout_s)
        self.created = int(time.time())
        self._started = False
        super().__init__(address, _Handler)
        self.batcher = Batcher(policy, window_s=batch_window_ms / 1000.0,
                               max_batch_size=max_batch_size)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def stats(self) -> dict:
        """Batching counters: batches, requests, max_batch (see ``Batcher``)."""
        return self.batcher.stats()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._started = True
        super().serve_forever(poll_interval)

    def close(self) -> None:
        """Stops accepting connections, fails queued requests, stops the batching worker."""
        if self._started:  # BaseServer.shutdown waits for a serve_forever that must have run
            self.shutdown()
        self.server_close()
        self.batcher.close()


class _Handler(BaseHTTPRequestHandler):
    server: PolicyServer
    server_version = "ace-jax-serve/1"

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        logger.debug("%s - " + format, self.address_string(), *args)

    # -- plumbing ----------------------------------------------------------------------------

    def _send_json(self, status: int, obj: dict) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, e: RequestError) -> None:
        self._send_json(e.status, _error_body(str(e), e.type, e.param))

    def _path(self) -> str:
        return self.path.split("?", 1)[0].rstrip("/") or "/"

    # -- routes ------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        path, srv = self._path(), self.server
        if path == "/health":
            self._send_json(200, {"status": "ok", "model": srv.model_name, **srv.stats()})
        elif path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": srv.model_name, "object": "model", "created": srv.created,
                 "owned_by": "ace-jax", "max_model_len": srv.max_new_tokens}]})
        else:
            self._send_error(RequestError(f"no route GET {path}", status=404,
                                          type="not_found_error"))

    def do_POST(self) -> None:  # noqa: N802 - stdlib name
        path = self._path()
        try:
            if path != "/v1/chat/completions":
                raise RequestError(f"no route POST {path}", status=404, type="not_found_error")
            self._chat_completions()
        except RequestError as e:
            self._send_error(e)
        except (BrokenPipeError, ConnectionResetError):
            logger.debug("client went away")
        except Exception as e:  # noqa: BLE001 - answer 500, keep serving
            logger.exception("internal error")
            self._send_error(RequestError(f"internal error: {type(e).__name__}: {e}",
                                          status=500, type="server_error"))

    def _read_body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if length is None or not length.strip().isdigit():
            raise RequestError("a Content-Length header is required")
        if int(length) > MAX_BODY_BYTES:
            raise RequestError(f"the body is larger than {MAX_BODY_BYTES} bytes", status=413)
        return self.rfile.read(int(length))

    def _chat_completions(self) -> None:
        srv = self.server
        req = parse_chat_request(self._read_body(), max_new_tokens=srv.max_new_tokens,
                                 default_temperature=srv.default_temperature)
        pending = srv.batcher.submit(req)
        if not pending.done.wait(srv.request_timeout_s):
            raise RequestError(f"no reply within {srv.request_timeout_s:g} s", status=503,
                               type="server_error")
        if pending.error is not None:
            raise pending.error
        c = pending.completion
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not req.stream:
            self._send_json(200, completion_response(c, request_id=request_id,
                                                     model=srv.model_name, created=created))
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": srv.model_name}

        def send(delta: dict, finish: Optional[str] = None, **extra) -> None:
            chunk = dict(head, choices=[{"index": 0, "delta": delta, "logprobs": None,
                                         "finish_reason": finish}], **extra)
            self.wfile.write(b"data: " + json.dumps(chunk, ensure_ascii=False).encode("utf-8")
                             + b"\n\n")

        send({"role": "assistant", "content": ""})
        for piece in text_pieces(c.text, c.token_ids, getattr(srv.policy, "tokenizer", None)):
            send({"content": piece})
        usage = completion_response(c, request_id=request_id, model=srv.model_name,
                                    created=created)["usage"]
        send({}, c.finish_reason)
        if req.include_usage:
            self.wfile.write(b"data: " + json.dumps(dict(head, choices=[], usage=usage)).encode()
                             + b"\n\n")
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        self.close_connection = True


# --------------------------------------------------------------------------------------- lifecycle


def start_server(policy, host: str = "127.0.0.1", port: int = 0, *,
                 batch_window_ms: float = 20.0, max_batch_size: int = 32,
                 max_new_tokens: Optional[int] = None, model_name: Optional[str] = None,
                 request_timeout_s: float = 3600.0
                 ) -> tuple[PolicyServer, threading.Thread, str]:
    """Serves ``policy`` on ``host:port`` (``port=0``: a free one) from a background thread.

    ``policy`` is a ``JaxPolicy`` (or anything with ``complete(conversations, *, seed,
    max_new_tokens, temperature) -> list[Completion]``). Returns ``(server, thread, url)`` with
    ``url`` like ``http://127.0.0.1:PORT`` (clients use ``url + "/v1"``). Stop with ``shutdown``.
    """
    server = PolicyServer((host, port), policy, batch_window_ms=batch_window_ms,
                          max_batch_size=max_batch_size, max_new_tokens=max_new_tokens,
                          model_name=model_name, request_timeout_s=request_timeout_s)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              name="ace-serve-http", daemon=True)
    server._started = True  # shutdown() is safe from here on: the loop will run and see it
    thread.start()
    return server, thread, server.url


def shutdown(server: PolicyServer, thread: Optional[threading.Thread] = None,
             timeout_s: float = 30.0) -> None:
    """Stops ``server`` (see ``PolicyServer.close``) and joins its serving thread."""
    server.close()
    if thread is not None:
        thread.join(timeout_s)
