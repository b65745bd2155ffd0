"""The rollout engine: a paged KV cache shared by a fixed number of decode slots, filled
continuously.

``Engine`` decodes requests (a prompt and n samples) in ``engine.slots`` rows stepped together.
Each row's keys and values live in fixed-size pages of one pool (`models.qwen3.PagedKVCache`);
a request's prompt is prefilled ONCE, in chunks of ``prefill_chunk`` tokens, into pages its n
samples share (the last, partial prompt page is copied for each sample before it writes there);
a finished row's pages go back to the pool and its slot takes the next waiting sample at once,
so no slot waits for the longest row of a batch. Every program has a fixed shape (slots, page
size, pool, prefill chunk, pages per row), so a run compiles each once, whatever its prompts.

Public surface: ``submit`` (a prompt, n samples, a key, budgets, a temperature) -> request id;
``step`` (admit, decode ``sync_every`` steps) -> the `Completion`s that finished; ``drain``;
``progress`` (the tokens of a request's running samples so far, for streaming); ``snapshot``
(a request's running samples as unfinished `Completion`s: to checkpoint them); ``cancel`` (a
request or one sample: its slot and pages freed at once); ``generate`` (`Generator.generate`'s
contract; it waits for its own requests only: others keep decoding, and their completions
come out of the next ``step``); ``update_weights`` (new parameters and their policy version:
running samples go on decoding under them, each token stamped with the version that sampled
it, `Completion.versions`); ``stats``. Its callers: the trainer (`make_sampler`), the server
(`ace_jax.policy.engines.JaxEngine`) and evaluation (`ace_jax.policy.policy.JaxPolicy`).

Programs (``engine_programs``, jitted once per engine): ``prefill`` (one prompt chunk into its
pages, the logits of its last real token), ``admit`` (waiting samples into free slots: page
table, budget, key, first logits; the partial prompt page copied), ``decode`` (``sync_every``
decode steps of all slots: sample, check EOS / stop / budget, forward), ``retire`` (cancelled
rows marked done).
The host admits and collects between ``decode`` calls (one device round trip per
``sync_every`` tokens).

Sampling follows `generate`'s per-row rule: sample g of a request with key k draws step t with
``fold_in(fold_in(k, g), t)``; `Engine.generate` gives prompt b the key ``fold_in(key, b)``,
so its rows draw exactly what ``generate.Generator.generate(prompts, key)`` draws (tokens equal
up to the rounding of the two attention paths; greedy equal token for token in the tests).

Pages: page 0 is never handed out (slots without a row point at it); a sample reserves the pages
its prompt and full budget need when it is admitted (no preemption, no mid-run failure); a
request that could never fit (context longer than ``pages_per_row`` pages, or more pages than
the pool) is refused by `Engine.submit` with `EngineCapacityError`.

Sharded (``placement`` with a mesh of several devices, or a sampler ``layout`` of its own): the
slots, the pool's pages and the prefix entries split into R row shards over the mesh's batch
axes, as the paged ops split them (`models.attention._page_shards`); each shard keeps its own
free list (page ids in the tables are the shard's own), a request's prompt pages and samples
stay in one shard, and the prefill runs one prompt per shard (R rows) per call. One device:
R = 1. In a sampler layout of its own (ace30b's: experts kept in place over 'expert', dense
weights replicated, bf16) the weights are resharded into it by `update_weights`.

Cascade decode (``engine.shared_prefixes`` > 0): a request's full prompt pages become an entry
of `qwen3.PagedPrefix` while it runs, and a decode step reads them once for all its running
samples (up to ``prefix_rows``), then each row's own pages, merged by log-sum-exp. Off by
default: on XLA:CPU the second page loop costs more than it saves; on TPU the per-row kernel
would read a long prompt once per sample (docs/tpu.md).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from ace_jax.runtime import engine_programs, generate, multihost
from models import qwen3


class EngineCapacityError(ValueError):
    """A request that the engine's fixed shapes can never hold; the message names the knob."""


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's fixed shapes (each change compiles the programs again).

    Attributes:
      slots: rows decoded together (a decode step runs all of them).
      page_size: token slots per page.
      max_context: prompt + completion tokens one row can hold (rounded up to whole pages).
      num_pages: pages in the pool (page 0 is reserved); 0 = room for every slot at
        ``max_context`` plus one prompt (no admission ever waits for pages).
      prefill_chunk: prompt tokens per prefill call.
      sync_every: decode steps per host round trip (finished rows idle until the next one).
      shared_prefixes: prompts whose full pages a decode step reads once for all their
        running samples (cascade attention, `qwen3.PagedPrefix`); 0 = off (every row reads its
        whole table, the prompt's pages once per sample). A request that finds no free entry,
        and the samples of a request past ``prefix_rows``, read their whole tables.
      prefix_rows: running samples per shared prefix.
    """

    slots: int = 8
    page_size: int = 16
    max_context: int = 1024
    num_pages: int = 0
    prefill_chunk: int = 128
    sync_every: int = 8
    shared_prefixes: int = 0
    prefix_rows: int = 8

    def __post_init__(self):
        for name in ("slots", "page_size", "max_context", "prefill_chunk", "sync_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("num_pages", "shared_prefixes"):
            if getattr(self, name) < 0:
                raise ValueError(f"engine.{name} must be >= 0, got {getattr(self, name)}")
        if self.prefix_rows < 1:
            raise ValueError(f"engine.prefix_rows must be >= 1, got {self.prefix_rows}")

    @property
    def pages_per_row(self) -> int:
        return -(-self.max_context // self.page_size)

    @property
    def pool_pages(self) -> int:
        """Pages in the pool, page 0 included."""
        return self.num_pages or 1 + (self.slots + 1) * self.pages_per_row


KINDS = ("auto", "paged", "static")


def default_config() -> ml_collections.ConfigDict:
    """The ``engine`` config section: which sampler the trainer runs, and the paged engine's
    shapes (see `EngineConfig`)."""
    d = EngineConfig()
    c = ml_collections.ConfigDict()
    # "paged": this module's `Engine`; "static": `generate.Generator` (one batch, one dense
    # cache). Both run sharded, in the learner's or the sampler's own layout (the engine's
    # slots and pages split per row shard). "auto": paged on one device, else static (the
    # sharded engine has not run on a pod yet).
    c.kind = "auto"
    c.slots = d.slots
    c.page_size = d.page_size
    c.max_context = 0                 # 0: rl.max_prompt_tokens + sampling.max_new_tokens
    c.num_pages = d.num_pages         # 0: every slot at max_context, plus one prompt
    c.prefill_chunk = d.prefill_chunk
    c.sync_every = d.sync_every
    c.shared_prefixes = d.shared_prefixes   # prompts read once per step for all their samples
    c.prefix_rows = d.prefix_rows
    # Keep the MoE routing record (uint8 [tokens, L_moe, k] per sample) for the
    # offpolicy/router_* metrics; R3 (grpo.routing_replay) keeps it whatever this says.
    c.record_routes = False
    return c


def resolve_kind(kind: str, num_devices: int) -> str:
    """"paged" or "static" for ``engine.kind`` on a mesh of ``num_devices`` ("auto": paged on
    one device; on several the static generator, until the sharded engine has run on a pod);
    ValueError for an unknown kind."""
    if kind not in KINDS:
        raise ValueError(f"engine.kind must be one of {list(KINDS)}, got {kind!r}")
    if kind == "auto":
        return "paged" if num_devices == 1 else "static"
    return kind


def row_shards(placement, config: EngineConfig, kv_heads: int) -> tuple[int, int]:
    """(row shards, pool pages) of an engine on ``placement`` (None: one device): the slots
    split over the mesh axes that `models.attention._page_shards` splits the paged ops' rows
    over, and the pool with them (``num_pages`` 0: room for every slot of a shard plus one
    prompt, in every shard). ValueError naming the knob that does not split."""
    if placement is None:
        return 1, config.pool_pages
    from models import kernel_mesh  # local: only a sharded engine needs it

    axes, _ = kernel_mesh.mesh_specs(placement.mesh, config.slots, kv_heads)
    k = math.prod(placement.mesh.shape[a] for a in axes or ())
    if config.shared_prefixes % k:
        raise ValueError(f"engine.shared_prefixes = {config.shared_prefixes} does not split over "
                         f"the {k} row shards of mesh axes {axes}: make it a multiple of {k}")
    if not config.num_pages:
        return k, k * (1 + (config.slots // k + 1) * config.pages_per_row)
    if config.num_pages % k:
        raise ValueError(f"engine.num_pages = {config.num_pages} does not split over the {k} row "
                         f"shards of mesh axes {axes}: make it a multiple of {k}")
    return k, config.num_pages


def make_sampler(model: nnx.Module, sampling: generate.SamplingConfig,
                 cfg: ml_collections.ConfigDict, *, max_context: int, placement=None, layout=None,
                 record_routes: bool = False):
    """The trainer's sampler for the ``engine`` section ``cfg``: an `Engine`, or a
    `generate.Generator` (see `default_config`). Both have ``generate(prompts, key)`` and
    ``update_weights(params, version)``. ``max_context``: used when ``cfg.max_context`` is 0;
    ``record_routes``: the engine keeps the MoE routing record (also when
    ``cfg.record_routes``)."""
    devices = 1 if placement is None else placement.mesh.size
    if resolve_kind(cfg.kind, devices) == "static":
        return generate.Generator(model, sampling, placement=placement, layout=layout)
    return Engine(model, sampling, engine_config(cfg, max_context), placement=placement,
                  layout=layout, record_routes=record_routes or bool(cfg.record_routes))


def engine_config(cfg: ml_collections.ConfigDict, max_context: int) -> EngineConfig:
    """The `EngineConfig` of the ``engine`` section ``cfg`` (``max_context``: used when
    ``cfg.max_context`` is 0)."""
    shapes = {f.name: cfg[f.name] for f in dataclasses.fields(EngineConfig)}
    shapes["max_context"] = cfg.max_context or max_context
    return EngineConfig(**shapes)


def empty_state(mc, config: EngineConfig, pool_pages: int, window: int
                ) -> engine_programs.SlotState:
    """The device state of ``config.slots`` slots with no row, for a model of ``mc``: a pool of
    ``pool_pages`` pages, stop-sequence windows of ``window`` tokens."""
    s = config.slots
    cache = qwen3.init_paged_cache(mc, s, num_pages=pool_pages, page_size=config.page_size,
                                   pages_per_row=config.pages_per_row)
    return engine_programs.SlotState(
        pools=(cache.k, cache.v), page_table=cache.page_table, lengths=cache.lengths,
        logits=jnp.zeros((s, mc.vocab_size), jnp.float32),
        keys=jax.random.split(jax.random.key(0), s), produced=jnp.zeros((s,), jnp.int32),
        budget=jnp.zeros((s,), jnp.int32), done=jnp.ones((s,), bool),
        reason=jnp.zeros((s,), jnp.int32), window=jnp.full((s, window), -2, jnp.int32),
        temperature=jnp.zeros((s,), jnp.float32))


def state_shardings(mesh, mc, state: engine_programs.SlotState) -> engine_programs.SlotState:
    """The shardings of the slots' device state ``state`` (arrays or abstract) on ``mesh``,
    split as the paged ops split it: the pools' pages and the per-slot arrays over the row
    shards' mesh axes, the pools' KV heads over 'tensor'."""
    from models import kernel_mesh  # local: only a sharded engine needs it

    rows, heads = kernel_mesh.mesh_specs(mesh, state.done.shape[0], mc.num_key_value_heads)
    P = jax.sharding.PartitionSpec
    named = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))  # noqa: E731
    pool = named(None, rows, None, heads)
    out = jax.tree.map(lambda _: named(rows), state)
    return out._replace(pools=jax.tree.map(lambda _: pool, state.pools))


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


NO_ROUTE = engine_programs.NO_ROUTE
"""The uint8 routing record's "no record" id (`Completion.routes`; the model keeps its own
router's choice for such a token)."""


class Completion(NamedTuple):
    """One finished sample: ``tokens`` / ``logprobs`` (behaviour log-probs, float32) of its
    ``len(tokens)`` generated tokens (EOS / stop tokens included), ``finish_reason`` a
    `generate.FinishReason` (None for a sample still running, `Engine.snapshot`). With
    ``record_routes`` and an MoE policy, the routing record (R3): ``routes`` uint8
    [len(tokens), L_moe, k], the experts each MoE layer sent each generated token to (the last
    token included: it is forwarded in the step that samples it), and ``prompt_routes`` uint8
    [len(prompt), L_moe, k], the prompt's (shared by the request's samples); None otherwise.
    ``versions`` int32 [len(tokens)]: the policy version (`Engine.update_weights`) whose
    parameters sampled each token."""

    request: int
    sample: int
    tokens: list[int]
    logprobs: np.ndarray
    finish_reason: int | None
    routes: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None
    versions: np.ndarray | None = None


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    key: jax.Array
    budgets: list[int]            # max new tokens of each sample
    temperature: float
    queue: collections.deque      # samples not admitted yet, in order
    prompt_pages: list[int] | None = None
    logits: jax.Array | None = None   # float32 [V] after the prefill
    live: int = 0                 # samples in a slot
    prompt_routes: np.ndarray | None = None   # uint8 [P, L_moe, k] (MoE policies)
    prefix: int | None = None     # its entry of the shared prefixes, if it has one
    shard: int | None = None      # the row shard holding its prompt pages and samples


class Engine:
    """Continuous-batching generation over a paged KV cache (see the module docstring).

    Example:
      engine = Engine(model, SamplingConfig(max_new_tokens=64), EngineConfig(slots=8))
      rid = engine.submit([5, 6, 7], n=4, key=jax.random.key(0))
      for c in engine.drain():          # Completions, as they finish
          print(c.request, c.sample, c.tokens)
      out = engine.generate(prompts, key)   # GenerationResult, as Generator.generate
    """

    def __init__(self, model: nnx.Module, sampling: generate.SamplingConfig,
                 config: EngineConfig = EngineConfig(), *, placement=None, layout=None,
                 record_routes: bool = False, version: int = 0):
        """``model``: the policy (params only); ``sampling``: the knobs (``group_size`` and
        ``prompt_bucket`` are unused here); ``placement``: the mesh and rules the params are
        placed with (`ace_jax.runtime.placement.Placement`; one device when None): the slots,
        the pool's pages and the shared prefixes are split into row shards over its batch axes
        (`models.attention._page_shards`), KV heads over 'tensor'. ``layout``: a
        `ace_jax.runtime.sampler_layout.SamplerLayout` (instead of ``placement``): decode in its
        placement with its model config's code paths, the weights resharded into it (cast to
        its weight dtype) here and by every `update_weights`, as `generate.Generator` does.
        ``record_routes``: keep the MoE routing record (`Completion.routes`; R3 and the routing
        metrics need it; off, the programs neither compute nor gather it). ``version``: the
        policy version of ``model``'s parameters (stamped on the tokens they sample)."""
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError("the policy holds non-parameter state; Engine expects params only")
        if sampling.eos_ids is None:
            sampling = dataclasses.replace(sampling, eos_ids=generate.model_eos_ids(model.config))
        mc = model.config
        self._reshard = lambda p: p
        if layout is not None and not layout.shared:
            self._reshard = layout.resharder(params)
            graphdef, mc, placement = layout.graphdef(graphdef), layout.model_config, layout.placement
        elif layout is not None and placement is None:
            placement = layout.placement
        self.graphdef, self.sampling, self.config = graphdef, sampling, config
        self.params = self._reshard(params)
        self._structure = jax.tree.structure(params)
        self._knobs = generate.SamplingKnobs.from_config(sampling)
        self.placement = placement if placement is not None and placement.mesh.size > 1 else None
        self._shards, self._pool_pages = row_shards(self.placement, config, mc.num_key_value_heads)
        s = config.slots
        empty = functools.partial(empty_state, mc, config, self._pool_pages,
                                  int(self._knobs.stop_table.shape[1]))
        # made where it lives (each process its own shards of a multi-host mesh)
        self._state = (empty() if self.placement is None else jax.jit(empty, out_shardings=(
            state_shardings(self.placement.mesh, mc, jax.eval_shape(empty))))())
        # per row shard: its pages (ids local to the shard; page 0 of each reserved), slots
        # [k * S / R, (k + 1) * S / R) and prefix entries likewise
        per = self._pool_pages // self._shards
        self._free_pages = [list(range(per - 1, 0, -1)) for _ in range(self._shards)]
        self._page_refs: dict[tuple[int, int], int] = {}
        self._requests: dict[int, _Request] = {}
        self._waiting: collections.deque[int] = collections.deque()
        self._slot_owner: list[tuple[int, int] | None] = [None] * s
        self._slot_pages: list[list[int]] = [[] for _ in range(s)]
        self._slot_tokens: list[list[int]] = [[] for _ in range(s)]
        self._slot_logprobs: list[list[float]] = [[] for _ in range(s)]
        self._slot_routes: list[list[np.ndarray]] = [[] for _ in range(s)]
        self._slot_versions: list[list[int]] = [[] for _ in range(s)]
        self.version = int(version)
        self.record_routes = bool(record_routes)
        if self.record_routes and mc.num_moe_layers:   # expert ids must fit the uint8 record
            engine_programs.check_route_record(mc.num_experts)
        # completions of other requests that a `generate` call's steps finished: the next
        # `step` returns them first
        self._unclaimed: list[Completion] = []
        # the shared prefixes (host copies, sent with each decode call): entry e's pages, slots
        # and rows (`qwen3.PagedPrefix`); a slot's (entry, position) in them
        pn = config.shared_prefixes
        self._prefix = qwen3.PagedPrefix(np.zeros((pn, config.pages_per_row), np.int32),
                                         np.zeros((pn,), np.int32),
                                         np.full((pn, config.prefix_rows), -1, np.int32))
        epr = pn // self._shards
        self._free_prefixes = [list(range((k + 1) * epr - 1, k * epr - 1, -1))
                               for k in range(self._shards)]
        self._slot_prefix: list[tuple[int, int] | None] = [None] * s
        self._next_id = 0
        self.stats = dict(decode_calls=0, decode_steps=0, prefill_calls=0, tokens=0,
                          peak_pages=0)
        self._prefill = jax.jit(functools.partial(engine_programs.prefill,
                                                  record_routes=self.record_routes),
                                static_argnums=(0,), donate_argnums=(2,))
        self._admit = jax.jit(engine_programs.admit, donate_argnums=(0,))
        self._retire = jax.jit(engine_programs.retire, donate_argnums=(0,))
        self._decode = jax.jit(functools.partial(engine_programs.decode,
                                                 record_routes=self.record_routes),
                               static_argnums=(0, 1), donate_argnums=(5,))
        self._slice_layers = jax.jit(engine_programs.layer_params, static_argnums=(0,))
        self._pack = jax.jit(pack_step)
        self._layers = self._sliced_layers()

    # ------------------------------------------------------------------ public surface
    def update_weights(self, params: nnx.State, version: int | None = None) -> None:
        """Installs new parameters (same structure; e.g. after a learner step), resharded
        into the sampler's layout when it has one of its own; ``version``: their policy version
        (default: the current one + 1). Samples in slots keep their pages (keys and values
        written by the older parameters) and decode on under the new ones; every token records
        the version that sampled it (`Completion.versions`)."""
        if jax.tree.structure(params) != self._structure:
            raise ValueError("update_weights: the new parameter tree has another structure")
        self.params = self._reshard(params)
        self._layers = self._sliced_layers()
        self.version = self.version + 1 if version is None else int(version)

    def submit(self, prompt: Sequence[int], *, n: int = 1, key: jax.Array,
               max_new_tokens: int | Sequence[int] | None = None,
               temperature: float | None = None) -> int:
        """Queues ``n`` samples of ``prompt`` (token ids); sample g draws with
        ``fold_in(key, g)`` (see the module docstring) at ``temperature`` (0 = greedy; default
        the sampling config's) and generates at most ``max_new_tokens`` (one for all, or one
        per sample; default the sampling config's). Returns the request id.

        Raises EngineCapacityError when the request can never fit the engine's shapes."""
        prompt = [int(t) for t in prompt]
        if max_new_tokens is None:
            max_new_tokens = self.sampling.max_new_tokens
        budgets = ([int(max_new_tokens)] * n if np.ndim(max_new_tokens) == 0
                   else [int(x) for x in max_new_tokens])
        cfg = self.config
        if not prompt:
            raise ValueError("submit: the prompt needs at least one token")
        if n < 1 or len(budgets) != n or min(budgets) < 1:
            raise ValueError(f"submit: n >= 1 samples with max_new_tokens >= 1 each, got n={n} "
                             f"and {max_new_tokens}")
        temperature = self.sampling.temperature if temperature is None else float(temperature)
        if not temperature >= 0.0:
            raise ValueError(f"submit: temperature must be >= 0, got {temperature}")
        m = max(budgets)
        if len(prompt) + m > cfg.pages_per_row * cfg.page_size:
            raise EngineCapacityError(
                f"prompt of {len(prompt)} + {m} new tokens exceeds engine.max_context = "
                f"{cfg.max_context} ({cfg.pages_per_row} pages of {cfg.page_size})")
        need = self._prompt_pages(len(prompt)) + self._sample_pages(len(prompt), m)
        room = self._pool_pages // self._shards - 1
        if need > room:
            where = f" in each of its {self._shards} row shards" if self._shards > 1 else ""
            raise EngineCapacityError(
                f"a sample of this request needs {need} pages, the pool has {room}{where} "
                f"(engine.num_pages)")
        if not jax.dtypes.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)     # a raw uint32 key (jax.random.PRNGKey)
        key = self._put(key)
        rid = self._next_id
        self._next_id += 1
        self._requests[rid] = _Request(prompt, key, budgets, temperature,
                                       collections.deque(range(int(n))))
        self._waiting.append(rid)
        return rid

    def snapshot(self, request: int) -> list[Completion]:
        """The samples of ``request`` now in a slot, as unfinished `Completion`s (finish_reason
        None): their tokens, behaviour log-probs, versions and routes so far (as of the last
        `step`); what a checkpoint keeps of a sample in flight."""
        req = self._requests.get(request)
        if req is None:
            return []
        return [self._completion(slot, None, req.prompt_routes)
                for slot, owner in enumerate(self._slot_owner)
                if owner is not None and owner[0] == request]

    def first_versions(self, request: int) -> dict[int, int]:
        """{sample: the policy version of its first token} of the samples of ``request`` in a
        slot that have one (their oldest token: a sample's versions never decrease)."""
        return {owner[1]: self._slot_versions[slot][0]
                for slot, owner in enumerate(self._slot_owner)
                if owner is not None and owner[0] == request and self._slot_versions[slot]}

    def finished(self) -> list[Completion]:
        """The completions a `generate` call finished for other requests since the last
        `step` (which would return them first); taken, they are not returned again."""
        out, self._unclaimed = self._unclaimed, []
        return out

    @property
    def busy(self) -> bool:
        """Whether any sample is waiting or running."""
        return bool(self._waiting) or any(o is not None for o in self._slot_owner)

    def progress(self, request: int) -> dict[int, list[int]]:
        """The tokens generated so far by each sample of ``request`` now in a slot (as of the
        last `step`); samples not admitted yet, finished or cancelled are not listed."""
        return {owner[1]: list(self._slot_tokens[slot])
                for slot, owner in enumerate(self._slot_owner)
                if owner is not None and owner[0] == request}

    def cancel(self, request: int, sample: int | None = None) -> None:
        """Ends sample ``sample`` of ``request`` (every sample when None) without a
        `Completion`: a waiting sample is dropped, a running one frees its slot and pages now.
        Unknown or finished requests and samples are ignored (it may have just finished)."""
        req = self._requests.get(request)
        if req is None:
            return
        hit = (lambda g: True) if sample is None else (lambda g: g == sample)  # noqa: E731
        req.queue = collections.deque(g for g in req.queue if not hit(g))
        if not req.queue and request in self._waiting:
            self._waiting.remove(request)
        slots = np.zeros((self.config.slots,), bool)
        for slot, owner in enumerate(self._slot_owner):
            if owner is not None and owner[0] == request and hit(owner[1]):
                slots[slot] = True
                self._free_slot(slot)
        if slots.any():
            with self._context():
                self._state = self._retire(self._state, self._put(slots))
        self._forget_if_done(request)

    def step(self) -> list[Completion]:
        """Admits waiting samples into free slots, decodes ``sync_every`` steps, and returns
        the samples that finished (first those a `generate` call finished for others)."""
        finished = self.finished()
        self._admit_waiting()
        if all(o is None for o in self._slot_owner):
            if self._waiting:
                raise RuntimeError("the engine cannot admit its next request with every slot free "
                                   "(a bug: submit checks that each request fits)")
            return finished
        steps = self.config.sync_every
        prefix = self._put(self._prefix) if self.config.shared_prefixes else None
        with self._context():
            self._state, tokens, logprobs, emitted, routes = self._decode(
                self.graphdef, steps, self.params, self._layers, self._knobs, self._state, prefix)
        self.stats["decode_calls"] += 1
        self.stats["decode_steps"] += steps
        with self._context():
            packed = self._pack(tokens, logprobs, emitted, self._state.done, self._state.reason)
        # the host's share of the call: S x (3 x steps + 2) int32 (ace30b: 512 x 98 x 4 B =
        # 200 kB), and the routes only when recorded (S x steps x L_moe x k bytes)
        self._bind_waiting()     # host work (and prefills) for what waits, while it decodes
        tokens, logprobs, emitted, done, reason = unpack_step(multihost.host_value(packed), steps)
        routes = None if routes is None else multihost.host_value(routes)
        self.stats["tokens"] += int(emitted.sum())
        for slot, owner in enumerate(self._slot_owner):
            if owner is None:
                continue
            keep = emitted[slot]
            self._slot_tokens[slot].extend(tokens[slot][keep].tolist())
            self._slot_logprobs[slot].extend(logprobs[slot][keep].tolist())
            self._slot_versions[slot].extend([self.version] * int(keep.sum()))
            if routes is not None:
                self._slot_routes[slot].append(routes[slot][keep])
            if done[slot]:
                finished.append(self._release(slot, int(reason[slot])))
        return finished

    def drain(self) -> list[Completion]:
        """Steps until every submitted sample has finished; returns them in finishing order."""
        out = []
        while self.busy or self._unclaimed:
            out.extend(self.step())
        return out

    def wait_for(self, requests) -> list[Completion]:
        """Steps until every sample of ``requests`` (ids) has finished; returns theirs in
        finishing order. Other requests decode alongside; their completions are kept for the
        next `step`."""
        want, out = set(requests), []
        while any(r in self._requests for r in want) or any(
                c.request in want for c in self._unclaimed):
            for c in self.step():
                (out if c.request in want else self._unclaimed).append(c)
        return out

    def generate(self, prompts: Sequence[Sequence[int]], key: jax.Array,
                 sampling: generate.SamplingConfig | None = None) -> generate.GenerationResult:
        """`generate.Generator.generate` on this engine: ``group_size`` samples of each prompt,
        rows prompt-major, the same per-row keys (prompt b: ``fold_in(key, b)``); the arrays of
        the result are host (numpy) arrays."""
        cfg = sampling or self.sampling
        if cfg.eos_ids is None:
            cfg = dataclasses.replace(cfg, eos_ids=self.sampling.eos_ids)
        fixed = ("eos_ids", "stop_sequences", "pad_id")   # shapes of the engine's state
        if any(getattr(cfg, f) != getattr(self.sampling, f) for f in fixed):
            raise ValueError(f"generate: {fixed} must be the engine's own (those of its "
                             f"SamplingConfig); temperature, top_k, top_p may differ")
        if not prompts:
            raise ValueError("generate() needs at least one prompt")
        if self.busy and (cfg.top_k, cfg.top_p) != (self.sampling.top_k, self.sampling.top_p):
            raise ValueError("generate: top_k / top_p apply to every slot, and other requests "
                             "are running: use the engine's own while they run")
        knobs, self._knobs = self._knobs, generate.SamplingKnobs.from_config(cfg)
        try:
            return self._generate(prompts, key, cfg)
        finally:
            self._knobs = knobs

    def _generate(self, prompts, key, cfg) -> generate.GenerationResult:
        g, m = cfg.group_size, cfg.max_new_tokens
        ids = {self.submit(p, n=g, key=jax.random.fold_in(key, b), max_new_tokens=m,
                           temperature=cfg.temperature): b
               for b, p in enumerate(prompts)}
        n = len(prompts) * g
        tokens = np.full((n, m), cfg.pad_id, np.int32)
        logprobs = np.zeros((n, m), np.float32)
        lengths = np.zeros((n,), np.int32)
        reason = np.zeros((n,), np.int32)
        routes, prompt_routes = None, [None] * len(prompts)
        versions = np.zeros((n, m), np.int32)
        for c in self.wait_for(ids):
            row = ids[c.request] * g + c.sample
            tokens[row, :len(c.tokens)] = c.tokens
            logprobs[row, :len(c.tokens)] = c.logprobs
            lengths[row], reason[row] = len(c.tokens), c.finish_reason
            versions[row, :len(c.tokens)] = c.versions
            if c.routes is not None:
                if routes is None:
                    routes = np.full((n, m) + c.routes.shape[1:], NO_ROUTE, np.uint8)
                routes[row, :len(c.tokens)] = c.routes
                prompt_routes[ids[c.request]] = c.prompt_routes
        prompt_index = np.repeat(np.arange(len(prompts), dtype=np.int32), g)
        # host arrays (as the trainer wants them): no transfer, no per-shape program
        return generate.GenerationResult(tokens, logprobs, lengths, reason, prompt_index,
                                         routes, None if routes is None else tuple(prompt_routes),
                                         versions)

    # ------------------------------------------------------------------ pages and slots
    def _prompt_pages(self, p: int) -> int:
        return -(-p // self.config.page_size)

    def _sample_pages(self, p: int, m: int) -> int:
        """Pages a sample owns: from its prompt's last partial page (its copy) to its budget."""
        ps = self.config.page_size
        return -(-(p + m) // ps) - p // ps

    def _sliced_layers(self):
        """The per-layer weights of ``self.params`` (`engine_programs.layer_params`)."""
        with self._context():
            return self._slice_layers(self.graphdef, self.params)

    def _put(self, tree):
        """Host values (numpy arrays, PRNG keys) as inputs of the engine's programs: as they are
        on one device, else replicated over the mesh: global arrays, which every process of a
        multi-host run builds from the same values (`Placement.replicate`)."""
        if self.placement is None:
            return jax.tree.map(jnp.asarray, tree)
        return self.placement.replicate(tree)

    def _context(self):
        """The mesh the programs trace under (the paged ops split per row shard under it)."""
        return contextlib.nullcontext() if self.placement is None else self.placement.context()

    def _shard_of(self, slot: int) -> int:
        return slot // (self.config.slots // self._shards)

    def _global_page(self, shard: int, page: int) -> int:
        """A shard's own page id as an index of the whole pool (`engine_programs.admit`)."""
        return shard * (self._pool_pages // self._shards) + page if page else 0

    def _take_pages(self, shard: int, k: int) -> list[int]:
        pages = [self._free_pages[shard].pop() for _ in range(k)]
        for q in pages:
            self._page_refs[shard, q] = 1
        used = self._pool_pages - self._shards - sum(map(len, self._free_pages))
        self.stats["peak_pages"] = max(self.stats["peak_pages"], used)
        return pages

    def _drop_pages(self, shard: int, pages: list[int]) -> None:
        for q in pages:
            self._page_refs[shard, q] -= 1
            if self._page_refs[shard, q] == 0:
                del self._page_refs[shard, q]
                self._free_pages[shard].append(q)

    def _free_slots(self, shard: int) -> list[int]:
        per = self.config.slots // self._shards
        return [i for i in range(shard * per, (shard + 1) * per) if self._slot_owner[i] is None]

    def _prefill_requests(self, reqs: list[_Request]) -> None:
        """Writes the prompts of ``reqs`` (at most one per row shard: row r of the prefill
        program is shard r's) into their pages, chunk by chunk; keeps each one's last logits."""
        cfg, c = self.config, self.config.prefill_chunk
        rows = np.zeros((self._shards, cfg.pages_per_row), np.int32)
        for req in reqs:
            rows[req.shard, :len(req.prompt_pages)] = req.prompt_pages
        pools = self._state.pools
        chunk_routes = {req.shard: [] for req in reqs}
        for start in range(0, max(len(req.prompt) for req in reqs), c):
            ids = np.full((self._shards, c), self.sampling.pad_id, np.int32)
            n_valid = np.zeros((self._shards,), np.int32)
            for req in reqs:
                part = req.prompt[start:start + c]
                ids[req.shard, :len(part)] = part
                n_valid[req.shard] = len(part)
            with self._context():
                pools, logits, routes = self._prefill(
                    self.graphdef, self.params, pools, *self._put(
                        (ids, rows, np.full((self._shards,), start, np.int32), n_valid)))
            self.stats["prefill_calls"] += 1
            for req in reqs:
                k = int(n_valid[req.shard])
                if k and start + k == len(req.prompt):   # its last chunk
                    req.logits = logits[req.shard]
                if k and routes is not None:
                    chunk_routes[req.shard].append((multihost.host_value(routes), k))
        self._state = self._state._replace(pools=pools)
        for req in reqs:
            if chunk_routes[req.shard]:
                req.prompt_routes = np.concatenate(
                    [r[req.shard, :k] for r, k in chunk_routes[req.shard]])

    def _bind_waiting(self) -> bool:
        """Gives waiting requests, in submission order, a row shard and their prompt pages, and
        prefills them together: a shard takes a new request when no request is partly admitted
        there and it has a free slot and the pages of the prompt and its first sample
        (the emptiest such shard). Stops at the first request that finds none (FIFO)."""
        busy = {self._requests[r].shard for r in self._waiting} - {None}
        new = []
        for rid in self._waiting:
            req = self._requests[rid]
            if req.shard is not None:
                continue
            p = len(req.prompt)
            need = self._prompt_pages(p) + self._sample_pages(p, req.budgets[req.queue[0]])
            room = [(len(self._free_slots(k)), -k) for k in range(self._shards)
                    if k not in busy and need <= len(self._free_pages[k]) and self._free_slots(k)]
            if not room:
                break
            req.shard = -max(room)[1]
            busy.add(req.shard)
            req.prompt_pages = self._take_pages(req.shard, self._prompt_pages(p))
            new.append(req)
        if new:
            self._prefill_requests(new)
        return bool(new)

    def _place_samples(self, batch: list) -> bool:
        """Puts the waiting samples of the requests that have a shard into its free slots while
        its pages last; appends (slot, rid, sample, page row, copy src, copy dst) to ``batch``."""
        ps, placed = self.config.page_size, False
        for rid in list(self._waiting):
            req = self._requests[rid]
            if req.shard is None:
                break
            p, shard = len(req.prompt), req.shard
            while req.queue:
                sample = req.queue[0]
                free = self._free_slots(shard)
                if not free or self._sample_pages(p, req.budgets[sample]) > len(self._free_pages[shard]):
                    break
                own = self._take_pages(shard, self._sample_pages(p, req.budgets[sample]))
                shared = req.prompt_pages[:p // ps]
                for q in shared:
                    self._page_refs[shard, q] += 1
                src = self._global_page(shard, req.prompt_pages[-1]) if p % ps else 0
                dst = self._global_page(shard, own[0]) if p % ps else 0
                slot = free[0]
                self._join_prefix(req, slot, shared)
                self._slot_owner[slot] = (rid, sample)
                self._slot_pages[slot] = shared + own
                self._slot_tokens[slot], self._slot_logprobs[slot] = [], []
                self._slot_routes[slot], self._slot_versions[slot] = [], []
                batch.append((slot, rid, sample, shared + own, src, dst))
                req.queue.popleft()
                req.live += 1
                placed = True
            if not req.queue:
                self._waiting.remove(rid)
        return placed

    def _admit_waiting(self) -> None:
        """Fills free slots with waiting samples, in submission order: requests get a shard
        and are prefilled (`_bind_waiting`), their samples take its slots (`_place_samples`),
        until neither moves; then one ``admit`` call puts them on the device."""
        cfg, s = self.config, self.config.slots
        batch = []   # (slot, rid, sample, page row, copy src, copy dst)
        while True:
            bound = self._bind_waiting()
            if not self._place_samples(batch) and not bound:
                break
        if not batch:
            return
        slot = np.full((s,), s, np.int32)
        rows = np.zeros((s, cfg.pages_per_row), np.int32)
        lengths = np.zeros((s,), np.int32)
        budgets = np.zeros((s,), np.int32)
        temperatures = np.zeros((s,), np.float32)
        src = np.zeros((s,), np.int32)
        dst = np.zeros((s,), np.int32)
        samples = np.zeros((s,), np.int32)
        keys, logits = [self._state.keys[0]] * s, [self._state.logits[0]] * s  # padding
        for i, (sl, rid, sample, pages, a, b) in enumerate(batch):
            req = self._requests[rid]
            slot[i], lengths[i], budgets[i], src[i], dst[i] = sl, len(req.prompt), req.budgets[sample], a, b
            temperatures[i] = req.temperature
            rows[i, :len(pages)] = pages
            samples[i], keys[i], logits[i] = sample, req.key, req.logits
        with self._context():
            slot, rows, lengths, budgets, temperatures, samples, src, dst = self._put(
                (slot, rows, lengths, budgets, temperatures, samples, src, dst))
            self._state = self._admit(self._state, slot, rows, lengths, budgets, temperatures,
                                      tuple(keys), samples, tuple(logits), src, dst)
        for sl, rid, *_ in batch:   # a fully admitted request no longer needs its logits
            req = self._requests[rid]
            if not req.queue:
                req.logits = None

    def _join_prefix(self, req: _Request, slot: int, shared: list[int]) -> None:
        """Lists ``slot`` among the rows of ``req``'s shared prefix (its full prompt pages
        ``shared``), taking a free entry for the request first; no-op when the request has no
        full prompt page, or no entry or row position is free (the row then reads its table)."""
        if not shared:
            return
        pre = self._prefix
        if req.prefix is None and self._free_prefixes[req.shard]:
            req.prefix = self._free_prefixes[req.shard].pop()
            pre.table[req.prefix, :len(shared)] = shared
            pre.lengths[req.prefix] = len(shared) * self.config.page_size
        if req.prefix is None:
            return
        spare = np.flatnonzero(pre.rows[req.prefix] < 0)
        if spare.size:   # the row's index within its shard, as its page ids
            pre.rows[req.prefix, spare[0]] = slot % (self.config.slots // self._shards)
            self._slot_prefix[slot] = (req.prefix, int(spare[0]))

    def _free_slot(self, slot: int) -> None:
        """The slot's row leaves it (host side: its pages go back, its request counts it)."""
        rid, _ = self._slot_owner[slot]
        if self._slot_prefix[slot] is not None:
            entry, position = self._slot_prefix[slot]
            self._prefix.rows[entry, position] = -1
            self._slot_prefix[slot] = None
        self._drop_pages(self._shard_of(slot), self._slot_pages[slot])
        self._slot_owner[slot], self._slot_pages[slot] = None, []
        self._requests[rid].live -= 1

    def _forget_if_done(self, rid: int) -> None:
        """Drops a request with no sample running or waiting, and its prompt pages."""
        req = self._requests[rid]
        if req.live == 0 and not req.queue:
            if req.prompt_pages is not None:
                self._drop_pages(req.shard, req.prompt_pages)
            if req.prefix is not None:   # its entry is free again
                self._prefix.table[req.prefix] = 0
                self._prefix.lengths[req.prefix] = 0
                self._free_prefixes[req.shard].append(req.prefix)
            del self._requests[rid]

    def _completion(self, slot: int, reason: int | None, prompt_routes) -> Completion:
        """The `Completion` of the sample in ``slot`` so far."""
        rid, sample = self._slot_owner[slot]
        routes = (np.concatenate(self._slot_routes[slot]) if self._slot_routes[slot] else None)
        return Completion(rid, sample, list(self._slot_tokens[slot]),
                          np.asarray(self._slot_logprobs[slot], np.float32), reason, routes,
                          prompt_routes, np.asarray(self._slot_versions[slot], np.int32))

    def _release(self, slot: int, reason: int) -> Completion:
        out = self._completion(slot, reason, self._requests[self._slot_owner[slot][0]].prompt_routes)
        self._free_slot(slot)
        self._forget_if_done(out.request)
        return out
