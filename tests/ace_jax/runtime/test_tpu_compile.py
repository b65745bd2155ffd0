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


def test_padded_bytes_round_the_two_minor_dims_up_to_the_tile():
    # one KV head (dim 3, second most minor) under T(2,128): padded to 2 heads
    assert tpu_compile.padded_bytes("bf16[2,545,128,1,128]{4,3,2,1,0:T(2,128)(2,1)}") == \
        2 * 545 * 128 * 2 * 128 * 2
    # the slots (dim 2) second most minor under T(8,128): no padding
    assert tpu_compile.padded_bytes("bf16[2,545,128,1,128]{4,2,3,1,0:T(8,128)(2,1)}") == \
        2 * 545 * 128 * 1 * 128 * 2
    assert tpu_compile.padded_bytes("f32[3,5]{1,0:T(8,128)}") == 8 * 128 * 4
    assert tpu_compile.padded_bytes("s32[16]{0:T(128)}") == 128 * 4
    assert tpu_compile.padded_bytes("f32[3,5]") == 60
    with pytest.raises(ValueError, match="not an HLO array shape"):
        tpu_compile.padded_bytes("(tuple)")


def test_large_copies_name_the_loop_body_and_skip_small_ones():
    hlo = "\n".join([
        "%body.1 (arg: (s32[], bf16[4,8,128])) -> (s32[], bf16[4,8,128]) {",
        "  %copy.5 = bf16[4,8,128]{2,0,1:T(8,128)(2,1)} copy(%dus.3), metadata={}",
        "  %copy.6 = s32[]{:T(128)} copy(%x)",
        "}",
        "ENTRY %main.9 (p: bf16[4,8,128]) -> bf16[4,8,128] {",
        "  %copy-start.2 = (bf16[4,8,128]{2,1,0:T(8,128)(2,1)}, bf16[4,8,128]{2,1,0:T(8,128)"
        "(2,1)S(1)}, u32[]{:S(2)}) copy-start(%p)",
        "  %copy-done.2 = bf16[4,8,128]{2,1,0:T(8,128)(2,1)} copy-done(%copy-start.2)",
        "  %while.1 = (s32[], bf16[4,8,128]) while(%t), condition=%cond.1, body=%body.1",
        "  ROOT %copy.7 = bf16[4,1,128]{2,1,0:T(2,128)(2,1)} copy(%q)",
        "}"])
    got = tpu_compile.large_copies(hlo, 4 * 8 * 128 * 2)
    assert [(c["name"], c["op"], c["in_loop"], c["computation"]) for c in got] == [
        ("copy.5", "copy", True, "body.1"), ("copy-start.2", "copy-start", False, "main.9")]
    # copy.5's layout puts dim 0 (4) second most minor: the T(8,128) tile pads it to 8
    assert [c["bytes"] for c in got] == [8 * 8 * 128 * 2, 4 * 8 * 128 * 2]
    # the padded 1-head copy is 2 x its dense size, still below the bound
    assert tpu_compile.large_copies(hlo, 4 * 128 * 2)[-1]["bytes"] == 4 * 2 * 128 * 2


def test_large_copies_finds_a_copy_the_tpu_compiler_made():
    """A second witness on a compiler's own HLO: swapping a pool's two minor dims compiles to a
    layout-changing copy of the whole array, which `large_copies` finds (dense bytes: no
    padding under the (128, 128) minor dims); a bound above it finds none."""
    sh = NamedSharding(Mesh(np.array(tpu_compile.topology_devices("v5p:2x2x1")[:1]), ("x",)), P())
    pool = jax.ShapeDtypeStruct((2, 64, 1, 128, 128), jnp.bfloat16, sharding=sh)
    hlo = jax.jit(lambda p: jnp.swapaxes(p, 3, 4)).lower(pool).compile().as_text()
    dense = 2 * 64 * 128 * 128 * 2
    got = tpu_compile.large_copies(hlo, dense)
    assert [(c["op"], c["bytes"], c["in_loop"]) for c in got] == [("copy", dense, False)]
    assert tpu_compile.large_copies(hlo, dense + 1) == []
    # copies_of: the copies of an array of those dims (any layout), not of another of its size
    assert [c["name"] for c in tpu_compile.copies_of(hlo, (2, 64, 1, 128, 128), jnp.bfloat16)] \
        == [got[0]["name"]]
    assert tpu_compile.copies_of(hlo, (2, 64, 128, 1, 128), jnp.bfloat16) == []


