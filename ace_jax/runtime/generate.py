"""Grouped generation with a static-shape KV cache: prefill once per prompt, decode G samples.

One jitted function does the whole rollout for a batch of B prompts:

1. prefill: the B prompts, left-padded to a common bucketed length P, run through the model once,
   writing slots [0, P) of a cache;
2. share: the prompt is computed once for the G samples of its group. On accelerators
   (`shared_prefix_decode`) its keys are stored once, a prefix the G rows share and each decode
   step reads once per group (cascade attention), each row owning max_new_tokens slots of its
   own; otherwise the prefilled cache (room for P + max_new_tokens) is repeated G times along
   the batch axis (`share_cache`). The last-position logits are repeated G times;
3. decode: a ``lax.while_loop`` samples one token per row per step (temperature, top-k, top-p),
   stops rows at EOS or a stop sequence, and ends when every row is done or the budget is spent.
   Each layer's weights are sliced out of the stacks once, before the loop.

It returns, per sample (N = B * G rows, row ``b * G + g`` is sample g of prompt b):
``tokens`` int32 [N, M] (M = max_new_tokens; positions past ``lengths`` hold ``pad_id``),
``logprobs`` float32 [N, M], the behaviour log-probability of each sampled token, ``lengths`` [N]
(including the EOS / stop tokens), ``finish_reason`` [N] (see ``FinishReason``) and
``prompt_index`` [N].

Behaviour log-probabilities are ``log_softmax(logits / temperature)`` of the full vocabulary at the
sampled token (greedy: temperature 1). Top-k / top-p truncation changes which tokens can be drawn
but is not folded into the recorded log-probability, which is what the learner recomputes; keep
them off (``top_k=0, top_p=1``) for on-policy RL, as the local config does.

Sampling is deterministic for a given key, row by row: sample g of prompt b draws step t with
``fold_in(row_key(key, b, g), t)`` (`row_keys`), and the draw equals ``jax.random.categorical``
with that key. The rule depends on nothing else in the batch, so the paged engine
(`ace_jax.runtime.engine`), which decodes rows in any order and slot, draws the same tokens.

On CPU the cache uses the model's "decode" layout (`cache_layout`): per-layer k^T / v buffers that
the decode loop updates in place and the attention reads without copies.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from models import configs as model_configs, qwen3
from models.attention import resolve_attention_impl


class FinishReason(enum.IntEnum):
    LENGTH = 0   # max_new_tokens spent
    EOS = 1      # an EOS id was sampled
    STOP = 2     # a stop sequence was completed


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample. Only ``max_new_tokens`` and ``group_size`` (and the number of EOS ids and
    the stop-table shape) are compiled in; the other knobs are traced and never recompile.

    Attributes:
      max_new_tokens: decode budget M per sample.
      group_size: G samples per prompt.
      temperature: softmax temperature; 0 means greedy (argmax).
      top_k: keep the k most likely tokens (0 = off).
      top_p: nucleus sampling mass (1.0 = off).
      eos_ids: token ids that end a sample (included in its length); None (default): the model's
        ``config.eos_token_id`` (resolved by `Generator`); ``()``: none.
      stop_sequences: token-id sequences that end a sample once generated (included).
      pad_id: filler written after a sample has finished.
      prompt_bucket: prompts are left-padded to a multiple of this (limits recompilation).
    """

    max_new_tokens: int = 128
    group_size: int = 1
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    eos_ids: tuple[int, ...] | None = None
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    pad_id: int = 0
    prompt_bucket: int = 64

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(len(s) == 0 for s in self.stop_sequences):
            raise ValueError("stop_sequences must not contain an empty sequence")


def default_config() -> ml_collections.ConfigDict:
    """The ``sampling`` config section: the `SamplingConfig` knobs a run sets, with its defaults.

    ``group_size`` is ``rl.group_size``; ``eos_ids`` / ``pad_id`` come from the tokenizer, and
    ``stop_sequences`` are not used in training. The learner recomputes the behaviour log-probs
    at ``temperature`` (greedy counts as 1, see `sample_token`)."""
    d = SamplingConfig()
    c = ml_collections.ConfigDict()
    c.max_new_tokens = d.max_new_tokens   # decode budget per completion
    c.temperature = d.temperature         # 0 = greedy
    c.top_k = d.top_k                     # 0 = off
    c.top_p = d.top_p                     # 1.0 = off
    c.prompt_bucket = d.prompt_bucket     # prompts left-padded to a multiple (fewer compiles)
    return c


