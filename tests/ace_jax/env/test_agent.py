"""Tests of ace_jax.env.agent: step kinds, prompt rendering, the action format (parse / target)."""
import pytest

from ace_jax.curriculum.buffer import State, StepSummary
from ace_jax.env import agent
from models.tokenizer import IM_END, render_chat
from sandbox.tasks.base import Task

DESCRIPTION = """# Toy flowers

## Overview

Predict the colour of a flower from its size. Second sentence is not shown.

## Data

- `train.csv`: rows.
"""


@pytest.fixture
def task(tmp_path):
    pub = tmp_path / "public"
    pub.mkdir()
    cols = ["id"] + [f"px_{i}" for i in range(10)] + ["size", "colour"]
    (pub / "train.csv").write_text(",".join(cols) + "\n" + ",".join(["1"] * len(cols)) + "\n")
    (pub / "test.csv").write_text(",".join(cols[:-1]) + "\n" + ",".join(["1"] * (len(cols) - 1)) + "\n")
    return Task(task_id="toy-flowers", description=DESCRIPTION, public_dir=pub, private_dir=tmp_path / "private",
                metric="accuracy", lower_is_better=False, target_columns=("colour",), labels=("red", "blue"))


def state(code="", history=(), score=None, task_id="toy-flowers"):
    return State(state_id=7, task_id=task_id, parent_id=None, depth=len(history), code=code,
                 history=list(history), score=score, origin="rollout", created_step=0)


OK = StepSummary("draft", "ok", 0.8125, "")
FAIL = StepSummary("improve", "runtime_error", None, "Traceback...\nNameError: name 'np' is not defined")


def test_step_kind():
    assert agent.step_kind(state()) == "draft"
    assert agent.step_kind(state(code="  \n")) == "draft"
    assert agent.step_kind(state(code="print(1)\n")) == "improve"  # seed with code, never run
    assert agent.step_kind(state(code="x", history=[OK])) == "improve"
    assert agent.step_kind(state(code="x", history=[OK, FAIL])) == "debug"
    assert agent.step_kind(state(code="x", history=[FAIL, OK])) == "improve"


def test_compress_columns():
    cols = ["id"] + [f"pixel_{i}" for i in range(64)] + ["label"]
    assert agent.compress_columns(cols, 0) == "id, pixel_0..pixel_63 (64 columns), label"
    assert agent.compress_columns(["a1", "a2", "b"], 0) == "a1, a2, b"  # runs of 2 stay
    cut = agent.compress_columns([f"c{i}x" for i in range(100)], 30)
    assert len(cut) <= 30 and cut.endswith("...")


