"""The code agent's environment (``mode = "acegrpo"``), AceGRPO's: the policy is the agent and
writes the script itself (``agent.render_prompt`` -> ``agent.parse_action`` -> the sandbox pool).

The ``Environment`` protocol and the ``EnvContext`` an environment is bound to are
``ace_jax.env.environment``'s; ``python -m ace_jax`` maps a config's ``mode`` to an
environment.
"""
from __future__ import annotations

from typing import Any, Optional

from ace_jax.env import agent
from ace_jax.env.environment import EnvContext
from ace_jax.runtime import multihost
from ace_jax.train import sft
from ace_jax.train.rollouts import Rollout, StepRollouts


class CodeAgentEnv:
    """AceGRPO's environment: the policy is the agent and writes the script itself."""

    mode = "acegrpo"

    def __init__(self):
        self.ctx: Optional[EnvContext] = None

    def tokenizer_texts(self, cfg, tasks) -> list[str]:
        return []

    def bind(self, ctx: EnvContext) -> None:
        self.ctx = ctx

    def sft_examples(self) -> list:
        c = self.ctx
        return sft.build_sft_examples(c.tasks, c.cfg.sft, c.cfg.agent)

    def after_warm_start(self, model: Any) -> None:
        pass

    def prompt_text(self, state) -> str:
        c = self.ctx
        return agent.render_prompt(state, c.task_by_id[state.task_id], c.cfg.agent)

    def execute(self, s: StepRollouts) -> None:
        """Parses every completion and sends the valid actions of this process's share
        (`multihost.my_share`; all of them on one host) to its sandbox pool."""
        c = self.ctx
        mine = multihost.my_share(len(s.rollouts))
        s.futures = []
        for i, r in enumerate(s.rollouts):
            r.action = agent.parse_action(r.text, max_code_chars=c.cfg.agent.max_code_chars)
            s.futures.append(c.submit(c.task_by_id[r.task_id], r.action.code)
                             if r.action.valid and i in mine else None)

    def record(self, r: Rollout) -> dict:
        return {}

    def metrics(self, s: StepRollouts) -> dict[str, float]:
        return {}
