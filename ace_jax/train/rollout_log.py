"""The rollouts log: ``<workdir>/rollouts/<step>.jsonl`` (local or gs://), one JSON line per
completion of a step learned on: its state, token counts (prompt, completion) and finish reason,
parsed action, status, dev score, reward and policy version, the environment's own fields, and
with partial rollouts its (group, sample) name. A resumed run that replays a step rewrites the
step's file, so the log names every completion once."""
from __future__ import annotations

import json
from typing import Callable

from ace_jax.runtime import generate, storage
from ace_jax.train.rollouts import Rollout, StepRollouts


def record(step: int, r: Rollout) -> dict:
    """The fields of one completion ``r`` of RL step ``step`` that every environment logs."""
    res = r.result
    return dict(
        step=step, state_id=r.state_id, task_id=r.task_id, text=r.text,
        valid_format=r.action.valid,
        invalid_reason=None if r.action.valid else r.action.reason.value,
        status=None if res is None else res.status.value,
        dev_score=None if res is None else res.dev_score,
        stderr_tail=None if res is None else res.stderr[-300:],
        reward=r.reward, policy_version=r.policy_version)


def write(workdir: str, s: StepRollouts, group_size: int,
          env_record: Callable[[Rollout], dict]) -> None:
    """Writes step ``s``'s file (``env_record``: the environment's fields of a completion)."""
    g = s.gen
    rows = []
    for i, r in enumerate(s.rollouts):
        b = int(g.prompt_index[i])
        names = ({} if s.group_ids is None or s.group_ids[b] is None
                 else dict(group=s.group_ids[b], sample=i % group_size))
        rows.append(json.dumps(dict(
            record(s.step, r), **env_record(r), prompt_tokens=len(s.prompts[b]),
            completion_tokens=int(g.lengths[i]),
            finish_reason=generate.FinishReason(int(g.finish_reason[i])).name.lower(), **names)))
    storage.write_text(storage.join(workdir, "rollouts", f"{s.step:06d}.jsonl"),
                       "\n".join(rows) + "\n")
