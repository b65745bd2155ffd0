"""Tests of ace_jax.env.rewards: hand-computed values, both metric directions, clipping, the registry."""
import pytest

from ace_jax.env import rewards
from ace_jax.registry import UnknownNameError
from ace_jax.env.agent import Action, InvalidAction, InvalidReason
from sandbox.result import ExecutionResult, Status
from sandbox.tasks.targets import TaskTargets

HI = TaskTargets("hi", gold=0.9, median=0.7, baseline=0.5)                            # spread 0.2
LO = TaskTargets("lo", gold=1.0, median=2.0, baseline=4.0, lower_is_better=True)      # spread 1.0
ACT = Action(code="x = 1\n")
BAD = InvalidAction(InvalidReason.NO_BLOCK, "no block")


def ok(score):
    return ExecutionResult(Status.OK, exit_code=0, valid_submission=True, dev_score=score)


def step(action, result, cur, targets, **over):
    cfg = rewards.default_config()
    cfg.update(over)
    return rewards.get_reward("acegrpo_step")(action=action, result=result, current_score=cur,
                                             targets=targets, cfg=cfg)


def test_acegrpo_format_and_failures():
    assert step(BAD, None, 0.6, HI) == -1.0
    assert step(BAD, ok(0.9), 0.6, HI) == -1.0           # format wins even if something ran
    for st in (Status.RUNTIME_ERROR, Status.SYNTAX_ERROR, Status.TIMEOUT, Status.NO_SUBMISSION,
               Status.INVALID_SUBMISSION):
        assert step(ACT, ExecutionResult(st, exit_code=1), 0.6, HI) == 0.0
    assert step(ACT, None, 0.6, HI) == 0.0
    assert step(ACT, ExecutionResult(Status.OK, dev_score=None), 0.6, HI) == 0.0
    assert step(ACT, ok(float("nan")), 0.6, HI) == 0.0
    assert step(BAD, None, 0.6, HI, r_format=-2.5) == -2.5


def test_acegrpo_higher_is_better():
    # 1 + 0.5 * clip((0.65 - 0.6) / 0.2) = 1 + 0.5 * 0.25
    assert step(ACT, ok(0.65), 0.6, HI) == pytest.approx(1.125)
    assert step(ACT, ok(0.55), 0.6, HI) == pytest.approx(0.875)
    assert step(ACT, ok(0.95), 0.6, HI) == pytest.approx(1.5)       # +1.75 clipped to +1
    assert step(ACT, ok(0.0), 0.6, HI) == pytest.approx(0.5)        # -3 clipped to -1
    assert step(ACT, ok(0.6), None, HI) == pytest.approx(1.25)      # first valid: vs baseline 0.5
    assert step(ACT, ok(0.65), 0.6, HI, r_valid=0.2, improve_coef=2.0) == pytest.approx(0.7)
    assert step(ACT, ok(0.95), 0.6, HI, improve_clip=0.5) == pytest.approx(1.25)


def test_acegrpo_lower_is_better():
    # 1 + 0.5 * clip(-(2.5 - 3.0) / 1.0) = 1.25
    assert step(ACT, ok(2.5), 3.0, LO) == pytest.approx(1.25)
    assert step(ACT, ok(3.2), 3.0, LO) == pytest.approx(0.9)
    assert step(ACT, ok(0.5), 3.0, LO) == pytest.approx(1.5)        # clipped
    assert step(ACT, ok(3.5), None, LO) == pytest.approx(1.25)      # baseline 4.0


def test_ideator_ternary():
    cfg = rewards.default_config()
    fn = rewards.get_reward("ideator_ternary")
    idea = Action(code="x\n", idea="scale the features")
    kw = dict(cfg=cfg)
    assert fn(action=idea, result=ok(0.65), current_score=0.6, targets=HI, **kw) == 1.0
    assert fn(action=idea, result=ok(0.6), current_score=0.6, targets=HI, **kw) == 0.0   # not strictly
    assert fn(action=idea, result=ok(2.5), current_score=3.0, targets=LO, **kw) == 1.0
    assert fn(action=idea, result=ok(3.5), current_score=3.0, targets=LO, **kw) == 0.0
    assert fn(action=idea, result=ok(3.5), current_score=None, targets=LO, **kw) == 1.0  # vs baseline 4
    assert fn(action=idea, result=ExecutionResult(Status.TIMEOUT), current_score=0.6, targets=HI, **kw) == 0.0
    assert fn(action=BAD, result=None, current_score=0.6, targets=HI, **kw) == -1.0
    assert fn(action=ACT, result=ok(0.9), current_score=0.6, targets=HI, **kw) == -1.0  # no idea
    cfg.ideator_require_idea = False
    assert fn(action=ACT, result=ok(0.9), current_score=0.6, targets=HI, **kw) == 1.0


def test_normalised_score():
    assert rewards.normalised_score(0.5, HI) == 0.0
    assert rewards.normalised_score(0.9, HI) == pytest.approx(1.0)
    assert rewards.normalised_score(0.7, HI) == pytest.approx(0.5)
    assert rewards.normalised_score(2.5, LO) == pytest.approx(0.5)   # (2.5-4)/(1-4)
    assert rewards.normalised_score(5.0, LO) == pytest.approx(-1 / 3)
    assert rewards.normalised_score(100.0, LO) == -1.0               # clipped low
    assert rewards.normalised_score(100.0, LO, clip_low=None) == pytest.approx(-32.0)
    assert rewards.normalised_score(-3.0, LO) == 2.0                 # clipped high
    assert rewards.normalised_score(None, HI) == 0.0
    with pytest.raises(ValueError, match="gold == baseline"):
        rewards.normalised_score(1.0, TaskTargets("t", gold=1.0, median=0.5, baseline=1.0))


def test_registry():
    assert {"acegrpo_step", "ideator_ternary"} <= set(rewards.list_rewards())
    with pytest.raises(UnknownNameError) as e:
        rewards.get_reward("nope")
    assert "nope" in str(e.value) and "acegrpo_step" in str(e.value) and "ideator_ternary" in str(e.value)
    with pytest.raises(ValueError, match="already registered"):
        rewards.register_reward("acegrpo_step")(lambda **kw: 0.0)
    with pytest.raises(TypeError, match="action"):
        step("not an action", None, None, HI)


def test_compute_rewards_batch():
    r = rewards.compute_rewards("acegrpo_step", [BAD, ACT, ACT], [None, ExecutionResult(Status.OOM), ok(2.5)],
                                [None, 3.0, 3.0], [LO, LO, LO])
    assert r == [-1.0, 0.0, 1.25] and all(type(x) is float for x in r)
    with pytest.raises(ValueError, match="differ in length"):
        rewards.compute_rewards("acegrpo_step", [BAD], [], [None], [LO])
    with pytest.raises(UnknownNameError):
        rewards.compute_rewards("nope", [], [], [], [])


def test_acegrpo_optional_syntax_shaping():
    syntax = ExecutionResult(Status.SYNTAX_ERROR, exit_code=1)
    runtime = ExecutionResult(Status.RUNTIME_ERROR, exit_code=1)
    assert step(ACT, syntax, 0.6, HI) == 0.0                     # off by default: the paper's reward
    assert step(ACT, syntax, 0.6, HI, r_syntax_error=-0.5) == -0.5
    assert step(ACT, runtime, 0.6, HI, r_syntax_error=-0.5) == 0.0
    assert step(BAD, None, 0.6, HI, r_syntax_error=-0.5) == -1.0
