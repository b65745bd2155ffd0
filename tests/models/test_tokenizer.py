"""Tests for models/tokenizer.py: the Qwen3 chat format, the tiny BPE trainer, the real tokenizer.

The real-tokenizer tests need ``scripts/fetch_qwen3_tokenizer.sh ./cache`` (or
``$ACE_QWEN3_TOKENIZER_DIR``); they are skipped with that reason when it has not been run.
"""
import json

import pytest

from models import tokenizer as T

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Train a model on iris."}],
    "system_user": [
        {"role": "system", "content": "You are an ML engineer."},
        {"role": "user", "content": "Improve the score.\nUse sklearn."},
    ],
    "multi_turn_with_reasoning": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nold reasoning\n</think>\n\nanswer one"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "answer two", "reasoning_content": "\nnew reasoning\n"},
    ],
    "tool_responses": [
        {"role": "user", "content": "run it"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "result A"},
        {"role": "tool", "content": "result B"},
        {"role": "assistant", "content": "<think>r</think>done"},
    ],
    "second_system_and_unicode": [
        {"role": "user", "content": "数字 🙂"},
        {"role": "system", "content": "late system"},
        {"role": "assistant", "content": ""},
    ],
}


# --------------------------------------------------------------------------------------------------
# render_chat on its own (always runs)


def test_render_chat_basic_format():
    text = T.render_chat(CONVERSATIONS["system_user"])
    assert text == (
        "<|im_start|>system\nYou are an ML engineer.<|im_end|>\n"
        "<|im_start|>user\nImprove the score.\nUse sklearn.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert T.render_chat(CONVERSATIONS["system_user"], enable_thinking=True).endswith(
        "<|im_start|>assistant\n"
    )
    assert T.render_chat(CONVERSATIONS["system_user"], add_generation_prompt=False).endswith(
        "Use sklearn.<|im_end|>\n"
    )


def test_render_chat_strips_reasoning_before_last_query_keeps_after():
    text = T.render_chat(CONVERSATIONS["multi_turn_with_reasoning"], add_generation_prompt=False)
    assert "old reasoning" not in text
    assert "<|im_start|>assistant\nanswer one<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n<think>\nnew reasoning\n</think>\n\nanswer two<|im_end|>\n")


def test_render_chat_groups_tool_responses_in_one_user_turn():
    text = T.render_chat(CONVERSATIONS["tool_responses"], add_generation_prompt=False)
    assert (
        "<|im_start|>user\n<tool_response>\nresult A\n</tool_response>\n<tool_response>\nresult B"
        "\n</tool_response><|im_end|>\n" in text
    )


@pytest.mark.parametrize(
    "bad, match",
    [
        ([], "empty"),
        ("hello", "list of dicts"),
        ([{"role": "robot", "content": "x"}], "role 'robot'"),
        ([{"role": "user", "content": 3}], r"messages\[0\].content"),
        ([["user", "x"]], r"messages\[0\] must be a dict"),
    ],
)
def test_render_chat_rejects_bad_messages(bad, match):
    with pytest.raises(T.TokenizerError, match=match):
        T.render_chat(bad)


# --------------------------------------------------------------------------------------------------
# BPE trainer (always runs)

_CORPUS = [
    f"import numpy as np\nfrom sklearn.linear_model import Ridge\n# task {i}: ünïcode 中文\n"
    f"model = Ridge(alpha={i / 10})\nscore = {i * 3} + 1\n"
    for i in range(120)
]


@pytest.fixture(scope="module")
def tiny_tok_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("bpe")
    T.train_bpe_tokenizer(_CORPUS, 320, out)
    return out


def test_bpe_special_tokens_and_layout(tiny_tok_dir):
    tok = T.load_tokenizer(tiny_tok_dir)
    n = len(tok)
    assert 256 + 5 < n <= 320
    ids = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"])
    assert ids == list(range(n - 5, n))  # added after the BPE vocab, Qwen3's order
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    # Each added token is one id, even glued to text; no BOS is prepended.
    enc = tok("x<|im_start|>user\n<think>y</think><|im_end|>").input_ids
    assert enc.count(ids[1]) == 1 and enc.count(ids[3]) == 1 and enc.count(ids[4]) == 1
    assert enc.count(ids[2]) == 1 and enc[0] != ids[0]
    # <think> is kept by skip_special_tokens (as in Qwen3); <|im_end|> is dropped.
    dec = tok.decode(enc, skip_special_tokens=True)
    assert "<think>" in dec and "<|im_end|>" not in dec


def test_bpe_learns_merges_and_round_trips_text(tiny_tok_dir):
    tok = T.load_tokenizer(tiny_tok_dir)
    text = _CORPUS[7] + "never seen: ∑ ✓ \t tabs\r\n"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8")) * 0.6  # merges really compress the corpus style
    # Qwen3's split regex isolates single digits.
    digit_ids = tok("12345").input_ids
    assert len(digit_ids) == 5


