"""The probe: fixed states from the seed alone (held-out tasks flagged), fixed keys, real
executions scored as the metrics say, and the config checks."""
import dataclasses

import numpy as np
import pytest

from ace_jax import config_utils
from ace_jax.env import agent, rewards
from ace_jax.train import config as run_config, probe, setup
from sandbox.pool import SandboxPool
from sandbox.seed_corpus import list_scripts
from sandbox.tasks import registry

TRAIN, HELDOUT = ("iris-species", "wine-cultivar"), ("linnerud-physiology",)


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tasks")
    return ([registry.load_task(t, cache, seed=0) for t in TRAIN],
            [registry.load_task(t, cache, seed=0) for t in HELDOUT])


def _cfg(**probe_values):
    c = run_config.default_config()
    c.workdir, c.tasks.ids = "unused", TRAIN
    c.probe.update({**dict(every=2, heldout_tasks=HELDOUT), **probe_values})
    return c


def test_states_depend_on_the_seed_alone(tasks):
    train, heldout = tasks
    a = probe.build_states(train, heldout, seed=0)
    assert a == probe.build_states(train, heldout, seed=0)
    assert [(s.state.task_id, s.kind, s.heldout) for s in a] == [
        (t, k, t in HELDOUT) for t in TRAIN + HELDOUT for k in ("draft", "improve")]
    assert all(s.state.state_id < 0 for s in a)                  # never a buffer id
    assert len({s.state.state_id for s in a}) == len(a)
    for s in a:
        if s.kind == "improve":   # a reference script of its task with its measured score
            assert s.state.code in {x.code for x in list_scripts(s.state.task_id)}
            assert s.state.score is not None
        else:
            assert s.state.code == "" and s.state.score is None
    picks = {seed: [s.state.code for s in probe.build_states(train, heldout, seed=seed)]
             for seed in range(6)}
    assert len({tuple(p) for p in picks.values()}) > 1           # the seed picks the references
    assert [s.kind for s in probe.build_states(train, (), seed=0, kinds=("draft",))] == \
        ["draft", "draft"]


def test_the_probe_is_the_same_for_every_sampler_and_objective(tasks):
    train, heldout = tasks
    probes = []
    for sampler, proximal in (("lp", "behaviour"), ("uniform", "learner")):
        c = _cfg()
        c.lp.sampler, c.grpo.proximal = sampler, proximal
        probes.append(probe.Probe.from_config(c, train, heldout))
    assert probes[0].states == probes[1].states
    assert np.array_equal(*(np.asarray(probe.jax.random.key_data(probe.sampling_key(p.seed)))
                            for p in probes))
    c = _cfg()
    c.seed = 1
    assert probe.Probe.from_config(c, train, heldout).states != probes[0].states
    c.probe.every = 0
    assert probe.Probe.from_config(c, train, heldout) is None


def test_due_every_n_updates_and_after_the_last(tasks):
    p = probe.Probe.from_config(_cfg(every=3), *tasks)
    assert [u for u in range(8) if p.due(u)] == [0, 3, 6]


def test_summarize_known_outcomes():
    m = probe.summarize([(False, 1.0, 0.5, 0.8), (False, 0.0, 0.0, 0.0),
                         (True, 1.0, 1.0, None), (True, 0.0, 0.0, None)])
    assert m == pytest.approx({
        "probe/valid_rate": 0.5, "probe/score": 0.375, "probe/humanrank": 0.4,
        "probe/valid_rate_train": 0.5, "probe/score_train": 0.25, "probe/humanrank_train": 0.4,
        "probe/valid_rate_heldout": 0.5, "probe/score_heldout": 0.5})


@dataclasses.dataclass
class _Gen:
    tokens: np.ndarray
    lengths: np.ndarray
    prompt_index: np.ndarray


def test_run_executes_on_the_test_split_and_scores_as_documented(tasks, tmp_path):
    """Completions are decoded, parsed and run for real: per state, sample 0 answers with the
    state's own reference script (or the task's first one for a draft), sample 1 with text that
    is not an action; the metrics are recomputed here from the pool's own results."""
    train, heldout = tasks
    p = probe.Probe.from_config(_cfg(samples=2), train, heldout)
    texts, seen = [], {}

    def generate(prompts, key, n):
        seen.update(prompts=prompts, n=n, key=key)
        rows = []
        for b, ps in enumerate(p.states):
            code = ps.state.code or list_scripts(ps.state.task_id)[0].code
            rows += [f"I will run it.\n```python\n{code}\n```", "no code here"]
        texts.extend(rows)
        return _Gen(np.arange(len(rows))[:, None], np.ones(len(rows), np.int64),
                    np.repeat(np.arange(len(p.states)), n))

    cfg = _cfg()
    with SandboxPool("process", num_workers=2, root_dir=tmp_path) as pool:
        m = p.run(lambda ps: [len(ps.state.code)], generate, pool, lambda ids: texts[ids[0]],
                  max_code_chars=cfg.agent.max_code_chars, rewards_cfg=cfg.rewards)
        expected = []
        for b, ps in enumerate(p.states):
            task = p.tasks[ps.state.task_id]
            code = agent.parse_action(texts[2 * b]).code
            res = pool.run(task, code, split="test")
            assert res.status.value == "ok" and res.test_score is not None
            norm = rewards.normalised_score(res.dev_score, p.targets[task.task_id],
                                            clip_low=cfg.rewards.norm_clip_low,
                                            clip_high=cfg.rewards.norm_clip_high)
            rank = task.position_score(res.test_score) if task.has_leaderboard else None
            expected += [(ps.heldout, 1.0, norm, rank),
                         (ps.heldout, 0.0, 0.0, 0.0 if task.has_leaderboard else None)]
    assert seen["n"] == 2 and len(seen["prompts"]) == len(p.states)
    assert m == pytest.approx(probe.summarize(expected))
    assert m["probe/valid_rate"] == 0.5 and m["probe/valid_rate_heldout"] == 0.5


@pytest.mark.parametrize("change, match", [
    (dict(every=-1), "probe.every"),
    (dict(kinds=("draft", "debug")), "probe.kinds"),
    (dict(heldout_tasks=("iris-species",)), "also in tasks.ids"),
])
def test_config_checks_name_the_key(change, match):
    c = _cfg(**{k: v for k, v in change.items()})
    with pytest.raises(config_utils.ConfigError, match=match):
        run_config.validate(c, num_devices=1, num_processes=1)


def test_heldout_needs_listed_training_tasks():
    c = _cfg()
    c.tasks.ids = ()
    with pytest.raises(config_utils.ConfigError, match="nothing is held out"):
        run_config.validate(c, num_devices=1, num_processes=1)


def test_heldout_tasks_load_like_the_training_tasks(tmp_path):
    c = _cfg()
    c.tasks.cache_dir = str(tmp_path)
    assert [t.task_id for t in setup.load_tasks(c, HELDOUT)] == list(HELDOUT)
    with pytest.raises(setup.SetupError, match="nope"):
        setup.load_tasks(c, ("nope",))
