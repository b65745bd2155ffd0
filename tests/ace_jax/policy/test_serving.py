"""ace_jax/policy/serving.py without a model: request validation, a sample's text while it is decoded
(stop strings, EOS, budget, streamed pieces) and the batcher's sample budget. The server over
HTTP with a real policy is tested in tests/launch/test_serve.py."""
import json
import threading

import pytest

from ace_jax.policy import batching, openai_api, sample_stream
from ace_jax.policy.interface import Completion
from models import tokenizer as tok_lib
from tests.run_fixture import CORPUS

CONV = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    tok_lib.train_bpe_tokenizer(CORPUS, 300, path)
    return tok_lib.load_tokenizer(path)


def _ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _stream(tokenizer, ids, **kw):
    """(stream, pieces popped after each push)."""
    kw.setdefault("max_tokens", 1000)
    s = sample_stream.SampleStream(tokenizer, **kw)
    pieces = []
    for t in ids:
        s.push(t)
        pieces.append(s.pop_text())
    return s, pieces


# -- parse_chat_request ----------------------------------------------------------------------------

def _parse(**fields):
    return openai_api.parse_chat_request(json.dumps(dict(messages=CONV, **fields)).encode(),
                                         max_new_tokens=32, max_n=8)


def test_parse_defaults():
    req = _parse()
    assert (req.max_tokens, req.temperature, req.seed, req.n, req.stop, req.stream) == \
        (32, 0.0, None, 1, (), False)
    req = _parse(max_completion_tokens=5, n=8, stop="x", temperature=0.5, seed=3)
    assert (req.max_tokens, req.n, req.stop, req.temperature, req.seed) == (5, 8, ("x",), 0.5, 3)


def test_max_tokens_above_the_limit_is_refused_not_clamped():
    for key in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai_api.RequestError, match=f"{key} is too large: 33.*at most 32") as e:
            _parse(**{key: 33})
        assert e.value.status == 400 and e.value.param == key
    assert _parse(max_tokens=32).max_tokens == 32


@pytest.mark.parametrize("n", [0, -1, 9, "2", 2.0, True])
def test_bad_n_is_refused(n):
    with pytest.raises(openai_api.RequestError, match="'n' must be an integer from 1 to 8") as e:
        _parse(n=n)
    assert e.value.param == "n"


# -- SampleStream ----------------------------------------------------------------------------------

def test_a_stop_string_ends_the_sample_at_the_token_that_completes_it(tokenizer):
    text = "import numpy as np\nimport pandas as pd\n"
    ids = _ids(tokenizer, text)
    stop = "as pd"
    k = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    s, pieces = _stream(tokenizer, ids + ids, stop=("zzz", stop))
    assert s.finish_reason == "stop" and s.token_ids == ids[:k]
    assert s.text == text[:text.find(stop)] == "".join(pieces)
    c = s.completion(prompt_tokens=7)
    assert (c.completion_tokens, c.prompt_tokens, c.finish_reason, c.text) == (k, 7, "stop", s.text)


def test_pieces_hold_back_what_could_begin_a_stop_string(tokenizer):
    text = "print('VALIDATION_METRIC: 0.5')\n"
    ids = _ids(tokenizer, text)
    s, pieces = _stream(tokenizer, ids, stop=("VALIDATION_X",))
    assert s.finish_reason is None and "".join(pieces) == text
    prefixes = [tokenizer.decode(ids[:k + 1]) for k in range(len(ids))]
    at_v = next(k for k, t in enumerate(prefixes) if t.endswith("('V"))
    at_m = next(k for k, t in enumerate(prefixes) if t.endswith("VALIDATION_M"))
    assert pieces[at_v - 1].endswith("('") and set(pieces[at_v:at_m]) == {""}
    assert pieces[at_m] == "VALIDATION_M"


def test_a_held_back_tail_is_text_once_the_sample_ends(tokenizer):
    eos = _eos(tokenizer)
    s, pieces = _stream(tokenizer, _ids(tokenizer, "print('VALID") + [eos], stop=("VALIDATION_X",),
                        eos_ids=(eos,))
    assert s.finish_reason == "stop" and pieces[-2:] == ["", "VALID"]
    assert "".join(pieces) == s.text == "print('VALID"


def _eos(tokenizer):
    return tokenizer.convert_tokens_to_ids(tok_lib.IM_END)


def test_eos_is_counted_without_text_and_later_tokens_are_ignored(tokenizer):
    ids = _ids(tokenizer, "print(x)")
    eos = _eos(tokenizer)
    s, pieces = _stream(tokenizer, ids + [eos] + ids, eos_ids=(eos,))
    assert s.finish_reason == "stop" and s.token_ids == ids + [eos]
    assert s.text == "print(x)" == "".join(pieces)
    assert s.completion(0).completion_tokens == len(ids) + 1


def test_the_budget_ends_the_sample_with_length(tokenizer):
    ids = _ids(tokenizer, "import numpy as np\n")
    s, pieces = _stream(tokenizer, ids, max_tokens=3)
    assert s.finish_reason == "length" and s.token_ids == ids[:3]
    assert "".join(pieces) == s.text == tokenizer.decode(ids[:3])
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        sample_stream.SampleStream(tokenizer, max_tokens=0)


def test_pieces_never_split_a_character(tokenizer):
    text = "héllo 日本 wörld"
    ids = _ids(tokenizer, text)
    s, pieces = _stream(tokenizer, ids, max_tokens=len(ids))
    assert s.finish_reason == "length" and "".join(pieces) == s.text == text
    assert all("\ufffd" not in p for p in pieces) and sum(bool(p) for p in pieces) > 3