class GenerationResult(NamedTuple):
    tokens: jax.Array         # int32 [N, M]
    logprobs: jax.Array       # float32 [N, M]
    lengths: jax.Array        # int32 [N]
    finish_reason: jax.Array  # int32 [N], FinishReason values
    prompt_index: jax.Array   # int32 [N]
    # The routing record of an MoE policy (the paged engine's; None from the static generator):
    # uint8 [N, M, L_moe, k] per completion token (255 past a row's length) and, per prompt,
    # uint8 [len(prompt), L_moe, k].
    routes: np.ndarray | None = None
    prompt_routes: tuple | None = None
    # The policy version that sampled each completion token (int32 [N, M], 0 past a row's
    # length): the paged engine's (`Engine.update_weights`); None from the static generator
    # (every token the generator's current parameters').
    versions: np.ndarray | None = None


def left_pad(prompts: Sequence[Sequence[int]], bucket: int, pad_id: int):
    """Left-pads token lists to a shared length rounded up to ``bucket``.

    Returns (ids int32 [B, P], positions int32 [B, P], mask bool [B, P]); positions count from 0
    at each row's first real token (padding slots get position 0 and mask False).
    """
    if not prompts:
        raise ValueError("generate() needs at least one prompt")
    lens = [len(p) for p in prompts]
    if min(lens) == 0:
        raise ValueError("every prompt needs at least one token")
    width = -(-max(lens) // bucket) * bucket
    ids = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), bool)
    pos = np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = p
        mask[i, width - len(p):] = True
        pos[i, width - len(p):] = np.arange(len(p))
    return ids, pos, mask


def _stop_table(stop_sequences: tuple[tuple[int, ...], ...]) -> np.ndarray:
    """Right-aligned stop sequences [S, L]; -1 marks 'any token' in front of shorter ones."""
    if not stop_sequences:
        return np.zeros((0, 1), np.int32)
    width = max(len(s) for s in stop_sequences)
    table = np.full((len(stop_sequences), width), -1, np.int32)
    for i, s in enumerate(stop_sequences):
        table[i, width - len(s):] = s
    return table


class SamplingKnobs(NamedTuple):
    """The traced (non-static) sampling parameters: changing them never recompiles."""

    temperature: jax.Array   # float32 scalar (or [N], one per row); 0 = greedy
    top_k: jax.Array         # int32 scalar; 0 = off
    top_p: jax.Array         # float32 scalar; 1 = off
    eos_ids: jax.Array       # int32 [n_eos] (-1 = none)
    stop_table: jax.Array    # int32 [S, L] right-aligned stop sequences (-1 = any token)
    pad_id: jax.Array        # int32 scalar

    @classmethod
    def from_config(cls, cfg: SamplingConfig) -> "SamplingKnobs":
        return cls(jnp.float32(cfg.temperature), jnp.int32(cfg.top_k), jnp.float32(cfg.top_p),
                   jnp.asarray(tuple(cfg.eos_ids or ()) or (-1,), jnp.int32),
                   jnp.asarray(_stop_table(cfg.stop_sequences)), jnp.int32(cfg.pad_id))


def row_keys(key: jax.Array, prompt_index: jax.Array, sample_index: jax.Array) -> jax.Array:
    """The sampling keys of rows [N]: ``fold_in(fold_in(key, prompt_index), sample_index)``;
    step t of a row draws with ``fold_in(row key, t)`` (`step_keys`)."""
    fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    return jax.vmap(jax.random.fold_in)(fold(key, prompt_index), sample_index)


def step_keys(keys: jax.Array, steps: jax.Array) -> jax.Array:
    """keys [N] (`row_keys`) at the rows' decode steps (int [N] or a scalar) -> keys [N]."""
    return jax.vmap(jax.random.fold_in)(keys, jnp.broadcast_to(steps, keys.shape))


