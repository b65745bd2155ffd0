"""The rollout engine's device programs (``ace_jax.runtime.engine.Engine`` jits each once,
`jitted`): ``prefill`` (one prompt chunk into its pages), ``admit`` (waiting samples into free
slots), ``decode`` (``steps`` decode steps of every slot) and ``retire`` (cancelled rows marked
done), over the slots' device state ``SlotState``; ``pack_step`` puts what the host needs of a
decode call into one array (`unpack_step`, on the host, takes it apart). The host-side
scheduling (requests, pages, slots) is ``engine.py``'s.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ace_jax.runtime import generate
from models import qwen3

NO_ROUTE = 255
"""The uint8 routing record's "no record" id (`completions.Completion.routes`; the model keeps
its own router's choice for such a token): expert ids must stay below it."""


class RouteRecordError(ValueError):
    """The policy's expert ids do not fit the uint8 routing record."""


def check_route_record(num_experts: int) -> None:
    """Raises `RouteRecordError` unless every expert id 0..num_experts-1 fits the uint8 routing
    record below `NO_ROUTE`: with more than 255 experts the cast would wrap ids silently
    (expert 256 recorded as expert 0) or record expert 255 as "no record"."""
    if num_experts > NO_ROUTE:
        raise RouteRecordError(
            f"the MoE routing record is uint8 with {NO_ROUTE} meaning 'no record': it holds "
            f"expert ids 0..{NO_ROUTE - 1}, but the policy has {num_experts} experts (turn "
            f"route recording off, or widen the record's dtype)")


class SlotState(NamedTuple):
    """The device state of the slots (S = slots)."""

    pools: tuple          # (k, v) per layer group [Lg, pool_pages, nkv, page_size, d]
    page_table: jax.Array  # int32 [S, pages_per_row]
    lengths: jax.Array     # int32 [S]: cache slots filled
    logits: jax.Array      # float32 [S, V]: logits of each row's next token
    keys: jax.Array        # PRNG keys [S]: each row's sampling key
    produced: jax.Array    # int32 [S]: tokens generated (the next draw's step t)
    budget: jax.Array      # int32 [S]: max new tokens of the row
    done: jax.Array        # bool [S]: no row, or finished
    reason: jax.Array      # int32 [S]: FinishReason
    window: jax.Array      # int32 [S, L]: last tokens, for stop sequences
    temperature: jax.Array  # float32 [S]: each row's request's temperature (0 = greedy)


def model_forward(model, layer_params, tokens, mask, pools, page_table, lengths, prefix=None,
                  read_pages=None, record_routes=False):
    """-> (hidden states, pools, routes uint8 [B, T, L_moe, k], or None for a dense model or
    without ``record_routes``). ``prefix``: the rows' shared prompt pages (`qwen3.PagedPrefix`)
    or None; ``read_pages``: `qwen3.PagedKVCache.read_pages`."""
    cache = qwen3.PagedKVCache(k=pools[0], v=pools[1], page_table=page_table, lengths=lengths,
                               prefix=prefix, read_pages=read_pages)
    moe = record_routes and model.config.num_moe_layers > 0
    if moe:     # at trace time: the engine's programs are never built to wrap expert ids
        check_route_record(model.config.num_experts)
    out = model(tokens, attention_mask=mask, cache=cache, compute_logits=False,
                layer_params=layer_params, return_routes=moe)
    routes = None if out.routes is None else out.routes.astype(jnp.uint8)
    return out.hidden_states, (out.cache.k, out.cache.v), routes


def layer_params(graphdef, params):
    """The per-layer weights sliced out of the stacks (`qwen3.Qwen3ForCausalLM.layer_params`):
    the engine keeps them beside ``params`` (once per `Engine.update_weights`), so that its
    decode steps run their layers on loop-invariant slices, as `generate._rollout`'s loop does
    (a stack sliced inside the loop is laid out again at every step)."""
    return nnx.merge(graphdef, params).layer_params()


def prefill(graphdef, params, pools, ids, page_rows, start, n_valid, record_routes=False):
    """One prompt chunk per row shard (R = the engine's row shards, 1 on one device): ids int32
    [R, C] (row r's first ``n_valid[r]`` real; 0 = no prompt in that shard) into the pages of
    ``page_rows`` [R, pages] (each row's shard's own page ids) from slot ``start`` [R] ->
    (pools, logits float32 [R, V] of each row's last real token, the chunk's routes uint8
    [R, C, L_moe, k] or None; ``record_routes`` static: see `model_forward`)."""
    model = nnx.merge(graphdef, params)
    mask = jnp.arange(ids.shape[1])[None, :] < n_valid[:, None]
    h, pools, routes = model_forward(model, None, ids, mask, pools, page_rows, start,
                                     record_routes=record_routes)
    last = jnp.maximum(n_valid - 1, 0)[:, None, None]
    logits = model.lm_logits(jnp.take_along_axis(h, last, axis=1)[:, 0])
    return pools, logits, routes


