"""Tests of ace_jax/ideator (ideator, prompts, advisor, sft_examples): the prompt, the strict
idea format, the category classifier, the Advisor over a scripted ChatPolicy, and the warm-start
examples. No JAX model is involved."""
import pytest

from ace_jax.curriculum.buffer import State, StepSummary
from ace_jax.env import agent
from ace_jax.env.advice import Advice, AdviceRequest, Attempt
from ace_jax.ideator import advisor, ideator, prompts, sft_examples
from ace_jax.ideator.ideator import IdeaError
from ace_jax.policy.interface import Completion
from sandbox.tasks.base import Task

DESCRIPTION = "# Toy flowers\n\n## Overview\n\nPredict the colour of a flower from its size.\n"
GOOD = ("Analysis: refine: the logistic regression under-fits the data.\n"
        "Action: Replace LogisticRegression with RandomForestClassifier(n_estimators=300).\n"
        "Rationale: Trees capture the non-linear size effects, so accuracy should rise.")


@pytest.fixture
def task(tmp_path):
    pub = tmp_path / "public"
    pub.mkdir()
    (pub / "train.csv").write_text("id,size,colour\n1,2,red\n")
    (pub / "test.csv").write_text("id,size\n1,2\n")
    return Task(task_id="toy-flowers", description=DESCRIPTION, public_dir=pub,
                private_dir=tmp_path / "private", metric="accuracy", lower_is_better=False,
                target_columns=("colour",), labels=("red", "blue"))


def request(task, **kw):
    attempts = [Attempt(0, "draft", "x = 1\n", "ok", 0.8125),
                Attempt(1, "improve", "y = 2\n", "runtime_error", None,
                        "Traceback (most recent call last):\nNameError: name 'np' is not defined")]
    args = dict(task=task, attempts=attempts, current_score=0.8125,
                current_code="import pandas as pd\nmodel = LogisticRegression()\n",
                reason="stagnation")
    args.update(kw)
    return AdviceRequest(**args)


# ------------------------------------------------------------------------------------ parsing


def test_parse_accepts_the_exact_structure():
    idea = ideator.parse_idea(GOOD)
    assert idea.valid and isinstance(idea, ideator.Idea)
    assert idea.verb == "refine"
    assert idea.analysis == "the logistic regression under-fits the data."
    assert idea.action.startswith("Replace LogisticRegression")
    assert idea.rationale.endswith("should rise.")
    assert ideator.parse_idea(idea.text()) == idea                      # canonical round trip
    assert ideator.parse_idea(GOOD + "<|im_end|>") == idea              # trailing EOS
    assert ideator.parse_idea("\n  " + GOOD + "\n<|endoftext|>\n") == idea
    assert ideator.parse_idea("<think>\nhmm\n</think>\n\n" + GOOD) == idea  # reasoning block
    assert ideator.parse_idea(GOOD.replace("refine:", "REVERT :")).verb == "revert"
    # Action may span lines and hold a code block (a code change); a label inside it is code.
    code = ("Analysis: revert: the last change broke the score.\nAction: Restore this line:\n"
            "```python\nNote: = 3\nmodel = Ridge(alpha=1.0)\n```\n"
            "Rationale: The earlier model was better.")
    parsed = ideator.parse_idea(code)
    assert parsed.valid and "model = Ridge(alpha=1.0)" in parsed.action


