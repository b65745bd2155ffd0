"""Shared by the evaluation tests: the prepared iris task, one sandbox pool and one scripted
episode (built once for the package)."""
import pytest

from ace_jax.eval import runner
from sandbox.tasks import registry
from tests.ace_jax.eval.scripted import (CountingTask, DUMMY, GARBAGE, ERROR, LOGREG, TASK_ID, TREE,
                                          ScriptedPolicy, copy_task)


@pytest.fixture(scope="package")
def task_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("tasks")


@pytest.fixture(scope="package")
def iris(task_cache):
    return registry.load_task(TASK_ID, task_cache, seed=0)


@pytest.fixture(scope="package")
def pool(tmp_path_factory):
    from sandbox.backends.bwrap import bwrap_available
    from sandbox.pool import SandboxPool

    backend = "bwrap" if bwrap_available()[0] else "process"
    p = SandboxPool(backend, num_workers=2, root_dir=tmp_path_factory.mktemp("runs"))
    yield p
    p.close()


@pytest.fixture(scope="package")
def main_episode(iris, pool, tmp_path_factory):
    task = copy_task(iris, CountingTask)
    policy = ScriptedPolicy([GARBAGE, ERROR, "BROKEN", TREE, LOGREG, DUMMY])
    log = tmp_path_factory.mktemp("log") / "ep.jsonl"
    ep = runner.run_episode(policy, task, pool, seed=3, max_steps=6, log_path=log)
    return ep, task, policy
