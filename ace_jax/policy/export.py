"""Export a training run's Orbax checkpoint as a Hugging Face model directory, streaming.

``export_run(workdir, out_dir)`` reads a run directory (``launch/tpu_train.py``'s ``workdir``:
``config.json``, the tokenizer, ``checkpoints/<step>``) and writes what
``transformers.AutoModelForCausalLM.from_pretrained``, vLLM and ``JaxPolicy.from_hf`` load:

    config.json                         Qwen3 / Qwen3-MoE config (v4 style, torch_dtype = dtype)
    generation_config.json              eos_token_id = [<|im_end|>, <|endoftext|>], pad_token_id
    model-0000k-of-0000n.safetensors    per-expert HF keys, each shard <= max_shard_bytes
    model.safetensors.index.json        key -> shard
    tokenizer.json, tokenizer_config.json (+ the chat template inline), chat_template.jinja, ...

It runs on any host (a CPU VM is enough for Qwen3-30B-A3B) and never builds the model, on a
device or on the host. The checkpoint's parameter arrays are opened with tensorstore (the store
Orbax wrote them with: OCDBT or not, local or gs://) and read one parameter at a time, in blocks:
a block is one chunk range of the parameter's stacked axes (layers, experts) with its whole
trailing axes, so each stored chunk is decoded once. Every HF tensor of the block is converted by
the parameter table (``models.hf_mapping.export_plan`` / ``hf_tensor``: transposes, head splits,
per-expert keys) and written straight into its place in its safetensors file, whose header is
written first from the shapes alone: no shard is assembled in memory. A finished shard of a
remote ``out_dir`` is uploaded and deleted at once, so local disk holds about one shard.

Host memory: one block plus one HF tensor (and tensorstore's decode buffers, at most 2 chunks).
A block is as large as the stored chunks make it: Orbax writes each array in chunks of the
saving devices' shards (split below 2 GiB, 400 MiB on GCS), and the 'layers' axis is never
sharded, so a block spans every layer of a group. For a run saved by one device the chunk is the
whole parameter (the largest stacked parameter is the peak); for ace30b's checkpoints (fsdp 16 x
expert 4) an expert block is its 32 experts' slice of every layer with the whole hidden axis.
Reading a chunk again per layer would cut that at the cost of decoding (and downloading) every
chunk once per layer, which this does not do. ``ExportResult`` reports the measured peak.

``launch/export_hf.py`` is the command-line entry point.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any, Mapping, Optional

from ace_jax.policy.interface import PolicyError

DTYPES = ("bfloat16", "float32")
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
# What an export writes; the only files ``overwrite`` removes from a non-empty out_dir.
_EXPORT_FILE_RE = re.compile(
    r"^(config\.json|generation_config\.json|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|"
    r"tokenizer\.json|tokenizer_config\.json|chat_template\.jinja|special_tokens_map\.json|"
    r"added_tokens\.json|vocab\.json|merges\.txt)$")


class ExportError(PolicyError):
    """An export that cannot be done as asked (non-empty out_dir, bad dtype or shard size).

    Problems with the run itself (no run directory, no checkpoint, step absent) raise the
    ``PolicyError`` of ``runs.load_run_model``, of which this is a subclass.
    """


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What ``export_run`` wrote and what it took.

    Attributes:
      out_dir, step, files: the directory, the checkpoint step and the file names.
      tensor_bytes: bytes of the HF tensors written (the model at the stored dtype).
      peak_buffer_bytes: the most bytes of numpy buffers the export held at once (a block read
        from the checkpoint + the HF tensor being written), counted exactly.
      largest_block_bytes: the largest block read (one chunk range of one parameter).
      peak_rss_bytes: how far the process's resident memory rose, at its peak, above what it
        was when the tensors began to be read (after the imports, the checks and the plan):
        everything the streaming held at once, tensorstore's buffers included. From
        ``getrusage``'s ``ru_maxrss`` when the export set the process's high-water mark, else
        from /proc samples every 5 ms.
      seconds: wall-clock time.
    """
    out_dir: str
    step: int
    files: tuple
    tensor_bytes: int = 0
    peak_buffer_bytes: int = 0
    largest_block_bytes: int = 0
    peak_rss_bytes: int = 0
    seconds: float = 0.0


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)


