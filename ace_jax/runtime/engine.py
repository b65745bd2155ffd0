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
``progress`` (the tokens of a request's running samples so far, for streaming); ``cancel`` (a
request or one sample: its slot and pages freed at once); ``generate`` (`Generator.generate`'s
contract); ``update_weights``; ``stats``. Its callers: the trainer (`make_sampler`), the server
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

Cascade decode (``engine.shared_prefixes`` > 0): a request's full prompt pages become an entry
of `qwen3.PagedPrefix` while it runs, and a decode step reads them once for all its running
samples (up to ``prefix_rows``), then each row's own pages, merged by log-sum-exp. Off by
default: on XLA:CPU the second page loop costs more than it saves; on TPU the per-row kernel
would read a long prompt once per sample (docs/tpu.md).
"""
from __future__ import annotations

import collections
import dataclasses
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from ace_jax.runtime import engine_programs, generate
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
    # cache; it runs sharded, in the learner's or the sampler's own layout); "auto": paged on
    # one device in the learner's layout, else static (the paged engine does not shard yet).
    c.kind = "auto"
    c.slots = d.slots
    c.page_size = d.page_size
    c.max_context = 0                 # 0: rl.max_prompt_tokens + sampling.max_new_tokens
    c.num_pages = d.num_pages         # 0: every slot at max_context, plus one prompt
    c.prefill_chunk = d.prefill_chunk
    c.sync_every = d.sync_every
    c.shared_prefixes = d.shared_prefixes   # prompts read once per step for all their samples
    c.prefix_rows = d.prefix_rows
    return c


def resolve_kind(kind: str, num_devices: int) -> str:
    """"paged" or "static" for ``engine.kind`` on a mesh of ``num_devices``; ValueError for an
    unknown kind or "paged" on several devices."""
    if kind not in KINDS:
        raise ValueError(f"engine.kind must be one of {list(KINDS)}, got {kind!r}")
    if kind == "auto":
        return "paged" if num_devices == 1 else "static"
    if kind == "paged" and num_devices > 1:
        raise ValueError(f"engine.kind='paged' runs on one device; the mesh has {num_devices} "
                         f"(use 'static' or 'auto')")
    return kind


def make_sampler(model: nnx.Module, sampling: generate.SamplingConfig,
                 cfg: ml_collections.ConfigDict, *, max_context: int, placement=None, layout=None):
    """The trainer's sampler for the ``engine`` section ``cfg``: an `Engine`, or a
    `generate.Generator` (see `default_config`). Both have ``generate(prompts, key)`` and
    ``update_weights(params)``. ``max_context``: used when ``cfg.max_context`` is 0."""
    devices = 1 if placement is None else placement.mesh.size
    shared = layout is None or layout.shared      # decode in the learner's own layout
    kind = resolve_kind(cfg.kind, devices)
    if kind == "paged" and not shared:
        if cfg.kind == "paged":
            raise ValueError("engine.kind='paged' decodes in the learner's layout; "
                             "sampler_mesh.layout='own' needs engine.kind='static' (or 'auto')")
        kind = "static"
    if kind == "static":
        return generate.Generator(model, sampling, placement=placement, layout=layout)
    shapes = {f.name: cfg[f.name] for f in dataclasses.fields(EngineConfig)}
    shapes["max_context"] = cfg.max_context or max_context
    return Engine(model, sampling, EngineConfig(**shapes))


NO_ROUTE = 255
"""The uint8 routing record's "no record" id (`Completion.routes`; the model keeps its own
router's choice for such a token)."""


