"""The rollout engine's configuration, and the shapes and placement of its device state.

The ``engine`` config section (`default_config`: which sampler the trainer runs, and the paged
engine's shapes), its `EngineConfig` (`engine_config`; the pages a prompt and a sample take) and
its ``kind`` (`resolve_kind`); the row shards that an engine's slots and page pool split into on
a mesh (`row_shards`); the slots' device state with no row (`empty_state`, an
`engine_programs.SlotState`) and its shardings (`state_shardings`); and `EngineCapacityError`,
what `engine.Engine.submit` raises for a request these shapes can never hold
(`EngineConfig.check_fits`). The engine (`engine.Engine`) and the dry run
(`ace_jax.train.dry_run_programs`) both build from these, so they compile the same programs.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_collections

from ace_jax.runtime import engine_programs
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

    def prompt_pages(self, p: int) -> int:
        """Pages a prompt of ``p`` tokens fills (its samples share them)."""
        return -(-p // self.page_size)

    def sample_pages(self, p: int, m: int) -> int:
        """Pages a sample owns: from its prompt's last partial page (its copy) to its budget."""
        ps = self.page_size
        return -(-(p + m) // ps) - p // ps

    def check_fits(self, p: int, m: int, shards: int, pool_pages: int) -> None:
        """Raises `EngineCapacityError` unless a request of a ``p``-token prompt and samples of
        up to ``m`` new tokens fits a row and a row shard's part of a pool of ``pool_pages``
        pages split over ``shards`` row shards (`row_shards`)."""
        if p + m > self.pages_per_row * self.page_size:
            raise EngineCapacityError(
                f"prompt of {p} + {m} new tokens exceeds engine.max_context = "
                f"{self.max_context} ({self.pages_per_row} pages of {self.page_size})")
        need = self.prompt_pages(p) + self.sample_pages(p, m)
        room = pool_pages // shards - 1
        if need > room:
            where = f" in each of its {shards} row shards" if shards > 1 else ""
            raise EngineCapacityError(
                f"a sample of this request needs {need} pages, the pool has {room}{where} "
                f"(engine.num_pages)")


KINDS = ("auto", "paged", "static")


def default_config() -> ml_collections.ConfigDict:
    """The ``engine`` config section: which sampler the trainer runs, and the paged engine's
    shapes (see `EngineConfig`)."""
    d = EngineConfig()
    c = ml_collections.ConfigDict()
    # "paged": `engine.Engine`; "static": `generate.Generator` (one batch, one dense
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


def engine_config(cfg: ml_collections.ConfigDict, max_context: int) -> EngineConfig:
    """The `EngineConfig` of the ``engine`` section ``cfg`` (``max_context``: used when
    ``cfg.max_context`` is 0)."""
    shapes = {f.name: cfg[f.name] for f in dataclasses.fields(EngineConfig)}
    shapes["max_context"] = cfg.max_context or max_context
    return EngineConfig(**shapes)


def row_shards(placement, config: EngineConfig, kv_heads: int) -> tuple[int, int]:
    """(row shards, pool pages) of an engine on ``placement`` (None: one device): the slots
    split over the mesh axes that `models.attention._page_shards` splits the paged ops' rows
    over, and the pool with them (``num_pages`` 0: room for every slot of a shard plus one
    prompt, in every shard). ValueError naming the knob that does not split."""
    if placement is None:
        return 1, config.pool_pages
    from models import kernel_mesh  # local: only a sharded engine needs it

    axes, _, k = kernel_mesh.row_split(placement.mesh, config.slots, kv_heads)
    if config.shared_prefixes % k:
        raise ValueError(f"engine.shared_prefixes = {config.shared_prefixes} does not split over "
                         f"the {k} row shards of mesh axes {axes}: make it a multiple of {k}")
    if not config.num_pages:
        return k, k * (1 + (config.slots // k + 1) * config.pages_per_row)
    if config.num_pages % k:
        raise ValueError(f"engine.num_pages = {config.num_pages} does not split over the {k} row "
                         f"shards of mesh axes {axes}: make it a multiple of {k}")
    return k, config.num_pages


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

    rows, heads, _ = kernel_mesh.row_split(mesh, state.done.shape[0], mc.num_key_value_heads)
    P = jax.sharding.PartitionSpec
    named = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))  # noqa: E731
    pool = named(None, rows, heads)
    out = jax.tree.map(lambda _: named(rows), state)
    return out._replace(pools=jax.tree.map(lambda _: pool, state.pools))