def parse_size(size: Any) -> int:
    """Bytes of a size: an int, or a string like "5GB" (10^9), "500MiB" (2^20), "2G", "123".

    Raises ExportError for anything else or a size < 1.
    """
    if isinstance(size, int) and not isinstance(size, bool):
        n = size
    else:
        m = _SIZE_RE.match(str(size))
        if not m:
            raise ExportError(f"cannot read the size {size!r}; use e.g. 5GB, 500MiB or bytes")
        unit = m[2].upper()
        base = 1024 if (m[3] or "").upper() == "IB" else 1000
        n = int(float(m[1]) * base ** " KMGT".index(unit or " "))
    if n < 1:
        raise ExportError(f"the size must be at least 1 byte, got {size!r}")
    return n


def _listing(out_dir: str) -> Optional[list[str]]:
    """Names in out_dir, or None when it does not exist; raises ExportError for a file."""
    if "://" in out_dir:
        import fsspec

        fs, root = fsspec.core.url_to_fs(out_dir)
        if not fs.exists(root):
            return None
        if not fs.isdir(root):
            raise ExportError(f"out_dir {out_dir!r} is a file")
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)]
    if not os.path.exists(out_dir):
        return None
    if not os.path.isdir(out_dir):
        raise ExportError(f"out_dir {out_dir!r} is a file")
    return sorted(os.listdir(out_dir))


def _token_ids(tokenizer) -> dict[str, Optional[int]]:
    from models import tokenizer as tok_lib

    vocab = tokenizer.get_vocab()
    return {"im_end": vocab.get(tok_lib.IM_END), "endoftext": vocab.get(tok_lib.ENDOFTEXT)}


def _tokenizer_files(src: str, dst: pathlib.Path) -> pathlib.Path:
    """Copies the tokenizer files to ``dst`` with the chat template also inline in
    tokenizer_config.json (older transformers and vLLM read it only there)."""
    from models import hf_mapping

    dst.mkdir(parents=True, exist_ok=True)
    for name in hf_mapping._TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copyfile(os.path.join(src, name), dst / name)
    template = dst / "chat_template.jinja"
    config_path = dst / "tokenizer_config.json"
    if template.is_file() and config_path.is_file():
        config = json.loads(config_path.read_text(encoding="utf-8"))
        if not config.get("chat_template"):
            config["chat_template"] = template.read_text(encoding="utf-8")
            config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                   encoding="utf-8")
    return dst


def return_freed_memory() -> bool:
    """Makes glibc's malloc give every buffer of 1 MiB or more its own mapping, returned to the
    system when freed (``mallopt(M_MMAP_THRESHOLD, 1 MiB)``). By default the threshold grows with
    the largest buffer freed, and the blocks of an export (tens of MB to GBs, allocated by
    tensorstore's threads in their own arenas) then stay in the heap and pile up in the resident
    memory. Process-wide and permanent; ``launch/export_hf.py`` calls it. Returns whether it
    took effect (False off glibc)."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, 1 << 20))   # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def _rss_bytes() -> int:
    """This process's resident memory now (Linux /proc; else its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return _max_rss_bytes()


def _max_rss_bytes() -> int:
    import resource
    import sys

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss) if sys.platform == "darwin" else int(rss) * 1024


class _PeakRss:
    """The peak of this process's resident memory above what it is now, until `stop`: exact
    (``getrusage`` ``ru_maxrss``) when that peak is the process's highest so far, else the
    highest of samples taken every ``interval_s`` (an earlier, higher peak, e.g. of the imports,
    hides later ones from ``ru_maxrss``)."""

    def __init__(self, interval_s: float = 0.005):
        import threading

        self.start, self.max_before = _rss_bytes(), _max_rss_bytes()
        self.sampled = self.start
        self.result: Optional[int] = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, args=(interval_s,), daemon=True,
                                        name="export-rss")
        self._thread.start()

    def _sample(self, interval_s: float) -> None:
        while not self._done.wait(interval_s):
            self.sampled = max(self.sampled, _rss_bytes())

    def stop(self) -> int:
        if self.result is None:
            self._done.set()
            self._thread.join()
            top = _max_rss_bytes()
            peak = top if top > self.max_before else max(self.sampled, _rss_bytes())
            self.result = max(0, peak - self.start)
        return self.result


# ------------------------------------------------------------------------------ the checkpoint


