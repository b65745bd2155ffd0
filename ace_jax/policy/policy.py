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
        self.mirrored = multihost == "leader" and _spans_processes(model)
        self._policy_id = _register_mirrored(self) if self.mirrored else None
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
            return self._new_engine(config)
        import jax

        if jax.process_index() != 0:
            raise PolicyError("a multihost='leader' policy is driven by process 0 alone; the "
                              "other processes run ace_jax.policy.policy.follow()")
        return _MIRROR.engine(self, config)

    def _new_engine(self, config):
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


# ------------------------------------------------------------------ several processes, one leader

MULTIHOST_MODES = ("spmd", "leader")


def _spans_processes(model) -> bool:
    """Whether some parameter of ``model`` lives on devices of other processes too."""
    import jax
    from flax import nnx

    if jax.process_count() == 1:
        return False
    return any(isinstance(x, jax.Array) and not x.is_fully_addressable
               for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _register_mirrored(policy) -> int:
    """A number for a mirrored policy, the same on every process: every process builds the
    same policies in the same order (e.g. the evaluation's policy, then its advisor)."""
    with _MIRROR.lock:
        _MIRROR.policies.append(policy)
        return len(_MIRROR.policies) - 1


def _key_json(key) -> dict:
    import jax
    import numpy as np

    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return {"data": np.asarray(jax.random.key_data(key)).tolist(),
                "impl": str(jax.random.key_impl(key))}
    return {"data": np.asarray(key).tolist(), "impl": None}


def _key_from_json(d: dict):
    import jax
    import numpy as np

    data = np.asarray(d["data"], dtype=np.uint32)
    return data if d["impl"] is None else jax.random.wrap_key_data(data, impl=d["impl"])


class _LeaderEngine:
    """Process 0's engine of a mirrored policy: each call that changes the engine (or runs a
    collective) is first sent to the other processes, under one lock, so that every process
    makes the same calls in the same order. Everything else (``progress``, ``config``, ...)
    is read from the engine itself."""

    def __init__(self, engine, engine_id: int):
        self._engine = engine
        self.engine_id = engine_id

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def _call(self, method: str, args: dict, call):
        with _MIRROR.lock:
            _MIRROR.send({"op": "call", "engine": self.engine_id, "method": method, "args": args})
            return call()

    def submit(self, prompt, *, n: int = 1, key, max_new_tokens=None, temperature=None) -> int:
        budget = (max_new_tokens if max_new_tokens is None or isinstance(max_new_tokens, int)
                  else [int(m) for m in max_new_tokens])
        args = {"prompt": [int(t) for t in prompt], "n": int(n), "key": _key_json(key),
                "max_new_tokens": budget,
                "temperature": None if temperature is None else float(temperature)}
        return self._call("submit", args, lambda: self._engine.submit(
            prompt, n=n, key=key, max_new_tokens=max_new_tokens, temperature=temperature))

    def cancel(self, request: int, sample: Optional[int] = None) -> None:
        return self._call("cancel", {"request": int(request),
                                     "sample": None if sample is None else int(sample)},
                          lambda: self._engine.cancel(request, sample))

    def step(self):
        return self._call("step", {}, self._engine.step)

    def drain(self):
        return self._call("drain", {}, self._engine.drain)

    def generate(self, prompts, key, sampling=None):
        args = {"prompts": [[int(t) for t in p] for p in prompts], "key": _key_json(key),
                "sampling": None if sampling is None else dataclasses.asdict(sampling)}
        return self._call("generate", args,
                          lambda: self._engine.generate(prompts, key, sampling))

    def update_weights(self, params):
        raise NotImplementedError("a mirrored engine serves fixed weights")


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def _replay(engine, method: str, args: dict):
    """One call that process 0 made, made here with the same arguments."""
    from ace_jax.runtime import generate as generate_lib

    if method == "submit":
        budget = args["max_new_tokens"]
        return engine.submit(args["prompt"], n=args["n"], key=_key_from_json(args["key"]),
                             max_new_tokens=budget, temperature=args["temperature"])
    if method == "cancel":
        return engine.cancel(args["request"], args["sample"])
    if method in ("step", "drain"):
        return getattr(engine, method)()
    if method == "generate":
        sampling = args["sampling"]
        if sampling is not None:
            sampling = generate_lib.SamplingConfig(**{k: _tuples(v) for k, v in sampling.items()})
        return engine.generate(args["prompts"], _key_from_json(args["key"]), sampling)
    raise ValueError(f"process 0 sent an unknown engine call {method!r}")


class _Mirror:
    """The channel from process 0 to the others: numbered JSON messages in JAX's distributed
    key-value store (the coordination service every ``jax.distributed`` process already talks
    to; not a device collective, so an idle server holds no collective open). Process 0 writes
    ``<prefix>/<n>``; the others read n = 0, 1, 2, ... in order and every ``ACK_EVERY`` messages
    write how many they have read (``<prefix>/ack/<process>``); process 0 deletes the messages
    every other process has read."""

    PREFIX = "ace_jax/policy/mirror"
    ACK_EVERY = 16

    def __init__(self):
        import threading as _threading

        self.lock = _threading.RLock()
        self.policies: list = []
        self.sent = 0
        self.received = 0
        self.next_engine = 0
        self.dropped: list[int] = []
        self.deleted = 0   # messages below this number are deleted (process 0)

    @staticmethod
    def _client():
        from jax._src import distributed

        client = distributed.global_state.client
        if client is None:
            raise PolicyError("a mirrored policy needs jax.distributed to be initialised")
        return client

    def send(self, msg: dict) -> None:
        with self.lock:
            drop = self.dropped[:]
            if drop:   # engines process 0 no longer holds (appended by their finalizers)
                del self.dropped[:len(drop)]
                msg = dict(msg, drop=drop)
            client = self._client()
            client.key_value_set(f"{self.PREFIX}/{self.sent}", json.dumps(msg))
            self.sent += 1
            if self.sent % self.ACK_EVERY == 0:
                self._delete_read(client)

    def _delete_read(self, client) -> None:
        import jax

        read = []
        for p in range(1, jax.process_count()):
            try:
                read.append(int(client.key_value_try_get(f"{self.PREFIX}/ack/{p}")))
            except Exception:  # noqa: BLE001 - NOT_FOUND: that process has not acked yet
                read.append(0)
        upto = min(read, default=0)
        for n in range(self.deleted, upto):
            try:
                client.key_value_delete(f"{self.PREFIX}/{n}")
            except Exception:  # noqa: BLE001 - a leftover key costs a few bytes
                pass
        self.deleted = max(self.deleted, upto)

    def receive(self, poll_s: float) -> dict:
        from ace_jax.runtime import multihost

        key = f"{self.PREFIX}/{self.received}"
        while True:
            try:
                text = self._client().blocking_key_value_get(key, int(poll_s * 1000))
                break
            except Exception as e:  # noqa: BLE001 - a timeout, or a lost coordinator
                message = str(e)
                if "DEADLINE_EXCEEDED" in message:   # nothing sent yet: an idle server
                    continue
                raise multihost.PeerLostError(
                    f"waiting for process 0's next engine call failed ({type(e).__name__}: "
                    f"{message[:300]}): process 0 most likely stopped; start every process "
                    "again") from e
        self.received += 1
        if self.received % self.ACK_EVERY == 0:
            import jax

            try:
                self._client().key_value_set(f"{self.PREFIX}/ack/{jax.process_index()}",
                                             str(self.received), allow_overwrite=True)
            except Exception:  # noqa: BLE001 - process 0 then keeps the messages longer
                pass
        return json.loads(text)

    def engine(self, policy, config):
        """A new engine of ``policy`` on process 0, built on every process."""
        import weakref

        with self.lock:
            engine_id = self.next_engine
            self.next_engine += 1
            self.send({"op": "engine", "policy": policy._policy_id, "engine": engine_id,
                       "config": dataclasses.asdict(config)})
            proxy = _LeaderEngine(policy._new_engine(config), engine_id)
        weakref.finalize(proxy, self.dropped.append, engine_id)   # sent with the next message
        return proxy


_MIRROR = _Mirror()


def follow(*, poll_s: float = 30.0) -> int:
    """On a process other than 0 of a multi-process run: replays process 0's engine calls of
    its mirrored (``multihost="leader"``) policies until process 0 calls `release_followers`;
    returns the number of calls replayed. Build the same policies, in the same order, as
    process 0 before calling it. Returns at once when no policy here is mirrored (nothing will
    be sent). A call that fails here fails on process 0 too (the same call on the same state):
    it is logged and the next one replayed.

    Raises:
      multihost.PeerLostError: process 0 (the coordinator) went away.
    """
    import logging

    import jax
    from ace_jax.runtime.engine_config import EngineConfig

    if jax.process_index() == 0:
        raise PolicyError("process 0 leads; follow() is for the other processes")
    if not _MIRROR.policies:
        return 0
    engines: dict[int, Any] = {}
    calls = 0
    log = logging.getLogger(__name__)
    while True:
        msg = _MIRROR.receive(poll_s)
        for engine_id in msg.get("drop", ()):
            engines.pop(engine_id, None)
        op = msg.get("op")
        if op == "stop":
            return calls
        if op == "engine":
            policy = _MIRROR.policies[msg["policy"]]
            engines[msg["engine"]] = policy._new_engine(EngineConfig(**msg["config"]))
        elif op == "call":
            calls += 1
            try:
                _replay(engines[msg["engine"]], msg["method"], msg["args"])
            except Exception as e:  # noqa: BLE001 - process 0 sees the same failure
                log.warning("replaying %s failed here as on process 0: %s", msg["method"], e)
        else:
            raise PolicyError(f"unknown message from process 0: {msg!r}")


def init_multihost(distributed: str = "auto", coordinator_address: str = "",
                   num_processes: int = 0, process_id: int = -1) -> bool:
    """``jax.distributed.initialize`` for a command that loads a run on every host of a pod
    (``launch/evaluate.py``, ``launch/serve.py``), before anything touches a JAX backend: as the
    trainer does (``sharding.maybe_initialize_distributed``): "auto" initialises on a TPU VM or
    when the environment names several processes; "always" / "never" force it. The run's own
    saved coordinator settings are those of its training launch and are not used. Returns
    whether it initialised."""
    from ace_jax.runtime import sharding

    cfg = sharding.default_config()
    cfg.distributed = distributed
    cfg.coordinator_address = coordinator_address or ""
    cfg.num_processes = int(num_processes)
    cfg.process_id = int(process_id)
    return sharding.maybe_initialize_distributed(cfg)


def release_followers() -> None:
    """Process 0: tells the other processes' `follow()` to return (after the evaluation or
    when the server stops). No-op with one process or no mirrored policy."""
    import jax

    if jax.process_count() > 1 and jax.process_index() == 0 and _MIRROR.policies:
        _MIRROR.send({"op": "stop"})


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
    from models import tokenizer as tok_lib   # stdlib only at import: transformers is lazy

    return RunFiles(workdir=workdir, config=cfg, tokenizer_dir=storage.local_copy(
        tok_path, files=tok_lib.TOKENIZER_FILES), checkpoint_dir=ckpt_dir)


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


SINGLE_DEVICE = "single_device"   # load_run_model(shardings=...): the old placement, one device


def run_mesh_config(run_config: Mapping[str, Any]):
    """The ``mesh`` section a run trained with (its saved ``config.json``, over
    ``sharding.default_config()``): axis sizes, axis type and the rules table. Its
    ``distributed`` / coordinator fields are those of the training launch and are not used
    here."""
    import ml_collections

    from ace_jax.runtime import sharding

    cfg = sharding.default_config()
    saved = dict((run_config or {}).get("mesh") or {})
    for key in ("data", "fsdp", "tensor", "expert"):
        if key in saved:
            cfg[key] = int(saved[key])
    if saved.get("axis_types"):
        cfg.axis_types = str(saved["axis_types"])
    rules = dict(cfg.rules)
    rules.update({k: ("" if v is None else ",".join(v) if isinstance(v, (list, tuple)) else str(v))
                  for k, v in dict(saved.get("rules") or {}).items()})
    cfg.rules = ml_collections.ConfigDict(rules)
    return cfg


def _config_of(run_or_config) -> dict:
    if isinstance(run_or_config, RunFiles):
        return run_or_config.config
    if isinstance(run_or_config, (str, os.PathLike)):
        return read_run_config(run_or_config)
    if hasattr(run_or_config, "to_dict"):
        return run_or_config.to_dict()
    return dict(run_or_config)


def run_placement(run_or_config, devices: Optional[Sequence[Any]] = None):
    """The `Placement` the trainer built for a run (``Placement.from_config(cfg.mesh)``: its
    mesh axes and rules table, ``ace_jax/runtime/placement.py``) over ``devices`` (default: every
    device of every process; abstract TPU devices work too).

    ``run_or_config``: a run directory, its `RunFiles`, or a training config (dict /
    ConfigDict). When the saved axis sizes do not fit the number of devices (a 64-chip run served
    on 8), the mesh is refitted: ``expert`` kept where it divides the devices (else the largest
    divisor of both), ``data`` = ``tensor`` = 1 and ``fsdp`` the rest; the rules are kept.
    """
    import logging
    import math

    import jax

    from ace_jax.runtime import placement as placement_lib, sharding

    mesh_cfg = run_mesh_config(_config_of(run_or_config))
    devices = list(jax.devices() if devices is None else devices)
    try:
        sharding.resolve_mesh_shape(mesh_cfg, len(devices))
    except sharding.MeshConfigError as e:
        expert = math.gcd(max(1, int(mesh_cfg.expert)), len(devices))
        logging.getLogger(__name__).warning(
            "the run's mesh does not fit %d devices (%s): using fsdp=%d x expert=%d",
            len(devices), e, len(devices) // expert, expert)
        mesh_cfg.data, mesh_cfg.tensor, mesh_cfg.expert, mesh_cfg.fsdp = 1, 1, expert, -1
    return placement_lib.Placement.from_config(mesh_cfg, devices)


def default_placement(run_or_config):
    """What ``load_run_model(shardings=None)`` and ``JaxPolicy.from_run`` use: the run's own
    `run_placement` over every device when there are several devices or processes, else None
    (the one device)."""
    import jax

    if jax.process_count() > 1 or jax.device_count() > 1:
        return run_placement(run_or_config)
    return None


def _abstract_params(model_cfg):
    from flax import nnx

    from models import qwen3

    abstract = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(0)))
    return nnx.split(abstract, nnx.Param)


