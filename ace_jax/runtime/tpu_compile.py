"""Ahead-of-time compilation for TPU on any host: topologies, HBM, compiled memory.

XLA's TPU compiler ships in the ``libtpu`` wheel (``pip install "jax[tpu]"`` at the pinned jax)
and runs without a TPU (``reference/tpu_aot.md``): `topology_devices` gives the abstract devices
of a named slice (``"v5p:4x4x4"`` = 64 v5p chips), a `Mesh` over them carries the runtime's
shardings, and `compile_program` compiles a jitted function's lowering for them and reads XLA's
own per-chip memory figures. Units: bytes; the compiler's messages print GiB ("G").

    devices = topology_devices("v5p:2x2x2")           # TopologyError for an unknown name
    hbm = hbm_bytes(devices[0])                       # what the compiler will let a program use
    result = compile_program(jitted.trace(*abstract_args).lower())
    result.peak_bytes, result.fits(hbm)
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["TopologyError", "LibtpuMissingError", "CompiledProgram", "libtpu_available",
           "topology_devices", "hbm_bytes", "compile_program", "collective_bytes", "collective_hops",
           "torus_hops", "EXAMPLE_TOPOLOGIES", "HBM_TRAFFIC_OPTIONS"]

EXAMPLE_TOPOLOGIES = ("v5p:2x2x1", "v5p:2x2x2", "v5p:4x4x4", "v4:2x2x2", "v5e:4x4", "v6e:4x4")
_OOM = re.compile(r"total memory required for HLO temporaries \(([\d.]+)([KMGT])\) exceeds "
                  r"available HBM \(([\d.]+)([KMGT])\)")
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}

# XLA's cost analysis ("bytes accessed") sums every instruction's operand and result bytes,
# whatever memory they live in. With memory-space assignment on (the default), a buffer that XLA
# prefetches into on-chip memory (VMEM; CMEM on v4) is counted about 5 times: the copy-start's
# operand and its (destination, source) result, then its readers. Measured on v5p for 4 chained
# [32, 2048] x [2048, 4608] bf16 matmuls (75.5 MB of weights): 379.5 MB accessed with it, 77.5 MB
# without. Compiled without on-chip memory-space assignment every operand is read from HBM and
# counted once: the HBM traffic of the program, an upper bound on the real program's (which only
# moves some of it on chip). One flag per generation; a generation ignores the others' flags.
HBM_TRAFFIC_OPTIONS = {
    "xla_tpu_cmem_memory_space_assignment": False,   # v4 (CMEM)
    "xla_vf_vmem_memory_space_assignment": False,    # v5p, v5e
    "xla_gf_vmem_memory_space_assignment": False,    # v6e
}


_COLLECTIVE = re.compile(
    r"=\s*(?P<shape>\([^=]*?\)|[\w]+\[[\d,]*\]\S*)\s+"
    r"(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16)\[([\d,]*)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[(?P<dims>[\d,]*)\]"
                          r"(?:T\((?P<perm>[\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[(?P<mesh>[^\]]*)\]\s*\{(?P<axes>[^}]*)\}")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def _array_bytes(shape: str) -> list[int]:
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        bits = 8 if dtype == "pred" else 16 if dtype == "bf16" else int(dtype[1:])
        out.append(int(np.prod([int(d) for d in dims.split(",") if d] or [1])) * max(bits, 8) // 8)
    return out


def _first_group(line: str) -> list[int] | None:
    """The device ids (positions in the program's device assignment) of an op's first replica
    group: ``{{0,1,..},..}``, ``[groups,size]<=[dims]T(perm)`` or the mesh form
    ``mesh['a'=4,'b'=2] {'a'}`` (the ids of a row-major mesh of those axes, the named axes
    varying, the others at 0); None without groups."""
    m = _GROUPS_LIST.search(line)
    if m:
        return [int(d) for d in m[1].split(",") if d]
    m = _GROUPS_IOTA.search(line)
    if m:
        dims = [int(x) for x in m["dims"].split(",")] if m["dims"] else [int(m[1]) * int(m[2])]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m["perm"]:
            ids = ids.transpose([int(x) for x in m["perm"].split(",")])
        return ids.reshape(int(m[1]), int(m[2]))[0].tolist()
    m = _GROUPS_MESH.search(line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m["mesh"])
        named = re.findall(r"'([^']+)'", m["axes"])
        ids = np.arange(int(np.prod([int(n) for _, n in axes]))).reshape([int(n) for _, n in axes])
        ids = ids[tuple(slice(None) if a in named else 0 for a, _ in axes)]
        keep = [a for a, _ in axes if a in named]
        return ids.transpose([keep.index(a) for a in named if a in keep]).reshape(-1).tolist()
    return None


def _group_size(line: str) -> int:
    """Devices per replica group (`_first_group`; 1 without groups)."""
    return len(_first_group(line) or [0])


def torus_hops(coords: Sequence[Sequence[int]], dims: Sequence[int]) -> int:
    """ICI hops a collective over the chips at ``coords`` waits, on a torus of ``dims`` chips
    per axis: per axis the group spans ``e`` chips; a whole axis of a multiple of 4 chips has
    its wraparound link (v4 / v5p, the scaling book) and is a bidirectional ring, e // 2 hops;
    a part of an axis is a line, e - 1 hops. Axes add (the collective runs one axis after the
    other)."""
    hops = 0
    for axis, size in enumerate(dims):
        e = len({c[axis] for c in coords})
        hops += e // 2 if e == size and size % 4 == 0 else e - 1
    return hops
def _collectives(hlo: str):
    """(op, bytes moved per device, line) of each collective in an optimised HLO text (see
    `collective_bytes` for the bytes)."""
    for line in hlo.splitlines():
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        op, sizes = m["op"], _array_bytes(m["shape"])
        if not sizes:
            continue
        if m["start"] and op in ("all-gather", "collective-permute"):
            arrays = [b for b in sizes if b > 4] or sizes   # drop the u32[] context scalars
            sizes = arrays[len(arrays) // 2:]
        moved = sum(sizes)
        if op == "reduce-scatter":
            moved *= _group_size(line)
        elif op == "all-reduce":
            moved *= 2
        yield op, moved, line


def collective_bytes(hlo: str) -> dict[str, int]:
    """Bytes each kind of collective moves per device in an optimised HLO text (one count per
    instruction: an op inside a ``while`` body counts once, like ``cost_analysis``).

    From each op's result shape (operands are not typed in the optimised text): all-gather the
    result, reduce-scatter the operand (result x group size), all-to-all and collective-permute
    the operand (= result), all-reduce 2 x the operand (a ring sends and receives it about
    twice). Async ``-start`` ops count once (their ``-done`` twin is skipped); a start's tuple
    holds (operands, results): the results half is used. Returns {kind: bytes, "total": bytes}.
    """
    out = dict.fromkeys(COLLECTIVES, 0)
    for op, moved, _ in _collectives(hlo):
        out[op] += moved
    out["total"] = sum(out[k] for k in COLLECTIVES)
    return out


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4,
                "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_LAID_OUT = re.compile(r"(?P<dtype>pred|[subf]\d+|bf16)\[(?P<dims>[\d,]*)\]"
                       r"(?:\{(?P<layout>[^}]*)\})?")
_COPY = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>[\w.\-]+) = (?P<shape>\(?[^ ]+?\{[^}]*\}[^=]*?) "
                   r"(?P<op>copy|copy-start)\(")
_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+) \(")
_BODY = re.compile(r"\bbody=%(?P<name>[\w.\-]+)")


def padded_bytes(shape: str) -> int:
    """Bytes of one array in an optimised HLO's notation, e.g. ``bf16[2,545,128,1,128]{4,3,2,1,
    0:T(2,128)(2,1)}``, with its first tile's padding: the most minor dim (the first of the
    minor-to-major list) rounded up to the tile's last size, the next to its first (a head dim
    of 1 under ``T(2,128)`` takes 2). Without a layout or tile, the dense size."""
    m = _LAID_OUT.search(shape)
    if not m:
        raise ValueError(f"not an HLO array shape: {shape!r}")
    dims = [int(d) for d in m["dims"].split(",") if d]
    layout = m["layout"] or ""
    order, _, tiles = layout.partition(":")
    tile = re.match(r"T\((\d+)(?:,(\d+))?\)", tiles)
    minor = [int(x) for x in order.split(",") if x.strip()] if order.strip() else []
    if tile and minor:
        sizes = [int(tile[2] or tile[1]), int(tile[1])] if tile[2] else [int(tile[1])]
        for dim, t in zip(minor, sizes):
            dims[dim] = -(-dims[dim] // t) * t
    n = 1
    for d in dims:
        n *= d
    return n * _DTYPE_BYTES[m["dtype"]]


def large_copies(hlo: str, min_bytes: int) -> list[dict]:
    """The ``copy`` / ``copy-start`` instructions of an optimised HLO text whose result holds at
    least ``min_bytes`` (`padded_bytes`: the layout's padding counted), e.g. a KV page pool
    converted to another layout. Per copy: name, shape, bytes (padded), its computation and
    ``in_loop`` (the computation is a ``while`` body: it runs every iteration). Each instruction
    counts once, like ``cost_analysis`` (a loop body's copy is one entry). ``in_hbm``: whether the
    copy moves HBM to HBM (a layout conversion or a duplicate); memory-space assignment's moves
    between HBM and the chip's on-chip memory (``S(1)`` in a layout: a ``copy-start`` whose
    source or destination is there) are copies too, but convert nothing."""
    bodies = {m["name"] for m in _BODY.finditer(hlo)}
    out, computation = [], ""
    for line in hlo.splitlines():
        h = _HEADER.match(line)
        if h:
            computation = h["name"]
            continue
        m = _COPY.match(line)
        if not m:
            continue
        # copy-start's result is (destination, source, context): both buffers' layouts
        buffers = list(_LAID_OUT.finditer(m["shape"]))[:2]
        shape = buffers[0]
        size = padded_bytes(shape.group(0))
        if size >= min_bytes:
            on_chip = [re.search(r"S\(\d+\)", x["layout"] or "") is not None for x in buffers]
            out.append(dict(name=m["name"], op=m["op"], shape=shape.group(0), bytes=size,
                            computation=computation, in_loop=computation in bodies,
                            in_hbm=not any(on_chip)))
    return out


def copies_of(hlo: str, shape: Sequence[int], dtype: Any, on_chip: bool = False) -> list[dict]:
    """`large_copies` of an array of ``shape`` and ``dtype`` (e.g. one KV cache or page pool
    array per chip): the copies within HBM whose result has those dims, in any layout
    (``on_chip``: the moves to and from on-chip memory too)."""
    dims = ",".join(map(str, shape))
    dense = math.prod(shape) * np.dtype(dtype).itemsize
    return [c for c in large_copies(hlo, dense) if _LAID_OUT.search(c["shape"])["dims"] == dims
            and (on_chip or c["in_hbm"])]


class TopologyError(ValueError):
    """A TPU topology name the compiler does not know."""


class LibtpuMissingError(RuntimeError):
    """XLA's TPU compiler (libtpu) is not installed, so nothing can be compiled for TPU."""


def libtpu_available() -> bool:
    return importlib.util.find_spec("libtpu") is not None


def _require_libtpu() -> None:
    if not libtpu_available():
        raise LibtpuMissingError(
            f"libtpu is not installed, so XLA's TPU compiler is not available: run "
            f"`pip install \"jax[tpu]=={jax.__version__}\"` (about 700 MB; it works on a host "
            f"without a TPU) to compile for TPU")


@functools.lru_cache(maxsize=None)
def topology_devices(name: str) -> tuple:
    """The abstract devices (one per chip) of the TPU slice ``name`` ("v5p:4x4x4")."""
    _require_libtpu()
    from jax.experimental import topologies

    # Compiling uses no TPU, so several processes may hold libtpu at once (e.g. a dry run beside
    # a test); libtpu refuses a second process unless told so, before it loads.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not re.fullmatch(r"v\d+[a-z]*:\d+(x\d+)*", str(name)):
        raise TopologyError(f"unknown TPU topology {name!r}: expected <generation>:<chips per "
                            f"axis>, e.g. {', '.join(EXAMPLE_TOPOLOGIES)}")
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=str(name))
    except Exception as e:  # noqa: BLE001 - the compiler raises a bare runtime error
        if "lockfile" in str(e):
            raise LibtpuMissingError(f"libtpu is held by another process ({str(e)[:200]}); set "
                                     "ALLOW_MULTIPLE_LIBTPU_LOAD=1 before starting") from None
        raise TopologyError(f"the TPU compiler does not know topology {name!r} "
                            f"({str(e).splitlines()[0][:200]}); try one of "
                            f"{', '.join(EXAMPLE_TOPOLOGIES)}") from None
    return tuple(topo.devices)


