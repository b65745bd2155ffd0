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
    c = _cfg(every=3)
    c.probe.at_start = False      # a run whose warm start probed its first parameters
    p = probe.Probe.from_config(c, *tasks)
    assert [u for u in range(8) if p.due(u)] == [3, 6]


def test_summarize_known_outcomes():
    m = probe.summarize([(False, 1.0, 0.5, 0.8), (False, 0.0, 0.0, 0.0),
                         (True, 1.0, 1.0, None), (True, 0.0, 0.0, None)])
    assert m == pytest.approx({
        "probe/valid_rate": 0.5, "probe/score": 0.375, "probe/humanrank": 0.4,
        "probe/valid_rate_train": 0.5, "probe/score_train": 0.25, "probe/humanrank_train": 0.4,
        "probe/valid_rate_heldout": 0.5, "probe/score_heldout": 0.5,
        "probe/heldout_valid_rate": 0.5, "probe/heldout_score": 0.5})


def test_summarize_held_out_groups_apart_and_together():
    m = probe.summarize([("train", 1.0, 0.5, 0.8), ("heldout_instances", 1.0, 0.6, 0.5),
                         ("heldout_instances", 0.0, 0.0, 0.0), ("heldout_family", 0.0, 0.0, 0.0),
                         ("heldout", 1.0, 1.0, None)])
    assert m["probe/valid_rate_train"] == 1.0 and m["probe/score_train"] == 0.5
    assert m["probe/heldout_instances_valid_rate"] == 0.5
    assert m["probe/heldout_instances_score"] == pytest.approx(0.3)
    assert m["probe/heldout_instances_humanrank"] == pytest.approx(0.25)
    assert m["probe/heldout_family_valid_rate"] == 0.0 and m["probe/heldout_family_score"] == 0.0
    # every held-out completion (an offline held-out task too) in probe/heldout_*
    assert m["probe/heldout_valid_rate"] == m["probe/valid_rate_heldout"] == 0.5
    assert m["probe/heldout_score"] == pytest.approx(1.6 / 4)
    assert m["probe/valid_rate"] == pytest.approx(3 / 5)
    assert "probe/heldout_family_humanrank" in m   # 0.0 from a failure on a leaderboard task
    assert not any(k.startswith("probe/heldout_instances") for k in probe.summarize(
        [("train", 1.0, 0.5, None), ("heldout_family", 1.0, 0.5, None)]))


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


# ---------------------------------------------------------------- the held-out procedural probe

PROC_TRAIN = ("proc-linear-000", "proc-rules-001")
PROC_HELD = ("proc-clusters-003", "proc-linear-002")          # split "heldout"
PROC_FAMILY = ("proc-tokens-000", "proc-tokens-001")          # split "heldout_family"


def test_procedural_ids_are_in_the_splits_the_tests_assume():
    from sandbox.tasks import procedural

    assert [procedural.instance_split(t) for t in PROC_TRAIN + PROC_HELD + PROC_FAMILY] == \
        ["train"] * 2 + ["heldout"] * 2 + ["heldout_family"] * 2
    assert [probe.heldout_group(t) for t in PROC_HELD + PROC_FAMILY + HELDOUT] == \
        ["heldout_instances"] * 2 + ["heldout_family"] * 2 + ["heldout"]


@pytest.fixture(scope="module")
def proc_tasks(tmp_path_factory):
    cache = tmp_path_factory.mktemp("proc")
    return ([registry.load_task(t, cache, seed=0) for t in PROC_TRAIN],
            [registry.load_task(t, cache, seed=0) for t in PROC_HELD + PROC_FAMILY])


def _proc_cfg(**probe_values):
    c = run_config.default_config()
    c.workdir, c.tasks.ids = "unused", PROC_TRAIN
    c.probe.update({**dict(every=2, heldout_tasks=PROC_HELD + PROC_FAMILY), **probe_values})
    return c


def test_held_out_instances_get_their_own_draft_only(proc_tasks):
    """A held-out instance has no seed scripts: its one probe state is its draft, rendered from
    its own task page; training instances keep draft and improve."""
    train, held = proc_tasks
    states = probe.build_states(train, held, seed=0)
    assert [(s.state.task_id, s.kind, s.group) for s in states] == (
        [(t, k, "train") for t in PROC_TRAIN for k in ("draft", "improve")]
        + [(t, "draft", "heldout_instances") for t in PROC_HELD]
        + [(t, "draft", "heldout_family") for t in PROC_FAMILY])
    cfg = agent.default_config()
    by_id = {t.task_id: t for t in train + held}
    for s in states:
        if s.heldout:
            text = agent.render_prompt(s.state, by_id[s.state.task_id], cfg)
            assert s.state.code == "" and agent.describe_task(by_id[s.state.task_id], cfg) in text
            assert not any(t in text for t in PROC_TRAIN)


def test_train_tasks_pick_the_in_distribution_states(proc_tasks):
    train, held = proc_tasks
    p = probe.Probe.from_config(_proc_cfg(train_tasks=PROC_TRAIN[1:]), train, held)
    assert [s.state.task_id for s in p.states if not s.heldout] == [PROC_TRAIN[1]] * 2
    with pytest.raises(ValueError, match="not training tasks"):
        probe.Probe.from_config(_proc_cfg(train_tasks=("proc-linear-001",)), train, held)


