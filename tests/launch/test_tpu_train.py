"""The main job end to end on a tiny config: it runs, a misspelt key is refused, and kill -9 at an
arbitrary moment followed by the same command resumes with no lost or duplicated state and the
same RNG stream as an uninterrupted run."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
# configs/local.py:smoke = the local run with a smaller model, 3 SFT steps, 5 RL steps of
# 2 x 2 rollouts of 24 tokens on two tasks, process sandbox (tests/ace_jax/train/test_config.py).
TINY = ["--config=configs/local.py:smoke", "--no_progress"]


def _cmd(workdir, *extra):
    return [sys.executable, str(REPO / "launch/tpu_train.py"), *TINY[:1],
            f"--config.workdir={workdir}", *TINY[1:], *extra]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user would have
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(workdir, *extra, timeout=600):
    out = subprocess.run(_cmd(workdir, *extra), cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _metrics(workdir):
    lines = (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x) for x in lines if x.strip()]


def _metrics_steps(workdir):
    return [m["step"] for m in _metrics(workdir)]


def _step_metrics(workdir):
    """The lines of the RL steps (the last line holds only the probe after the last update)."""
    return [m for m in _metrics(workdir) if "reward/mean" in m]


def _probes(workdir):
    return [{k: v for k, v in m.items() if k.startswith("probe/")} for m in _metrics(workdir)
            if "probe/updates" in m]


def _rollouts(workdir):
    d = pathlib.Path(workdir) / "rollouts"
    out = {}
    for p in sorted(d.glob("*.jsonl")):
        rows = [json.loads(x) for x in p.read_text().splitlines()]
        out[p.name] = [(r["state_id"], r["text"], r["reward"]) for r in rows]
    return out


def _buffer_states(workdir):
    from ace_jax import config_utils
    from ace_jax.curriculum import buffer, buffer_store
    from ace_jax.train import setup
    from sandbox.tasks.targets import task_targets

    cfg = config_utils.load_config_file(str(REPO / "configs/local.py"))
    cfg.tasks.ids = ("iris-species", "wine-cultivar")
    tasks = setup.load_tasks(cfg)
    buf = buffer.EvolvingBuffer(cfg.buffer, [task_targets(t) for t in tasks])
    info = buffer_store.BufferStore(os.path.join(workdir, "buffer")).restore(buf)
    return info.step, sorted((s.state_id, s.parent_id, s.code) for s in buf.states.values())


def test_misspelt_override_lists_valid_keys(tmp_path):
    out = subprocess.run(_cmd(tmp_path, "--config.rl.grup_size=3"), cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "rl.grup_size" in out.stderr and "rl.group_size" in out.stderr


def test_removed_and_misspelt_keys_are_refused_with_any_config_arg(tmp_path):
    # optim.temperature is gone: the learner takes sampling.temperature
    out = subprocess.run(_cmd(tmp_path, "--config.optim.temperature=0.5"), cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "optim.temperature: no such config key" in out.stderr, out.stderr[-2000:]
    assert "Valid keys under optim:" in out.stderr and "optim.learning_rate" in out.stderr
    out = subprocess.run([sys.executable, str(REPO / "launch/tpu_train.py"),
                          "--config=configs/local.py:nope"], cwd=REPO, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown setting; valid: smoke" in out.stderr, out.stderr


def test_a_config_that_cannot_work_is_refused_before_heavy_work(tmp_path):
    out = subprocess.run(_cmd(tmp_path / "run", "--config.optim.microbatches=3"), cwd=REPO,
                         env=_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "error: rows = rl.batch_states x rl.group_size = 4 is not divisible by " \
           "optim.microbatches = 3" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "run").exists()


def test_unwritable_workdir_fails_before_heavy_work(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    out = subprocess.run(_cmd(blocker / "run"), cwd=REPO, env=_env(), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode != 0
    assert "not writable" in out.stderr


def _check_root_child_metrics(workdir):
    """rollout/root_frac and rollout/valid_rate_{root,child} agree with the rollout logs."""
    parents = {sid: pid for sid, pid, _ in _buffer_states(workdir)[1]}
    rows = _step_metrics(workdir)
    for row in rows:
        path = workdir / "rollouts" / f"{row['step']:06d}.jsonl"
        rolls = [json.loads(x) for x in path.read_text().splitlines()]
        root = [parents[r["state_id"]] is None for r in rolls]
        assert row["rollout/root_frac"] == pytest.approx(sum(root) / len(rolls))
        for name, want in (("root", True), ("child", False)):
            ok = [r["status"] == "ok" for r, is_root in zip(rolls, root) if is_root is want]
            assert (f"rollout/valid_rate_{name}" in row) == bool(ok)
            if ok:
                assert row[f"rollout/valid_rate_{name}"] == pytest.approx(sum(ok) / len(ok))
    assert rows[0]["rollout/root_frac"] == 1.0  # the buffer starts with the drafts alone


# One device: the paged engine keeps the routing record. The router's aux loss gives every step a
# gradient (the smoke run's groups all get equal rewards), so the policy moves and the behaviour
# weight of a batch generated one update earlier is not 1.
R3 = ("--config.grpo.routing_replay=R3", "--config.optim.aux_loss_coef=0.01")
OFFPOLICY = ("clip_frac", "behaviour_weight_mean", "behaviour_weight_max", "masked_frac",
             "mismatch_k3", "staleness", "routing_mismatch_frac", "router_disagreement_frac")
PROBE = ("valid_rate", "score", "humanrank", "valid_rate_train", "valid_rate_heldout",
         "updates")


@pytest.mark.slow
def test_kill9_and_resume_matches_uninterrupted_run(tmp_path):
    """The smoke run with k = 1 (the default), MoE routing replay and the probe, killed and
    resumed: the same run, off-policy measures and probes included (the in-flight step's
    routing record is restored)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _run(straight, *R3)
    # steps 0-4, then the probe after the last update as a line of its own
    assert _metrics_steps(straight) == [0, 1, 2, 3, 4, 5]
    _check_root_child_metrics(straight)
    want = _step_metrics(straight)
    assert all(f"offpolicy/{n}" in m for m in want for n in OFFPOLICY)
    assert all(m["offpolicy/routing_mismatch_frac"] == 0.0 for m in want)
    assert [m["offpolicy/staleness"] for m in want] == [0, 1, 1, 1, 1]
    assert all(m["grpo/grad_norm"] > 0 for m in want)
    # step 0 was generated by the parameters that learn on it; later steps one update earlier
    assert abs(want[0]["offpolicy/behaviour_weight_mean"] - 1) < 1e-5
    assert all(m["offpolicy/behaviour_weight_max"] > 1 + 1e-4 for m in want[1:])
    # the probe before update 0, 2, 4 and after the last (5): probe.every = 2
    probes = _probes(straight)
    assert [p["probe/updates"] for p in probes] == [0, 2, 4, 5]
    assert all(f"probe/{n}" in p for p in probes for n in PROBE)

    proc = subprocess.Popen(_cmd(resumed, *R3), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    metrics = resumed / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _run(resumed, *R3)

    assert _metrics_steps(resumed) == [0, 1, 2, 3, 4, 5]
    for a, b in zip(_step_metrics(resumed), want):
        assert {k: a[k] for k in a if k.startswith("offpolicy/")} == \
            {k: b[k] for k in b if k.startswith("offpolicy/")}
    assert _probes(resumed) == probes
    assert _rollouts(resumed) == _rollouts(straight)  # same states, completions, rewards
    assert _buffer_states(resumed) == _buffer_states(straight)


def _checkpoint_meta(workdir) -> dict | None:
    """The trainer's JSON (``TrainState.sampler_state``) of the newest checkpoint of ``workdir``
    whose meta is written; None while there is none. Read straight from the file, so that a
    test can poll a running job quickly."""
    steps = sorted((int(p.name) for p in (pathlib.Path(workdir) / "checkpoints").glob("*")
                    if p.name.isdigit()), reverse=True)
    for step in steps:
        meta = pathlib.Path(workdir) / "checkpoints" / str(step) / "meta" / "metadata"
        try:
            return json.loads(meta.read_text())["sampler_state"]
        except (OSError, ValueError, KeyError):   # being written
            continue
    return None


def _part_way(meta) -> bool:
    """Whether a checkpoint's partial rollouts hold a sample part-way through its decode."""
    return meta is not None and any(
        s is not None and s["finish_reason"] is None and s["tokens"]
        for g in meta["partial"]["groups"] for s in g["samples"])


# partial rollouts on, the engine holding 2 x B groups of the smoke run's two tasks (repeats
# allowed); completions long and hot enough that about half end early (EOS), so that samples
# start at different times and a checkpoint catches some part-way
PARTIAL = ["--config.rl.partial_rollouts=True", "--config.rl.partial_factor=2",
           "--config.lp.allow_repeats=True",
           "--config.rl.num_steps=10", "--config.sampling.max_new_tokens=400",
           "--config.sampling.temperature=3.0", "--config.engine.slots=2",
           "--config.checkpoint.save_interval_steps=1", "--config.checkpoint.async_save=False"]


@pytest.mark.slow
def test_kill9_with_partial_rollouts_in_flight_logs_every_sample_once(tmp_path):
    """Partial rollouts (the engine holds 2 x B groups): kill -9 once a checkpoint holds a
    sample part-way through its decode (the next step under way), then the same command: the
    rollouts log names every sample (group, sample) once, each logged group whole, and every
    group ever drawn is logged or still in flight at the end (nothing lost); the off-policy
    measures at every step, token staleness within the bound."""
    run = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run, *PARTIAL), cwd=REPO, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if _part_way(_checkpoint_meta(run)):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run finished before a checkpoint caught a sample part-way"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert _part_way(_checkpoint_meta(run))
    _run(run, *PARTIAL)

    rows = [json.loads(x) for p in sorted((run / "rollouts").glob("*.jsonl"))
            for x in p.read_text().splitlines()]
    logged = [(r["group"], r["sample"]) for r in rows]
    assert len(logged) == len(set(logged)), "a sample was logged twice"
    groups = {}
    for g, i in logged:
        groups.setdefault(g, set()).add(i)
    assert all(samples == {0, 1} for samples in groups.values()), groups
    end = _checkpoint_meta(run)["partial"]
    assert set(groups) | {g["seq"] for g in end["groups"]} == set(range(end["next_seq"]))
    steps = _step_metrics(run)
    assert [m["step"] for m in steps] == list(range(10))
    assert all(f"offpolicy/{n}" in m for m in steps
               for n in ("staleness", "truncated_frac", "ess", "behaviour_weight_min"))
    assert max(m["offpolicy/staleness"] for m in steps) <= 3   # rl.max_token_staleness


