"""The step's metrics that are functions of plain values (the whole line of a run:
test_trainer.py, tests/launch/test_tpu_train.py)."""
import pytest

from ace_jax.train import step_metrics


def test_medal_level_from_a_task_report():
    from sandbox.grading import medal_report, medal_thresholds

    thr = medal_thresholds([0.1 * i for i in range(1, 21)], lower_is_better=False)
    levels = [step_metrics.medal_level(medal_report(s, thr)) for s in (2.5, thr.silver, thr.bronze, 0.0)]
    assert levels == [3, 2, 1, 0]


def test_root_child_metrics():
    m = step_metrics.root_child_metrics([True, True, False, False, False], [True, False, True, False, False])
    assert m == {"rollout/root_frac": 0.4, "rollout/valid_rate_root": 0.5,
                 "rollout/valid_rate_child": pytest.approx(1 / 3)}
    assert step_metrics.root_child_metrics([True, True], [False, True]) == {
        "rollout/root_frac": 1.0, "rollout/valid_rate_root": 0.5}  # no child rollouts: no key


def test_sandbox_metrics_count_the_scripts_that_ran_and_add_their_seconds():
    """A completion without a code block has no result, a sandbox that never started the script
    no exit code: neither counts as a script run."""
    from sandbox.result import ExecutionResult, Status

    results = [ExecutionResult(Status.OK, exit_code=0, wall_s=2.5),
               ExecutionResult(Status.RUNTIME_ERROR, exit_code=1, wall_s=0.25),
               ExecutionResult(Status.SANDBOX_ERROR, exit_code=None, wall_s=0.0),
               None]
    assert step_metrics.sandbox_metrics(results) == {"perf/sandbox_scripts": 2.0,
                                                     "perf/sandbox_run_seconds": 2.75}
