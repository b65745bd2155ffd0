"""The evaluation harness: episodes on a real prepared task in a real sandbox, with a real
deterministic policy (seed-corpus scripts, broken code, garbage, policy errors, help requests in a
scripted order), a real tiny advisor, hand-computed metrics, reports and an end-to-end JAX run."""
import collections
import dataclasses
import json
import math
import sys
import threading

import pytest

from ace_jax.curriculum import buffer as buffer_lib
from ace_jax import config_utils
from ace_jax.env import agent, tasks as tasks_lib
from ace_jax.env.advice import Advice, SEEK_HELP_TAG
from ace_jax.eval import episodes, harness, reports, run_config, runner, scoring
from ace_jax.policy.policy import Completion
from sandbox import seed_corpus
from sandbox.result import ExecutionResult, Status
from sandbox.tasks import registry
from sandbox.tasks.base import Task

TASK_ID = "iris-species"


def _script(name: str) -> str:
    return next(s.code for s in seed_corpus.list_scripts(TASK_ID) if s.name == name)


def _leaderboard_test_score(name: str) -> float:
    """The committed sweep's final-test score of seed script ``name`` (iris, seed 0)."""
    import pandas as pd

    lb = pd.read_csv(seed_corpus.RESULTS_DIR / "seed0" / TASK_ID / "leaderboard.csv")
    return float(lb.loc[lb["team"] == name, "score"].iloc[0])


TREE, LOGREG, DUMMY = "06_tree_depth3.py", "03_logreg_c1.py", "01_dummy.py"
BROKEN_CODE = "import numpy as np\nimport no_such_module_for_the_test\n"
GARBAGE = "I would train a model here but I forgot the code block."
SEEK = f"{SEEK_HELP_TAG} I am stuck: which model should I try?"
ERROR = object()  # the policy fails on this step (Completion.error)


class ScriptedPolicy:
    """A deterministic ChatPolicy: the reply to step t (read from the seed, see
    ``runner.step_seed``) is ``replies[t - 1]``: a seed script name (answered in the format
    the parser accepts), ``BROKEN`` code, raw text, or ``ERROR``. Records every call."""

    name = "scripted"

    def __init__(self, replies):
        self.replies = list(replies)
        self.calls = []
        self._lock = threading.Lock()

    def _reply(self, step: int) -> Completion:
        r = self.replies[min(step, len(self.replies)) - 1]
        if r is ERROR:
            return Completion(text="", error="timeout after 30 s", finish_reason="error")
        if r == "BROKEN":
            return Completion(text=agent.completion_target(BROKEN_CODE))
        if r.endswith(".py"):
            return Completion(text="Idea: a baseline.\n\n" + agent.completion_target(_script(r)))
        return Completion(text=r)

    def complete(self, conversations, *, seed=0):
        with self._lock:
            self.calls.append((conversations, seed))
        return [self._reply(seed % runner.SEED_STRIDE) for _ in conversations]


class TinyAdvisor:
    """A real Advisor: answers request k with a numbered instruction and records the requests."""

    def __init__(self, fail: bool = False):
        self.requests, self.seeds, self.fail = [], [], fail

    def advise(self, request, *, seed=0):
        self.requests.append(request)
        self.seeds.append(seed)
        if self.fail:
            raise ConnectionError("advisor endpoint down")
        n = len(self.requests)
        return Advice(instruction=f"ADVICE-{n}: try a random forest", valid=True,
                      category="model_choice", raw=f"raw answer {n}")


class CountingTask(Task):
    """The real task, counting its grader calls per split."""

    def __post_init__(self):
        super().__post_init__()
        self.grade_calls = collections.Counter()

    def grade(self, submission_csv, split="dev"):
        self.grade_calls[split] += 1
        return super().grade(submission_csv, split)


class BrokenGraderTask(Task):
    """The real task whose grader crashes (an environment bug)."""

    def grade(self, submission_csv, split="dev"):
        raise RuntimeError("answers file is corrupt")


def _copy(task: Task, cls=Task, **changes) -> Task:
    d = {f.name: getattr(task, f.name) for f in dataclasses.fields(Task)}
    d.update(changes)
    return cls(**d)


@pytest.fixture(scope="module")
def task_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tasks")


@pytest.fixture(scope="module")
def iris(task_cache):
    return registry.load_task(TASK_ID, task_cache, seed=0)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    from sandbox.backends.bwrap import bwrap_available
    from sandbox.pool import SandboxPool

    backend = "bwrap" if bwrap_available()[0] else "process"
    p = SandboxPool(backend, num_workers=2, root_dir=tmp_path_factory.mktemp("runs"))
    yield p
    p.close()


