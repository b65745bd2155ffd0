"""A run's config sections, tasks and advisor spec as the evaluation reads them."""
import json
import sys

import pytest

from ace_jax import config_utils
from ace_jax.env import tasks as tasks_lib
from ace_jax.eval import harness, run_config
from tests.ace_jax.eval.scripted import TASK_ID


def test_run_config_sections_refuse_unknown_keys(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(
        {"model": {}, "agent": {"show_system": False}, "buffer": {"history_len": 2}}))
    assert run_config.run_agent_config(run).show_system is False
    assert run_config.run_buffer_config(run).history_len == 2
    (run / "config.json").write_text(json.dumps({"model": {}, "agent": {"show_sytem": False}}))
    with pytest.raises(config_utils.ConfigKeyError, match="agent.show_sytem") as info:
        run_config.run_agent_config(run)
    assert "agent.show_system" in str(info.value)  # the valid keys are listed
    (run / "config.json").write_text(json.dumps({"model": {}, "buffer": {"history_len": "x"}}))
    with pytest.raises(config_utils.ConfigError, match="buffer.history_len"):
        run_config.run_buffer_config(run)


def test_run_tasks_default_to_the_runs(iris, task_cache):
    run_cfg = {"tasks": {"ids": [TASK_ID], "cache_dir": str(task_cache)},
               "sandbox": {"max_time_limit_s": 1.5}}
    (task,) = run_config.run_tasks([], run_cfg)
    assert task.task_id == TASK_ID and task.time_limit_s == 1.5
    (task,) = run_config.run_tasks([TASK_ID], run_cfg, exec_time_limit_s=0.5)
    assert task.time_limit_s == 0.5
    with pytest.raises(tasks_lib.TaskLoadError, match="available"):
        run_config.run_tasks(["no-such-task"], run_cfg)


def test_missing_ideator_module_is_a_clear_error(monkeypatch):
    import ace_jax

    monkeypatch.delattr(ace_jax, "ideator", raising=False)
    if "ace_jax.ideator" in sys.modules:   # imported by an earlier test: hide its submodule too
        monkeypatch.delattr(sys.modules["ace_jax.ideator"], "advisor", raising=False)
    monkeypatch.setitem(sys.modules, "ace_jax.ideator.advisor", None)
    with pytest.raises(harness.EvaluationError, match="ace_jax/ideator/advisor.py"):
        run_config.advisor_from_spec("openai:http://127.0.0.1:9/v1#m")
