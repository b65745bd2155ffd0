"""Orbax checkpoints of the training state, with validation and fallback on restore.

A checkpoint of step s holds one `TrainState`:

    params        pytree of arrays (sharded or not)
    opt_state     optax state pytree
    step          int (also the step directory name)
    rng           a typed PRNG key (stored as its key data + the implementation name)
    sampler_state arbitrary JSON (buffer cursor, LP sampler statistics, ...)

Layout: `<directory>/<step>/{params,opt_state,rng,meta}/` written by an Orbax
`CheckpointManager` (items `params`, `opt_state`, `rng`: `StandardSave`; `meta`: `JsonSave`
with step, rng implementation, sampler state and a format version). Orbax writes into
`<step>.orbax-checkpoint-tmp-*` and renames when complete, leaving `commit_success.txt` in the
step dir; an unrenamed tmp dir is an unfinished save. `directory` may be a local path or `gs://`
(etils/gcsfs for files, tensorstore for arrays; tested against the gcp-storage-emulator with
`use_ocdbt=False`: the emulator sends no object generation with a read, which OCDBT's conditional
manifest writes need; real GCS does).

Saves are asynchronous by default: `save` returns once the arrays are copied off the device and
the write continues in the background; `wait_until_finished()` / `close()` (or leaving the `with`
block) block until it is on disk. `keep` bounds how many complete checkpoints are retained.

Restore checks, in order, and raises `CheckpointCorruptError` (naming the step and the problem)
for: an unfinished (tmp) or missing step dir, a missing `commit_success.txt`, unreadable
`_CHECKPOINT_METADATA`, a missing item, unreadable `meta` JSON, unreadable array metadata, and
any failure reading array data (deleted or truncated files). Before reading any data it compares
the saved tree with the target: a different structure, shape or dtype raises
`CheckpointMismatchError` naming the first mismatching leaf (e.g. restoring another model size).
`restore_latest` walks the steps newest first, logs and skips corrupt ones, returns None when
there is no checkpoint at all, and raises `CheckpointCorruptError` when every one is corrupt;
corrupt steps newer than the one restored are renamed `<step>.corrupt` so they can be re-saved.

Several processes (a multi-host run): every process makes the same calls (Orbax's own barriers
are collective). The processes meet at a barrier of their own before the manager is created
(`multihost.barrier`, with its long timeout: they arrive minutes apart, while Orbax's own
barriers give up after 300 s when they go through the distributed client); deleting or renaming
step folders (`delete_after`, `restore_latest`'s quarantine) is done by process 0 alone, between
barriers. A peer lost during any of these raises `multihost.PeerLostError`, never a corrupt
checkpoint.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from ace_jax.runtime import multihost

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ARRAY_ITEMS = ("params", "opt_state", "rng")
ITEMS = ARRAY_ITEMS + ("meta",)
COMMIT_MARKER = "commit_success.txt"
_TMP_RE = re.compile(r"^(\d+)\.orbax-checkpoint-tmp")

__all__ = [
    "CheckpointError",
    "CheckpointCorruptError",
    "CheckpointMismatchError",
    "TrainState",
    "Checkpointer",
    "default_config",
]


def bytes_read() -> int:
    """Bytes this process's tensorstore key-value stores (file, gcs, ...) have read so far."""
    import tensorstore as ts

    return int(sum(v.get("value", 0)
                   for m in ts.experimental_collect_matching_metrics("/tensorstore/kvstore/")
                   if m["name"].endswith("/bytes_read") for v in m["values"]))


class CheckpointError(Exception):
    """Base class of checkpoint errors."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint step that is incomplete or unreadable; `step` names it."""

    def __init__(self, step: int, problem: str):
        super().__init__(f"checkpoint step {step} is corrupt or incomplete: {problem}")
        self.step = step
        self.problem = problem


class CheckpointMismatchError(CheckpointError, ValueError):
    """The saved tree does not fit the restore target (structure, shape or dtype)."""


