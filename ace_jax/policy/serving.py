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
at most that many wasted steps (never counted).

Errors have the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``: 400
``invalid_request_error`` for an unparsable or invalid body, 404 for an unknown path, 500
``server_error`` when sampling fails, 503 while shutting down. A stream that fails after its first
chunk ends with one ``data: {"error": ...}`` event. A bad request never stops the server; a
client that goes away mid-stream frees its rows of the batch.

Batching: handler threads parse and validate requests and put them on a queue; one worker thread
takes the first waiting request, collects whatever else arrives within ``batch_window_ms`` (up to
``max_batch_size`` samples), and decodes each group of requests with equal ``(temperature,
max_tokens)`` together. Greedy replies (temperature 0) are what ``policy.complete`` gives for the
conversation alone; a sampled request with an explicit ``seed`` is run alone with key ``seed``,
so it reproduces ``policy.complete([conversation], seed=seed)`` for ``n=1`` and
``policy.generator.generate([prompt], key(seed), <group_size n>)`` for ``n > 1``; unseeded
sampled requests share a batch and a server-chosen key.

Engines: a ``JaxPolicy`` is decoded step-wise here (``JaxEngine``: the prefill of
``generate._rollout``, then jitted chunks of its decode loop, same keys and sampling, with the
stop and stream checks on the host between chunks). Any other policy with ``complete(...)``
(``CompletionEngine``) is sampled whole, its replies cut at stop strings after sampling and
streamed once complete.

``start_server(policy, host, port)`` runs all of this in-process (``port=0`` picks a free port);
``shutdown(server)`` stops it. ``launch/serve.py`` is the command-line entry point.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Iterator, Optional

from ace_jax.policy.policy import Completion

logger = logging.getLogger(__name__)

ROLES = ("system", "user", "assistant", "tool")
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_STOP_STRINGS = 4
DECODE_CHUNK_TOKENS = 8   # default decode steps between host checks (stop strings, streaming)
# A decoded tail that ends inside a multi-byte character is held back for at most this many
# tokens (a UTF-8 character has at most 4 bytes, a byte-level token at least 1).
_MAX_PARTIAL_TOKENS = 4


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


# --------------------------------------------------------------------------------------- samples


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


# --------------------------------------------------------------------------------------- engines


class _Pending:
    """One queued request and the events of its reply, in order, on ``events``:

    ("delta", choice index, text piece), ("finish", choice index, Completion), then ("done",)
    or ("error", RequestError). ``cancelled`` is set when the client went away.
    """

    def __init__(self, request: ChatRequest):
        self.request = request
        self.events: "queue.Queue[tuple]" = queue.Queue()
        self.cancelled = False
        self.closed = False   # "done" or "error" was put

    def put(self, *event) -> None:
        if self.closed:
            return
        self.closed = event[0] in ("done", "error")
        self.events.put(event)


class JaxEngine:
    """Step-wise decoding of a ``JaxPolicy``: prefill once, then jitted chunks of
    ``chunk_tokens`` decode steps; between chunks the host feeds each sample's tokens to its
    ``SampleStream`` (stop strings, EOS, budget), hands the new text to the requests (one delta
    per token that adds text) and marks finished or abandoned rows done. Rows are ``n`` copies
    of each request's prompt (request-major, as ``Generator``'s groups), sharing its prefilled
    cache.
    """

    def __init__(self, policy, *, chunk_tokens: int = DECODE_CHUNK_TOKENS):
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.policy = policy
        self.chunk_tokens = int(chunk_tokens)
        self.tokenizer = policy.tokenizer

    def decode(self, group: list[_Pending], *, seed: int, temperature: float,
               max_tokens: int) -> Iterator[None]:
        """Decodes the requests of ``group`` together; yields after every chunk (its events
        already put), ends after every request got "done"."""
        import jax
        import jax.numpy as jnp
        import numpy as np

        from ace_jax.runtime import generate

        policy, gen = self.policy, self.policy.generator
        prompts = [policy.encode(p.request.messages)[0] for p in group]
        owners = [(p, j, len(prompts[i])) for i, p in enumerate(group)
                  for j in range(p.request.n)]
        rows = np.repeat(np.arange(len(group), dtype=np.int32), [p.request.n for p in group])
        sampling = dataclasses.replace(policy.sampling, max_new_tokens=max_tokens,
                                       temperature=temperature, group_size=1)
        ids, pos, mask = generate.left_pad(prompts, sampling.prompt_bucket, sampling.pad_id)
        prefill, decode_chunk = _jitted_steps()
        state = prefill(gen.graphdef, ids.shape[1] + max_tokens, gen.params, jnp.asarray(ids),
                        jnp.asarray(pos), jnp.asarray(mask), jnp.asarray(rows))
        knobs = generate.SamplingKnobs.from_config(sampling)
        key = jax.random.key(seed)
        streams = [SampleStream(self.tokenizer, max_tokens=max_tokens, stop=p.request.stop,
                                eos_ids=sampling.eos_ids) for p, _, _ in owners]
        done = np.zeros(len(owners), bool)
        steps_done = 0
        while not done.all():
            state, tokens = decode_chunk(gen.graphdef, self.chunk_tokens, gen.params, knobs, state,
                                         key, jnp.int32(ids.shape[1]), jnp.int32(max_tokens),
                                         jnp.asarray(done))
            tokens, step = np.asarray(tokens), int(state.step)
            new, steps_done = step - steps_done, step
            for r, (p, j, prompt_len) in enumerate(owners):
                if done[r]:
                    continue
                if p.cancelled:
                    done[r] = True
                    continue
                s = streams[r]
                for t in tokens[r, :new].tolist():  # one delta per token with text
                    s.push(t)
                    piece = s.pop_text()
                    if piece:
                        p.put("delta", j, piece)
                    if s.finished:
                        break
                if not s.finished and new == 0:  # never loop without progress
                    raise RuntimeError(f"the decoder stopped at step {step} of {max_tokens} "
                                       f"with sample {r} unfinished")
                if s.finished:
                    done[r] = True
                    p.put("finish", j, s.completion(prompt_len))
            yield
        for p in group:
            p.put("done")


