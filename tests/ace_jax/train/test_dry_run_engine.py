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


def test_pool_copies_are_every_copy_of_a_pool_sized_array_in_the_compiled_call():
    """At one KV head of d = 128 (the pod's per chip) on v5p: every copy whose result has the
    pool's dims, found by a plain scan of the HLO text, is one `pool_copies` reports, and none
    else; those inside the decode scan are marked so."""
    mc = configs.tiny_moe(hidden_size=256, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=128, num_hidden_layers=2, vocab_size=512, dtype="bfloat16")
    config = EngineConfig(slots=8, page_size=128, max_context=1024, sync_every=4)
    sampling = generate.SamplingConfig(max_new_tokens=64, eos_ids=(1,), pad_id=0)
    program, state = dry_run_engine.engine_decode_call(
        mc, config, sampling, tpu_compile.topology_devices("v5p:2x2x1")[0])
    assert program.ok, program.error
    pool = state.pools[0][0]
    dims = "[" + ",".join(map(str, pool.shape)) + "]"
    plain = [m[1] for m in re.finditer(r"%([\w.\-]+) = \(?bf16" + re.escape(dims)
                                       + r"\{[^}]*\}[^=]* (?:copy|copy-start)\(", program.hlo)]
    copies = dry_run_engine.pool_copies(program, state)
    assert sorted(c["name"] for c in copies) == sorted(plain)
    assert all(c["bytes"] >= pool.size * 2 for c in copies)
    scan_bodies = set(re.findall(r"body=%([\w.\-]+)", program.hlo))
    assert all(c["in_loop"] == (c["computation"] in scan_bodies) for c in copies)
