"""One process of a 2-process load of a run (test_two_process.py starts two of these, 4 CPU
devices each, as two hosts of a pod):

    python -m tests.ace_jax.policy.two_process_load <workdir> <out_dir> <port> <process_id>

1. ``jax.distributed`` over gloo; ``load_run_model(workdir)`` with its default placement: the
   run's own mesh (its saved ``mesh`` section) over the 8 devices of both processes, each
   parameter restored straight into its shards;
2. writes, per parameter, its spec and the bytes of the shards this process holds, and the bytes
   this process read from the checkpoint (tensorstore's counter);
3. the logits of a fixed batch (a jitted forward pass over the global arrays, gathered);
4. greedy replies of ``JaxPolicy`` in ``multihost="leader"`` mode: process 0 calls ``complete``,
   process 1 replays its engine calls in ``follow()``; process 0 then releases it.

Each process writes ``<out_dir>/proc<i>.json``.
"""
from __future__ import annotations

import json
import os
import sys

import jax

CONVERSATIONS = [[{"role": "user", "content": "train a model"}],
                 [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
                 [{"role": "user", "content": "import numpy as np"}]]
MAX_NEW_TOKENS = 8
BATCH = (2, 12)   # the logits' batch: [2, 12] token ids from a fixed seed


def batch_ids(vocab: int):
    import numpy as np

    return np.random.default_rng(0).integers(0, vocab, size=BATCH).astype(np.int32)


def forward(model, ids, placement=None):
    """Logits of ``ids`` (numpy) as a numpy array, on the model's devices."""
    import numpy as np
    from flax import nnx

    from ace_jax.runtime import multihost

    pos = np.broadcast_to(np.arange(ids.shape[1], dtype=np.int32), ids.shape)
    graphdef, params = nnx.split(model, nnx.Param)
    if placement is not None:
        ids, pos = placement.replicate((ids, pos))

    @jax.jit
    def run(params, ids, pos):
        return nnx.merge(graphdef, params)(ids, pos).logits

    return multihost.host_value(run(params, ids, pos))


QUEUED = 40   # requests queued at once in a server-style engine: more messages than one ack


def engine_requests(jax_policy) -> list:
    """The server's way (``engines.JaxEngine``): ``QUEUED`` requests submitted to an engine of
    8 slots, then stepped until all have finished; the greedy tokens of each, in order."""
    engine = jax_policy.make_engine(jax_policy.engine_config(slots=8))
    prompts = [jax_policy.encode(CONVERSATIONS[i % len(CONVERSATIONS)])[0] for i in range(QUEUED)]
    ids = [engine.submit(p, key=jax.random.key(i), temperature=0.0) for i, p in enumerate(prompts)]
    done = {}
    while len(done) < QUEUED:
        for c in engine.step():
            done[c.request] = list(c.tokens)
    return [done[i] for i in ids]


def main(workdir: str, out_dir: str, port: int, process_id: int) -> None:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2,
                               process_id=process_id)
    from flax import nnx

    from ace_jax.policy import mirror, policy, runs
    from ace_jax.runtime import checkpoint
    from models import qwen3

    before = checkpoint.bytes_read()
    model, tokenizer, step = runs.load_run_model(workdir)
    read = checkpoint.bytes_read() - before
    params = {}
    for name, x in qwen3.flat_params(model).items():
        shards = x.addressable_shards
        distinct = {tuple(sl.indices(n)[:2] for sl, n in zip(s.index, x.shape)): s.data
                    for s in shards}   # replicas of one block counted once
        params[name] = dict(
            shape=list(x.shape), spec=str(x.sharding.spec), devices=len(x.sharding.device_set),
            bytes=int(x.size * x.dtype.itemsize), local_devices=len(shards),
            shard_shapes=sorted({tuple(s.data.shape) for s in shards}),
            want_shard_shape=list(x.sharding.shard_shape(x.shape)),
            local_bytes=sum(int(d.size * d.dtype.itemsize) for d in distinct.values()))
    placement = runs.run_placement(workdir)
    logits = forward(model, batch_ids(model.config.vocab_size), placement)
    jax_policy = policy.JaxPolicy(model, tokenizer, max_new_tokens=MAX_NEW_TOKENS,
                                  placement=placement, multihost="leader", slots=8)
    replies, replayed, queued = None, None, None
    if process_id == 0:
        try:
            replies = [c.token_ids for c in jax_policy.complete(CONVERSATIONS)]
            again = [c.token_ids for c in jax_policy.complete(CONVERSATIONS[:1])]
            assert again == replies[:1], (again, replies[:1])
            queued = engine_requests(jax_policy)
        finally:
            mirror.release_followers()
    else:
        replayed = mirror.follow(poll_s=5)
    with open(os.path.join(out_dir, f"proc{process_id}.json"), "w") as f:
        json.dump(dict(step=step, process=jax.process_index(), processes=jax.process_count(),
                       devices=jax.device_count(), local_devices=jax.local_device_count(),
                       mesh=dict(placement.mesh.shape), mirrored=jax_policy.mirrored,
                       bytes_read=read, params=params, logits=logits.tolist(),
                       replies=replies, replayed=replayed, queued=queued,
                       messages_deleted=mirror._MIRROR.deleted), f)
    del nnx


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