class CompletionEngine:
    """Any policy with ``complete(conversations, *, seed, max_new_tokens, temperature)``: the
    samples of a group are sampled whole in one call, cut at stop strings afterwards
    (``apply_stop``) and their text handed out at once."""

    def __init__(self, policy):
        self.policy = policy
        self.tokenizer = getattr(policy, "tokenizer", None)

    def decode(self, group: list[_Pending], *, seed: int, temperature: float,
               max_tokens: int) -> Iterator[None]:
        conversations = [p.request.messages for p in group for _ in range(p.request.n)]
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
        yield


def make_engine(policy, *, decode_chunk_tokens: int = DECODE_CHUNK_TOKENS):
    """``JaxEngine`` for a ``JaxPolicy``, ``CompletionEngine`` for any other policy."""
    from ace_jax.policy.policy import JaxPolicy

    if isinstance(policy, JaxPolicy):
        return JaxEngine(policy, chunk_tokens=decode_chunk_tokens)
    return CompletionEngine(policy)


@functools.lru_cache(maxsize=None)
def _jitted_steps():
    """(prefill, decode_chunk): the two jitted halves of ``generate._rollout`` that
    ``JaxEngine`` runs with the host in between (built on first use: importing this module
    needs no JAX).

    prefill(graphdef, cache_len, params, ids [B, P], positions [B, P], mask [B, P], rows [N])
      -> state: the B prompts prefilled into a cache of cache_len = P + M slots, then row r of
      the N rows a copy of prompt rows[r] (cache, next-token logits, next position).
    decode_chunk(graphdef, chunk, params, knobs, state, key, prompt_len, max_new_tokens,
      host_done [N]) -> (state, tokens int32 [N, chunk]): up to ``chunk`` more decode steps
      (fewer when every row is done or the budget is spent); step t samples with
      ``fold_in(key, t)`` as ``_rollout`` does. Rows done (EOS, or marked by the host) get
      ``pad_id``. ``state.step`` counts the steps decoded so far.
    """
    from typing import NamedTuple

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from ace_jax.runtime import generate
    from models import qwen3

    class State(NamedTuple):
        step: jax.Array       # int32 scalar: tokens decoded so far (t of _rollout)
        logits: jax.Array     # float32 [N, V]: logits of the next token
        cache: Any            # qwen3.KVCache of N rows, P + M slots
        next_pos: jax.Array   # int32 [N]: RoPE position of each row's first new token
        done: jax.Array       # bool [N]

    def prefill(graphdef, cache_len, params, ids, positions, mask, rows):
        model = nnx.merge(graphdef, params)
        layout = generate.cache_layout(model.config)
        cache = qwen3.init_cache(model.config, ids.shape[0], cache_len, layout=layout)
        out = model(ids, positions, attention_mask=mask, cache=cache, cache_index=0,
                    compute_logits=False)
        logits = model.lm_logits(out.hidden_states[:, -1, :])
        c, axis = out.cache, 0 if out.cache.layout == "decode" else 1
        cache = qwen3.KVCache(k=tuple(jnp.take(x, rows, axis=axis) for x in c.k),
                              v=tuple(jnp.take(x, rows, axis=axis) for x in c.v),
                              kv_mask=c.kv_mask[rows], layout=c.layout)
        return State(jnp.int32(0), logits[rows], cache, positions[rows, -1] + 1,
                     jnp.zeros(rows.shape, bool))

    def decode_chunk(graphdef, chunk, params, knobs, state, key, prompt_len, max_new_tokens,
                     host_done):
        model = nnx.merge(graphdef, params)
        layer_params = model.layer_params() if state.cache.layout == "decode" else None
        n = state.logits.shape[0]

        def cond(carry):
            i, s, _ = carry
            return (i < chunk) & (s.step < max_new_tokens) & jnp.logical_not(jnp.all(s.done))

        def body(carry):
            i, s, tokens = carry
            tok, _ = generate.sample_token(jax.random.fold_in(key, s.step), s.logits, knobs)
            tok = jnp.where(s.done, knobs.pad_id, tok)
            hit_eos = jnp.any(tok[:, None] == knobs.eos_ids[None, :], axis=-1)
            out = model(tok[:, None], (s.next_pos + s.step)[:, None],
                        attention_mask=jnp.ones((n, 1), bool), cache=s.cache,
                        cache_index=prompt_len + s.step, layer_params=layer_params)
            return i + 1, State(s.step + 1, out.logits[:, -1, :], out.cache, s.next_pos,
                                s.done | hit_eos), tokens.at[:, i].set(tok)

        state = state._replace(done=state.done | host_done)
        init = (jnp.int32(0), state, jnp.full((n, chunk), knobs.pad_id, jnp.int32))
        _, state, tokens = jax.lax.while_loop(cond, body, init)
        return state, tokens

    return (jax.jit(prefill, static_argnums=(0, 1)),
            jax.jit(decode_chunk, static_argnums=(0, 1), donate_argnums=(4,)))


