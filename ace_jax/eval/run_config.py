"""What an evaluation takes from a training run and its specs: the run's ``agent`` and ``buffer``
config sections (so evaluation prompts match its training), its tasks, and the advisor.

The run's ``config.json`` is read by ``runs.read_run_config``; a policy is built from its spec
by ``policy.policy_from_spec``; tasks are loaded by ``env.tasks.load_tasks``.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

import ml_collections

from ace_jax import config_utils
from ace_jax.curriculum import buffer as buffer_lib
from ace_jax.env import agent, tasks as tasks_lib
from ace_jax.env.advice import Advisor
from ace_jax.eval.harness import EvaluationError
from ace_jax.policy import policy as policy_lib, runs


def run_agent_config(workdir: Union[str, os.PathLike]) -> ml_collections.ConfigDict:
    """The ``agent`` section a run trained with (so evaluation prompts match its training).

    Raises ``interface.PolicyError`` (not a run directory), ``config_utils.ConfigKeyError`` (a key
    this checkout's ``agent`` section does not have; the message lists the valid keys) or
    ``config_utils.ConfigError`` (a value of the wrong type)."""
    return config_utils.merge_section(agent.default_config(),
                                      runs.read_run_config(workdir).get("agent"), "agent")


def run_buffer_config(workdir: Union[str, os.PathLike]) -> ml_collections.ConfigDict:
    """The ``buffer`` section a run trained with (history length, stderr tail); errors as
    ``run_agent_config``."""
    return config_utils.merge_section(buffer_lib.default_config(),
                                      runs.read_run_config(workdir).get("buffer"), "buffer")


def run_tasks(ids: Sequence[str], run_cfg: Optional[dict[str, Any]] = None, *,
              cache_dir: str = "", task_seed: int = 0, exec_time_limit_s: float = 0.0) -> list:
    """The tasks to evaluate on (``env.tasks.load_tasks``): the run's task source (the offline
    suite, prepared into the cache if missing, or the run's MLE-bench competitions from its
    ``tasks.data_dir``, staged from gs:// when remote); what is not given comes from the run's
    config.

    Args:
      ids: task ids; empty: the run's ``tasks.ids``, else the whole offline suite.
      run_cfg: a run's config dict (``runs.read_run_config``) or None.
      cache_dir: prepared tasks; empty: the run's ``tasks.cache_dir``, else ``cache/tasks``.
      task_seed: the seed the tasks were prepared with (its reference leaderboard must exist).
      exec_time_limit_s: per-execution limit (s); 0: the run's ``sandbox.max_time_limit_s`` (or
        ``tasks.time_limit_s`` of older runs), else the task's own.

    Raises:
      env.tasks.TaskLoadError: an unknown task id (the message lists the available ones).
    """
    run_tasks_cfg = (run_cfg or {}).get("tasks") or {}
    run_sandbox = (run_cfg or {}).get("sandbox") or {}
    limit = exec_time_limit_s or float(run_sandbox.get("max_time_limit_s")
                                       or run_tasks_cfg.get("time_limit_s") or 0.0)  # older runs
    return tasks_lib.load_tasks(list(ids) or list(run_tasks_cfg.get("ids") or []),
                                source=run_tasks_cfg.get("source") or "offline",
                                data_dir=run_tasks_cfg.get("data_dir") or "",
                                cache_dir=cache_dir or run_tasks_cfg.get("cache_dir")
                                or "cache/tasks",
                                seed=task_seed, time_limit_s=limit)


def advisor_from_spec(spec: str, **policy_kwargs: Any) -> Advisor:
    """``ace_jax.ideator.advisor.Ideator(policy.policy_from_spec(spec))``; EvaluationError if that
    module is not in this checkout (an ImportError raised inside it propagates unchanged)."""
    try:
        from ace_jax.ideator import advisor
    except ModuleNotFoundError as e:
        if e.name != "ace_jax.ideator.advisor":
            raise
        raise EvaluationError("--ideator needs ace_jax/ideator/advisor.py (MLE-Ideator's "
                              "Ideator), which this checkout does not have; run without "
                              "--ideator") from None
    return advisor.Ideator(policy_lib.policy_from_spec(spec, **policy_kwargs))
