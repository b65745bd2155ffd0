"""Device mesh, logical-axis sharding rules and placement helpers.

One `jax.sharding.Mesh` with named axes `MESH_AXES = ('data', 'fsdp', 'tensor', 'expert')`,
sized by a config section (`default_config()`; -1 = the rest of the devices). Arrays carry
LOGICAL axis names (a tuple per array, e.g. `('layers', 'embed', 'mlp')`); a rules table maps each
logical name to a mesh axis, a tuple of mesh axes, or None (replicated):

    rules = rules_from_config(cfg.mesh.rules)       # {'embed': ('fsdp',), 'head_dim': None, ...}
    shardings = shardings_for(axes_tree, params, mesh, rules)   # pytree of NamedSharding
    params = place(params, shardings)

Policy of `logical_to_pspec` (documented because it silently changes memory use):

1. Unknown logical names raise `UnknownLogicalAxisError` (a typo must not silently replicate a
   30B tensor); map a name to None to replicate it on purpose. A None entry in the axes tuple
   means "replicated" as well.
2. A mesh axis is used at most once per array: dims are visited left to right and a mesh axis
   already taken by an earlier dim is skipped for later dims.
3. With a mesh and a shape: mesh axes of size 1 are left out (they shard nothing), and for each
   dim the candidate mesh axes are kept greedily, in order, while the product of the kept sizes
   divides the dim; an axis that would not divide is dropped, so that dim is sharded over fewer
   axes or replicated. Each drop is logged once per (logical name, mesh axis, dim size) as a
   warning.

The model exposes `logical_axes(model) -> {flat_name: axes}` next to `flat_params(model) ->
{flat_name: array}`; both are plain dicts with the same keys, so they work directly as the
`axes_tree` and `shapes_tree` here. Everything also works on any pytree of arrays with a
matching pytree of axes tuples.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

logger = logging.getLogger(__name__)

MESH_AXES: tuple[str, ...] = ("data", "fsdp", "tensor", "expert")

# Logical axis name -> mesh axes. Strings in the config: "a,b" is a tuple, "" is replicated.
DEFAULT_RULES: dict[str, str] = {
    "batch": "data,fsdp,expert",  # activations / data: data parallel over every non-model axis
    "length": "",                 # sequence positions
    "cache_length": "",           # KV-cache positions
    "embed": "fsdp,expert",       # hidden size: the FSDP (ZeRO-3) axis of every weight. Expert
    #                               weights put 'expert' on their experts dim first (dims are
    #                               visited left to right), so there embed gets only 'fsdp';
    #                               every other weight is sharded over fsdp x expert, the same
    #                               devices the batch is split over.
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": "",
    "mlp": "tensor",
    "experts": "expert",
    "router": "expert",           # the router's experts dim (after embed: gets what embed leaves)
    "layers": "",                 # the scanned layer stack
}

Rules = Mapping[str, "tuple[str, ...] | None"]
Axes = tuple  # tuple[str | None, ...]

__all__ = [
    "MESH_AXES",
    "DEFAULT_RULES",
    "MeshConfigError",
    "UnknownLogicalAxisError",
    "default_config",
    "resolve_mesh_shape",
    "make_mesh",
    "is_multi_process_env",
    "maybe_initialize_distributed",
    "rules_from_config",
    "logical_to_pspec",
    "logical_sharding",
    "shardings_for",
    "place",
    "shard_params",
    "optimizer_state_shardings",
    "init_sharded_optimizer_state",
    "batch_axes",
    "shard_batch",
    "with_logical_constraint",
    "replicated",
]


class MeshConfigError(ValueError):
    """The mesh section cannot be realised on the available devices."""


class UnknownLogicalAxisError(KeyError):
    """A logical axis name that the rules table does not map (map it to None to replicate)."""

    def __str__(self) -> str:
        return str(self.args[0])


# ----------------------------------------------------------------------------------------------
# Config and mesh
# ----------------------------------------------------------------------------------------------

def default_config() -> ml_collections.ConfigDict:
    """The `mesh` config section: axis sizes, axis type, distributed init, and the rules table."""
    cfg = ml_collections.ConfigDict()
    cfg.data = 1
    cfg.fsdp = -1                  # -1: all devices not used by the other axes (at most one -1)
    cfg.tensor = 1
    cfg.expert = 1
    cfg.axis_types = "auto"        # auto (GSPMD propagation) | explicit (sharding in types)
    cfg.distributed = "auto"       # auto: initialise iff the environment is multi-process
    #                                always | never
    cfg.coordinator_address = ""   # passed to jax.distributed.initialize when set
    cfg.num_processes = 0          # 0: let JAX detect (TPU / SLURM / env)
    cfg.process_id = -1            # -1: let JAX detect
    cfg.heartbeat_timeout_s = 0    # a lost peer is detected after this long (0: JAX's 100 s)
    cfg.rules = ml_collections.ConfigDict(dict(DEFAULT_RULES))
    return cfg


def resolve_mesh_shape(cfg: ml_collections.ConfigDict, num_devices: int) -> dict[str, int]:
    """{axis: size} in `MESH_AXES` order, with a -1 entry replaced by the remaining devices.

    Raises MeshConfigError when sizes are not positive, more than one is -1, or the product
    does not equal `num_devices`."""
    sizes = {axis: int(cfg[axis]) for axis in MESH_AXES}
    auto = [a for a, s in sizes.items() if s == -1]
    bad = [f"{a}={s}" for a, s in sizes.items() if s == 0 or s < -1]
    if bad:
        raise MeshConfigError(f"mesh axis sizes must be positive or -1, got {', '.join(bad)}")
    if len(auto) > 1:
        raise MeshConfigError(f"at most one mesh axis may be -1, got {auto}")
    fixed = int(np.prod([s for s in sizes.values() if s != -1]))
    if auto:
        if num_devices % fixed:
            raise MeshConfigError(f"{num_devices} devices do not split into the fixed mesh axes "
                                  f"{_fmt(sizes)} (product {fixed})")
        sizes[auto[0]] = num_devices // fixed
    elif fixed != num_devices:
        raise MeshConfigError(f"mesh {_fmt(sizes)} needs {fixed} devices, {num_devices} available")
    return sizes


def _fmt(sizes: Mapping[str, int]) -> str:
    return " x ".join(f"{a}={s}" for a, s in sizes.items())


def make_mesh(cfg: ml_collections.ConfigDict, devices: Sequence[Any] | None = None) -> Mesh:
    """A Mesh with axes `MESH_AXES` sized by `cfg` over `devices` (default: all devices).

    Uses `jax.make_mesh`, which orders devices for the physical topology on TPU."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = resolve_mesh_shape(cfg, len(devices))
    kinds = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    if cfg.axis_types not in kinds:
        raise MeshConfigError(f"mesh.axis_types must be one of {sorted(kinds)}, got "
                              f"{cfg.axis_types!r}")
    shape = tuple(sizes[a] for a in MESH_AXES)
    return jax.make_mesh(shape, MESH_AXES, axis_types=(kinds[cfg.axis_types],) * len(MESH_AXES),
                         devices=devices)


