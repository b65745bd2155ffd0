"""ace_jax/policy/serving.py without a model: request validation, a sample's text while it is decoded
(stop strings, EOS, budget, streamed pieces) and the batcher's sample budget. The server over
HTTP with a real policy is tested in tests/launch/test_serve.py."""
import json
import threading

import pytest

from ace_jax.policy import batching, openai_api, sample_stream
from ace_jax.policy.policy import Completion
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
    """Answers every sample with its request's first message; records the groups it got."""

    def __init__(self):
        self.groups = []
        self.entered = threading.Event()
        self.gate = threading.Event()

    def decode(self, group, *, seed, temperature, max_tokens):
        self.entered.set()
        self.gate.wait(30)
        self.groups.append([p.request.n for p in group])
        for p in group:
            for j in range(p.request.n):
                p.put("finish", j, Completion(text="ok", completion_tokens=1))
            p.put("done")
        yield


def _request(n):
    return openai_api.ChatRequest(messages=CONV, max_tokens=4, temperature=0.0, n=n)


def test_batches_hold_at_most_max_batch_size_samples():
    engine = _RecordingEngine()
    engine.gate.set()
    # A long window: every batch below ends because the next request does not fit, not by time.
    batcher = batching.Batcher(None, window_s=30.0, max_batch_size=4, engine=engine)
    try:
        pending = [batcher.submit(_request(n)) for n in (1, 2, 1, 3, 4)]
        for p in pending:
            events = [p.events.get(timeout=30) for _ in range(p.request.n + 1)]
            assert [e[0] for e in events] == ["finish"] * p.request.n + ["done"]
        assert engine.groups == [[1, 2, 1], [3], [4]]
        assert batcher.stats() == {"batches": 3, "requests": 5, "samples": 11, "max_batch": 3}
        with pytest.raises(openai_api.RequestError, match="at most 4 samples"):
            batcher.submit(_request(5))
    finally:
        batcher.close()


def test_a_reply_is_counted_before_its_client_sees_done():
    """The counters are read by whoever got a reply: they already include it, even while the
    engine has not returned yet (here: it stays inside decode after putting "done")."""
    engine, leave = _RecordingEngine(), threading.Event()
    engine.gate.set()
    inner = engine.decode

    def decode(group, **kw):
        yield from inner(group, **kw)
        leave.wait(30)                # still decoding after every request got "done"

    engine.decode = decode
    batcher = batching.Batcher(None, window_s=0.0, max_batch_size=4, engine=engine)
    try:
        p = batcher.submit(_request(2))
        assert [p.events.get(timeout=30)[0] for _ in range(3)] == ["finish", "finish", "done"]
        assert batcher.stats() == {"batches": 1, "requests": 1, "samples": 2, "max_batch": 1}
    finally:
        leave.set()
        batcher.close()


def test_close_answers_what_was_queued_and_refuses_what_comes_later():
    engine = _RecordingEngine()
    batcher = batching.Batcher(None, window_s=0.0, max_batch_size=2, engine=engine)
    running = batcher.submit(_request(1))
    assert engine.entered.wait(30)
    queued = batcher.submit(_request(2))
    threading.Timer(0.3, engine.gate.set).start()
    batcher.close(timeout_s=30)
    for p in (running, queued):
        assert [p.events.get(timeout=5)[0] for _ in range(p.request.n + 1)][-1] == "done"
    kind, err = batcher.submit(_request(1)).events.get(timeout=5)
    assert kind == "error" and err.status == 503 and "shutting down" in str(err)


def test_close_fails_the_queue_when_the_engine_is_stuck():
    engine = _RecordingEngine()
    batcher = batching.Batcher(None, window_s=0.0, max_batch_size=2, engine=engine)
    running = batcher.submit(_request(1))
    assert engine.entered.wait(30)
    queued = batcher.submit(_request(2))
    batcher.close(timeout_s=0.2)                 # the worker is still inside the engine
    kind, err = queued.events.get(timeout=5)
    assert kind == "error" and err.status == 503
    engine.gate.set()                            # the batch in progress still gets its reply
    assert [running.events.get(timeout=30)[0] for _ in range(2)] == ["finish", "done"]
