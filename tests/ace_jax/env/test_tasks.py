"""env/tasks.py: the one task loader of the trainer and the evaluation harness, on the real
offline suite (iris prepared into a temporary cache)."""
import dataclasses
import logging
import os

import pytest

from ace_jax.env import tasks as tasks_lib
from sandbox.tasks import registry

TASK_ID = "iris-species"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("tasks"))


def test_offline_tasks_load_with_a_capped_time_limit(cache):
    (task,) = tasks_lib.load_tasks([TASK_ID], cache_dir=cache)
    own = task.time_limit_s
    assert task.task_id == TASK_ID and task.baseline_score is not None and task.leaderboard
    (capped,) = tasks_lib.load_tasks([TASK_ID], cache_dir=cache, time_limit_s=own / 2,
                                     training=True)
    assert capped.time_limit_s == own / 2
    (same,) = tasks_lib.load_tasks([TASK_ID], cache_dir=cache, time_limit_s=own * 10)
    assert same.time_limit_s == own


def test_unknown_ids_and_sources_are_refused_with_the_valid_ones(cache):
    with pytest.raises(tasks_lib.TaskLoadError, match="unknown task ids") as info:
        tasks_lib.load_tasks(["no-such-task"], cache_dir=cache)
    assert TASK_ID in str(info.value) and isinstance(info.value, ValueError)
    with pytest.raises(tasks_lib.TaskLoadError, match="valid: offline, mlebench"):
        tasks_lib.load_tasks([TASK_ID], source="kaggle")
    with pytest.raises(tasks_lib.TaskLoadError, match="not a directory"):
        tasks_lib.load_tasks(source="mlebench", data_dir=str(cache) + "/nope")


def test_training_needs_a_baseline_and_warns_without_a_leaderboard(cache, monkeypatch, caplog):
    (iris,) = tasks_lib.load_tasks([TASK_ID], cache_dir=cache)
    no_board = dataclasses.replace(iris, leaderboard=[])
    monkeypatch.setattr(registry, "load_suite", lambda *a, **k: [no_board])
    with caplog.at_level(logging.WARNING, logger="ace_jax.env.tasks"):
        assert tasks_lib.load_tasks([TASK_ID], training=True) == [no_board]
    assert "no reference leaderboard" in caplog.text
    caplog.clear()
    assert tasks_lib.load_tasks([TASK_ID]) == [no_board] and not caplog.text  # evaluation: quiet

    broken = dataclasses.replace(iris, baseline_score=None)
    monkeypatch.setattr(registry, "load_suite", lambda *a, **k: [broken])
    assert tasks_lib.load_tasks([TASK_ID]) == [broken]
    with pytest.raises(tasks_lib.TaskLoadError, match="anchors the rewards"):
        tasks_lib.load_tasks([TASK_ID], training=True)


def test_mlebench_tasks_from_a_bucket_are_staged_once_each(gcs_emulator, monkeypatch, tmp_path):
    """``tasks.data_dir=gs://...``: only the competitions asked for are copied into the cache
    (public and private apart, as prepared), reused until their remote files change. The
    competitions are MLE-bench's own (its config.yaml, preparer and grader)."""
    import fsspec

    from ace_jax.env import mlebench_data
    from ace_jax.runtime import storage
    from tests import mlebench_prepared

    a, b = "spooky-author-identification", "tabular-playground-series-dec-2021"
    data = mlebench_prepared.prepare(tmp_path, [a, b])
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon", "skip_instance_cache": True})
    url = "gs://" + gcs_emulator.prefix() + "/mlebench"
    mlebench_data.stage(data, [a, b], url)
    cache = tmp_path / "cache"
    [task] = tasks_lib.load_tasks([a], source="mlebench", data_dir=url, cache_dir=str(cache))
    staged = cache / "mlebench" / a
    assert sorted(os.listdir(cache / "mlebench")) == [a]              # b never fetched
    assert task.public_dir == staged / "prepared" / "public"
    assert str(staged / "prepared" / "private") in task.hidden_paths
    assert task.description == (staged / "description.md").read_text()
    assert task.description.startswith("# Overview")
    marker = (staged / "prepared" / "public" / ".complete").stat().st_mtime_ns
    tasks_lib.load_tasks([a], source="mlebench", data_dir=url, cache_dir=str(cache))
    assert (staged / "prepared" / "public" / ".complete").stat().st_mtime_ns == marker  # reused
    storage.write_text(storage.join(url, a, "description.md"), "# Changed\n")
    [task] = tasks_lib.load_tasks([a], source="mlebench", data_dir=url, cache_dir=str(cache))
    assert task.description == "# Changed\n"
    with pytest.raises(tasks_lib.TaskLoadError, match="holds no competition 'random-acts-of-pizza'"):
        tasks_lib.load_tasks(["random-acts-of-pizza"], source="mlebench", data_dir=url,
                             cache_dir=str(cache))
    # no competition named with a bucket: refused (a bucket is never downloaded whole)
    with pytest.raises(tasks_lib.TaskLoadError, match="name the competitions"):
        tasks_lib.load_tasks(source="mlebench", data_dir=url, cache_dir=str(cache))
    got = tasks_lib.load_tasks([a, b], source="mlebench", data_dir=url, cache_dir=str(cache))
    assert [t.task_id for t in got] == [a, b]
    assert {t.grader_source for t in got} == {"mlebench:staged"}
