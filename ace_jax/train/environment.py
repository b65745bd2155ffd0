"""The environment a policy acts in, as the training loop sees it.

``Trainer.step()`` is one loop for every environment: select states, build prompts, generate,
execute, reward, learn, grow the buffer, persist. What the policy's completions *mean* is the
environment's: the prompt of a state, how a step's completions become executions, and what a
step adds to its rollout log and its metrics. A variant of the method is an environment plus a
config (``mode``), not a trainer subclass:

* ``CodeAgentEnv`` (``mode = "acegrpo"``): the policy writes the script itself
  (``agent.render_prompt`` -> ``agent.parse_action`` -> the sandbox pool).
* ``ace_jax.ideator.ideator_trainer.IdeatorEnv`` (``mode = "ideator"``): the policy writes an
  idea, a frozen implementer writes the script.

An environment is bound to its trainer (``bind``) at the end of ``Trainer.__init__``; its
methods then read the run's parts (config, tasks, buffer, sandbox pool, model) from it.
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence

import ml_collections

from ace_jax.env import agent
from ace_jax.runtime import multihost
from ace_jax.train import sft
from ace_jax.train.rollouts import Rollout, StepRollouts


class Environment(Protocol):
    """What the loop asks of an environment (all called on the trainer's host thread)."""

    def tokenizer_texts(self, cfg: ml_collections.ConfigDict, tasks: Sequence[Any]) -> list[str]:
        """Texts a tokenizer trained for this run sees besides the agent prompts and the seed
        scripts (called in ``Trainer.__init__``, before ``bind``)."""

    def bind(self, trainer: Any) -> None:
        """Called once the trainer's model, tokenizer, buffer and checkpointer exist; may check
        the config against the model (raising ``setup.SetupError``)."""

    def sft_examples(self) -> list:
        """The warm start's (prompt, completion) examples."""

    def after_warm_start(self) -> None:
        """Called after the warm start of a fresh run (not on a resume)."""

    def prompt_text(self, state: Any) -> str:
        """The policy's chat prompt for a buffer state (rendered text)."""

    def execute(self, s: StepRollouts) -> None:
        """Sets every rollout's ``action`` and ``s.futures`` (one sandbox future or None per
        rollout). Also used on a resume to run the steps in flight again."""

    def record(self, r: Rollout) -> dict:
        """Fields this environment adds to the rollout's line of ``rollouts/<step>.jsonl``."""

    def metrics(self, s: StepRollouts) -> dict[str, float]:
        """Metrics this environment adds to the step's (after its results and rewards)."""


class CodeAgentEnv:
    """AceGRPO's environment: the policy is the agent and writes the script itself."""

    trainer: Any = None

    def tokenizer_texts(self, cfg, tasks) -> list[str]:
        return []

    def bind(self, trainer) -> None:
        self.trainer = trainer

    def sft_examples(self) -> list:
        t = self.trainer
        return sft.build_sft_examples(t.tasks, t.cfg.sft, t.cfg.agent)

    def after_warm_start(self) -> None:
        pass

    def prompt_text(self, state) -> str:
        t = self.trainer
        return agent.render_prompt(state, t.task_by_id[state.task_id], t.cfg.agent)

    def execute(self, s: StepRollouts) -> None:
        """Parses every completion and sends the valid actions of this process's share
        (`multihost.my_share`; all of them on one host) to its sandbox pool."""
        t = self.trainer
        mine = multihost.my_share(len(s.rollouts))
        s.futures = []
        for i, r in enumerate(s.rollouts):
            r.action = agent.parse_action(r.text, max_code_chars=t.cfg.agent.max_code_chars)
            s.futures.append(t.pool.submit(t.task_by_id[r.task_id], r.action.code)
                             if r.action.valid and i in mine else None)

    def record(self, r: Rollout) -> dict:
        return {}

    def metrics(self, s: StepRollouts) -> dict[str, float]:
        return {}
