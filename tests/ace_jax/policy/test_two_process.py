"""A run loaded by two processes (4 CPU devices each, ``jax.distributed`` over gloo: two hosts of
a pod) with ``load_run_model``'s default placement, the run's own mesh: each process holds only
its shards, reads about its part of the checkpoint, and gives the logits and greedy replies of
the same run loaded by one process on one device. Sampling is ``JaxPolicy`` in
``multihost="leader"`` mode: process 0 samples, process 1 replays its engine calls."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.ace_jax.policy import run_dirs, two_process_load

REPO = pathlib.Path(__file__).resolve().parents[3]
MESH = dict(fsdp=4, expert=2)     # the run's mesh: 8 devices, 4 on each process


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(devices: int) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    return env


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """A tiny run saved from its own mesh (fsdp 4 x expert 2 over this process's 8 devices), as
    a 2-host run saves it: each array stored in chunks of its shards."""
    workdir = str(tmp_path_factory.mktemp("two_proc") / "run")
    saved, _ = run_dirs.make_run(workdir, mesh=MESH)
    return workdir, saved


@pytest.mark.slow
def test_two_processes_load_their_shards_and_agree_with_one(sharded_run, tmp_path):
    from ace_jax.policy import policy, runs
    from ace_jax.runtime import checkpoint
    from models import qwen3

    workdir, saved = sharded_run
    port = _free_port()
    procs = []
    for i in range(2):
        log = open(tmp_path / f"proc{i}.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, "-m", "tests.ace_jax.policy.two_process_load", workdir,
             str(tmp_path), str(port), str(i)], cwd=REPO, env=_env(4), stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True), log))
    deadline = time.time() + 600
    codes = []
    for p, log in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.time())))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            codes.append(p.wait())
        log.close()
    logs = [(tmp_path / f"proc{i}.log").read_text()[-3000:] for i in range(2)]
    assert codes == [0, 0], logs
    out = [json.loads((tmp_path / f"proc{i}.json").read_text()) for i in range(2)]

    # one process, one device: the reference
    before = checkpoint.bytes_read()
    model, tokenizer, step = runs.load_run_model(workdir, shardings=runs.SINGLE_DEVICE)
    full_read = checkpoint.bytes_read() - before
    assert len(qwen3.flat_params(model)["norm/scale"].sharding.device_set) == 1
    ref_logits = two_process_load.forward(model, two_process_load.batch_ids(model.config.vocab_size))
    ref = policy.JaxPolicy(model, tokenizer, max_new_tokens=two_process_load.MAX_NEW_TOKENS,
                           placement=None, slots=8)
    ref_replies = [c.token_ids for c in ref.complete(two_process_load.CONVERSATIONS)]

    for i, o in enumerate(out):
        assert (o["process"], o["processes"], o["devices"], o["local_devices"]) == (i, 2, 8, 4)
        assert o["mesh"] == dict(data=1, fsdp=4, tensor=1, expert=2) and o["step"] == step == 1
        assert o["mirrored"] is True
        total = local = 0
        for name, p in o["params"].items():
            assert p["bytes"] == saved[name].nbytes, name
            assert p["devices"] == 8 and p["local_devices"] == 4, name
            # every device holds its shard, not more (the parameters were never whole anywhere)
            assert p["shard_shapes"] == [p["want_shard_shape"]], (name, p)
            if "fsdp" in p["spec"]:   # fsdp spans the processes: each holds half of the blocks
                assert p["local_bytes"] == p["bytes"] // 2, (name, p)
            total += p["bytes"]
            local += p["local_bytes"]
        assert local <= 0.55 * total, (local, total)
        # each host reads its slices (+ the store's metadata), not the whole checkpoint
        assert o["bytes_read"] < 0.85 * full_read, (o["bytes_read"], full_read)
        print(f"process {i}: holds {local} of {total} parameter bytes on its 4 devices, read "
              f"{o['bytes_read']} bytes of the checkpoint (one process reading it all: {full_read})")
        np.testing.assert_allclose(np.asarray(o["logits"]), ref_logits, rtol=1e-5, atol=1e-5)
    assert np.std(ref_logits) > 1e-3
    assert out[0]["replies"] == ref_replies and all(len(r) > 0 for r in ref_replies)
    assert out[1]["replies"] is None and out[1]["replayed"] >= 2
    # 40 requests queued in an engine of 8 slots (the server's way): each its greedy reply;
    # the messages every follower had read were deleted from the coordinator's store
    n = len(two_process_load.CONVERSATIONS)
    assert out[0]["queued"] == [ref_replies[i % n] for i in range(two_process_load.QUEUED)]
    assert out[1]["replayed"] > two_process_load.QUEUED and out[0]["messages_deleted"] > 0
