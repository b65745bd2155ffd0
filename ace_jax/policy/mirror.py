"""Several processes, one leader: process 0's engine calls of a ``multihost="leader"``
`policy.JaxPolicy`, mirrored to the other processes of a pod, which replay them in `follow()`
until process 0 calls `release_followers()`; and `init_multihost`, the ``jax.distributed`` set-up
of a command that loads a run on every host, with `define_pod_flags`, that command's flags for it.

Nothing here runs at import time; JAX is imported lazily.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

from ace_jax.policy.interface import PolicyError


def spans_processes(model) -> bool:
    """Whether some parameter of ``model`` lives on devices of other processes too."""
    import jax
    from flax import nnx

    if jax.process_count() == 1:
        return False
    return any(isinstance(x, jax.Array) and not x.is_fully_addressable
               for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def register_mirrored(policy) -> int:
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
            self.send({"op": "engine", "policy": policy.mirror_id, "engine": engine_id,
                       "config": dataclasses.asdict(config)})
            proxy = _LeaderEngine(policy.local_engine(config), engine_id)
        weakref.finalize(proxy, self.dropped.append, engine_id)   # sent with the next message
        return proxy


_MIRROR = _Mirror()


def leader_engine(policy, config):
    """Process 0's new engine of the mirrored ``policy`` (``config``: an ``EngineConfig``), built
    on every process: each call it makes is first sent to the other processes."""
    return _MIRROR.engine(policy, config)


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
            engines[msg["engine"]] = policy.local_engine(EngineConfig(**msg["config"]))
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


@dataclasses.dataclass(frozen=True)
class PodFlags:
    """The absl flags (``FlagHolder``s) of a command that loads a run on every host of a pod:
    ``jax.distributed`` as the trainer's ``mesh.*`` keys set it up, and XLA's compilation cache."""
    distributed: Any
    coordinator_address: Any
    num_processes: Any
    process_id: Any
    compile_cache_dir: Any

    def start(self) -> bool:
        """Turns the compilation cache on (unset: its default folder), then `init_multihost`;
        call it before anything touches a JAX backend. Returns whether it initialised."""
        from ace_jax.runtime import compile_cache

        compile_cache.enable(self.compile_cache_dir.value)
        return init_multihost(self.distributed.value, self.coordinator_address.value,
                              self.num_processes.value, self.process_id.value)


def define_pod_flags() -> PodFlags:
    """Defines ``--distributed``, ``--coordinator_address``, ``--num_processes``,
    ``--process_id`` and ``--compile_cache_dir`` (``launch/evaluate.py``, ``launch/serve.py``
    call it once, at module level, then ``flags.adopt_module_key_flags(mirror)`` so that their
    ``--help`` lists them)."""
    from absl import flags

    return PodFlags(
        distributed=flags.DEFINE_enum(
            "distributed", "auto", ["auto", "always", "never"], "jax.distributed for a pod "
            "(every host runs this command): auto = on a TPU VM or when the environment names "
            "several processes."),
        coordinator_address=flags.DEFINE_string(
            "coordinator_address", "", "jax.distributed coordinator host:port (default: "
            "detected)."),
        num_processes=flags.DEFINE_integer("num_processes", 0, "Processes (0: detected)."),
        process_id=flags.DEFINE_integer("process_id", -1, "This process (-1: detected)."),
        compile_cache_dir=flags.DEFINE_string(
            "compile_cache_dir", None, "XLA's persistent compilation cache (ace_jax/runtime/"
            "compile_cache.py): a restart reuses what an earlier process compiled. Default "
            "~/.cache/ace_jax/xla, the training runs' default; '' = off."))


def release_followers() -> None:
    """Process 0: tells the other processes' `follow()` to return (after the evaluation or
    when the server stops). No-op with one process or no mirrored policy."""
    import jax

    if jax.process_count() > 1 and jax.process_index() == 0 and _MIRROR.policies:
        _MIRROR.send({"op": "stop"})