@functools.lru_cache(maxsize=None)
def hbm_bytes(device: Any) -> int:
    """The HBM a program may use on one chip of ``device``'s kind, as the compiler states it:
    compiles a program that cannot fit and reads the limit from its refusal (about 1 s)."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array([device]), ("x",))
    too_big = jax.ShapeDtypeStruct((2**40 // 4,), jnp.float32,
                                   sharding=NamedSharding(mesh, PartitionSpec()))
    try:
        jax.jit(lambda x: x * 2).lower(too_big).compile()
    except Exception as e:  # noqa: BLE001 - we want its message
        m = _OOM.search(str(e))
        if m:
            return int(float(m[3]) * _UNIT[m[4]])
        raise RuntimeError(f"could not read the HBM size of {device.device_kind}: {e}") from e
    raise RuntimeError(f"a 4 TiB program compiled for {device.device_kind}: no HBM limit found")


@dataclasses.dataclass
class CompiledProgram:
    """XLA's figures for one compiled program, per chip (bytes).

    ``peak_bytes`` = arguments + outputs - aliased (donated buffers reused by outputs) +
    temporaries: what the program holds at its peak. A program the compiler refused for memory
    has ``ok=False``, ``oom=True`` and ``peak_bytes`` = the requirement it printed.
    """

    ok: bool
    compile_s: float
    argument_bytes: int = 0
    output_bytes: int = 0
    alias_bytes: int = 0
    temp_bytes: int = 0
    peak_bytes: int = 0
    flops: float = 0.0
    hbm_bytes: float = 0.0    # cost_analysis "bytes accessed" (HBM traffic with hbm_traffic=True)
    collective_bytes: dict = dataclasses.field(default_factory=dict)  # `collective_bytes`
    collective_hops: dict = dataclasses.field(default_factory=dict)   # `collective_hops`
    mosaic_kernels: int = 0   # Pallas (Mosaic) kernel calls in the optimised HLO, e.g. splash
    oom: bool = False
    error: str = ""
    hlo: Any = dataclasses.field(default=None, repr=False)  # the compiled executable's HLO text

    def fits(self, hbm: int, fraction: float = 1.0) -> bool:
        return self.ok and self.peak_bytes <= fraction * hbm

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("hlo")
        return d


def collective_hops(hlo: str, devices: Sequence[Any] | None = None) -> dict[str, Any]:
    """The collective ops of an optimised HLO text and the ICI hops they wait through, per device
    (one count per instruction, like `collective_bytes`; an async ``-start`` counts once).

    With ``devices`` (the program's device assignment, whose ``coords`` place each chip on the
    torus) a group's hops are `torus_hops` of its chips; without, a group of ``n`` devices is
    taken as one bidirectional ring, ``n // 2`` hops. An all-gather, reduce-scatter or all-to-all
    waits that, an all-reduce (a reduce-scatter then an all-gather) twice that, a
    collective-permute one hop; a group of one device none. ``axis_bytes``: each op's bytes
    (`collective_bytes`) over the torus axes its group spans, summed: an op over ``a`` axes has
    ``a`` axes' links (the scaling book: a gather over several axes "increases the available
    bandwidth by a factor of n_axes"), so its bytes take the time of ``1/a`` of them on one axis;
    without ``devices`` every group is one axis. Returns {"ops": int, "hops": int,
    "axis_bytes": float, "by_group": {"<kind> x<n>": [ops, hops]}}. What a hop and an axis's
    bandwidth cost is the caller's constant (`ace_jax.train.dry_run_speed.CHIPS`).
    """
    coords = None
    if devices is not None and all(getattr(d, "coords", None) is not None for d in devices):
        coords = [tuple(d.coords) for d in devices]
        dims = [max(c[i] for c in coords) + 1 for i in range(len(coords[0]))]
    by_group: dict[str, list[int]] = {}
    axis_bytes = 0.0
    for op, moved, line in _collectives(hlo):
        ids = _first_group(line) or [0]
        n, axes = len(ids), 1
        if op == "collective-permute":
            hops = 1
        elif n <= 1:
            continue
        else:
            placed = coords is not None and max(ids) < len(coords)
            if placed:
                group = [coords[i] for i in ids]
                hops = torus_hops(group, dims)
                axes = max(1, sum(len({c[a] for c in group}) > 1 for a in range(len(dims))))
            else:
                hops = n // 2
            hops *= 2 if op == "all-reduce" else 1
        row = by_group.setdefault(f"{op} x{n}", [0, 0])
        row[0] += 1
        row[1] += hops
        axis_bytes += moved / axes
    return dict(ops=sum(r[0] for r in by_group.values()),
                hops=sum(r[1] for r in by_group.values()), axis_bytes=axis_bytes,
                by_group=by_group)


def _device_assignment(compiled: Any) -> list | None:
    """The devices of a compiled program's mesh, in the order its replica groups number them
    (the mesh's flat order), or None."""
    try:
        for s in jax.tree.leaves(compiled.input_shardings):
            mesh = getattr(s, "mesh", None)
            if mesh is not None and hasattr(mesh, "devices"):
                return list(mesh.devices.flat)
    except Exception:  # noqa: BLE001 - no assignment: the ring model
        return None
    return None


def compile_program(lowered: Any, *, keep_hlo: bool = False,
                    hbm_traffic: bool = False) -> CompiledProgram:
    """Compiles ``lowered`` (``jitted.trace(...).lower()`` over TPU devices) and reads its memory
    analysis and FLOPs. A program that does not fit is reported (``oom``), not raised.

    ``hbm_traffic``: compile with `HBM_TRAFFIC_OPTIONS` (no on-chip memory-space assignment), so
    that ``hbm_bytes`` is the program's HBM traffic with each operand counted once (what a
    roofline needs); its memory figures are then those of that variant, not the real program's.
    """
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile(compiler_options=HBM_TRAFFIC_OPTIONS if hbm_traffic else None)
    except Exception as e:  # noqa: BLE001 - reported with the compiler's words
        msg = str(e)
        m = _OOM.search(msg)
        if m:
            need = int(float(m[1]) * _UNIT[m[2]])
            return CompiledProgram(ok=False, compile_s=time.perf_counter() - t0, oom=True,
                                   temp_bytes=need, peak_bytes=need, error=m[0])
        return CompiledProgram(ok=False, compile_s=time.perf_counter() - t0,
                               error=f"{type(e).__name__}: {msg[:2000]}")
    dt = time.perf_counter() - t0
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    if isinstance(cost, (list, tuple)):
        cost = cost[0] if cost else {}
    arg, out = int(ma.argument_size_in_bytes), int(ma.output_size_in_bytes)
    alias, temp = int(ma.alias_size_in_bytes), int(ma.temp_size_in_bytes)
    hlo = compiled.as_text()
    return CompiledProgram(ok=True, compile_s=dt, argument_bytes=arg, output_bytes=out,
                           alias_bytes=alias, temp_bytes=temp, peak_bytes=arg + out - alias + temp,
                           flops=float((cost or {}).get("flops", 0.0)),
                           hbm_bytes=float((cost or {}).get("bytes accessed", 0.0)),
                           collective_bytes=collective_bytes(hlo),
                           collective_hops=collective_hops(hlo, _device_assignment(compiled)),
                           mosaic_kernels=hlo.count('custom_call_target="tpu_custom_call"'),
                           hlo=hlo if keep_hlo else None)
