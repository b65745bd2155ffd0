"""How a Pallas kernel's ``shard_map`` splits its operands over the tracing mesh: rows over the
batch axes, KV heads over 'tensor' (`models.attention.splash_attention`,
`models.decode_kernel.decode_stats`)."""
from __future__ import annotations

import math

__all__ = ["BATCH_MESH_AXES", "HEAD_MESH_AXIS", "mesh_specs", "row_split"]

BATCH_MESH_AXES = ("data", "fsdp", "expert")  # mesh axes a batch may be split over, in order
HEAD_MESH_AXIS = "tensor"


def mesh_specs(mesh, batch: int, kv_heads: int):
    """(batch mesh axes, head mesh axis or None) for a shard_map of the kernel over ``mesh``.

    Batch: the axes of ('data', 'fsdp', 'expert') present in the mesh, taken greedily in that
    order while the product of their sizes divides ``batch``. Heads: 'tensor' when it divides the
    kv heads (so every device keeps whole GQA groups).
    """
    batch_axes, size = [], 1
    for axis in BATCH_MESH_AXES:
        n = mesh.shape.get(axis, 1)
        if n > 1 and batch % (size * n) == 0:
            batch_axes.append(axis)
            size *= n
    n = mesh.shape.get(HEAD_MESH_AXIS, 1)
    head_axis = HEAD_MESH_AXIS if n > 1 and kv_heads % n == 0 else None
    return tuple(batch_axes) or None, head_axis


def row_split(mesh, rows: int, kv_heads: int):
    """(row mesh axes, head mesh axis or None, row shards) of ``rows`` rows with ``kv_heads`` KV
    heads over ``mesh``: the axes as `mesh_specs` splits them, and the number of shards the rows
    (and a page pool split with them) fall into, the product of the row axes' sizes (1 when the
    rows are not split)."""
    axes, head_axis = mesh_specs(mesh, rows, kv_heads)
    return axes, head_axis, math.prod(mesh.shape[a] for a in axes or ())