def admit(state: SlotState, slot, page_rows, lengths, budgets, temperatures, request_keys, samples,
           logits, copy_src, copy_dst):
    """Puts up to S samples into slots (``slot`` [S], S = none), each with its page row, filled
    length, budget, temperature, key ``fold_in(request key, sample)`` (``request_keys``: S keys)
    and first logits (S arrays [V]); copies page copy_src[i] to copy_dst[i] first (0 -> 0 for
    none; pool-wide page ids, where the page rows hold their shard's own). The per-sample
    values come as fixed-length tuples, so that the host builds no array whose shape depends
    on how many samples enter (each new shape would compile an op)."""
    keys = jax.vmap(jax.random.fold_in)(jnp.stack(request_keys), samples)
    logits = jnp.stack(logits)
    pools = tuple(tuple(p.at[:, copy_dst].set(p[:, copy_src]) for p in side)
                  for side in state.pools)
    put = lambda x, v: x.at[slot].set(v, mode="drop")  # noqa: E731
    s = state.window.shape[0]
    return state._replace(
        pools=pools, page_table=put(state.page_table, page_rows), lengths=put(state.lengths, lengths),
        logits=put(state.logits, logits), keys=put(state.keys, keys),
        produced=put(state.produced, jnp.zeros((s,), jnp.int32)), budget=put(state.budget, budgets),
        temperature=put(state.temperature, temperatures),
        done=put(state.done, jnp.zeros((s,), bool)),
        reason=put(state.reason, jnp.full((s,), int(generate.FinishReason.LENGTH), jnp.int32)),
        window=put(state.window, jnp.full(state.window.shape, -2, jnp.int32)))


def retire(state: SlotState, slots):
    """Ends the rows of ``slots`` (bool [S]) without a Completion (`Engine.cancel`)."""
    return state._replace(done=state.done | slots)


def decode(graphdef, steps, params, layers, knobs, state: SlotState, prefix=None, *,
           read_pages: int | None = None, truncate: bool | None = None,
           record_routes: bool = False):
    """``steps`` decode steps of every slot -> (state, tokens int32 [S, steps], logprobs
    float32 [S, steps], emitted bool [S, steps], routes uint8 [S, steps, L_moe, k] or None). A
    row samples from its logits with its key at step ``produced``, stops at EOS, a stop sequence
    or its budget, and (while live) writes the token's keys / values into its pages.
    ``layers``: `layer_params` of ``params``. ``prefix``: None, or the `qwen3.PagedPrefix` of
    the slots' shared prompt pages (each read once per step for all its rows). ``read_pages``
    (`qwen3.PagedKVCache.read_pages`) and ``truncate`` (`generate.sample_token`'s) are static
    hints for the dry run's cost program (`ace_jax.train.dry_run_programs.paged_decode_program`);
    the engine passes neither. ``record_routes`` (static): return the MoE routing record."""
    model = nnx.merge(graphdef, params)
    knobs = knobs._replace(temperature=state.temperature)

    def step(state: SlotState, _):
        live = ~state.done
        tok, lp = generate.sample_token(generate.step_keys(state.keys, state.produced),
                                        state.logits, knobs, truncate)
        tok = jnp.where(live, tok, knobs.pad_id)
        lp = jnp.where(live, lp, 0.0)
        produced = state.produced + live
        window, hit_eos, hit_stop = generate.check_stop(tok, state.window, knobs)
        spent = produced >= state.budget
        reason = jnp.where(hit_eos, int(generate.FinishReason.EOS),
                           jnp.where(hit_stop, int(generate.FinishReason.STOP),
                                     int(generate.FinishReason.LENGTH)))
        finishing = live & (hit_eos | hit_stop | spent)
        h, pools, routes = model_forward(model, layers, tok[:, None], live[:, None],
                                          state.pools, state.page_table, state.lengths, prefix,
                                          read_pages, record_routes)
        state = state._replace(
            pools=pools, lengths=state.lengths + live, logits=model.lm_logits(h[:, -1, :]),
            produced=produced, done=state.done | finishing,
            reason=jnp.where(finishing, reason, state.reason), window=window)
        return state, (tok, lp, live, None if routes is None else routes[:, 0])

    state, (tokens, logprobs, emitted, routes) = jax.lax.scan(step, state, None, length=steps)
    if routes is not None:
        routes = jnp.swapaxes(routes, 0, 1)
    return state, tokens.T, logprobs.T, emitted.T, routes


def pack_step(tokens, logprobs, emitted, done, reason) -> jax.Array:
    """What the host needs of a decode call, as one int32 array [S, 3 * steps + 2] (one
    gather across processes instead of five): tokens [S, steps], the float32 log-probs' bits
    [S, steps], emitted [S, steps], done [S], reason [S]. `unpack_step` inverts it."""
    bits = jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32), jnp.int32)
    return jnp.concatenate([tokens, bits, emitted.astype(jnp.int32), done[:, None].astype(
        jnp.int32), reason[:, None]], axis=1)


def unpack_step(packed: np.ndarray, steps: int) -> tuple:
    """(tokens, logprobs, emitted, done, reason) host arrays of a `pack_step` result."""
    tokens, bits, emitted = (packed[:, i * steps:(i + 1) * steps] for i in range(3))
    return (tokens, bits.view(np.float32), emitted.astype(bool),
            packed[:, 3 * steps].astype(bool), packed[:, 3 * steps + 1])


def jitted(record_routes: bool) -> tuple:
    """The programs as `engine.Engine` calls them, jitted (once per engine): (``prefill``,
    ``admit``, ``retire``, ``decode``, ``layer_params``, ``pack_step``), the graphdef (and
    decode's ``steps``) static, the pools and the slots' state donated. ``record_routes``:
    prefill and decode return the MoE routing record."""
    return (jax.jit(functools.partial(prefill, record_routes=record_routes),
                    static_argnums=(0,), donate_argnums=(2,)),
            jax.jit(admit, donate_argnums=(0,)),
            jax.jit(retire, donate_argnums=(0,)),
            jax.jit(functools.partial(decode, record_routes=record_routes),
                    static_argnums=(0, 1), donate_argnums=(5,)),
            jax.jit(layer_params, static_argnums=(0,)),
            jax.jit(pack_step))
