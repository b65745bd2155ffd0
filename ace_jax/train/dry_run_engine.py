"""The paged engine's decode call as `ace_jax.runtime.engine.Engine` makes it, compiled for a TPU
chip, and the page-pool copies in it (issue 49).

`engine_decode_call` compiles `engine_programs.decode` through the engine's own jit
(`engine_programs.jitted`: ``sync_every`` decode steps in one scan, the graphdef and the step
count static, the slots' state donated), with the arguments as the engine holds them: the default
layouts the engine's arrays are made with, and no ``read_pages`` hint (the engine passes none).
`pool_copies` reads its optimised HLO for copies of a pool-sized buffer
(`tpu_compile.large_copies`): a layout conversion of the KV pool on entry or exit, or a copy of
it inside the scan (every step). Each costs HBM traffic that a kernel's declared cost leaves out,
and a layout padded by its tile (one KV head under ``T(2,128)``) doubles the bytes.

    python -m ace_jax.train.dry_run_engine     # the figure at the pod's per-chip shape (JSON)
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from typing import Any, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ace_jax.runtime import engine_programs, generate, tpu_compile
from ace_jax.runtime.engine_config import EngineConfig, empty_state
from models import configs as model_configs, qwen3


def engine_decode_call(mc: model_configs.ModelConfig, config: EngineConfig,
                       sampling: generate.SamplingConfig, device: Any
                       ) -> tuple[tpu_compile.CompiledProgram, engine_programs.SlotState]:
    """(the compiled decode call, its abstract slot state) of an engine of ``config`` over a
    model of ``mc`` on one TPU ``device`` (an abstract one, `tpu_compile.topology_devices`): the
    pool of ``config.pool_pages`` pages, every array in its default layout, the HLO kept."""
    model = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model, nnx.Param)
    knobs = generate.SamplingKnobs.from_config(sampling)
    state = jax.eval_shape(functools.partial(empty_state, mc, config, config.pool_pages,
                                             int(knobs.stop_table.shape[1])))
    layers = jax.eval_shape(functools.partial(engine_programs.layer_params, graphdef), params)
    mesh = Mesh(np.array([device]), ("fsdp",))
    on_chip = NamedSharding(mesh, P())
    place = lambda tree: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=on_chip), tree)
    decode = engine_programs.jitted(record_routes=False)[3]
    with jax.set_mesh(mesh):
        lowered = decode.trace(graphdef, config.sync_every, place(params), place(layers),
                               place(knobs), place(state), None).lower(lowering_platforms=("tpu",))
    return tpu_compile.compile_program(lowered, keep_hlo=True), state


def pool_copies(program: tpu_compile.CompiledProgram, state: engine_programs.SlotState
                ) -> list[dict]:
    """The copies in ``program``'s HLO of a buffer at least as large as one of ``state``'s pool
    arrays (dense bytes): `tpu_compile.large_copies`'s entries."""
    pool = state.pools[0][0]
    return tpu_compile.large_copies(program.hlo, math.prod(pool.shape) * pool.dtype.itemsize)


def pod_chip_figures(topology: str = "v5p:2x2x1", layers: int = 2) -> dict[str, Any]:
    """The engine's decode call at ``configs/ace30b.py``'s per-chip shape: 32 slots (512 over 16
    row shards), 1,344 pages of 128 slots per shard, 1 KV head of d = 128 per chip (4 over
    tensor = 4), ``sync_every`` = 32, bf16; a stand-in model of ``layers`` layers. Each pool
    array holds every layer's pages, so its bytes grow with the layers, and so may the copies'
    count (measured: 4 at entry and exit, and 2 per layer inside the decode scan, at 2, 4 and 8
    layers)."""
    mc = model_configs.tiny_moe(hidden_size=512, num_attention_heads=4, num_key_value_heads=1,
                                head_dim=128, num_hidden_layers=layers, vocab_size=1024,
                                dtype="bfloat16")
    config = EngineConfig(slots=32, page_size=128, max_context=12288, num_pages=1344,
                          sync_every=32)
    sampling = generate.SamplingConfig(max_new_tokens=4096, eos_ids=(1,), pad_id=0)
    program, state = engine_decode_call(mc, config, sampling,
                                        tpu_compile.topology_devices(topology)[0])
    copies = pool_copies(program, state)
    pool = state.pools[0][0]
    return dict(topology=topology, layers=layers, pool_shape=list(pool.shape),
                pool_bytes=math.prod(pool.shape) * pool.dtype.itemsize,
                engine_pool_copies=len(copies),
                engine_pool_copies_in_scan=sum(c["in_loop"] for c in copies),
                engine_pool_copy_bytes=sum(c["bytes"] for c in copies),
                copies=[{k: c[k] for k in ("name", "shape", "bytes", "in_loop")} for c in copies])


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--topology", default="v5p:2x2x1")
    ap.add_argument("--layers", type=int, default=2)
    args = ap.parse_args(argv)
    print(json.dumps(pod_chip_figures(args.topology, args.layers), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
