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
it, `Completion.versions`); ``stats``. Its callers: the trainer (`sampler.make_sampler`), the
server (`ace_jax.policy.engines.JaxEngine`) and evaluation (`ace_jax.policy.policy.JaxPolicy`).

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
the pool) is refused by `Engine.submit` with `engine_config.EngineCapacityError`.

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
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ace_jax.runtime import engine_programs, generate, multihost
from ace_jax.runtime.completions import Completion, generation_result
from ace_jax.runtime.engine_config import EngineConfig, empty_state, row_shards, state_shardings
from models import qwen3


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
        # host_gather_s: seconds the host spent gathering decode calls' results once they were
        # computed (`multihost.host_value`: across processes on a pod), summed over the calls
        self.stats = dict(decode_calls=0, decode_steps=0, prefill_calls=0, tokens=0,
                          peak_pages=0, host_gather_s=0.0)
        (self._prefill, self._admit, self._retire, self._decode, self._slice_layers,
         self._pack) = engine_programs.jitted(self.record_routes)
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

        Raises `engine_config.EngineCapacityError` when the request can never fit the
        engine's shapes (`EngineConfig.check_fits`)."""
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
        cfg.check_fits(len(prompt), max(budgets), self._shards, self._pool_pages)
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
        jax.block_until_ready(packed)
        t0 = time.perf_counter()
        host = multihost.host_value(packed)
        routes = None if routes is None else multihost.host_value(routes)
        self.stats["host_gather_s"] += time.perf_counter() - t0
        tokens, logprobs, emitted, done, reason = engine_programs.unpack_step(host, steps)
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
        return generation_result(self.wait_for(ids), ids, len(prompts), g, m, cfg.pad_id)

    # ------------------------------------------------------------------ pages and slots
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
            p, cfg = len(req.prompt), self.config
            need = cfg.prompt_pages(p) + cfg.sample_pages(p, req.budgets[req.queue[0]])
            room = [(len(self._free_slots(k)), -k) for k in range(self._shards)
                    if k not in busy and need <= len(self._free_pages[k]) and self._free_slots(k)]
            if not room:
                break
            req.shard = -max(room)[1]
            busy.add(req.shard)
            req.prompt_pages = self._take_pages(req.shard, cfg.prompt_pages(p))
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
                need = self.config.sample_pages(p, req.budgets[sample])
                if not free or need > len(self._free_pages[shard]):
                    break
                own = self._take_pages(shard, need)
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
