"""The trainer runs the sharded runtime: on 8 simulated devices with fsdp=4 x expert=2 and with
data=2 x fsdp=4 the parameters and optimizer state are laid out by the rules, the run equals the
same run on one device (also with the paged engine decoding in the sampler's own layout), and
kill -9 followed by the same command resumes a sharded run exactly.
"""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from ace_jax import config_utils
from ace_jax.train import trainer
from tests.jax_cache import persistent_cache

REPO = pathlib.Path(__file__).resolve().parents[3]
STEPS = 2
OVERRIDES = dict(
    hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16)
RUN = {"sft.steps": 3, "sft.seconds": 0, "sft.batch_size": 4, "sft.debug_per_task": 0,
       "rl.num_steps": STEPS, "rl.batch_states": 2, "rl.group_size": 4,
       "sampling.max_new_tokens": 24, "sandbox.backend": "process"}
TASKS = ("iris-species", "wine-cultivar")
EXPERTS = "layers/0/mlp/experts/gate_proj"     # [L, E, H, Im]: (layers, experts, embed, mlp)
Q_PROJ = "layers/0/self_attn/q_proj/kernel"     # [L, H, nq, d]: (layers, embed, heads, head_dim)
MESHES = {  # mesh -> expected specs of the expert weights and of q_proj, and into how many
    # pieces a weight is split (parameters are replicated over 'data', a batch-only axis)
    "fsdp4_expert2": (dict(fsdp=4, expert=2), P(None, "expert", "fsdp"),
                      P(None, ("fsdp", "expert")), 8),
    "data2_fsdp4": (dict(data=2, fsdp=4), P(None, None, "fsdp"), P(None, "fsdp"), 4),
}
# run name -> (mesh of MESHES, config keys beyond the module's run)
RUNS = {**{name: (name, {}) for name in MESHES},
        # the paged engine in the sampler's own layout (data 2 x expert 4: the model's 4
        # experts kept in place, dense weights replicated; its 8 slots in 8 row shards), as
        # ace30b's trainer runs it with engine.kind=paged
        "own_paged": ("fsdp4_expert2", {"sampler_mesh.layout": "own", "sampler_mesh.data": 2,
                                        "engine.kind": "paged"})}


def _flags(workdir, mesh: dict) -> list[str]:
    flags = [f"--config.workdir={workdir}", "--no_progress",
             f"--config.tasks.ids=({','.join(repr(t) for t in TASKS)})"]
    flags += [f"--config.model.overrides.{k}={v}" for k, v in OVERRIDES.items()]
    flags += [f"--config.{k}={v}" for k, v in RUN.items()]
    flags += [f"--config.mesh.{k}={v}" for k, v in mesh.items()]
    return flags


# A persistent compilation cache shared by this module's runs, in process and launched (a fresh
# directory per session): a launched 8-device run loads the programs the in-process run of the
# same config compiled, a resumed run those of its killed predecessor (the same programs: the
# cache key is the program, its compile options, devices and backend) instead of compiling them
# again. Set by the `_compile_cache` fixture.
_CACHE_DIR: list[str] = []


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    if _CACHE_DIR:
        env["JAX_COMPILATION_CACHE_DIR"] = _CACHE_DIR[0]
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return env


def _cmd(workdir, mesh):
    # the launcher enables the cache its config names (ace_jax/runtime/compile_cache.py), which
    # wins over the environment's JAX_COMPILATION_CACHE_DIR: name the module's folder there
    cache = [f"--config.compile_cache_dir={_CACHE_DIR[0]}"] if _CACHE_DIR else []
    return [sys.executable, str(REPO / "launch/tpu_train.py"), "--config=configs/local.py",
            *_flags(workdir, mesh), *cache]


def _launch(workdir, mesh, devices, timeout=900):
    out = subprocess.run(_cmd(workdir, mesh), cwd=REPO, env=_env(devices), capture_output=True,
                         text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]