def check_stop(tok: jax.Array, window: jax.Array, knobs: SamplingKnobs):
    """After sampling ``tok`` int32 [N]: (the window of the last L tokens [N, L], hit_eos [N],
    hit_stop [N]); ``window`` holds the previous L tokens (-2 before the first)."""
    stops = knobs.stop_table
    window = jnp.concatenate([window[:, 1:], tok[:, None]], axis=1)
    hit_eos = jnp.any(tok[:, None] == knobs.eos_ids[None, :], axis=-1)
    hit_stop = (jnp.any(jnp.all((stops[None] == -1) | (stops[None] == window[:, None]), axis=-1),
                        axis=-1) if stops.shape[0] else jnp.zeros(tok.shape, bool))
    return window, hit_eos, hit_stop


def sample_token(keys: jax.Array, logits: jax.Array, knobs: SamplingKnobs,
                 truncate: bool | None = None):
    """Draws one token per row with its own key. keys [N] (typed PRNG keys), logits float32
    [N, V] -> (token int32 [N], logprob float32 [N]). ``knobs.temperature`` may be one per row
    (float32 [N]: the engine's requests each have their own).

    The log-prob is that of log_softmax(logits / T) (T = 1 when greedy), before top-k / top-p.
    With top-k and top-p off (the RL setting) the vocabulary sort is skipped at run time
    (``lax.cond`` on the traced knobs), which is most of the cost of a decode step on CPU.
    ``truncate``: None (default) decides so at run time; False / True compile only the branch
    the knobs take (the dry run's cost model: XLA's cost analysis counts a conditional's sort
    branch, ~0.7 GB of HBM traffic for 8 rows of a 152k vocabulary, whether it runs or not).
    """
    temperature = jnp.asarray(knobs.temperature)          # a scalar, or one per row [N]
    greedy = temperature <= 0.0
    t = jnp.where(greedy, 1.0, temperature)
    scaled = logits / (t[:, None] if t.ndim else t)
    untruncated = (knobs.top_k <= 0) & (knobs.top_p >= 1.0)
    if truncate is None:
        filtered = jax.lax.cond(untruncated, lambda s: s, lambda s: _truncate(s, knobs), scaled)
    else:
        filtered = _truncate(scaled, knobs) if truncate else scaled
    # = jax.random.categorical(keys[i], filtered[i]) per row (Gumbel-max with the same noise),
    # with an argmax that XLA:CPU runs ~5x faster than its variadic-reduce jnp.argmax. A greedy
    # row takes the argmax of its logits (no noise; truncation keeps every maximal logit), so one
    # argmax serves both kinds of row.
    gumbel = jax.vmap(lambda k: jax.random.gumbel(k, filtered.shape[1:], filtered.dtype))(keys)
    noise = jnp.where(greedy[:, None], 0.0, gumbel) if greedy.ndim else jnp.where(greedy, 0.0, gumbel)
    token = _argmax_last(filtered + noise).astype(jnp.int32)
    # log_softmax(scaled)[token], as jax.nn.log_softmax computes it, without the [N, V] result
    top = jax.lax.stop_gradient(jnp.max(scaled, axis=-1, keepdims=True))
    lse = jnp.log(jnp.sum(jnp.exp(scaled - top), axis=-1))
    return token, (jnp.take_along_axis(scaled, token[:, None], axis=-1) - top)[:, 0] - lse


def _argmax_last(x: jax.Array) -> jax.Array:
    """``jnp.argmax(x, axis=-1)`` for x without NaNs (the first maximal index; int32): a max and a
    min reduction instead of one (slow on CPU) variadic reduction."""
    top = jnp.max(x, axis=-1, keepdims=True)
    iota = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    return jnp.minimum(jnp.min(jnp.where(x == top, iota, x.shape[-1]), axis=-1), x.shape[-1] - 1)


