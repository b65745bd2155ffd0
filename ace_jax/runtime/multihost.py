"""What every process of a multi-host run must agree on, and how it gets there.

Every process runs the same program on the same global arrays (DESIGN.md, Sharding). Two things
need moving between processes:

* `host_value`: a global array whose shards live on other processes (e.g. the generated tokens,
  split over the mesh's 'batch' rule) as one numpy array that every process holds whole;
* `allgather_json`: plain Python records (e.g. each process's sandbox `ExecutionResult`s for its
  share of the rollouts) gathered so that every process ends with every record, in process order.

`my_share(n)` says which of ``n`` items (rollouts) this process executes. With one process all of
these are cheap identities, so the single-host code path is the same code.

`barrier(name)` waits for every process at a named point, with its own (long) timeout: it goes
through the JAX distributed client's coordination-service barrier (a private JAX API, isolated in
`_coordination_client`; JAX's public `sync_global_devices`, a device collective without a timeout,
is the fallback).

A peer that dies makes these collectives fail (or time out) on the other processes; `PeerLostError`
wraps that failure in a message that says which process saw it, which one was lost (when the
runtime names it) and what to do, and prints it to stderr at once: JAX's coordination service
ends the survivors itself once the lost peer's heartbeat times out (``mesh.heartbeat_timeout_s``),
possibly before the exception reaches the top of the program. `lost_peer_guard` /
`raise_if_peer_lost` turn the runtime's own errors of a lost peer (e.g. a jitted collective's or
Orbax's barrier's) into the same `PeerLostError`.
"""
from __future__ import annotations

import contextlib
import json
import re
import socket
import sys
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import jax
import numpy as np

__all__ = ["PeerLostError", "host_value", "allgather_json", "my_share", "is_multi_process",
           "barrier", "lost_peer_guard", "raise_if_peer_lost", "RELAUNCH_ADVICE",
           "BARRIER_TIMEOUT_S"]

# What a process that lost a peer tells the user (the end of every PeerLostError's message).
RELAUNCH_ADVICE = ("Stop every process of this run, then start the same command again on every "
                   "host: the run resumes from its last checkpoint.")
# How long `barrier` waits for the slowest process. Hosts reach a barrier minutes apart (each
# loads its slices of the weights, stages its tasks); a process that died is noticed sooner, by
# its missed heartbeats (mesh.heartbeat_timeout_s), which fail the barrier on every survivor.
BARRIER_TIMEOUT_S = 3600


class PeerLostError(RuntimeError):
    """A collective with the other processes failed: a peer died or is unreachable."""


def is_multi_process() -> bool:
    return jax.process_count() > 1


def _lost_processes(text: str) -> list[int]:
    """The process ids a runtime error names as lost (the coordination service's "Task 1
    heartbeat timeout" / "tasks are unhealthy (stopped sending heartbeats): 1 3"); [] when it
    names none (e.g. gloo's "Connection closed by peer")."""
    ids = {int(m) for m in re.findall(r"[Tt]ask (\d+) heartbeat", text)}
    m = re.search(r"unhealthy \(stopped sending heartbeats\):\s*([\d,\s]+)", text)
    if m:
        ids |= {int(x) for x in re.findall(r"\d+", m[1])}
    return sorted(ids)


def _wrap(what: str, e: BaseException) -> PeerLostError:
    """The PeerLostError of a failed collective, printed to stderr at once (JAX may end this
    process before the exception is reported: see the module docstring)."""
    detail = " ".join(f"{type(e).__name__}: {e}".split())
    lost = _lost_processes(str(e))
    who = (f" (process {', '.join(map(str, lost))})" if lost else "")
    which = ("" if lost else " (JAX names it once its heartbeat times out: 'The following tasks "
             "are unhealthy (stopped sending heartbeats)', in this log or process 0's)")
    msg = (f"process {jax.process_index()} of {jax.process_count()} ({socket.gethostname()}): "
           f"{what} failed ({detail[:400]}). Another process of this run{who} died or lost its "
           f"connection{which}. {RELAUNCH_ADVICE}")
    print(f"PeerLostError: {msg}", file=sys.stderr, flush=True)
    return PeerLostError(msg)


# markers of the runtime's errors when a peer is gone: gloo (CPU collectives), the coordination
# service (barriers, heartbeats), a collective's transport
_PEER_LOSS_MARKERS = ("gloo", "by peer", "heartbeat", "coordination", "barrier",
                      "task is set to error", "unavailable", "deadline_exceeded",
                      "connection reset", "connection refused", "socket closed")


