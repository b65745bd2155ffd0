"""launch/evaluate.py as a user runs it: a subprocess against a real OpenAI-compatible HTTP
endpoint (a tiny server in this process that answers with a seed-corpus script on the first step
and with prose after), writing the JSON, markdown, PNG and episode files."""
import json
import os
import pathlib
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ace_jax.env import agent
from ace_jax.eval import episodes, runner
from sandbox import seed_corpus

REPO = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = next(s.code for s in seed_corpus.list_scripts("iris-species")
              if s.name == "03_logreg_c1.py")


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        step = int(body["seed"]) % runner.SEED_STRIDE
        text = agent.completion_target(SCRIPT) if step == 1 else "No code this time."
        data = json.dumps({"choices": [{"message": {"role": "assistant", "content": text},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 10, "completion_tokens": 5}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def endpoint():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def _run(args, timeout=300):
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run([sys.executable, str(REPO / "launch/evaluate.py"), *args], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_cli_writes_json_markdown_and_plots(endpoint, tmp_path):
    out = tmp_path / "out"
    res = _run([f"--policy=openai:{endpoint}#fake", "--tasks=iris-species", "--seeds=0,1",
                "--max_steps=2", f"--out={out}", "--workers=2", "--backend=process",
                f"--cache_dir={tmp_path / 'tasks'}", "--max_new_tokens=64", "--no_progress"])
    assert res.returncode == 0, res.stderr[-3000:]
    assert "overall" in res.stdout and "HumanRank" in res.stdout
    data = json.loads((out / "results.json").read_text())
    assert data["policy"] == "fake" and data["config"]["seeds"] == [0, 1]
    assert data["overall"]["stats"]["valid"]["mean"] == 1.0
    assert data["tasks"][0]["stats"]["steps_to_first_valid"]["mean"] == 1.0
    assert [e["final"]["step"] for e in data["episodes"]] == [1, 1]
    assert "| **overall** |" in (out / "report.md").read_text()
    for png in ("per_task.png", "best_dev.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logs = sorted(p.name for p in (out / "episodes").iterdir())
    assert logs == ["iris-species__seed0.jsonl", "iris-species__seed1.jsonl"]
    ep = episodes.load_episode(out / "episodes" / logs[0])
    assert [s.status for s in ep.steps] == ["ok", "invalid_format"]
    assert len((out / "seed_solutions.jsonl").read_text().splitlines()) == 1  # same code, merged


def test_cli_refuses_a_bad_policy_spec_and_unknown_tasks(tmp_path):
    res = _run(["--policy=gpt4", f"--out={tmp_path}"])
    assert res.returncode != 0 and "run:<workdir>[@step]" in res.stderr
    res = _run(["--policy=openai:http://127.0.0.1:9/v1#m", "--tasks=no-such-task",
                f"--out={tmp_path}", f"--cache_dir={tmp_path / 'tasks'}"])
    assert res.returncode != 0 and "unknown task ids ['no-such-task']" in res.stderr


def test_cli_against_our_own_server(tmp_path):
    """launch/evaluate.py drives the JAX policy served by ace_jax.policy.serving over real HTTP: the
    episode runs to its end, every step is recorded, and the server counted the requests."""
    from ace_jax.policy import serving
    from ace_jax.policy.policy import JaxPolicy
    from tests.run_fixture import make_tiny_run

    make_tiny_run(str(tmp_path / "run"))
    policy = JaxPolicy.from_run(str(tmp_path / "run"), max_new_tokens=16)
    server, thread, url = serving.start_server(policy, batch_window_ms=5.0)
    try:
        out = tmp_path / "out"
        res = _run([f"--policy=openai:{url}/v1#tiny", "--tasks=iris-species", "--seeds=0",
                    "--max_steps=2", "--max_new_tokens=16", f"--out={out}", "--workers=1",
                    "--backend=process",
                    f"--cache_dir={tmp_path / 'tasks'}", "--no_progress"])
        assert res.returncode == 0, res.stderr[-2000:]
        (episode,) = episodes.load_episodes(out)
        assert len(episode.steps) == 2
        assert all(s.completion_error is None for s in episode.steps)
        assert server.stats()["requests"] == 2
    finally:
        serving.shutdown(server, thread)