def is_multi_process_env(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment describes a multi-process run (multi-host TPU slice, explicit JAX
    coordinator variables, or a multi-task SLURM job)."""
    env = os.environ if environ is None else environ
    hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    if len(hosts) > 1:
        return True
    if int(env.get("MEGASCALE_NUM_SLICES", "1") or 1) > 1:
        return True
    if int(env.get("JAX_NUM_PROCESSES", "1") or 1) > 1:
        return True
    if env.get("JAX_COORDINATOR_ADDRESS"):
        return True
    return int(env.get("SLURM_NTASKS", "1") or 1) > 1


GOOGLE_PCI_VENDOR = "0x1ae0"   # Google's PCI vendor id: TPU chips, but also gVNIC and NVMe
# The PCI device ids of TPU chips, as JAX's own check (jax/_src/hardware_utils.py) lists them:
# v2/v3, an unnamed one, v4, v5p, v5e, v6e, TPU7x. Google's other devices (gVNIC 0x0042, the
# persistent-disk NVMe controller 0x001f) are on every plain GCE VM and are not TPU chips.
TPU_PCI_DEVICE_IDS = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f",
                                "0x0076"})


def _tpu_device_ids() -> frozenset[str]:
    """`TPU_PCI_DEVICE_IDS`, plus those of chips newer than this file that the installed JAX
    knows (a private table, read when present)."""
    try:
        from jax._src import hardware_utils

        return TPU_PCI_DEVICE_IDS | frozenset(
            str(k).lower() for k in getattr(hardware_utils, "_TPU_PCI_DEVICE_IDS", {}))
    except Exception:  # noqa: BLE001 - the private table moved: the list above still holds
        return TPU_PCI_DEVICE_IDS


def tpu_chips_present(pci_root: str = "/sys/bus/pci/devices") -> bool:
    """Whether this machine has TPU chips on its PCI bus: a Cloud TPU VM (no backend is
    touched, so it is safe before ``jax.distributed.initialize``). A device counts when its
    vendor is Google's and its device id is a TPU chip's (`TPU_PCI_DEVICE_IDS`): a plain GCE
    VM, whose gVNIC and NVMe devices are Google's too, has none."""
    try:
        names = os.listdir(pci_root)
    except OSError:
        return False
    ids = _tpu_device_ids()
    for name in names:
        try:
            with open(os.path.join(pci_root, name, "vendor")) as f:
                if f.read().strip().lower() != GOOGLE_PCI_VENDOR:
                    continue
            with open(os.path.join(pci_root, name, "device")) as f:
                if f.read().strip().lower() in ids:
                    return True
        except OSError:
            continue
    return False


def maybe_initialize_distributed(cfg: ml_collections.ConfigDict, *,
                                 environ: Mapping[str, str] | None = None,
                                 initialize: Callable[..., None] | None = None,
                                 on_tpu_vm: Callable[[], bool] = tpu_chips_present) -> bool:
    """Call `jax.distributed.initialize()` when this is a multi-process run; no-op on one host.

    Must run before anything touches a JAX backend. `cfg.distributed`: "auto" initialises when
    `is_multi_process_env(environ)` or on a Cloud TPU VM (`on_tpu_vm`: TPU chips on the PCI
    bus). A TPU VM reached over ssh sets none of the multi-process variables; there,
    `jax.distributed.initialize()` with no arguments is the documented way (it reads the slice's
    workers from the TPU metadata; on a one-host slice it is one process). "always" / "never"
    force it. Already initialised -> no-op. `initialize` replaces `jax.distributed.initialize`
    (tests). Returns whether it initialised."""
    mode = cfg.distributed
    if mode not in ("auto", "always", "never"):
        raise MeshConfigError(f"mesh.distributed must be auto | always | never, got {mode!r}")
    if mode == "never" or (mode == "auto" and not is_multi_process_env(environ)
                           and not on_tpu_vm()):
        return False
    if jax.distributed.is_initialized():
        return False
    kwargs: dict[str, Any] = {}
    env = os.environ if environ is None else environ
    if cfg.coordinator_address:
        kwargs["coordinator_address"] = cfg.coordinator_address
    # JAX reads JAX_COORDINATOR_ADDRESS itself; the process count and index come from the config,
    # else from JAX_NUM_PROCESSES / JAX_PROCESS_ID (what scripts/tpu_pod_run.sh's local workers
    # set), else from JAX's cluster detection (a TPU VM's metadata).
    if cfg.num_processes > 0:
        kwargs["num_processes"] = int(cfg.num_processes)
    elif env.get("JAX_NUM_PROCESSES"):
        kwargs["num_processes"] = int(env["JAX_NUM_PROCESSES"])
    if cfg.process_id >= 0:
        kwargs["process_id"] = int(cfg.process_id)
    elif env.get("JAX_PROCESS_ID"):
        kwargs["process_id"] = int(env["JAX_PROCESS_ID"])
    if cfg.get("heartbeat_timeout_s", 0) > 0:
        kwargs["heartbeat_timeout_seconds"] = int(cfg.heartbeat_timeout_s)
    # CPU devices of different processes talk through gloo (TPU and GPU ignore this setting):
    # this is what lets a multi-process run be tested on one machine.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    (initialize or jax.distributed.initialize)(**kwargs)
    logger.info("jax.distributed initialised: %s", kwargs or "auto-detected")
    return True


# ----------------------------------------------------------------------------------------------
# Rules and partition specs
# ----------------------------------------------------------------------------------------------

def rules_from_config(rules: Mapping[str, Any]) -> dict[str, tuple[str, ...] | None]:
    """Normalise a rules table: each value a mesh-axis string ("fsdp", "data,fsdp", "" = None),
    a tuple/list of mesh axes, or None -> {logical: tuple of mesh axes | None}."""
    out: dict[str, tuple[str, ...] | None] = {}
    for name, value in dict(rules).items():
        if value is None:
            axes: tuple[str, ...] = ()
        elif isinstance(value, str):
            axes = tuple(a.strip() for a in value.split(",") if a.strip())
        elif isinstance(value, (tuple, list)):
            axes = tuple(value)
        else:
            raise TypeError(f"rule {name!r}: expected str, tuple or None, got {value!r}")
        unknown = [a for a in axes if a not in MESH_AXES]
        if unknown:
            raise MeshConfigError(f"rule {name!r} names unknown mesh axes {unknown}; "
                                  f"mesh axes are {MESH_AXES}")
        out[name] = axes or None
    return out


_WARNED: set[tuple[str, str, int]] = set()


def logical_to_pspec(axes: Sequence[str | None], rules: Mapping[str, Any], *,
                     shape: Sequence[int] | None = None,
                     mesh: Mesh | None = None) -> PartitionSpec:
    """PartitionSpec for an array with logical `axes` (see the module docstring for the policy).

    Args:
      axes: one logical name (or None) per dim.
      rules: logical -> mesh axes; raw config values are accepted (normalised here).
      shape: the array shape; with `mesh`, enables the size-1 and divisibility policy.
      mesh: the mesh whose axis sizes the divisibility policy uses.
    """
    rules = _normalised(rules)
    if shape is not None and len(shape) != len(axes):
        raise ValueError(f"logical axes {tuple(axes)} have rank {len(axes)}, shape {tuple(shape)} "
                         f"has rank {len(shape)}")
    sizes = dict(mesh.shape) if mesh is not None else None
    used: set[str] = set()
    spec: list[Any] = []
    for dim, name in enumerate(axes):
        if name is None:
            spec.append(None)
            continue
        if name not in rules:
            raise UnknownLogicalAxisError(
                f"logical axis {name!r} has no rule; known: {', '.join(sorted(rules))} "
                f"(map it to None to replicate it)")
        kept: list[str] = []
        product = 1
        for mesh_axis in rules[name] or ():
            if mesh_axis in used:
                continue
            if sizes is not None:
                if mesh_axis not in sizes:
                    raise MeshConfigError(f"rule {name!r} uses mesh axis {mesh_axis!r} that the "
                                          f"mesh {tuple(sizes)} lacks")
                size = sizes[mesh_axis]
                if size == 1:
                    continue
                if shape is not None and shape[dim] % (product * size):
                    key = (name, mesh_axis, int(shape[dim]))
                    if key not in _WARNED:
                        _WARNED.add(key)
                        logger.warning(
                            "logical axis %r (dim size %d) is not sharded over mesh axis %r "
                            "(size %d, already sharded %d-way): not divisible; that part is "
                            "replicated", name, shape[dim], mesh_axis, size, product)
                    continue
                product *= size
            kept.append(mesh_axis)
            used.add(mesh_axis)
        spec.append(None if not kept else kept[0] if len(kept) == 1 else tuple(kept))
    while spec and spec[-1] is None:
        spec.pop()
    return PartitionSpec(*spec)


def _normalised(rules: Mapping[str, Any]) -> dict[str, tuple[str, ...] | None]:
    if isinstance(rules, ml_collections.ConfigDict):
        rules = rules.to_dict()
    return rules_from_config(rules)


def logical_sharding(axes: Sequence[str | None], shape: Sequence[int], mesh: Mesh,
                     rules: Mapping[str, Any]) -> NamedSharding:
    """NamedSharding on `mesh` for one array with logical `axes` and `shape`."""
    return NamedSharding(mesh, logical_to_pspec(axes, rules, shape=shape, mesh=mesh))


def _is_axes(x: Any) -> bool:
    return isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)


