"""The OpenAI-compatible server (ace_jax/serving.py, launch/serve.py) over real HTTP on localhost,
in front of a JaxPolicy restored from a tiny run directory."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

from ace_jax import serving
from ace_jax.policy import Completion, JaxPolicy, OpenAIPolicy
from tests.run_fixture import make_tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 8
CONVS = [[{"role": "user", "content": f"task {i}: print the metric"}] for i in range(4)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(workdir, policy, server, url): a server with a generous batch window (a loaded CI
    machine may take a while to start 4 client threads)."""
    workdir = str(tmp_path_factory.mktemp("serve") / "run")
    make_tiny_run(workdir)
    policy = JaxPolicy.from_run(workdir, max_new_tokens=MAX_TOKENS)
    server, thread, url = serving.start_server(policy, "127.0.0.1", 0, batch_window_ms=300)
    yield workdir, policy, server, url
    serving.shutdown(server, thread)
    assert not thread.is_alive()


@pytest.fixture(scope="module")
def direct(served):
    """Replies of JaxPolicy.complete to each conversation alone (greedy)."""
    policy = served[1]
    return [policy.complete([c], seed=0)[0] for c in CONVS]


def _post(url: str, body, *, raw: bool = False):
    data = body if raw else json.dumps(body).encode()
    req = urllib.request.Request(url + "/v1/chat/completions", data=data, method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode("utf-8"), r.headers
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8"), e.headers


def _get(url: str, path: str):
    with urllib.request.urlopen(url + path, timeout=30) as r:
        return json.loads(r.read())


def test_openai_client_gets_what_the_policy_gives(served, direct):
    _, policy, server, url = served
    client = OpenAIPolicy(url + "/v1", max_tokens=MAX_TOKENS, temperature=0.0, retries=0,
                          timeout_s=120, max_concurrency=1)
    out = client.complete(CONVS[:2], seed=5)
    for got, want in zip(out, direct):
        assert got.ok, got.error
        assert (got.text, got.prompt_tokens, got.completion_tokens, got.finish_reason) == \
            (want.text, want.prompt_tokens, want.completion_tokens, want.finish_reason)


def test_response_follows_the_openai_schema(served, direct):
    _, policy, _, url = served
    status, body, headers = _post(url, {"model": "whatever", "messages": CONVS[0]})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    data = json.loads(body)
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert isinstance(data["created"], int) and data["model"] == policy.name
    choice = data["choices"][0]
    assert choice["index"] == 0 and choice["message"] == {"role": "assistant",
                                                          "content": direct[0].text}
    assert choice["finish_reason"] in ("stop", "length")
    u = data["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] > 0


def test_concurrent_requests_are_batched(served, direct):
    _, _, server, url = served
    before = server.stats()
    results = [None] * 4
    barrier = threading.Barrier(4)

    def call(i):
        barrier.wait()
        results[i] = _post(url, {"messages": CONVS[i], "max_tokens": MAX_TOKENS})

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    after = server.stats()
    assert after["requests"] - before["requests"] == 4
    assert after["batches"] - before["batches"] < 4, (before, after)
    assert after["max_batch"] >= 2
    for (status, body, _), want in zip(results, direct):
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["content"] == want.text


def _stream(url, body):
    status, text, headers = _post(url, dict(body, stream=True))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream"), text
    events = [line[len("data: "):] for line in text.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_gives_the_same_text(served, direct):
    _, _, _, url = served
    chunks = _stream(url, {"messages": CONVS[1], "stream_options": {"include_usage": True}})
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == direct[1].text
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 1
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [f["choices"][0]["finish_reason"] for f in finals] == [direct[1].finish_reason]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == \
        direct[1].completion_tokens


def test_seeded_sampling_reproduces_the_policy(served):
    _, policy, _, url = served
    want = policy.complete([CONVS[2]], seed=11, temperature=0.9)[0]
    status, body, _ = _post(url, {"messages": CONVS[2], "temperature": 0.9, "seed": 11})
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == want.text


def test_stop_strings_cut_the_reply(served, direct):
    _, _, _, url = served
    full = direct[0].text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    status, body, _ = _post(url, {"messages": CONVS[0], "stop": [stop]})
    choice = json.loads(body)["choices"][0]
    assert status == 200 and choice["message"]["content"] == full[:full.find(stop)]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"model": "m"}).encode(), "messages"),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), "wizard"),
    (json.dumps({"messages": [{"role": "user", "content": [1]}]}).encode(), "content"),
    (json.dumps({"messages": CONVS[0], "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"messages": CONVS[0], "temperature": -1}).encode(), "temperature"),
    (json.dumps({"messages": CONVS[0], "n": 3}).encode(), "n=1"),
    (json.dumps({"messages": CONVS[0], "stop": 5}).encode(), "stop"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(served, direct, body, needle):
    _, _, _, url = served
    status, text, _ = _post(url, body, raw=True)
    assert status == 400, text
    err = json.loads(text)["error"]
    assert err["type"] == "invalid_request_error" and needle in err["message"]
    assert _get(url, "/health")["status"] == "ok"


def test_unknown_route_is_404_and_a_good_request_still_works(served, direct):
    _, _, _, url = served
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(url + "/v2/nothing", timeout=30)
    assert e.value.code == 404 and "error" in json.loads(e.value.read())
    status, body, _ = _post(url, {"messages": CONVS[3]})
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == direct[3].text


def test_models_and_health(served):
    _, policy, server, url = served
    models = _get(url, "/v1/models")
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [policy.name]
    health = _get(url, "/health")
    assert health["status"] == "ok" and health["model"] == policy.name
    assert {"batches", "requests", "max_batch"} <= set(health)


def test_parse_clamps_max_tokens_and_defaults():
    body = json.dumps({"messages": CONVS[0], "max_tokens": 10_000}).encode()
    req = serving.parse_chat_request(body, max_new_tokens=32, default_temperature=0.7)
    assert req.max_tokens == 32 and req.temperature == 0.7 and req.seed is None
    req = serving.parse_chat_request(json.dumps({"messages": CONVS[0], "stop": "x"}).encode(),
                                     max_new_tokens=32)
    assert req.max_tokens == 32 and req.stop == ("x",) and req.stream is False


def test_text_pieces_concatenate_to_the_text(served):
    tok = served[1].tokenizer
    ids = tok("héllo 日本 wörld", add_special_tokens=False)["input_ids"]
    text = tok.decode(ids)
    pieces = serving.text_pieces(text, ids, tok)
    assert "".join(pieces) == text and len(pieces) > 1
    assert all("\ufffd" not in p for p in pieces)


class _FailingPolicy:
    name = "failing"

    def __init__(self):
        self.calls = 0

    def complete(self, conversations, *, seed=0, max_new_tokens=None, temperature=None):
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("device on fire")
        return [Completion(text="fine", prompt_tokens=1, completion_tokens=1)
                for _ in conversations]


def test_a_failing_batch_gives_500_and_the_server_survives():
    server, thread, url = serving.start_server(_FailingPolicy(), batch_window_ms=1,
                                               max_new_tokens=4)
    try:
        status, body, _ = _post(url, {"messages": CONVS[0]})
        assert status == 500 and "device on fire" in json.loads(body)["error"]["message"]
        status, body, _ = _post(url, {"messages": CONVS[0]})
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == "fine"
    finally:
        serving.shutdown(server, thread)
    assert not thread.is_alive()
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=5)


def test_shutdown_of_a_server_that_never_served():
    server = serving.PolicyServer(("127.0.0.1", 0), _FailingPolicy())
    done = threading.Event()
    threading.Thread(target=lambda: (server.close(), done.set()), daemon=True).start()
    assert done.wait(10), "close() hung"


def test_cli_serves_health(served):
    workdir = served[0]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "launch", "serve.py"), f"--run={workdir}",
         "--port=0", "--max_new_tokens=4", "--batch_window_ms=5"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline, line = time.time() + 240, ""
        while time.time() < deadline and "http://" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                pytest.fail(f"serve.py exited {proc.returncode}: {proc.stderr.read()[-2000:]}")
        url = line.split(" at ", 1)[1].split()[0]
        health = _get(url, "/health")
        assert health["status"] == "ok" and health["model"] == "run@1"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
