"""Setup errors of the trainer are clear and come before any heavy work."""
import numpy as np
import pytest

from ace_jax import config_utils
from ace_jax.curriculum import seeds
from ace_jax.train import config as train_config, trainer
from tests.jax_cache import persistent_cache


@pytest.fixture
def cfg(tmp_path):
    c = config_utils.load_config_file("configs/local.py")
    c.workdir = str(tmp_path / "run")
    c.tasks.cache_dir = str(tmp_path / "tasks")
    return c


def test_gs_without_credentials_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "true")           # not on a GCE VM: no metadata server
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud application-default file
    with pytest.raises(trainer.SetupError, match="credentials"):
        trainer.check_writable("gs://some-bucket/run")


def test_a_bucket_that_does_not_exist_is_named_with_the_fix(gcs_emulator, monkeypatch):
    import fsspec

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon", "skip_instance_cache": True})
    with pytest.raises(trainer.SetupError, match="bucket gs://no-such-bucket does not exist.*"
                                                 "gcloud storage buckets create"):
        trainer.check_writable("gs://no-such-bucket/run")
    trainer.check_writable("gs://" + gcs_emulator.prefix() + "/run")     # an existing one


def test_unknown_task_is_refused_with_the_available_ones(cfg):
    cfg.tasks.ids = ("iris-species", "no-such-task")
    with pytest.raises(trainer.SetupError, match="no-such-task.*available"):
        trainer.Trainer(cfg, progress=False)


def test_unknown_reward_and_bad_group_size(cfg):
    cfg.rl.reward = "nope"
    with pytest.raises(trainer.SetupError, match="rl.reward.*acegrpo_step"):
        trainer.Trainer(cfg, progress=False)
    cfg.rl.reward = "acegrpo_step"
    cfg.rl.group_size = 1
    with pytest.raises(trainer.SetupError, match="group_size"):
        trainer.Trainer(cfg, progress=False)


def test_missing_mlebench_dir(cfg, tmp_path):
    cfg.tasks.source = "mlebench"
    cfg.tasks.data_dir = str(tmp_path / "absent")
    with pytest.raises(trainer.SetupError, match="not a directory"):
        trainer.Trainer(cfg, progress=False)


def test_tokenizer_that_does_not_match_the_model(cfg, tmp_path):
    from flax import nnx

    from models import configs, hf_mapping, qwen3, tokenizer

    tok_dir = tmp_path / "tok"
    tokenizer.train_bpe_tokenizer(["print('hello world')\n" * 50, "import numpy as np\n" * 50],
                                  300, str(tok_dir))
    small = qwen3.Qwen3ForCausalLM(configs.tiny_dense(vocab_size=128), rngs=nnx.Rngs(0))
    hf_dir = tmp_path / "hf"
    hf_mapping.export_hf(small, small.config, str(hf_dir))
    cfg.model.hf_path = str(hf_dir)
    cfg.model.tokenizer_path = str(tok_dir)
    cfg.tasks.ids = ("iris-species",)
    with pytest.raises(trainer.SetupError, match="do not belong together"):
        trainer.Trainer(cfg, progress=False)


def test_init_from_run_takes_the_runs_weights_and_tokenizer(cfg, tmp_path):
    import jax
    import numpy as np
    from flax import nnx

    from tests.run_fixture import make_tiny_run

    model, tok = make_tiny_run(str(tmp_path / "warm"))
    cfg.model.init_from_run = str(tmp_path / "warm")
    cfg.tasks.ids = ("iris-species",)
    t = trainer.Trainer(cfg, progress=False)
    assert len(t.tokenizer) == len(tok)
    want = jax.tree.leaves(nnx.state(model, nnx.Param))
    got = jax.tree.leaves(nnx.state(t.model, nnx.Param))
    assert len(want) == len(got)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert t._warm_start() == {}  # no SFT on top of the run's weights


