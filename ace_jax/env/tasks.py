"""Loading the tasks an agent works on: the offline suite or prepared MLE-bench competitions.

``load_tasks`` is the one loader of the trainer (``train.trainer``: the configured ``tasks.*``,
``training=True``) and of the evaluation harness (``eval.run_config.run_tasks``: a run's tasks,
capped to a per-execution time limit). Every failure is a ``TaskLoadError`` whose message says
what to change; callers turn it into their own error (``trainer.SetupError``, a usage error).
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

from ace_jax.runtime import storage
from sandbox.tasks import registry

log = logging.getLogger("ace_jax.env.tasks")

SOURCES = ("offline", "mlebench")


class TaskLoadError(ValueError):
    """The tasks asked for cannot be loaded; the message says why (e.g. lists the valid ids)."""


def load_tasks(ids: Sequence[str] = (), *, source: str = "offline",
               cache_dir: str = "cache/tasks", data_dir: str = "", seed: int = 0,
               time_limit_s: float = 0.0, training: bool = False) -> list:
    """The tasks ``ids`` of ``source``, prepared into ``cache_dir`` if missing.

    Args:
      ids: task ids; empty: every task of the source (the whole offline suite, or every
        competition folder in ``data_dir``).
      source: "offline" (``sandbox.tasks.registry``) or "mlebench" (prepared MLE-bench
        competitions in ``data_dir``).
      cache_dir: where the offline suite is prepared (``registry.load_suite``).
      data_dir: the folder of prepared MLE-bench competitions (source "mlebench" only): a local
        path, or a URL (``gs://bucket/mlebench``) from which only the competitions ``ids`` are
        copied, once, into ``cache_dir/mlebench/<id>`` (``stage_competitions``).
      seed: the seed the tasks are (or were) prepared with; the reference leaderboard of the
        offline suite belongs to it.
      time_limit_s: when > 0, each task's per-execution ``time_limit_s`` is capped to it.
      training: tasks to train on: every task must have a baseline score (it anchors the
        rewards; TaskLoadError says why it has none), and a task without a reference
        leaderboard is logged as a warning (it trains with headroom 1, rewards relative to its
        baseline; medals and HumanRank n/a).

    Returns:
      the loaded ``sandbox.tasks.base.Task`` objects, in the order of ``ids``.

    Raises:
      TaskLoadError: an unknown source or task id (the message lists the valid ones), a missing
        ``data_dir``, an MLE-bench competition that cannot be loaded, or (``training``) a task
        without a baseline score.
    """
    if source == "offline":
        known = registry.list_tasks()
        ids = list(ids) or known
        unknown = sorted(set(ids) - set(known))
        if unknown:
            raise TaskLoadError(f"unknown task ids {unknown}; available: {known}")
        tasks = registry.load_suite(cache_dir, seed, ids)
    elif source == "mlebench":
        from sandbox.tasks import mlebench

        if storage.is_url(data_dir):
            data_dir = stage_competitions(data_dir, ids, cache_dir)
        if not data_dir or not os.path.isdir(data_dir):
            raise TaskLoadError(f"tasks.data_dir={data_dir!r} is not a directory of prepared "
                                "MLE-bench competitions")
        ids = list(ids) or sorted(os.listdir(data_dir))
        try:
            tasks = [mlebench.load_mlebench_task(i, data_dir, seed=seed) for i in ids]
        except (FileNotFoundError, mlebench.UnsupportedGraderError,
                mlebench.LeaderboardError) as e:
            raise TaskLoadError(f"cannot load an MLE-bench task: {e}") from e
    else:
        raise TaskLoadError(f"tasks.source={source!r}; valid: {', '.join(SOURCES)}")
    if time_limit_s > 0:
        for t in tasks:
            t.time_limit_s = min(float(t.time_limit_s), time_limit_s)
    if training:
        for t in tasks:
            if t.baseline_score is None:
                why = getattr(t, "baseline_error", "") or "it has no baseline score"
                raise TaskLoadError(f"task {t.task_id}: {why} (the baseline anchors the rewards)")
            if not t.leaderboard:
                log.warning("task %s has no reference leaderboard: headroom 1 and rewards "
                            "relative to its baseline %.6g; medals and HumanRank n/a",
                            t.task_id, t.baseline_score)
    return tasks


def stage_competitions(url: str, ids: Sequence[str], cache_dir: str) -> str:
    """Copies the prepared MLE-bench competitions ``ids`` (every one under ``url`` when empty)
    from ``url/<id>/`` (its ``prepared/{public,private}``, and ``config.yaml`` /
    ``description.md`` / ``leaderboard.csv`` when the mlebench package does not supply them)
    to ``cache_dir/mlebench/<id>/``; a competition already there is reused until its remote
    files change. Returns the local data folder. The private answers land in the cache, as a
    local ``data_dir``'s do: the sandbox hides ``prepared/private`` (``Task.hidden_paths``)
    and mounts only the public folder. TaskLoadError when a competition is not under ``url``."""
    local = os.path.join(cache_dir, "mlebench")
    ids = list(ids) or storage.listdir(url)
    for cid in ids:
        try:
            storage.local_copy(storage.join(url, cid), local, name=cid)
        except FileNotFoundError:
            raise TaskLoadError(f"tasks.data_dir={url!r} holds no competition {cid!r} "
                                f"(expected {storage.join(url, cid, 'prepared')}/...)") from None
        log.info("task %s staged from %s in %s", cid, url, local)
    return local