@pytest.mark.parametrize("text,reason", [
    ("", IdeaError.EMPTY),
    ("  <|im_end|>", IdeaError.EMPTY),
    ("Sure! Here is my idea.\n" + GOOD, IdeaError.PREAMBLE),
    ("Action: do it.\nAnalysis: refine: meh.\nRationale: because.", IdeaError.PREAMBLE),
    ("Analysis: refine: ok then.\nRationale: because it is.\nAction: do the thing.",
     IdeaError.WRONG_ORDER),
    ("Analysis: refine: ok then.\nAction: do the thing.", IdeaError.MISSING_FIELD),
    ("Analysis: refine: ok then.\nAction: do this.\nAction: and that.\nRationale: because.",
     IdeaError.DUPLICATE_FIELD),
    (GOOD.replace("Action: Replace LogisticRegression with RandomForestClassifier(n_estimators=300).",
                  "Action:   "), IdeaError.EMPTY_FIELD),
    (GOOD.replace("the logistic regression under-fits the data.", ""), IdeaError.EMPTY_FIELD),
    (GOOD.replace("refine:", "improve:"), IdeaError.BAD_VERB),
    (GOOD.replace("refine: ", "refine "), IdeaError.BAD_VERB),
    (GOOD.replace("\nAction:", "\n**Action:**"), IdeaError.BAD_LABEL),
    (GOOD.replace("\nRationale:", "\nrationale:"), IdeaError.BAD_LABEL),
    (GOOD + "\nNote: this is a guess.", IdeaError.EXTRA_FIELD),
    ("Analysis: refine: ok then.\nIdea: trees.\nAction: do it.\nRationale: because.",
     IdeaError.EXTRA_FIELD),
    (GOOD + "\n\nI hope this helps!", IdeaError.EXTRA_TEXT),
    (GOOD.replace("under-fits the data.", "under-fits.\n\nAlso the data."), IdeaError.EXTRA_TEXT),
    (GOOD.replace("Rationale: Trees capture the non-linear size effects, so accuracy should rise.",
                  "Rationale: ok"), IdeaError.TOO_SHORT),
    (GOOD.replace("Rationale: Trees", "Rationale: " + "very " * 100 + "Trees"), IdeaError.TOO_LONG),
    (GOOD.replace("so accuracy", "<|im_start|> so accuracy"), IdeaError.SPECIAL_TOKEN),
])
def test_parse_rejects_with_a_typed_reason(text, reason):
    out = ideator.parse_idea(text)
    assert not out.valid and isinstance(out, ideator.IdeaFormatError)
    assert out.reason is reason, out
    assert str(out).startswith(reason.value)


def test_parse_truncated_and_limits_from_the_config():
    assert ideator.parse_idea(GOOD, truncated=True).reason is IdeaError.TRUNCATED
    cfg = ideator.default_config()
    cfg.max_action_chars = 20
    assert ideator.parse_idea(GOOD, cfg).reason is IdeaError.TOO_LONG
    cfg.max_action_chars = 0                       # no bound
    assert ideator.parse_idea(GOOD, cfg).valid
    with pytest.raises(TypeError):
        ideator.parse_idea(None)


def test_format_idea_and_advice_modes():
    text = ideator.format_idea("revert", " go back. ", "Use the old model.", "It scored better.")
    assert text == ("Analysis: revert: go back.\nAction: Use the old model.\n"
                    "Rationale: It scored better.")
    idea = ideator.parse_idea(text)
    assert idea.advice() == "Use the old model."
    assert idea.advice("action_rationale") == "Use the old model.\nWhy: It scored better."
    assert idea.advice("full") == text
    with pytest.raises(ValueError):
        ideator.format_idea("retry", "a", "b", "c")
    with pytest.raises(ValueError):
        idea.advice("everything")


# ------------------------------------------------------------------------------------ categories


@pytest.mark.parametrize("action,category", [
    ("Average the predictions of the random forest and the logistic regression.", "ensembling"),
    ("Build a VotingClassifier over three models.", "ensembling"),
    ("Add polynomial features of the two size columns.", "feature_engineering"),
    ("Use TfidfVectorizer with ngram_range=(1, 2) on the text.", "feature_engineering"),
    ("Standardise the inputs with StandardScaler before the model.", "data_preparation"),
    ("Impute the missing values with the median.", "data_preparation"),
    ("Increase n_estimators from 50 to 300.", "hyperparameters"),
    ("Tune the learning rate of the booster with a grid search.", "hyperparameters"),
    ("Switch the model from DecisionTreeClassifier to RandomForestClassifier.", "model_choice"),
    ("Replace the ridge model with gradient boosting.", "model_choice"),
    ("Print more diagnostics.", "other"),
])
def test_category_of_each_kind(action, category):
    assert ideator.idea_category(action) == category
    idea = ideator.Idea("refine", "the score is flat.", action, "It should help.")
    assert idea.category == category


