"""One episode of the agent scaffold (``runner.run_episode``): step outcomes, the final
submission, prompts as the trainer builds them, the advisor, time budget and harness errors; on a
real prepared task in a real sandbox with a real deterministic policy."""
import pytest

from ace_jax.curriculum import buffer as buffer_lib
from ace_jax.env import agent
from ace_jax.eval import episodes, runner
from sandbox.result import ExecutionResult, Status
from tests.ace_jax.eval.scripted import (GARBAGE, LOGREG, SEEK, TREE, NoPool, ScriptedPolicy,
                                          TinyAdvisor, leaderboard_test_score, seed_script,
                                          targets_of)


def test_step_outcomes_kinds_and_steps_to_first_valid(main_episode):
    ep, _, policy = main_episode
    assert [s.status for s in ep.steps] == ["invalid_format", "policy_error", "runtime_error",
                                           "ok", "ok", "ok"]
    assert [s.kind for s in ep.steps] == ["draft", "draft", "draft", "debug", "improve",
                                         "improve"]
    assert ep.steps[0].invalid_reason == "no_block" and ep.steps[1].error.startswith("timeout")
    assert "no_such_module_for_the_test" in ep.steps[2].stderr_tail
    assert ep.steps[3].code == seed_script(TREE).strip("\n") + "\n"
    assert ep.steps[3].idea == "a baseline."
    assert [s for _, s in policy.calls] == [30_001, 30_002, 30_003, 30_004, 30_005, 30_006]
    assert ep.outcome.steps_to_first_valid == 4 and not ep.outcome.never_valid
    assert (ep.outcome.policy_errors, ep.outcome.invalid_format) == (1, 1)
    assert ep.stopped_by == "max_steps" and ep.error is None


def test_final_submission_is_the_best_dev_step_graded_once_on_test(main_episode):
    ep, task, _ = main_episode
    dev = [s.dev_score for s in ep.steps]
    assert dev[:3] == [None] * 3
    # log loss: lower is better. The tree has the worst dev score but a better TEST score than
    # logreg (committed sweep), and the dummy comes last: the rule must pick logreg (step 5).
    assert dev[4] < dev[5] < dev[3]
    assert leaderboard_test_score(TREE) < leaderboard_test_score(LOGREG)
    assert ep.best_dev_curve() == [None, None, None, dev[3], dev[4], dev[4]]
    assert [s.improved for s in ep.steps] == [False, False, False, True, True, False]
    assert ep.final.step == 5 and ep.final.dev_score == dev[4]
    assert ep.final.code == ep.steps[4].code and ep.final.status == "ok"
    assert ep.final.test_score == pytest.approx(leaderboard_test_score(LOGREG), rel=1e-9)
    assert ep.final.rerun_dev_score == pytest.approx(dev[4], rel=1e-12)
    # The grader saw the test split once: the final execution; dev: 3 valid steps + the final.
    assert task.grade_calls == {"dev": 4, "test": 1}
    assert ep.outcome.valid and ep.outcome.test_score == ep.final.test_score
    lb = sorted(task.leaderboard)
    strictly_better = sum(v < ep.final.test_score for v in lb)
    assert ep.outcome.human_rank == pytest.approx((len(lb) - (strictly_better + 1) + 1) / len(lb))


def test_prompts_equal_the_trainers_buffer_states(main_episode):
    """The episode's running state is built as the buffer builds children: same prompts."""
    ep, task, _ = main_episode
    buf = buffer_lib.EvolvingBuffer(buffer_lib.default_config(), [targets_of(task)])
    root = buf.seed()[0]
    render = lambda sid: agent.render_messages(buf.get(sid), task)  # noqa: E731
    assert ep.steps[0].prompt == ep.steps[1].prompt == ep.steps[2].prompt == render(root)

    def child(parent, rec):
        res = ExecutionResult(status=Status(rec.status), stderr=rec.stderr_tail,
                              dev_score=rec.dev_score)
        return buf.add_children(parent, [buffer_lib.Child(rec.code, res, 0.0, rec.kind)],
                                step=rec.step)[0]

    c1 = child(root, ep.steps[2])            # the crash: the next step debugs it
    assert ep.steps[3].prompt == render(c1)
    c2 = child(c1, ep.steps[3])              # the first valid one: improved next
    assert ep.steps[4].prompt == render(c2)
    c3 = child(c2, ep.steps[4])              # the best one; the dummy (step 6) starts from it
    assert ep.steps[5].prompt == render(c3)
    assert "Step: improve" in ep.steps[5].prompt[-1]["content"]