@dataclasses.dataclass
class TrainState:
    """What a checkpoint holds.

    Attributes:
      step: the number of completed optimizer steps.
      params: pytree of arrays.
      opt_state: optax state pytree for `params`.
      rng: typed PRNG key (`jax.random.key(...)`), any shape.
      sampler_state: JSON-serialisable value (dict, list, str, numbers, bool, None).
    """
    step: int
    params: Any
    opt_state: Any
    rng: jax.Array
    sampler_state: Any = None


def default_config() -> ml_collections.ConfigDict:
    """The `checkpoint` config section."""
    cfg = ml_collections.ConfigDict()
    cfg.directory = ""              # local path or gs://bucket/path; "" disables checkpointing
    cfg.keep = 3                    # complete checkpoints retained (oldest deleted first)
    cfg.save_interval_steps = 1     # `save` is a no-op on other steps unless force=True
    cfg.async_save = True
    # Orbax's OCDBT layout (one small database per item; its manifest is updated with
    # conditional writes). False: a zarr folder per array, for a store without working
    # conditional writes (gcp-storage-emulator: no x-goog-generation on reads).
    cfg.use_ocdbt = True
    return cfg


def _path_str(path: tuple) -> str:
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _leaf_signature(x: Any) -> tuple[tuple[int, ...], str]:
    return tuple(int(d) for d in x.shape), str(np.dtype(x.dtype))


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def _rng_parts(key: jax.Array) -> tuple[jax.Array, str | None]:
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key), str(jax.random.key_impl(key))
    return key, None   # a raw uint32 key


