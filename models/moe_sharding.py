"""MoE dispatch on a device mesh: weights travel ("gather") or tokens travel ("expert").

Three ways to run a layer's E experts over tokens that are split over the mesh's batch axes
(``('data', 'fsdp', 'expert')`` that divide the token count, in that order: the default rules'
'batch'). ``ModelConfig.moe_parallelism`` chooses; `sharded_dispatch` applies it.

"gather" (`per_device_dispatch`): each device keeps its tokens; the layer's expert weights are
  all-gathered to every device (in the compute dtype: 1.2 GB for a Qwen3-30B-A3B layer in bf16)
  and the grouped matmuls run locally; the weights' gradients are reduce-scattered back by the
  transpose of the gather. Left to the automatic partitioner, ``ragged_dot`` gathers every
  device's TOKENS instead (~170 GB of temporaries per chip at 8k tokens per row), hence the
  ``shard_map``. Communication per layer: the whole layer's weights, whatever the token count.

"expert" (`expert_parallel_dispatch`): expert parallelism. Each device of the ``expert`` mesh
  axis (size n) holds E / n experts and keeps them (the weights are only gathered over the OTHER
  axes their sharding uses: none in the sampler's layout, 'fsdp' in the learner's). The tokens of
  the n devices of an expert group are all-gathered over 'expert' (each device then sees the
  group's n x N_local tokens and their routes; the routes' ids and weights travel packed in ONE
  all-gather, `gather_rows`: a decode step's collectives are latency-bound, so each op saved is
  a few microseconds per layer), each device runs ITS experts on the assignments
  routed to them, and the fp32 partial outputs are reduce-scattered back over 'expert' to the
  devices that own the tokens. Dropless, static shapes, exact: every assignment is computed by
  the one device holding its expert, nothing is dropped, no capacity. Communication per layer:
  (n-1)/n x n x N_local x H tokens in the compute dtype plus the same rows in fp32 back,
  independent of the weights. For a decode step (8 rows per chip) that is a few MB against
  1.2 GB of gathered weights.

  Why an all-gather and not an all-to-all of the routed copies: with top-k routing each token
  has k copies, and an all-to-all moves each copy to its expert's device (~k x N_local x H per
  device), while the all-gather moves each token once to every device of the group ((n-1) x
  N_local x H). For k >= n (Qwen3-30B-A3B: k = 8, the learner's expert axis 4) the gather moves
  less; for a decode step over 64 devices the all-to-all would move less, but both are a few MB
  and latency-bound, and the gather needs no capacity (an all-to-all with static shapes must size
  its buffers for the worst-case routing or drop). The receive buffer is bounded all the same:
  a device sorts the group's n x N_local x k assignments with its own experts first and keeps
  ``n x N_local x min(k, E/n)`` rows (a token picks k DISTINCT experts, at most E/n of them on
  one device), so no routing can overflow it. When E/n <= k (a decode step over 64 chips: 2
  experts per chip, k = 8) that bound is n x N_local x E/n rows, what running each local expert
  on EVERY token of the group costs in matmuls; the device then does exactly that
  (`_local_all_experts`: no sort, gather or scatter, each token's output weighted by its routing
  weight for the expert, 0 if it did not pick it).

"expert_tensor": "expert" over the 'expert' and 'tensor' axes together (n = their product; the
  experts split over ('expert', 'tensor'), major to minor). The sampler's layout with
  tensor-parallel dense weights uses it: the rows are the same on the devices of a 'tensor'
  group (attention's heads are split there), so the tokens are gathered over 'expert' only, and
  the partial outputs are reduce-scattered over 'expert', then summed over 'tensor' (the tokens'
  rows only). Every chip keeps E / n experts where "expert" on the same mesh would keep
  E / n_expert.

The grouped matmul (`grouped_matmul`) is megablox's ``gmm`` on TPU at training token counts (a
Pallas kernel that visits only the row tiles of the device's own experts; `use_gmm` says when)
and ``jax.lax.ragged_dot`` otherwise; rows past the device's own groups produce zeros in both.

The mesh is the one in the tracing context (``jax.set_mesh`` / ``Placement.context()``); without
one (or on a mesh of one device) the dispatch runs as it is.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

__all__ = ["MOE_PARALLELISM", "BATCH_MESH_AXES", "EXPERT_AXIS", "TENSOR_AXIS", "sharded_dispatch", "expert_axis_size",
           "per_device_dispatch", "expert_parallel_dispatch", "grouped_matmul", "use_gmm", "local_expert_rows"]

MOE_PARALLELISM = ("gather", "expert", "expert_tensor")
BATCH_MESH_AXES = ("data", "fsdp", "expert")
EXPERT_AXIS = "expert"
TENSOR_AXIS = "tensor"
# the mesh axes an expert group spans, per parallelism (experts split over them jointly,
# major to minor, as a PartitionSpec entry ('expert', 'tensor') splits them)
_EXPERT_GROUP_AXES = {"expert": (EXPERT_AXIS,), "expert_tensor": (EXPERT_AXIS, TENSOR_AXIS)}
_F32 = jnp.float32
# gmm's tiles (rows, contraction, output columns), as maxtext's defaults: each row tile re-reads
# its expert's [K, N] weights, so 512 rows (512 FLOP per weight byte) keep a v5p chip (166 FLOP
# per HBM byte at its ridge) compute-bound where megablox's default 128 would not be.
_GMM_TILE = 512
_GMM_TILE_KN = 1024


def _mesh():
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or all(n == 1 for n in dict(mesh.shape).values()):
        return None
    return mesh


def expert_axis_size(parallelism: str = "expert") -> int:
    """Devices of the tracing mesh an expert group spans under ``parallelism``: the 'expert'
    axis ("expert"), or 'expert' x 'tensor' ("expert_tensor"); 1 without a mesh or for
    "gather"."""
    mesh = _mesh()
    axes = _EXPERT_GROUP_AXES.get(parallelism, ())
    return 1 if mesh is None else math.prod(dict(mesh.shape).get(a, 1) for a in axes)


def _token_axes(mesh, num_tokens: int) -> tuple[str, ...]:
    axes, size = [], 1
    for axis in BATCH_MESH_AXES:
        n = dict(mesh.shape).get(axis, 1)
        if n > 1 and num_tokens % (size * n) == 0:
            axes.append(axis)
            size *= n
    return tuple(axes)


def sharded_dispatch(dispatch: Callable, x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype,
                     *, parallelism: str, platform: str, partials: str = "float32"):
    """The dropless dispatch of a layer under the tracing mesh, by ``parallelism`` ("gather" |
    "expert" | "expert_tensor", see the module docstring). The expert-parallel ones need an
    expert group (`expert_axis_size`) of more than one device that divides E; otherwise (or
    without a mesh) they fall back to "gather". ``dispatch`` is the single-device dispatch
    "gather" runs per device. ``partials``: see `expert_parallel_dispatch`. Shapes as
    `per_device_dispatch`."""
    if parallelism not in MOE_PARALLELISM:
        raise ValueError(f"moe_parallelism={parallelism!r}; valid: {list(MOE_PARALLELISM)}")
    n_ep = expert_axis_size(parallelism)
    if parallelism != "gather" and n_ep > 1 and w_gate.shape[0] % n_ep == 0:
        return expert_parallel_dispatch(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype,
                                        platform=platform, parallelism=parallelism, partials=partials)
    return per_device_dispatch(dispatch, x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype)


def per_device_dispatch(dispatch: Callable, x, top_k_index, top_k_weights, w_gate, w_up, w_down,
                        dtype):
    """``dispatch(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype)`` (x [N, H],
    top_k_* [N, k], weights [E, H, Im] / [E, Im, H]; float32 [N, H] out) with each device's
    tokens processed where they are and the layer's weights gathered ("gather")."""
    mesh = _mesh()
    if mesh is None:
        return dispatch(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype)
    tokens = _token_axes(mesh, x.shape[0])
    row = P(tokens or None)
    weights = tuple(w.astype(dtype) for w in (w_gate, w_up, w_down))  # gathered in bf16

    def local(x, idx, wts, wg, wu, wd):
        return dispatch(x, idx, wts, wg, wu, wd, dtype)

    return jax.shard_map(local, mesh=mesh, in_specs=(row, row, row, P(), P(), P()),
                         out_specs=row, check_vma=False)(x, top_k_index, top_k_weights, *weights)


