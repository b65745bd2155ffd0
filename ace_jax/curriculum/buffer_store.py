"""Crash-safe persistence of the Evolving Data Buffer through fsspec (local dir, gs://, memory://).

Layout under the root URL (``seq`` = commit number, zero-padded):

  segments/<seq>.npz    one per commit: changed states + full stats rows of touched slots
  snapshots/<seq>.npz   periodic compacted copy of everything (every ``snapshot_every`` commits)
  manifests/<seq>.json  THE commit marker: names the snapshot and the segments after it, each with
                        its size and SHA-256; written last, after the data files are complete

A commit writes its data file, then its manifest. Readers take the newest manifest that parses,
and ignore every file it does not reference, so a crash at any moment (a half-written segment, a
segment without manifest, a torn manifest) loses at most the uncommitted tail. A referenced file
whose checksum does not match (truncated or damaged later) ends the replay there: the restore
keeps the valid prefix, reports what it dropped, and the next commit is a fresh snapshot.
Every file carries the sampler's state (e.g. its RNG key data) and the RL step of its commit.

Every storage call is retried with exponential backoff on transient errors (connection resets,
timeouts, HTTP 408/429/5xx); other failures raise ``BufferStoreError`` subclasses.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import random
import time
import uuid
from typing import Any, Callable, Mapping, Optional

import fsspec
import ml_collections
import numpy as np

from ace_jax.curriculum import buffer as buffer_lib
from ace_jax.curriculum.buffer import EvolvingBuffer, STAT_FIELDS

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


class BufferStoreError(Exception):
    """Base class of persistence errors."""


class StoreUnavailableError(BufferStoreError):
    """A storage operation kept failing with transient errors after every retry."""


class CorruptStoreError(BufferStoreError):
    """Nothing committed could be read back (every manifest or its snapshot is damaged)."""


def default_config() -> ml_collections.ConfigDict:
    """The ``buffer.store`` config section."""
    return buffer_lib.default_config().store


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: connection/timeouts and HTTP 408/429/5xx."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    code = getattr(exc, "code", None)
    if code is None:
        code = getattr(exc, "status", None)
    try:
        code = int(code) if code is not None else None
    except (TypeError, ValueError):
        code = None
    if code is not None and (code in (408, 429) or 500 <= code < 600):
        return True
    try:
        import aiohttp  # gcsfs's transport
        if isinstance(exc, (aiohttp.ClientConnectionError, aiohttp.ServerTimeoutError)):
            return True
    except ImportError:  # pragma: no cover - aiohttp comes with gcsfs
        pass
    return False


@dataclasses.dataclass
class RestoreInfo:
    """What ``BufferStore.restore`` found.

    Attributes:
      seq: the commit number of the last applied file.
      step: the RL step recorded with that commit.
      sampler_state: the sampler arrays recorded with that commit (exact).
      dropped: paths referenced by the newest manifest that could not be applied (a lost tail).
    """

    seq: int
    step: int
    sampler_state: dict[str, np.ndarray]
    dropped: list[str]


def _sha256(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def _encode(record: Mapping[str, Any], step: int, sampler_state: Mapping[str, np.ndarray]) -> bytes:
    header = {"format": FORMAT_VERSION, "kind": record["kind"], "meta": record["meta"],
              "states": record["states"], "removed": record["removed"], "step": int(step),
              "sampler_keys": sorted(sampler_state)}
    arrays = {"header": np.frombuffer(json.dumps(header).encode(), dtype=np.uint8),
              "slots": np.asarray(record["slots"], dtype=np.int64)}
    for name in STAT_FIELDS:
        arrays[f"row_{name}"] = np.asarray(record["rows"][name])
    for k, v in sampler_state.items():
        arrays[f"sampler_{k}"] = np.asarray(v)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def _decode(data: bytes) -> tuple[dict[str, Any], int, dict[str, np.ndarray]]:
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        header = json.loads(z["header"].tobytes().decode())
        if header.get("format") != FORMAT_VERSION:
            raise ValueError(f"unknown buffer file format {header.get('format')!r}")
        record = {"kind": header["kind"], "meta": header["meta"], "states": header["states"],
                  "removed": header["removed"], "slots": z["slots"],
                  "rows": {name: z[f"row_{name}"] for name in STAT_FIELDS}}
        sampler = {k: z[f"sampler_{k}"] for k in header["sampler_keys"]}
    return record, int(header["step"]), sampler


class BufferStore:
    """Append-only, checksummed, manifest-committed storage of one ``EvolvingBuffer``.

    Args:
      url: root folder: a local path, ``gs://bucket/prefix``, ``memory://name`` (any fsspec URL).
      config: the ``buffer.store`` section.
      storage_options: passed to fsspec (e.g. gcsfs ``endpoint_url``, ``token``, ``project``).
      fs: an already-built fsspec filesystem (then ``url`` is a path on it, protocol optional).
      sleep: the backoff sleep (seconds -> None); injectable for tests.
    """

    def __init__(self, url: str, config: Optional[ml_collections.ConfigDict] = None,
                 storage_options: Optional[dict] = None, fs=None,
                 sleep: Callable[[float], None] = time.sleep):
        if not url:
            raise ValueError("BufferStore needs a non-empty url (local dir, gs://..., memory://...)")
        self.config = config if config is not None else default_config()
        if self.config.retry_attempts < 1:
            raise ValueError(f"store.retry_attempts must be >= 1, got {self.config.retry_attempts}")
        if self.config.snapshot_every < 1:
            raise ValueError(f"store.snapshot_every must be >= 1, got {self.config.snapshot_every}")
        if fs is None:
            fs, root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        else:
            root = fs._strip_protocol(url)
        self.fs = fs
        self.root = root.rstrip("/")
        self._sleep = sleep
        self._local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        self._seq = -1                      # last commit number in use (committed or not)
        self._snapshot: Optional[dict] = None
        self._segments: list[dict] = []
        self._force_snapshot = True
        self.retries = 0                    # transient failures retried so far (observability)

    # -------------------------------------------------------------- retrying primitives
    def _retry(self, what: str, fn: Callable[[], Any]) -> Any:
        cfg = self.config
        delay = float(cfg.retry_initial_s)
        for attempt in range(1, cfg.retry_attempts + 1):
            try:
                return fn()
            except Exception as e:  # noqa: BLE001 - classified below
                if not is_transient(e):
                    raise
                if attempt == cfg.retry_attempts:
                    raise StoreUnavailableError(
                        f"{what} failed {attempt} times with transient errors; last: {e!r}") from e
                self.retries += 1
                log.warning("buffer store: %s failed (%r); retry %d/%d in %.2fs", what, e,
                            attempt, cfg.retry_attempts - 1, delay)
                self._sleep(delay * (0.5 + random.random() / 2))
                delay = min(delay * cfg.retry_multiplier, cfg.retry_max_s)

    def _path(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    def _write(self, path: str, data: bytes) -> None:
        def do():
            if self._local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                tmp = f"{path}.tmp-{uuid.uuid4().hex}"
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, path)  # atomic on one filesystem
            else:
                self.fs.pipe_file(path, data)  # object stores: an object appears whole or not at all
        self._retry(f"write {path}", do)

    def _read(self, path: str) -> bytes:
        return self._retry(f"read {path}", lambda: self.fs.cat_file(path))

    def _list(self, sub: str) -> list[str]:
        def do():
            try:
                self.fs.invalidate_cache()
                return [p for p in self.fs.ls(self._path(sub), detail=False)]
            except FileNotFoundError:
                return []
        return self._retry(f"list {sub}", do)

    @staticmethod
    def _seq_of(path: str) -> Optional[int]:
        name = path.rsplit("/", 1)[-1].split(".", 1)[0]
        return int(name) if name.isdigit() else None

    # -------------------------------------------------------------- commit
    def commit(self, buffer: EvolvingBuffer, step: int,
               sampler_state: Optional[Mapping[str, np.ndarray]] = None) -> int:
        """Persists the buffer's changes since the last commit; returns the commit number.

        Writes a segment (or a snapshot every ``snapshot_every`` commits, and after any failure
        or lossy restore), then the manifest. If this raises, nothing of this commit is visible to
        readers and the next commit is a full snapshot.
        """
        sampler_state = dict(sampler_state or {})
        seq = self._seq + 1
        snap = (self._force_snapshot or self._snapshot is None
                or seq - self._snapshot["seq"] >= self.config.snapshot_every)
        record = buffer.export_full() if snap else buffer.export_delta()
        data = _encode(record, step, sampler_state)
        kind = "snapshots" if snap else "segments"
        entry = {"path": f"{kind}/{seq:012d}.npz", "sha256": _sha256(data), "size": len(data), "seq": seq}
        self._seq = seq  # never reuse a number, even if this commit fails
        try:
            self._write(self._path(entry["path"]), data)
            snapshot = entry if snap else self._snapshot
            segments = [] if snap else self._segments + [entry]
            manifest = {"format": FORMAT_VERSION, "seq": seq, "step": int(step),
                        "snapshot": snapshot, "segments": segments}
            self._write(self._path("manifests", f"{seq:012d}.json"), json.dumps(manifest).encode())
        except BaseException:
            self._force_snapshot = True
            raise
        self._snapshot, self._segments, self._force_snapshot = snapshot, segments, False
        if snap:
            self._collect_garbage(seq)
        return seq

    def _collect_garbage(self, seq: int) -> None:
        """Best effort: removes manifests older than the newest ``keep_manifests`` and the data
        files no kept manifest references. Failures are logged, never raised."""
        try:
            manifests = sorted((s, p) for p in self._list("manifests")
                               if (s := self._seq_of(p)) is not None and s <= seq)
            keep = manifests[-self.config.keep_manifests:]
            referenced = set()
            for s, p in keep:
                m = json.loads(self._read(p))
                for e in [m["snapshot"], *m["segments"]]:
                    referenced.add(e["path"])
            for s, p in manifests[:-self.config.keep_manifests]:
                self._retry(f"delete {p}", lambda p=p: self.fs.rm_file(p))
            for sub in ("segments", "snapshots"):
                for p in self._list(sub):
                    s = self._seq_of(p)
                    if s is not None and s < keep[0][0] and f"{sub}/{p.rsplit('/', 1)[-1]}" not in referenced:
                        self._retry(f"delete {p}", lambda p=p: self.fs.rm_file(p))
        except Exception as e:  # noqa: BLE001 - collection is an optimisation
            log.warning("buffer store: garbage collection failed: %r", e)

    # -------------------------------------------------------------- restore
    def _load_entry(self, entry: dict) -> tuple[dict, int, dict]:
        data = self._read(self._path(entry["path"]))
        if len(data) != entry["size"] or _sha256(data) != entry["sha256"]:
            raise ValueError(f"{entry['path']}: {len(data)} bytes, checksum mismatch "
                             f"(expected {entry['size']} bytes)")
        return _decode(data)

    def restore(self, buffer: EvolvingBuffer) -> Optional[RestoreInfo]:
        """Loads the newest committed state into ``buffer`` (replacing its contents).

        Returns None if the store holds no commit; raises CorruptStoreError if manifests exist
        but none has a readable snapshot.
        """
        manifests = sorted(((s, p) for p in self._list("manifests")
                            if p.endswith(".json") and (s := self._seq_of(p)) is not None), reverse=True)
        files = [p for sub in ("segments", "snapshots") for p in self._list(sub)]
        used = [s for s in (self._seq_of(p) for p in files) if s is not None] + [s for s, _ in manifests]
        self._seq = max(used, default=-1)
        if not manifests:
            return None
        problems = []
        for mseq, mpath in manifests:
            try:
                m = json.loads(self._read(mpath))
                if m.get("format") != FORMAT_VERSION or m.get("seq") != mseq:
                    raise ValueError(f"format {m.get('format')!r}, seq {m.get('seq')!r}")
                record, step, sampler = self._load_entry(m["snapshot"])
            except (StoreUnavailableError, PermissionError):
                raise
            except Exception as e:  # noqa: BLE001 - a torn manifest/snapshot: try the previous one
                problems.append(f"{mpath}: {e!r}")
                log.warning("buffer store: skipping commit %s: %r", mpath, e)
                continue
            buffer.apply(record)
            applied_seq, segments, dropped = m["snapshot"]["seq"], [], []
            for i, entry in enumerate(m["segments"]):
                try:
                    rec, st, smp = self._load_entry(entry)
                except StoreUnavailableError:
                    raise
                except Exception as e:  # noqa: BLE001 - damaged tail: keep the prefix
                    dropped = [e2["path"] for e2 in m["segments"][i:]]
                    log.warning("buffer store: segment %s unreadable (%r); dropping %d segment(s)",
                                entry["path"], e, len(dropped))
                    break
                buffer.apply(rec)
                step, sampler, applied_seq = st, smp, entry["seq"]
                segments.append(entry)
            if problems:
                dropped = [p for p in problems] + dropped
            self._snapshot, self._segments = m["snapshot"], segments
            self._force_snapshot = bool(dropped)
            return RestoreInfo(seq=applied_seq, step=step, sampler_state=sampler, dropped=dropped)
        raise CorruptStoreError("no committed buffer state is readable: " + "; ".join(problems))