def _results(workdir) -> dict:
    """What a run produced: per step its completions and rewards, and its learner metrics; its
    probes (the smoke config's, every 2 updates and after the last: a line of its own)."""
    rollouts = {}
    for p in sorted((pathlib.Path(workdir) / "rollouts").glob("*.jsonl")):
        rows = [json.loads(x) for x in p.read_text().splitlines()]
        rollouts[p.name] = [(r["state_id"], r["text"], r["status"], r["reward"]) for r in rows]
    lines = [json.loads(x) for x in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    probes = [{k: v for k, v in m.items() if k.startswith("probe/")} for m in lines
              if "probe/updates" in m]
    return dict(rollouts=rollouts, metrics=[m for m in lines if "reward/mean" in m],
                buffer=_buffer_states(workdir), probes=probes)


def _buffer_states(workdir):
    """(step of the last buffer commit, sorted (state id, parent id, code) of every state)."""
    from ace_jax.curriculum import buffer, buffer_store
    from ace_jax.train import setup
    from sandbox.tasks.targets import task_targets

    cfg = config_utils.load_config_file(str(REPO / "configs/local.py"))
    cfg.tasks.ids = TASKS
    targets = [task_targets(t) for t in setup.load_tasks(cfg)]
    buf = buffer.EvolvingBuffer(cfg.buffer, targets)
    info = buffer_store.BufferStore(os.path.join(workdir, "buffer")).restore(buf)
    return info.step, sorted((s.state_id, s.parent_id, s.code) for s in buf.states.values())


def _in_process_config(workdir, mesh, extra=None):
    cfg = config_utils.load_config_file(str(REPO / "configs/local.py"))
    cfg.workdir = str(workdir)
    cfg.tasks.ids = TASKS
    cfg.model.overrides.update(OVERRIDES)
    for key, value in {**RUN, **(extra or {})}.items():
        section, name = key.split(".")
        cfg[section][name] = value
    for k, v in mesh.items():
        cfg.mesh[k] = v
    cfg.mesh.fsdp = mesh.get("fsdp", 1)
    return cfg


@pytest.fixture(scope="module", autouse=True)
def _eight_devices():
    if jax.device_count() < 8:
        pytest.skip("needs 8 simulated devices (tests/conftest.py)")


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    _CACHE_DIR[:] = [str(tmp_path_factory.mktemp("jax_cache"))]
    with persistent_cache(_CACHE_DIR[0], min_compile_seconds=0):
        yield                                # the rest of the session compiles as before
    _CACHE_DIR.clear()


class _Launched:
    """A run started in the background (the command of `_launch`); ``results()`` waits for it.

    The 1-device reference runs in its own process while this one runs the sharded trainer:
    either is mostly one busy thread (compiling, Python), so on 2 cores the two overlap."""

    def __init__(self, workdir, mesh, devices, timeout=900):
        self.workdir, self.timeout, self._results = workdir, timeout, None
        self.log = open(pathlib.Path(workdir).parent / "launch.log", "w+")
        self.proc = subprocess.Popen(_cmd(workdir, mesh), cwd=REPO, env=_env(devices),
                                     stdout=subprocess.DEVNULL, stderr=self.log,
                                     start_new_session=True)

    def results(self) -> dict:
        if self._results is None:
            try:
                code = self.proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                raise
            self.log.seek(0)
            assert code == 0, self.log.read()[-3000:]
            self._results = _results(self.workdir)
        return self._results

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """The reference: the same run as a user on a 1-device machine would start it (started at
    once, in the background; ``one_device.results()`` waits for it)."""
    run = _Launched(tmp_path_factory.mktemp("one_device") / "run", {}, devices=1)
    yield run
    run.stop()


def _run_in_process(workdir, name):
    """Runs the trainer in this (8-device) process as run ``name`` of RUNS; checks the layout of
    its parameters and optimizer state (and of its sampler's); returns its results."""
    mesh_name, extra = RUNS[name]
    mesh, want_experts, want_q, pieces = MESHES[mesh_name]
    t = trainer.Trainer(_in_process_config(workdir, mesh, extra), progress=False)
    try:
        assert dict(t.placement.mesh.shape) == dict(dict(data=1, fsdp=1, tensor=1, expert=1), **mesh)
        t.run()
        if extra:
            from ace_jax.runtime import engine

            assert isinstance(t.generator, engine.Engine) and t.generator._shards == 8
            sampled = {"/".join(map(str, k)): v.get_value()
                       for k, v in nnx.to_flat_state(t.generator.params)}
            assert sampled[EXPERTS].sharding.spec == P(None, "expert")
            assert sampled[Q_PROJ].sharding.spec == P()
        params = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(t.learner.params)}
        assert params[EXPERTS].sharding.spec == want_experts
        assert params[Q_PROJ].sharding.spec == want_q
        shard = params[EXPERTS].addressable_shards[0].data
        assert shard.size * pieces == params[EXPERTS].size     # really split
        mu = {"/".join(map(str, k)): v.get_value() for k, v in nnx.to_flat_state(
            optax.tree_utils.tree_get(t.learner.state.opt_state, "mu"))}
        assert mu[EXPERTS].sharding.spec == want_experts
        assert mu[Q_PROJ].sharding.spec == want_q
    finally:
        t.close()
    return _results(workdir)