class Completion(NamedTuple):
    """One finished sample: ``tokens`` / ``logprobs`` (behaviour log-probs, float32) of its
    ``len(tokens)`` generated tokens (EOS / stop tokens included), ``finish_reason`` a
    `generate.FinishReason`. For an MoE policy, the routing record (R3): ``routes`` uint8
    [len(tokens), L_moe, k], the experts each MoE layer sent each generated token to (the last
    token included: it is forwarded in the step that samples it), and ``prompt_routes`` uint8
    [len(prompt), L_moe, k], the prompt's (shared by the request's samples); None for a dense
    policy."""

    request: int
    sample: int
    tokens: list[int]
    logprobs: np.ndarray
    finish_reason: int
    routes: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None


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
                 config: EngineConfig = EngineConfig(), *, placement=None, layout=None):
        """``model``: the policy (params only); ``sampling``: the knobs (``group_size`` and
        ``prompt_bucket`` are unused here); ``placement`` / ``layout``: as `generate.Generator`
        (single device when None)."""
        if (placement is not None and placement.mesh.size > 1) or layout is not None:
            raise NotImplementedError("the paged engine runs on one device for now; use "
                                      "generate.Generator for a sharded sampler")
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ValueError("the policy holds non-parameter state; Engine expects params only")
        if sampling.eos_ids is None:
            sampling = dataclasses.replace(sampling, eos_ids=generate.model_eos_ids(model.config))
        self.graphdef, self.params, self.sampling, self.config = graphdef, params, sampling, config
        self._structure = jax.tree.structure(params)
        self._knobs = generate.SamplingKnobs.from_config(sampling)
        mc = model.config
        cache = qwen3.init_paged_cache(mc, config.slots, num_pages=config.pool_pages,
                                       page_size=config.page_size,
                                       pages_per_row=config.pages_per_row)
        s = config.slots
        self._state = engine_programs.SlotState(
            pools=(cache.k, cache.v), page_table=cache.page_table, lengths=cache.lengths,
            logits=jnp.zeros((s, mc.vocab_size), jnp.float32),
            keys=jax.random.split(jax.random.key(0), s), produced=jnp.zeros((s,), jnp.int32),
            budget=jnp.zeros((s,), jnp.int32), done=jnp.ones((s,), bool),
            reason=jnp.zeros((s,), jnp.int32),
            window=jnp.full((s, self._knobs.stop_table.shape[1]), -2, jnp.int32),
            temperature=jnp.zeros((s,), jnp.float32))
        self._free_pages = list(range(config.pool_pages - 1, 0, -1))   # page 0 reserved
        self._page_refs: dict[int, int] = {}
        self._requests: dict[int, _Request] = {}
        self._waiting: collections.deque[int] = collections.deque()
        self._slot_owner: list[tuple[int, int] | None] = [None] * s
        self._slot_pages: list[list[int]] = [[] for _ in range(s)]
        self._slot_tokens: list[list[int]] = [[] for _ in range(s)]
        self._slot_logprobs: list[list[float]] = [[] for _ in range(s)]
        self._slot_routes: list[list[np.ndarray]] = [[] for _ in range(s)]
        # the shared prefixes (host copies, sent with each decode call): entry e's pages, slots
        # and rows (`qwen3.PagedPrefix`); a slot's (entry, position) in them
        pn = config.shared_prefixes
        self._prefix = qwen3.PagedPrefix(np.zeros((pn, config.pages_per_row), np.int32),
                                         np.zeros((pn,), np.int32),
                                         np.full((pn, config.prefix_rows), -1, np.int32))
        self._free_prefixes = list(range(pn - 1, -1, -1))
        self._slot_prefix: list[tuple[int, int] | None] = [None] * s
        self._next_id = 0
        self.stats = dict(decode_calls=0, decode_steps=0, prefill_calls=0, tokens=0,
                          peak_pages=0)
        self._prefill = jax.jit(engine_programs.prefill, static_argnums=(0,),
                                donate_argnums=(2,))
        self._admit = jax.jit(engine_programs.admit, donate_argnums=(0,))
        self._retire = jax.jit(engine_programs.retire, donate_argnums=(0,))
        self._decode = jax.jit(engine_programs.decode, static_argnums=(0, 1), donate_argnums=(4,))

    # ------------------------------------------------------------------ public surface
    def update_weights(self, params: nnx.State) -> None:
        """Installs new parameters (same structure; e.g. after a learner step)."""
        if jax.tree.structure(params) != self._structure:
            raise ValueError("update_weights: the new parameter tree has another structure")
        self.params = params

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
        if need > cfg.pool_pages - 1:
            raise EngineCapacityError(
                f"a sample of this request needs {need} pages, the pool has "
                f"{cfg.pool_pages - 1} (engine.num_pages)")
        if not jax.dtypes.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
            key = jax.random.wrap_key_data(key)     # a raw uint32 key (jax.random.PRNGKey)
        rid = self._next_id
        self._next_id += 1
        self._requests[rid] = _Request(prompt, key, budgets, temperature,
                                       collections.deque(range(int(n))))
        self._waiting.append(rid)
        return rid

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
            self._state = self._retire(self._state, jnp.asarray(slots))
        self._forget_if_done(request)

    def step(self) -> list[Completion]:
        """Admits waiting samples into free slots, decodes ``sync_every`` steps, and returns
        the samples that finished."""
        self._admit_waiting()
        if all(o is None for o in self._slot_owner):
            if self._waiting:
                raise RuntimeError("the engine cannot admit its next request with every slot free "
                                   "(a bug: submit checks that each request fits)")
            return []
        steps = self.config.sync_every
        prefix = (jax.tree.map(jnp.asarray, self._prefix) if self.config.shared_prefixes
                  else None)
        self._state, tokens, logprobs, emitted, routes = self._decode(
            self.graphdef, steps, self.params, self._knobs, self._state, prefix)
        self.stats["decode_calls"] += 1
        self.stats["decode_steps"] += steps
        tokens, logprobs, emitted, done, reason, routes = jax.device_get(
            (tokens, logprobs, emitted, self._state.done, self._state.reason, routes))
        self.stats["tokens"] += int(emitted.sum())
        finished = []
        for slot, owner in enumerate(self._slot_owner):
            if owner is None:
                continue
            keep = emitted[slot]
            self._slot_tokens[slot].extend(tokens[slot][keep].tolist())
            self._slot_logprobs[slot].extend(logprobs[slot][keep].tolist())
            if routes is not None:
                self._slot_routes[slot].append(routes[slot][keep])
            if done[slot]:
                finished.append(self._release(slot, int(reason[slot])))
        return finished

    def drain(self) -> list[Completion]:
        """Steps until every submitted sample has finished; returns them in finishing order."""
        out = []
        while self._waiting or any(o is not None for o in self._slot_owner):
            out.extend(self.step())
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
        for c in self.drain():
            row = ids[c.request] * g + c.sample
            tokens[row, :len(c.tokens)] = c.tokens
            logprobs[row, :len(c.tokens)] = c.logprobs
            lengths[row], reason[row] = len(c.tokens), c.finish_reason
            if c.routes is not None:
                if routes is None:
                    routes = np.full((n, m) + c.routes.shape[1:], NO_ROUTE, np.uint8)
                routes[row, :len(c.tokens)] = c.routes
                prompt_routes[ids[c.request]] = c.prompt_routes
        prompt_index = np.repeat(np.arange(len(prompts), dtype=np.int32), g)
        # host arrays (as the trainer wants them): no transfer, no per-shape program
        return generate.GenerationResult(tokens, logprobs, lengths, reason, prompt_index,
                                         routes, None if routes is None else tuple(prompt_routes))

    # ------------------------------------------------------------------ pages and slots
    def _prompt_pages(self, p: int) -> int:
        return -(-p // self.config.page_size)

    def _sample_pages(self, p: int, m: int) -> int:
        """Pages a sample owns: from its prompt's last partial page (its copy) to its budget."""
        ps = self.config.page_size
        return -(-(p + m) // ps) - p // ps

    def _take_pages(self, k: int) -> list[int]:
        pages = [self._free_pages.pop() for _ in range(k)]
        for q in pages:
            self._page_refs[q] = 1
        used = self.config.pool_pages - 1 - len(self._free_pages)
        self.stats["peak_pages"] = max(self.stats["peak_pages"], used)
        return pages

    def _drop_pages(self, pages: list[int]) -> None:
        for q in pages:
            self._page_refs[q] -= 1
            if self._page_refs[q] == 0:
                del self._page_refs[q]
                self._free_pages.append(q)

    def _prefill_request(self, req: _Request) -> None:
        """Writes the prompt into fresh pages, chunk by chunk; keeps its last logits."""
        cfg = self.config
        req.prompt_pages = self._take_pages(self._prompt_pages(len(req.prompt)))
        row = np.zeros((1, cfg.pages_per_row), np.int32)
        row[0, :len(req.prompt_pages)] = req.prompt_pages
        c = cfg.prefill_chunk
        pools = self._state.pools
        chunk_routes = []
        for start in range(0, len(req.prompt), c):
            part = req.prompt[start:start + c]
            ids = np.full((1, c), self.sampling.pad_id, np.int32)
            ids[0, :len(part)] = part
            pools, logits, routes = self._prefill(
                self.graphdef, self.params, pools, jnp.asarray(ids), jnp.asarray(row),
                jnp.asarray([start], jnp.int32), jnp.int32(len(part)))
            self.stats["prefill_calls"] += 1
            if routes is not None:
                chunk_routes.append((routes, len(part)))
        self._state = self._state._replace(pools=pools)
        req.logits = logits
        if chunk_routes:
            req.prompt_routes = np.concatenate([np.asarray(r)[:k] for r, k in chunk_routes])

    def _admit_waiting(self) -> None:
        """Fills free slots with waiting samples, in submission order (FIFO: at most one
        request is partly admitted, so its prompt pages are the only ones held by no slot)."""
        cfg, s = self.config, self.config.slots
        ps = cfg.page_size
        free = [i for i, o in enumerate(self._slot_owner) if o is None]
        batch = []   # (slot, rid, sample, page row, copy src, copy dst)
        while free and self._waiting:
            rid = self._waiting[0]
            req = self._requests[rid]
            sample = req.queue[0]
            p, m = len(req.prompt), req.budgets[sample]
            need = self._sample_pages(p, m)
            if req.prompt_pages is None:
                need += self._prompt_pages(p)
            if need > len(self._free_pages):
                break
            if req.prompt_pages is None:
                self._prefill_request(req)
            own = self._take_pages(self._sample_pages(p, m))
            shared = req.prompt_pages[:p // ps]
            for q in shared:
                self._page_refs[q] += 1
            src = req.prompt_pages[-1] if p % ps else 0
            dst = own[0] if p % ps else 0
            slot = free.pop(0)
            self._join_prefix(req, slot, shared)
            self._slot_owner[slot] = (rid, sample)
            self._slot_pages[slot] = shared + own
            self._slot_tokens[slot], self._slot_logprobs[slot] = [], []
            self._slot_routes[slot] = []
            batch.append((slot, rid, sample, shared + own, src, dst))
            req.queue.popleft()
            req.live += 1
            if not req.queue:
                self._waiting.popleft()
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
        self._state = self._admit(self._state, jnp.asarray(slot), jnp.asarray(rows),
                                  jnp.asarray(lengths), jnp.asarray(budgets),
                                  jnp.asarray(temperatures), tuple(keys),
                                  jnp.asarray(samples), tuple(logits), jnp.asarray(src),
                                  jnp.asarray(dst))
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
        if req.prefix is None and self._free_prefixes:
            req.prefix = self._free_prefixes.pop()
            pre.table[req.prefix, :len(shared)] = shared
            pre.lengths[req.prefix] = len(shared) * self.config.page_size
        if req.prefix is None:
            return
        spare = np.flatnonzero(pre.rows[req.prefix] < 0)
        if spare.size:
            pre.rows[req.prefix, spare[0]] = slot
            self._slot_prefix[slot] = (req.prefix, int(spare[0]))

    def _free_slot(self, slot: int) -> None:
        """The slot's row leaves it (host side: its pages go back, its request counts it)."""
        rid, _ = self._slot_owner[slot]
        if self._slot_prefix[slot] is not None:
            entry, position = self._slot_prefix[slot]
            self._prefix.rows[entry, position] = -1
            self._slot_prefix[slot] = None
        self._drop_pages(self._slot_pages[slot])
        self._slot_owner[slot], self._slot_pages[slot] = None, []
        self._requests[rid].live -= 1

    def _forget_if_done(self, rid: int) -> None:
        """Drops a request with no sample running or waiting, and its prompt pages."""
        req = self._requests[rid]
        if req.live == 0 and not req.queue:
            if req.prompt_pages is not None:
                self._drop_pages(req.prompt_pages)
            if req.prefix is not None:   # its entry is free again
                self._prefix.table[req.prefix] = 0
                self._prefix.lengths[req.prefix] = 0
                self._free_prefixes.append(req.prefix)
            del self._requests[rid]

    def _release(self, slot: int, reason: int) -> Completion:
        rid, sample = self._slot_owner[slot]
        prompt_routes = self._requests[rid].prompt_routes
        self._free_slot(slot)
        self._forget_if_done(rid)
        routes = (np.concatenate(self._slot_routes[slot]) if self._slot_routes[slot] else None)
        return Completion(rid, sample, self._slot_tokens[slot],
                          np.asarray(self._slot_logprobs[slot], np.float32), reason, routes,
                          prompt_routes)