def shardings_for(axes_tree: Any, shapes_tree: Any, mesh: Mesh, rules: Mapping[str, Any]) -> Any:
    """Pytree of NamedSharding: for each leaf of `axes_tree` (a tuple of logical names) the
    sharding of the matching leaf of `shapes_tree` (array, ShapeDtypeStruct or shape tuple).

    The two trees must have the same structure down to the axes tuples."""
    rules = _normalised(rules)

    def one(axes: tuple, leaf: Any) -> NamedSharding:
        shape = tuple(leaf) if _is_axes_free_shape(leaf) else tuple(leaf.shape)
        return logical_sharding(axes, shape, mesh, rules)

    try:
        return jax.tree.map(one, axes_tree, shapes_tree, is_leaf=_is_axes)
    except ValueError as e:
        raise ValueError(f"axes tree and shapes tree differ in structure: {e}") from None


def _is_axes_free_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, (int, np.integer)) for d in x)


def replicated(mesh: Mesh) -> NamedSharding:
    """Fully replicated sharding on `mesh`."""
    return NamedSharding(mesh, PartitionSpec())


def _put(x: Any, sharding: NamedSharding) -> jax.Array:
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    # Multi-host: every host holds the same global value; each builds its own shards from it.
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def place(tree: Any, shardings: Any) -> Any:
    """Put every array of `tree` on the matching sharding of `shardings` (same structure).

    On multi-host meshes the values must be identical on every host (global arrays)."""
    return jax.tree.map(_put, tree, shardings)


