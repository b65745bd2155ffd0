"""The evaluation harness: one episode per (task, seed), run in threads, and their summary.

``evaluate`` runs ``runner.run_episode`` for every task and seed (logs under
``<out>/episodes/``, see ``episodes``) and aggregates the metrics (``scoring.summarize``) into an
``EvaluationResult``; ``reports`` turns that into a table, a markdown report and plots.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from typing import Any, Callable, Optional, Sequence, Union

import ml_collections

from ace_jax.env import agent
from ace_jax.env.advice import Advisor
from ace_jax.eval.episodes import Episode, episode_log_path
from ace_jax.eval.runner import run_episode
from ace_jax.eval.scoring import TaskSummary, summarize


class EvaluationError(RuntimeError):
    """A setup problem of the evaluation (bad policy spec, missing module, unknown task)."""



@dataclasses.dataclass
class EvaluationResult:
    """Everything one evaluation produced (``evaluate``)."""
    policy: str
    config: dict[str, Any]
    episodes: list[Episode]
    tasks: list[TaskSummary]
    overall: TaskSummary
    notes: list[str]
    wall_s: float

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "config": self.config, "wall_s": self.wall_s,
                "notes": self.notes, "overall": dataclasses.asdict(self.overall),
                "tasks": [dataclasses.asdict(t) for t in self.tasks],
                "episodes": [e.to_dict(with_steps=False) for e in self.episodes]}



def evaluate(policy: Any, tasks: Sequence[Any], pool: Any, *, seeds: Sequence[int] = (0,),
             max_steps: int = 4, time_budget_s: Optional[float] = None,
             advisor: Optional[Advisor] = None, stagnation_steps: int = 2,
             agent_cfg: Optional[ml_collections.ConfigDict] = None,
             buffer_cfg: Optional[ml_collections.ConfigDict] = None,
             out_dir: Optional[Union[str, os.PathLike]] = None, episode_workers: int = 1,
             serialize_policy: bool = True, progress: bool = False,
             on_episode: Optional[Callable[[Episode, Optional[str]], None]] = None
             ) -> EvaluationResult:
    """Runs one episode per (task, seed) and aggregates the metrics.

    Args:
      policy, pool, max_steps, time_budget_s, advisor, stagnation_steps, agent_cfg, buffer_cfg:
        as in ``run_episode``.
      tasks: the tasks (unique ids).
      seeds: episode seeds; every task runs once per seed.
      out_dir: where the episode logs go (``episode_log_path``); None: no logs.
      episode_workers: episodes run concurrently in threads (the pool's workers are shared).
      serialize_policy: one policy call at a time across threads (a JAX policy needs it; an HTTP
        policy does not).
      progress: a tqdm bar over episodes.
      on_episode: called with each finished episode and its log path (None without
        ``out_dir``), in the thread that ran it (``launch/evaluate.py`` copies the log to a
        gs:// ``--out`` at once).

    Returns:
      an ``EvaluationResult``; episodes ordered by task (as given) then seed. A failure of one
      episode (even a broken grader or task) is recorded and the others still run.
    """
    ids = [t.task_id for t in tasks]
    if len(set(ids)) != len(ids):
        raise EvaluationError(f"duplicate task ids: {ids}")
    if not seeds:
        raise EvaluationError("no seeds given")
    if episode_workers < 1:
        raise ValueError(f"episode_workers must be >= 1, got {episode_workers}")
    lock = threading.Lock() if serialize_policy and episode_workers > 1 else None
    jobs = [(t, int(s)) for t in tasks for s in seeds]
    t0 = time.monotonic()

    def one(job: tuple[Any, int]) -> Episode:
        task, seed = job
        log = None if out_dir is None else episode_log_path(out_dir, task.task_id, seed)
        ep = run_episode(policy, task, pool, seed=seed, max_steps=max_steps,
                         time_budget_s=time_budget_s, advisor=advisor,
                         stagnation_steps=stagnation_steps, agent_cfg=agent_cfg,
                         buffer_cfg=buffer_cfg, log_path=log, policy_lock=lock)
        if on_episode is not None:
            on_episode(ep, None if log is None else str(log))
        return ep

    episodes = _run_jobs(one, jobs, episode_workers, progress)
    task_summaries, overall, notes = summarize(episodes)
    config = {"tasks": ids, "seeds": [int(s) for s in seeds], "max_steps": max_steps,
              "time_budget_s": time_budget_s, "stagnation_steps": stagnation_steps,
              "advisor": None if advisor is None else type(advisor).__name__,
              "agent": (agent_cfg or agent.default_config()).to_dict()}
    return EvaluationResult(policy=str(getattr(policy, "name", type(policy).__name__)),
                            config=config, episodes=episodes, tasks=task_summaries,
                            overall=overall, notes=notes, wall_s=time.monotonic() - t0)


def _run_jobs(fn: Callable[[Any], Episode], jobs: list, workers: int,
              progress: bool) -> list[Episode]:
    from tqdm.auto import tqdm

    bar = tqdm(total=len(jobs), desc="episodes", unit="ep", disable=not progress)
    try:
        if workers == 1:
            out = []
            for j in jobs:
                out.append(fn(j))
                bar.update(1)
            return out
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="episode") as ex:
            futures = [ex.submit(fn, j) for j in jobs]
            for _ in concurrent.futures.as_completed(futures):
                bar.update(1)
            return [f.result() for f in futures]
    finally:
        bar.close()
