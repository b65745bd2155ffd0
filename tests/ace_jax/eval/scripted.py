"""The evaluation tests' parts: a scripted policy (seed-corpus scripts, broken code, garbage,
policy errors, help requests in a scripted order), a tiny advisor, tasks that count or break their
grader, and a pool that must not be used."""
import collections
import dataclasses
import threading

from ace_jax.env import agent
from ace_jax.env.advice import Advice, SEEK_HELP_TAG
from ace_jax.eval import runner
from ace_jax.policy.interface import Completion
from sandbox import seed_corpus
from sandbox.tasks.base import Task
from sandbox.tasks.targets import TaskTargets

TASK_ID = "iris-species"


def seed_script(name: str) -> str:
    return next(s.code for s in seed_corpus.list_scripts(TASK_ID) if s.name == name)


def leaderboard_test_score(name: str) -> float:
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
            return Completion(
                text="Idea: a baseline.\n\n" + agent.completion_target(seed_script(r)))
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


def copy_task(task: Task, cls=Task, **changes) -> Task:
    d = {f.name: getattr(task, f.name) for f in dataclasses.fields(Task)}
    d.update(changes)
    return cls(**d)


def targets_of(task):
    return TaskTargets(task.task_id, gold=task.gold, median=task.median,
                                  baseline=task.baseline_score, lower_is_better=True)


class NoPool:
    """A pool that must not be used (episodes that execute nothing)."""

    def run(self, *a, **k):
        raise AssertionError("nothing should be executed")