def _chain(e: Optional[BaseException]) -> Iterator[BaseException]:
    """``e`` and the exceptions it was raised from or during (a bounded walk)."""
    for _ in range(8):
        if e is None:
            return
        yield e
        e = e.__cause__ or e.__context__


def _is_peer_loss(e: BaseException) -> bool:
    return any(type(x).__name__ in ("JaxRuntimeError", "XlaRuntimeError")
               and any(k in str(x).lower() for k in _PEER_LOSS_MARKERS) for x in _chain(e))


def raise_if_peer_lost(e: BaseException, what: Union[str, Callable[[], str]]) -> None:
    """Raises a PeerLostError when this is a multi-process run and ``e`` is the runtime's error
    of a lost peer (a failed collective or barrier), or was raised while handling one (the
    PeerLostError already made is raised again); returns otherwise, so the caller handles
    ``e`` as before."""
    for x in _chain(e):
        if isinstance(x, PeerLostError):
            raise x
    if is_multi_process() and _is_peer_loss(e):
        raise _wrap(what() if callable(what) else what, e) from e


@contextlib.contextmanager
def lost_peer_guard(what: Union[str, Callable[[], str]]) -> Iterator[None]:
    """Inside, the runtime's errors of a lost peer (see `raise_if_peer_lost`) are raised as
    `PeerLostError`; any other exception passes unchanged. ``what``: what was being done (or
    a function that says it when the error comes)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - re-raised unchanged unless it is a lost peer
        raise_if_peer_lost(e, what)
        raise


def host_value(x: Any) -> np.ndarray:
    """The whole value of ``x`` (a jax.Array, possibly sharded over other processes' devices, or
    anything numpy accepts) as a numpy array on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        try:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        except Exception as e:  # noqa: BLE001 - the runtime raises many types for a lost peer
            raise _wrap("gathering an array", e) from e
    return np.asarray(x)


def my_share(n: int) -> range:
    """The indices of ``n`` items that this process handles: a contiguous block per process
    (the last ones may be shorter or empty)."""
    per = -(-n // jax.process_count())
    start = min(n, jax.process_index() * per)
    return range(start, min(n, start + per))


def allgather_json(items: Sequence[Any]) -> list[Any]:
    """Every process's ``items`` (JSON-serialisable values), concatenated in process order, on
    every process. One process: ``list(items)``."""
    if not is_multi_process():
        return list(items)
    from jax.experimental import multihost_utils

    payload = np.frombuffer(json.dumps(list(items)).encode(), np.uint8)
    try:
        sizes = multihost_utils.process_allgather(np.asarray([payload.size], np.int64))
        width = int(np.max(sizes))
        padded = np.zeros((width,), np.uint8)
        padded[:payload.size] = payload
        gathered = multihost_utils.process_allgather(padded)
    except Exception as e:  # noqa: BLE001 - the runtime raises many types for a lost peer
        raise _wrap("gathering execution results", e) from e
    out: list[Any] = []
    for row, size in zip(np.asarray(gathered).reshape(-1, width), np.asarray(sizes).reshape(-1)):
        out.extend(json.loads(bytes(row[:int(size)]).decode()))
    return out


def _coordination_client() -> Optional[Any]:
    """JAX's distributed-runtime client (``jax._src.distributed.global_state.client``, a private
    API) when it offers ``wait_at_barrier``; None otherwise (then `barrier` falls back on the
    public ``sync_global_devices``)."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    client = getattr(getattr(distributed, "global_state", None), "client", None)
    return client if hasattr(client, "wait_at_barrier") else None


_barrier_calls: dict[str, int] = {}


def barrier(name: str, timeout_s: float = BARRIER_TIMEOUT_S) -> None:
    """Waits until every process reached the barrier ``name`` (no-op with one process), for at
    most ``timeout_s`` seconds; a dead peer fails it sooner (its heartbeat timeout). Every
    process must call the same barriers in the same order (the n-th call of a name is its own
    barrier). Raises PeerLostError when the barrier fails."""
    if not is_multi_process():
        return
    n = _barrier_calls[name] = _barrier_calls.get(name, -1) + 1
    key = f"ace_jax:{name}:{n}"
    client = _coordination_client()
    try:
        if client is not None:
            client.wait_at_barrier(key, int(timeout_s * 1000))
        else:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(key)
    except Exception as e:  # noqa: BLE001 - the runtime raises many types for a lost peer
        raise _wrap(f"waiting at barrier {name!r} (up to {timeout_s:.0f} s)", e) from e
