"""Chat policies: anything that turns conversations into assistant replies.

The evaluation harness, the MLE-Ideator loop and the OpenAI-compatible server all talk to a policy
through one small interface, ``ChatPolicy.complete``:

    conversations: a list of N chat conversations, each a list of {"role", "content"} dicts
    returns:       a list of N ``Completion``s, in order; a policy that cannot answer one
                   conversation (timeout, garbage, server error) returns a Completion with
                   ``error`` set and empty text, never raises for it.

Implementations:

* ``JaxPolicy``: our Qwen3 / Qwen3-MoE Flax model + tokenizer, sampled with the jitted grouped
  ``Generator`` (group size 1). Built from a model in memory, from an HF directory
  (``JaxPolicy.from_hf``) or from a training run directory (``JaxPolicy.from_run``: its
  ``config.json``, ``tokenizer/`` and the newest (or a given) Orbax checkpoint).
* ``OpenAIPolicy``: any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, a frontier
  API, or ``launch/serve.py``), over plain HTTP with a timeout and retries.

Nothing here runs at import time; JAX is imported lazily so an HTTP-only user needs none.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
import urllib.error
import urllib.request
from typing import Any, Mapping, Optional, Protocol, Sequence

Conversation = Sequence[Mapping[str, Any]]


class PolicyError(RuntimeError):
    """A policy that cannot be built (missing run directory, no checkpoint, mismatched sizes)."""


@dataclasses.dataclass
class Completion:
    """One assistant reply.

    Attributes:
      text: the reply (special tokens removed); "" when ``error`` is set.
      error: why the policy gave no reply (e.g. "timeout after 30.0 s"), else None.
      prompt_tokens / completion_tokens: token counts where the policy knows them (0 otherwise).
      finish_reason: "stop" (EOS / stop sequence), "length" (token budget spent) or "error".
    """
    text: str
    error: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"

    @property
    def ok(self) -> bool:
        return self.error is None


class ChatPolicy(Protocol):
    """What the harness needs of a policy (see the module docstring)."""

    name: str

    def complete(self, conversations: Sequence[Conversation], *, seed: int = 0
                 ) -> list[Completion]: ...


# --------------------------------------------------------------------------------------- JAX


class JaxPolicy:
    """Our Flax policy behind the ChatPolicy interface.

    Prompts are rendered with the Qwen3 chat template (thinking disabled), cut from the left to
    ``max_prompt_tokens``, and sampled in one batch of ``len(conversations)`` samples with the
    jitted ``Generator``. Deterministic for a given ``seed``.
    """

    def __init__(self, model, tokenizer, *, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, max_prompt_tokens: int = 1024,
                 prompt_bucket: int = 64, name: str = "jax"):
        from ace_jax import generate
        from models import tokenizer as tok_lib

        if len(tokenizer) > model.config.vocab_size:
            raise PolicyError(f"the tokenizer has {len(tokenizer)} tokens but the model's "
                              f"vocab_size is {model.config.vocab_size}")
        self.name = name
        self.model = model
        self.tokenizer = tokenizer
        self.max_prompt_tokens = int(max_prompt_tokens)
        eos = tuple(tokenizer.convert_tokens_to_ids([tok_lib.IM_END, tok_lib.ENDOFTEXT]))
        self.sampling = generate.SamplingConfig(
            max_new_tokens=max_new_tokens, group_size=1, temperature=temperature, top_k=top_k,
            top_p=top_p, eos_ids=eos, pad_id=int(eos[-1]), prompt_bucket=prompt_bucket)
        self.generator = generate.Generator(model, self.sampling)

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, path: str, *, dtype: str = "float32", **kwargs) -> "JaxPolicy":
        """An HF directory holding config.json, safetensors and the tokenizer files."""
        from models import hf_mapping, tokenizer as tok_lib

        model = hf_mapping.load_hf_model(path, dtype=dtype)
        kwargs.setdefault("name", os.path.basename(os.path.normpath(str(path))))
        return cls(model, tok_lib.load_tokenizer(path), **kwargs)

    @classmethod
    def from_run(cls, workdir: str, *, step: Optional[int] = None, **kwargs) -> "JaxPolicy":
        """The policy of a training run directory (``launch/tpu_train.py``'s ``workdir``).

        Reads ``<workdir>/config.json`` (model preset + overrides), ``<workdir>/tokenizer`` (or
        the config's ``model.tokenizer_path``) and restores only the parameters of checkpoint
        ``step`` (default: the newest complete one) from ``<workdir>/checkpoints``.
        """
        model, tokenizer, step = load_run_model(workdir, step=step)
        kwargs.setdefault("name", f"{os.path.basename(os.path.normpath(workdir))}@{step}")
        return cls(model, tokenizer, **kwargs)

    # -- sampling ----------------------------------------------------------------------------

    def encode(self, conversation: Conversation) -> tuple[list[int], bool]:
        """Token ids of the rendered prompt, and whether it was cut to ``max_prompt_tokens``."""
        from models import tokenizer as tok_lib

        text = tok_lib.render_chat(list(conversation), add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_prompt_tokens:
            return ids[-self.max_prompt_tokens:], True
        return ids, False

    def complete(self, conversations: Sequence[Conversation], *, seed: int = 0,
                 max_new_tokens: Optional[int] = None, temperature: Optional[float] = None
                 ) -> list[Completion]:
        import jax
        import numpy as np

        from ace_jax import generate

        if not conversations:
            return []
        prompts = [self.encode(c)[0] for c in conversations]
        sampling = self.sampling
        if max_new_tokens is not None or temperature is not None:
            sampling = dataclasses.replace(
                sampling, max_new_tokens=max_new_tokens or sampling.max_new_tokens,
                temperature=sampling.temperature if temperature is None else float(temperature))
        out = self.generator.generate(prompts, jax.random.key(seed), sampling)
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        reasons = np.asarray(out.finish_reason)
        result = []
        for i, p in enumerate(prompts):
            ids = tokens[i, :lengths[i]].tolist()
            result.append(Completion(
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                prompt_tokens=len(p), completion_tokens=int(lengths[i]),
                finish_reason="length" if reasons[i] == generate.FinishReason.LENGTH else "stop"))
        return result


def load_run_model(workdir: str, *, step: Optional[int] = None):
    """(model, tokenizer, step) of a training run directory; see ``JaxPolicy.from_run``.

    Raises PolicyError naming what is missing; a checkpoint of another model size raises the
    checkpoint module's CheckpointMismatchError (naming the first mismatching tensor).
    """
    from flax import nnx

    from ace_jax import checkpoint as ckpt_lib
    from models import configs as model_configs, qwen3, tokenizer as tok_lib

    cfg_path = os.path.join(workdir, "config.json")
    if not os.path.exists(cfg_path):
        raise PolicyError(f"{workdir!r} is not a training run directory: no config.json")
    with open(cfg_path, encoding="utf-8") as f:
        cfg = json.load(f)
    tok_path = cfg["model"].get("tokenizer_path") or os.path.join(workdir, "tokenizer")
    if not os.path.exists(os.path.join(tok_path, "tokenizer.json")):
        raise PolicyError(f"no tokenizer at {tok_path!r}")
    tokenizer = tok_lib.load_tokenizer(tok_path)
    if cfg["model"].get("hf_path"):
        from models import hf_mapping

        template = hf_mapping.load_hf_model(cfg["model"]["hf_path"],
                                            **dict(cfg["model"].get("runtime") or {}))
        model_cfg = template.config
    else:
        overrides = dict(cfg["model"].get("overrides") or {})
        overrides["vocab_size"] = len(tokenizer)
        model_cfg = model_configs.get_model_config(cfg["model"]["preset"], **overrides)
    abstract = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, params_shape = nnx.split(abstract, nnx.Param)
    ckpt_dir = (cfg.get("checkpoint") or {}).get("directory") or os.path.join(workdir,
                                                                              "checkpoints")
    ckpt = ckpt_lib.Checkpointer(ckpt_dir, keep=None, async_save=False)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise PolicyError(f"no checkpoint in {ckpt_dir!r}")
        step = steps[-1] if step is None else int(step)
        if step not in steps:
            raise PolicyError(f"no checkpoint of step {step} in {ckpt_dir!r}; have {steps}")
        params = ckpt.restore_params(step, params_shape)
    finally:
        ckpt.close()
    return nnx.merge(graphdef, params), tokenizer, step


# --------------------------------------------------------------------------------------- HTTP


class OpenAIPolicy:
    """An OpenAI-compatible chat endpoint (``POST {base_url}/chat/completions``).

    ``base_url`` ends in ``/v1`` (e.g. ``http://127.0.0.1:8000/v1``). Each conversation is one
    request; a timeout, an HTTP error, or a body without ``choices[0].message.content`` becomes
    ``Completion(error=...)`` after ``retries`` further attempts.
    """

    def __init__(self, base_url: str, model: str = "default", *, api_key: Optional[str] = None,
                 timeout_s: float = 60.0, retries: int = 1, max_tokens: int = 1024,
                 temperature: float = 0.0, name: Optional[str] = None):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.name = name or model

    def _post(self, body: dict) -> dict:
        req = urllib.request.Request(self.base_url + "/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read().decode("utf-8"))

    def complete_one(self, conversation: Conversation, *, seed: int = 0) -> Completion:
        body = {"model": self.model, "messages": [dict(m) for m in conversation],
                "max_tokens": self.max_tokens, "temperature": self.temperature, "seed": seed}
        error = "no attempt"
        for attempt in range(self.retries + 1):
            try:
                data = self._post(body)
                choice = data["choices"][0]
                text = choice["message"]["content"]
                if not isinstance(text, str):
                    raise TypeError(f"message.content is {type(text).__name__}, not a string")
                usage = data.get("usage") or {}
                return Completion(text=text, prompt_tokens=int(usage.get("prompt_tokens", 0)),
                                  completion_tokens=int(usage.get("completion_tokens", 0)),
                                  finish_reason=str(choice.get("finish_reason") or "stop"))
            except TimeoutError:
                error = f"timeout after {self.timeout_s:g} s"
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}: {e.read()[:200].decode('utf-8', 'replace')}"
            except urllib.error.URLError as e:
                error = ("timeout after %g s" % self.timeout_s
                         if isinstance(e.reason, TimeoutError) else f"unreachable: {e.reason}")
            except (ValueError, KeyError, IndexError, TypeError) as e:
                error = f"malformed response: {type(e).__name__}: {str(e)[:200]}"
            if attempt < self.retries:
                time.sleep(min(2.0, 0.25 * 2 ** attempt))
        return Completion(text="", error=error, finish_reason="error")

    def complete(self, conversations: Sequence[Conversation], *, seed: int = 0
                 ) -> list[Completion]:
        return [self.complete_one(c, seed=seed + i) for i, c in enumerate(conversations)]
