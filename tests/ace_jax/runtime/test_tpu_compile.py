"""`tpu_compile.compile_program`'s HBM traffic: XLA's cost analysis counts a buffer it prefetches
on chip several times; compiled with ``hbm_traffic`` each operand is counted once."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ace_jax.runtime import tpu_compile

pytestmark = pytest.mark.skipif(not tpu_compile.libtpu_available(),
                                reason="libtpu (XLA's TPU compiler) is not installed")


@pytest.mark.parametrize("topology", ["v5p:2x2x1", "v4:2x2x1", "v6e:2x2"])
def test_hbm_traffic_counts_each_weight_once(topology):
    """Four chained [32, 2048] x [2048, 4608] bf16 matmuls: the weights (75.5 MB) are read once.
    The default compile prefetches them on chip and its 'bytes accessed' counts them over 3x."""
    devices = tpu_compile.topology_devices(topology)
    sh = NamedSharding(Mesh(np.array(devices[:1]), ("x",)), P())
    x = jax.ShapeDtypeStruct((32, 2048), jnp.bfloat16, sharding=sh)
    ws = [jax.ShapeDtypeStruct((2048, 4608), jnp.bfloat16, sharding=sh) for _ in range(4)]

    def chain(x, ws):
        for w in ws:
            x = jnp.tanh(x @ w)[:, :2048]
        return x

    weights = 4 * 2048 * 4608 * 2
    activations = 4 * 32 * (2048 + 4608) * 2 * 2          # each matmul's input and output, twice
    lowered = jax.jit(chain).lower(x, ws)
    traffic = tpu_compile.compile_program(lowered, hbm_traffic=True)
    default = tpu_compile.compile_program(lowered)
    assert traffic.ok and default.ok
    assert weights <= traffic.hbm_bytes <= weights + activations, traffic.hbm_bytes
    assert traffic.flops == default.flops == pytest.approx(4 * 2 * 32 * 2048 * 4608, rel=1e-3)
    assert default.hbm_bytes > 3 * weights, default.hbm_bytes