def test_category_prose_outvotes_quoted_code_and_falls_back_to_rationale():
    action = ("Switch the model from DecisionTreeClassifier to RandomForestClassifier: replace "
              "`model = DecisionTreeClassifier(max_depth=3)` with "
              "`model = RandomForestClassifier(n_estimators=300, min_samples_leaf=2)`.")
    assert ideator.idea_category(action) == "model_choice"
    assert ideator.idea_category("Apply `model.fit(X, y)` twice.") == "other"
    idea = ideator.Idea("refine", "too few trees.", "Do the obvious thing.",
                        "More trees reduce the variance: increase n_estimators.")
    assert idea.category == "hyperparameters"
    assert set(ideator.category_scores("x")) == set(ideator.CATEGORIES) - {"other"}


# ------------------------------------------------------------------------------------ prompt


def test_render_ideator_messages(task):
    msgs = prompts.render_ideator_messages(request(task))
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert "ONE idea" in msgs[0]["content"]
    user = msgs[1]["content"]
    assert user.startswith("Task: toy-flowers\nPredict the colour of a flower from its size.")
    assert "Goal: improve the dev score (accuracy, higher is better). Current best score: 0.8125." in user
    assert "1. draft: ok, score 0.8125\n2. improve: runtime_error\n   Traceback" in user
    assert "NameError: name 'np' is not defined" in user
    assert "Current script:\n```python\nimport pandas as pd\nmodel = LogisticRegression()\n```" in user
    assert "The implementer's score stopped improving." in user
    assert user.endswith(prompts.FORMAT_INSTRUCTIONS)     # last: survives a left cut
    assert user.index("Task:") < user.index("Goal:") < user.index("attempts") < user.index("Current script")


def test_render_options_and_an_empty_request(task):
    cfg = ideator.default_config()
    cfg.show_system, cfg.max_attempts, cfg.description = False, 1, "full"
    msgs = prompts.render_ideator_messages(request(task, reason="seek_help"), cfg)
    assert len(msgs) == 1
    user = msgs[0]["content"]
    assert user.startswith("# Toy flowers") and "1. draft" not in user and "2. improve" in user
    assert "The implementer asked for help." in user
    empty = prompts.render_ideator_messages(request(task, attempts=[], current_score=None,
                                                    current_code=""))[1]["content"]
    assert "Current best score: none." in empty and "Current script: none yet." in empty
    assert "attempts" not in empty
    cfg.description = "nope"
    with pytest.raises(agent.AgentError):
        prompts.render_ideator_messages(request(task), cfg)


def test_request_from_state_and_the_implementer_prompt(task):
    st = State(3, "toy-flowers", None, 2, "model = A()\n",
               [StepSummary("draft", "ok", 0.5, ""), StepSummary("improve", "timeout", None, "killed")],
               0.5, "rollout", 0)
    req = prompts.request_from_state(st, task)
    assert req.current_code == "model = A()\n" and req.current_score == 0.5
    assert [(a.kind, a.status, a.dev_score) for a in req.attempts] == [
        ("draft", "ok", 0.5), ("improve", "timeout", None)]
    assert req.reason == "stagnation"
    idea = ideator.parse_idea(GOOD)
    msgs = prompts.implementer_prompt_with_idea(st, task, idea)
    assert msgs == agent.render_messages(st, task, advice=idea.action)
    assert f"Advice from an expert (follow it in this step):\n{idea.action}" in msgs[-1]["content"]
    assert prompts.implementer_prompt_with_idea(st, task, "Use trees.") == \
        agent.render_messages(st, task, advice="Use trees.")


# ------------------------------------------------------------------------------------ advisor


class ScriptedPolicy:
    """A ChatPolicy that answers from a list, in order, and records what it was asked."""

    name = "scripted"

    def __init__(self, replies):
        self.replies = list(replies)
        self.calls = []

    def complete(self, conversations, *, seed=0):
        self.calls.append((list(conversations), seed))
        out = []
        for _ in conversations:
            r = self.replies.pop(0)
            out.append(r if isinstance(r, Completion) else Completion(text=r))
        return out


class BrokenPolicy:
    name = "broken"

    def complete(self, conversations, *, seed=0):
        raise ConnectionError("endpoint down")