def use_gmm(platform: str, num_tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether the grouped matmul is megablox's ``gmm``: on TPU, when an expert gets at least one
    of gmm's 512-row tiles of tokens on average (``num_tokens x top_k / num_experts``, tokens
    counted over the expert group), as in training. Below that (a decode step: 512 rows x top-8
    over 128 experts is 32 per expert) gmm's grid, sized for the worst-case routing, visits
    mostly empty tiles and re-reads an expert's weights per tile, and XLA's ``ragged_dot``
    reads each local expert once."""
    return platform == "tpu" and num_tokens * top_k >= _GMM_TILE * num_experts


def grouped_matmul(lhs, rhs, group_sizes, *, gmm: bool, dtype, interpret: bool = False):
    """``out[r] = lhs[r] @ rhs[g(r)]`` for rows grouped in order (group i: ``group_sizes[i]`` rows);
    rows past ``sum(group_sizes)`` give zeros. lhs [M, K], rhs [G, K, N], group_sizes int32 [G];
    returns [M, N] in ``dtype`` (fp32 accumulation). ``gmm`` (TPU only, see `use_gmm`): megablox's
    Pallas kernel (M a multiple of its row tile; the rows past the groups are one more group without
    weights, whose tiles gmm skips; ``interpret``: run it on CPU, for tests); else
    ``jax.lax.ragged_dot``."""
    lhs, rhs = lhs.astype(dtype), rhs.astype(dtype)
    if gmm:
        from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm  # local: TPU only

        rest = lhs.shape[0] - jnp.sum(group_sizes)
        sizes = jnp.concatenate([group_sizes, rest[None]]).astype(jnp.int32)
        tiling = (min(_GMM_TILE, lhs.shape[0]), min(_GMM_TILE_KN, lhs.shape[1]), min(_GMM_TILE_KN, rhs.shape[2]))
        out = megablox_gmm(lhs, rhs, sizes, _F32, tiling, jnp.zeros((), jnp.int32), None, False, interpret)
        return out.astype(dtype)
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=_F32).astype(dtype)


def local_expert_rows(num_tokens: int, top_k: int, local_experts: int, gmm: bool) -> int:
    """Rows of a device's receive buffer in `expert_parallel_dispatch`: ``num_tokens x
    min(top_k, local_experts)`` (a token's k experts are distinct, so at most ``local_experts``
    of them live on one device: no routing overflows it), rounded up to gmm's row tile."""
    rows = num_tokens * min(top_k, local_experts)
    return int(math.ceil(rows / _GMM_TILE) * _GMM_TILE) if gmm else rows


