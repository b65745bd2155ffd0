"""What every process of a multi-host run must agree on, and how it gets there.

Every process runs the same program on the same global arrays (DESIGN.md, Sharding). Two things
need moving between processes:

* `host_value`: a global array whose shards live on other processes (e.g. the generated tokens,
  split over the mesh's 'batch' rule) as one numpy array that every process holds whole;
* `allgather_json`: plain Python records (e.g. each process's sandbox `ExecutionResult`s for its
  share of the rollouts) gathered so that every process ends with every record, in process order.

`my_share(n)` says which of ``n`` items (rollouts) this process executes. With one process all of
these are cheap identities, so the single-host code path is the same code.

A peer that dies makes these collectives fail (or time out) on the other processes; `PeerLostError`
wraps that failure in a message that says what to do.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import jax
import numpy as np

__all__ = ["PeerLostError", "host_value", "allgather_json", "my_share", "is_multi_process",
           "barrier"]


class PeerLostError(RuntimeError):
    """A collective with the other processes failed: a peer died or is unreachable."""


def is_multi_process() -> bool:
    return jax.process_count() > 1


def _wrap(what: str, e: BaseException) -> PeerLostError:
    return PeerLostError(
        f"{what} across {jax.process_count()} processes failed ({type(e).__name__}: "
        f"{str(e)[:300]}). Another process of this run most likely died or lost its connection: "
        "stop every process and start the same command on every host again; the run resumes "
        "from its last checkpoint.")


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


def barrier(name: str) -> None:
    """Waits until every process reached the barrier ``name`` (no-op with one process)."""
    if not is_multi_process():
        return
    from jax.experimental import multihost_utils

    try:
        multihost_utils.sync_global_devices(name)
    except Exception as e:  # noqa: BLE001 - the runtime raises many types for a lost peer
        raise _wrap(f"waiting at barrier {name!r}", e) from e