def _truncate(scaled: jax.Array, knobs: SamplingKnobs) -> jax.Array:
    """Top-k / top-p filtering of scaled logits [N, V]: dropped tokens get -inf."""
    sorted_desc = jnp.sort(scaled, axis=-1)[:, ::-1]
    vocab = scaled.shape[-1]
    # top-k: keep logits >= the k-th largest (k = 0 keeps everything).
    k = jnp.where(knobs.top_k > 0, jnp.minimum(knobs.top_k, vocab), vocab)
    kth = jax.lax.dynamic_index_in_dim(sorted_desc, k - 1, axis=1, keepdims=True)
    # top-p: keep the smallest prefix of the sorted distribution whose mass reaches top_p (the
    # token that crosses it included).
    probs = jax.nn.softmax(jnp.where(sorted_desc >= kth, sorted_desc, -jnp.inf), axis=-1)
    keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < knobs.top_p
    cutoff = jnp.min(jnp.where(keep_sorted, sorted_desc, jnp.inf), axis=-1, keepdims=True)
    return jnp.where((scaled >= kth) & (scaled >= cutoff), scaled, -jnp.inf)


def share_cache(cache: qwen3.KVCache, g: int) -> qwen3.KVCache:
    """Repeats a prefilled cache G times along batch: row b becomes rows b*G .. b*G+G-1."""
    if g == 1:
        return cache
    axis = 0 if cache.layout == "decode" else 1  # decode: per-layer [B, ...]; standard: [Lg, B, ...]
    return qwen3.KVCache(k=tuple(jnp.repeat(x, g, axis=axis) for x in cache.k),
                         v=tuple(jnp.repeat(x, g, axis=axis) for x in cache.v),
                         kv_mask=jnp.repeat(cache.kv_mask, g, axis=0), layout=cache.layout)


def shared_prefix_decode(config, group_size: int, max_new_tokens: int) -> bool:
    """Whether the rollout keeps each prompt's prefilled keys ONCE, as a prefix its G samples
    share (`qwen3.KVCache.prefix`; cascade attention reads it once per group per step), instead
    of G copies (`share_cache`): with G > 1, a "standard" cache and a decode kernel that reads
    the cache block by block (not "dot", which the M own slots would pick on a GPU when short)."""
    return (group_size > 1 and cache_layout(config) == "standard"
            and resolve_attention_impl(config.attention_impl, model_configs.target_platform(config),
                                       max_new_tokens) != "dot")


def decode_cache(config, prompts: int, group_size: int, prompt_len: int, max_new_tokens: int,
                 prefix: qwen3.KVCache | None = None) -> qwen3.KVCache:
    """The empty cache a rollout of ``prompts`` x ``group_size`` rows decodes into. With
    `shared_prefix_decode`: the G rows of prompt b share ``prefix``'s row b (the prefilled
    prompts; zeros when None) and own ``max_new_tokens`` slots, the first new token at slot 0;
    else P + M slots per row, the first new token at slot P (after the prompt's copy)."""
    if shared_prefix_decode(config, group_size, max_new_tokens):
        if prefix is None:
            prefix = qwen3.init_cache(config, prompts, prompt_len)
        return qwen3.with_shared_prefix(prefix, group_size, max_new_tokens)
    return qwen3.init_cache(config, prompts * group_size, prompt_len + max_new_tokens,
                            layout=cache_layout(config))


def model_eos_ids(config) -> tuple[int, ...]:
    """The EOS token ids of a model config (``eos_token_id``: None, an id or a tuple of ids)."""
    eos = config.eos_token_id
    return () if eos is None else tuple(eos) if isinstance(eos, tuple) else (int(eos),)


def cache_layout(config) -> str:
    """The KV-cache layout the sampler uses for a model of ``config``: "decode" on CPU (per-layer
    buffers in the matmuls' operand layouts, unrolled layers: XLA:CPU otherwise copies and
    transposes the cache and the weights in every decode step), "standard" elsewhere (one scanned
    stack per layer group). The platform is the model's target (``config.platform``), so a CPU
    host compiling ahead of time for TPU takes the TPU layout."""
    return "decode" if model_configs.target_platform(config) == "cpu" else "standard"


def _constrain_cache(cache: qwen3.KVCache, placement) -> qwen3.KVCache:
    return cache if placement is None else placement.constrain_kv_cache(cache)


