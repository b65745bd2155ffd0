"""A training run directory as a policy reads it: its files (`resolve_run`: config, tokenizer,
checkpoint directory), its ``config.json`` (`read_run_config`), the model config and mesh it
trained with (`run_model_config`, `run_placement`), its parameters restored onto a placement
(`load_run_model`) and where they would go without reading them (`restore_plan`).

Nothing here runs at import time; JAX is imported lazily.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Mapping, Optional, Sequence, Union

from ace_jax.policy.interface import PolicyError
from ace_jax.runtime import storage


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """Where the pieces of a training run directory live (see ``resolve_run``).

    Attributes:
      workdir: the run directory.
      config: its ``config.json`` as a dict (the full training config).
      tokenizer_dir: the local tokenizer directory the run trained with.
      checkpoint_dir: the Orbax checkpoint directory (local path or ``gs://`` URL).
    """
    workdir: str
    config: dict
    tokenizer_dir: str
    checkpoint_dir: str


def read_run_config(workdir: Union[str, os.PathLike]) -> dict:
    """``<workdir>/config.json`` of a training run (local or gs://) as a dict.

    Raises:
      PolicyError: no such directory, no / unreadable config.json, or one without a ``model``
        section (not a training run's config).
    """
    workdir = os.fspath(workdir)
    cfg_path = storage.join(workdir, "config.json")
    if not storage.is_url(workdir) and not os.path.isdir(workdir):
        raise PolicyError(f"run directory {workdir!r} does not exist")
    try:
        text = storage.read_text(cfg_path)
    except FileNotFoundError:
        raise PolicyError(f"{workdir!r} is not a training run directory: no config.json") \
            from None
    except OSError as e:
        raise PolicyError(f"{cfg_path} is unreadable: {e}") from e
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise PolicyError(f"{cfg_path} is unreadable: {e}") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise PolicyError(f"{cfg_path} has no 'model' section: not a training run config")
    return cfg


def resolve_run(workdir: str) -> RunFiles:
    """Finds the config, tokenizer and checkpoint directory of a run (local or gs://), as the
    trainer chose them.

    The tokenizer is, in the trainer's order: ``model.tokenizer_path``, else
    ``<model.init_from_run>/tokenizer``, else ``<workdir>/tokenizer``; a gs:// one is read from
    its local copy (``runtime.storage.local_copy``).

    Raises:
      PolicyError: no such directory, no / unreadable config.json, no tokenizer.
    """
    workdir = os.fspath(workdir)
    cfg = read_run_config(workdir)
    model = cfg["model"]
    tok_path = (model.get("tokenizer_path")
                or (storage.join(model["init_from_run"], "tokenizer")
                    if model.get("init_from_run") else storage.join(workdir, "tokenizer")))
    if not storage.exists(storage.join(tok_path, "tokenizer.json")):
        raise PolicyError(f"no tokenizer at {tok_path!r} (run {workdir!r})")
    ckpt_dir = ((cfg.get("checkpoint") or {}).get("directory")
                or storage.join(workdir, "checkpoints"))
    from models import tokenizer as tok_lib   # stdlib only at import: transformers is lazy

    return RunFiles(workdir=workdir, config=cfg, tokenizer_dir=storage.local_copy(
        tok_path, files=tok_lib.TOKENIZER_FILES), checkpoint_dir=ckpt_dir)


def _hf_model_config(hf_path: str, overrides: Mapping[str, Any]):
    """The ModelConfig ``hf_mapping.load_hf_model(hf_path, **overrides)`` builds, from config.json
    alone (no weights are read)."""
    from models.configs import RUNTIME_FIELDS, ModelConfig

    url = str(hf_path).rstrip("/") + "/config.json"
    try:
        if "://" in url:
            import fsspec

            with fsspec.open(url, "r") as f:
                hf_cfg = json.load(f)
        else:
            with open(url, encoding="utf-8") as f:
                hf_cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise PolicyError(f"cannot read the model config {url!r}: {e}") from e
    overrides = dict(overrides)
    runtime = {k: overrides.pop(k) for k in list(overrides) if k in RUNTIME_FIELDS}
    config = ModelConfig.from_hf_dict(hf_cfg, **runtime)
    return config.replace(**overrides) if overrides else config


def run_model_config(run: RunFiles, vocab_size: int, _depth: int = 0):
    """The ModelConfig the trainer built for ``run`` (``Trainer._build_model``): the config of
    ``model.init_from_run`` when set, else the HF config of ``model.hf_path`` (+ ``runtime``),
    else the preset + overrides with ``vocab_size`` (the run tokenizer's length)."""
    from models import configs as model_configs

    model = run.config["model"]
    if model.get("init_from_run"):
        if _depth > 16:
            raise PolicyError(f"model.init_from_run chain is too deep at {run.workdir!r}")
        parent = resolve_run(model["init_from_run"])
        from models import tokenizer as tok_lib

        parent_vocab = len(tok_lib.load_tokenizer(parent.tokenizer_dir))
        return run_model_config(parent, parent_vocab, _depth + 1)
    if model.get("hf_path"):
        return _hf_model_config(model["hf_path"], model.get("runtime") or {})
    if not model.get("preset"):
        raise PolicyError(f"{run.workdir!r}: config.json names no model.preset nor model.hf_path")
    overrides = dict(model.get("overrides") or {})
    overrides["vocab_size"] = vocab_size
    try:
        return model_configs.get_model_config(model["preset"], **overrides)
    except (KeyError, TypeError, ValueError) as e:
        raise PolicyError(f"{run.workdir!r}: cannot build model preset "
                          f"{model['preset']!r}: {e}") from e


SINGLE_DEVICE = "single_device"   # load_run_model(shardings=...): the old placement, one device


def run_mesh_config(run_config: Mapping[str, Any]):
    """The ``mesh`` section a run trained with (its saved ``config.json``, over
    ``sharding.default_config()``): axis sizes, axis type and the rules table. Its
    ``distributed`` / coordinator fields are those of the training launch and are not used
    here."""
    import ml_collections

    from ace_jax.runtime import sharding

    cfg = sharding.default_config()
    saved = dict((run_config or {}).get("mesh") or {})
    for key in ("data", "fsdp", "tensor", "expert"):
        if key in saved:
            cfg[key] = int(saved[key])
    if saved.get("axis_types"):
        cfg.axis_types = str(saved["axis_types"])
    rules = dict(cfg.rules)
    rules.update({k: ("" if v is None else ",".join(v) if isinstance(v, (list, tuple)) else str(v))
                  for k, v in dict(saved.get("rules") or {}).items()})
    cfg.rules = ml_collections.ConfigDict(rules)
    return cfg


def _config_of(run_or_config) -> dict:
    if isinstance(run_or_config, RunFiles):
        return run_or_config.config
    if isinstance(run_or_config, (str, os.PathLike)):
        return read_run_config(run_or_config)
    if hasattr(run_or_config, "to_dict"):
        return run_or_config.to_dict()
    return dict(run_or_config)


def run_placement(run_or_config, devices: Optional[Sequence[Any]] = None):
    """The `Placement` the trainer built for a run (``Placement.from_config(cfg.mesh)``: its
    mesh axes and rules table, ``ace_jax/runtime/placement.py``) over ``devices`` (default: every
    device of every process; abstract TPU devices work too).

    ``run_or_config``: a run directory, its `RunFiles`, or a training config (dict /
    ConfigDict). When the saved axis sizes do not fit the number of devices (a 64-chip run served
    on 8), the mesh is refitted: ``expert`` kept where it divides the devices (else the largest
    divisor of both), ``data`` = ``tensor`` = 1 and ``fsdp`` the rest; the rules are kept.
    """
    import logging
    import math

    import jax

    from ace_jax.runtime import placement as placement_lib, sharding

    mesh_cfg = run_mesh_config(_config_of(run_or_config))
    devices = list(jax.devices() if devices is None else devices)
    try:
        sharding.resolve_mesh_shape(mesh_cfg, len(devices))
    except sharding.MeshConfigError as e:
        expert = math.gcd(max(1, int(mesh_cfg.expert)), len(devices))
        logging.getLogger(__name__).warning(
            "the run's mesh does not fit %d devices (%s): using fsdp=%d x expert=%d",
            len(devices), e, len(devices) // expert, expert)
        mesh_cfg.data, mesh_cfg.tensor, mesh_cfg.expert, mesh_cfg.fsdp = 1, 1, expert, -1
    return placement_lib.Placement.from_config(mesh_cfg, devices)


def default_placement(run_or_config):
    """What ``load_run_model(shardings=None)`` and ``JaxPolicy.from_run`` use: the run's own
    `run_placement` over every device when there are several devices or processes, else None
    (the one device)."""
    import jax

    if jax.process_count() > 1 or jax.device_count() > 1:
        return run_placement(run_or_config)
    return None


def abstract_params(model_cfg):
    """(graphdef, abstract parameters) of a `Qwen3ForCausalLM` of ``model_cfg``: shapes and
    dtypes only (``nnx.eval_shape``), nothing allocated; what a checkpoint is checked and
    restored against."""
    from flax import nnx

    from models import qwen3

    abstract = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param)


def load_run_model(workdir, *, step: Optional[int] = None, shardings: Optional[Any] = None):
    """(model, tokenizer, step) of a training run directory; see ``JaxPolicy.from_run``.

    ``step=None`` takes the newest complete checkpoint (corrupt or unfinished newer ones are
    logged and skipped). Nothing is written to the run directory. ``workdir``: the run
    directory or its `RunFiles`.

    ``shardings``, where the parameters go (each is restored straight into its shardings by
    Orbax from ShapeDtypeStructs: each host reads only the slices its devices hold, and no
    device ever holds a whole parameter it is not given):

    * None (default): with several devices or processes, the run's own mesh and rules
      (`default_placement` -> `run_placement`: the trainer's ``Placement`` of the saved
      ``mesh`` section); with one device, that device.
    * a function of the abstract Param state giving each parameter's sharding (e.g.
      ``Placement.params``), or a `Placement`;
    * ``SINGLE_DEVICE``: every parameter on the first device (the whole model on one chip).

    Collective on a mesh that spans several processes: every process must call it with the same
    arguments (Orbax's restore synchronises them).

    Raises:
      PolicyError: no run directory / config.json / tokenizer / checkpoint, or no checkpoint of
        ``step`` (the message lists the steps present).
      checkpoint.CheckpointMismatchError: the checkpoint holds another model size (naming the
        first mismatching tensor).
      checkpoint.CheckpointCorruptError: checkpoint ``step`` (given explicitly) is unreadable.
    """
    import logging

    import jax
    from flax import nnx

    from ace_jax.runtime import checkpoint as ckpt_lib
    from models import tokenizer as tok_lib

    run = workdir if isinstance(workdir, RunFiles) else resolve_run(workdir)
    tokenizer = tok_lib.load_tokenizer(run.tokenizer_dir)
    model_cfg = run_model_config(run, len(tokenizer))
    graphdef, params_shape = abstract_params(model_cfg)
    if shardings is None:
        placement = default_placement(run)
        shardings = None if placement is None else placement.params
    elif isinstance(shardings, str):
        if shardings != SINGLE_DEVICE:
            raise ValueError(f"shardings must be None, {SINGLE_DEVICE!r}, a Placement or a "
                             f"function of the param state, got {shardings!r}")
        shardings = None
    elif hasattr(shardings, "params") and hasattr(shardings, "mesh"):   # a Placement
        shardings = shardings.params
    if shardings is not None:
        params_shape = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params_shape,
            shardings(params_shape))
    ckpt_dir = run.checkpoint_dir
    # Checkpointer creates its directory: never let it do so in someone's run directory.
    if "://" not in ckpt_dir and not os.path.isdir(ckpt_dir):
        raise PolicyError(f"no checkpoint in {ckpt_dir!r} (the directory does not exist)")
    ckpt = ckpt_lib.Checkpointer(ckpt_dir, keep=None, async_save=False)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise PolicyError(f"no checkpoint in {ckpt_dir!r}")
        if step is not None:
            step = int(step)
            if step not in steps:
                raise PolicyError(f"no checkpoint of step {step} in {ckpt_dir!r}; have {steps}")
            params = ckpt.restore_params(step, params_shape)
        else:
            params, errors = None, []
            for s in reversed(steps):
                try:
                    params, step = ckpt.restore_params(s, params_shape), s
                    break
                except ckpt_lib.CheckpointCorruptError as e:
                    logging.getLogger(__name__).warning("skipping checkpoint: %s", e)
                    errors.append(e)
            if params is None:
                raise PolicyError(f"no complete checkpoint in {ckpt_dir!r} (steps {steps}): "
                                  f"{errors[0]}") from errors[0]
    finally:
        ckpt.close()
    return nnx.merge(graphdef, params), tokenizer, step


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _plan_model_config(config: Mapping[str, Any]):
    """The ModelConfig of a training config without reading anything: the preset with its
    overrides, plus the ``runtime`` fields when ``hf_path`` is set (as the dry run builds it:
    the architecture of an HF run is its preset's)."""
    from models import configs as model_configs

    m = dict(config.get("model") or {})
    overrides = dict(m.get("overrides") or {})
    if m.get("hf_path") and m.get("runtime"):
        overrides.update(dict(m["runtime"]))
    return model_configs.get_model_config(m["preset"], **overrides)


def restore_plan(run_or_config, *, devices: Optional[Sequence[Any]] = None,
                 topology: Optional[str] = None, model_config: Any = None) -> dict:
    """Where ``load_run_model`` (with its default, the run's own mesh) would put each parameter,
    and how many bytes that leaves on each device; nothing is read, nothing allocated.

    Args:
      run_or_config: a run directory (its model config and tokenizer are read, no weights), its
        `RunFiles`, or a training config (dict / ConfigDict, e.g. ``configs/ace30b.py``'s: the
        architecture then comes from ``model.preset`` + overrides, as in the dry run).
      devices: the devices of the mesh (default every device); ``topology``: instead, the
        abstract devices of a TPU slice (``"v5p:4x4x4"``; needs libtpu, no TPU).
      model_config: the `ModelConfig` to use instead of the one the run names.

    Returns a dict: ``devices``, ``mesh`` (axis -> size), ``param_dtype``, ``total_bytes`` (every
    parameter once), ``per_device_bytes`` {max, min, mean} (what each device holds),
    ``largest`` (the 5 parameters with the most bytes per device: name, shape, spec, bytes,
    bytes per device), ``hbm_bytes`` / ``hbm_fraction`` (max per-device bytes over the chip's
    HBM when the devices are TPU chips the compiler knows, else None) and ``export_block``: the
    largest block ``ace_jax.policy.export.export_run`` would read at once from a checkpoint this
    mesh saved (Orbax stores each array in chunks of its shards, split below 400 MiB on GCS /
    2 GiB elsewhere; a block is one chunk range of the stacked axes with the trailing axes
    whole): {name, bytes, gcs} for a ``gs://`` checkpoint directory (``checkpoint.directory`` or
    ``workdir``), else local.
    """
    import numpy as np

    if topology:
        from ace_jax.runtime import tpu_compile

        devices = list(tpu_compile.topology_devices(topology))
    config = _config_of(run_or_config)
    if model_config is None:
        if isinstance(run_or_config, (str, os.PathLike, RunFiles)):
            from models import tokenizer as tok_lib

            run = run_or_config if isinstance(run_or_config, RunFiles) \
                else resolve_run(run_or_config)
            model_config = run_model_config(run, len(tok_lib.load_tokenizer(run.tokenizer_dir)))
        else:
            model_config = _plan_model_config(config)
    placement = run_placement(config, devices)
    _, params_shape = abstract_params(model_config)
    shardings = placement.params(params_shape)
    from flax import nnx

    per_device: dict[Any, int] = {d: 0 for d in placement.mesh.devices.flat}
    rows, total = [], 0
    for (path, var), (_, sh) in zip(nnx.to_flat_state(params_shape), nnx.to_flat_state(shardings)):
        x = var.get_value() if isinstance(var, nnx.Variable) else var
        sharding = sh.get_value() if isinstance(sh, nnx.Variable) else sh
        itemsize = np.dtype(x.dtype).itemsize
        nbytes = int(np.prod(x.shape)) * itemsize
        total += nbytes
        shard = int(np.prod(sharding.shard_shape(x.shape))) * itemsize
        for d in sharding.device_set:
            per_device[d] += shard
        rows.append(dict(name="/".join(str(p) for p in path), shape=tuple(x.shape),
                         spec=str(sharding.spec), bytes=nbytes, bytes_per_device=shard,
                         shard_shape=tuple(sharding.shard_shape(x.shape))))
    values = list(per_device.values())
    gcs = str((config.get("checkpoint") or {}).get("directory") or config.get("workdir") or "")
    block = _export_block(model_config, rows, gcs.startswith("gs://"))
    hbm = None
    try:
        if devices is not None and getattr(devices[0], "platform", "") == "tpu":
            from ace_jax.runtime import tpu_compile

            hbm = tpu_compile.hbm_bytes(devices[0])
    except Exception:  # noqa: BLE001 - the fraction is a nicety
        hbm = None
    first = next(iter(jax_leaves(params_shape)), None)
    return dict(devices=len(values), mesh=dict(placement.mesh.shape),
                param_dtype=str(first.dtype) if first is not None else None, total_bytes=total,
                per_device_bytes=dict(max=max(values), min=min(values),
                                      mean=sum(values) / len(values)),
                largest=sorted(rows, key=lambda r: -r["bytes_per_device"])[:5],
                hbm_bytes=hbm, hbm_fraction=None if not hbm else max(values) / hbm,
                export_block=block)


def _export_block(model_config, rows: list, gcs: bool) -> dict:
    """The largest read block of a streaming export of a checkpoint saved in the shards of
    ``rows`` (see `restore_plan`)."""
    import math

    import numpy as np
    from orbax.checkpoint._src.arrays import subchunking

    from models import hf_mapping

    leading = {name: len(items[0].index)
               for name, items in hf_mapping.export_plan(model_config).items()}
    target = (400 if gcs else 2048) * 2**20   # Orbax's OCDBT target data file sizes
    best = dict(name=None, bytes=0, chunk=None, gcs=gcs)
    for r in rows:
        itemsize = r["bytes"] // max(1, math.prod(r["shape"]))
        shard = tuple(int(n) for n in r["shard_shape"])
        # as Orbax's tensorstore_utils.calculate_chunk_byte_size: split only above the target
        chunk = subchunking.choose_chunk_shape(
            r["shape"], shard, np.dtype(f"V{itemsize}"),
            target if r["bytes_per_device"] > target else None)
        n = leading.get(r["name"], 0)
        nbytes = math.prod(chunk[:n]) * math.prod(r["shape"][n:]) * itemsize
        if nbytes > best["bytes"]:
            best = dict(name=r["name"], bytes=int(nbytes), chunk=tuple(int(c) for c in chunk),
                        gcs=gcs)
    return best
