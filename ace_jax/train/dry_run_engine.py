"""The rollout engine's calls as `ace_jax.runtime.engine.Engine` makes them, compiled for a TPU
chip, and the copies of its KV page pool in them (issue 49); the static generator's rollout the
same way.

`engine_call` compiles `engine_programs.decode` (``sync_every`` decode steps in one scan, with
the shared prefixes' entries when the engine has some) or `engine_programs.prefill` (one chunk)
through the engine's own jit (`engine_programs.jitted`: the graphdef and the step count static,
the slots' state donated), with the arguments as the engine holds them: the default layouts its
arrays are made with, no ``read_pages`` hint (the engine passes none), and the model on the
TPU's code paths (the paged decode kernel). `pool_copies` reads the optimised HLO for copies of
a pool array (`tpu_compile.copies_of`: its dims, any layout): a layout conversion of the pool on entry or
exit, or a copy of it inside a loop (every step or layer). Each costs HBM traffic that a
kernel's declared cost leaves out, and a layout padded by its tile (one KV head under
``T(2,128)``) doubles the bytes. `static_rollout_call` compiles the static generator's rollout
(`generate._rollout`, ``engine.kind=static``) for the same reading of its cache.

    python -m ace_jax.train.dry_run_engine     # the figure at the pod's per-chip shape (JSON)
    python -m ace_jax.train.dry_run_engine --static   # and the static generator's rollout
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ace_jax.runtime import engine_programs, generate, tpu_compile
from ace_jax.runtime.engine_config import EngineConfig, empty_state
from models import configs as model_configs, qwen3


CALLS = ("decode", "prefill")


def _on_chip(mc: model_configs.ModelConfig, device: Any):
    """(the model's graphdef, its abstract params, the one-chip mesh, ``place``: a tree as
    abstract arrays on the chip) of a model of ``mc`` on the TPU's code paths (its kernels and
    cache layout, as on a pod) on ``device``."""
    mc = mc.replace(platform="tpu")
    graphdef, params = nnx.split(nnx.eval_shape(
        lambda: qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0))), nnx.Param)
    mesh = Mesh(np.array([device]), ("fsdp",))
    on_chip = NamedSharding(mesh, P())
    place = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_chip), tree)
    return graphdef, params, mesh, place


def engine_call(which: str, mc: model_configs.ModelConfig, config: EngineConfig,
                sampling: generate.SamplingConfig, device: Any
                ) -> tuple[tpu_compile.CompiledProgram, engine_programs.SlotState]:
    """(the compiled call, the engine's abstract slot state) of the engine's ``which`` program
    ("decode": ``sync_every`` steps of every slot, with ``shared_prefixes`` entries when it has
    some; "prefill": one ``prefill_chunk`` of one prompt) for an engine of ``config`` over a
    model of ``mc`` on one TPU ``device`` (an abstract one, `tpu_compile.topology_devices`): the
    pool of ``config.pool_pages`` pages, every array in its default layout, the HLO kept."""
    if which not in CALLS:
        raise ValueError(f"engine call {which!r}; valid: {list(CALLS)}")
    graphdef, params, mesh, place = _on_chip(mc, device)
    knobs = generate.SamplingKnobs.from_config(sampling)
    state = jax.eval_shape(functools.partial(empty_state, mc, config, config.pool_pages,
                                             int(knobs.stop_table.shape[1])))
    host = lambda shape: place(jax.ShapeDtypeStruct(shape, np.int32))  # noqa: E731
    prefill, _, _, decode, _, _ = engine_programs.jitted(record_routes=False)
    with jax.set_mesh(mesh):
        if which == "decode":
            layers = jax.eval_shape(functools.partial(engine_programs.layer_params, graphdef),
                                    params)
            prefix = None   # the engine passes its shared prefixes' entries when it has some
            if config.shared_prefixes:
                n = config.shared_prefixes
                prefix = qwen3.PagedPrefix(host((n, config.pages_per_row)), host((n,)),
                                           host((n, config.prefix_rows)))
            traced = decode.trace(graphdef, config.sync_every, place(params), place(layers),
                                  place(knobs), place(state), prefix)
        else:   # one row shard on one chip: one prompt per call
            traced = prefill.trace(graphdef, place(params), place(state.pools),
                                   host((1, config.prefill_chunk)), host((1, config.pages_per_row)),
                                   host((1,)), host((1,)))
        lowered = traced.lower(lowering_platforms=("tpu",))
    return tpu_compile.compile_program(lowered, keep_hlo=True), state


def static_rollout_call(mc: model_configs.ModelConfig, prompts: int, prompt_len: int,
                        group_size: int, sampling: generate.SamplingConfig, device: Any
                        ) -> tuple[tpu_compile.CompiledProgram, list[jax.ShapeDtypeStruct]]:
    """(the compiled rollout, its cache's arrays per layer group) of the static generator
    (`generate._rollout`: the prompts' prefill, then the decode loop of every row to
    ``sampling.max_new_tokens``) for ``prompts`` prompts of ``prompt_len`` tokens x
    ``group_size`` samples over a model of ``mc`` on one TPU ``device``, on the TPU's code paths
    (its cache layout, the splash and decode kernels), the HLO kept. The cache's arrays: a layer
    group's keys of the rows' own slots (with the prompts' keys shared: their new tokens), and
    of the shared prompts where the rollout shares them (values: the same shapes)."""
    graphdef, params, mesh, place = _on_chip(mc, device)
    knobs = generate.SamplingKnobs.from_config(sampling)
    m = sampling.max_new_tokens
    ids = place(jax.ShapeDtypeStruct((prompts, prompt_len), np.int32))
    mask = place(jax.ShapeDtypeStruct((prompts, prompt_len), np.bool_))
    key = jax.eval_shape(lambda: jax.random.key(0))
    rollout = jax.jit(generate._rollout, static_argnums=(0, 1, 2, 3))
    with jax.set_mesh(mesh):
        lowered = rollout.trace(graphdef, m, group_size, None, place(params), place(knobs), ids,
                                ids, mask, place(key)).lower(lowering_platforms=("tpu",))
    cache = jax.eval_shape(lambda: generate.decode_cache(mc.replace(platform="tpu"), prompts,
                                                         group_size, prompt_len, m))
    arrays = [cache.k[0]] + ([cache.prefix.k[0]] if cache.prefix is not None else [])
    return tpu_compile.compile_program(lowered, keep_hlo=True), arrays


def layouts(hlo: str, array: jax.ShapeDtypeStruct) -> dict[str, int]:
    """{layout: bytes with its padding (`tpu_compile.padded_bytes`)} of every buffer of
    ``array``'s dtype and dims in an optimised HLO text."""
    dims = "[" + ",".join(map(str, array.shape)) + "]"
    dtype = {"bfloat16": "bf16", "float32": "f32"}[array.dtype.name]
    found = set(re.findall(re.escape(dtype + dims) + r"\{[^}]*\}", hlo))
    return {x: tpu_compile.padded_bytes(x) for x in sorted(found)}


def pool_copies(program: tpu_compile.CompiledProgram, state: engine_programs.SlotState
                ) -> list[dict]:
    """The copies within HBM in ``program``'s HLO of one of ``state``'s pool arrays (its dims,
    any layout): `tpu_compile.large_copies`'s entries."""
    pool = state.pools[0][0]
    return tpu_compile.copies_of(program.hlo, pool.shape, pool.dtype)


def pod_chip_figures(topology: str = "v5p:2x2x1", layers: int = 2, kv_heads: int = 1,
                     static: bool = False, prompt_len: int = 8192) -> dict[str, Any]:
    """The engine's decode and prefill calls at ``configs/ace30b.py``'s per-chip shape: 32 slots
    (512 over 16 row shards), 4 shared prefixes of 8 rows, 1,344 pages of 128 slots per shard,
    ``kv_heads`` KV heads of d = 128 per chip (ace30b: 1, its 4 over tensor = 4),
    ``sync_every`` = 32, a prefill chunk of 1,024 tokens, bf16; a stand-in model of ``layers``
    layers (each pool array holds every layer's pages, so its bytes grow with the layers). Per
    call: its pool-sized copies (`pool_copies`), those inside a loop (every step or layer), and
    their bytes. ``static``: also the static generator's rollout (`static_rollout_call`: 4
    prompts of ``prompt_len`` tokens x 8 samples, 4,096 new tokens, the chip's share of
    ace30b's static rollout): its cache's arrays (dense bytes, and the most any layout of
    them in its HLO takes with padding), their copies within HBM (`tpu_compile.copies_of`) and,
    apart, the compiler's moves of them to and from on-chip memory (``on_chip_moves``: a
    stand-in of a few layers has a cache small enough for that)."""
    mc = model_configs.tiny_moe(hidden_size=512, num_attention_heads=4 * kv_heads,
                                num_key_value_heads=kv_heads, head_dim=128,
                                num_hidden_layers=layers, vocab_size=1024, dtype="bfloat16")
    config = EngineConfig(slots=32, page_size=128, max_context=12288, num_pages=1344,
                          prefill_chunk=1024, sync_every=32, shared_prefixes=4, prefix_rows=8)
    sampling = generate.SamplingConfig(max_new_tokens=4096, eos_ids=(1,), pad_id=0,
                                       group_size=8)
    out: dict[str, Any] = dict(topology=topology, layers=layers, kv_heads=kv_heads)
    for which in CALLS:
        program, state = engine_call(which, mc, config, sampling,
                                     tpu_compile.topology_devices(topology)[0])
        copies = pool_copies(program, state)
        pool = state.pools[0][0]
        out.update(pool_shape=list(pool.shape),
                   pool_bytes=math.prod(pool.shape) * pool.dtype.itemsize)
        out[which] = dict(engine_pool_copies=len(copies),
                          engine_pool_copies_in_loop=sum(c["in_loop"] for c in copies),
                          engine_pool_copy_bytes=sum(c["bytes"] for c in copies),
                          copies=[{k: c[k] for k in ("name", "shape", "bytes", "in_loop")}
                                  for c in copies])
    if static:
        program, arrays = static_rollout_call(mc, 4, prompt_len, 8, sampling,
                                              tpu_compile.topology_devices(topology)[0])
        dense = [math.prod(a.shape) * a.dtype.itemsize for a in arrays]
        found = [c for a in arrays
                 for c in tpu_compile.copies_of(program.hlo, a.shape, a.dtype, on_chip=True)]
        copies = [c for c in found if c["in_hbm"]]
        keys = ("name", "shape", "bytes", "in_loop")
        out["static"] = dict(
            cache_arrays=[dict(shape=list(a.shape), bytes=b,
                               padded_max=max(layouts(program.hlo, a).values(), default=b))
                          for a, b in zip(arrays, dense)],
            cache_copies=len(copies), cache_copies_in_loop=sum(c["in_loop"] for c in copies),
            copies=[{k: c[k] for k in keys} for c in copies],
            on_chip_moves=[{k: c[k] for k in keys} for c in found if not c["in_hbm"]])
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="v5p:2x2x1")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--kv_heads", type=int, default=1, help="KV heads per chip")
    ap.add_argument("--static", action="store_true",
                    help="also the static generator's rollout (engine.kind=static)")
    ap.add_argument("--prompt_len", type=int, default=8192, help="the static rollout's prompts")
    args = ap.parse_args(argv)
    print(json.dumps(pod_chip_figures(args.topology, args.layers, args.kv_heads, args.static,
                                      args.prompt_len), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