def decode_forward(model, tokens, positions, cache: qwen3.KVCache, cache_index, placement=None,
                   layer_params=None):
    """One decode step's forward: tokens / positions int32 [N] at ``cache_index`` (scalar) ->
    (next logits float32 [N, V], the cache with this step's keys and values). The body of the
    rollout's loop; `decode_step` is the same as a program of its own (the dry run costs it)."""
    n = tokens.shape[0]
    out = model(tokens[:, None], positions[:, None], attention_mask=jnp.ones((n, 1), bool), cache=cache,
                cache_index=cache_index, layer_params=layer_params)
    return out.logits[:, -1, :], _constrain_cache(out.cache, placement)


def decode_step(graphdef, placement, params, knobs: SamplingKnobs, cache: qwen3.KVCache, logits,
                positions, cache_index: int, keys, layer_params=None, truncate: bool | None = None):
    """One step of the rollout's decode loop as a function of its own, for the dry run to compile
    and cost (`ace_jax.train.dry_run_programs.decode_step_program` jits it): sample from
    ``logits`` float32 [N, V] with ``keys`` [N] (this step's, `step_keys`), then `decode_forward`
    the sampled tokens at ``positions`` int32 [N] into slot ``cache_index``. Returns
    (tokens [N], logprobs [N], next logits, cache).
    ``cache_index`` is a Python int here (the loop's is traced), so the attention's loop over
    the filled key blocks unrolls and XLA's cost analysis counts every block (it counts a loop
    body once). ``layer_params``: the per-layer weights, as the rollout passes them.
    ``truncate``: as `sample_token` (the dry run passes what its sampling config takes)."""
    model = nnx.merge(graphdef, params)
    tok, lp = sample_token(keys, logits, knobs, truncate)
    logits, cache = decode_forward(model, tok, positions, cache, cache_index, placement, layer_params)
    return tok, lp, logits, cache


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _rollout(graphdef, max_new_tokens: int, group_size: int, placement, params,
             knobs: SamplingKnobs, ids, positions, mask, key):
    model = nnx.merge(graphdef, params)
    b, p = ids.shape
    m, g = max_new_tokens, group_size
    n = b * g
    layout = cache_layout(model.config)
    shared = shared_prefix_decode(model.config, g, m)
    cache = _constrain_cache(qwen3.init_cache(model.config, b, p if shared else p + m, layout=layout),
                             placement)
    # each layer's weights sliced out of the stacks once, here: the decode loop then runs its
    # layers unrolled on these loop-invariant slices, which XLA lays out once for the step's
    # matmuls (a stack sliced inside the loop is re-laid out in every step: the attention
    # projections of every layer, ~40 MB of copies per layer per step in the compiled v5p
    # rollout). The prefill keeps the model's scan (unrolled, its buffers would not be reused).
    layer_params = model.layer_params()
    # cache_index a Python 0 (static): the prefill attends to the P prompt keys only, not to the
    # whole (still empty) cache. Only the last position's logits are needed.
    out = model(ids, positions, attention_mask=mask, cache=cache, cache_index=0, compute_logits=False)
    last_logits = jnp.repeat(model.lm_logits(out.hidden_states[:, -1, :]), g, axis=0)
    # shared: the prompts' keys once, shared by their G rows; the new tokens from slot 0
    cache = (decode_cache(model.config, b, g, p, m, prefix=out.cache) if shared
             else share_cache(out.cache, g))
    cache = _constrain_cache(cache, placement)
    first_slot = 0 if shared else p
    next_pos = jnp.repeat(positions[:, -1] + 1, g, axis=0)
    prompt_index = jnp.repeat(jnp.arange(b, dtype=jnp.int32), g)
    keys = row_keys(key, prompt_index, jnp.tile(jnp.arange(g, dtype=jnp.int32), b))
    window0 = jnp.full((n, knobs.stop_table.shape[1]), -2, jnp.int32)

    def cond(state):
        t, done = state[0], state[5]
        return jnp.logical_and(t < m, jnp.logical_not(jnp.all(done)))

    def body(state):
        t, logits, cache, tokens, logprobs, done, lengths, reason, window = state
        tok, lp = sample_token(step_keys(keys, t), logits, knobs)
        tok = jnp.where(done, knobs.pad_id, tok)
        lp = jnp.where(done, 0.0, lp)
        tokens = tokens.at[:, t].set(tok)
        logprobs = logprobs.at[:, t].set(lp)
        lengths = lengths + jnp.logical_not(done).astype(jnp.int32)
        window, hit_eos, hit_stop = check_stop(tok, window, knobs)
        new_reason = jnp.where(hit_eos, int(FinishReason.EOS),
                               jnp.where(hit_stop, int(FinishReason.STOP), int(FinishReason.LENGTH)))
        finishing = jnp.logical_not(done) & (hit_eos | hit_stop)
        reason = jnp.where(finishing, new_reason, reason)
        done = done | finishing
        logits, cache = decode_forward(model, tok, next_pos + t, cache, jnp.int32(first_slot) + t,
                                       placement, layer_params)
        return (t + 1, logits, cache, tokens, logprobs, done, lengths, reason, window)

    init = (jnp.int32(0), last_logits, cache, jnp.full((n, m), knobs.pad_id, jnp.int32),
            jnp.zeros((n, m), jnp.float32), jnp.zeros((n,), bool), jnp.zeros((n,), jnp.int32),
            jnp.full((n,), int(FinishReason.LENGTH), jnp.int32), window0)
    _, _, _, tokens, logprobs, _, lengths, reason, _ = jax.lax.while_loop(cond, body, init)
    return GenerationResult(tokens, logprobs, lengths, reason, prompt_index)


