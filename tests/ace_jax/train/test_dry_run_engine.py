"""The engine's decode call compiled for a TPU chip as the engine makes it, and the pool copies
read from its HLO (issue 49)."""
import re

import pytest

from ace_jax.runtime import generate, tpu_compile
from ace_jax.runtime.engine_config import EngineConfig
from ace_jax.train import dry_run_engine
from models import configs

pytestmark = pytest.mark.skipif(not tpu_compile.libtpu_available(),
                                reason="libtpu (XLA's TPU compiler) is not installed")


def _compiled(which: str, kv_heads: int, **engine):
    """The engine's ``which`` call at ``kv_heads`` KV heads of d = 128 on one v5p chip."""
    mc = configs.tiny_moe(hidden_size=256, num_attention_heads=2 * kv_heads,
                          num_key_value_heads=kv_heads, head_dim=128, num_hidden_layers=2,
                          vocab_size=512, dtype="bfloat16")
    config = EngineConfig(slots=8, page_size=128, max_context=1024, **engine)
    sampling = generate.SamplingConfig(max_new_tokens=64, eos_ids=(1,), pad_id=0)
    program, state = dry_run_engine.engine_call(
        which, mc, config, sampling, tpu_compile.topology_devices("v5p:2x2x1")[0])
    assert program.ok, program.error
    return program, state


@pytest.fixture(scope="module")
def decode_call():
    """The engine's decode call at one KV head of d = 128 (the pod's per chip) on v5p."""
    return _compiled("decode", 1, sync_every=4)


def test_the_decode_call_reads_the_pool_in_place_through_the_kernel(decode_call):
    """Issue 49 item 1: the call runs the paged decode kernel (the TPU path), holds no copy of a
    pool-sized buffer (entry, exit or per layer), and every layout it gives the pool tiles
    without padding: one KV head costs its dense bytes."""
    program, state = decode_call
    assert "paged_decode_attention" in program.hlo
    assert dry_run_engine.pool_copies(program, state) == []
    pool = state.pools[0][0]
    layouts = dry_run_engine.layouts(program.hlo, pool)
    assert layouts and all(x.startswith("bf16[" + ",".join(map(str, pool.shape)) + "]{")
                           for x in layouts)
    assert set(layouts.values()) == {pool.size * 2}, layouts


def test_the_prefill_call_writes_the_pool_in_place_at_several_kv_heads():
    """The prefill chunk's write at 2 KV heads per chip (one scatter per head) holds no
    pool-sized copy: a write of all heads at once makes the TPU compiler convert the pool to a
    heads-minor layout and back. Its attention is the paged kernel's (issue 49 item 2: a chunk
    of 512 tokens x 2 query heads per KV head, two tiles of query rows), not the page loop."""
    program, state = _compiled("prefill", 2, prefill_chunk=512)
    assert dry_run_engine.pool_copies(program, state) == []
    assert "paged_decode_attention" in program.hlo
    with pytest.raises(ValueError, match="engine call"):
        dry_run_engine.engine_call("score", None, None, None, None)


def test_pool_copies_are_every_copy_of_a_pool_sized_array_in_the_compiled_call(decode_call):
    """Every copy whose result has the pool's dims, found by a plain scan of the HLO text, is
    one `pool_copies` reports, and none else, but for memory-space assignment's moves to and
    from on-chip memory (``S(1)``); those inside the decode scan are marked so."""
    program, state = decode_call
    pool = state.pools[0][0]
    dims = "[" + ",".join(map(str, pool.shape)) + "]"
    plain = [m[1] for m in re.finditer(r"%([\w.\-]+) = \(?bf16" + re.escape(dims)
                                       + r"\{[^}]*\}[^=]* (?:copy|copy-start)\(", program.hlo)
             if "S(1)" not in m[0]]
    copies = dry_run_engine.pool_copies(program, state)
    assert sorted(c["name"] for c in copies) == sorted(plain)
    assert all(c["bytes"] >= pool.size * 2 for c in copies)
    scan_bodies = set(re.findall(r"body=%([\w.\-]+)", program.hlo))
    assert all(c["in_loop"] == (c["computation"] in scan_bodies) for c in copies)


def test_the_static_rollout_reads_its_cache_unpadded_and_in_place():
    """Issue 49 item 5: the static generator's rollout (prefill, then the decode loop through the
    kernel) at one KV head of d = 128 per chip lays its cache's arrays (the rows' own slots and
    the shared prompts') out without padding and copies none of them within HBM: the kernel reads
    the cache heads before slots, which one head under ``T(2,128)`` would otherwise pad to two
    (and the prompts' keys, written unpadded by the prefill, were copied into that layout)."""
    mc = configs.tiny_moe(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=128, num_hidden_layers=2, vocab_size=512, dtype="bfloat16")
    sampling = generate.SamplingConfig(max_new_tokens=256, eos_ids=(1,), pad_id=0, group_size=4)
    program, arrays = dry_run_engine.static_rollout_call(
        mc, 2, 1024, 4, sampling, tpu_compile.topology_devices("v5p:2x2x1")[0])
    assert program.ok, program.error
    assert "decode_attention" in program.hlo
    assert len(arrays) == 2   # the rows' own slots and the shared prompts
    for array in arrays:
        dense = array.size * 2
        found = dry_run_engine.layouts(program.hlo, array)
        assert found and set(found.values()) == {dense}, found
        assert tpu_compile.copies_of(program.hlo, array.shape, array.dtype) == []
