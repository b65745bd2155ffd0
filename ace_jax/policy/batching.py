"""The server's batching: handler threads put validated requests on a queue; one worker thread
hands each request to its engine (``ace_jax.policy.engines``) as it arrives and steps the engine
while any request is in flight, so a request that arrives while others decode joins them at the
next step (continuous admission; with the rollout engine, at the next free slot). When the
engine is idle, the first request waits up to the batch window for others to start with it.

Seeds: greedy replies (temperature 0) are what ``policy.complete`` gives for the conversation
alone; a sampled request with an explicit ``seed`` draws what ``policy.complete([conversation],
seed=seed)`` draws, whatever else is decoded beside it; unseeded sampled requests get a
server-chosen seed.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

from ace_jax.policy.engines import DECODE_CHUNK_TOKENS, Pending, make_engine
from ace_jax.policy.openai_api import ChatRequest, RequestError

logger = logging.getLogger(__name__)

_STOP = object()


class Batcher:
    """Admits requests into ``engine`` continuously and steps it (see the module docstring).

    ``max_batch_size``: the engine's decode slots (samples decoded together) and the largest
    ``n``; ``max_new_tokens``: the longest reply the engine must hold. Counters (``stats()``):
    ``steps`` (engine steps), ``requests`` (requests answered, counted before their client sees
    "done"), ``samples`` (choices answered), ``max_batch`` (the most requests in flight at
    once).
    """

    def __init__(self, policy, *, window_s: float = 0.02, max_batch_size: int = 32,
                 max_new_tokens: int | None = None, engine=None,
                 decode_chunk_tokens: int = DECODE_CHUNK_TOKENS):
        if window_s < 0 or max_batch_size < 1:
            raise ValueError(f"need window_s >= 0 and max_batch_size >= 1, got {window_s}, "
                             f"{max_batch_size}")
        self.policy = policy
        self.engine = engine or make_engine(policy, slots=max_batch_size,
                                            max_new_tokens=max_new_tokens,
                                            decode_chunk_tokens=decode_chunk_tokens)
        self.window_s = float(window_s)
        self.max_batch_size = int(max_batch_size)
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._live: list[Pending] = []      # added to the engine, not answered yet
        self._lock = threading.Lock()
        self._stats = {"steps": 0, "requests": 0, "samples": 0, "max_batch": 0}
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ace-serve-batcher", daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def submit(self, request: ChatRequest) -> Pending:
        """Queues ``request``; its reply arrives as events on the returned ``Pending``."""
        if request.n > self.max_batch_size:
            raise RequestError(f"'n' is {request.n}, the server decodes at most "
                               f"{self.max_batch_size} samples at once", param="n")
        p = Pending(request)
        with self._lock:  # no put after close, so nothing waits forever
            if self._closed:
                p.put("error", RequestError("the server is shutting down", status=503,
                                            type="server_error"))
            else:
                self._queue.put(p)
        return p

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops taking requests (new ones get 503), answers those already queued or in flight,
        stops the worker; what is still queued after ``timeout_s`` seconds gets 503."""
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
            if isinstance(p, Pending):
                p.put("error", RequestError("the server is shutting down", status=503,
                                            type="server_error"))

    def _in_flight(self) -> bool:
        self._live = [p for p in self._live if not p.closed]
        return bool(self._live)

    def _take(self, window_s: float) -> bool:
        """Admits what is queued, waiting up to ``window_s`` for more; True at the stop mark."""
        deadline = time.monotonic() + window_s
        while True:
            left = deadline - time.monotonic()
            try:
                item = self._queue.get(timeout=left) if left > 0 else self._queue.get_nowait()
            except queue.Empty:
                return False
            if item is _STOP:
                return True
            self._admit(item)

    def _run(self) -> None:
        stopping = False
        while True:
            if not self._in_flight():
                if stopping:
                    return
                first = self._queue.get()     # idle: wait for a request
                if first is _STOP:
                    return
                self._admit(first)
                stopping = self._take(self.window_s)
            else:
                stopping = self._take(0.0) or stopping
            if self._in_flight():
                self._step()

    def _admit(self, p: Pending) -> None:
        if p.cancelled:
            p.put("done")
            return
        p.on_done = self._answered
        try:
            self.engine.add(p, p.request.seed)
        except RequestError as e:
            p.put("error", e)
            return
        except Exception as e:  # noqa: BLE001 - one bad request must not stop the server
            logger.exception("admitting a request failed")
            p.put("error", RequestError(f"sampling failed: {type(e).__name__}: {e}", status=500,
                                        type="server_error"))
            return
        self._live.append(p)
        with self._lock:
            self._stats["max_batch"] = max(self._stats["max_batch"],
                                           sum(not q.closed for q in self._live))

    def _answered(self, p: Pending) -> None:
        """Counts ``p`` as answered (called by ``p`` just before its "done" goes out)."""
        if not p.cancelled:
            with self._lock:
                self._stats["requests"] += 1
                self._stats["samples"] += p.request.n

    def _step(self) -> None:
        with self._lock:
            self._stats["steps"] += 1
        try:
            self.engine.step()
        except Exception as e:  # noqa: BLE001 - one failing step must not stop the server
            logger.exception("an engine step with %d requests in flight failed", len(self._live))
            err = RequestError(f"sampling failed: {type(e).__name__}: {e}", status=500,
                               type="server_error")
            for p in self._live:
                p.put("error", err)
            self.engine.abort()
