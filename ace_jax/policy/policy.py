"""Chat policies built from a spec, and our own: ``JaxPolicy``.

Every policy implements ``interface.ChatPolicy`` (``complete(conversations) ->
list[Completion]``). Here:

* ``JaxPolicy``: our Qwen3 / Qwen3-MoE Flax model + tokenizer, sampled with the rollout engine
  (``ace_jax.runtime.engine.Engine``: paged KV cache, continuous batching). Built from a model
  in memory, from an HF directory (``JaxPolicy.from_hf``) or from a training run directory
  (``JaxPolicy.from_run``: its ``config.json``, ``tokenizer/`` and the newest (or a given) Orbax
  checkpoint; see ``runs``). On a pod, ``multihost="leader"`` mirrors process 0's engine calls
  to the others (``mirror``).
* ``openai_policy.OpenAIPolicy``: any OpenAI-compatible ``/v1/chat/completions`` endpoint (vLLM,
  a frontier API, or ``launch/serve.py``), over plain HTTP with a timeout and retries.

``policy_from_spec`` builds either from a spec string (``parse_policy_spec``: ``run:``, ``hf:``,
``openai:``); ``runs.read_run_config`` reads a training run's ``config.json``.

Nothing here runs at import time; JAX is imported lazily so an HTTP-only user needs none.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any, Optional, Sequence

from ace_jax.policy import mirror
from ace_jax.policy.interface import ChatPolicy, Completion, Conversation, PolicyError
from ace_jax.policy.openai_policy import OpenAIPolicy
from ace_jax.policy.runs import (SINGLE_DEVICE, default_placement, load_run_model,
                                 read_run_config, resolve_run)


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


# --------------------------------------------------------------------------------------- JAX

MULTIHOST_MODES = ("spmd", "leader")


class JaxPolicy:
    """Our Flax policy behind the ChatPolicy interface.

    Prompts are rendered with the Qwen3 chat template (thinking disabled), cut from the left to
    ``max_prompt_tokens``, and sampled with the rollout engine (``engine``: ``slots`` rows
    decoded together, refilled as rows finish; the same per-row keys as the static
    ``generate.Generator``). Deterministic for a given ``seed``. Safe to call from several
    threads (an evaluation's episodes, its advisor): one `complete` at a time drives the engine,
    whose request queue and donated buffers are not thread-safe.

    Sharded (``placement``: the `ace_jax.runtime.placement.Placement` the parameters are laid
    out by, e.g. a run's own mesh from `run_placement`): the engine splits its slots and KV pages
    over the mesh as the trainer's does. On a mesh that spans several processes (a pod) every
    engine call is a collective: every process must make the same calls in the same order.
    ``multihost`` says who makes them:

    * ``"spmd"`` (default): every process calls `complete` with the same arguments (the trainer's
      way, e.g. the ideator's frozen implementer);
    * ``"leader"``: process 0 alone calls `complete` (or drives `make_engine`'s engines, as the
      server does); each of its engine calls is first sent to the other processes, which replay
      it in `follow()` until process 0 calls `release_followers()`. This is what
      ``launch/evaluate.py`` and ``launch/serve.py`` use on a pod: process 0 runs the
      evaluation or the HTTP server, the other hosts only lend their chips.

    With one process (or parameters held by this process alone) both are the same and nothing
    is sent.
    """

    def __init__(self, model, tokenizer, *, max_new_tokens: int = 256, temperature: float = 0.0,
                 top_k: int = 0, top_p: float = 1.0, max_prompt_tokens: int = 1024,
                 prompt_bucket: int = 64, slots: int = 8, name: str = "jax",
                 placement=None, multihost: str = "spmd"):
        from ace_jax.runtime import generate
        from models import tokenizer as tok_lib

        if len(tokenizer) > model.config.vocab_size:
            raise PolicyError(f"the tokenizer has {len(tokenizer)} tokens but the model's "
                              f"vocab_size is {model.config.vocab_size}")
        if multihost not in MULTIHOST_MODES:
            raise ValueError(f"multihost must be one of {MULTIHOST_MODES}, got {multihost!r}")
        self.name = name
        self.model = model
        self.placement = placement
        self.multihost = multihost
        # leader mode over parameters that other processes hold too: engine calls are mirrored
        # (mirror_id: its number among this process's mirrored policies, the same on every one)
        self.mirrored = multihost == "leader" and mirror.spans_processes(model)
        self.mirror_id = mirror.register_mirrored(self) if self.mirrored else None
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
        from ace_jax.runtime.engine_config import EngineConfig

        d = EngineConfig()
        return EngineConfig(
            slots=slots or self.slots, sync_every=sync_every or d.sync_every,
            max_context=self.max_prompt_tokens + (max_new_tokens or self.sampling.max_new_tokens))

    def make_engine(self, config=None):
        """A new rollout engine on this policy's model (``config``: `engine_config()`), on its
        ``placement``; the engines of one policy share their compiled programs. A mirrored
        (``multihost="leader"``) policy's engine, on process 0, sends each call to the other
        processes before making it (see `follow`); the other processes cannot make one."""
        config = config or self.engine_config()
        if not self.mirrored:
            return self.local_engine(config)
        import jax

        if jax.process_index() != 0:
            raise PolicyError("a multihost='leader' policy is driven by process 0 alone; the "
                              "other processes run ace_jax.policy.mirror.follow()")
        return mirror.leader_engine(self, config)

    def local_engine(self, config):
        """A new engine on this process alone, never mirrored: `make_engine`'s, and the one
        `mirror.follow` builds on the other processes to replay process 0's calls."""
        from ace_jax.runtime import engine

        return engine.Engine(self.model, self.sampling, config, placement=self.placement)

    @property
    def engine(self):
        """The engine ``complete`` samples with (built on first use, rebuilt larger when a call
        asks for longer replies than it holds)."""
        if self._engine is None:
            self._engine = self.make_engine()
        return self._engine

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, path: str, *, dtype: str = "float32", placement=None,
                **kwargs) -> "JaxPolicy":
        """An HF directory holding config.json, safetensors and the tokenizer files.

        ``placement``: read every parameter straight into its shardings on that mesh (each host
        reads only its blocks); None: the whole model on this host's first device."""
        from models import hf_mapping, tokenizer as tok_lib

        model = hf_mapping.load_hf_model(
            path, dtype=dtype, shardings=None if placement is None else placement.params)
        kwargs.setdefault("name", os.path.basename(os.path.normpath(str(path))))
        return cls(model, tok_lib.load_tokenizer(path), placement=placement, **kwargs)

    @classmethod
    def from_run(cls, workdir: str, *, step: Optional[int] = None, placement: Any = "auto",
                 **kwargs) -> "JaxPolicy":
        """The policy of a training run directory (``launch/tpu_train.py``'s ``workdir``).

        Reads ``<workdir>/config.json`` (model preset + overrides), ``<workdir>/tokenizer`` (or
        the config's ``model.tokenizer_path``) and restores only the parameters of checkpoint
        ``step`` (default: the newest complete one) from ``<workdir>/checkpoints``.

        ``placement``: "auto" (default): with several devices (or processes) the run's own mesh
        and rules (`run_placement`), each parameter restored straight into its shards; with one
        device, that device. None: the first device. Or a `Placement`. On a mesh spanning
        several processes this is collective: every process calls it with the same arguments
        (see `load_run_model`), and ``multihost`` (a keyword of the constructor) says who
        samples afterwards.
        """
        run = resolve_run(workdir)
        if isinstance(placement, str):
            if placement != "auto":
                raise ValueError(f"placement must be 'auto', None or a Placement, got {placement!r}")
            placement = default_placement(run)
        shardings = SINGLE_DEVICE if placement is None else placement.params
        model, tokenizer, step = load_run_model(run, step=step, shardings=shardings)
        kwargs.setdefault("name", f"{os.path.basename(os.path.normpath(workdir))}@{step}")
        return cls(model, tokenizer, placement=placement, **kwargs)

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


def policy_from_spec(spec: str, *, max_new_tokens: Optional[int] = None,
                     temperature: Optional[float] = None,
                     max_prompt_tokens: Optional[int] = None,
                     multihost: str = "spmd") -> "ChatPolicy":
    """Builds the ``ChatPolicy`` a spec names (see ``parse_policy_spec``).

    For ``run:`` the sampling settings default to the run's (``sampling.*``,
    ``rl.max_prompt_tokens``); the arguments given here override them. A ``run:`` policy is
    placed on the run's own mesh when there are several devices (``JaxPolicy.from_run``);
    ``multihost``: see ``JaxPolicy`` (collective on a multi-process mesh: every process builds
    it).

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
    kw["multihost"] = multihost
    if kind == "run":
        return JaxPolicy.from_run(args["workdir"], step=args["step"], **kw)
    return JaxPolicy.from_hf(args["path"], **kw)
