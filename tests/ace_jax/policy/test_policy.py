"""ace_jax.policy.policy: JaxPolicy.from_run against a real tiny run directory, and OpenAIPolicy against
real stdlib HTTP servers that time out, return garbage or fail."""
import json
import os
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
from flax import nnx
import pytest

from ace_jax.policy.policy import (Completion, JaxPolicy, load_run_model, OpenAIPolicy, PolicyError,
                                   read_run_config)
from ace_jax.runtime import checkpoint as ckpt_lib
from models.qwen3 import flat_params
from tests.run_fixture import make_tiny_run

CONV = [{"role": "user", "content": "print the metric"}]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("policy") / "run")
    model, tokenizer = make_tiny_run(workdir)
    return workdir, model, tokenizer


def _copy_run(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


# ----------------------------------------------------------------------------------- JaxPolicy


def test_from_run_restores_exactly_the_saved_weights(tiny_run):
    workdir, model, tokenizer = tiny_run
    policy = JaxPolicy.from_run(workdir, max_new_tokens=4)
    assert policy.name == "run@1"
    saved, restored = flat_params(model), flat_params(policy.model)
    assert saved.keys() == restored.keys()
    for k in saved:
        np.testing.assert_array_equal(np.asarray(restored[k]), np.asarray(saved[k]), err_msg=k)
    assert len(policy.tokenizer) == len(tokenizer)
    out = policy.complete([CONV])
    assert len(out) == 1 and out[0].ok and out[0].completion_tokens == len(out[0].token_ids) <= 4
    assert out[0].prompt_tokens == len(policy.encode(CONV)[0])


def test_checkpoint_of_another_model_size_raises_mismatch(tiny_run, tmp_path):
    workdir = _copy_run(tiny_run[0], tmp_path / "run")
    path = os.path.join(workdir, "config.json")
    cfg = json.load(open(path))
    cfg["model"]["overrides"]["hidden_size"] = 64
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match="hidden|embed|64|32"):
        load_run_model(workdir)


def test_missing_run_dir_and_config_raise_policy_error(tmp_path):
    with pytest.raises(PolicyError, match="does not exist"):
        JaxPolicy.from_run(str(tmp_path / "nope"))
    with pytest.raises(PolicyError, match="no config.json"):
        JaxPolicy.from_run(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PolicyError, match="unreadable"):
        JaxPolicy.from_run(str(tmp_path))
    (tmp_path / "config.json").write_text('{"agent": {}}')
    with pytest.raises(PolicyError, match="no 'model' section"):
        read_run_config(tmp_path)
    (tmp_path / "config.json").write_text('{"model": {"d": 1}, "agent": {}}')
    assert read_run_config(tmp_path) == {"model": {"d": 1}, "agent": {}}


def test_no_checkpoint_or_absent_step_raises_policy_error(tiny_run, tmp_path):
    workdir = _copy_run(tiny_run[0], tmp_path / "run")
    with pytest.raises(PolicyError, match=r"no checkpoint of step 7 .*have \[1\]"):
        load_run_model(workdir, step=7)
    shutil.rmtree(os.path.join(workdir, "checkpoints"))
    with pytest.raises(PolicyError, match="no checkpoint"):
        load_run_model(workdir)
    assert not os.path.exists(os.path.join(workdir, "checkpoints")), "must not create it"
    os.makedirs(os.path.join(workdir, "checkpoints"))
    with pytest.raises(PolicyError, match="no checkpoint"):
        load_run_model(workdir)


def test_newest_complete_checkpoint_is_used_when_a_newer_one_is_unfinished(tiny_run, tmp_path):
    workdir = _copy_run(tiny_run[0], tmp_path / "run")
    ckpts = os.path.join(workdir, "checkpoints")
    shutil.copytree(os.path.join(ckpts, "1"), os.path.join(ckpts, "2"))
    os.remove(os.path.join(ckpts, "2", ckpt_lib.COMMIT_MARKER))
    _, _, step = load_run_model(workdir)
    assert step == 1
    with pytest.raises(ckpt_lib.CheckpointCorruptError):
        load_run_model(workdir, step=2)


def test_run_started_from_another_run_uses_that_runs_model_and_tokenizer(tiny_run, tmp_path):
    """A run with model.init_from_run trains the parent's model with the parent's tokenizer,
    whatever its own model.preset says (as Trainer._build_model / _load_tokenizer do)."""
    parent, model, _ = tiny_run
    child = _copy_run(parent, tmp_path / "child")
    shutil.rmtree(os.path.join(child, "tokenizer"))
    path = os.path.join(child, "config.json")
    cfg = json.load(open(path))
    cfg["model"].update(init_from_run=parent, preset="qwen3_0_6b", overrides={})
    json.dump(cfg, open(path, "w"))
    restored, tokenizer, step = load_run_model(child)
    assert step == 1 and restored.config == model.config
    np.testing.assert_array_equal(np.asarray(flat_params(restored)["norm/scale"]),
                                  np.asarray(flat_params(model)["norm/scale"]))


