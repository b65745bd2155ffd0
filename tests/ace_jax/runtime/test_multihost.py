"""Multi-process hygiene: the barrier with its own timeout, the message of a lost peer, and one
writer for the folders that every process could delete (two real processes on one machine)."""
import os
import pathlib
import socket
import subprocess
import sys
import textwrap

import pytest

from ace_jax.runtime import multihost

REPO = pathlib.Path(__file__).resolve().parents[3]


class JaxRuntimeError(RuntimeError):
    """Named as the runtime's error type (what `multihost` recognises by name)."""


HEARTBEAT = ("INTERNAL: Barrier failed because: task is set to ERROR: UNAVAILABLE: Task 1 "
             "heartbeat timeout. This indicates that the remote task has failed, got preempted, "
             "or crashed unexpectedly.")
GLOO = "UNKNOWN: Gloo AllGather failed: [gloo/transport/tcp/pair.cc:547] Connection closed by peer"


def test_the_lost_process_is_named_when_the_runtime_names_it():
    assert multihost._lost_processes(HEARTBEAT) == [1]
    assert multihost._lost_processes(
        "UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):\n3\n5\n"
        "The tasks have crashed.") == [3, 5]
    assert multihost._lost_processes(GLOO) == []


def test_a_lost_peer_is_reported_with_what_to_do(monkeypatch, capsys):
    monkeypatch.setattr(multihost, "is_multi_process", lambda: True)
    with pytest.raises(multihost.PeerLostError) as info:
        with multihost.lost_peer_guard(lambda: "the RL loop (iteration 3)"):
            raise JaxRuntimeError(HEARTBEAT)
    msg = str(info.value)
    assert msg.startswith(f"process 0 of 1 ({socket.gethostname()}): the RL loop (iteration 3) "
                          "failed (JaxRuntimeError: INTERNAL: Barrier failed")
    assert "Another process of this run (process 1) died or lost its connection. " in msg
    assert msg.endswith(multihost.RELAUNCH_ADVICE)
    assert "same command again on every host" in msg and "resumes from its last checkpoint" in msg
    # printed at once: JAX may end the process before the exception reaches the top
    assert capsys.readouterr().err == f"PeerLostError: {msg}\n"

    # raised from an error of a lost peer (Orbax's barrier inside a save): also a lost peer
    with pytest.raises(multihost.PeerLostError, match="saving checkpoint step 2 failed"):
        with multihost.lost_peer_guard("saving checkpoint step 2"):
            try:
                raise JaxRuntimeError(GLOO)
            except JaxRuntimeError as e:
                raise ValueError("orbax: the save failed") from e
    # a PeerLostError passes through an outer guard unchanged (reported once)
    capsys.readouterr()
    with pytest.raises(multihost.PeerLostError) as outer:
        with multihost.lost_peer_guard("outer"):
            with multihost.lost_peer_guard("inner"):
                raise JaxRuntimeError(GLOO)
    assert "inner failed" in str(outer.value) and capsys.readouterr().err.count("PeerLost") == 1
    # gloo does not say which process: where JAX will say it
    assert "connection (JAX names it once its heartbeat times out: 'The following tasks are " \
           "unhealthy (stopped sending heartbeats)'" in str(outer.value)
    # other errors pass unchanged
    with pytest.raises(JaxRuntimeError, match="RESOURCE_EXHAUSTED"):
        with multihost.lost_peer_guard("x"):
            raise JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory")
    with pytest.raises(KeyError):
        with multihost.lost_peer_guard("x"):
            raise KeyError("a")
    # one process: nothing is a lost peer
    monkeypatch.setattr(multihost, "is_multi_process", lambda: False)
    with pytest.raises(JaxRuntimeError):
        with multihost.lost_peer_guard("x"):
            raise JaxRuntimeError(GLOO)