# -- Batcher --------------------------------------------------------------------------------------

class _RecordingEngine:
    """Each request finishes after ``steps`` engine steps (its choices answered "ok"); records
    the requests (their n) in flight at each step. ``gate`` holds every step until set."""

    def __init__(self, steps: int = 2):
        self.steps = steps
        self.live = {}          # Pending -> steps left
        self.log = []
        self.entered = threading.Event()
        self.gate = threading.Event()

    def add(self, p, seed):
        self.live[p] = self.steps

    def step(self):
        self.entered.set()
        self.gate.wait(30)
        self.log.append(sorted(p.request.n for p in self.live))
        for p in list(self.live):
            self.live[p] -= 1
            if self.live[p] == 0:
                del self.live[p]
                for j in range(p.request.n):
                    p.put("finish", j, Completion(text="ok", completion_tokens=1))
                p.put("done")

    def abort(self):
        self.live.clear()


def _request(n):
    return openai_api.ChatRequest(messages=CONV, max_tokens=4, temperature=0.0, n=n)


def _answered(p):
    events = [p.events.get(timeout=30) for _ in range(p.request.n + 1)]
    return [e[0] for e in events] == ["finish"] * p.request.n + ["done"]


def test_a_request_that_arrives_mid_decode_joins_at_the_next_step():
    """Continuous admission: B arrives while A's first step runs and is decoded beside A from
    the second step on; nothing waits for A to finish."""
    engine = _RecordingEngine(steps=2)
    batcher = batching.Batcher(None, window_s=0.0, max_batch_size=4, engine=engine)
    try:
        a = batcher.submit(_request(1))
        assert engine.entered.wait(30)           # A's first step is running
        b = batcher.submit(_request(3))
        engine.gate.set()
        assert _answered(a) and _answered(b)
        assert engine.log == [[1], [1, 3], [3]]
        assert batcher.stats() == {"steps": 3, "requests": 2, "samples": 4, "max_batch": 2}
        with pytest.raises(openai_api.RequestError, match="at most 4 samples"):
            batcher.submit(_request(5))
    finally:
        batcher.close()


def test_the_window_lets_an_idle_server_start_requests_together():
    engine = _RecordingEngine(steps=1)
    engine.gate.set()
    batcher = batching.Batcher(None, window_s=30.0, max_batch_size=4, engine=engine)
    try:
        pending = [batcher.submit(_request(n)) for n in (1, 2)]
        # the window ends only at close (its stop mark): both start in the first step
        batcher.close(timeout_s=30)
        assert all(_answered(p) for p in pending) and engine.log == [[1, 2]]
    finally:
        batcher.close()


def test_a_reply_is_counted_before_its_client_sees_done():
    """The counters are read by whoever got a reply: they already include it, even while the
    engine has not returned yet (here: it stays inside its step after putting "done")."""
    engine, leave = _RecordingEngine(steps=1), threading.Event()
    engine.gate.set()
    inner = engine.step

    def step():
        inner()
        leave.wait(30)                # still stepping after the request got "done"

    engine.step = step
    batcher = batching.Batcher(None, window_s=0.0, max_batch_size=4, engine=engine)
    try:
        p = batcher.submit(_request(2))
        assert _answered(p)
        assert batcher.stats() == {"steps": 1, "requests": 1, "samples": 2, "max_batch": 1}
    finally:
        leave.set()
        batcher.close()


def test_close_answers_what_was_queued_and_refuses_what_comes_later():
    engine = _RecordingEngine(steps=1)
    batcher = batching.Batcher(None, window_s=0.0, max_batch_size=2, engine=engine)
    running = batcher.submit(_request(1))
    assert engine.entered.wait(30)
    queued = batcher.submit(_request(2))
    threading.Timer(0.3, engine.gate.set).start()
    batcher.close(timeout_s=30)
    for p in (running, queued):
        assert _answered(p)
    kind, err = batcher.submit(_request(1)).events.get(timeout=5)
    assert kind == "error" and err.status == 503 and "shutting down" in str(err)


def test_close_fails_the_queue_when_the_engine_is_stuck():
    engine = _RecordingEngine(steps=1)
    batcher = batching.Batcher(None, window_s=0.0, max_batch_size=2, engine=engine)
    running = batcher.submit(_request(1))
    assert engine.entered.wait(30)
    queued = batcher.submit(_request(2))
    batcher.close(timeout_s=0.2)                 # the worker is still inside the engine
    kind, err = queued.events.get(timeout=5)
    assert kind == "error" and err.status == 503
    engine.gate.set()                            # the request in flight still gets its reply
    assert _answered(running)


def test_a_failing_step_fails_the_requests_in_flight_and_the_next_ones_are_served():
    engine = _RecordingEngine(steps=1)
    engine.gate.set()
    inner, calls = engine.step, []

    def step():
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("device on fire")
        inner()

    engine.step = step
    batcher = batching.Batcher(None, window_s=0.0, max_batch_size=2, engine=engine)
    try:
        kind, err = batcher.submit(_request(2)).events.get(timeout=30)
        assert kind == "error" and err.status == 500 and "device on fire" in str(err)
        assert engine.live == {}                 # aborted
        assert _answered(batcher.submit(_request(1)))
    finally:
        batcher.close()