def test_ideator_advise_valid_invalid_and_errors(task):
    pol = ScriptedPolicy([
        GOOD,
        "Try harder.",
        Completion(text="", error="timeout after 30 s", finish_reason="error"),
        Completion(text=GOOD[:60], finish_reason="length"),
    ])
    adv = advisor.Ideator(pol)
    a = adv.advise(request(task), seed=7)
    assert isinstance(a, Advice) and a.valid and a.error is None
    assert a.instruction == ideator.parse_idea(GOOD).action
    assert a.category == "model_choice" and a.raw == GOOD
    convs, seed = pol.calls[0]
    assert seed == 7 and convs == [prompts.render_ideator_messages(request(task))]

    bad = adv.advise(request(task))
    assert not bad.valid and bad.instruction is None and bad.category is None
    assert bad.error.startswith("format: preamble") and bad.raw == "Try harder."
    err = adv.advise(request(task))
    assert not err.valid and err.error == "policy error: timeout after 30 s"
    cut = adv.advise(request(task))
    assert not cut.valid and cut.error.startswith("format: truncated")

    down = advisor.Ideator(BrokenPolicy()).advise(request(task))
    assert not down.valid and "ConnectionError: endpoint down" in down.error


def test_ideator_batch_and_advice_text(task):
    cfg = ideator.default_config()
    cfg.advice_text = "action_rationale"
    pol = ScriptedPolicy([GOOD, "nope"])
    out = advisor.Ideator(pol, cfg).advise_batch([request(task), request(task)], seed=3)
    assert len(pol.calls) == 1 and len(pol.calls[0][0]) == 2     # one batched call
    assert out[0].instruction.endswith("\nWhy: " + ideator.parse_idea(GOOD).rationale)
    assert not out[1].valid
    assert advisor.Ideator(pol).advise_batch([]) == []
    cfg.advice_text = "all"
    with pytest.raises(ValueError):
        advisor.Ideator(pol, cfg)


# ------------------------------------------------------------------------------------ warm start


@pytest.fixture(scope="module")
def iris(tmp_path_factory):
    from sandbox.tasks import registry

    return registry.load_task("iris-species", tmp_path_factory.mktemp("tasks"),
                              prepare_if_missing=True)


def test_sft_examples_parse_and_follow_the_trainer_rendering(iris):
    from models.tokenizer import render_chat

    exs = sft_examples.build_ideator_sft_examples([iris])
    kinds = [e.kind for e in exs]
    n = kinds.count("idea")
    assert n >= 3 and kinds.count("idea_revert") == n and kinds.count("advised_improve") == n
    for e in exs:
        assert e.task_id == "iris-species"
        if e.kind == "advised_improve":
            assert agent.parse_action(e.completion).valid
            assert "Advice from an expert" in e.prompt
            continue
        idea = ideator.parse_idea(e.completion)
        assert idea.valid, (idea, e.completion)
        assert idea.verb == ("revert" if e.kind == "idea_revert" else "refine")
        assert idea.action.startswith(("Switch the model", "Tune the", "Add StandardScaler"))
        assert e.prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert prompts.FORMAT_INSTRUCTIONS in e.prompt
    # The prompt is exactly what the ideator trainer renders for such a state.
    first = exs[kinds.index("idea")]
    code = first.prompt.split("```python\n", 1)[1].split("\n```", 1)[0]
    score = float(first.prompt.split("Current best score: ", 1)[1].split(".\n", 1)[0])
    st = State(0, "iris-species", None, 1, code + "\n", [StepSummary("draft", "ok", score, "")],
               score, "seed", 0)
    want = render_chat(prompts.render_ideator_messages(prompts.request_from_state(st, iris)),
                       add_generation_prompt=True, enable_thinking=False)
    assert first.prompt == want
    only = sft_examples.build_ideator_sft_examples([iris], kinds=("idea",))
    assert {e.kind for e in only} == {"idea"}
    with pytest.raises(ValueError):
        sft_examples.build_ideator_sft_examples([iris], kinds=("essay",))


def test_synthesise_idea_needs_one_model_line():
    assert sft_examples.synthesise_idea("x = 1\n", "model = A()\n", 0.1, 0.2) is None
    text = sft_examples.synthesise_idea("import a\nmodel = A(k=1)\n", "import a\nfrom b import B\n"
                                   "model = B(k=2)\n", 0.1, 0.2)
    idea = ideator.parse_idea(text)
    assert idea.verb == "refine" and "`from b import B`" in idea.action
    assert idea.action.startswith("Switch the model from A to B")