# --------------------------------------------------------------------------------------- batching


_STOP = object()


class Batcher:
    """Collects requests for ``window_s`` after the first one and decodes them in groups.

    A batch holds at most ``max_batch_size`` samples (the sum of the requests' ``n``). Counters
    (``stats()``): ``batches`` (engine calls), ``requests`` (requests answered), ``samples``
    (choices answered), ``max_batch`` (the most requests decoded together).
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
        self._carry: Optional[_Pending] = None  # taken from the queue, did not fit the batch
        self._lock = threading.Lock()
        self._stats = {"batches": 0, "requests": 0, "samples": 0, "max_batch": 0}
        self._seeds = itertools.count(1)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="ace-serve-batcher", daemon=True)
        self._thread.start()

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def submit(self, request: ChatRequest) -> _Pending:
        """Queues ``request``; its reply arrives as events on the returned ``_Pending``."""
        if request.n > self.max_batch_size:
            raise RequestError(f"'n' is {request.n}, the server decodes at most "
                               f"{self.max_batch_size} samples at once", param="n")
        p = _Pending(request)
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
            if isinstance(p, _Pending):
                p.put("error", RequestError("the server is shutting down", status=503,
                                            type="server_error"))

    def _next(self, timeout: Optional[float]) -> Any:
        if self._carry is not None:
            p, self._carry = self._carry, None
            return p
        if timeout is None:
            return self._queue.get()
        return self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()

    def _collect(self) -> tuple[list[_Pending], bool]:
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
                self._decode(group, seed=seed, temperature=temperature, max_tokens=max_tokens)

    def _decode(self, group: list[_Pending], *, seed: int, temperature: float,
                max_tokens: int) -> None:
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
            return
        answered = [p for p in group if not p.cancelled]
        with self._lock:
            self._stats["batches"] += 1
            self._stats["requests"] += len(answered)
            self._stats["samples"] += sum(p.request.n for p in answered)
            self._stats["max_batch"] = max(self._stats["max_batch"], len(group))


# --------------------------------------------------------------------------------------- HTTP


def _error_body(message: str, type_: str, param: Optional[str] = None) -> dict:
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
                               max_batch_size=max_batch_size, engine=engine,
                               decode_chunk_tokens=decode_chunk_tokens)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def stats(self) -> dict:
        """Batching counters: batches, requests, samples, max_batch (see ``Batcher``)."""
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
        self._send_json(e.status, _error_body(str(e), e.type, e.param))

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

    def _next_event(self, pending: _Pending) -> tuple:
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
            pending.cancelled = True  # its rows stop at the next chunk
            raise

    def _reply(self, pending: _Pending) -> None:
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

    def _stream(self, pending: _Pending) -> None:
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
                self._send_event(_error_body(str(e), e.type, e.param))
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

    ``policy`` is a ``JaxPolicy`` (decoded step-wise, ``decode_chunk_tokens`` tokens between
    stop / stream checks) or anything with ``complete(conversations, *, seed, max_new_tokens,
    temperature) -> list[Completion]``; ``engine`` overrides ``make_engine(policy)``. Returns
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
