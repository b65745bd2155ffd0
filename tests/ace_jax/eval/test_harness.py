"""The evaluation harness: a broken grader is recorded and the others carry on; a JAX policy
from a run directory end to end."""
import json

from ace_jax.eval import episodes, harness, reports, run_config
from tests.ace_jax.eval.scripted import BrokenGraderTask, LOGREG, ScriptedPolicy, copy_task


def test_broken_grader_is_recorded_and_the_evaluation_carries_on(iris, pool, tmp_path):
    broken = copy_task(iris, BrokenGraderTask, task_id="iris-broken-grader")
    finished = []   # (task, record types of its log when on_episode ran)
    result = harness.evaluate(ScriptedPolicy([LOGREG]), [broken, iris], pool, seeds=[0],
                              max_steps=1, out_dir=tmp_path, on_episode=lambda ep, log: (
                                  finished.append((ep.task_id, [json.loads(x)["type"]
                                                                for x in open(log)]))))
    # the log is whole (header, the one step, the final line) before on_episode copies it
    assert sorted(finished) == [("iris-broken-grader", ["header", "step", "final"]),
                                ("iris-species", ["header", "step", "final"])]
    bad, good = result.episodes
    assert bad.steps[0].status == "grader_error" and "corrupt" in bad.steps[0].error
    assert bad.final.status == episodes.NO_VALID and bad.outcome.grader_errors == 1
    assert good.final.status == "ok" and good.outcome.valid
    assert [t.grader_errors for t in result.tasks] == [1, 0]
    assert any("iris-broken-grader" in n and "grader" in n for n in result.notes)
    assert "iris-broken-grader" in reports.format_table(result)
    assert sorted(p.name for p in (tmp_path / "episodes").iterdir()) == [
        "iris-broken-grader__seed0.jsonl", "iris-species__seed0.jsonl"]


def test_jax_policy_from_a_run_dir_end_to_end(iris, pool, tmp_path):
    from ace_jax.policy.policy import JaxPolicy
    from tests.run_fixture import make_tiny_run

    make_tiny_run(str(tmp_path / "run"))
    policy = JaxPolicy.from_run(str(tmp_path / "run"), max_new_tokens=16, temperature=1.0,
                                max_prompt_tokens=512)
    agent_cfg = run_config.run_agent_config(str(tmp_path / "run"))
    assert agent_cfg.show_system is False  # the run's agent section (configs/local.py)
    result = harness.evaluate(policy, [iris], pool, seeds=[0], max_steps=2,
                                 agent_cfg=agent_cfg, out_dir=tmp_path / "out")
    (ep,) = result.episodes
    assert ep.error is None and len(ep.steps) == 2
    assert all(s.status != "ok" and s.completion_error is None for s in ep.steps)
    assert ep.steps[0].prompt[0]["role"] == "user"  # no system turn, as in that run's training
    assert ep.final.status == episodes.NO_VALID and not ep.outcome.valid
    assert result.overall.stats["valid"].mean == 0.0
    assert episodes.load_episode(ep.log_path).to_dict() == ep.to_dict()