def test_brief_draft_prompt(task):
    cfg = agent.default_config()
    msgs = agent.render_messages(state(), task, cfg)
    assert [m["role"] for m in msgs] == ["system", "user"]
    sys_text, user = msgs[0]["content"], msgs[1]["content"]
    for rule in ("./input", "./submission/submission.csv", "VALIDATION_METRIC: <float>", "```python"):
        assert rule in sys_text
    assert user.startswith("Task: toy-flowers\nPredict the colour of a flower from its size.\n")
    assert "Second sentence" not in user
    assert "Metric: accuracy (higher is better)." in user
    assert "train.csv target: colour\nfeatures (11): px_0..px_9 (10 columns), size\n" in user
    assert "submission.csv columns: id, colour" in user and "labels: red, blue" in user
    assert "Current script" not in user and user.endswith("Step: draft. Write a first solution.")
    prompt = agent.render_prompt(state(), task, cfg)
    assert prompt == render_chat(msgs, add_generation_prompt=True, enable_thinking=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_full_description_and_no_system(task):
    cfg = agent.default_config()
    cfg.description, cfg.show_system = "full", False
    msgs = agent.render_messages(state(), task, cfg)
    assert len(msgs) == 1 and msgs[0]["content"].startswith(DESCRIPTION.strip())
    cfg.description = "short"
    with pytest.raises(agent.AgentError, match="description"):
        agent.render_messages(state(), task, cfg)


def test_debug_prompt_shows_code_history_and_stderr(task):
    cfg = agent.default_config()
    cfg.max_history, cfg.stderr_tail_chars = 1, 30
    s = state(code="import pandas\nprint(np.zeros(1))\n", history=[OK, FAIL], score=0.8125)
    user = agent.render_messages(s, task, cfg)[1]["content"]
    assert "Current script:\n```python\nimport pandas\nprint(np.zeros(1))\n```" in user
    assert "History:\n2. improve: runtime_error\n" in user           # only the last entry (max_history=1)
    assert "1. draft" not in user
    assert "NameError: name 'np' is not defined"[-30:] in user and "Traceback" not in user
    assert "Best score so far: 0.8125" in user
    assert user.endswith("Step: debug. The last run failed. Fix the script.")
    s_ok = state(code="x = 1\n", history=[FAIL, OK], score=0.8125)
    assert agent.render_messages(s_ok, task, cfg)[1]["content"].endswith(
        "Step: improve. Improve the score of the script.")


def test_long_code_is_cut(task):
    cfg = agent.default_config()
    cfg.max_code_chars = 20
    user = agent.render_messages(state(code="a = 1\n" * 50, history=[OK]), task, cfg)[1]["content"]
    assert "a = 1\na = 1\na = 1\n# ... (cut)\n```" in user and user.count("a = 1") == 3


def test_wrong_task_is_an_error(task):
    with pytest.raises(agent.AgentError, match="other-task"):
        agent.render_messages(state(task_id="other-task"), task)


CODE = "import os\n\nprint('VALIDATION_METRIC: 1.0')\n"


def test_target_round_trips():
    text = agent.completion_target(CODE)
    assert text == "```python\n" + CODE + "```"
    assert agent.parse_action(text) == agent.Action(code=CODE)
    assert agent.parse_action(text + IM_END) == agent.Action(code=CODE)  # EOS left in by the decoder
    with_idea = agent.completion_target(CODE, idea="use  a\nrandom forest")
    assert agent.parse_action(with_idea) == agent.Action(code=CODE, idea="use a random forest")
    assert agent.parse_action("Let me think.\n" + text + "\nDone.").code == CODE  # free text around


@pytest.mark.parametrize("text,reason", [
    ("no code here", agent.InvalidReason.NO_BLOCK),
    ("", agent.InvalidReason.NO_BLOCK),
    ("```python\nx = 1\n```\n```python\ny = 2\n```", agent.InvalidReason.MULTIPLE_BLOCKS),
    ("```python\nx = 1\n```\n```python\ny = 2\n", agent.InvalidReason.MULTIPLE_BLOCKS),
    ("```python\nimport os\nx = 1", agent.InvalidReason.UNCLOSED_BLOCK),  # cut by the budget
    ("```python\n  \n\n```", agent.InvalidReason.EMPTY_CODE),
    ("```bash\nls\n```", agent.InvalidReason.NOT_PYTHON),
    ("```python import os\nx=1\n```", agent.InvalidReason.NO_BLOCK),
])
def test_invalid_formats_are_typed(text, reason):
    out = agent.parse_action(text)
    assert isinstance(out, agent.InvalidAction) and not out.valid
    assert out.reason is reason and out.detail


def test_untagged_block_and_too_long():
    assert agent.parse_action("```\nx = 1\n```") == agent.Action(code="x = 1\n")
    out = agent.parse_action(agent.completion_target("x = 1\n" * 10), max_code_chars=20)
    assert isinstance(out, agent.InvalidAction) and out.reason is agent.InvalidReason.TOO_LONG
    with pytest.raises(TypeError):
        agent.parse_action(None)


def test_completion_target_rejects_unfenceable_code():
    with pytest.raises(agent.AgentError, match="non-blank"):
        agent.completion_target("  \n")
    with pytest.raises(agent.AgentError, match="```"):
        agent.completion_target("x = 1\n```\n")
