"""Export a training run's Orbax checkpoint as a Hugging Face model directory.

``export_run(workdir, out_dir)`` reads a run directory (``launch/tpu_train.py``'s ``workdir``:
``config.json``, the tokenizer, ``checkpoints/<step>``), restores only the parameters of one
checkpoint and writes what ``transformers.AutoModelForCausalLM.from_pretrained``, vLLM and
``JaxPolicy.from_hf`` load:

    config.json                         Qwen3 / Qwen3-MoE config (v4 style, torch_dtype = dtype)
    generation_config.json              eos_token_id = [<|im_end|>, <|endoftext|>], pad_token_id
    model-0000k-of-0000n.safetensors    per-expert HF keys, each shard <= max_shard_bytes
    model.safetensors.index.json        key -> shard
    tokenizer.json, tokenizer_config.json (+ the chat template inline), chat_template.jinja, ...

The tensors are written by ``models.hf_mapping.export_hf`` (the one HF <-> Flax table).
``launch/export_hf.py`` is the command-line entry point.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import tempfile
from typing import Any, Mapping, Optional

from ace_jax.policy.policy import PolicyError

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
    ``PolicyError`` of ``policy.load_run_model``, of which this is a subclass.
    """


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """What ``export_run`` wrote: the directory, the checkpoint step and the file names."""
    out_dir: str
    step: int
    files: tuple


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


def export_run(workdir: str, out_dir: str, *, step: Optional[int] = None,
               dtype: Optional[str] = None, max_shard_bytes: Any = DEFAULT_MAX_SHARD_BYTES,
               overwrite: bool = False,
               generation_config: Optional[Mapping[str, Any]] = None) -> ExportResult:
    """Writes checkpoint ``step`` (default: the newest complete one) of run ``workdir`` as an HF
    model directory ``out_dir`` (local path or fsspec URL; see the module docstring).

    Args:
      dtype: stored dtype, "bfloat16" (half the size) or "float32" (exact); None (default): the
        model's own ``param_dtype`` (an fp32 run exports fp32).
      max_shard_bytes: shard size bound (int bytes or "5GB"-style string).
      overwrite: allow a non-empty ``out_dir``; files of an earlier export there are replaced
        (nothing else is deleted).
      generation_config: extra generation_config.json fields (e.g. sampling defaults).

    Raises:
      ExportError: bad dtype / size, ``out_dir`` is a file or non-empty without ``overwrite``.
      PolicyError: not a run directory, no tokenizer, no checkpoint, no checkpoint of ``step``.
      checkpoint.CheckpointMismatchError: the checkpoint is of another model size.
    """
    from models import hf_mapping
    from ace_jax.policy import policy as policy_lib

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

    run = policy_lib.resolve_run(workdir)  # PolicyError before any heavy work
    model, tokenizer, step = policy_lib.load_run_model(workdir, step=step)
    ids = _token_ids(tokenizer)
    config = model.config
    changes = {}
    if config.eos_token_id is None and ids["im_end"] is not None:
        changes["eos_token_id"] = ids["im_end"]
    if config.pad_token_id is None and ids["endoftext"] is not None:
        changes["pad_token_id"] = ids["endoftext"]
    config = config.replace(**changes) if changes else config
    gen: dict[str, Any] = {}
    stop_ids = [i for i in (ids["im_end"], ids["endoftext"]) if i is not None]
    if stop_ids:  # what JaxPolicy stops at
        gen["eos_token_id"] = stop_ids
    if config.pad_token_id is not None:
        gen["pad_token_id"] = config.pad_token_id
    gen.update(dict(generation_config or {}))

    if existing and "://" not in out_dir:
        for name in existing:
            if _EXPORT_FILE_RE.match(name) and os.path.isfile(os.path.join(out_dir, name)):
                os.remove(os.path.join(out_dir, name))
    with tempfile.TemporaryDirectory(prefix="ace_export_tok_") as tmp:
        tok_dir = _tokenizer_files(run.tokenizer_dir, pathlib.Path(tmp))
        hf_mapping.export_hf(model, config, out_dir, dtype=dtype, max_shard_bytes=shard_bytes,
                             tokenizer_dir=tok_dir, generation_config=gen)
    files = _listing(out_dir) or []
    return ExportResult(out_dir=out_dir, step=int(step), files=tuple(sorted(files)))
