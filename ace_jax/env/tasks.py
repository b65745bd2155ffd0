"""Loading the tasks an agent works on: the offline suite or prepared MLE-bench competitions.

``load_tasks`` is the one loader of the trainer (``train.trainer``: the configured ``tasks.*``,
``training=True``) and of the evaluation harness (``eval.run_config.run_tasks``: a run's tasks,
capped to a per-execution time limit). Every failure is a ``TaskLoadError`` whose message says
what to change; callers turn it into their own error (``trainer.SetupError``, a usage error).
"""
from __future__ import annotations

import dataclasses
import json
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
        competition folder of a local ``data_dir``; refused for a URL ``data_dir``: a bucket is
        never downloaded whole).
      source: "offline" (``sandbox.tasks.registry``) or "mlebench" (prepared MLE-bench
        competitions in ``data_dir``).
      cache_dir: where the offline suite is prepared (``registry.load_suite``).
      data_dir: the folder of prepared MLE-bench competitions (source "mlebench" only): a local
        path, or a URL (``gs://bucket/mlebench``, staged by ``launch/stage_mlebench.py``) from
        which only the competitions ``ids`` are copied, public and private folders apart, once,
        into ``cache_dir/mlebench/<id>`` (``stage_competitions``; the bytes it downloaded are
        logged).
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
        # () = the offline suite (the procedural family is named: its held-out instances and
        # held-out family must never be trained on by default)
        ids = list(ids) or registry.list_tasks(family="offline")
        unknown = sorted(set(ids) - set(known))
        if unknown:
            raise TaskLoadError(f"unknown task ids {unknown}; available: {known}")
        tasks = registry.load_suite(cache_dir, seed, ids)
    elif source == "mlebench":
        from sandbox.tasks import mlebench

        if storage.is_url(data_dir):
            staged = stage_competitions(data_dir, ids, cache_dir)
            log.info("MLE-bench tasks %s from %s: %d bytes downloaded into %s", list(ids),
                     data_dir, staged.bytes_downloaded, staged.data_dir)
            data_dir = staged.data_dir
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


#: A staged competition's own files a host fetches beside ``prepared/{public,private}`` (with
#: the grader's ``*.py``): never ``raw/``, Kaggle's zip or anything else in the folder.
COMPETITION_FILES = ("config.yaml", "description.md", "leaderboard.csv", "STAGED.json")
_FILES_MARKER = ".competition_files.json"


@dataclasses.dataclass(frozen=True)
class StagedCompetitions:
    """What ``stage_competitions`` did.

    Attributes:
      data_dir: the local folder of the staged competitions (``cache_dir/mlebench``).
      downloaded: competition id -> bytes downloaded by this call (0: the cached copy was
        current).
    """

    data_dir: str
    downloaded: dict

    @property
    def bytes_downloaded(self) -> int:
        """Bytes downloaded by this call, every competition together."""
        return sum(self.downloaded.values())


def _marker(folder: str) -> "str | None":
    try:
        with open(os.path.join(folder, ".complete")) as f:
            return f.read()
    except OSError:
        return None


def _folder_bytes(folder: str) -> int:
    """Bytes of the files under ``folder`` (its ``.complete`` marker excluded)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder)
               for f in fs if f != ".complete")


def _fetch_folder(url: str, parent: str, name: str) -> int:
    """``storage.local_copy`` of ``url`` into ``parent/name``; the bytes it downloaded (0 when
    the cached copy was current). FileNotFoundError when ``url`` holds no file."""
    folder = os.path.join(parent, name)
    before = _marker(folder)
    storage.local_copy(url, parent, name=name)
    return 0 if before is not None and before == _marker(folder) else _folder_bytes(folder)


def _fetch_competition_files(url: str, local: str) -> int:
    """The files ``COMPETITION_FILES`` and ``*.py`` directly under ``url`` into ``local`` (each
    replaced when its size or version changed, removed when gone); the bytes downloaded."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    want = {}
    for info in fs.ls(root, detail=True):
        name = info["name"].rstrip("/").rsplit("/", 1)[-1]
        if info.get("type", "file") == "file" and (name in COMPETITION_FILES
                                                   or name.endswith(".py")):
            want[name] = [int(info.get("size") or 0), str(
                info.get("etag") or info.get("md5Hash") or info.get("mtime")
                or info.get("updated") or "")]
    os.makedirs(local, exist_ok=True)
    marker = os.path.join(local, _FILES_MARKER)
    try:
        with open(marker) as f:
            have = json.load(f)
    except (OSError, ValueError):
        have = {}
    got = 0
    for name, version in sorted(want.items()):
        dst = os.path.join(local, name)
        if have.get(name) == version and os.path.isfile(dst):
            continue
        tmp = f"{dst}.tmp-{os.getpid()}"
        fs.get_file(f"{root}/{name}", tmp)
        os.replace(tmp, dst)
        got += os.path.getsize(dst)
    for name in set(have) | set(COMPETITION_FILES):     # gone from the bucket: gone here too
        if name not in want and os.path.isfile(os.path.join(local, name)):
            os.remove(os.path.join(local, name))
    tmp = f"{marker}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(want, f)
    os.replace(tmp, marker)
    return got


def stage_competitions(url: str, ids: Sequence[str], cache_dir: str) -> StagedCompetitions:
    """Copies the named MLE-bench competitions from ``url`` into ``cache_dir/mlebench/<id>/``.

    Per competition (as ``launch/stage_mlebench.py`` staged it), each part fetched on its own:
    ``<url>/<id>/prepared/public`` and ``<url>/<id>/prepared/private`` (``storage.local_copy``
    each, reused until their remote files change), and the competition files directly under
    ``<url>/<id>/`` (``COMPETITION_FILES`` and the grader's ``*.py``; what a host without
    mlebench needs to load and grade it). Nothing else under ``<url>/<id>/`` (``raw/``, Kaggle's
    zip) and no other competition is downloaded. The private answers land in the cache, as a
    local ``data_dir``'s do: the sandbox hides ``prepared/private`` (``Task.hidden_paths``) and
    mounts only the public folder.

    Returns:
      the local data folder and the bytes downloaded per competition by this call.

    Raises:
      TaskLoadError: no competition named (a bucket is never downloaded whole), a competition
        not under ``url``, or one without its private answers.
    """
    ids = list(ids)
    if not ids:
        raise TaskLoadError(
            f"tasks.ids=() with tasks.data_dir={url!r}: name the competitions to load (e.g. "
            "tasks.ids=('spooky-author-identification',)); a bucket is never downloaded whole")
    local = os.path.join(cache_dir, "mlebench")
    downloaded = {}
    for cid in ids:
        comp_url, comp_dir = storage.join(url, cid), os.path.join(local, cid)
        prepared = os.path.join(comp_dir, "prepared")
        try:
            n = _fetch_folder(storage.join(comp_url, "prepared", "public"), prepared, "public")
        except FileNotFoundError:
            raise TaskLoadError(f"tasks.data_dir={url!r} holds no competition {cid!r} "
                                f"(expected {storage.join(comp_url, 'prepared', 'public')}/...; "
                                "stage it with launch/stage_mlebench.py)") from None
        try:
            n += _fetch_folder(storage.join(comp_url, "prepared", "private"), prepared, "private")
        except FileNotFoundError:
            raise TaskLoadError(f"competition {cid!r} in tasks.data_dir={url!r} has no private "
                                f"answers (expected {storage.join(comp_url, 'prepared', 'private')}"
                                "/...; stage it with launch/stage_mlebench.py)") from None
        n += _fetch_competition_files(comp_url, comp_dir)
        downloaded[cid] = n
        log.info("task %s staged from %s in %s: %d bytes downloaded", cid, url, comp_dir, n)
    return StagedCompetitions(data_dir=local, downloaded=downloaded)
