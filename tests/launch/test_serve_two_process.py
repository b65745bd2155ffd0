"""``launch/serve.py`` on two processes (4 CPU devices each, ``jax.distributed``: two hosts of a
pod): both load their shards of a run saved from its own 8-device mesh, process 0 serves HTTP and
process 1 replays its engine calls; replies equal those of the run served by one process on one
device, and stopping process 0 ends process 1."""
import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from ace_jax.policy.policy import JaxPolicy
from tests.ace_jax.policy import run_dirs

REPO = pathlib.Path(__file__).resolve().parents[2]
MAX_TOKENS = 6
CONVS = [[{"role": "user", "content": f"task {i}: print the metric"}] for i in range(3)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, conv) -> dict:
    body = json.dumps({"messages": conv, "max_tokens": MAX_TOKENS, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_a_run_served_by_two_processes(tmp_path):
    workdir = str(tmp_path / "run")
    run_dirs.make_run(workdir, mesh=dict(fsdp=4, expert=2))
    coordinator, http_port = _free_port(), _free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=4")
    procs = []
    for i in range(2):
        log = open(tmp_path / f"serve{i}.log", "w")
        procs.append((subprocess.Popen(
            [sys.executable, str(REPO / "launch/serve.py"), f"--run={workdir}",
             f"--port={http_port}", f"--max_new_tokens={MAX_TOKENS}", "--max_batch_size=8",
             "--batch_window_ms=50", "--distributed=always", "--num_processes=2",
             f"--coordinator_address=127.0.0.1:{coordinator}", f"--process_id={i}"],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))

    def logs():
        return [(tmp_path / f"serve{i}.log").read_text()[-3000:] for i in range(2)]

    try:
        deadline = time.time() + 400
        url = None
        while url is None and time.time() < deadline:
            assert all(p.poll() is None for p, _ in procs), logs()
            line = [x for x in logs()[0].splitlines() if x.startswith("serving ")]
            url = line[0].split(" at ")[1].split()[0] if line else None
            time.sleep(1)
        assert url, logs()
        assert "following process 0 (process 1 of 2)" in logs()[1], logs()
        served = [_post(url, c)["choices"][0]["message"]["content"] for c in CONVS]
        procs[0][0].send_signal(signal.SIGTERM)
        codes = [p.wait(timeout=120) for p, _ in procs]
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    assert codes == [0, 0], logs()
    assert "stopped after" in logs()[1], logs()
    one = JaxPolicy.from_run(workdir, max_new_tokens=MAX_TOKENS, placement=None)
    want = [c.text for c in one.complete(CONVS)]
    assert served == want