class _Arrays:
    """The parameter arrays of one checkpoint step, opened with tensorstore (nothing read yet).

    ``names``: flat Flax name -> the array's name in the item (Orbax joins the tree keys with
    '.'); ``open(name)`` -> a ``ts.TensorStore`` whose ``read`` decodes only the chunks asked.
    """

    def __init__(self, params_dir: str):
        from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

        from ace_jax.runtime import storage

        self.params_dir = params_dir
        meta = json.loads(storage.read_text(storage.join(params_dir, "_METADATA")))
        self.use_ocdbt = bool(meta.get("use_ocdbt", True))
        self.use_zarr3 = bool(meta.get("use_zarr3", False))
        self.names = {}
        for entry in meta["tree_metadata"].values():
            keys = [str(k["key"]) for k in entry["key_metadata"]]
            flax = "/".join(keys[:-1] if keys and keys[-1] == "value" else keys)
            self.names[flax] = ".".join(keys)
        # no chunk cache (each chunk is read once); at most 2 chunks decoded at a time
        self._context = ts_utils.get_ts_context(use_ocdbt=self.use_ocdbt,
                                                data_copy_concurrency_limit=2)
        self._ts_utils = ts_utils

    def open(self, flax_name: str):
        import tensorstore as ts

        spec = self._ts_utils.ArrayReadSpec(self.params_dir, self.names[flax_name],
                                            self.use_zarr3, use_ocdbt=self.use_ocdbt).json
        return ts.open(spec, context=self._context, open=True, read=True).result()


def _open_step(run, model_cfg, step: Optional[int]):
    """(step, _Arrays) of checkpoint ``step`` (None: the newest complete one whose tree matches
    the model), checked as ``load_run_model`` checks it, before any tensor is read."""
    import logging

    from ace_jax.policy import runs
    from ace_jax.runtime import checkpoint as ckpt_lib

    ckpt_dir = run.checkpoint_dir
    if "://" not in ckpt_dir and not os.path.isdir(ckpt_dir):
        raise PolicyError(f"no checkpoint in {ckpt_dir!r} (the directory does not exist)")
    _, params_shape = runs.abstract_params(model_cfg)
    ckpt = ckpt_lib.Checkpointer(ckpt_dir, keep=None, async_save=False)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise PolicyError(f"no checkpoint in {ckpt_dir!r}")
        if step is not None and int(step) not in steps:
            raise PolicyError(f"no checkpoint of step {int(step)} in {ckpt_dir!r}; have {steps}")
        errors = []
        for s in ([int(step)] if step is not None else list(reversed(steps))):
            try:
                ckpt._check_complete(s)
                saved = ckpt._read_array_metadata(s)["params"]
            except ckpt_lib.CheckpointCorruptError as e:
                if step is not None:
                    raise
                logging.getLogger(__name__).warning("skipping checkpoint: %s", e)
                errors.append(e)
                continue
            ckpt_lib._compare_trees("params", s, saved, params_shape)
            return s, _Arrays(str(ckpt.directory / str(s) / "params"))
        raise PolicyError(f"no complete checkpoint in {ckpt_dir!r} (steps {steps}): "
                          f"{errors[0]}") from errors[0]
    finally:
        ckpt.close()


def _leading_blocks(shape: tuple, chunk: tuple, n_lead: int):
    """The blocks of a parameter's ``n_lead`` leading (stacked) axes along its chunk grid: each a
    tuple of (start, stop), the trailing axes whole."""
    import itertools

    ranges = [[(a, min(a + max(1, chunk[k]), shape[k])) for a in range(0, shape[k], max(1, chunk[k]))]
              for k in range(n_lead)]
    return list(itertools.product(*ranges)) if n_lead else [()]


# ------------------------------------------------------------------------------ safetensors


_ST_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64"}


