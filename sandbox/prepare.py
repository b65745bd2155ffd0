"""Prepares the offline task suite once and guards it with checksums.

    python -m sandbox.prepare --cache_dir=cache/tasks            # prepare missing tasks, verify the rest
    python -m sandbox.prepare --cache_dir=cache/tasks --verify   # also rebuild each task and compare
    python -m sandbox.prepare --cache_dir=cache/tasks --tasks=iris-species,digits-8x8 --seed=0

Each prepared task gets ``checksums.json``: the sha256 of every file under ``public/`` and
``private/`` and of ``task.json``. A later run checks the files against it (corruption or edits),
``--verify`` additionally rebuilds the task in a temporary folder and requires byte-identical files
(drift in library versions or in the packaged data would change them, cf. MLE-bench #58), and
compares with the reference checksums committed next to the sweep leaderboards
(``sandbox/seed_corpus/results/seed<k>/checksums.json``) when that file exists: the reference
leaderboards are only valid for those exact files. Exit status 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import shutil
import sys
import tempfile
import time
from typing import Optional, Sequence

from sandbox.tasks import registry

CHECKSUM_FILE = "checksums.json"


class ChecksumError(RuntimeError):
    """A prepared task's files do not match their recorded checksums."""


def file_checksums(task_dir: pathlib.Path) -> dict[str, str]:
    """sha256 of every file of a prepared task (relative posix path -> hex digest), sorted."""
    task_dir = pathlib.Path(task_dir)
    out = {}
    for p in sorted(task_dir.rglob("*")):
        if p.is_file() and p.name != CHECKSUM_FILE:
            out[p.relative_to(task_dir).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _diff(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    probs = [f"missing {k}" for k in sorted(set(expected) - set(actual))]
    probs += [f"unexpected {k}" for k in sorted(set(actual) - set(expected))]
    probs += [f"changed {k}" for k in sorted(set(expected) & set(actual)) if expected[k] != actual[k]]
    return probs


def verify_checksums(task_dir: pathlib.Path) -> None:
    """Raises ChecksumError (listing the files) unless the task matches its checksums.json."""
    path = pathlib.Path(task_dir) / CHECKSUM_FILE
    if not path.exists():
        raise ChecksumError(f"{task_dir}: no {CHECKSUM_FILE}")
    probs = _diff(json.loads(path.read_text()), file_checksums(task_dir))
    if probs:
        raise ChecksumError(f"{task_dir}: " + "; ".join(probs))


def prepare_task(task_id: str, cache_dir: pathlib.Path, seed: int, force: bool = False) -> str:
    """Prepares one task if needed; returns "prepared" or "verified". Raises ChecksumError."""
    d = registry.task_dir(cache_dir, task_id, seed)
    if (d / CHECKSUM_FILE).exists() and not force:
        verify_checksums(d)
        return "verified"
    if d.exists():
        shutil.rmtree(d)
    registry.get_builder(task_id).prepare(d, seed)
    (d / CHECKSUM_FILE).write_text(json.dumps(file_checksums(d), indent=1, sort_keys=True) + "\n")
    return "prepared"


def rebuild_matches(task_id: str, cache_dir: pathlib.Path, seed: int) -> list[str]:
    """Rebuilds ``task_id`` in a temp dir; returns the differences with the cached copy."""
    d = registry.task_dir(cache_dir, task_id, seed)
    with tempfile.TemporaryDirectory() as tmp:
        registry.get_builder(task_id).prepare(pathlib.Path(tmp) / task_id, seed)
        return _diff(file_checksums(d), file_checksums(pathlib.Path(tmp) / task_id))


def reference_checksums(seed: int) -> Optional[dict[str, dict[str, str]]]:
    """The committed checksums the reference leaderboards were measured on, if any."""
    path = registry.RESULTS_DIR / f"seed{seed}" / CHECKSUM_FILE
    return json.loads(path.read_text()) if path.exists() else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sandbox.prepare", description=__doc__.split("\n")[0])
    ap.add_argument("--cache_dir", default="cache/tasks", help="root of the prepared tasks")
    ap.add_argument("--seed", type=int, default=0, help="split/id seed")
    ap.add_argument("--tasks", default="", help="comma-separated task ids (default: all)")
    ap.add_argument("--verify", action="store_true",
                    help="also rebuild each task and compare with the cache and the reference")
    ap.add_argument("--force", action="store_true", help="re-prepare even if present")
    args = ap.parse_args(argv)
    cache = pathlib.Path(args.cache_dir)
    ids = [t for t in args.tasks.split(",") if t] or registry.list_tasks()
    for t in ids:
        registry.get_builder(t)  # unknown ids fail before any work
    ref = reference_checksums(args.seed) if args.verify else None
    failures = 0
    t0 = time.time()
    for t in ids:
        try:
            what = prepare_task(t, cache, args.seed, force=args.force)
            if args.verify:
                probs = rebuild_matches(t, cache, args.seed)
                if ref is not None and t in ref:
                    probs += [f"vs reference: {p}" for p in _diff(
                        ref[t], file_checksums(registry.task_dir(cache, t, args.seed)))]
                if probs:
                    raise ChecksumError("; ".join(probs))
                what += ", rebuild identical" + (", matches reference" if ref and t in ref else "")
            print(f"{t:28s} {what}")
        except ChecksumError as e:
            failures += 1
            print(f"{t:28s} MISMATCH: {e}", file=sys.stderr)
    print(f"{len(ids) - failures}/{len(ids)} tasks ok under {cache / f'seed{args.seed}'} "
          f"({time.time() - t0:.1f} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