def test_init_from_run_that_is_not_a_run(cfg, tmp_path):
    from tests.run_fixture import make_tiny_run

    make_tiny_run(str(tmp_path / "warm"))
    import shutil

    shutil.rmtree(tmp_path / "warm" / "checkpoints")
    cfg.model.init_from_run = str(tmp_path / "warm")
    cfg.tasks.ids = ("iris-species",)
    with pytest.raises(trainer.SetupError, match="no checkpoint"):
        trainer.Trainer(cfg, progress=False)


def test_seed_solutions_of_an_evaluation_seed_the_buffer(cfg, tmp_path):
    from ace_jax.curriculum import buffer
    from tests.run_fixture import make_tiny_run

    make_tiny_run(str(tmp_path / "warm"))
    cfg.model.init_from_run = str(tmp_path / "warm")
    cfg.tasks.ids = ("iris-species",)
    code = "print('an earlier valid attempt')\n"
    sols = seeds.write_seed_solutions(
        [buffer.SeedSolution("iris-species", code, 0.9),
         buffer.SeedSolution("wine-cultivar", "print(1)\n", 0.8)],  # not a task of this run
        tmp_path / "eval" / "seed_solutions.jsonl")
    cfg.rl.seed_solutions = str(sols)
    t = trainer.Trainer(cfg, progress=False)
    t._seed_buffer()
    roots = sorted((s.code, s.score, s.origin) for s in t.buffer.states.values())
    assert roots == [("", None, "seed"), (code, 0.9, "evaluation")]


@pytest.mark.parametrize("content, match", [
    (None, "cannot read"),
    ('{"task_id": "iris-species", "code": "x"}\n', "line 1: not a seed solution"),
    ('{"task_id": "iris-species", "code": "x", "score": 1}\nnot json\n', "line 2"),
    ('{"task_id": "iris-species", "code": "x", "score": NaN}\n', "line 1"),
    ('{"task_id": "wine-cultivar", "code": "x", "score": 1}\n', "only for tasks this run"),
])
def test_bad_seed_solutions_are_setup_errors(cfg, tmp_path, content, match):
    path = tmp_path / "seed_solutions.jsonl"
    if content is not None:
        path.write_text(content)
    cfg.rl.seed_solutions = str(path)
    cfg.tasks.ids = ("iris-species",)
    with pytest.raises(trainer.SetupError, match=match):
        trainer.Trainer(cfg, progress=False)


# ------------------------------------------------------------------ the loop, end to end (tiny)

TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16)


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    """A task cache and a small BPE shared by the end-to-end runs of this module."""
    from sandbox import seed_corpus
    from sandbox.tasks import registry

    from ace_jax.train import sft

    root = tmp_path_factory.mktemp("tiny")
    task = registry.load_task("iris-species", root / "tasks", prepare_if_missing=True)
    sft.build_tokenizer([task], seed_corpus.list_scripts("iris-species"), 400,
                        str(root / "tok"))
    return root


def tiny_loop_cfg(tiny_setup, workdir, **rl):
    c = config_utils.load_config_file("configs/local.py")
    c.workdir = str(workdir)
    c.tasks.cache_dir = str(tiny_setup / "tasks")
    c.tasks.ids = ("iris-species",)
    c.model.tokenizer_path = str(tiny_setup / "tok")
    c.model.overrides.update(TINY)
    c.sft.enabled = False
    c.rl.update(dict(dict(num_steps=3, batch_states=1, group_size=2), **rl))
    c.sampling.max_new_tokens = 8
    c.sandbox.backend = "process"
    c.probe.every, c.probe.heldout_tasks = 2, ()   # the probe on the static generator too
    return c


