"""The engines behind the server's batcher (``ace_jax.policy.batching``): each takes requests as
they arrive (``add``) and advances them (``step``), putting the events of their replies on their
``Pending``.

A ``JaxPolicy`` is served by the rollout engine (``JaxEngine`` over
``ace_jax.runtime.engine.Engine``: paged KV cache, continuous batching, the same per-row keys
and sampling as the trainer's rollouts), with the stop and stream checks on the host after each
engine step. Any other policy with ``complete(...)`` (``CompletionEngine``) is sampled whole, its
replies cut at stop strings after sampling and streamed once complete. ``make_engine(policy)``
picks one.

The interface the batcher uses: ``add(pending, seed)`` (seed None: the engine picks one; raises
``RequestError`` for a request it can never serve), ``step()`` (may raise: the batcher then fails
every request in flight and calls ``abort()``), ``abort()`` (forget everything in flight).
"""
from __future__ import annotations

import dataclasses
import itertools
import queue
from typing import Callable, Optional

from ace_jax.policy.openai_api import ChatRequest, RequestError
from ace_jax.policy.sample_stream import SampleStream, apply_stop, text_pieces

DECODE_CHUNK_TOKENS = 8   # default decode steps between host checks (stop strings, streaming)


class Pending:
    """One queued request and the events of its reply, in order, on ``events``:

    ("delta", choice index, text piece), ("finish", choice index, Completion), then ("done",)
    or ("error", RequestError). ``cancelled`` is set when the client went away. ``on_done``
    (if set) is called just before "done" is put, so whoever counts replies has counted this one
    before its client can see it.
    """

    def __init__(self, request: ChatRequest):
        self.request = request
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.cancelled = False
        self.closed = False   # "done" or "error" was put
        self.on_done: Optional[Callable[["Pending"], None]] = None

    def put(self, *event) -> None:
        if self.closed:
            return
        self.closed = event[0] in ("done", "error")
        if event[0] == "done" and self.on_done is not None:
            self.on_done(self)
        self.events.put(event)


@dataclasses.dataclass
class _Live:
    """A request in the engine: its reply's streams (one per sample) and how many are open."""
    pending: Pending
    streams: list[SampleStream]
    prompt_tokens: int
    open: int


class JaxEngine:
    """A ``JaxPolicy`` on the rollout engine: requests enter its ``slots`` as they arrive (no
    batch waits for its longest row); after every engine step (``sync_every`` decode steps) each
    running sample's new tokens go through its ``SampleStream`` (stop strings, EOS, budget) and
    out as text, one delta per token that adds text; a sample that completes a stop string is
    cancelled in the engine at once (its slot and pages freed).

    Keys: request with seed s samples choice j with ``fold_in(fold_in(key(s), 0), j)``: what
    ``policy.complete([conversation], seed=s)`` draws for j = 0 and the group of
    ``Generator.generate([prompt], key(s))`` for n samples. Requests without a seed get one
    from a counter (1, 2, ...).
    """

    def __init__(self, policy, *, slots: int = 32, max_new_tokens: Optional[int] = None,
                 sync_every: int = DECODE_CHUNK_TOKENS):
        self.policy = policy
        self.tokenizer = policy.tokenizer
        self.config = policy.engine_config(max_new_tokens, slots=slots, sync_every=sync_every)
        self.engine = policy.make_engine(self.config)
        self._live: dict[int, _Live] = {}
        self._seeds = itertools.count(1)

    def add(self, pending: Pending, seed: Optional[int]) -> None:
        import jax

        from ace_jax.runtime.engine_config import EngineCapacityError

        r = pending.request
        prompt = self.policy.encode(r.messages)[0]
        seed = next(self._seeds) if seed is None else seed
        try:
            rid = self.engine.submit(prompt, n=r.n, key=jax.random.fold_in(jax.random.key(seed), 0),
                                     max_new_tokens=r.max_tokens, temperature=r.temperature)
        except EngineCapacityError as e:
            raise RequestError(f"the request does not fit the server's engine: {e}") from e
        streams = [SampleStream(self.tokenizer, max_tokens=r.max_tokens, stop=r.stop,
                                eos_ids=self.policy.sampling.eos_ids) for _ in range(r.n)]
        self._live[rid] = _Live(pending, streams, len(prompt), r.n)

    def step(self) -> None:
        for rid, live in list(self._live.items()):   # clients that went away free their rows
            if live.pending.cancelled:
                self.engine.cancel(rid)
                del self._live[rid]
                live.pending.put("done")
        finished = {(c.request, c.sample): c.tokens for c in self.engine.step()}
        tokens = dict(finished)
        for rid in self._live:
            tokens.update({(rid, j): t for j, t in self.engine.progress(rid).items()})
        for (rid, j), ids in tokens.items():
            live = self._live[rid]
            s = live.streams[j]
            for t in ids[len(s.token_ids):]:
                s.push(t)
                piece = s.pop_text()
                if piece:
                    live.pending.put("delta", j, piece)
                if s.finished:
                    break
            if not s.finished:
                if (rid, j) in finished:
                    raise RuntimeError(f"the engine ended sample {j} after {len(ids)} tokens "
                                       f"but its stream did not (EOS ids or budget disagree)")
                continue
            if (rid, j) not in finished:
                self.engine.cancel(rid, j)          # a stop string: the engine stops it too
            live.pending.put("finish", j, s.completion(live.prompt_tokens))
            live.open -= 1
            if live.open == 0:
                del self._live[rid]
                live.pending.put("done")

    def abort(self) -> None:
        self.engine = self.policy.make_engine(self.config)   # its state may be half-updated
        self._live.clear()