class Checkpointer:
    """Save / restore `TrainState`s under one directory (see the module docstring).

    Args:
      directory: local path or gs:// URL.
      keep: number of complete checkpoints kept (None keeps all).
      save_interval_steps: `save` only writes on multiples of this, unless `force=True`.
      async_save: write in the background.
      use_ocdbt: Orbax's OCDBT array layout (False: a zarr folder per array).
    """

    def __init__(self, directory: str, *, keep: int | None = 3, save_interval_steps: int = 1,
                 async_save: bool = True, use_ocdbt: bool = True):
        if not directory:
            raise ValueError("checkpoint directory is empty")
        if save_interval_steps < 1:
            raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}")
        # Orbax needs absolute local paths; URLs (gs://...) pass through.
        self.directory = epath.Path(directory if "://" in str(directory)
                                    else os.path.abspath(directory))
        self.save_interval_steps = int(save_interval_steps)
        if use_ocdbt and str(directory).startswith("gs://") and os.environ.get(
                "STORAGE_EMULATOR_HOST"):
            # Only against a GCS emulator (the pod rehearsal, tests): it sends no object
            # generation with a read, which OCDBT's conditional manifest writes need; real GCS
            # does, so a pod keeps OCDBT.
            logging.warning("checkpoints in %s go to a GCS emulator (STORAGE_EMULATOR_HOST): "
                            "Orbax's OCDBT layout is off", directory)
            use_ocdbt = False
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, save_interval_steps=1, create=True,
            enable_async_checkpointing=async_save)
        handlers = {item: ocp.StandardCheckpointHandler(use_ocdbt=use_ocdbt)
                    for item in ARRAY_ITEMS}
        handlers["meta"] = ocp.JsonCheckpointHandler()
        # The hosts of a run get here minutes apart (each loads its slices of the weights and
        # stages its tasks first), and the manager's first act is a barrier of Orbax's (the
        # directory's creation), whose timeout is 300 s (orbax multihost.coordination_timeout,
        # when its barriers go through the distributed client; else a device collective). Meet
        # first at a barrier of our own that waits up to `multihost.BARRIER_TIMEOUT_S`, so
        # Orbax's finds every host there.
        multihost.barrier("before-checkpoint-manager")
        with multihost.lost_peer_guard(f"creating the checkpoint manager of {self.directory}"):
            self._manager = ocp.CheckpointManager(self.directory, options=options,
                                                  item_handlers=handlers)

    @classmethod
    def from_config(cls, cfg: ml_collections.ConfigDict) -> "Checkpointer":
        return cls(cfg.directory, keep=cfg.keep, save_interval_steps=cfg.save_interval_steps,
                   async_save=cfg.async_save, use_ocdbt=cfg.use_ocdbt)

    # ------------------------------------------------------------------ saving

    def save(self, state: TrainState, *, force: bool = False) -> bool:
        """Start saving `state` as step `state.step` if the step is a multiple of
        `save_interval_steps` (or `force`); returns whether a save was started."""
        if not force and int(state.step) % self.save_interval_steps:
            return False
        try:
            sampler_json = json.loads(json.dumps(state.sampler_state, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise TypeError(f"sampler_state is not JSON-serialisable: {e}") from None
        key_data, impl = _rng_parts(state.rng)
        meta = {"format_version": FORMAT_VERSION, "step": int(state.step), "rng_impl": impl,
                "sampler_state": sampler_json}
        args = ocp.args.Composite(
            params=ocp.args.StandardSave(state.params),
            opt_state=ocp.args.StandardSave(state.opt_state),
            rng=ocp.args.StandardSave({"key_data": key_data}),
            meta=ocp.args.JsonSave(meta))
        with multihost.lost_peer_guard(f"saving checkpoint step {int(state.step)}"):
            return bool(self._manager.save(int(state.step), args=args, force=force))

    def wait_until_finished(self) -> None:
        with multihost.lost_peer_guard(f"finishing a checkpoint save in {self.directory}"):
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves, then release the manager."""
        with multihost.lost_peer_guard(f"closing the checkpoints of {self.directory}"):
            self._manager.wait_until_finished()
            self._manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ listing

    def all_steps(self) -> list[int]:
        """Steps with a step directory (complete or not), ascending; unfinished tmp dirs excluded."""
        if not self.directory.exists():
            return []
        return sorted(int(p.name) for p in self.directory.iterdir()
                      if p.name.isdigit() and p.is_dir())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    def delete_after(self, step: int) -> list[int]:
        """Deletes every checkpoint newer than `step` (e.g. one whose companion buffer commit
        never landed), so those steps can be saved again; returns the deleted steps.

        Several processes: every one lists the steps, then they meet at a barrier (no folder
        is deleted while a host still lists or reads it); process 0 alone deletes the unfinished
        step folders (Orbax's `delete` of a finished step is collective, and also deletes on
        process 0 only); a last barrier holds every host until the folders are gone."""
        newer = [s for s in self.all_steps() if s > step]
        finished = set(self._manager.all_steps())
        multihost.barrier("checkpoint-delete-after-listed")
        with multihost.lost_peer_guard(f"deleting checkpoint steps {newer} of {self.directory}"):
            for s in newer:
                if s in finished:
                    self._manager.delete(s)
                elif jax.process_index() == 0:   # an unfinished save on an object store
                    (self.directory / str(s)).rmtree()   # (written in place: nothing renames)
        multihost.barrier("checkpoint-delete-after-deleted")
        self._manager.reload()
        return newer

    # ------------------------------------------------------------------ restoring

    def restore(self, step: int, target: TrainState) -> TrainState:
        """Restore step `step` into the structure, shapes, dtypes and shardings of `target`.

        `target` leaves may be arrays or `jax.ShapeDtypeStruct`s (with `.sharding` for a
        sharded restore); `target.step`, `target.sampler_state` and the value of `target.rng` are
        ignored (only the key's shape is used). Raises CheckpointCorruptError /
        CheckpointMismatchError (see the module docstring)."""
        self.wait_until_finished()
        step = int(step)
        self._check_complete(step)
        meta = self._read_meta(step)
        saved = self._read_array_metadata(step)
        key_data, _ = _rng_parts(target.rng)
        targets = {"params": target.params, "opt_state": target.opt_state,
                   "rng": {"key_data": key_data}}
        for item in ARRAY_ITEMS:
            _compare_trees(item, step, saved[item], targets[item])
        abstract = {k: jax.tree.map(_abstract, v) for k, v in targets.items()}
        args = ocp.args.Composite(**{k: ocp.args.StandardRestore(v) for k, v in abstract.items()})
        try:
            restored = self._manager.restore(step, args=args)
        except Exception as e:  # tensorstore / orbax raise many types for unreadable data
            multihost.raise_if_peer_lost(e, f"restoring checkpoint step {step}")
            raise CheckpointCorruptError(step, f"reading array data failed: "
                                               f"{type(e).__name__}: {_short(e)}") from e
        rng = restored["rng"]["key_data"]
        if meta["rng_impl"] is not None:
            rng = jax.random.wrap_key_data(rng, impl=meta["rng_impl"])
        return TrainState(step=meta["step"], params=restored["params"],
                          opt_state=restored["opt_state"], rng=rng,
                          sampler_state=meta["sampler_state"])

    def restore_params(self, step: int, params: Any) -> Any:
        """Only the parameters of step `step` (for inference and export: no optimizer state is
        read). `params` gives the structure, shapes and dtypes (arrays or ShapeDtypeStructs).
        Raises CheckpointCorruptError / CheckpointMismatchError like `restore`."""
        self.wait_until_finished()
        step = int(step)
        self._check_complete(step)
        _compare_trees("params", step, self._read_array_metadata(step)["params"], params)
        args = ocp.args.Composite(params=ocp.args.StandardRestore(jax.tree.map(_abstract, params)))
        before = bytes_read()
        try:
            out = self._manager.restore(step, args=args)["params"]
        except Exception as e:  # tensorstore / orbax raise many types for unreadable data
            multihost.raise_if_peer_lost(e, f"restoring the parameters of checkpoint step {step}")
            raise CheckpointCorruptError(step, f"reading array data failed: "
                                               f"{type(e).__name__}: {_short(e)}") from e
        # with sharded targets each host reads only its slices: this says how much it read
        logger.info("process %d read %d bytes of the parameters of checkpoint step %d in %s",
                    jax.process_index(), bytes_read() - before, step, self.directory)
        return out

    def restore_latest(self, target: TrainState, *, quarantine: bool = True) -> TrainState | None:
        """Restore the newest complete checkpoint; None when the directory holds none.

        Corrupt steps are logged and skipped; if every step is corrupt, raises the
        CheckpointCorruptError of the newest one. Mismatch errors are not skipped. With
        `quarantine`, the corrupt steps newer than the restored one are renamed to
        `<step>.corrupt[-k]` (by process 0) so the resumed run can save those steps again."""
        self.wait_until_finished()
        if self.directory.exists():
            for p in self.directory.iterdir():
                m = _TMP_RE.match(p.name)
                if m:
                    logger.warning("ignoring unfinished checkpoint save %s (step %s)", p, m[1])
        steps = self.all_steps()
        errors: list[CheckpointCorruptError] = []
        for step in reversed(steps):
            try:
                state = self.restore(step, target)
            except CheckpointCorruptError as e:
                logger.warning("skipping checkpoint: %s", e)
                errors.append(e)
                continue
            if errors:
                logger.warning("restored step %d after skipping corrupt step(s) %s", step,
                               [e.step for e in errors])
                if quarantine:
                    self._quarantine([e.step for e in errors])
            return state
        if errors:
            raise errors[0]
        return None

    def _quarantine(self, steps: list[int]) -> None:
        multihost.barrier("checkpoint-quarantine-read")   # every host is done reading them
        if jax.process_index() == 0:
            for step in steps:
                src = self.directory / str(step)
                dst = self.directory / f"{step}.corrupt"
                k = 0
                while dst.exists():
                    k += 1
                    dst = self.directory / f"{step}.corrupt-{k}"
                src.rename(dst)
                logger.warning("moved corrupt checkpoint step %d to %s", step, dst)
        multihost.barrier("checkpoint-quarantine-renamed")
        self._manager.reload()

    # ------------------------------------------------------------------ validation

    def _check_complete(self, step: int) -> None:
        step_dir = self.directory / str(step)
        if not step_dir.exists():
            tmp = [p.name for p in self.directory.iterdir() if _TMP_RE.match(p.name)
                   and int(_TMP_RE.match(p.name)[1]) == step] if self.directory.exists() else []
            if tmp:
                raise CheckpointCorruptError(step, f"the save was never finalised ({tmp[0]})")
            raise FileNotFoundError(f"no checkpoint of step {step} in {self.directory}")
        if not (step_dir / COMMIT_MARKER).exists():
            raise CheckpointCorruptError(step, f"missing commit marker {COMMIT_MARKER} in "
                                               f"{step_dir} (unfinished save)")
        try:
            handlers = json.loads((step_dir / "_CHECKPOINT_METADATA").read_text())["item_handlers"]
        except Exception as e:
            raise CheckpointCorruptError(step, f"unreadable _CHECKPOINT_METADATA: {_short(e)}") from e
        missing = [item for item in ITEMS if item not in handlers or not (step_dir / item).exists()]
        if missing:
            raise CheckpointCorruptError(step, f"missing item(s) {missing}")

    def _read_meta(self, step: int) -> dict[str, Any]:
        path = self.directory / str(step) / "meta" / "metadata"
        try:
            meta = json.loads(path.read_text())
            ok = (isinstance(meta, dict) and meta.get("format_version") == FORMAT_VERSION
                  and meta.get("step") == step and "sampler_state" in meta and "rng_impl" in meta)
        except Exception as e:
            raise CheckpointCorruptError(step, f"unreadable meta JSON {path}: {_short(e)}") from e
        if not ok:
            raise CheckpointCorruptError(step, f"meta JSON {path} lacks the expected fields "
                                               f"(format_version {FORMAT_VERSION}, step {step})")
        return meta

    def _read_array_metadata(self, step: int) -> dict[str, dict[str, tuple]]:
        try:
            md = self._manager.item_metadata(step)
            out = {}
            for item in ARRAY_ITEMS:
                tree = md[item].tree
                leaves = jax.tree_util.tree_flatten_with_path(
                    tree, is_leaf=lambda x: hasattr(x, "shape") and hasattr(x, "dtype"))[0]
                out[item] = {_path_str(p): _leaf_signature(x) for p, x in leaves}
            return out
        except Exception as e:
            raise CheckpointCorruptError(step, f"unreadable array metadata: "
                                               f"{type(e).__name__}: {_short(e)}") from e


def _compare_trees(item: str, step: int, saved: dict[str, tuple], target: Any) -> None:
    leaves = jax.tree_util.tree_flatten_with_path(target)[0]
    want = {_path_str(p): _leaf_signature(x) for p, x in leaves}
    for name, sig in want.items():
        if name not in saved:
            raise CheckpointMismatchError(
                f"{item}: target leaf {name!r} {sig[0]} {sig[1]} is not in checkpoint step {step}")
        if saved[name] != sig:
            raise CheckpointMismatchError(
                f"{item}: leaf {name!r} is {saved[name][0]} {saved[name][1]} in checkpoint step "
                f"{step} but {sig[0]} {sig[1]} in the restore target")
    extra = [n for n in saved if n not in want]
    if extra:
        raise CheckpointMismatchError(
            f"{item}: checkpoint step {step} has leaf {extra[0]!r} that the restore target lacks "
            f"({len(extra)} extra leaves)")


def _short(e: BaseException, limit: int = 300) -> str:
    s = str(e).replace("\n", " ")
    return s if len(s) <= limit else s[:limit] + "..."
