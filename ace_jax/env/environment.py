"""The environment a policy acts in, as the training loop sees it, and what it may read of its run.

``Trainer.step()`` (``ace_jax.train.trainer``) is one loop for every environment: select states,
build prompts, generate, execute, reward, learn, grow the buffer, persist. What the policy's
completions *mean* is the environment's: the prompt of a state, how a step's completions become
executions, and what a step adds to its rollout log and its metrics. A variant of the method is an
environment plus a config (``mode``), not a trainer subclass; ``python -m ace_jax`` maps the
config's ``mode`` to an environment (``ace_jax.__main__.ENVIRONMENTS``):

* ``"acegrpo"``: ``ace_jax.train.environment.CodeAgentEnv``, the policy writes the script itself.
* ``"ideator"``: ``ace_jax.ideator.ideator_trainer.IdeatorEnv``, the policy writes an idea and a
  frozen implementer writes the script.

The trainer binds its environment to an ``EnvContext`` at the end of ``Trainer.__init__``: the
parts of the run an environment may read, and nothing else of the trainer.
"""
from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Protocol, Sequence

import ml_collections

from ace_jax.curriculum.buffer import State
from sandbox.result import ExecutionResult
from sandbox.tasks.targets import TaskTargets

__all__ = ["EnvContext", "Environment"]


@dataclasses.dataclass(frozen=True)
class EnvContext:
    """What an environment may read of its run (given to ``Environment.bind``).

    Attributes:
      cfg: the run's resolved config (``lp.seed`` / ``sft.seed`` = the run's seed).
      workdir: the run's output folder (local or ``gs://``).
      tasks / task_by_id: the training tasks (``sandbox.tasks.base.Task``), and by id.
      targets: task id -> the task's score facts (direction, baseline, medal lines).
      model: the policy as built (an ``nnx.Module``; before any warm start: its structure and
        config; ``Environment.after_warm_start`` gets the warm-started one).
      tokenizer: the run's tokenizer (HF ``PreTrainedTokenizerFast``).
      replicate: puts a host value on every device of the run's mesh as one global array.
      submit: sends (task, script) to this process's sandbox pool -> a future of its
        ``ExecutionResult`` (usable once the run has started).
    """

    cfg: ml_collections.ConfigDict
    workdir: str
    tasks: Sequence[Any]
    task_by_id: Mapping[str, Any]
    targets: Mapping[str, TaskTargets]
    model: Any
    tokenizer: Any
    replicate: Callable[[Any], Any]
    submit: Callable[[Any, str], "Future[ExecutionResult]"]


class Environment(Protocol):
    """What the loop asks of an environment (all called on the trainer's host thread).

    ``mode`` is the config's ``mode`` the environment serves; the rollouts passed to
    ``execute`` / ``record`` / ``metrics`` are ``ace_jax.train.rollouts`` records
    (``StepRollouts`` of one step, ``Rollout`` of one completion).
    """

    mode: str

    def tokenizer_texts(self, cfg: ml_collections.ConfigDict, tasks: Sequence[Any]) -> list[str]:
        """Texts a tokenizer trained for this run sees besides the agent prompts and the seed
        scripts (called in ``Trainer.__init__``, before ``bind``)."""

    def bind(self, ctx: EnvContext) -> None:
        """Called once the run's model, tokenizer and buffer exist; may check the config against
        the model (raising ``ace_jax.train.setup.SetupError``)."""

    def sft_examples(self) -> list:
        """The warm start's (prompt, completion) examples."""

    def after_warm_start(self, model: Any) -> None:
        """Called with the warm-started policy after the warm start of a fresh run (not on a
        resume)."""

    def prompt_text(self, state: State) -> str:
        """The policy's chat prompt for a buffer state (rendered text)."""

    def execute(self, s: Any) -> None:
        """Sets every rollout's ``action`` and ``s.futures`` (one sandbox future or None per
        rollout) of a ``StepRollouts``. Also used on a resume to run the steps in flight again."""

    def record(self, r: Any) -> dict:
        """Fields this environment adds to the rollout's line of ``rollouts/<step>.jsonl``."""

    def metrics(self, s: Any) -> dict[str, float]:
        """Metrics this environment adds to the step's (after its results and rewards)."""

