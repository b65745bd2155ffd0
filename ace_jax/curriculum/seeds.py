"""Seed solutions: reference code with a measured dev score, and how it enters the buffer.

A ``buffer.SeedSolution`` (task_id, code, dev score in metric units) becomes a root state of the
Evolving Data Buffer. Sources: the seed corpus's reference scripts (``reference_solutions``) and
``seed_solutions.jsonl`` files that ``launch/evaluate.py`` writes (``read_seed_solutions``).
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from typing import Iterable, Sequence, Union

from ace_jax.curriculum import buffer


class SeedFileError(ValueError):
    """A seed-solutions file cannot be read or holds a line that is not a seed solution."""


def reference_solutions(tasks, seed: int) -> list[buffer.SeedSolution]:
    """Reference solutions of the seed corpus as improvable states (code + measured dev score)."""
    from sandbox import seed_corpus

    out, known = [], set(seed_corpus.sft_task_ids())
    for t in tasks:
        if t.task_id not in known:   # held out (or no corpus): no reference scripts
            continue
        scores = seed_corpus.reference_scores(t.task_id, seed)
        for s in seed_corpus.list_scripts(t.task_id):
            if scores.get(s.name) is not None:
                out.append(buffer.SeedSolution(t.task_id, s.code, float(scores[s.name])))
    return out


def add_seed_states(buffer: buffer.EvolvingBuffer,
                    solutions: Iterable[buffer.SeedSolution], *, step: int = 0,
                    skip_unknown_tasks: bool = False) -> list[int]:
    """Adds seed solutions (``eval.episodes.episodes_to_seed_solutions``, ``read_seed_solutions``) to
    ``buffer`` as root states of origin "evaluation"; returns their ids. Raises
    ``buffer.UnknownTaskError`` for a task the buffer does not know, unless
    ``skip_unknown_tasks``."""
    ids = []
    for sol in solutions:
        if sol.task_id not in buffer.targets:
            if skip_unknown_tasks:
                continue
            buffer.task_index(sol.task_id)  # raises UnknownTaskError naming the known tasks
        ids.append(buffer.add_root(sol.task_id, sol.code, sol.score, origin="evaluation",
                                   step=step))
    return ids


def write_seed_solutions(solutions: Sequence[buffer.SeedSolution],
                         path: Union[str, os.PathLike]) -> pathlib.Path:
    """One JSON line per ``SeedSolution`` (task_id, code, score)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(dataclasses.asdict(s)) + "\n" for s in solutions))
    return path


def read_seed_solutions(path: Union[str, os.PathLike]) -> list[buffer.SeedSolution]:
    """The ``SeedSolution``s of a file written by ``write_seed_solutions`` (a local path or an
    fsspec URL such as ``gs://...``).

    Raises SeedFileError naming the file and line when it is missing or a line is not an
    object with a task_id (str), code (str) and score (a finite number or null).
    """
    import fsspec

    try:
        with fsspec.open(os.fspath(path), "rt") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError) as e:
        raise SeedFileError(f"cannot read seed solutions {path}: {e}") from e
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            score = row["score"]
            if not (isinstance(row, dict) and isinstance(row["task_id"], str)
                    and isinstance(row["code"], str)
                    and (score is None or (isinstance(score, (int, float))
                                           and not isinstance(score, bool)
                                           and math.isfinite(score)))):
                raise ValueError("wrong types")
        except (ValueError, KeyError, TypeError) as e:
            raise SeedFileError(
                f"{path} line {n}: not a seed solution (a JSON object with task_id, code and a "
                f"finite score or null): {type(e).__name__}: {e}; {line[:120]!r}") from None
        out.append(buffer.SeedSolution(row["task_id"], row["code"],
                                           None if score is None else float(score)))
    return out
