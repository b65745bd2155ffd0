"""Training targets and evaluation on an MLE-bench competition without a leaderboard (the
adapter itself: tests/sandbox/test_mlebench_adapter.py): MLE-bench's own
spooky-author-identification, prepared by its preparer, its folder copied without leaderboard.csv."""
import shutil

import pytest

from ace_jax.curriculum import buffer as buffer_lib
from ace_jax.env import agent, rewards
from ace_jax.eval import harness, reports, runner, scoring
from ace_jax.policy.interface import Completion
from sandbox.pool import SandboxPool
from sandbox.result import Status
from sandbox.tasks import mlebench
from sandbox.tasks.base import NoLeaderboardError
from sandbox.tasks.targets import TaskTargets, task_targets
from tests import mlebench_prepared
from tests.sandbox.mlebench_competition import AGENT_CODE

class FixedPolicy:
    """A ChatPolicy answering every step with the same script."""

    name = "fixed"

    def __init__(self, code):
        self.code = code

    def complete(self, conversations, *, seed=0):
        return [Completion(text=agent.completion_target(self.code)) for _ in conversations]


def test_a_competition_without_leaderboard_trains_and_evaluates(tmp_path):
    """Targets fall back to headroom 1 and baseline-relative rewards; evaluation reports medals
    and HumanRank as n/a; grading is unaffected."""
    cid = "spooky-author-identification"
    data = mlebench_prepared.prepare(tmp_path / "mle", [cid])
    from mlebench.registry import registry

    comp = tmp_path / "competitions" / cid
    shutil.copytree(registry.get_competitions_dir() / cid, comp,
                    ignore=shutil.ignore_patterns("leaderboard.csv"))
    task = mlebench.load_mlebench_task(cid, data, comp, memory_limit_mb=1024, time_limit_s=30)
    assert task.grader_source == "mlebench:staged"
    assert not task.has_leaderboard and task.leaderboard_source == ""
    with pytest.raises(NoLeaderboardError,
                       match=rf"competition folder .*{cid} has no leaderboard.csv .*n/a"):
        task.medal(0.5)
    with pytest.raises(NoLeaderboardError):
        task.position_score(0.5)

    base = task.baseline_score                     # the sample submission's dev log loss
    assert 0.5 < base < 2.0
    targets = task_targets(task)
    assert (targets.gold, targets.median, targets.has_leaderboard) == (None, None, False)
    assert targets.baseline == pytest.approx(base) and targets.spread == pytest.approx(base)
    assert targets.headroom(None) == targets.headroom(0.01) == targets.headroom(5.0) == 1.0
    assert rewards.normalised_score(base / 2, targets) == pytest.approx(0.5)  # lower is better
    assert rewards.normalised_score(base * 1.25, targets) == pytest.approx(-0.25)
    assert rewards.improvement(base / 2, None, targets) == pytest.approx(0.5)
    cfg = rewards.default_config()
    assert rewards.acegrpo_step(
        action=type("A", (), {"valid": True})(), current_score=None, targets=targets, cfg=cfg,
        result=type("R", (), {"status": Status.OK, "dev_score": base / 2})()) == pytest.approx(
            cfg.r_valid + cfg.improve_coef * 0.5)
    zero = TaskTargets("z", gold=None, median=None, baseline=0.0)  # e.g. QWK 0
    assert zero.spread == 1.0 and rewards.normalised_score(0.25, zero) == pytest.approx(0.25)
    with pytest.raises(ValueError, match="both set .* or both None"):
        TaskTargets("t", gold=0.2, median=None, baseline=1.0, lower_is_better=True)
    buf = buffer_lib.EvolvingBuffer(buffer_lib.default_config(), [targets])
    root = buf.seed()[0]
    assert buf.stats.headroom[buf.slot_of[root]] == 1.0

    good = AGENT_CODE.format(overrides={})
    with SandboxPool("process", num_workers=1, root_dir=tmp_path / "runs", grace_s=0.3,
                     allow_unisolated=True) as pool:
        ep = runner.run_episode(FixedPolicy(good), task, pool, seed=0, max_steps=1)
    out = ep.outcome
    sample = task.sample_submission_file
    assert out.valid and out.test_score == pytest.approx(task.grade(sample, "test"), rel=1e-9)
    assert [out.gold, out.silver, out.bronze, out.any_medal, out.above_median, out.human_rank] \
        == [None] * 6
    tasks, overall, notes = scoring.summarize([ep])
    assert any(f"{cid} has no reference leaderboard: medals and HumanRank n/a" in n for n in notes)
    result = harness.EvaluationResult(
        policy="fixed", config={"tasks": [cid], "seeds": [0], "max_steps": 1,
                                "time_budget_s": None, "stagnation_steps": 2, "advisor": None},
        episodes=[ep], tasks=tasks, overall=overall, notes=notes, wall_s=1.0)
    row = next(l for l in reports.format_table(result).splitlines() if l.startswith(cid[:20]))
    cells = row.split()
    assert cells[2] == "100" and cells[3:9] == ["n/a"] * 6, row  # valid %, then the six n/a
    assert reports.format_markdown(result).count("n/a") >= 6