@pytest.fixture(scope="module")
def sharded_runs(tmp_path_factory):
    """Results of the in-process sharded runs, by mesh name, computed once."""
    cache = {}

    def get(name):
        if name not in cache:
            workdir = tmp_path_factory.mktemp(name) / "run"
            cache[name] = dict(_run_in_process(workdir, name), workdir=str(workdir))
        return cache[name]

    return get


def _same_run(got: dict, ref: dict) -> None:
    assert got["rollouts"].keys() == ref["rollouts"].keys()
    for name, rows in ref["rollouts"].items():
        ours = got["rollouts"][name]
        assert [r[:3] for r in ours] == [r[:3] for r in rows], name   # same states, texts, status
        np.testing.assert_allclose([r[3] for r in ours], [r[3] for r in rows], rtol=1e-6,
                                   atol=1e-9, err_msg=name)
    assert got["buffer"] == ref["buffer"]
    assert got["probes"] == ref["probes"] and len(got["probes"]) >= 2
    assert [m["step"] for m in got["metrics"]] == [m["step"] for m in ref["metrics"]]
    for ours, theirs in zip(got["metrics"], ref["metrics"]):
        for key in ("grpo/loss", "grpo/grad_norm", "grpo/entropy", "reward/mean"):
            # sharded sums run in another order: relative 1e-4 of these O(1) values
            assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-5), key


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_sharded_trainer_equals_one_device(name, one_device, sharded_runs):
    got = sharded_runs(name)            # in this process, while the reference runs in its own
    _same_run(got, one_device.results())


