"""Chat policies: anything that turns conversations into assistant replies.

The evaluation harness, the MLE-Ideator loop and the OpenAI-compatible server all talk to a policy
through one small interface, ``ChatPolicy.complete``:

    conversations: a list of N chat conversations, each a list of {"role", "content"} dicts
    returns:       a list of N ``Completion``s, in order; a policy that cannot answer one
                   conversation (timeout, garbage, server error) returns a Completion with
                   ``error`` set and empty text, never raises for it.

Implementations:

* ``JaxPolicy``: our Qwen3 / Qwen3-MoE Flax model + tokenizer, sampled with the rollout engine
  (``ace_jax.runtime.engine.Engine``: paged KV cache, continuous batching). Built from a model in memory, from an HF directory
  (``JaxPolicy.from_hf``) or from a training run directory (``JaxPolicy.from_run``: its
  ``config.json``, ``tokenizer/`` and the newest (or a given) Orbax checkpoint).
* ``OpenAIPolicy``: any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM, a frontier
  API, or ``launch/serve.py``), over plain HTTP with a timeout and retries.

``policy_from_spec`` builds either from a spec string (``parse_policy_spec``: ``run:``, ``hf:``,
``openai:``); ``read_run_config`` reads a training run's ``config.json``.

Nothing here runs at import time; JAX is imported lazily so an HTTP-only user needs none.
"""
from __future__ import annotations

import dataclasses
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Mapping, Optional, Protocol, Sequence, Union

from ace_jax.runtime import storage

Conversation = Sequence[Mapping[str, Any]]


class PolicyError(RuntimeError):
    """A policy that cannot be built (missing run directory, no checkpoint, mismatched sizes)."""


class PolicySpecError(PolicyError, ValueError):
    """A policy spec string that is not one of ``POLICY_SPEC_FORMS``."""


POLICY_SPEC_FORMS = "run:<workdir>[@step] | hf:<dir> | openai:<base_url>#<model>"


def parse_policy_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """``run:<workdir>[@step]`` | ``hf:<dir>`` | ``openai:<base_url>[#<model>]`` -> (kind, args).

    args: run -> {"workdir", "step" (int or None: the newest)}; hf -> {"path"};
    openai -> {"base_url", "model" ("default" when omitted)}.

    Raises:
      PolicySpecError: anything else (the message lists the accepted forms).
    """
    kind, sep, rest = (spec or "").partition(":")
    if not sep or not rest:
        raise PolicySpecError(f"policy spec {spec!r} is not one of: {POLICY_SPEC_FORMS}")
    if kind == "run":
        path, at, step = rest.rpartition("@")
        if at and step.isdigit() and path:
            return "run", {"workdir": path, "step": int(step)}
        return "run", {"workdir": rest, "step": None}
    if kind == "hf":
        return "hf", {"path": rest}
    if kind == "openai":
        url, hash_, model = rest.rpartition("#")
        if not hash_:
            url, model = rest, "default"
        if not url.startswith(("http://", "https://")):
            raise PolicySpecError(f"openai policy needs an http(s) base URL, got {url!r}")
        return "openai", {"base_url": url, "model": model or "default"}
    raise PolicySpecError(f"unknown policy kind {kind!r} in {spec!r}; use one of: "
                          f"{POLICY_SPEC_FORMS}")


