"""The server's batching: handler threads put validated requests on a queue; one worker thread
takes the first waiting request, collects whatever else arrives within the batch window (up to
``max_batch_size`` samples), and decodes each group of requests with equal ``(temperature,
max_tokens)`` together with its engine (``ace_jax.policy.engines``). Greedy replies
(temperature 0) are what ``policy.complete`` gives for the conversation alone; a sampled request
with an explicit ``seed`` is run alone with key ``seed``; unseeded sampled requests share a batch
and a server-chosen key."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from typing import Any, Optional

from ace_jax.policy.engines import DECODE_CHUNK_TOKENS, Pending, make_engine
from ace_jax.policy.openai_api import ChatRequest, RequestError

logger = logging.getLogger(__name__)

_STOP = object()


class Batcher:
    """Collects requests for ``window_s`` after the first one and decodes them in groups.

    A batch holds at most ``max_batch_size`` samples (the sum of the requests' ``n``). Counters
    (``stats()``): ``batches`` (engine calls), ``requests`` (requests answered, counted before
    their client sees "done"), ``samples`` (choices answered), ``max_batch`` (the most requests
    decoded together).
    """

    def __init__(self, policy, *, window_s: float = 0.02, max_batch_size: int = 32,
                 engine=None, decode_chunk_tokens: int = DECODE_CHUNK_TOKENS):
        if window_s < 0 or max_batch_size < 1:
            raise ValueError(f"need window_s >= 0 and max_batch_size >= 1, got {window_s}, "
                             f"{max_batch_size}")
        self.policy = policy
        self.engine = engine or make_engine(policy, decode_chunk_tokens=decode_chunk_tokens)
        self.window_s = float(window_s)
        self.max_batch_size = int(max_batch_size)
        self._queue: "queue.Queue[Any]" = queue.Queue()
        self._carry: Optional[Pending] = None  # taken from the queue, did not fit the batch
        self._lock = threading.Lock()
        self._stats = {"batches": 0, "requests": 0, "samples": 0, "max_batch": 0}
        self._seeds = itertools.count(1)
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
        """Stops taking requests (new ones get 503), answers those already queued, stops the
        worker; what is still queued after ``timeout_s`` seconds gets 503."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._queue.put(_STOP)
        self._thread.join(timeout_s)
        left = [self._carry] if self._carry is not None else []
        while True:
            try:
                left.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for p in left:
            if isinstance(p, Pending):
                p.put("error", RequestError("the server is shutting down", status=503,
                                            type="server_error"))

    def _next(self, timeout: Optional[float]) -> Any:
        if self._carry is not None:
            p, self._carry = self._carry, None
            return p
        if timeout is None:
            return self._queue.get()
        return self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()

    def _collect(self) -> tuple[list[Pending], bool]:
        first = self._next(None)
        if first is _STOP:
            return [], True
        batch, samples = [first], first.request.n
        deadline = time.monotonic() + self.window_s
        while samples < self.max_batch_size:
            try:
                item = self._next(deadline - time.monotonic())
            except queue.Empty:
                break
            if item is _STOP:
                self._queue.put(_STOP)  # seen again after this batch
                break
            if samples + item.request.n > self.max_batch_size:
                self._carry = item
                break
            batch.append(item)
            samples += item.request.n
        return batch, False

    def _run(self) -> None:
        while True:
            batch, stop = self._collect()
            if stop:
                return
            groups: dict[tuple, list[Pending]] = {}
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
                self._decode(group, seed=seed, temperature=temperature, max_tokens=max_tokens)

    def _answered(self, p: Pending) -> None:
        """Counts ``p`` as answered (called by ``p`` just before its "done" goes out)."""
        if not p.cancelled:
            with self._lock:
                self._stats["requests"] += 1
                self._stats["samples"] += p.request.n

    def _decode(self, group: list[Pending], *, seed: int, temperature: float,
                max_tokens: int) -> None:
        with self._lock:
            self._stats["batches"] += 1
            self._stats["max_batch"] = max(self._stats["max_batch"], len(group))
        for p in group:
            p.on_done = self._answered
        try:
            for _ in self.engine.decode(group, seed=seed, temperature=temperature,
                                        max_tokens=max_tokens):
                pass
        except Exception as e:  # noqa: BLE001 - one failing batch must not stop the server
            logger.exception("decoding a batch of %d requests failed", len(group))
            err = RequestError(f"sampling failed: {type(e).__name__}: {e}", status=500,
                               type="server_error")
            for p in group:
                p.put("error", err)