def run_loop(cfg, stop_after_iteration=None):
    """Runs a Trainer; ``stop_after_iteration``: dies (as if killed) right after that
    iteration's persist. Returns what the run left: per-step metrics (no perf/), rollout rows
    and buffer states, the probes, and apart the perf/ timings."""
    import json
    import pathlib

    class Killed(Exception):
        pass

    t = trainer.Trainer(cfg, progress=False)
    persist = t._persist

    def dying_persist(**kw):
        persist(**kw)
        if t.iteration == stop_after_iteration:
            raise Killed
    t._persist = dying_persist
    try:
        t.run()
    except Killed:
        pass
    finally:
        t.close()
    wd = pathlib.Path(cfg.workdir)
    lines = [json.loads(x) for x in (wd / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in lines if "reward/mean" in r]   # the last line holds only the last probe
    metrics = [{k: v for k, v in r.items() if not k.startswith("perf/")
                and k not in ("time", "wall_time", "timestamp")} | {"staleness": r["offpolicy/staleness"]}
               for r in rows]
    probes = [(r["step"], {k: v for k, v in r.items() if k.startswith("probe/")})
              for r in lines if "probe/updates" in r]
    perf = [{k: v for k, v in r.items() if k.startswith("perf/")} for r in rows]
    rollouts = {p.name: [json.loads(x) for x in p.read_text().splitlines()]
                for p in sorted((wd / "rollouts").glob("*.jsonl"))}
    from ace_jax.curriculum import buffer, buffer_store

    buf = buffer.EvolvingBuffer(cfg.buffer, list(t.targets.values()))
    info = buffer_store.BufferStore(str(wd / "buffer")).restore(buf)
    states = sorted((s.state_id, s.parent_id, s.code) for s in buf.states.values())
    return dict(metrics=metrics, rollouts=rollouts, buffer=(info.step, states), perf=perf,
                probes=probes)


def test_max_staleness_knob():
    c = config_utils.load_config_file("configs/local.py")
    assert trainer.max_staleness(c) == c.rl.max_staleness == 1   # the default: today's overlap
    c.rl.max_staleness = 3
    assert trainer.max_staleness(c) == 3
    c.rl.max_staleness = 0                   # synchronous (the one knob: no async_rollouts)
    assert trainer.max_staleness(c) == 0 and "async_rollouts" not in c.rl
    c.rl.max_staleness = -1
    with pytest.raises(config_utils.ConfigError, match="max_staleness"):
        train_config.validate(c)


@pytest.fixture(scope="module")
def k1_run(tiny_setup, tmp_path_factory):
    """k = 1 (today's overlap), checkpoints every 2 iterations, written in the background."""
    cfg = tiny_loop_cfg(tiny_setup, tmp_path_factory.mktemp("k1") / "run", max_staleness=1)
    cfg.checkpoint.save_interval_steps = 2
    cfg.checkpoint.async_save = True
    with persistent_cache(None):   # perf/compile_seconds counts compiles, and a hit is none
        return run_loop(cfg)


@pytest.mark.parametrize("k", [0, 1])
def test_each_batch_is_learned_at_most_k_updates_after_it_was_generated(
        k, k1_run, tiny_setup, tmp_path):
    if k == 1:
        got = k1_run
    else:
        with persistent_cache(None):
            got = run_loop(tiny_loop_cfg(tiny_setup, tmp_path / "run", max_staleness=k))
    assert [m["step"] for m in got["metrics"]] == [0, 1, 2]
    # the probe: before updates 0 and 2 (probe.every = 2) and after the last, a line of its own
    assert [(step, p["probe/updates"]) for step, p in got["probes"]] == [(0, 0), (2, 2), (3, 3)]
    # learner version when step t is learned on: t (one update per step); generated by:
    versions = [max(t - k, 0) for t in range(3)]
    assert [m["staleness"] for m in got["metrics"]] == [t - v for t, v in enumerate(versions)]
    assert all(m["staleness"] <= k for m in got["metrics"])
    for t, name in enumerate(sorted(got["rollouts"])):
        assert {r["policy_version"] for r in got["rollouts"][name]} == {versions[t]}
    # the off-policy measures are written at every step; with k = 1 the lag shows in the
    # behaviour weight pi_learner / pi_sampler (step 0 is on-policy). (The routing measures
    # need the paged engine's record: tests/launch/test_tpu_train.py, on one device.)
    names = ("clip_frac", "behaviour_weight_mean", "behaviour_weight_max", "masked_frac",
             "mismatch_k3", "staleness")
    assert all(f"offpolicy/{n}" in m for m in got["metrics"] for n in names)
    weights = [m["offpolicy/behaviour_weight_mean"] for m in got["metrics"]]
    assert all(np.isfinite(weights)) and (k == 0 or len(set(weights)) > 1), weights
    # The first step compiled the generator and the learner; compiling is part of the step.
    first = got["perf"][0]
    assert 0 < first["perf/compile_seconds"] <= first["perf/step_seconds"]


def test_resume_replays_from_the_last_checkpoint(k1_run, tiny_setup, tmp_path):
    """Checkpoints every 2 iterations (written in the background): killed after iteration 3
    (saved: 0 and 2), the same command resumes at 2, replays 3 and ends as the straight run."""
    import os

    cfg = tiny_loop_cfg(tiny_setup, tmp_path / "run", max_staleness=1)
    cfg.checkpoint.save_interval_steps = 2
    cfg.checkpoint.async_save = True
    run_loop(cfg, stop_after_iteration=3)
    assert sorted(int(p) for p in os.listdir(tmp_path / "run" / "checkpoints")
                  if p.isdigit()) == [0, 2]
    untimed = lambda run: {k: v for k, v in run.items() if k != "perf"}  # noqa: E731
    assert untimed(run_loop(cfg)) == untimed(k1_run)


def test_a_failed_background_save_gets_no_buffer_commit(k1_run, tiny_setup, tmp_path):
    """The checkpoint of iteration 2, written in the background, fails (as an object store's
    write can): the run stops with the error, closing it commits nothing for iteration 2, and
    the same command resumes from the last iteration with both and ends as the straight run."""
    cfg = tiny_loop_cfg(tiny_setup, tmp_path / "run", max_staleness=1)
    cfg.checkpoint.save_interval_steps = 2
    cfg.checkpoint.async_save = True
    t = trainer.Trainer(cfg, progress=False)
    wait = t.checkpointer.wait_until_finished

    failed = []

    def failing_wait():      # as Orbax: the failed save raises once, at the next wait
        wait()
        if t.iteration == 3 and not failed:   # iteration 2's save was pending
            failed.append(True)
            raise OSError("Error writing manifest.ocdbt (injected)")
    t.checkpointer.wait_until_finished = failing_wait
    with pytest.raises(OSError, match="injected"):
        t.run()
    t.close()
    from ace_jax.curriculum import buffer, buffer_store
    buf = buffer.EvolvingBuffer(cfg.buffer, list(t.targets.values()))
    assert buffer_store.BufferStore(str(tmp_path / "run" / "buffer")).restore(buf).step == 0
    untimed = lambda run: {k: v for k, v in run.items() if k != "perf"}  # noqa: E731
    assert untimed(run_loop(cfg)) == untimed(k1_run)


def test_a_run_killed_before_its_first_buffer_commit_starts_afresh(k1_run, tiny_setup, tmp_path):
    """Iteration 0's checkpoint is written but its buffer commit never lands (a host lost in
    between, as the rehearsal's gloo time-out did): the same command drops that checkpoint,
    starts afresh and ends as the straight run (it used to stop: "the run directory is
    inconsistent")."""
    import os

    cfg = tiny_loop_cfg(tiny_setup, tmp_path / "run", max_staleness=1)
    cfg.checkpoint.save_interval_steps = 2
    cfg.checkpoint.async_save = True
    t = trainer.Trainer(cfg, progress=False)

    def lost(*args, **kw):
        raise RuntimeError("host lost before the buffer commit (injected)")
    t.store.commit = lost
    with pytest.raises(RuntimeError, match="injected"):
        t.run()
    t.close()
    assert [p for p in os.listdir(tmp_path / "run" / "checkpoints") if p.isdigit()] == ["0"]
    untimed = lambda run: {k: v for k, v in run.items() if k != "perf"}  # noqa: E731
    assert untimed(run_loop(cfg)) == untimed(k1_run)


def test_token_budget_ends_the_run_at_the_step_that_spends_it(tiny_setup, tmp_path):
    """``rl.token_budget``: no step goes out once the run has generated that many completion
    tokens (k = 1: the step in flight is still learned on); the final probe is the line after
    the last step; killed and resumed, the run ends at the same step with the same metrics
    (the count is checkpointed)."""
    budget = 17    # > one step's most (B x G x max_new_tokens = 16): at least 2 steps
    cfg = tiny_loop_cfg(tiny_setup, tmp_path / "run", num_steps=50, token_budget=budget)
    got = run_loop(cfg)
    tokens = [m["rollout/generated_tokens"] for m in got["metrics"]]
    n = len(tokens)
    assert 2 <= n < 50 and sum(tokens[:-1]) < budget <= sum(tokens), tokens
    assert [m["step"] for m in got["metrics"]] == list(range(n))
    assert got["probes"][-1] == (n, {**got["probes"][-1][1], "probe/updates": float(n)})
    cfg.workdir = str(tmp_path / "resumed")
    run_loop(cfg, stop_after_iteration=1)
    untimed = lambda run: {k: v for k, v in run.items() if k != "perf"}  # noqa: E731
    assert untimed(run_loop(cfg)) == untimed(got)
    cfg.rl.token_budget = -1
    with pytest.raises(config_utils.ConfigError, match="token_budget"):
        train_config.validate(cfg)


def _refill_run(tiny_setup, tmp_path, task_ids, **rl):
    """A synchronous tiny run with 2 dynamic-sampling rounds on ``task_ids``, no probe:
    (run_loop's result, B, G)."""
    cfg = tiny_loop_cfg(tiny_setup, tmp_path / "run", max_staleness=0,
                        dynamic_sampling_rounds=2, **rl)
    cfg.tasks.ids = task_ids
    cfg.probe.every = 0
    return run_loop(cfg), cfg.rl.batch_states, cfg.rl.group_size


def test_dynamic_sampling_refills_groups_without_signal(tiny_setup, tmp_path):
    """DAPO's dynamic sampling: the tiny policy's groups all get the same reward (no signal), so
    each step refills; with two tasks (two root states) and B = 1, one refill round finds the
    other task's draft and the second finds no state this step has not drawn, so it stops.
    Every refill is generated, logged and counted in the step's generated tokens, and the
    learner still gets B groups."""
    got, b, g = _refill_run(tiny_setup, tmp_path, ("iris-species", "wine-cultivar"),
                            dynamic_sampling="dapo")
    assert [m["rollout/refill_rounds"] for m in got["metrics"]] == [1, 1, 1]
    for m, name in zip(got["metrics"], sorted(got["rollouts"])):
        rows = got["rollouts"][name]
        assert len(rows) == 2 * b * g                      # the step's group + 1 refill
        assert {r["task_id"] for r in rows} == {"iris-species", "wine-cultivar"}
        assert m["rollout/generated_tokens"] == sum(r["completion_tokens"] for r in rows)
        # no group has signal: the learner keeps the step's own B groups (the first rows)
        assert m["grpo/num_completion_tokens"] == sum(r["completion_tokens"]
                                                      for r in rows[:b * g])


def test_reinforce_ada_resamples_the_same_state_and_balances_its_group(tiny_setup, tmp_path):
    """``rl.dynamic_sampling="reinforce_ada"``: a state whose samples all agree gets G more, each
    round (the tiny policy never finds a spread, so every step runs its 2 rounds on the same
    state); without a spread the learner keeps the first G samples."""
    got, b, g = _refill_run(tiny_setup, tmp_path, ("iris-species",),
                            dynamic_sampling="reinforce_ada")
    assert [m["rollout/refill_rounds"] for m in got["metrics"]] == [2, 2, 2]
    for m, name in zip(got["metrics"], sorted(got["rollouts"])):
        rows = got["rollouts"][name]
        assert len(rows) == 3 * b * g and len({r["state_id"] for r in rows}) == b
        assert m["grpo/num_completion_tokens"] == sum(r["completion_tokens"]
                                                      for r in rows[:b * g])