class Generator:
    """Grouped sampler over a Qwen3 policy. The weights can be swapped after every learner step.

    Example:
      gen = Generator(model, SamplingConfig(max_new_tokens=64, group_size=4, eos_ids=(2,)))
      out = gen.generate([[5, 6, 7], [8, 9]], jax.random.key(0))   # 8 samples
      gen.update_weights(nnx.state(new_model, nnx.Param))          # after a learner step
    """

    def __init__(self, model: nnx.Module, sampling: SamplingConfig, *, placement=None, layout=None):
        """``placement``: an `ace_jax.runtime.placement.Placement` to run sharded: the prompts and the KV
        cache are split over its 'batch' rule (place the params with ``placement.place_params``
        first). None: wherever the params live (one device). ``layout``: a
        `ace_jax.runtime.sampler_layout.SamplerLayout` (instead of ``placement``): decode in the
        sampler's own layout, the weights resharded into it by every `update_weights`."""
        graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(self.rest):
            raise ValueError("the policy holds non-parameter state; Generator expects params only")
        self._reshard = (lambda p: p) if layout is None else layout.resharder(params)
        self.graphdef = graphdef if layout is None else layout.graphdef(graphdef)
        self.placement = placement if layout is None else layout.placement
        self._structure = jax.tree.structure(params)
        self.params = self._reshard(params)
        self.sampling = sampling
        self.model_eos_ids = model_eos_ids(model.config)

    def update_weights(self, params: nnx.State, version: int | None = None) -> None:
        """Installs new parameters (same structure and shapes; e.g. after a learner step),
        resharded into the sampler's layout when it has one of its own. ``version`` (the
        engine's per-token stamp) is not kept: every row of a call is sampled by one version."""
        if jax.tree.structure(params) != self._structure:
            raise ValueError("update_weights: the new parameter tree has another structure")
        self.params = self._reshard(params)

    def generate(self, prompts: Sequence[Sequence[int]], key: jax.Array,
                 sampling: SamplingConfig | None = None) -> GenerationResult:
        """Samples ``group_size`` completions for each prompt (token-id lists of any lengths)."""
        cfg = sampling or self.sampling
        ids, pos, mask = left_pad(prompts, cfg.prompt_bucket, cfg.pad_id)
        if cfg.eos_ids is None:   # the model's own EOS
            cfg = dataclasses.replace(cfg, eos_ids=self.model_eos_ids)
        knobs = SamplingKnobs.from_config(cfg)
        if self.placement is None:
            return _rollout(self.graphdef, cfg.max_new_tokens, cfg.group_size, None, self.params,
                            knobs, *map(jnp.asarray, (ids, pos, mask)), key)
        inputs = self.placement.place_batch((ids, pos, mask))
        knobs, key = self.placement.replicate((knobs, key))
        with self.placement.context():
            return _rollout(self.graphdef, cfg.max_new_tokens, cfg.group_size, self.placement,
                            self.params, knobs, *inputs, key)
