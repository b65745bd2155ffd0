"""Episode logs: replayed exactly, and exported as seed solutions / buffer states."""
import dataclasses
import json

import pytest

from ace_jax.curriculum import buffer as buffer_lib
from ace_jax.env import agent
from ace_jax.eval import episodes
from tests.ace_jax.eval.scripted import TASK_ID, targets_of


def test_log_replays_and_exports_seed_states(main_episode, iris):
    ep, task, _ = main_episode
    replay = episodes.load_episode(ep.log_path)
    assert replay.to_dict() == ep.to_dict()
    rows = [json.loads(x) for x in open(ep.log_path)]
    assert [r["type"] for r in rows] == ["header"] + ["step"] * 6 + ["final"]
    assert rows[1]["prompt"][-1]["role"] == "user" and rows[5]["completion"].startswith("Idea:")

    sols = episodes.episodes_to_seed_solutions([ep.log_path])
    assert [(s.task_id, s.score) for s in sols] == [(TASK_ID, ep.steps[i].dev_score)
                                                    for i in (3, 4, 5)]
    buf = buffer_lib.EvolvingBuffer(buffer_lib.default_config(), [targets_of(task)])
    ids = episodes.episodes_to_seed_states(buf, [ep], step=7)
    states = [buf.get(i) for i in ids]
    assert [s.origin for s in states] == ["evaluation"] * 3
    assert [s.code for s in states] == [ep.steps[i].code for i in (3, 4, 5)]
    assert agent.step_kind(states[0]) == "improve"  # code, no history: improvable like a seed
    other = buffer_lib.EvolvingBuffer(buffer_lib.default_config(),
                                      [dataclasses.replace(targets_of(task), task_id="other")])
    with pytest.raises(buffer_lib.UnknownTaskError):
        episodes.episodes_to_seed_states(other, [ep])
    assert episodes.episodes_to_seed_states(other, [ep], skip_unknown_tasks=True) == []