@dataclasses.dataclass
class Completion:
    """One assistant reply.

    Attributes:
      text: the reply (special tokens removed); "" when ``error`` is set.
      error: why the policy gave no reply (e.g. "timeout after 30.0 s"), else None.
      prompt_tokens / completion_tokens: token counts where the policy knows them (0 otherwise).
      finish_reason: "stop" (EOS / stop sequence), "length" (token budget spent) or "error".
      token_ids: the sampled token ids (the EOS included, ``completion_tokens`` of them) where
        the policy has them (``JaxPolicy``), else None.
    """
    text: str
    error: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = "stop"
    token_ids: Optional[list[int]] = None

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
    ``max_prompt_tokens``, and sampled with the rollout engine (``engine``: ``slots`` rows
    decoded together, refilled as rows finish; the same per-row keys as the static
    ``generate.Generator``). Deterministic for a given ``seed``. Safe to call from several
    threads (an evaluation's episodes, its advisor): one `complete` at a time drives the engine,
    whose request queue and donated buffers are not thread-safe.
    """

    def __init__(self, model, tokenizer, *, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, max_prompt_tokens: int = 1024,
                 prompt_bucket: int = 64, slots: int = 8, name: str = "jax"):
        from ace_jax.runtime import generate
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
        self.slots = int(slots)
        self._engine = None
        self._lock = threading.Lock()   # one complete() at a time owns the engine

    def engine_config(self, max_new_tokens: Optional[int] = None, *, slots: Optional[int] = None,
                      sync_every: Optional[int] = None):
        """The ``EngineConfig`` for replies of up to ``max_new_tokens`` (default the policy's)
        after a prompt of up to ``max_prompt_tokens``: ``slots`` rows (default the policy's),
        ``sync_every`` decode steps per host round trip."""
        from ace_jax.runtime import engine

        d = engine.EngineConfig()
        return engine.EngineConfig(
            slots=slots or self.slots, sync_every=sync_every or d.sync_every,
            max_context=self.max_prompt_tokens + (max_new_tokens or self.sampling.max_new_tokens))

    def make_engine(self, config=None):
        """A new rollout engine on this policy's model (``config``: `engine_config()`); the
        engines of one policy share their compiled programs."""
        from ace_jax.runtime import engine

        return engine.Engine(self.model, self.sampling, config or self.engine_config())

    @property
    def engine(self):
        """The engine ``complete`` samples with (built on first use, rebuilt larger when a call
        asks for longer replies than it holds)."""
        if self._engine is None:
            self._engine = self.make_engine()
        return self._engine

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
        """Samples one reply per conversation through the engine (N requests, ``slots`` at a
        time).

        ``max_new_tokens`` / ``temperature`` override the policy's defaults for this call.
        Conversation i samples with key ``fold_in(key(seed), i)`` (as ``Generator.generate``),
        so at temperature > 0 its reply depends on its place in the list; greedy (temperature
        0) replies do not depend on ``seed``. Raises ``models.tokenizer.TokenizerError`` for a
        malformed conversation.
        """
        import jax
        import numpy as np

        from ace_jax.runtime import generate

        if not conversations:
            return []
        prompts = [self.encode(c)[0] for c in conversations]
        sampling = self.sampling
        if max_new_tokens is not None or temperature is not None:
            sampling = dataclasses.replace(
                sampling, max_new_tokens=max_new_tokens or sampling.max_new_tokens,
                temperature=sampling.temperature if temperature is None else float(temperature))
        with self._lock:
            if self.engine.config.max_context < self.max_prompt_tokens + sampling.max_new_tokens:
                self._engine = self.make_engine(self.engine_config(sampling.max_new_tokens))
            out = self.engine.generate(prompts, jax.random.key(seed), sampling)
        tokens, lengths = np.asarray(out.tokens), np.asarray(out.lengths)
        reasons = np.asarray(out.finish_reason)
        result = []
        for i, p in enumerate(prompts):
            ids = tokens[i, :lengths[i]].tolist()
            result.append(Completion(
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
                prompt_tokens=len(p), completion_tokens=int(lengths[i]),
                finish_reason="length" if reasons[i] == generate.FinishReason.LENGTH else "stop",
                token_ids=ids))
        return result


@dataclasses.dataclass(frozen=True)
class RunFiles:
    """Where the pieces of a training run directory live (see ``resolve_run``).

    Attributes:
      workdir: the run directory.
      config: its ``config.json`` as a dict (the full training config).
      tokenizer_dir: the local tokenizer directory the run trained with.
      checkpoint_dir: the Orbax checkpoint directory (local path or ``gs://`` URL).
    """
    workdir: str
    config: dict
    tokenizer_dir: str
    checkpoint_dir: str


def read_run_config(workdir: Union[str, os.PathLike]) -> dict:
    """``<workdir>/config.json`` of a training run (local or gs://) as a dict.

    Raises:
      PolicyError: no such directory, no / unreadable config.json, or one without a ``model``
        section (not a training run's config).
    """
    workdir = os.fspath(workdir)
    cfg_path = storage.join(workdir, "config.json")
    if not storage.is_url(workdir) and not os.path.isdir(workdir):
        raise PolicyError(f"run directory {workdir!r} does not exist")
    try:
        text = storage.read_text(cfg_path)
    except FileNotFoundError:
        raise PolicyError(f"{workdir!r} is not a training run directory: no config.json") \
            from None
    except OSError as e:
        raise PolicyError(f"{cfg_path} is unreadable: {e}") from e
    try:
        cfg = json.loads(text)
    except ValueError as e:
        raise PolicyError(f"{cfg_path} is unreadable: {e}") from e
    if not isinstance(cfg, dict) or not isinstance(cfg.get("model"), dict):
        raise PolicyError(f"{cfg_path} has no 'model' section: not a training run config")
    return cfg


def resolve_run(workdir: str) -> RunFiles:
    """Finds the config, tokenizer and checkpoint directory of a run (local or gs://), as the
    trainer chose them.

    The tokenizer is, in the trainer's order: ``model.tokenizer_path``, else
    ``<model.init_from_run>/tokenizer``, else ``<workdir>/tokenizer``; a gs:// one is read from
    its local copy (``runtime.storage.local_copy``).

    Raises:
      PolicyError: no such directory, no / unreadable config.json, no tokenizer.
    """
    workdir = os.fspath(workdir)
    cfg = read_run_config(workdir)
    model = cfg["model"]
    tok_path = (model.get("tokenizer_path")
                or (storage.join(model["init_from_run"], "tokenizer")
                    if model.get("init_from_run") else storage.join(workdir, "tokenizer")))
    if not storage.exists(storage.join(tok_path, "tokenizer.json")):
        raise PolicyError(f"no tokenizer at {tok_path!r} (run {workdir!r})")
    ckpt_dir = ((cfg.get("checkpoint") or {}).get("directory")
                or storage.join(workdir, "checkpoints"))
    return RunFiles(workdir=workdir, config=cfg, tokenizer_dir=storage.local_copy(tok_path),
                    checkpoint_dir=ckpt_dir)


def _hf_model_config(hf_path: str, overrides: Mapping[str, Any]):
    """The ModelConfig ``hf_mapping.load_hf_model(hf_path, **overrides)`` builds, from config.json
    alone (no weights are read)."""
    from models.configs import RUNTIME_FIELDS, ModelConfig

    url = str(hf_path).rstrip("/") + "/config.json"
    try:
        if "://" in url:
            import fsspec

            with fsspec.open(url, "r") as f:
                hf_cfg = json.load(f)
        else:
            with open(url, encoding="utf-8") as f:
                hf_cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise PolicyError(f"cannot read the model config {url!r}: {e}") from e
    overrides = dict(overrides)
    runtime = {k: overrides.pop(k) for k in list(overrides) if k in RUNTIME_FIELDS}
    config = ModelConfig.from_hf_dict(hf_cfg, **runtime)
    return config.replace(**overrides) if overrides else config


def run_model_config(run: RunFiles, vocab_size: int, _depth: int = 0):
    """The ModelConfig the trainer built for ``run`` (``Trainer._build_model``): the config of
    ``model.init_from_run`` when set, else the HF config of ``model.hf_path`` (+ ``runtime``),
    else the preset + overrides with ``vocab_size`` (the run tokenizer's length)."""
    from models import configs as model_configs

    model = run.config["model"]
    if model.get("init_from_run"):
        if _depth > 16:
            raise PolicyError(f"model.init_from_run chain is too deep at {run.workdir!r}")
        parent = resolve_run(model["init_from_run"])
        from models import tokenizer as tok_lib

        parent_vocab = len(tok_lib.load_tokenizer(parent.tokenizer_dir))
        return run_model_config(parent, parent_vocab, _depth + 1)
    if model.get("hf_path"):
        return _hf_model_config(model["hf_path"], model.get("runtime") or {})
    if not model.get("preset"):
        raise PolicyError(f"{run.workdir!r}: config.json names no model.preset nor model.hf_path")
    overrides = dict(model.get("overrides") or {})
    overrides["vocab_size"] = vocab_size
    try:
        return model_configs.get_model_config(model["preset"], **overrides)
    except (KeyError, TypeError, ValueError) as e:
        raise PolicyError(f"{run.workdir!r}: cannot build model preset "
                          f"{model['preset']!r}: {e}") from e


def load_run_model(workdir: str, *, step: Optional[int] = None,
                   shardings: Optional[Any] = None):
    """(model, tokenizer, step) of a training run directory; see ``JaxPolicy.from_run``.

    ``step=None`` takes the newest complete checkpoint (corrupt or unfinished newer ones are
    logged and skipped). Nothing is written to the run directory. ``shardings``: a function of
    the abstract Param state giving each parameter's sharding (``Placement.params``): the
    parameters are restored straight into those shardings, each host reading only the slices
    its devices hold; None: every parameter on the first device.

    Raises:
      PolicyError: no run directory / config.json / tokenizer / checkpoint, or no checkpoint of
        ``step`` (the message lists the steps present).
      checkpoint.CheckpointMismatchError: the checkpoint holds another model size (naming the
        first mismatching tensor).
      checkpoint.CheckpointCorruptError: checkpoint ``step`` (given explicitly) is unreadable.
    """
    import logging

    import jax
    from flax import nnx

    from ace_jax.runtime import checkpoint as ckpt_lib
    from models import qwen3, tokenizer as tok_lib

    run = resolve_run(workdir)
    tokenizer = tok_lib.load_tokenizer(run.tokenizer_dir)
    model_cfg = run_model_config(run, len(tokenizer))
    abstract = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0)))
    graphdef, params_shape = nnx.split(abstract, nnx.Param)
    if shardings is not None:
        params_shape = jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), params_shape,
            shardings(params_shape))
    ckpt_dir = run.checkpoint_dir
    # Checkpointer creates its directory: never let it do so in someone's run directory.
    if "://" not in ckpt_dir and not os.path.isdir(ckpt_dir):
        raise PolicyError(f"no checkpoint in {ckpt_dir!r} (the directory does not exist)")
    ckpt = ckpt_lib.Checkpointer(ckpt_dir, keep=None, async_save=False)
    try:
        steps = ckpt.all_steps()
        if not steps:
            raise PolicyError(f"no checkpoint in {ckpt_dir!r}")
        if step is not None:
            step = int(step)
            if step not in steps:
                raise PolicyError(f"no checkpoint of step {step} in {ckpt_dir!r}; have {steps}")
            params = ckpt.restore_params(step, params_shape)
        else:
            params, errors = None, []
            for s in reversed(steps):
                try:
                    params, step = ckpt.restore_params(s, params_shape), s
                    break
                except ckpt_lib.CheckpointCorruptError as e:
                    logging.getLogger(__name__).warning("skipping checkpoint: %s", e)
                    errors.append(e)
            if params is None:
                raise PolicyError(f"no complete checkpoint in {ckpt_dir!r} (steps {steps}): "
                                  f"{errors[0]}") from errors[0]
    finally:
        ckpt.close()
    return nnx.merge(graphdef, params), tokenizer, step


# --------------------------------------------------------------------------------------- HTTP


class OpenAIPolicy:
    """An OpenAI-compatible chat endpoint (``POST {base_url}/chat/completions``).

    ``base_url`` ends in ``/v1`` (e.g. ``http://127.0.0.1:8000/v1``). Each conversation is one
    request (conversation i is sent with ``seed + i``); up to ``max_concurrency`` requests are in
    flight at once, so a batching server (``launch/serve.py``, vLLM) can batch them.

    Failures never raise: after ``retries`` further attempts (``backoff_s * 2**attempt`` apart,
    at most 2 s) the reply is ``Completion(error=..., finish_reason="error")`` with ``error``
    starting "timeout after ...", "HTTP <code>: ...", "unreachable: ..." or
    "malformed response: ...". Client errors (HTTP 4xx other than 408 / 429) are not retried.
    """

    def __init__(self, base_url: str, model: str = "default", *, api_key: Optional[str] = None,
                 timeout_s: float = 60.0, retries: int = 1, max_tokens: int = 1024,
                 temperature: float = 0.0, max_concurrency: int = 8, backoff_s: float = 0.25,
                 name: Optional[str] = None):
        if retries < 0 or max_concurrency < 1 or timeout_s <= 0:
            raise ValueError(f"need retries >= 0, max_concurrency >= 1, timeout_s > 0; got "
                             f"{retries}, {max_concurrency}, {timeout_s}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.max_tokens = int(max_tokens)
        self.temperature = float(temperature)
        self.max_concurrency = int(max_concurrency)
        self.backoff_s = float(backoff_s)
        self.name = name or model

    def _post(self, body: dict) -> Any:
        req = urllib.request.Request(self.base_url + "/chat/completions",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
            return json.loads(resp.read().decode("utf-8"))

    @staticmethod
    def _parse(data: Any) -> Completion:
        """The Completion of a chat.completion body; raises ValueError when it is not one."""
        if not isinstance(data, dict):
            raise ValueError(f"body is a {type(data).__name__}, not a JSON object")
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise ValueError(f"no choices[0] in the body (keys {sorted(data)[:8]})")
        choice = choices[0]
        message = choice.get("message")
        text = message.get("content") if isinstance(message, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"choices[0].message.content is {type(text).__name__}, not a string")
        usage = data.get("usage")
        usage = usage if isinstance(usage, dict) else {}
        return Completion(text=text, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          completion_tokens=int(usage.get("completion_tokens") or 0),
                          finish_reason=str(choice.get("finish_reason") or "stop"))

    def complete_one(self, conversation: Conversation, *, seed: int = 0) -> Completion:
        body = {"model": self.model, "messages": [dict(m) for m in conversation],
                "max_tokens": self.max_tokens, "temperature": self.temperature, "seed": seed}
        error = "no attempt"
        for attempt in range(self.retries + 1):
            retryable = True
            try:
                return self._parse(self._post(body))
            except urllib.error.HTTPError as e:
                try:
                    detail = e.read()[:200].decode("utf-8", "replace")
                except Exception:  # the error body itself may be cut off
                    detail = ""
                error = f"HTTP {e.code}: {detail}".rstrip(": ")
                retryable = e.code >= 500 or e.code in (408, 429)
            except urllib.error.URLError as e:
                error = (f"timeout after {self.timeout_s:g} s"
                         if isinstance(e.reason, TimeoutError) else f"unreachable: {e.reason}")
            except TimeoutError:
                error = f"timeout after {self.timeout_s:g} s"
            except (OSError, http.client.HTTPException) as e:  # reset, closed, cut-off body
                error = f"unreachable: {type(e).__name__}: {str(e)[:200]}"
            except (ValueError, TypeError) as e:  # JSON / UTF-8 / schema
                error = f"malformed response: {str(e)[:200]}"
            if attempt < self.retries and retryable:
                time.sleep(min(2.0, self.backoff_s * 2 ** attempt))
            elif not retryable:
                break
        return Completion(text="", error=error, finish_reason="error")

    def complete(self, conversations: Sequence[Conversation], *, seed: int = 0
                 ) -> list[Completion]:
        """One reply per conversation, in order (requests run ``max_concurrency`` at a time)."""
        if len(conversations) <= 1 or self.max_concurrency == 1:
            return [self.complete_one(c, seed=seed + i) for i, c in enumerate(conversations)]
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(self.max_concurrency, len(conversations))) as pool:
            return list(pool.map(lambda ic: self.complete_one(ic[1], seed=seed + ic[0]),
                                 enumerate(conversations)))


def policy_from_spec(spec: str, *, max_new_tokens: Optional[int] = None,
                     temperature: Optional[float] = None,
                     max_prompt_tokens: Optional[int] = None) -> "ChatPolicy":
    """Builds the ``ChatPolicy`` a spec names (see ``parse_policy_spec``).

    For ``run:`` the sampling settings default to the run's (``sampling.*``,
    ``rl.max_prompt_tokens``); the arguments given here override them.

    Raises:
      PolicySpecError: a malformed spec; PolicyError: a run or model that cannot be loaded.
    """
    kind, args = parse_policy_spec(spec)
    if kind == "openai":
        kw: dict[str, Any] = {}
        if max_new_tokens is not None:
            kw["max_tokens"] = int(max_new_tokens)
        if temperature is not None:
            kw["temperature"] = float(temperature)
        return OpenAIPolicy(args["base_url"], args["model"], **kw)
    kw = {}
    if kind == "run":
        cfg = read_run_config(args["workdir"])
        sampling = cfg.get("sampling") or {}
        for key in ("max_new_tokens", "temperature", "top_k", "top_p", "prompt_bucket"):
            if key in sampling:
                kw[key] = sampling[key]
        if (cfg.get("rl") or {}).get("max_prompt_tokens"):
            kw["max_prompt_tokens"] = int(cfg["rl"]["max_prompt_tokens"])
    for key, value in (("max_new_tokens", max_new_tokens), ("temperature", temperature),
                       ("max_prompt_tokens", max_prompt_tokens)):
        if value is not None:
            kw[key] = value
    if kind == "run":
        return JaxPolicy.from_run(args["workdir"], step=args["step"], **kw)
    return JaxPolicy.from_hf(args["path"], **kw)