def shard_params(params: Any, axes_tree: Any, mesh: Mesh, rules: Mapping[str, Any]) -> Any:
    """Params placed by the rules: `place(params, shardings_for(axes_tree, params, ...))`."""
    return place(params, shardings_for(axes_tree, params, mesh, rules))


# ----------------------------------------------------------------------------------------------
# Optimizer state
# ----------------------------------------------------------------------------------------------

def optimizer_state_shardings(tx: Any, opt_state: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """Shardings for an optax state: every params-shaped subtree (Adam's mu, nu, ...) takes the
    params' shardings, every other leaf (step counts, scalars) is replicated.

    `opt_state` may be abstract (`jax.eval_shape(tx.init, params)`)."""
    import optax  # local: optax is only needed by callers that shard optimizer state

    return optax.tree_map_params(tx, lambda _, s: s, opt_state, param_shardings,
                                 transform_non_params=lambda _: replicated(mesh))


def init_sharded_optimizer_state(tx: Any, params: Any, param_shardings: Any, mesh: Mesh) -> Any:
    """`tx.init(params)` computed directly into its sharded layout (no replicated copy)."""
    abstract = jax.eval_shape(tx.init, params)
    shardings = optimizer_state_shardings(tx, abstract, param_shardings, mesh)
    return jax.jit(tx.init, out_shardings=shardings)(params)


# ----------------------------------------------------------------------------------------------
# Batches and activations (KV-cache shardings: ace_jax.runtime.placement.KV_CACHE_AXES)
# ----------------------------------------------------------------------------------------------

def batch_axes(ndim: int) -> tuple[str | None, ...]:
    """Default logical axes of a batch array: ('batch', None, ...)."""
    return ("batch",) + (None,) * (ndim - 1) if ndim else ()


def shard_batch(batch: Any, mesh: Mesh, rules: Mapping[str, Any],
                axes_tree: Any | None = None) -> Any:
    """Place a pytree of host arrays [B, ...] sharded on the leading (batch) dim.

    `axes_tree` overrides the default `batch_axes` per leaf (same structure as `batch`)."""
    if axes_tree is None:
        axes_tree = jax.tree.map(lambda x: batch_axes(np.ndim(x)), batch)
    return place(batch, shardings_for(axes_tree, jax.tree.map(np.shape, batch), mesh, rules))


def with_logical_constraint(x: jax.Array, axes: Sequence[str | None], mesh: Mesh,
                            rules: Mapping[str, Any]) -> jax.Array:
    """`jax.lax.with_sharding_constraint` of an activation by its logical axes (inside jit)."""
    return jax.lax.with_sharding_constraint(x, logical_sharding(axes, x.shape, mesh, rules))