# ------------------------------------------------------------------------------- one episode


@pytest.fixture(scope="module")
def main_episode(iris, pool, tmp_path_factory):
    task = _copy(iris, CountingTask)
    policy = ScriptedPolicy([GARBAGE, ERROR, "BROKEN", TREE, LOGREG, DUMMY])
    log = tmp_path_factory.mktemp("log") / "ep.jsonl"
    ep = runner.run_episode(policy, task, pool, seed=3, max_steps=6, log_path=log)
    return ep, task, policy


def test_step_outcomes_kinds_and_steps_to_first_valid(main_episode):
    ep, _, policy = main_episode
    assert [s.status for s in ep.steps] == ["invalid_format", "policy_error", "runtime_error",
                                           "ok", "ok", "ok"]
    assert [s.kind for s in ep.steps] == ["draft", "draft", "draft", "debug", "improve",
                                         "improve"]
    assert ep.steps[0].invalid_reason == "no_block" and ep.steps[1].error.startswith("timeout")
    assert "no_such_module_for_the_test" in ep.steps[2].stderr_tail
    assert ep.steps[3].code == _script(TREE).strip("\n") + "\n"
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
    assert _leaderboard_test_score(TREE) < _leaderboard_test_score(LOGREG)
    assert ep.best_dev_curve() == [None, None, None, dev[3], dev[4], dev[4]]
    assert [s.improved for s in ep.steps] == [False, False, False, True, True, False]
    assert ep.final.step == 5 and ep.final.dev_score == dev[4]
    assert ep.final.code == ep.steps[4].code and ep.final.status == "ok"
    assert ep.final.test_score == pytest.approx(_leaderboard_test_score(LOGREG), rel=1e-9)
    assert ep.final.rerun_dev_score == pytest.approx(dev[4], rel=1e-12)
    # The grader saw the test split once: the final execution; dev: 3 valid steps + the final.
    assert task.grade_calls == {"dev": 4, "test": 1}
    assert ep.outcome.valid and ep.outcome.test_score == ep.final.test_score
    lb = sorted(task.leaderboard)
    strictly_better = sum(v < ep.final.test_score for v in lb)
    assert ep.outcome.human_rank == pytest.approx((len(lb) - (strictly_better + 1) + 1) / len(lb))


def _targets(task):
    return buffer_lib.TaskTargets(task.task_id, gold=task.gold, median=task.median,
                                  baseline=task.baseline_score, lower_is_better=True)


def test_prompts_equal_the_trainers_buffer_states(main_episode):
    """The episode's running state is built as the buffer builds children: same prompts."""
    ep, task, _ = main_episode
    buf = buffer_lib.EvolvingBuffer(buffer_lib.default_config(), [_targets(task)])
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
    buf = buffer_lib.EvolvingBuffer(buffer_lib.default_config(), [_targets(task)])
    ids = episodes.episodes_to_seed_states(buf, [ep], step=7)
    states = [buf.get(i) for i in ids]
    assert [s.origin for s in states] == ["evaluation"] * 3
    assert [s.code for s in states] == [ep.steps[i].code for i in (3, 4, 5)]
    assert agent.step_kind(states[0]) == "improve"  # code, no history: improvable like a seed
    other = buffer_lib.EvolvingBuffer(buffer_lib.default_config(),
                                      [dataclasses.replace(_targets(task), task_id="other")])
    with pytest.raises(buffer_lib.UnknownTaskError):
        episodes.episodes_to_seed_states(other, [ep])
    assert episodes.episodes_to_seed_states(other, [ep], skip_unknown_tasks=True) == []


# ------------------------------------------------------------------------------- advisor


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


class NoPool:
    """A pool that must not be used (episodes that execute nothing)."""

    def run(self, *a, **k):
        raise AssertionError("nothing should be executed")


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


def test_broken_grader_is_recorded_and_the_evaluation_carries_on(iris, pool, tmp_path):
    broken = _copy(iris, BrokenGraderTask, task_id="iris-broken-grader")
    result = harness.evaluate(ScriptedPolicy([LOGREG]), [broken, iris], pool, seeds=[0],
                                 max_steps=1, out_dir=tmp_path)
    bad, good = result.episodes
    assert bad.steps[0].status == "grader_error" and "corrupt" in bad.steps[0].error
    assert bad.final.status == episodes.NO_VALID and bad.outcome.grader_errors == 1
    assert good.final.status == "ok" and good.outcome.valid
    assert [t.grader_errors for t in result.tasks] == [1, 0]
    assert any("iris-broken-grader" in n and "grader" in n for n in result.notes)
    assert "iris-broken-grader" in reports.format_table(result)
    assert sorted(p.name for p in (tmp_path / "episodes").iterdir()) == [
        "iris-broken-grader__seed0.jsonl", "iris-species__seed0.jsonl"]