class CompletionEngine:
    """Any policy with ``complete(conversations, *, seed, max_new_tokens, temperature)``: each
    step samples every request added since the last one, whole, in one call per ``(temperature,
    max_tokens, seed)``; replies are cut at stop strings afterwards (``apply_stop``) and their
    text handed out at once. Requests without a seed share one server-chosen seed per step."""

    def __init__(self, policy):
        self.policy = policy
        self.tokenizer = getattr(policy, "tokenizer", None)
        self._added: list[tuple[Pending, Optional[int]]] = []
        self._seeds = itertools.count(1)

    def add(self, pending: Pending, seed: Optional[int]) -> None:
        self._added.append((pending, seed))

    def step(self) -> None:
        added, self._added = self._added, []
        shared_seed = next(self._seeds)
        groups: dict[tuple, list[Pending]] = {}
        for p, seed in added:
            r = p.request
            seed = 0 if r.temperature == 0 else shared_seed if seed is None else seed
            groups.setdefault((r.temperature, r.max_tokens, seed), []).append(p)
        for (temperature, max_tokens, seed), group in groups.items():
            self._complete(group, seed=seed, temperature=temperature, max_tokens=max_tokens)

    def _complete(self, group: list[Pending], *, seed: int, temperature: float,
                  max_tokens: int) -> None:
        for p in group:
            if p.cancelled:
                p.put("done")
        group = [p for p in group if not p.cancelled]
        conversations = [p.request.messages for p in group for _ in range(p.request.n)]
        if not conversations:
            return
        out = self.policy.complete(conversations, seed=seed, max_new_tokens=max_tokens,
                                   temperature=temperature)
        if len(out) != len(conversations):
            raise RuntimeError(f"the policy returned {len(out)} replies for {len(conversations)}")
        replies = iter(out)
        for p in group:
            choices = [apply_stop(next(replies), p.request.stop) for _ in range(p.request.n)]
            failed = [c.error for c in choices if c.error is not None]
            if failed:
                p.put("error", RequestError(f"the policy gave no reply: {failed[0]}",
                                            status=500, type="server_error"))
                continue
            for j, c in enumerate(choices):
                for piece in text_pieces(c.text, c.token_ids, self.tokenizer):
                    p.put("delta", j, piece)
                p.put("finish", j, c)
            p.put("done")

    def abort(self) -> None:
        self._added.clear()


def make_engine(policy, *, slots: int = 32, max_new_tokens: Optional[int] = None,
                decode_chunk_tokens: int = DECODE_CHUNK_TOKENS):
    """``JaxEngine`` for a ``JaxPolicy`` (``slots`` decode rows, replies of up to
    ``max_new_tokens``), ``CompletionEngine`` for any other policy."""
    from ace_jax.policy.policy import JaxPolicy

    if isinstance(policy, JaxPolicy):
        return JaxEngine(policy, slots=slots, max_new_tokens=max_new_tokens,
                         sync_every=decode_chunk_tokens)
    return CompletionEngine(policy)
