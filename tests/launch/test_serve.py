"""The OpenAI-compatible server (ace_jax/policy/serving.py, launch/serve.py) over real HTTP on localhost,
in front of a JaxPolicy restored from a tiny run directory: the replies, n samples, stop strings
that end decoding, streaming as decoded, refused requests, and the official openai SDK."""
import dataclasses
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

from ace_jax.policy import engines, openai_api, sample_stream, serving
from ace_jax.policy.interface import Completion
from ace_jax.policy.openai_policy import OpenAIPolicy
from ace_jax.policy.policy import JaxPolicy
from ace_jax.runtime import generate
from tests.run_fixture import make_tiny_run

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_TOKENS = 8
CHUNK = 3   # decode steps between host checks: 8 tokens take chunks of 3, 3 and 2
CONVS = [[{"role": "user", "content": f"task {i}: print the metric"}] for i in range(4)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(workdir, policy, server, url): a server with a generous batch window (a loaded CI
    machine may take a while to start 4 client threads)."""
    workdir = str(tmp_path_factory.mktemp("serve") / "run")
    make_tiny_run(workdir)
    policy = JaxPolicy.from_run(workdir, max_new_tokens=MAX_TOKENS)
    server, thread, url = serving.start_server(policy, "127.0.0.1", 0, batch_window_ms=1000,
                                               decode_chunk_tokens=CHUNK)
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
    assert not any(t.is_alive() for t in threads), "a request got no reply in 300 s"
    after = server.stats()
    for (status, body, _), want in zip(results, direct):
        assert status == 200, body
        assert json.loads(body)["choices"][0]["message"]["content"] == want.text
    assert after["requests"] - before["requests"] == 4
    # together: the steps of the longest reply (<= ceil(8 / CHUNK) = 3), not >= 1 per request
    assert after["steps"] - before["steps"] < 4, (before, after)
    assert after["max_batch"] >= 2


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


def _stop_inside(text: str) -> str:
    """A 3-character ASCII piece of ``text`` after its first character (the stop string of the
    tests: it occurs in the greedy reply, not at its start)."""
    m = re.search(r"[A-Za-z0-9_ ]{3}", text[1:])
    assert m, f"no ASCII piece in {text!r}"
    return m.group(0)


def _tokens_until(tokenizer, ids, stop):
    """The number of leading tokens of ``ids`` whose text first contains ``stop``."""
    return next(k for k in range(1, len(ids) + 1)
                if stop in tokenizer.decode(ids[:k], skip_special_tokens=True))


def test_stop_strings_end_decoding_and_count_the_tokens_generated(served, direct):
    _, policy, _, url = served
    want = direct[1]
    stop = _stop_inside(want.text)
    k = _tokens_until(policy.tokenizer, want.token_ids, stop)
    status, body, _ = _post(url, {"messages": CONVS[1], "stop": ["never-there", stop]})
    data = json.loads(body)
    choice = data["choices"][0]
    assert status == 200 and choice["message"]["content"] == want.text[:want.text.find(stop)]
    assert choice["finish_reason"] == "stop"
    assert data["usage"]["completion_tokens"] == k < want.completion_tokens
    chunks = _stream(url, {"messages": CONVS[1], "stop": stop})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == choice["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "stop"


def _generate_group(policy, conv, *, seed, n, temperature):
    """The texts and token counts of Generator.generate([prompt], key(seed), group_size=n): the
    static generator, the oracle of the engine."""
    sampling = dataclasses.replace(policy.sampling, max_new_tokens=MAX_TOKENS, group_size=n,
                                   temperature=temperature)
    out = generate.Generator(policy.model, sampling).generate(
        [policy.encode(conv)[0]], jax.random.key(seed))
    tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
    return [(policy.tokenizer.decode(tokens[j, :lengths[j]].tolist(), skip_special_tokens=True),
             int(lengths[j])) for j in range(n)]


def test_n_samples_of_one_prompt_reproduce_the_generator_group(served):
    _, policy, _, url = served
    want = _generate_group(policy, CONVS[2], seed=7, n=3, temperature=1.0)
    status, body, _ = _post(url, {"messages": CONVS[2], "n": 3, "seed": 7, "temperature": 1.0})
    data = json.loads(body)
    assert status == 200 and [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert [(c["message"]["content"]) for c in data["choices"]] == [t for t, _ in want]
    assert len({t for t, _ in want}) > 1                   # three samples, not one three times
    u = data["usage"]
    assert u["completion_tokens"] == sum(n for _, n in want)
    assert u["prompt_tokens"] == len(policy.encode(CONVS[2])[0])
    chunks = _stream(url, {"messages": CONVS[2], "n": 3, "seed": 7, "temperature": 1.0})
    texts = ["".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                     if c["choices"] and c["choices"][0]["index"] == j) for j in range(3)]
    assert texts == [t for t, _ in want]


def test_the_engine_matches_the_generator_on_the_accelerator_cache_layout(served):
    """A model whose code paths are the GPU's (platform="gpu") keeps its KV cache in the
    "standard" layout of TPU / GPU, also on CPU: the policy's engine samples the groups of
    Generator.generate, token for token."""
    from flax import nnx

    from models import configs as model_configs, qwen3
    from tests.run_fixture import MODEL_OVERRIDES

    tokenizer = served[1].tokenizer
    cfg = model_configs.get_model_config("tiny_moe", **dict(
        MODEL_OVERRIDES, vocab_size=len(tokenizer), platform="gpu"))
    policy = JaxPolicy(qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(1)), tokenizer,
                       max_new_tokens=MAX_TOKENS, slots=4)
    assert generate.cache_layout(cfg) == "standard"
    sampling = dataclasses.replace(policy.sampling, group_size=2, temperature=1.0)
    prompts = [policy.encode(c)[0] for c in CONVS[:3]]
    want = generate.Generator(policy.model, sampling).generate(prompts, jax.random.key(5))
    got = policy.engine.generate(prompts, jax.random.key(5), sampling)
    np.testing.assert_array_equal(got.tokens, np.asarray(want.tokens))
    np.testing.assert_array_equal(got.lengths, np.asarray(want.lengths))


def _drain(pending) -> list:
    out = []
    while not pending.events.empty():
        out.append(pending.events.get_nowait())
    return out


def test_the_engine_hands_out_text_step_by_step(served, direct):
    """JaxEngine.step puts each request's new text on its queue after every engine step of
    CHUNK tokens; a request abandoned on the way stops there (its slot freed), the others
    finish with what the policy gives."""
    policy = served[1]
    engine = engines.JaxEngine(policy, slots=4, max_new_tokens=MAX_TOKENS, sync_every=CHUNK)
    group = [engines.Pending(openai_api.ChatRequest(messages=c, max_tokens=MAX_TOKENS,
                                                    temperature=0.0)) for c in CONVS]
    for p in group:
        engine.add(p, seed=None)
    engine.step()
    first = [_drain(p) for p in group]
    assert all(ev and {e[0] for e in ev} == {"delta"} for ev in first), first
    group[0].cancelled = True
    for _ in range(MAX_TOKENS):
        if all(p.closed for p in group):
            break
        engine.step()
    events = [ev + _drain(p) for ev, p in zip(first, group)]
    assert [e[0] for e in events[0]][-1] == "done" and "finish" not in [e[0] for e in events[0]]
    for ev, want in zip(events[1:], direct[1:]):
        (fin,) = [e[2] for e in ev if e[0] == "finish"]
        assert "".join(e[2] for e in ev if e[0] == "delta") == fin.text == want.text
        assert (fin.completion_tokens, fin.finish_reason) == (want.completion_tokens,
                                                             want.finish_reason)
        assert ev[-1] == ("done",)
    assert engine.engine._requests == {} and engine._live == {}


@pytest.mark.parametrize("body,needle", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    (json.dumps({"model": "m"}).encode(), "messages"),
    (json.dumps({"messages": []}).encode(), "messages"),
    (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), "wizard"),
    (json.dumps({"messages": [{"role": "user", "content": [1]}]}).encode(), "content"),
    (json.dumps({"messages": CONVS[0], "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({"messages": CONVS[0], "temperature": -1}).encode(), "temperature"),
    (json.dumps({"messages": CONVS[0], "n": 0}).encode(), "'n' must be"),
    (json.dumps({"messages": CONVS[0], "n": 33}).encode(), "from 1 to 32"),
    (json.dumps({"messages": CONVS[0], "max_tokens": MAX_TOKENS + 1}).encode(),
     f"at most {MAX_TOKENS} completion tokens"),
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
    assert {"steps", "requests", "max_batch"} <= set(health)


def test_text_pieces_concatenate_to_the_text(served):
    tok = served[1].tokenizer
    ids = tok("héllo 日本 wörld", add_special_tokens=False)["input_ids"]
    text = tok.decode(ids)
    pieces = sample_stream.text_pieces(text, ids, tok)
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


class _ErrorReplyPolicy:
    """A policy that cannot answer conversations mentioning "boom" (an OpenAIPolicy whose
    upstream failed gives such Completions)."""
    name = "flaky"

    def complete(self, conversations, *, seed=0, max_new_tokens=None, temperature=None):
        return [Completion(text="", error="upstream timeout", finish_reason="error")
                if "boom" in c[0]["content"] else Completion(text="fine", completion_tokens=1)
                for c in conversations]


def test_a_reply_with_an_error_gives_500_and_the_others_are_answered():
    server, thread, url = serving.start_server(_ErrorReplyPolicy(), batch_window_ms=1,
                                               max_new_tokens=4)
    try:
        status, body, _ = _post(url, {"messages": [{"role": "user", "content": "boom"}]})
        assert status == 500 and "upstream timeout" in json.loads(body)["error"]["message"]
        status, body, _ = _post(url, {"messages": CONVS[0], "n": 2})
        assert status == 200 and [c["message"]["content"]
                                  for c in json.loads(body)["choices"]] == ["fine", "fine"]
    finally:
        serving.shutdown(server, thread)


class _GatedEngine:
    """Hands out "hello" at a request's first step, then waits for ``gate`` at its second before
    " world" (or, with ``fail``, raises): a client that gets "hello" while the engine waits got
    it as it was decoded."""

    def __init__(self, fail: bool = False):
        self.gate = threading.Event()
        self.fail = fail
        self.started = {}        # Pending -> whether "hello" went out

    def add(self, p, seed):
        self.started[p] = False

    def step(self):
        if not all(self.started.values()):
            for p in self.started:
                p.put("delta", 0, "hello")
                self.started[p] = True
            return
        self.gate.wait(60)
        if self.fail:
            raise RuntimeError("device on fire")
        for p in self.started:
            p.put("delta", 0, " world")
            p.put("finish", 0, Completion(text="hello world", prompt_tokens=3,
                                          completion_tokens=2))
            p.put("done")
        self.started.clear()

    def abort(self):
        self.started.clear()


def _open_stream(url):
    host, port = url[len("http://"):].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(
        {"messages": CONVS[0], "stream": True}), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _next_data(resp) -> str:
    while True:
        line = resp.readline().decode()
        if not line:
            return ""
        if line.startswith("data: "):
            return line[len("data: "):].strip()


def test_stream_chunks_are_sent_as_they_are_decoded():
    engine = _GatedEngine()
    server, thread, url = serving.start_server(_FailingPolicy(), batch_window_ms=1,
                                               max_new_tokens=4, engine=engine)
    try:
        conn, resp = _open_stream(url)
        assert json.loads(_next_data(resp))["choices"][0]["delta"]["role"] == "assistant"
        first = json.loads(_next_data(resp))["choices"][0]["delta"]["content"]
        assert first == "hello" and not engine.gate.is_set()   # the engine is still decoding
        engine.gate.set()
        rest = [_next_data(resp) for _ in range(3)]
        assert json.loads(rest[0])["choices"][0]["delta"]["content"] == " world"
        assert json.loads(rest[1])["choices"][0]["finish_reason"] == "stop"
        assert rest[2] == "[DONE]"
        conn.close()
    finally:
        serving.shutdown(server, thread)


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_serving_goes_on():
    engine = _GatedEngine(fail=True)
    server, thread, url = serving.start_server(_FailingPolicy(), batch_window_ms=1,
                                               max_new_tokens=4, engine=engine)
    try:
        conn, resp = _open_stream(url)
        _next_data(resp)
        assert json.loads(_next_data(resp))["choices"][0]["delta"]["content"] == "hello"
        engine.gate.set()
        err = json.loads(_next_data(resp))["error"]
        assert err["type"] == "server_error" and "device on fire" in err["message"]
        assert _next_data(resp) == ""                        # and the stream ends there
        conn.close()
        engine.fail = False
        status, body, _ = _post(url, {"messages": CONVS[0]})
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == \
            "hello world"
    finally:
        serving.shutdown(server, thread)


def test_a_client_that_leaves_mid_stream_does_not_stop_the_server():
    engine = _GatedEngine()
    server, thread, url = serving.start_server(_FailingPolicy(), batch_window_ms=1,
                                               max_new_tokens=4, engine=engine)
    try:
        host, port = url[len("http://"):].split(":")
        body = json.dumps({"messages": CONVS[0], "stream": True}).encode()
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                         b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
            received = b""
            while b"hello" not in received:
                data = sock.recv(4096)
                assert data, received
                received += data
        engine.gate.set()            # the client is gone before the reply is complete
        status, body, _ = _post(url, {"messages": CONVS[0]})
        assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == \
            "hello world"
        assert _get(url, "/health")["status"] == "ok"
    finally:
        serving.shutdown(server, thread)


def test_the_openai_sdk_talks_to_the_server(served):
    openai = pytest.importorskip("openai")
    _, policy, _, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    want = _generate_group(policy, CONVS[2], seed=7, n=3, temperature=1.0)
    reply = client.chat.completions.create(model="any", messages=CONVS[2], n=3, seed=7,
                                           temperature=1.0, max_tokens=MAX_TOKENS)
    assert [c.message.content for c in reply.choices] == [t for t, _ in want]
    assert reply.usage.completion_tokens == sum(n for _, n in want)
    texts = {}
    finish = {}
    for chunk in client.chat.completions.create(model="any", messages=CONVS[2], n=3, seed=7,
                                                temperature=1.0, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert [texts[j] for j in range(3)] == [t for t, _ in want]
    assert all(finish[j] in ("stop", "length") for j in range(3))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=CONVS[0],
                                       max_tokens=MAX_TOKENS + 1)
    assert e.value.status_code == 400 and "too large" in str(e.value)
    assert client.models.list().data[0].id == policy.name


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
        # The checkpoint was restored through Orbax, which logs at INFO: none of it shows.
        info = [ln for ln in proc.stderr.read().splitlines() if re.match(r"I\d{4} ", ln)]
        assert info == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