def _dry_run(*extra):
    return subprocess.run([sys.executable, str(REPO / "launch/tpu_train.py"),
                           "--config=configs/ace30b.py", "--dry_run",
                           "--config.dry_run.topology=", *extra],   # the plan, not compiled
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)


def test_dry_run_of_the_production_config_prints_the_plan():
    out = _dry_run()
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "30,532,122,624" in text or "30532122624" in text, text[:2000]
    assert "HBM" in text
    assert "learner_step       ok" in text and "generate_rollout   ok" in text, text[-3000:]
    result = json.loads(text.strip().splitlines()[-1])          # the last line is the JSON summary
    assert result["compiled"] is False and result["chips"] == 64 and result["fits"] is True
    assert (result["prompt_tokens"], result["new_tokens"]) == (8192, 4096)
    assert {"topology", "hbm_gb", "learner_peak_gb", "rollout_peak_gb"} <= set(result)


def test_dry_run_that_does_not_fit_exits_nonzero_and_says_why():
    out = _dry_run("--config.dry_run.max_hbm_fraction=0.01", "--config.dry_run.lower=False")
    assert out.returncode == 1, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["fits"] is False and result["learner_fits"] is False
    out = _dry_run("--config.mesh.expert=3")                    # 64 chips do not split 3 ways
    assert out.returncode == 2 and "mesh" in out.stderr and "Traceback" not in out.stderr, out.stderr