class _ShardWriter:
    """Writes planned safetensors shards tensor by tensor: a shard's header (every key, shape and
    offset, known from the plan) first, then each tensor as it comes, in plan order; a shard is
    closed (and ``on_close(path)`` called) when its last tensor is written."""

    def __init__(self, out: pathlib.Path, shards: list, names: list, dtype, on_close):
        self.out, self.shards, self.names, self.on_close = out, shards, names, on_close
        self.dtype = dtype
        self.current = -1
        self.file = None
        self.pos = 0

    def _open(self, s: int) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, shape in self.shards[s]:
            n = int(math.prod(shape)) * self.dtype.itemsize
            header[key] = {"dtype": _ST_NAMES[self.dtype.name], "shape": list(shape),
                           "data_offsets": [offset, offset + n]}
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)    # the data starts 8-byte aligned, as safetensors writes it
        self.file = open(self.out / self.names[s], "wb")
        self.file.write(len(raw).to_bytes(8, "little"))
        self.file.write(raw)
        self.current, self.pos = s, 0

    def write(self, key: str, x) -> None:
        if self.file is None:
            self._open(self.current + 1)
        want_key, want_shape = self.shards[self.current][self.pos]
        if key != want_key or tuple(x.shape) != tuple(want_shape) or x.dtype != self.dtype:
            raise ExportError(f"internal: got {key} {x.shape} {x.dtype}, planned {want_key} "
                              f"{want_shape} {self.dtype}")
        x.tofile(self.file)
        self.pos += 1
        if self.pos == len(self.shards[self.current]):
            self.file.close()
            self.file = None
            self.on_close(self.out / self.names[self.current])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def export_run(workdir: str, out_dir: str, *, step: Optional[int] = None,
               dtype: Optional[str] = None, max_shard_bytes: Any = DEFAULT_MAX_SHARD_BYTES,
               overwrite: bool = False,
               generation_config: Optional[Mapping[str, Any]] = None) -> ExportResult:
    """Writes checkpoint ``step`` (default: the newest complete one) of run ``workdir`` as an HF
    model directory ``out_dir`` (local path or fsspec URL; see the module docstring), streaming:
    one block of one parameter in memory at a time, no device used.

    Args:
      dtype: stored dtype, "bfloat16" (half the size) or "float32" (exact); None (default): the
        model's own ``param_dtype`` (an fp32 run exports fp32).
      max_shard_bytes: shard size bound (int bytes or "5GB"-style string); a tensor larger than
        the bound gets a shard of its own.
      overwrite: allow a non-empty ``out_dir``; files of an earlier export there are replaced
        (nothing else is deleted).
      generation_config: extra generation_config.json fields (e.g. sampling defaults).

    Raises:
      ExportError: bad dtype / size, ``out_dir`` is a file or non-empty without ``overwrite``.
      PolicyError: not a run directory, no tokenizer, no checkpoint, no checkpoint of ``step``.
      checkpoint.CheckpointMismatchError: the checkpoint is of another model size.
      checkpoint.CheckpointCorruptError: checkpoint ``step`` (given explicitly) is unreadable, or
        its array data cannot be read.
    """
    import time

    import numpy as np

    from ace_jax.policy import runs
    from ace_jax.runtime import checkpoint as ckpt_lib
    from models import hf_mapping, tokenizer as tok_lib

    t0 = time.perf_counter()
    if dtype is not None and dtype not in DTYPES:
        raise ExportError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    shard_bytes = parse_size(max_shard_bytes)
    out_dir = os.fspath(out_dir)
    existing = _listing(out_dir)
    if existing and not overwrite:
        raise ExportError(f"out_dir {out_dir!r} is not empty ({len(existing)} entries, e.g. "
                          f"{existing[0]!r}); pass overwrite=True (--overwrite) to replace an "
                          "earlier export there")
    if "://" not in out_dir and os.path.abspath(out_dir) == os.path.abspath(workdir):
        raise ExportError("out_dir must not be the run directory itself")

    run = runs.resolve_run(workdir)  # PolicyError before any heavy work
    tokenizer = tok_lib.load_tokenizer(run.tokenizer_dir)
    config = runs.run_model_config(run, len(tokenizer))
    step, arrays = _open_step(run, config, step)
    ids = _token_ids(tokenizer)
    changes = {}
    if config.eos_token_id is None and ids["im_end"] is not None:
        changes["eos_token_id"] = ids["im_end"]
    if config.pad_token_id is None and ids["endoftext"] is not None:
        changes["pad_token_id"] = ids["endoftext"]
    config = config.replace(**changes) if changes else config
    gen: dict[str, Any] = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id}
    stop_ids = [i for i in (ids["im_end"], ids["endoftext"]) if i is not None]
    if stop_ids:  # what JaxPolicy stops at
        gen["eos_token_id"] = stop_ids
    if isinstance(gen["eos_token_id"], tuple):
        gen["eos_token_id"] = list(gen["eos_token_id"])
    if config.pad_token_id is not None:
        gen["pad_token_id"] = config.pad_token_id
    gen.update(dict(generation_config or {}))
    stored = hf_mapping._np_dtype(config.param_dtype if dtype is None else dtype)

    # the plan: parameter by parameter, block by block (the chunk grid of its stacked axes), the
    # HF tensors of each block; shards are cut in that order, before anything is read
    work = []   # (flax name, store, block, [HFTensor]) in reading order
    for flax_name, items in hf_mapping.export_plan(config).items():
        store = arrays.open(flax_name)
        shape = tuple(store.shape)
        chunk = tuple(store.chunk_layout.read_chunk.shape or shape)
        n_lead = len(items[0].index)
        blocks = {b: [] for b in _leading_blocks(shape, chunk, n_lead)}
        for it in items:
            blocks[tuple((i // max(1, chunk[k]) * max(1, chunk[k]),
                          min(shape[k], (i // max(1, chunk[k]) + 1) * max(1, chunk[k])))
                         for k, i in enumerate(it.index))].append(it)
        work += [(flax_name, store, b, its) for b, its in blocks.items() if its]
    shards: list[list[tuple[str, tuple]]] = [[]]
    size = total = 0
    for *_, items in work:
        for it in items:
            nbytes = int(math.prod(it.shape)) * stored.itemsize
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append((it.key, it.shape))
            size += nbytes
            total += nbytes
    n = len(shards)
    names = [f"model-{s + 1:05d}-of-{n:05d}.safetensors" for s in range(n)]
    weight_map = {key: names[s] for s, keys in enumerate(shards) for key, _ in keys}

    remote = "://" in out_dir and not out_dir.startswith("file://")
    if remote:
        import fsspec

        fs, root = fsspec.core.url_to_fs(out_dir)
        fs.makedirs(root, exist_ok=True)
        stage = pathlib.Path(tempfile.mkdtemp(prefix="ace_export_"))
        if existing:
            for name in existing:
                if _EXPORT_FILE_RE.match(name):
                    fs.rm(f"{root.rstrip('/')}/{name}")

        def publish(path: pathlib.Path) -> None:   # upload a finished file, free the disk
            fs.put(str(path), f"{root.rstrip('/')}/{path.name}")
            path.unlink()
    else:
        stage = pathlib.Path(out_dir[len("file://"):] if out_dir.startswith("file://") else out_dir)
        stage.mkdir(parents=True, exist_ok=True)
        for name in existing or ():
            if _EXPORT_FILE_RE.match(name) and (stage / name).is_file():
                (stage / name).unlink()

        def publish(path: pathlib.Path) -> None:
            del path

    peak = largest = 0
    rss = _PeakRss()   # everything imported and planned: what follows is the streaming
    writer = _ShardWriter(stage, shards, names, stored, publish)
    try:
        for flax_name, store, block, items in work:
            box = tuple(slice(lo, hi) for lo, hi in block)
            try:
                data = np.asarray(store[box].read().result() if box else store.read().result())
            except Exception as e:  # tensorstore raises many types for unreadable data
                raise ckpt_lib.CheckpointCorruptError(
                    step, f"reading {flax_name!r} failed: {type(e).__name__}: "
                          f"{str(e)[:300]}") from e
            largest = max(largest, data.nbytes)
            for it in items:
                local = tuple(i - lo for i, (lo, _) in zip(it.index, block))
                x = hf_mapping.hf_tensor(it, data[local] if local else data, config, stored)
                # x is a view of data when no copy was needed (contiguous, same dtype)
                peak = max(peak, data.nbytes + (0 if np.may_share_memory(x, data) else x.nbytes))
                writer.write(it.key, x)
                del x
            del data
        writer.close()

        index = {"metadata": {"total_size": total,
                              "total_parameters": total // stored.itemsize},
                 "weight_map": dict(sorted(weight_map.items()))}
        small = {"model.safetensors.index.json": json.dumps(index, indent=2, sort_keys=True) + "\n",
                 "config.json": json.dumps(hf_mapping.hf_config_dict(config, stored),
                                           indent=2) + "\n",
                 "generation_config.json": json.dumps(gen, indent=2) + "\n"}
        for name, text in small.items():
            (stage / name).write_text(text, encoding="utf-8")
            publish(stage / name)
        with tempfile.TemporaryDirectory(prefix="ace_export_tok_") as tmp:
            tok_dir = _tokenizer_files(run.tokenizer_dir, pathlib.Path(tmp))
            if not (tok_dir / "tokenizer.json").is_file():
                raise hf_mapping.CheckpointError(f"tokenizer_dir {str(tok_dir)!r} has no "
                                                 "tokenizer.json")
            for f in sorted(tok_dir.iterdir()):
                shutil.copyfile(f, stage / f.name)
                publish(stage / f.name)
    finally:
        rss.stop()
        writer.close()
        if remote:
            shutil.rmtree(stage, ignore_errors=True)
    files = _listing(out_dir) or []
    return ExportResult(out_dir=out_dir, step=int(step), files=tuple(sorted(files)),
                        tensor_bytes=total, peak_buffer_bytes=peak, largest_block_bytes=largest,
                        peak_rss_bytes=rss.stop(),
                        seconds=time.perf_counter() - t0)