def test_collective_hops_of_a_program_the_tpu_compiler_made():
    """A second witness beside the hand-written HLO (test_dry_run.py): a sum over 4 chips of a
    v5p:2x2x1 compiles to one all-reduce of a group of 4 (2 x 4 // 2 = 4 hops); the same sum over
    a mesh axis of 1 device compiles to none."""
    devices = np.array(tpu_compile.topology_devices("v5p:2x2x1"))
    for n, want in ((4, dict(ops=1, hops=4, by_group={"all-reduce x4": [1, 4]})),
                    (1, dict(ops=0, hops=0, by_group={}))):
        mesh = Mesh(devices[:n], ("x",))
        x = jax.ShapeDtypeStruct((n * 8, 128), jnp.float32, sharding=NamedSharding(mesh, P("x")))
        out = NamedSharding(mesh, P())
        hlo = jax.jit(lambda a: a.sum(0), out_shardings=out).lower(x).compile().as_text()
        got = tpu_compile.collective_hops(hlo)
        # without a device assignment every group is one torus axis: its bytes, undivided
        assert got.pop("axis_bytes") == tpu_compile.collective_bytes(hlo)["total"]
        assert got == want, hlo


def test_torus_hops_ring_an_axis_with_its_wraparound_and_line_a_part_of_it():
    """A whole axis of 4 (wraparound): 2 hops; 2 of its 4 chips: 1; 4 of 8 chips of an axis: a
    line, 3; a 4 x 4 plane of a 4 x 4 x 4 cube: 2 + 2; one chip: 0."""
    cube = (4, 4, 4)
    assert tpu_compile.torus_hops([(x, 0, 0) for x in range(4)], cube) == 2
    assert tpu_compile.torus_hops([(0, 0, 0), (1, 0, 0)], cube) == 1
    assert tpu_compile.torus_hops([(x, 0, 0) for x in range(4)], (8, 4, 4)) == 3
    assert tpu_compile.torus_hops([(0, y, z) for y in range(4) for z in range(4)], cube) == 4
    assert tpu_compile.torus_hops([(1, 2, 3)], cube) == 0


def test_collective_hops_place_a_group_on_the_torus():
    """v5p:4x4x4 as the sampler's mesh ('expert' 16 x 'tensor' 4, `mesh_utils`): a sum over
    'expert' is one all-reduce over a 4 x 4 plane, 2 x (2 + 2) hops on the torus where a ring of
    16 would wait 2 x 8; over 'tensor' (one axis of 4 with its wraparound) 2 x 2. The plane's
    sum has two axes' links, so its bytes count half on one axis (``axis_bytes``); the axis's sum
    counts whole. The compiled program's own device assignment is what `compile_program` reads."""
    from jax.experimental import mesh_utils

    devices = mesh_utils.create_device_mesh((16, 4), devices=tpu_compile.topology_devices("v5p:4x4x4"))
    mesh = Mesh(devices, ("expert", "tensor"))
    x = jax.ShapeDtypeStruct((16 * 8, 4 * 128), jnp.float32,
                             sharding=NamedSharding(mesh, P("expert", "tensor")))
    for dim, torus, ring, axes in ((0, 8, 16, 2), (1, 4, 4, 1)):  # dim 0 over 'expert', 1 'tensor'
        lowered = jax.jit(lambda a: a.sum(dim)).lower(x)
        compiled = lowered.compile()
        got = tpu_compile.collective_hops(compiled.as_text(), list(devices.flat))
        assert got["hops"] == torus and got["ops"] == 1, got
        moved = tpu_compile.collective_bytes(compiled.as_text())["total"]
        assert moved > 0 and got["axis_bytes"] == moved / axes
        assert tpu_compile.collective_hops(compiled.as_text())["hops"] == ring
        assert tpu_compile.compile_program(lowered).collective_hops["hops"] == torus
