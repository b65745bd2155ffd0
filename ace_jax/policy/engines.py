"""The decode engines behind the server's batcher: each decodes a group of requests together and
puts the events of their replies on their ``Pending``.

A ``JaxPolicy`` is decoded step-wise (``JaxEngine``: the prefill of ``generate._rollout``, then
jitted chunks of its decode loop, same keys and sampling, with the stop and stream checks on the
host between chunks). Any other policy with ``complete(...)`` (``CompletionEngine``) is sampled
whole, its replies cut at stop strings after sampling and streamed once complete.
``make_engine(policy)`` picks one.
"""
from __future__ import annotations

import dataclasses
import functools
import queue
from typing import Any, Callable, Iterator, Optional

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

    def decode(self, group: list[Pending], *, seed: int, temperature: float,
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
        keys = generate.row_keys(jax.random.key(seed), jnp.asarray(rows),
                                 jnp.asarray([j for _, j, _ in owners], jnp.int32))
        streams = [SampleStream(self.tokenizer, max_tokens=max_tokens, stop=p.request.stop,
                                eos_ids=sampling.eos_ids) for p, _, _ in owners]
        done = np.zeros(len(owners), bool)
        steps_done = 0
        while not done.all():
            state, tokens = decode_chunk(gen.graphdef, self.chunk_tokens, gen.params, knobs, state,
                                         keys, jnp.int32(ids.shape[1]), jnp.int32(max_tokens),
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

    def decode(self, group: list[Pending], *, seed: int, temperature: float,
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
    decode_chunk(graphdef, chunk, params, knobs, state, keys, prompt_len, max_new_tokens,
      host_done [N]) -> (state, tokens int32 [N, chunk]): up to ``chunk`` more decode steps
      (fewer when every row is done or the budget is spent); row r's step t samples with
      ``fold_in(keys[r], t)`` (`generate.row_keys`) as ``_rollout`` does. Rows done (EOS, or marked by the host) get
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

    def decode_chunk(graphdef, chunk, params, knobs, state, keys, prompt_len, max_new_tokens,
                     host_done):
        model = nnx.merge(graphdef, params)
        layer_params = model.layer_params() if state.cache.layout == "decode" else None
        n = state.logits.shape[0]

        def cond(carry):
            i, s, _ = carry
            return (i < chunk) & (s.step < max_new_tokens) & jnp.logical_not(jnp.all(s.done))

        def body(carry):
            i, s, tokens = carry
            tok, _ = generate.sample_token(generate.step_keys(keys, s.step), s.logits, knobs)
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