def test_bpe_chat_template_matches_render_chat(tiny_tok_dir):
    tok = T.load_tokenizer(tiny_tok_dir)
    for name, msgs in CONVERSATIONS.items():
        for gen in (True, False):
            for think in (True, False):
                got = tok.apply_chat_template(
                    msgs, tokenize=False, add_generation_prompt=gen, enable_thinking=think
                )
                want = T.render_chat(msgs, add_generation_prompt=gen, enable_thinking=think)
                assert got == want, (name, gen, think)


def test_bpe_is_deterministic(tiny_tok_dir, tmp_path):
    T.train_bpe_tokenizer(_CORPUS, 320, tmp_path)
    a = json.loads((tiny_tok_dir / "tokenizer.json").read_text())
    b = json.loads((tmp_path / "tokenizer.json").read_text())
    assert a == b
    assert (tiny_tok_dir / "tokenizer.json").read_bytes() == (tmp_path / "tokenizer.json").read_bytes()


def test_bpe_rejects_bad_input(tmp_path):
    with pytest.raises(T.TokenizerError, match="vocab_size"):
        T.train_bpe_tokenizer(_CORPUS, 100, tmp_path)
    with pytest.raises(T.TokenizerError, match="empty"):
        T.train_bpe_tokenizer([], 300, tmp_path)
    with pytest.raises(T.TokenizerError, match=r"texts\[1\]"):
        T.train_bpe_tokenizer(["a", b"b"], 300, tmp_path)


def test_load_tokenizer_missing_files(tmp_path):
    with pytest.raises(T.TokenizerError, match="does not exist"):
        T.load_tokenizer(tmp_path / "nope")
    with pytest.raises(T.TokenizerError, match="tokenizer.json"):
        T.load_tokenizer(tmp_path)


# --------------------------------------------------------------------------------------------------
# The real Qwen3 tokenizer (skipped, with the reason, when not fetched)

_QWEN3_DIR = T.find_qwen3_tokenizer()
needs_qwen3 = pytest.mark.skipif(
    _QWEN3_DIR is None,
    reason="real Qwen3 tokenizer not found: run `scripts/fetch_qwen3_tokenizer.sh ./cache` "
    "or set $ACE_QWEN3_TOKENIZER_DIR",
)


@pytest.fixture(scope="module")
def qwen3_tok():
    return T.load_tokenizer(_QWEN3_DIR)


@needs_qwen3
def test_qwen3_ids_on_fixed_strings(qwen3_tok):
    tok = qwen3_tok
    assert len(tok) == 151669
    assert tok.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    ) == [151643, 151644, 151645, 151667, 151668]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert tok("Hello world").input_ids == [9707, 1879]
    assert tok("def f(x):\n    return x + 1\n").input_ids == [750, 282, 2075, 982, 262, 470, 856, 488, 220, 16, 198]
    assert tok("数字 12345 🙂").input_ids == [82587, 220, 16, 17, 18, 19, 20, 27484]
    assert tok("<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n\n").input_ids == [
        151644, 872, 198, 6023, 151645, 198, 151667, 271, 151668, 271
    ]


@needs_qwen3
def test_qwen3_transformers_matches_raw_tokenizers(qwen3_tok):
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(_QWEN3_DIR / "tokenizer.json"))
    for text in ["Hello world", "  spaces\n\n\ttabs", "x<|im_end|>y", "naïve café 中文 🙂 12345", _CORPUS[3]]:
        assert qwen3_tok(text).input_ids == raw.encode(text).ids, text


@needs_qwen3
def test_qwen3_chat_template_parity(qwen3_tok):
    tools = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
    cases = dict(CONVERSATIONS)
    cases["tool_calls"] = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "go"},
        {
            "role": "assistant",
            "content": "ok",
            "tool_calls": [
                {"function": {"name": "run", "arguments": {"code": "print(1)", "ü": 1}}},
                {"name": "run", "arguments": '{"code": "x"}'},
            ],
        },
        {"role": "tool", "content": "1"},
    ]
    for name, msgs in cases.items():
        for gen in (True, False):
            for think in (True, False):
                for use_tools in (None, tools):
                    want = qwen3_tok.apply_chat_template(
                        msgs, tools=use_tools, tokenize=False, add_generation_prompt=gen,
                        enable_thinking=think,
                    )
                    got = T.render_chat(msgs, add_generation_prompt=gen, enable_thinking=think, tools=use_tools)
                    assert got == want, (name, gen, think, bool(use_tools))
    ids = qwen3_tok.apply_chat_template(CONVERSATIONS["system_user"], tokenize=True, add_generation_prompt=True,
                                        enable_thinking=False)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert list(ids) == qwen3_tok(T.render_chat(CONVERSATIONS["system_user"])).input_ids
