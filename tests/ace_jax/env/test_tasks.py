"""env/tasks.py: the one task loader of the trainer and the evaluation harness, on the real
offline suite (iris prepared into a temporary cache)."""
import dataclasses
import logging

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
