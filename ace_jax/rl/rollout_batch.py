"""The training batch built from grouped rollouts, in the exact layout the sampler used.

A row is ``[left-padded prompt (P) | completion (M)]``: the prompt sits right-aligned in its P
slots as in ``generate.left_pad`` and the completion follows at slots P..P+M-1, so positions,
masks and hence log-probabilities are the ones the sampler saw.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ace_jax.runtime import generate
from ace_jax.runtime.engine_programs import NO_ROUTE
from models import qwen3


class TrainBatch(NamedTuple):
    """One learner batch of N rows (N = number of prompts x group size).

    Attributes:
      input_ids: int32 [N, P + M] prompt (left-padded) then completion (right-padded).
      positions: int32 [N, P + M] position ids, 0 at each row's first real prompt token.
      attention_mask: bool [N, P + M] real tokens (prompt and completion up to its length).
      completion_mask: float32 [N, M] 1 on the completion tokens that are trained.
      behaviour_logprobs: float32 [N, M] the sampler's log-probs of the completion tokens.
      rewards: float32 [N] one scalar per completion; rows are group-major (G per prompt).
      ref_logprobs: float32 [N, M] frozen reference log-probs (zeros when the KL term is off).
      routes: None, or uint8 [N, P + M, L_moe, k]: the sampler's routing record (the experts
        each MoE layer sent each token to; `engine_programs.NO_ROUTE` on padding), for routing
        replay (``grpo.routing_replay="R3"``) and the ``offpolicy/*routing*`` measures.
      advantages: None, or float32 [N]: advantages the host computed (Reinforce-Ada's, from
        the global statistics of every sample of a state, `dynamic_sampling.global_advantages`);
        None = the learner computes them from ``rewards`` per group (``grpo.advantage_estimator``).
    """

    input_ids: jax.Array
    positions: jax.Array
    attention_mask: jax.Array
    completion_mask: jax.Array
    behaviour_logprobs: jax.Array
    rewards: jax.Array
    ref_logprobs: jax.Array
    routes: jax.Array | None = None
    advantages: jax.Array | None = None

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.completion_mask.shape[1]


BatchShardings = Callable[[TrainBatch], TrainBatch]
"""A batch's target shardings: abstract TrainBatch (``jax.ShapeDtypeStruct`` leaves) -> a
TrainBatch of ``jax.sharding.Sharding``, e.g. `ace_jax.runtime.placement.Placement.batch` (the
learner's 'batch' rule: rows split, every other dim replicated)."""


class RouteRecord(NamedTuple):
    """A batch's MoE routing record in host memory, as the sampler returned it: each prompt's
    routes once and each row's completion routes. `block` assembles any block of the learner's
    uint8 ``[N, P + M, L_moe, k]`` record (``[left-padded prompt routes | completion routes]``,
    `engine_programs.NO_ROUTE` on padding), so a device's shard is built without the whole array
    (``N x (P + M) x L_moe x k`` bytes: 2.4 GB at 512 rows of 8k + 4k tokens, 48 x 8) ever
    existing on the host or on one device.

    Attributes:
      prompt_routes: per prompt b, uint8 [len(prompt b), L_moe, k].
      routes: uint8 [N, M, L_moe, k], each row's completion (`NO_ROUTE` past its length).
      prompt_index: int [N], each row's prompt.
      prompt_len: P, the left-padded prompt width (>= every prompt's length).
    """

    prompt_routes: tuple
    routes: np.ndarray
    prompt_index: np.ndarray
    prompt_len: int

    @classmethod
    def create(cls, prompt_routes: Sequence[np.ndarray], routes: np.ndarray,
               prompt_index: np.ndarray, prompt_len: int) -> "RouteRecord":
        """Checks the parts (ValueError naming what disagrees) and keeps them, not copied."""
        routes = np.asarray(routes)
        index = np.asarray(prompt_index)
        if routes.dtype != np.uint8 or routes.ndim != 4:
            raise ValueError(f"routes must be uint8 [N, M, L_moe, k], got {routes.dtype} "
                             f"{list(routes.shape)}")
        if index.shape != routes.shape[:1]:
            raise ValueError(f"prompt_index has shape {index.shape}, the routes {routes.shape[0]} "
                             f"rows")
        if index.size and (index.min() < 0 or index.max() >= len(prompt_routes)):
            raise ValueError(f"prompt_index points outside the {len(prompt_routes)} prompts")
        for b, r in enumerate(prompt_routes):
            r = np.asarray(r)
            if r.dtype != np.uint8 or r.shape[1:] != routes.shape[2:] or len(r) > prompt_len:
                raise ValueError(f"prompt {b}'s routes must be uint8 [<= {prompt_len}, "
                                 f"{routes.shape[2]}, {routes.shape[3]}], got {r.dtype} "
                                 f"{list(r.shape)}")
        return cls(tuple(prompt_routes), routes, index, int(prompt_len))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(N, P + M, L_moe, k) of the assembled record."""
        n, m, layers, k = self.routes.shape
        return n, self.prompt_len + m, layers, k

    def block(self, index: tuple = ()) -> np.ndarray:
        """The assembled record's block ``index`` (a tuple of slices, as
        ``jax.make_array_from_callback`` passes a shard's; () = the whole record): uint8,
        built from the rows the block covers only."""
        index = tuple(index) + (slice(None),) * (4 - len(index))
        p = self.prompt_len
        rows = range(*index[0].indices(self.shape[0]))
        out = np.full((len(rows),) + self.shape[1:], NO_ROUTE, np.uint8)
        for j, i in enumerate(rows):
            prompt = self.prompt_routes[self.prompt_index[i]]
            out[j, p - len(prompt):p] = prompt
            out[j, p:] = self.routes[i]
        return out[(slice(None),) + index[1:]]


def _host_batch(prompts: Sequence[Sequence[int]], gen: generate.GenerationResult, rewards, *,
                prompt_bucket: int, pad_id: int, ref_logprobs=None, advantages=None
                ) -> tuple[dict[str, np.ndarray], RouteRecord | None]:
    """The TrainBatch's fields but ``routes`` as host numpy arrays of their final dtypes, and
    the routing record (None without one); see `make_train_batch`."""
    ids, pos, mask = generate.left_pad(prompts, prompt_bucket, pad_id)
    idx = np.asarray(gen.prompt_index)
    tokens = np.asarray(gen.tokens)
    lengths = np.asarray(gen.lengths)
    n, m = tokens.shape
    comp_mask = (np.arange(m)[None, :] < lengths[:, None])
    next_pos = pos[idx, -1][:, None] + 1 + np.arange(m)[None, :]
    rew = np.asarray(rewards, np.float32)
    if rew.shape != (n,):
        raise ValueError(f"rewards must have shape ({n},), got {rew.shape}")
    ref = np.zeros((n, m), np.float32) if ref_logprobs is None else np.asarray(ref_logprobs)
    fields = dict(
        input_ids=np.concatenate([ids[idx], tokens], axis=1).astype(np.int32),
        positions=np.concatenate([pos[idx], next_pos], axis=1).astype(np.int32),
        attention_mask=np.concatenate([mask[idx], comp_mask], axis=1),
        completion_mask=comp_mask.astype(np.float32),
        behaviour_logprobs=np.asarray(gen.logprobs, np.float32),
        rewards=rew,
        ref_logprobs=ref.astype(np.float32))
    if advantages is not None:
        adv = np.asarray(advantages, np.float32)
        if adv.shape != (n,):
            raise ValueError(f"advantages must have shape ({n},), got {adv.shape}")
        fields["advantages"] = adv
    record = None
    if gen.routes is not None:
        if gen.prompt_routes is None or len(gen.prompt_routes) != len(prompts):
            raise ValueError(f"the routing record needs one prompt_routes entry per prompt "
                             f"({len(prompts)}), got "
                             f"{None if gen.prompt_routes is None else len(gen.prompt_routes)}")
        record = RouteRecord.create(gen.prompt_routes, gen.routes, idx, ids.shape[1])
    return fields, record


def make_train_batch(prompts: Sequence[Sequence[int]], gen: generate.GenerationResult,
                     rewards, *, prompt_bucket: int, pad_id: int, ref_logprobs=None,
                     advantages=None, shardings: BatchShardings | None = None) -> TrainBatch:
    """Builds a TrainBatch from the prompts and the grouped generation that answered them.

    ``rewards`` float [N]; rows are ordered as in ``gen`` (prompt-major, G samples each).
    ``advantages`` None or float [N] (`TrainBatch.advantages`: computed on the host).

    ``shardings`` None: every array on the default device (the routing record assembled whole
    first). Else the batch's target shardings (`BatchShardings`, e.g. the learner's
    ``placement.batch``): every array is built shard by shard from host memory
    (``jax.make_array_from_callback``), so a device receives only its rows and the routing
    record ``[N, P + M, L_moe, k]`` never exists whole (`RouteRecord.block`); on a multi-host
    mesh each process builds its own devices' shards (the inputs must be the same on every
    process). The learner then takes the batch as placed (`placed_on`).
    """
    fields, record = _host_batch(prompts, gen, rewards, prompt_bucket=prompt_bucket,
                                 pad_id=pad_id, ref_logprobs=ref_logprobs, advantages=advantages)
    if shardings is None:
        return TrainBatch(**{k: jnp.asarray(v) for k, v in fields.items()},
                          routes=None if record is None else jnp.asarray(record.block()))
    return _place_from_host(fields, record, shardings)


def _place_from_host(fields: dict[str, np.ndarray], record: RouteRecord | None,
                     shardings: BatchShardings) -> TrainBatch:
    """`TrainBatch` of global arrays with the shardings ``shardings`` gives the abstract batch,
    each device's shard sliced (or, for the routes, assembled) from host memory."""
    abstract = TrainBatch(
        **{k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in fields.items()},
        routes=None if record is None else jax.ShapeDtypeStruct(record.shape, jnp.uint8))
    target = shardings(abstract)
    arrays = {k: jax.make_array_from_callback(v.shape, getattr(target, k),
                                              lambda index, v=v: v[index])
              for k, v in fields.items()}
    routes = None
    if record is not None:
        routes = jax.make_array_from_callback(record.shape, target.routes, record.block)
    return TrainBatch(**arrays, routes=routes)


def placed_on(batch: TrainBatch, shardings: BatchShardings) -> bool:
    """Whether every array of ``batch`` already has the sharding ``shardings`` gives it (a batch
    `make_train_batch` built with them): the learner then places nothing (re-placing a global
    array of a multi-host mesh from one host is not possible)."""
    target = shardings(batch)
    arrays, wants = jax.tree.leaves(batch), jax.tree.leaves(target)
    return len(arrays) == len(wants) and all(
        isinstance(x, jax.Array) and x.sharding.is_equivalent_to(s, x.ndim)
        for x, s in zip(arrays, wants))


class RouteStats(NamedTuple):
    """How the learner's routers agree with the sampler's record, over (token, MoE layer) pairs
    with a record: ``records`` of them, ``disagree`` whose top-k expert set differs (float32
    scalars; counts, so microbatches add up)."""

    disagree: jax.Array
    records: jax.Array


def route_disagreement(own: jax.Array, recorded: jax.Array, mask: jax.Array,
                       num_experts: int) -> RouteStats:
    """own int [B, T, L, k] (the routers' top-k), recorded int [B, T, L, k] (ids outside
    [0, num_experts): no record), mask bool [B, T] (real tokens) -> `RouteStats`."""
    rec = recorded.astype(jnp.int32)
    has = mask[:, :, None] & qwen3.has_route(rec, num_experts)                      # [B, T, L]
    same = jnp.all(jnp.sort(own.astype(jnp.int32), axis=-1) == jnp.sort(rec, axis=-1), axis=-1)
    return RouteStats(jnp.sum(has & ~same, dtype=jnp.float32), jnp.sum(has, dtype=jnp.float32))


def _completion_hidden(model, batch: TrainBatch, group_size: int = 1, replay: bool = False
                       ) -> tuple[jax.Array, jax.Array, RouteStats | None]:
    """(final-normed hidden states [N, M, H] at the M positions that predict the completion
    tokens, router aux loss scalar, `RouteStats` or None): one policy forward with no logits
    formed.

    ``group_size`` G > 1: the rows come in groups of G consecutive rows with one prompt (the
    sampler's layout), and each prompt runs once instead of G times (`_shared_prompt_hidden`).
    With a routing record in the batch the forward measures its routers against it, and with
    ``replay`` dispatches by it (R3)."""
    if group_size > 1:
        return _shared_prompt_hidden(model, batch, group_size, replay)
    record = batch.routes
    out = model(batch.input_ids, batch.positions, attention_mask=batch.attention_mask,
                compute_logits=False, routes=record if replay else None,
                return_routes=record is not None)
    p = batch.prompt_len
    m = batch.completion_mask.shape[1]
    stats = None if record is None else route_disagreement(
        out.routes, record, batch.attention_mask, model.config.num_experts)
    return out.hidden_states[:, p - 1:p - 1 + m, :], out.aux_loss, stats


def _shared_prompt_hidden(model, batch: TrainBatch, g: int, replay: bool = False
                          ) -> tuple[jax.Array, jax.Array, RouteStats | None]:
    """`_completion_hidden` with each group's prompt run once, as the sampler runs it: the N/G
    prompts [N/G, P] go through the policy into a KV cache, the cache is repeated G times
    (``generate.share_cache``) and the completions [N, M-1] attend to it and to themselves. The
    values are those of the full-row forward (other summation order); the work on prompt tokens
    is 1/G of it. The aux loss returned is the completions' (the router statistics of one call;
    the trainer uses this path only with ``optim.aux_loss_coef = 0``)."""
    n, s = batch.input_ids.shape
    p = batch.prompt_len
    if n % g:
        raise ValueError(f"{n} rows do not split into groups of {g}")
    prompt = lambda x: x[::g, :p]          # every group's first row: the group's prompt
    record = batch.routes
    routes = lambda part: None if record is None or not replay else part(record)  # noqa: E731
    stats = lambda out, part: None if record is None else route_disagreement(  # noqa: E731
        out.routes, part(record), part(batch.attention_mask), model.config.num_experts)
    out_p = model(prompt(batch.input_ids), prompt(batch.positions),
                  attention_mask=prompt(batch.attention_mask),
                  cache=model.init_cache(n // g, s), cache_index=0, compute_logits=False,
                  cache_as_xs=True, routes=routes(prompt), return_routes=record is not None)
    last = jnp.repeat(out_p.hidden_states[:, -1:, :], g, axis=0)     # predicts completion token 0
    if s - p == 1:
        return last, out_p.aux_loss, stats(out_p, prompt)
    rest = lambda x: x[:, p:s - 1]          # completion tokens 0..M-2 predict tokens 1..M-1
    out_c = model(rest(batch.input_ids), rest(batch.positions),
                  attention_mask=rest(batch.attention_mask),
                  cache=generate.share_cache(out_p.cache, g), cache_index=p, compute_logits=False,
                  cache_as_xs=True, routes=routes(rest), return_routes=record is not None)
    both = None
    if record is not None:   # each prompt counted once, each forwarded completion token once
        sp, sc = stats(out_p, prompt), stats(out_c, rest)
        both = RouteStats(sp.disagree + sc.disagree, sp.records + sc.records)
    return jnp.concatenate([last, out_c.hidden_states], axis=1), out_c.aux_loss, both


def completion_logits(model, batch: TrainBatch) -> tuple[jax.Array, jax.Array]:
    """Runs the policy on full rows; returns (logits float32 [N, M, V] that predict the completion
    tokens, router aux loss scalar).

    Only the M positions that predict completion tokens go through the lm_head (the prompt
    positions' [N, P, V] logits are never formed), which saves that share of the lm_head matmul
    in the forward and the backward pass.
    """
    h, aux, _ = _completion_hidden(model, batch)
    return model.lm_logits(h), aux


def _log_probs(logits: jax.Array, temperature: float) -> jax.Array:
    """float32 log_softmax(logits / T) over the last axis; greedy (T <= 0) counts as T = 1, the
    convention of ``generate.sample_token``."""
    t = temperature if temperature > 0 else 1.0
    return jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)


def _at_tokens(logp: jax.Array, tokens: jax.Array) -> jax.Array:
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def _entropy(logp: jax.Array) -> jax.Array:
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float):
    """log_softmax(logits / T) at ``tokens``: logits [N, M, V], tokens [N, M] -> float32 [N, M].

    Uses the same temperature convention as ``generate.sample_token`` (greedy counts as T = 1).
    """
    return _at_tokens(_log_probs(logits, temperature), tokens)


def token_entropy(logits: jax.Array, temperature: float) -> jax.Array:
    """Entropy of each next-token distribution: logits [N, M, V] -> float32 [N, M] (nats)."""
    return _entropy(_log_probs(logits, temperature))


DEFAULT_CHUNK_TOKENS = 1024
"""Default ``chunk_tokens`` of `completion_logprobs`: completion positions per row in one chunk."""


def completion_logprobs(model, batch: TrainBatch, temperature: float, *,
                        chunk_tokens: int | None = DEFAULT_CHUNK_TOKENS, group_size: int = 1,
                        replay_routes: bool = False, return_route_stats: bool = False):
    """``token_logprobs`` and ``token_entropy`` of the completion tokens straight from the policy:
    returns (logprobs float32 [N, M], entropy float32 [N, M], router aux loss scalar).

    The same values as ``completion_logits`` followed by ``token_logprobs`` / ``token_entropy``,
    computed by `_fused_logprobs`: the lm_head runs over ``chunk_tokens`` completion positions of
    every row at a time (fp32 logits [N, chunk_tokens, V] per chunk, never [N, M, V]; None: all M
    at once), and a hand-written backward pass recomputes each chunk's logits and forms their
    gradient once, as ``g * (onehot - p) - g_H * p * (logp + H)``, instead of through autodiff of
    log_softmax, the one-hot gather and the entropy sum (several full-vocabulary passes and a
    scatter). Chunks run along M, not across rows, so each keeps the rows' (batch) sharding.
    ``group_size`` > 1: each group's prompt runs once (see `_completion_hidden`).
    ``replay_routes``: dispatch MoE tokens by ``batch.routes`` (R3); ``return_route_stats``:
    return a fourth value, the `RouteStats` of the routers against ``batch.routes`` (None
    without a record).

    Raises:
      ValueError: ``chunk_tokens`` is neither None nor a positive int (before the policy runs).
    """
    _check_chunk_tokens(chunk_tokens)
    h, aux, route_stats = _completion_hidden(model, batch, group_size, replay_routes)
    cfg = model.config
    if cfg.tie_word_embeddings:
        w = model.embed_tokens.embedding[...]
    else:
        w = model.lm_head.kernel[...]
    t = temperature if temperature > 0 else 1.0
    tokens = batch.input_ids[:, batch.prompt_len:].astype(jnp.int32)
    logprobs, entropy = _fused_logprobs(h, w, tokens, float(t), cfg.dtype,
                                        bool(cfg.tie_word_embeddings), chunk_tokens)
    if return_route_stats:
        return logprobs, entropy, aux, route_stats
    return logprobs, entropy, aux


def _head_logits(h, w, dtype, tied: bool):
    """fp32 logits exactly as ``Qwen3ForCausalLM.lm_logits`` forms them (w: [H, V], or [V, H] tied)."""
    eq = "...h,vh->...v" if tied else "...h,hv->...v"
    return jnp.einsum(eq, h.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32)


def _check_chunk_tokens(chunk_tokens) -> None:
    """Raises ValueError unless ``chunk_tokens`` is None or a positive int."""
    if chunk_tokens is None:
        return
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, (int, np.integer)) \
            or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int or None, got {chunk_tokens!r}")


def _chunk_len(m: int, chunk_tokens: int | None) -> int:
    """Positions per chunk along M: ``chunk_tokens`` capped at M (None: M)."""
    return m if chunk_tokens is None else min(int(chunk_tokens), m)


def _to_chunks(x: jax.Array, c: int) -> jax.Array:
    """[N, M, ...] -> [K, N, c, ...] with K = ceil(M / c); M is zero-padded to K * c."""
    n, m = x.shape[:2]
    k = -(-m // c)
    pad = [(0, 0), (0, k * c - m)] + [(0, 0)] * (x.ndim - 2)
    x = jnp.pad(x, pad).reshape((n, k, c) + x.shape[2:])
    return jnp.moveaxis(x, 1, 0)


def _from_chunks(x: jax.Array, m: int) -> jax.Array:
    """[K, N, c, ...] -> [N, M, ...]: the inverse of `_to_chunks`, padding dropped."""
    k, n, c = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape((n, k * c) + x.shape[3:])[:, :m]


def _scaled_logits(h, w, temperature, dtype, tied):
    """z = logits / T, float32 [..., V] (the argument of ``_log_probs``' log_softmax)."""
    return _head_logits(h, w, dtype, tied) / temperature


def _chunk_forward(h, w, tokens, temperature, dtype, tied):
    """One chunk: h [N, c, H], tokens [N, c] -> (token log-probs, entropy (nats), logsumexp of z),
    each float32 [N, c]."""
    z = _scaled_logits(h, w, temperature, dtype, tied)
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = z - lse[..., None]
    return _at_tokens(logp, tokens), _entropy(logp), lse


def _chunk_logit_grad(h, w, tokens, lse, entropy, g_lp, g_ent, temperature, dtype, tied):
    """One chunk's gradient of the fp32 logits, cast to the compute dtype: [N, c, V].

    With z = logits / T and p = softmax(z):  d lp / d z = onehot - p;  d H / d z = -p (logp + H).
    """
    logp = _scaled_logits(h, w, temperature, dtype, tied) - lse[..., None]
    p = jnp.exp(logp)
    vocab = jax.lax.broadcasted_iota(jnp.int32, logp.shape, logp.ndim - 1)
    onehot = (vocab == tokens[..., None]).astype(jnp.float32)
    dz = g_lp[..., None] * (onehot - p) - g_ent[..., None] * p * (logp + entropy[..., None])
    return (dz / temperature).astype(dtype)


def _head_grads(dlogits, h, w, dtype, tied):
    """(dh float32 [..., H], dw float32 like w) of fp32-accumulated products with the head."""
    if tied:  # w [V, H]
        dh = jnp.einsum("...v,vh->...h", dlogits, w.astype(dtype), preferred_element_type=jnp.float32)
        dw = jnp.einsum("...v,...h->vh", dlogits, h.astype(dtype), preferred_element_type=jnp.float32)
    else:  # w [H, V]
        dh = jnp.einsum("...v,hv->...h", dlogits, w.astype(dtype), preferred_element_type=jnp.float32)
        dw = jnp.einsum("...h,...v->hv", h.astype(dtype), dlogits, preferred_element_type=jnp.float32)
    return dh, dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _fused_logprobs(h, w, tokens, temperature: float, dtype, tied: bool,
                    chunk_tokens: int | None):
    """(token log-probs float32 [N, M], entropy float32 [N, M]) of hidden states h [N, M, H]
    through the lm_head w ([H, V], or [V, H] tied); a custom VJP (see `completion_logprobs`).

    ``temperature`` > 0 (the caller maps greedy to 1). ``chunk_tokens``: completion positions
    per chunk (None: all M), so temporaries are O(N * chunk_tokens * V), independent of M.
    """
    lp, entropy, _ = _chunked_forward(h, w, tokens, temperature, dtype, tied, chunk_tokens)
    return lp, entropy


def _chunked_forward(h, w, tokens, temperature, dtype, tied, chunk_tokens):
    """(lp, entropy, logsumexp of z), each float32 [N, M], one chunk of M at a time."""
    _check_chunk_tokens(chunk_tokens)
    if h.ndim != 3 or tokens.shape != h.shape[:2]:
        raise ValueError(f"h must be [N, M, H] and tokens [N, M], got {h.shape} and {tokens.shape}")
    m = h.shape[1]
    c = _chunk_len(m, chunk_tokens)
    if c == m:
        return _chunk_forward(h, w, tokens, temperature, dtype, tied)
    out = jax.lax.map(lambda xs: _chunk_forward(xs[0], w, xs[1], temperature, dtype, tied),
                      (_to_chunks(h, c), _to_chunks(tokens, c)))
    return tuple(_from_chunks(x, m) for x in out)


def _fused_logprobs_fwd(h, w, tokens, temperature, dtype, tied, chunk_tokens):
    lp, entropy, lse = _chunked_forward(h, w, tokens, temperature, dtype, tied, chunk_tokens)
    return (lp, entropy), (h, w, tokens, lse, entropy)


def _fused_logprobs_bwd(temperature, dtype, tied, chunk_tokens, res, cts):
    """Recomputes each chunk's logits; dh per chunk, dw summed over chunks in fp32."""
    h, w, tokens, lse, entropy = res
    g_lp, g_ent = cts
    m = h.shape[1]
    c = _chunk_len(m, chunk_tokens)

    def chunk_grads(hc, tc, lse_c, ent_c, glp_c, gent_c):
        dlogits = _chunk_logit_grad(hc, w, tc, lse_c, ent_c, glp_c, gent_c, temperature, dtype,
                                    tied)
        return _head_grads(dlogits, hc, w, dtype, tied)

    if c == m:
        dh, dw = chunk_grads(h, tokens, lse, entropy, g_lp, g_ent)
    else:
        def step(dw_acc, xs):
            dh_c, dw_c = chunk_grads(*xs)
            return dw_acc + dw_c, dh_c

        xs = tuple(_to_chunks(x, c) for x in (h, tokens, lse, entropy, g_lp, g_ent))
        dw, dh = jax.lax.scan(step, jnp.zeros(w.shape, jnp.float32), xs)
        dh = _from_chunks(dh, m)
    return dh.astype(h.dtype), dw.astype(w.dtype), None


_fused_logprobs.defvjp(_fused_logprobs_fwd, _fused_logprobs_bwd)