# ------------------------------------------------------------------------------- metrics


LEADERBOARD = [0.1, 0.2, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]  # log loss, lower is better


def _episode(task, seed, first_valid, test_score):
    """An episode record: steps 1..first_valid-1 crash, then a valid step; a final test score."""
    steps = []
    for n in range(1, (first_valid or 2) + 1):
        valid = first_valid is not None and n == first_valid
        steps.append(episodes.EpisodeStep(
            step=n, kind="draft", prompt=[], policy_seed=n, code="x = 1\n",
            status="ok" if valid else "runtime_error", dev_score=0.5 if valid else None,
            best_dev_so_far=0.5 if valid else None))
    final = episodes.FinalSubmission(
        step=first_valid, status="ok" if test_score is not None else episodes.NO_VALID,
        test_score=test_score)
    ep = episodes.Episode(task_id=task.task_id, seed=seed, policy="p", metric=task.metric,
                            lower_is_better=True, steps=steps, final=final)
    ep.outcome = scoring.score_episode(ep, task)
    return ep


def test_humanrank_medals_and_mean_se_by_hand(iris, tmp_path):
    task = _copy(iris, leaderboard=LEADERBOARD)
    # Thresholds (N = 10 < 100): gold = 1st = 0.1, silver = 2nd = 0.2, bronze = 4th = 0.3,
    # median = (0.4 + 0.5) / 2 = 0.45.
    eps = [_episode(task, 0, 2, 0.2),     # ties entries 2-3: p = 1 + 1 = 2 -> 9/10; silver
           _episode(task, 1, 1, 0.35),    # 4 entries strictly better: p = 5 -> 6/10; > median
           _episode(task, 2, None, None),  # never valid -> 0, nothing
           _episode(task, 3, 3, 0.05)]    # best of all: p = 1 -> 1; gold
    hr = [e.outcome.human_rank for e in eps]
    assert hr == pytest.approx([0.9, 0.6, 0.0, 1.0])
    assert _episode(task, 4, 1, 0.95).outcome.human_rank == 0.0  # worse than all: p = N + 1
    flags = [(e.outcome.gold, e.outcome.silver, e.outcome.bronze, e.outcome.above_median)
             for e in eps]
    assert flags == [(False, True, False, True), (False, False, False, True),
                     (False, False, False, False), (True, False, False, True)]
    s = scoring.summarize_task(task.task_id, eps)
    st = s.stats
    # HumanRank: mean 0.625; deviations .275 -.025 -.625 .375 -> ss .6075 / 3 = .2025, sd .45,
    # SE = .45 / 2.
    assert (st["human_rank"].mean, st["human_rank"].se) == pytest.approx((0.625, 0.225))
    assert (st["any_medal"].mean, st["any_medal"].se) == pytest.approx((0.5, math.sqrt(1 / 3) / 2))
    assert [st[m].mean for m in ("gold", "silver", "bronze", "valid", "above_median")] == \
        pytest.approx([0.25, 0.25, 0.0, 0.75, 0.75])
    # Steps to first valid: over the 3 that reached one (2, 1, 3): mean 2, sd 1, SE 1/sqrt(3).
    assert (st["steps_to_first_valid"].mean, st["steps_to_first_valid"].se,
            st["steps_to_first_valid"].n) == pytest.approx((2.0, 1 / math.sqrt(3), 3))
    assert st["never_valid"].mean == 0.25
    assert st["test_score"].mean == pytest.approx((0.2 + 0.35 + 0.05) / 3)
    assert scoring.mean_se([0.7]) == scoring.Stat(0.7, None, 1)
    assert scoring.mean_se([None]) == scoring.Stat(None, None, 0)

    # Overall: per seed the mean over tasks, then mean and SE over seeds.
    other = _copy(task, task_id="other-task")
    two = [eps[0], eps[1], _episode(other, 0, 1, 0.45), _episode(other, 1, None, None)]
    # other: 0.45 -> 5 entries better -> p = 6 -> 0.5; invalid -> 0.
    assert two[2].outcome.human_rank == pytest.approx(0.5)
    tasks, overall, _ = scoring.summarize(two)
    assert [t.task_id for t in tasks] == [task.task_id, "other-task"]
    # seed 0: (0.9 + 0.5) / 2 = 0.7; seed 1: (0.6 + 0) / 2 = 0.3 -> mean 0.5, SE 0.2 / sqrt(2)...
    # sd of (0.7, 0.3) = 0.2828, SE = 0.2.
    assert (overall.stats["human_rank"].mean, overall.stats["human_rank"].se) == \
        pytest.approx((0.5, 0.2))
    # valid: seed 0 (1 + 1) / 2 = 1, seed 1 (1 + 0) / 2 = .5 -> .75 ± .25
    assert (overall.stats["valid"].mean, overall.stats["valid"].se) == pytest.approx((0.75, 0.25))
    assert "test_score" not in overall.stats
    # Best@2: per task the best of its 2 seeds, then the mean over tasks: (0.9 + 0.5) / 2.
    assert overall.stats[scoring.BEST_AT_K] == scoring.Stat(pytest.approx(0.7), None, 2)
    with pytest.raises(ValueError, match="same number of episodes per task"):
        scoring.best_at_k(two[:3])

    result = harness.EvaluationResult(
        policy="p", config={"tasks": [task.task_id, "other-task"], "seeds": [0, 1],
                            "max_steps": 3, "time_budget_s": None, "stagnation_steps": 2,
                            "advisor": None},
        episodes=two, tasks=tasks, overall=overall, notes=[], wall_s=1.0)
    table = reports.format_table(result)
    assert "overall" in table and "0.500±0.200" in table and "75±25" in table
    paths = reports.write_reports(result, tmp_path)
    data = json.loads(open(paths["json"]).read())
    assert data["overall"]["stats"]["human_rank"]["mean"] == pytest.approx(0.5)
    markdown = open(paths["markdown"]).read()
    assert "| **overall** |" in markdown
    assert "Avg@2 / Best@2 of HumanRank (2 seeds per task): 0.500 / 0.700" in markdown
    for key in ("per_task_plot", "best_dev_plot"):
        assert open(paths[key], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_task_without_leaderboard_has_no_medals(iris):
    task = _copy(iris, leaderboard=[])
    ep = _episode(task, 0, 1, 0.3)
    assert ep.outcome.valid and ep.outcome.human_rank is None and ep.outcome.gold is None
    s = scoring.summarize_task(task.task_id, [ep])
    assert s.stats["human_rank"].n == 0 and "no reference leaderboard" in s.notes[0]
    assert scoring.best_at_k([ep]) == scoring.Stat(None, None, 0)


# ------------------------------------------------------------------------------- specs


def test_run_config_sections_refuse_unknown_keys(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(
        {"model": {}, "agent": {"show_system": False}, "buffer": {"history_len": 2}}))
    assert run_config.run_agent_config(run).show_system is False
    assert run_config.run_buffer_config(run).history_len == 2
    (run / "config.json").write_text(json.dumps({"model": {}, "agent": {"show_sytem": False}}))
    with pytest.raises(config_utils.ConfigKeyError, match="agent.show_sytem") as info:
        run_config.run_agent_config(run)
    assert "agent.show_system" in str(info.value)  # the valid keys are listed
    (run / "config.json").write_text(json.dumps({"model": {}, "buffer": {"history_len": "x"}}))
    with pytest.raises(config_utils.ConfigError, match="buffer.history_len"):
        run_config.run_buffer_config(run)


def test_run_tasks_default_to_the_runs(iris, task_cache):
    run_cfg = {"tasks": {"ids": [TASK_ID], "cache_dir": str(task_cache)},
               "sandbox": {"max_time_limit_s": 1.5}}
    (task,) = run_config.run_tasks([], run_cfg)
    assert task.task_id == TASK_ID and task.time_limit_s == 1.5
    (task,) = run_config.run_tasks([TASK_ID], run_cfg, exec_time_limit_s=0.5)
    assert task.time_limit_s == 0.5
    with pytest.raises(tasks_lib.TaskLoadError, match="available"):
        run_config.run_tasks(["no-such-task"], run_cfg)


def test_missing_ideator_module_is_a_clear_error(monkeypatch):
    import ace_jax

    monkeypatch.delattr(ace_jax, "ideator", raising=False)
    if "ace_jax.ideator" in sys.modules:   # imported by an earlier test: hide its submodule too
        monkeypatch.delattr(sys.modules["ace_jax.ideator"], "advisor", raising=False)
    monkeypatch.setitem(sys.modules, "ace_jax.ideator.advisor", None)
    with pytest.raises(harness.EvaluationError, match="ace_jax/ideator/advisor.py"):
        run_config.advisor_from_spec("openai:http://127.0.0.1:9/v1#m")


# ------------------------------------------------------------------------------- end to end


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