def _local_swiglu(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype, *, first_expert,
                  gmm: bool):
    """This device's experts ``[first_expert, first_expert + E_l)`` on the assignments routed to
    them: x [N, H], top_k_* [N, k], weights [E_l, H, Im] / [E_l, Im, H] -> fp32 [N, H] partial
    sums (assignments to other devices' experts contribute 0)."""
    n, k = top_k_index.shape
    e_local = w_gate.shape[0]
    local_id = top_k_index.reshape(-1).astype(jnp.int32) - first_expert        # [N*k]
    mine = (local_id >= 0) & (local_id < e_local)
    key = jnp.where(mine, local_id, e_local)                                   # others sort last
    padded = local_expert_rows(n, k, e_local, gmm)
    rows = min(padded, n * k)
    order = jnp.argsort(key, stable=True)[:rows]                               # own assignments first
    group_sizes = jnp.bincount(key, length=e_local + 1)[:e_local].astype(jnp.int32)
    x_sorted = jnp.take(x, order // k, axis=0)                                 # [rows, H]
    if padded > rows:  # gmm, not a whole number of row tiles
        x_sorted = jnp.pad(x_sorted, ((0, padded - rows), (0, 0)))

    def mm(lhs, rhs):
        return grouped_matmul(lhs, rhs, group_sizes, gmm=gmm, dtype=dtype)

    h = jax.nn.silu(mm(x_sorted, w_gate)) * mm(x_sorted, w_up)
    y_sorted = mm(h, w_down)[:rows]                                            # [rows, H]
    # back to assignment order: assignment c reads its sorted row when it is one of ours
    position = jnp.zeros((n * k,), jnp.int32).at[order].set(jnp.arange(rows, dtype=jnp.int32))
    weights = jnp.where(mine, top_k_weights.reshape(-1).astype(_F32), 0.0)
    y = jnp.take(y_sorted, position, axis=0).astype(_F32) * weights[:, None]  # [N*k, H]
    return y.reshape(n, k, -1).sum(axis=1)


def _local_all_experts(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype, *,
                       first_expert):
    """`_local_swiglu` without the sort: each of this device's E_l experts on EVERY token, its
    output weighted by the token's routing weight for it (0 when the token did not pick it).
    Same arguments and result. Chosen when E_l <= k (`local_expert_rows`): the dropless receive
    buffer then holds N x E_l rows anyway, so the matmuls do the same FLOPs, and the argsort of
    the N x k assignments, the row gather and the scatter back (what a decode step's MoE spent
    its HBM traffic on: ~0.7 GB per layer on a v5p chip for 8 B of weights' worth of work) go."""
    e_local = w_gate.shape[0]
    ids = first_expert + jnp.arange(e_local, dtype=jnp.int32)                  # [E_l]
    picked = top_k_index.astype(jnp.int32)[:, :, None] == ids                  # [N, k, E_l]
    combine = jnp.sum(jnp.where(picked, top_k_weights.astype(_F32)[:, :, None], 0.0), axis=1)
    x = x.astype(dtype)

    def mm(spec, lhs, rhs):
        return jnp.einsum(spec, lhs, rhs.astype(dtype), preferred_element_type=_F32).astype(dtype)

    h = jax.nn.silu(mm("nh,ehi->eni", x, w_gate)) * mm("nh,ehi->eni", x, w_up)  # [E_l, N, Im]
    y = mm("eni,eih->enh", h, w_down)                                          # [E_l, N, H]
    return jnp.einsum("ne,enh->nh", combine, y.astype(_F32))


_WORDS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _packed_all_gather(arrays, axis: str):
    """`jax.lax.all_gather` (tiled, over dim 0) of several [N, ...] arrays as ONE collective:
    each is bitcast to unsigned words of the narrowest itemsize among them, flattened to
    [N, words], concatenated, gathered, split and bitcast back. Bit-exact; one collective's
    latency where each array would pay its own (a decode step's tokens and routes are a few KB:
    latency-bound)."""
    unit = min(jnp.dtype(a.dtype).itemsize for a in arrays)
    word = _WORDS[unit]
    parts = [jax.lax.bitcast_convert_type(a, word).reshape(a.shape[0], -1) for a in arrays]
    packed = jax.lax.all_gather(jnp.concatenate(parts, axis=1), axis, tiled=True)
    out, start = [], 0
    for a, part in zip(arrays, parts):
        width = part.shape[1]
        ratio = jnp.dtype(a.dtype).itemsize // unit
        words = packed[:, start:start + width].reshape(
            packed.shape[0], *a.shape[1:], *((ratio,) if ratio > 1 else ()))
        out.append(jax.lax.bitcast_convert_type(words, a.dtype))
        start += width
    return tuple(out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gather_rows(arrays, axis: str):
    """The rows of ``arrays`` (a tuple of [N, ...] arrays, any dtypes) all-gathered over the
    mesh axis ``axis`` (tiled: [n x N, ...], in device order) in one collective
    (`_packed_all_gather`). Inside ``shard_map``. Differentiable: a float array's cotangent is
    reduce-scattered back, as `jax.lax.all_gather`'s transpose does; an integer array gets none."""
    return _packed_all_gather(arrays, axis)


def _gather_rows_fwd(arrays, axis):
    return _packed_all_gather(arrays, axis), None


def _gather_rows_bwd(axis, _, cotangents):
    return (tuple(None if ct.dtype == jax.dtypes.float0 else
                  jax.lax.psum_scatter(ct, axis, scatter_dimension=0, tiled=True)
                  for ct in cotangents),)


gather_rows.defvjp(_gather_rows_fwd, _gather_rows_bwd)


def expert_parallel_dispatch(x, top_k_index, top_k_weights, w_gate, w_up, w_down, dtype, *,
                             platform: str, parallelism: str = "expert", partials: str = "float32"):
    """Expert-parallel dropless dispatch ("expert" or "expert_tensor", see the module docstring)
    under the tracing mesh: x [N, H], top_k_index int [N, k], top_k_weights [N, k], weights
    [E, H, Im] / [E, Im, H] -> float32 [N, H], equal to the single-device dispatch.

    ``partials``: "float32" sums the devices' partial outputs in fp32 (equal to one device up to
    fp32 rounding); "compute" rounds each device's partial to ``dtype`` first, then sums in it:
    half the bytes a decode step writes, reads and reduce-scatters per layer (with bf16 a token's
    sum of k expert outputs takes up to k bf16 roundings, as HF's eager loop does)."""
    if partials not in ("float32", "compute"):
        raise ValueError(f"partials={partials!r}; valid: ['float32', 'compute']")
    partial_dtype = _F32 if partials == "float32" else jnp.dtype(dtype)
    mesh = _mesh()
    axes = tuple(a for a in _EXPERT_GROUP_AXES[parallelism] if dict(mesh.shape).get(a, 1) > 1)
    n_ep = expert_axis_size(parallelism)
    num_experts = w_gate.shape[0]
    if num_experts % n_ep:
        raise ValueError(f"{num_experts} experts do not split over the {n_ep} devices of the "
                         f"mesh axes {axes}")
    e_local = num_experts // n_ep
    tokens = _token_axes(mesh, x.shape[0])   # never 'tensor': the rows are the same across it
    row = P(tokens or None)
    tokens_split = EXPERT_AXIS in tokens
    weights = tuple(w.astype(dtype) for w in (w_gate, w_up, w_down))
    expert_spec = P(axes)
    group_tokens = x.shape[0] // math.prod(dict(mesh.shape)[a] for a in tokens if a != EXPERT_AXIS)
    gmm = use_gmm(platform, group_tokens, top_k_index.shape[1], num_experts)

    def local(x, idx, wts, wg, wu, wd):
        if tokens_split:  # the expert group's tokens and routes, in device order
            x = jax.lax.all_gather(x, EXPERT_AXIS, tiled=True)
            idx, wts = gather_rows((idx, wts), EXPERT_AXIS)
        shard = 0   # this device's index in the expert group, major to minor
        for a in axes:
            shard = shard * dict(mesh.shape)[a] + jax.lax.axis_index(a)
        first = shard * e_local
        if not gmm and e_local <= idx.shape[1]:  # the sort buys nothing (see _local_all_experts)
            y = _local_all_experts(x, idx, wts, wg, wu, wd, dtype, first_expert=first)
        else:
            y = _local_swiglu(x, idx, wts, wg, wu, wd, dtype, first_expert=first, gmm=gmm)
        y = y.astype(partial_dtype)
        if tokens_split:  # back to the token owners first: the 'tensor' sum then moves their rows only
            y = jax.lax.psum_scatter(y, EXPERT_AXIS, scatter_dimension=0, tiled=True)
        rest = tuple(a for a in axes if a != EXPERT_AXIS or not tokens_split)
        return (jax.lax.psum(y, rest) if rest else y).astype(_F32)

    return jax.shard_map(local, mesh=mesh,
                         in_specs=(row, row, row, expert_spec, expert_spec, expert_spec),
                         out_specs=row, check_vma=False)(x, top_k_index, top_k_weights, *weights)
