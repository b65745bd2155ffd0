"""Task registry: a task is a registered builder (``task_id`` + ``prepare(out_dir, seed) -> Task``).

Usage::

    from sandbox.tasks import registry
    registry.list_tasks()                          # every task: the offline suite + procedural
    registry.list_tasks(family="offline")          # ['breast-cancer-diagnosis', ...]
    task = registry.load_task("digits-8x8", cache_dir="cache/tasks")   # prepares if missing
    tasks = registry.load_suite("cache/tasks")

Prepared tasks live in ``<cache_dir>/seed<seed>/<task_id>/``. The reference leaderboard of a task
comes from the committed baseline sweep (``sandbox/seed_corpus/results/seed<seed>/<task_id>/
leaderboard.csv``), or from the builder's own ``reference_leaderboard(seed)`` when it has one
(the procedural family's compact sweep file, ``sandbox.tasks.procedural``); a seed without a sweep
gets an empty leaderboard (medal and position helpers then raise a clear error).

Families: a builder's ``family`` attribute ("offline" when it has none): "offline" (the offline
suite, ``sandbox.tasks.offline_suite``, 13 tasks) and "procedural" (``sandbox.tasks.procedural``,
``proc-<kind>-NNN``, 240 instances with train / held-out splits).
"""
from __future__ import annotations

import importlib
import os
import pathlib
from typing import Optional, Protocol

import pandas as pd

from sandbox.tasks import base

RESULTS_DIR = pathlib.Path(__file__).resolve().parent.parent / "seed_corpus" / "results"
_BUILTIN_MODULES = ("sandbox.tasks.offline_suite", "sandbox.tasks.procedural")
DEFAULT_FAMILY = "offline"


class TaskBuilder(Protocol):
    """What the registry needs. Optional: ``hidden_paths() -> tuple[str, ...]`` (host paths of
    the sources the task was built from, hidden inside the sandbox), ``family: str`` (default
    "offline") and ``reference_leaderboard(seed) -> (scores, source note)`` (else the committed
    per-task ``leaderboard.csv``)."""

    task_id: str

    def prepare(self, out_dir: "os.PathLike | str", seed: int = 0) -> base.Task: ...


_REGISTRY: dict[str, TaskBuilder] = {}


def register(builder: TaskBuilder) -> TaskBuilder:
    """Registers a builder under ``builder.task_id``; a second builder with that id is an error."""
    tid = getattr(builder, "task_id", None)
    if not isinstance(tid, str) or not tid:
        raise ValueError(f"a task builder needs a non-empty str task_id, got {tid!r}")
    if tid in _REGISTRY and _REGISTRY[tid] is not builder:
        raise ValueError(f"task {tid!r} is already registered")
    _REGISTRY[tid] = builder
    return builder


def _ensure_builtins() -> None:
    for m in _BUILTIN_MODULES:
        importlib.import_module(m)


def family_of(task_id: str) -> str:
    """The family of a registered task ("offline", "procedural", ...)."""
    return getattr(get_builder(task_id), "family", DEFAULT_FAMILY)


def families() -> list[str]:
    """Sorted names of the registered families."""
    _ensure_builtins()
    return sorted({getattr(b, "family", DEFAULT_FAMILY) for b in _REGISTRY.values()})


def list_tasks(family: Optional[str] = None) -> list[str]:
    """Sorted ids of every registered task, or of one ``family`` (ValueError for an unknown one)."""
    _ensure_builtins()
    if family is None:
        return sorted(_REGISTRY)
    if family not in families():
        raise ValueError(f"unknown task family {family!r}; registered: {families()}")
    return sorted(t for t, b in _REGISTRY.items() if getattr(b, "family", DEFAULT_FAMILY) == family)


def get_builder(task_id: str) -> TaskBuilder:
    """The registered builder ``task_id``; KeyError lists the known ids."""
    _ensure_builtins()
    try:
        return _REGISTRY[task_id]
    except KeyError:
        raise KeyError(f"unknown task {task_id!r}; registered: {sorted(_REGISTRY)}") from None


def task_dir(cache_dir: "os.PathLike | str", task_id: str, seed: int = 0) -> pathlib.Path:
    """Where ``task_id`` prepared with ``seed`` lives under ``cache_dir``."""
    return pathlib.Path(cache_dir) / f"seed{seed}" / task_id


def reference_leaderboard(task_id: str, seed: int = 0,
                          results_dir: Optional[pathlib.Path] = None) -> tuple[list[float], str]:
    """(scores, source note) from the committed sweep, or ([], "") when there is none. A builder
    with its own ``reference_leaderboard(seed)`` (the procedural family) answers for its task
    unless ``results_dir`` is given."""
    if results_dir is None:
        _ensure_builtins()
        builder = _REGISTRY.get(task_id)
        if builder is not None and hasattr(builder, "reference_leaderboard"):
            return builder.reference_leaderboard(seed)
    path = pathlib.Path(results_dir or RESULTS_DIR) / f"seed{seed}" / task_id / "leaderboard.csv"
    if not path.exists():
        return [], ""
    df = pd.read_csv(path)
    if "score" not in df.columns:
        raise ValueError(f"{path}: leaderboard needs a 'score' column, has {list(df.columns)}")
    return [float(s) for s in df["score"].dropna()], (
        f"our own baseline sweep (sandbox/sweep.py, seed {seed}, final-test scores); not human teams")


def load_task(task_id: str, cache_dir: "os.PathLike | str" = "cache/tasks", seed: int = 0,
              prepare_if_missing: bool = True) -> base.Task:
    """Loads a prepared task (preparing it first if missing and allowed), with its leaderboard."""
    d = task_dir(cache_dir, task_id, seed)
    if not (d / "task.json").exists():
        if not prepare_if_missing:
            raise FileNotFoundError(
                f"task {task_id!r} (seed {seed}) is not prepared under {cache_dir}; run "
                f"`python -m sandbox.prepare --cache_dir={cache_dir} --seed={seed}`")
        get_builder(task_id).prepare(d, seed)
    lb, src = reference_leaderboard(task_id, seed)
    builder = get_builder(task_id)
    hidden = tuple(builder.hidden_paths()) if hasattr(builder, "hidden_paths") else ()
    return base.read_task_json(d, leaderboard=lb, leaderboard_source=src, extra_hidden_paths=hidden)


def load_suite(cache_dir: "os.PathLike | str" = "cache/tasks", seed: int = 0,
               task_ids: Optional[list[str]] = None,
               prepare_if_missing: bool = True, family: Optional[str] = None) -> list[base.Task]:
    """Loads every registered task (or ``task_ids``; or every task of ``family``), in id order."""
    ids = list_tasks(family) if task_ids is None else list(task_ids)
    return [load_task(t, cache_dir, seed, prepare_if_missing) for t in ids]
