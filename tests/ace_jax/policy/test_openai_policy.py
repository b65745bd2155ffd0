"""ace_jax.policy.openai_policy: OpenAIPolicy against real stdlib HTTP servers that time out,
return garbage or fail."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from ace_jax.policy.interface import Completion
from ace_jax.policy.openai_policy import OpenAIPolicy

CONV = [{"role": "user", "content": "print the metric"}]


class _Stub:
    """A stdlib HTTP server whose POST handler is ``behaviour(hit_number, handler)``."""

    def __init__(self, behaviour):
        self.hits, self.bodies, self.headers = 0, [], []
        self._lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with stub._lock:
                    stub.hits += 1
                    n = stub.hits
                    stub.bodies.append(json.loads(body))
                    stub.headers.append(dict(self.headers))
                try:
                    behaviour(n, self)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _send(handler, status: int, body: bytes, ctype="application/json"):
    handler.send_response(status)
    handler.send_header("Content-Type", ctype)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def _ok(text="hello", **usage):
    return json.dumps({"id": "x", "object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3, **usage}}).encode()


@pytest.fixture
def stub():
    made = []

    def make(behaviour):
        s = _Stub(behaviour)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def _client(url, **kw):
    kw.setdefault("retries", 1)
    kw.setdefault("backoff_s", 0.01)
    kw.setdefault("timeout_s", 5.0)
    return OpenAIPolicy(url, model="m", **kw)


def test_openai_policy_parses_a_reply_and_sends_the_request(stub):
    s = stub(lambda n, h: _send(h, 200, _ok("hi there")))
    c = _client(s.url, api_key="sk-test", max_tokens=17, temperature=0.5).complete_one(CONV, seed=4)
    assert c == Completion(text="hi there", prompt_tokens=7, completion_tokens=3,
                           finish_reason="length")
    assert s.hits == 1
    assert s.bodies[0] == {"model": "m", "messages": CONV, "max_tokens": 17, "temperature": 0.5,
                           "seed": 4}
    assert s.headers[0]["Authorization"] == "Bearer sk-test"


def test_openai_policy_timeout_is_an_error_after_retries(stub):
    s = stub(lambda n, h: (time.sleep(1.0), _send(h, 200, _ok())))
    t0 = time.monotonic()
    c = _client(s.url, timeout_s=0.3, retries=1).complete_one(CONV)
    assert not c.ok and "timeout" in c.error and c.text == "" and c.finish_reason == "error"
    assert s.hits == 2 and time.monotonic() - t0 < 3


@pytest.mark.parametrize("body", [b"not json at all", b"[1, 2]", b'{"choices": []}',
                                  b'{"choices": [{"message": {"content": null}}]}',
                                  b'{"choices": [{"message": "x"}], "usage": []}',
                                  b"\xff\xfe garbage"])
def test_openai_policy_malformed_response(stub, body):
    s = stub(lambda n, h: _send(h, 200, body))
    c = _client(s.url, retries=2).complete_one(CONV)
    assert not c.ok and c.error.startswith("malformed response"), c.error
    assert s.hits == 3


def test_openai_policy_http_500_is_retried_then_reported(stub):
    s = stub(lambda n, h: _send(h, 500, b'{"error": {"message": "boom"}}'))
    c = _client(s.url, retries=2).complete_one(CONV)
    assert not c.ok and "HTTP 500" in c.error and "boom" in c.error
    assert s.hits == 3


def test_openai_policy_retry_recovers(stub):
    s = stub(lambda n, h: _send(h, 503, b"busy") if n == 1 else _send(h, 200, _ok("second")))
    c = _client(s.url, retries=1).complete_one(CONV)
    assert c.ok and c.text == "second" and s.hits == 2


def test_openai_policy_client_error_is_not_retried(stub):
    s = stub(lambda n, h: _send(h, 400, b'{"error": {"message": "bad messages"}}'))
    c = _client(s.url, retries=3).complete_one(CONV)
    assert not c.ok and "HTTP 400" in c.error and s.hits == 1


def test_openai_policy_connection_dropped_is_an_error(stub):
    def drop(n, h):
        h.close_connection = True
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"cho")  # cut short

    s = stub(drop)
    c = _client(s.url, retries=1).complete_one(CONV)
    assert not c.ok and s.hits == 2


def test_openai_policy_unreachable(stub):
    s = stub(lambda n, h: None)
    url = s.url
    s.close()
    c = _client(url, retries=0).complete_one(CONV)
    assert not c.ok and c.error.startswith("unreachable")


def test_openai_policy_complete_keeps_order_and_seeds_under_concurrency(stub):
    def reply(n, h):
        seed = s.bodies[n - 1]["seed"]
        time.sleep(0.05 * (5 - seed))  # later seeds answer first
        _send(h, 200, _ok(f"seed {seed}"))

    s = stub(reply)
    out = _client(s.url, max_concurrency=4).complete([CONV] * 4, seed=1)
    assert [c.text for c in out] == ["seed 1", "seed 2", "seed 3", "seed 4"]
    assert s.hits == 4