def test_barrier_waits_at_the_coordination_service_with_its_own_timeout(monkeypatch):
    calls = []

    class Client:
        fail = False

        def wait_at_barrier(self, key, timeout_ms):
            calls.append((key, timeout_ms))
            if self.fail:
                raise JaxRuntimeError(HEARTBEAT)

    client = Client()
    monkeypatch.setattr(multihost, "_barrier_calls", {})
    multihost.barrier("solo")                        # one process: no barrier at all
    monkeypatch.setattr(multihost, "is_multi_process", lambda: True)
    monkeypatch.setattr(multihost, "_coordination_client", lambda: client)
    multihost.barrier("tokenizer")
    multihost.barrier("tokenizer", timeout_s=5)
    multihost.barrier("other")
    full = multihost.BARRIER_TIMEOUT_S * 1000
    assert calls == [("ace_jax:tokenizer:0", full), ("ace_jax:tokenizer:1", 5000),
                     ("ace_jax:other:0", full)]
    client.fail = True
    with pytest.raises(multihost.PeerLostError, match=r"waiting at barrier 'x' \(up to 3600 s\) "
                                                      r"failed .*\(process 1\) died"):
        multihost.barrier("x")
    # without the private client: JAX's public device barrier
    synced = []
    from jax.experimental import multihost_utils
    monkeypatch.setattr(multihost, "_coordination_client", lambda: None)
    monkeypatch.setattr(multihost_utils, "sync_global_devices", synced.append)
    multihost.barrier("tokenizer")
    assert synced == ["ace_jax:tokenizer:2"]
    # the installed JAX has the client's barrier (else the fallback above is what runs)
    from jax._src.lib import _jax
    assert hasattr(_jax.DistributedRuntimeClient, "wait_at_barrier")


WORKER = textwrap.dedent("""
    import os, sys, time
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    pid, port, ckdir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    jax.distributed.initialize(f"127.0.0.1:{port}", 2, pid, heartbeat_timeout_seconds=20)
    from etils import epath
    from ace_jax.runtime import checkpoint, multihost

    removed = []
    cls = type(epath.Path(ckdir))
    real_rmtree = cls.rmtree
    def rmtree(self, *a, **k):
        removed.append(self.name)
        return real_rmtree(self, *a, **k)
    cls.rmtree = rmtree

    if pid == 1:
        time.sleep(4)                  # arrives late (loading its weights)
    t0 = time.time()
    multihost.barrier("start", timeout_s=60)
    waited = time.time() - t0
    c = checkpoint.Checkpointer(ckdir, async_save=False)   # meets at its own barrier first
    if pid == 0:                       # an unfinished save of step 5, written in place
        (epath.Path(ckdir) / "5").mkdir()
        (epath.Path(ckdir) / "5" / "params").mkdir()
    multihost.barrier("made")
    assert c.all_steps() == [5], c.all_steps()
    assert c.delete_after(1) == [5]
    assert c.all_steps() == [], c.all_steps()
    c.close()
    print(f"RESULT {pid} waited={waited:.1f} removed={removed}", flush=True)
""")


@pytest.mark.slow
def test_two_processes_meet_at_barriers_and_one_deletes(tmp_path):
    """Two real processes (jax.distributed on this machine): the late one is waited for at the
    coordination-service barrier; the unfinished step folder of a resume is deleted by
    process 0 alone, both waiting before and after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO),
               XLA_FLAGS="--xla_force_host_platform_device_count=1")
    procs = [subprocess.Popen([sys.executable, str(script), str(i), str(port),
                               str(tmp_path / "ck")], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for i in range(2)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=240)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("the processes did not finish: " + "\n".join(
                q.communicate()[0][-2000:] for q in procs))
    assert [p.returncode for p in procs] == [0, 0], "\n\n".join(o[-3000:] for o in outs)
    results = {int(line.split()[1]): line for o in outs for line in o.splitlines()
               if line.startswith("RESULT ")}
    assert "removed=['5']" in results[0] and "removed=[]" in results[1], results
    assert float(results[0].split("waited=")[1].split()[0]) >= 3.0   # process 0 waited
