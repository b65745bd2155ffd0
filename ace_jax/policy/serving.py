"""An OpenAI-compatible HTTP server in front of a ``JaxPolicy`` (stdlib HTTP).

Endpoints (JSON bodies, UTF-8):

* ``POST /v1/chat/completions``: ``model`` (ignored: the server has one model), ``messages``
  (list of ``{"role", "content"}``, roles system / user / assistant / tool), ``max_tokens`` (or
  ``max_completion_tokens``; default and upper limit: the server's ``max_new_tokens``; a larger
  value is refused, as OpenAI does), ``temperature`` (>= 0; default: the policy's), ``seed``,
  ``n`` (samples of the one prompt, 1 to ``max_batch_size``: the trainer's G samples per prompt),
  ``stop`` (a string or up to 4), ``stream`` and ``stream_options.include_usage``. Other fields
  are ignored. The reply follows the OpenAI ``chat.completion`` schema, ``n`` choices;
  ``usage.completion_tokens`` counts the tokens of every choice, as generated (an EOS or the
  token that completed a stop string included), the prompt once. With ``stream`` it is
  Server-Sent Events, sent as the tokens are decoded: ``data: {chunk}`` lines of
  ``chat.completion.chunk`` objects (per choice: the role, then the text piece by piece, then an
  empty delta with ``finish_reason``), a ``usage`` chunk when asked, and ``data: [DONE]``.
* ``GET /v1/models``: the one model. ``GET /health``: status and batching counters.

Stop strings end decoding: a sample stops at the token that completes one (finish_reason "stop"),
its text ends before it, and streamed text holds back a tail that could begin one. Decoding runs
in chunks of ``decode_chunk_tokens`` tokens between checks, so a sample that stops mid-chunk costs
at most that many wasted steps (never counted); its slot then takes the next request.

Errors have the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` for an unparsable or invalid body, 404 for an unknown path, 500
``server_error`` when sampling fails, 503 while shutting down. A stream that fails after its first
chunk ends with one ``data: {"error": ...}`` event. A bad request never stops the server; a
client that goes away mid-stream frees its rows of the batch.

Batching (``ace_jax.policy.batching``): handler threads parse and validate requests
(``ace_jax.policy.openai_api``) and put them on a queue; one worker thread admits each into the
engine as it arrives and steps the engine while any request is in flight (continuous admission:
a request never waits for another batch to finish; when the engine is idle the first one waits
``batch_window_ms`` for company). Greedy replies (temperature 0) are what ``policy.complete``
gives for the conversation alone; a sampled request with an explicit ``seed`` reproduces
``policy.complete([conversation], seed=seed)`` for ``n=1`` and the group of
``Generator.generate([prompt], key(seed))`` for ``n > 1``, whatever is decoded beside it;
unseeded sampled requests get a server-chosen seed.

Engines (``ace_jax.policy.engines``): a ``JaxPolicy`` is served by the rollout engine
(``JaxEngine`` over ``ace_jax.runtime.engine.Engine``: ``max_batch_size`` decode slots over a
paged KV cache, the trainer's keys and sampling), with the stop and stream checks on the host
between engine steps (``ace_jax.policy.sample_stream``). Any other policy with
``complete(...)`` (``CompletionEngine``) is sampled whole, its replies cut at stop strings after
sampling and streamed once complete.

``start_server(policy, host, port)`` runs all of this in-process (``port=0`` picks a free port);
``shutdown(server)`` stops it. ``launch/serve.py`` is the command-line entry point.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Optional

from ace_jax.policy.batching import Batcher
from ace_jax.policy.engines import DECODE_CHUNK_TOKENS, Pending
from ace_jax.policy.openai_api import (RequestError, completion_response, error_body,
                                       parse_chat_request, usage_of)
from ace_jax.policy.interface import Completion

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 1024 * 1024


class PolicyServer(ThreadingHTTPServer):
    """The HTTP server: one handler thread per connection, one ``Batcher`` behind them.

    Attributes:
      policy, batcher, model_name, max_new_tokens, default_temperature, request_timeout_s
      (seconds a handler waits for the next event of its reply).
    """

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], policy, *, batch_window_ms: float = 20.0,
                 max_batch_size: int = 32, max_new_tokens: Optional[int] = None,
                 model_name: Optional[str] = None, request_timeout_s: float = 3600.0,
                 decode_chunk_tokens: int = DECODE_CHUNK_TOKENS, engine=None):
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
                               max_batch_size=max_batch_size, max_new_tokens=self.max_new_tokens,
                               engine=engine, decode_chunk_tokens=decode_chunk_tokens)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def stats(self) -> dict:
        """Batching counters: steps, requests, samples, max_batch (see ``Batcher``)."""
        return self.batcher.stats()

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._started = True
        super().serve_forever(poll_interval)

    def close(self) -> None:
        """Stops accepting connections, answers the queued requests (see ``Batcher.close``),
        stops the batching worker."""
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
        self._send_json(e.status, error_body(str(e), e.type, e.param))

    def _send_event(self, obj: Any) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
        self.wfile.write(b"data: " + data.encode("utf-8") + b"\n\n")
        self.wfile.flush()

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

    def _next_event(self, pending: Pending) -> tuple:
        try:
            return pending.events.get(timeout=self.server.request_timeout_s)
        except queue.Empty:
            pending.cancelled = True
            return ("error", RequestError(f"no reply within {self.server.request_timeout_s:g} s",
                                          status=503, type="server_error"))

    def _chat_completions(self) -> None:
        srv = self.server
        req = parse_chat_request(self._read_body(), max_new_tokens=srv.max_new_tokens,
                                 default_temperature=srv.default_temperature,
                                 max_n=srv.batcher.max_batch_size)
        pending = srv.batcher.submit(req)
        try:
            if req.stream:
                self._stream(pending)
            else:
                self._reply(pending)
        except BaseException:
            pending.cancelled = True  # its rows stop at the next engine step
            raise

    def _reply(self, pending: Pending) -> None:
        choices: dict[int, Completion] = {}
        while True:
            event = self._next_event(pending)
            if event[0] == "error":
                raise event[1]
            if event[0] == "finish":
                choices[event[1]] = event[2]
            elif event[0] == "done":
                break
        self._send_json(200, completion_response(
            [choices[i] for i in sorted(choices)], request_id=f"chatcmpl-{uuid.uuid4().hex}",
            model=self.server.model_name, created=int(time.time())))

    def _stream(self, pending: Pending) -> None:
        """Server-Sent Events as the engine hands out text. An error before the first event is
        an ordinary HTTP error; after it, one ``data: {"error": ...}`` event ends the stream."""
        event = self._next_event(pending)
        if event[0] == "error":
            raise event[1]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.server.model_name}

        def chunk(index: int, delta: dict, finish: Optional[str] = None) -> dict:
            return dict(head, choices=[{"index": index, "delta": delta, "logprobs": None,
                                        "finish_reason": finish}])

        for j in range(pending.request.n):
            self._send_event(chunk(j, {"role": "assistant", "content": ""}))
        choices: list[Completion] = []
        while True:
            kind = event[0]
            if kind == "delta":
                self._send_event(chunk(event[1], {"content": event[2]}))
            elif kind == "finish":
                choices.append(event[2])
                self._send_event(chunk(event[1], {}, event[2].finish_reason))
            elif kind == "error":
                e = event[1]
                self._send_event(error_body(str(e), e.type, e.param))
                return
            else:  # done
                break
            event = self._next_event(pending)
        if pending.request.include_usage:
            self._send_event(dict(head, choices=[], usage=usage_of(choices)))
        self._send_event("[DONE]")


# --------------------------------------------------------------------------------------- lifecycle


def start_server(policy, host: str = "127.0.0.1", port: int = 0, *,
                 batch_window_ms: float = 20.0, max_batch_size: int = 32,
                 max_new_tokens: Optional[int] = None, model_name: Optional[str] = None,
                 request_timeout_s: float = 3600.0,
                 decode_chunk_tokens: int = DECODE_CHUNK_TOKENS, engine=None
                 ) -> tuple[PolicyServer, threading.Thread, str]:
    """Serves ``policy`` on ``host:port`` (``port=0``: a free one) from a background thread.

    ``policy`` is a ``JaxPolicy`` (on the rollout engine: ``max_batch_size`` slots,
    ``decode_chunk_tokens`` tokens between stop / stream checks) or anything with
    ``complete(conversations, *, seed, max_new_tokens, temperature) -> list[Completion]``;
    ``engine`` overrides ``engines.make_engine(policy)``. Returns
    ``(server, thread, url)`` with ``url`` like ``http://127.0.0.1:PORT`` (clients use
    ``url + "/v1"``). Stop with ``shutdown``.
    """
    server = PolicyServer((host, port), policy, batch_window_ms=batch_window_ms,
                          max_batch_size=max_batch_size, max_new_tokens=max_new_tokens,
                          model_name=model_name, request_timeout_s=request_timeout_s,
                          decode_chunk_tokens=decode_chunk_tokens, engine=engine)
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