def test_a_run_restores_straight_into_the_placements_shardings(tiny_run):
    """``model.init_from_run`` on a mesh: every parameter comes back already sharded as the
    placement says (no copy on one device first), with the saved values."""
    import jax

    from ace_jax.runtime import placement as placement_lib, sharding

    workdir, model, _ = tiny_run
    cfg = sharding.default_config()
    cfg.fsdp, cfg.expert = 4, 2
    place = placement_lib.Placement.from_config(cfg)
    restored, _, _ = load_run_model(workdir, shardings=place.params)
    want = place.params(nnx.state(restored, nnx.Param))
    got = nnx.state(restored, nnx.Param)
    saved = flat_params(model)
    sharded = 0
    for (path, leaf), (_, sh) in zip(jax.tree_util.tree_leaves_with_path(got),
                                     jax.tree_util.tree_leaves_with_path(want)):
        assert leaf.sharding == sh, path
        sharded += len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
    assert sharded > 0
    for k, v in flat_params(restored).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(saved[k]), err_msg=k)


def test_run_of_an_hf_model_reads_only_its_config(tiny_run, tmp_path):
    """model.hf_path: the architecture comes from the HF config.json; no HF weights are read."""
    from models import hf_mapping

    parent, model, _ = tiny_run
    hf_dir = hf_mapping.export_hf(model, model.config, tmp_path / "hf", dtype="float32")
    for f in hf_dir.glob("model*.safetensors*"):
        f.unlink()  # weights are not needed, only config.json
    workdir = _copy_run(parent, tmp_path / "run")
    path = os.path.join(workdir, "config.json")
    cfg = json.load(open(path))
    cfg["model"].update(hf_path=str(hf_dir), runtime={"moe_dispatch": "dense"})
    json.dump(cfg, open(path, "w"))
    restored, _, _ = load_run_model(workdir)
    assert restored.config.moe_dispatch == "dense"
    assert restored.config.replace(moe_dispatch=model.config.moe_dispatch) == model.config
    np.testing.assert_array_equal(np.asarray(flat_params(restored)["norm/scale"]),
                                  np.asarray(flat_params(model)["norm/scale"]))


def test_missing_tokenizer_raises_policy_error(tiny_run, tmp_path):
    workdir = _copy_run(tiny_run[0], tmp_path / "run")
    shutil.rmtree(os.path.join(workdir, "tokenizer"))
    with pytest.raises(PolicyError, match="no tokenizer"):
        load_run_model(workdir)


# ----------------------------------------------------------------------------------- OpenAIPolicy


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


def test_policy_spec_errors_are_typed():
    from ace_jax.policy import policy

    parse = policy.parse_policy_spec
    assert parse("run:runs/a@7") == ("run", {"workdir": "runs/a", "step": 7})
    assert parse("run:runs/local") == ("run", {"workdir": "runs/local", "step": None})
    assert parse("run:runs/a@b/x@200") == ("run", {"workdir": "runs/a@b/x", "step": 200})
    assert parse("hf:/m/Qwen3") == ("hf", {"path": "/m/Qwen3"})
    assert parse("openai:http://h:8000/v1#qwen") == (
        "openai", {"base_url": "http://h:8000/v1", "model": "qwen"})
    assert parse("openai:https://h/v1")[1]["model"] == "default"
    for bad in ("", "runs/local", "gpt:x", "openai:h/v1#m", "hf:"):
        with pytest.raises(policy.PolicySpecError, match="policy") as info:
            parse(bad)
        assert isinstance(info.value, ValueError) and isinstance(info.value, policy.PolicyError)
        with pytest.raises(policy.PolicySpecError):
            policy.policy_from_spec(bad)


def test_policy_from_spec_builds_an_openai_policy_with_the_given_sampling():
    from ace_jax.policy import policy

    p = policy.policy_from_spec("openai:http://127.0.0.1:9/v1#m", max_new_tokens=7,
                                temperature=0.3)
    assert isinstance(p, OpenAIPolicy)
    assert (p.model, p.max_tokens, p.temperature) == ("m", 7, 0.3)


def test_policy_from_spec_of_a_run_takes_the_runs_sampling(tiny_run):
    from ace_jax.policy import policy

    workdir = tiny_run[0]
    cfg = read_run_config(workdir)
    p = policy.policy_from_spec(f"run:{workdir}", temperature=0.5)
    assert isinstance(p, JaxPolicy) and p.sampling.temperature == 0.5
    assert p.sampling.max_new_tokens == cfg["sampling"]["max_new_tokens"]


def test_jax_policy_is_safe_to_call_from_threads(tiny_run):
    """An evaluation calls the implementer and its advisor (both JAX policies) from episode
    threads; unserialised, calls shared one engine and failed (lost requests, donated buffers
    read after deletion). Each thread gets what a call alone gives."""
    import concurrent.futures

    policy = JaxPolicy.from_run(tiny_run[0], max_new_tokens=6, temperature=1.0)
    convs = [[{"role": "user", "content": f"task {i}: print the metric"}] for i in range(8)]
    alone = [policy.complete([c], seed=i)[0] for i, c in enumerate(convs)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        threaded = list(pool.map(lambda i: policy.complete([convs[i]], seed=i)[0], range(8)))
    assert all(c.ok for c in threaded)
    assert [c.token_ids for c in threaded] == [c.token_ids for c in alone]