@pytest.mark.slow
def test_kill9_resume_of_a_sharded_run(sharded_runs, tmp_path):
    """Killed at an arbitrary moment on 8 devices (fsdp=4 x expert=2), the same command resumes and
    ends with exactly the results of the uninterrupted sharded run."""
    name = "fsdp4_expert2"
    mesh = MESHES[name][0]
    workdir = tmp_path / "resumed"
    proc = subprocess.Popen(_cmd(workdir, mesh), cwd=REPO, env=_env(8),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 1:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    _launch(workdir, mesh, devices=8)
    got = _results(workdir)
    ref = sharded_runs(name)
    assert got["rollouts"] == ref["rollouts"]
    assert got["buffer"] == ref["buffer"]
    assert [m["step"] for m in got["metrics"]] == list(range(STEPS))
    for ours, theirs in zip(got["metrics"], ref["metrics"]):
        assert ours["grpo/loss"] == theirs["grpo/loss"]


# ------------------------------------------------------------------ two processes, one mesh

def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_two(workdir, tmp_path, port, cmd=None, env=None):
    """Two processes of 4 CPU devices each on this machine: one run over an 8-device mesh
    (fsdp=4 x expert=2) spanning both, as on a 2-host pod (each host its own task cache).
    ``cmd``: the command before the multi-process flags (default: the module's run)."""
    procs = []
    for i in range(2):
        full = (cmd or _cmd(workdir, MESHES["fsdp4_expert2"][0])) + [
            "--config.mesh.distributed=always", f"--config.mesh.coordinator_address=127.0.0.1:{port}",
            "--config.mesh.num_processes=2", f"--config.mesh.process_id={i}",
            "--config.mesh.heartbeat_timeout_s=10", f"--config.tasks.cache_dir={tmp_path}/tasks{i}",
            "--verbosity=0"]   # INFO: each process logs the executions it ran
        log = open(tmp_path / f"proc{i}.log", "w")
        procs.append((subprocess.Popen(full, cwd=REPO, env=env or _env(4), stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True), log))
    return procs


def _wait(procs, timeout=900):
    deadline = time.time() + timeout
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(p.wait())
        log.close()
    return codes


@pytest.mark.slow
def test_two_processes_run_one_mesh_and_survive_a_lost_peer(sharded_runs, tmp_path):
    """Two processes train one run on a mesh spanning both. Each executes its share of the
    rollouts in its own sandbox pool; one writer persists the buffer; the results equal the
    1-process 8-device run. A killed peer makes the other fail with a clear message, and the
    same two commands resume the run to the same end."""
    ref = sharded_runs("fsdp4_expert2")
    workdir = tmp_path / "run"
    procs = _start_two(workdir, tmp_path, _free_port())
    metrics = workdir / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline and all(p.poll() is None for p, _ in procs):
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 1:
            break
        time.sleep(0.2)
    assert all(p.poll() is None for p, _ in procs), (tmp_path / "proc0.log").read_text()[-3000:]
    os.killpg(procs[1][0].pid, signal.SIGKILL)
    codes = _wait(procs, timeout=300)
    survivor = (tmp_path / "proc0.log").read_text()
    assert codes[0] != 0, "the surviving process went on without its peer"
    # the survivor says at once (before JAX's own end of it) which process it is, that another
    # one was lost, and how to go on: multihost.PeerLostError's one line
    from ace_jax.runtime import multihost
    lost = [x for x in survivor.splitlines() if x.startswith("PeerLostError: process 0 of 2 (")]
    assert lost, survivor[-3000:]
    assert " failed (" in lost[0] and "Another process of this run" in lost[0], lost[0]
    assert lost[0].endswith(multihost.RELAUNCH_ADVICE), lost[0]

    codes = _wait(_start_two(workdir, tmp_path, _free_port()))
    logs = [(tmp_path / f"proc{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n\n".join(x[-3000:] for x in logs)
    got = _results(workdir)
    _same_run(got, ref)
    # each process ran its own share of the executions (multihost.my_share: half each)
    for i, text in enumerate(logs):
        assert f"process {i} of 2 ran" in text, text[-2000:]
        assert f"process {i} of 2: 4 of 8 devices, mesh " in text, text[-2000:]
    # the buffer (written by process 0 alone) holds exactly the reference run's states
    assert got["buffer"] == ref["buffer"]


@pytest.mark.slow
def test_two_processes_run_the_paged_engine_in_the_samplers_own_layout(sharded_runs, tmp_path):
    """The paged engine on a mesh spanning two processes, as on a 2-host pod: each holds half
    of its row shards' slots and pages, builds the programs' host inputs from the same values
    (replicated global arrays) and gathers each decode call's tokens from both. The run equals
    the 1-process 8-device run of the same config."""
    workdir = tmp_path / "run"
    cmd = _cmd(workdir, MESHES["fsdp4_expert2"][0]) + [
        f"--config.{k}={v}" for k, v in RUNS["own_paged"][1].items()]
    codes = _wait(_start_two(workdir, tmp_path, _free_port(), cmd=cmd))
    logs = [(tmp_path / f"proc{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n\n".join(x[-3000:] for x in logs)
    _same_run(_results(workdir), sharded_runs("own_paged"))


@pytest.mark.slow
def test_two_processes_run_the_ideator_from_a_run_on_tasks_in_a_bucket(
        sharded_runs, gcs_emulator, tmp_path, monkeypatch):
    """MLE-Ideator on two processes (one 8-device mesh over both), its weights restored from
    the sharded run (``model.init_from_run``), its task an MLE-bench competition prepared in a
    (emulated) bucket: each process stages the task into its own cache, restores only its
    slices of the parameters (tensorstore's count of the bytes each process read, against
    the parameter files' size: a process reading everything would read about all of it), and
    runs its share of the implementer's scripts."""
    from ace_jax.env import mlebench_data
    from tests import mlebench_prepared

    cid = "spooky-author-identification"      # MLE-bench's own, prepared by its preparer
    data = mlebench_prepared.prepare(tmp_path / "mle", [cid])
    source = sharded_runs("fsdp4_expert2")["workdir"]
    bucket = "gs://" + gcs_emulator.prefix() + "/mlebench"
    env = dict(_env(4), **gcs_emulator.env())
    import fsspec
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon", "skip_instance_cache": True})
    mlebench_data.stage(data, [cid], bucket)
    workdir = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "launch/tpu_train.py"), "--config=configs/ideator.py",
           f"--config.workdir={workdir}", "--no_progress",
           f"--config.model.init_from_run={source}",
           *[f"--config.model.overrides.{k}={v}" for k, v in OVERRIDES.items()],
           "--config.tasks.source=mlebench", f"--config.tasks.data_dir={bucket}",
           f"--config.tasks.ids=('{cid}',)",
           "--config.rl.num_steps=2", "--config.rl.batch_states=1", "--config.rl.group_size=4",
           "--config.sampling.max_new_tokens=24", "--config.ideator.implementer_max_new_tokens=24",
           "--config.sandbox.backend=process", "--config.sandbox.allow_unisolated=True",
           # MLE-bench tasks ask 16 GiB per execution: 2 processes x 2 workers here get 2 GiB
           "--config.sandbox.max_memory_mb=2048",
           *[f"--config.mesh.{k}={v}" for k, v in MESHES["fsdp4_expert2"][0].items()]]
    procs = _start_two(workdir, tmp_path, _free_port(), cmd=cmd, env=env)
    codes = _wait(procs)
    logs = [(tmp_path / f"proc{i}.log").read_text() for i in range(2)]
    assert codes == [0, 0], "\n\n".join(x[-3000:] for x in logs)
    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "reward/mean" in m] == [0, 1]
    step_dir = max((p for p in (pathlib.Path(source) / "checkpoints").iterdir()
                    if p.name.isdigit()), key=lambda p: int(p.name))
    total = sum(f.stat().st_size for f in (step_dir / "params").rglob("*") if f.is_file())
    for i, text in enumerate(logs):
        assert f"process {i} of 2: 4 of 8 devices" in text, text[-2000:]
        assert f"process {i} of 2 ran" in text, text[-2000:]
        assert os.listdir(tmp_path / f"tasks{i}" / "mlebench") == [cid]
        read = [int(x.split(" read ")[1].split(" bytes")[0]) for x in text.splitlines()
                if f"process {i} read " in x and f"checkpoint step {step_dir.name} in "
                f"{step_dir.parent}" in x]
        assert read and read[0] < 0.75 * total, (read, total)