def test_heldout_samples_sample_held_out_states_apart(proc_tasks):
    train, held = proc_tasks
    same = probe.Probe.from_config(_proc_cfg(samples=2), train, held)
    [(idx, n, key)] = same.batches()    # as before: one call, the probe's key
    assert idx == list(range(len(same.states))) and n == 2
    apart = probe.Probe.from_config(_proc_cfg(samples=2, heldout_samples=3), train, held)
    (ti, tn, tk), (hi, hn, hk) = apart.batches()
    assert [apart.states[i].heldout for i in ti] == [False] * 4 and tn == 2
    assert [apart.states[i].heldout for i in hi] == [True] * 4 and hn == 3
    data = probe.jax.random.key_data
    assert np.array_equal(data(tk), data(probe.sampling_key(0)))
    assert not np.array_equal(data(hk), data(tk))


class _Pool:
    """Answers every submission at once: valid for code that says so, else a runtime error."""

    def submit(self, task, code, split="dev"):
        import concurrent.futures

        from sandbox.result import ExecutionResult, Status

        assert split == "test"
        f = concurrent.futures.Future()
        f.set_result(ExecutionResult(Status.OK, dev_score=task.baseline_score,
                                     test_score=task.baseline_score, valid_submission=True)
                     if "valid" in code else ExecutionResult(Status.RUNTIME_ERROR))
        return f


def test_run_writes_the_held_out_metrics_per_group(proc_tasks):
    """Generation is faked: a completion of a held-out-family state is valid, the rest not; the
    two calls (heldout_samples != samples) are mapped back to their states."""
    train, held = proc_tasks
    p = probe.Probe.from_config(_proc_cfg(samples=1, heldout_samples=3), train, held)
    texts, calls = [], []

    def generate(prompts, key, n):
        calls.append((len(prompts), n))
        rows = []
        for b in range(len(prompts)):
            tid = prompts[b][0]
            ok = probe.heldout_group(tid) == "heldout_family"
            rows += ["```python\nprint('valid')\n```" if ok else "no code"] * n
        start = len(texts)
        texts.extend(rows)
        return _Gen(np.arange(start, len(texts))[:, None], np.ones(len(rows), np.int64),
                    np.repeat(np.arange(len(prompts)), n))

    cfg = _proc_cfg()
    m = p.run(lambda ps: [ps.state.task_id], generate, _Pool(), lambda ids: texts[ids[0]],
              max_code_chars=cfg.agent.max_code_chars, rewards_cfg=cfg.rewards)
    assert calls == [(4, 1), (4, 3)]
    assert m["probe/heldout_family_valid_rate"] == 1.0
    assert m["probe/heldout_instances_valid_rate"] == 0.0
    assert m["probe/heldout_valid_rate"] == m["probe/valid_rate_heldout"] == 0.5
    assert m["probe/valid_rate_train"] == 0.0
    norm = [rewards.normalised_score(p.tasks[t].baseline_score, p.targets[t],
                                     clip_low=cfg.rewards.norm_clip_low,
                                     clip_high=cfg.rewards.norm_clip_high) for t in PROC_FAMILY]
    assert m["probe/heldout_family_score"] == pytest.approx(np.mean(norm))
    assert m["probe/heldout_score"] == pytest.approx(np.mean(norm) / 2)
    assert m["probe/valid_rate"] == pytest.approx(6 / 16)


@pytest.mark.parametrize("change, match", [
    (dict(ids=PROC_TRAIN + PROC_HELD[:1]), r"tasks.ids holds held-out procedural instances "
                                           r"\['proc-clusters-003'\]"),
    (dict(ids=PROC_TRAIN + PROC_FAMILY[:1]), "held-out procedural instances.*heldout_family"),
    (dict(heldout=PROC_HELD + PROC_TRAIN[1:]), r"\['proc-rules-001'\] are procedural training"),
    (dict(train_tasks=("proc-linear-001",)), "probe.train_tasks.*not in tasks.ids"),
    (dict(heldout_samples=-1), "probe.heldout_samples"),
])
def test_procedural_split_checks(change, match):
    c = _proc_cfg()
    if "ids" in change:
        c.tasks.ids = change["ids"]
        c.probe.heldout_tasks = ()
    if "heldout" in change:
        c.tasks.ids = PROC_TRAIN[:1]
        c.probe.heldout_tasks = change["heldout"]
    assert not set(c.probe.heldout_tasks) & set(c.tasks.ids)
    for k in ("train_tasks", "heldout_samples"):
        if k in change:
            c.probe[k] = change[k]
    with pytest.raises(config_utils.ConfigError, match=match):
        run_config.validate(c, num_devices=1, num_processes=1)
    if "ids" in change:   # refused with the probe off too: the split is the family's
        c.probe.every = 0
        with pytest.raises(config_utils.ConfigError, match=match):
            run_config.validate(c, num_devices=1, num_processes=1)