def test_advisor_on_seek_help_and_on_stagnation(iris, pool):
    advisor = TinyAdvisor()
    policy = ScriptedPolicy([SEEK, LOGREG, GARBAGE, GARBAGE, GARBAGE])
    ep = runner.run_episode(policy, iris, pool, seed=1, max_steps=5, advisor=advisor,
                                stagnation_steps=2)
    assert [s.status for s in ep.steps] == ["seek_help", "ok", "invalid_format",
                                           "invalid_format", "invalid_format"]
    assert ep.steps[0].seek_help
    # Asked after step 1 (help) and after step 4 (steps 3 and 4 did not improve); never after
    # the last step.
    assert [r.reason for r in advisor.requests] == ["seek_help", "stagnation"]
    assert [s.advice_reason for s in ep.steps] == ["seek_help", None, None, "stagnation", None]
    assert advisor.seeds == [runner.advice_seed(1, 1), runner.advice_seed(1, 4)]
    assert ep.steps[0].advice == {"instruction": "ADVICE-1: try a random forest", "valid": True,
                                  "error": None, "category": "model_choice",
                                  "raw": "raw answer 1"}
    # Each instruction reaches the NEXT prompt only.
    assert [s.advice_in_prompt for s in ep.steps] == [
        None, "ADVICE-1: try a random forest", None, None, "ADVICE-2: try a random forest"]
    assert "ADVICE-1" in ep.steps[1].prompt[-1]["content"]
    assert "ADVICE-2" in ep.steps[4].prompt[-1]["content"]
    assert not any("ADVICE" in s.prompt[-1]["content"] for s in ep.steps[2:4])
    first, second = advisor.requests
    assert first.current_score is None and first.current_code == ""
    assert [a.status for a in first.attempts] == ["seek_help"]
    assert second.current_score == ep.steps[1].dev_score
    assert second.current_code == ep.steps[1].code and len(second.attempts) == 4
    assert ep.outcome.advice_requests == 2 and ep.final.step == 2


def test_seek_help_without_advisor_is_an_invalid_step(iris):
    ep = runner.run_episode(ScriptedPolicy([SEEK]), iris, NoPool(), max_steps=2)
    assert [s.status for s in ep.steps] == ["invalid_format", "invalid_format"]
    assert ep.steps[0].seek_help and ep.steps[0].advice is None
    assert ep.final.status == episodes.NO_VALID and not ep.outcome.valid
    assert ep.outcome.never_valid and ep.outcome.human_rank == 0.0


def test_a_failing_advisor_is_recorded_and_the_episode_goes_on(iris):
    advisor = TinyAdvisor(fail=True)
    ep = runner.run_episode(ScriptedPolicy([SEEK]), iris, NoPool(), max_steps=3,
                                advisor=advisor, stagnation_steps=0)
    assert len(ep.steps) == 3 and len(advisor.requests) == 2
    assert ep.steps[0].advice["valid"] is False
    assert ep.steps[0].advice["error"] == "ConnectionError: advisor endpoint down"
    assert all(s.advice_in_prompt is None for s in ep.steps)


def test_time_budget_and_harness_errors(iris):
    ep = runner.run_episode(ScriptedPolicy([LOGREG]), iris, NoPool(), max_steps=3,
                                time_budget_s=0.0)
    assert ep.steps == [] and ep.stopped_by == "time_budget" and not ep.outcome.valid
    # A pool that raises (a harness bug) aborts that episode only, with the reason recorded.
    ep = runner.run_episode(ScriptedPolicy([LOGREG]), iris, NoPool(), max_steps=3)
    assert ep.stopped_by == "error" and "AssertionError" in ep.error
    assert ep.outcome.valid is False and ep.outcome.human_rank == 0.0