def load_run_model(workdir, *, step: Optional[int] = None, shardings: Optional[Any] = None):
    """(model, tokenizer, step) of a training run directory; see ``JaxPolicy.from_run``.

    ``step=None`` takes the newest complete checkpoint (corrupt or unfinished newer ones are
    logged and skipped). Nothing is written to the run directory. ``workdir``: the run
    directory or its `RunFiles`.

    ``shardings``, where the parameters go (each is restored straight into its shardings by
    Orbax from ShapeDtypeStructs: each host reads only the slices its devices hold, and no
    device ever holds a whole parameter it is not given):

    * None (default): with several devices or processes, the run's own mesh and rules
      (`default_placement` -> `run_placement`: the trainer's ``Placement`` of the saved
      ``mesh`` section); with one device, that device.
    * a function of the abstract Param state giving each parameter's sharding (e.g.
      ``Placement.params``), or a `Placement`;
    * ``SINGLE_DEVICE``: every parameter on the first device (the whole model on one chip).

    Collective on a mesh that spans several processes: every process must call it with the same
    arguments (Orbax's restore synchronises them).

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
    from models import tokenizer as tok_lib

    run = workdir if isinstance(workdir, RunFiles) else resolve_run(workdir)
    tokenizer = tok_lib.load_tokenizer(run.tokenizer_dir)
    model_cfg = run_model_config(run, len(tokenizer))
    graphdef, params_shape = _abstract_params(model_cfg)
    if shardings is None:
        placement = default_placement(run)
        shardings = None if placement is None else placement.params
    elif isinstance(shardings, str):
        if shardings != SINGLE_DEVICE:
            raise ValueError(f"shardings must be None, {SINGLE_DEVICE!r}, a Placement or a "
                             f"function of the param state, got {shardings!r}")
        shardings = None
    elif hasattr(shardings, "params") and hasattr(shardings, "mesh"):   # a Placement
        shardings = shardings.params
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


def jax_leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _plan_model_config(config: Mapping[str, Any]):
    """The ModelConfig of a training config without reading anything: the preset with its
    overrides, plus the ``runtime`` fields when ``hf_path`` is set (as the dry run builds it:
    the architecture of an HF run is its preset's)."""
    from models import configs as model_configs

    m = dict(config.get("model") or {})
    overrides = dict(m.get("overrides") or {})
    if m.get("hf_path") and m.get("runtime"):
        overrides.update(dict(m["runtime"]))
    return model_configs.get_model_config(m["preset"], **overrides)


def restore_plan(run_or_config, *, devices: Optional[Sequence[Any]] = None,
                 topology: Optional[str] = None, model_config: Any = None) -> dict:
    """Where ``load_run_model`` (with its default, the run's own mesh) would put each parameter,
    and how many bytes that leaves on each device; nothing is read, nothing allocated.

    Args:
      run_or_config: a run directory (its model config and tokenizer are read, no weights), its
        `RunFiles`, or a training config (dict / ConfigDict, e.g. ``configs/ace30b.py``'s: the
        architecture then comes from ``model.preset`` + overrides, as in the dry run).
      devices: the devices of the mesh (default every device); ``topology``: instead, the
        abstract devices of a TPU slice (``"v5p:4x4x4"``; needs libtpu, no TPU).
      model_config: the `ModelConfig` to use instead of the one the run names.

    Returns a dict: ``devices``, ``mesh`` (axis -> size), ``param_dtype``, ``total_bytes`` (every
    parameter once), ``per_device_bytes`` {max, min, mean} (what each device holds),
    ``largest`` (the 5 parameters with the most bytes per device: name, shape, spec, bytes,
    bytes per device), ``hbm_bytes`` / ``hbm_fraction`` (max per-device bytes over the chip's
    HBM when the devices are TPU chips the compiler knows, else None) and ``export_block``: the
    largest block ``ace_jax.policy.export.export_run`` would read at once from a checkpoint this
    mesh saved (Orbax stores each array in chunks of its shards, split below 400 MiB on GCS /
    2 GiB elsewhere; a block is one chunk range of the stacked axes with the trailing axes
    whole): {name, bytes, gcs} for a ``gs://`` checkpoint directory (``checkpoint.directory`` or
    ``workdir``), else local.
    """
    import numpy as np

    if topology:
        from ace_jax.runtime import tpu_compile

        devices = list(tpu_compile.topology_devices(topology))
    config = _config_of(run_or_config)
    if model_config is None:
        if isinstance(run_or_config, (str, os.PathLike, RunFiles)):
            from models import tokenizer as tok_lib

            run = run_or_config if isinstance(run_or_config, RunFiles) \
                else resolve_run(run_or_config)
            model_config = run_model_config(run, len(tok_lib.load_tokenizer(run.tokenizer_dir)))
        else:
            model_config = _plan_model_config(config)
    placement = run_placement(config, devices)
    _, params_shape = _abstract_params(model_config)
    shardings = placement.params(params_shape)
    from flax import nnx

    per_device: dict[Any, int] = {d: 0 for d in placement.mesh.devices.flat}
    rows, total = [], 0
    for (path, var), (_, sh) in zip(nnx.to_flat_state(params_shape), nnx.to_flat_state(shardings)):
        x = var.get_value() if isinstance(var, nnx.Variable) else var
        sharding = sh.get_value() if isinstance(sh, nnx.Variable) else sh
        itemsize = np.dtype(x.dtype).itemsize
        nbytes = int(np.prod(x.shape)) * itemsize
        total += nbytes
        shard = int(np.prod(sharding.shard_shape(x.shape))) * itemsize
        for d in sharding.device_set:
            per_device[d] += shard
        rows.append(dict(name="/".join(str(p) for p in path), shape=tuple(x.shape),
                         spec=str(sharding.spec), bytes=nbytes, bytes_per_device=shard,
                         shard_shape=tuple(sharding.shard_shape(x.shape))))
    values = list(per_device.values())
    gcs = str((config.get("checkpoint") or {}).get("directory") or config.get("workdir") or "")
    block = _export_block(model_config, rows, gcs.startswith("gs://"))
    hbm = None
    try:
        if devices is not None and getattr(devices[0], "platform", "") == "tpu":
            from ace_jax.runtime import tpu_compile

            hbm = tpu_compile.hbm_bytes(devices[0])
    except Exception:  # noqa: BLE001 - the fraction is a nicety
        hbm = None
    first = next(iter(jax_leaves(params_shape)), None)
    return dict(devices=len(values), mesh=dict(placement.mesh.shape),
                param_dtype=str(first.dtype) if first is not None else None, total_bytes=total,
                per_device_bytes=dict(max=max(values), min=min(values),
                                      mean=sum(values) / len(values)),
                largest=sorted(rows, key=lambda r: -r["bytes_per_device"])[:5],
                hbm_bytes=hbm, hbm_fraction=None if not hbm else max(values) / hbm,
                export_block=block)


def _export_block(model_config, rows: list, gcs: bool) -> dict:
    """The largest read block of a streaming export of a checkpoint saved in the shards of
    ``rows`` (see `restore_plan`)."""
    import math

    import numpy as np
    from orbax.checkpoint._src.arrays import subchunking

    from models import hf_mapping

    leading = {name: len(items[0].index)
               for name, items in hf_mapping.export_plan(model_config).items()}
    target = (400 if gcs else 2048) * 2**20   # Orbax's OCDBT target data file sizes
    best = dict(name=None, bytes=0, chunk=None, gcs=gcs)
    for r in rows:
        itemsize = r["bytes"] // max(1, math.prod(r["shape"]))
        shard = tuple(int(n) for n in r["shard_shape"])
        # as Orbax's tensorstore_utils.calculate_chunk_byte_size: split only above the target
        chunk = subchunking.choose_chunk_shape(
            r["shape"], shard, np.dtype(f"V{itemsize}"),
            target if r["bytes_per_device"] > target else None)
        n = leading.get(r["name"], 0)
        nbytes = math.prod(chunk[:n]) * math.prod(r["shape"][n:]) * itemsize
        if nbytes > best["bytes"]:
            best = dict(name=r["name"], bytes=int(nbytes), chunk=tuple(int(c) for c in chunk),
                        gcs=gcs)
    return best


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
