"""BufferStore on local folders and memory://: round trips, crash recovery, retries, typed errors."""
import json
import uuid

import fsspec
import numpy as np
import pytest
from fsspec.implementations.memory import MemoryFileSystem

from ace_jax.curriculum import buffer as B, buffer_store as S, learnability as L
from sandbox.result import ExecutionResult, Status
from sandbox.tasks.targets import TaskTargets

TARGETS = [TaskTargets("a", gold=0.9, median=0.7, baseline=0.5),
           TaskTargets("b", gold=1.0, median=2.0, baseline=4.0, lower_is_better=True)]


def bcfg(capacity=24):
    c = B.default_config()
    c.capacity = capacity
    c.protect_recent_steps = 0
    c.store.snapshot_every = 3
    c.store.retry_initial_s = 0.0
    return c


def new_buffer(cfg):
    return B.EvolvingBuffer(cfg, TARGETS)


def grow(buf, smp, step, rng):
    """One simulated RL step: select, mark, add a group of children to each selected state."""
    ids = buf.ids_for_slots(smp.select(buf.stats, step, 2))
    buf.mark_sampled(ids, step)
    for sid in ids:
        kids = []
        for j in range(3):
            r = float(rng.integers(0, 2))
            res = (ExecutionResult(Status.OK, valid_submission=True, dev_score=float(rng.random()))
                   if r else ExecutionResult(Status.RUNTIME_ERROR, stderr=f"err {step} {j}"))
            kids.append(B.Child(f"code {sid} {step} {j % 2}", res, r))
        buf.add_children(sid, kids, step)


def assert_same(a, b):
    assert a.states == b.states
    assert a.slot_of == b.slot_of and a.next_id == b.next_id
    for name, arr in a.stats.arrays().items():
        np.testing.assert_array_equal(arr, b.stats.arrays()[name], err_msg=name)


def run_steps(store, buf, smp, steps, rng, start=0):
    for t in range(start, start + steps):
        grow(buf, smp, t, rng)
        store.commit(buf, t, smp.state_dict())


@pytest.fixture(params=["memory", "local"])
def url(request, tmp_path):
    if request.param == "memory":
        u = f"memory://buf-{uuid.uuid4().hex}"
        yield u
        fs = fsspec.filesystem("memory")
        if fs.exists(u):
            fs.rm(u, recursive=True)
    else:
        yield str(tmp_path / "buf")


def fresh(cfg):
    buf = new_buffer(cfg)
    buf.seed([B.SeedSolution("a", "ref a", 0.75), B.SeedSolution("b", "ref b", 1.5)])
    return buf, L.Sampler.from_config(L.default_config())


def test_round_trip_restores_everything_exactly(url):
    cfg = bcfg()
    buf, smp = fresh(cfg)
    store = S.BufferStore(url, cfg.store)
    assert store.restore(new_buffer(cfg)) is None  # empty store
    run_steps(store, buf, smp, 8, np.random.default_rng(0))  # snapshots + segments + pruning
    assert len(buf) <= cfg.capacity
    other = new_buffer(cfg)
    info = S.BufferStore(url, cfg.store).restore(other)
    assert info.step == 7 and info.dropped == []
    assert_same(buf, other)
    smp2 = L.Sampler.from_config(L.default_config())
    smp2.load_state_dict(info.sampler_state)
    np.testing.assert_array_equal(smp2.select(other.stats, 8, 2), smp.select(buf.stats, 8, 2))
    # the restored copy keeps committing where the original left off
    store2 = S.BufferStore(url, cfg.store)
    third = new_buffer(cfg)
    store2.restore(third)
    grow(third, smp2, 9, np.random.default_rng(5))
    seq = store2.commit(third, 9, smp2.state_dict())
    fourth = new_buffer(cfg)
    assert S.BufferStore(url, cfg.store).restore(fourth).seq == seq
    assert_same(third, fourth)


def _committed_copy(url, cfg):
    b = new_buffer(cfg)
    info = S.BufferStore(url, cfg.store).restore(b)
    return b, info


def _files(store, sub):
    return sorted(store._list(sub))


def test_uncommitted_tail_is_ignored(url):
    cfg = bcfg()
    buf, smp = fresh(cfg)
    store = S.BufferStore(url, cfg.store)
    run_steps(store, buf, smp, 4, np.random.default_rng(1))
    before, info = _committed_copy(url, cfg)
    # a crash after writing a segment but before its manifest, and a half-written next segment
    grow(buf, smp, 4, np.random.default_rng(2))
    rec = buf.export_delta()
    data = S._encode(rec, 4, smp.state_dict())
    store.fs.pipe_file(store._path("segments", f"{store._seq + 1:012d}.npz"), data)
    store.fs.pipe_file(store._path("segments", f"{store._seq + 2:012d}.npz"), data[: len(data) // 2])
    after, info2 = _committed_copy(url, cfg)
    assert_same(before, after)
    assert info2.seq == info.seq and info2.dropped == []
    # and a new writer does not collide with the orphans: its commit is readable
    s2 = S.BufferStore(url, cfg.store)
    s2.restore(after)
    grow(after, smp, 5, np.random.default_rng(3))
    s2.commit(after, 5, smp.state_dict())
    again, _ = _committed_copy(url, cfg)
    assert_same(after, again)


def test_torn_manifest_falls_back_to_previous_commit(url):
    cfg = bcfg()
    buf, smp = fresh(cfg)
    store = S.BufferStore(url, cfg.store)
    run_steps(store, buf, smp, 4, np.random.default_rng(1))
    prev, prev_info = _committed_copy(url, cfg)
    run_steps(store, buf, smp, 1, np.random.default_rng(2), start=4)
    newest = _files(store, "manifests")[-1]
    raw = store.fs.cat_file(newest)
    store.fs.pipe_file(newest, raw[: len(raw) // 3])  # torn write of the commit marker
    got, info = _committed_copy(url, cfg)
    assert_same(prev, got)
    assert info.seq == prev_info.seq and any("manifests" in d for d in info.dropped)


def test_truncated_committed_segment_loses_only_the_tail(url):
    cfg = bcfg()
    cfg.store.snapshot_every = 10
    buf, smp = fresh(cfg)
    store = S.BufferStore(url, cfg.store)
    rng = np.random.default_rng(7)
    run_steps(store, buf, smp, 3, rng)           # snapshot 0, segments 1, 2
    prefix, _ = _committed_copy(url, cfg)
    run_steps(store, buf, smp, 2, rng, start=3)  # segments 3, 4
    segs = _files(store, "segments")
    victim = segs[2]                              # segment of commit 3
    raw = store.fs.cat_file(victim)
    store.fs.pipe_file(victim, raw[:-10])
    got, info = _committed_copy(url, cfg)
    assert_same(prefix, got)
    assert info.seq == 2 and len(info.dropped) == 2
    # the next commit after a lossy restore is a full snapshot; the store is healthy again
    s2 = S.BufferStore(url, cfg.store)
    s2.restore(got)
    grow(got, smp, 10, rng)
    seq = s2.commit(got, 10, smp.state_dict())
    assert any(p.endswith(f"{seq:012d}.npz") for p in _files(s2, "snapshots"))
    again, info3 = _committed_copy(url, cfg)
    assert_same(got, again) and info3.dropped == []


def test_unreadable_store_is_a_typed_error(url):
    cfg = bcfg()
    buf, smp = fresh(cfg)
    store = S.BufferStore(url, cfg.store)
    store.commit(buf, 0, smp.state_dict())
    snap = _files(store, "snapshots")[0]
    store.fs.pipe_file(snap, b"garbage")
    with pytest.raises(S.CorruptStoreError, match="no committed buffer state"):
        S.BufferStore(url, cfg.store).restore(new_buffer(cfg))
    with pytest.raises(ValueError, match="non-empty url"):
        S.BufferStore("", cfg.store)


def test_old_files_are_collected(url):
    cfg = bcfg()
    cfg.store.snapshot_every = 2
    buf, smp = fresh(cfg)
    store = S.BufferStore(url, cfg.store)
    run_steps(store, buf, smp, 9, np.random.default_rng(4))
    assert len(_files(store, "manifests")) <= cfg.store.keep_manifests + cfg.store.snapshot_every
    assert len(_files(store, "snapshots")) <= 2 and len(_files(store, "segments")) <= 2
    got, _ = _committed_copy(url, cfg)
    assert_same(buf, got)


# ---------------------------------------------------------------- fault injection at the fs layer
class FlakyMemoryFS(MemoryFileSystem):
    """An fsspec filesystem that fails the first ``fail_next`` data operations with ``error``."""

    protocol = ("flakymem",)
    fail_next = 0
    error: Exception = ConnectionResetError("connection reset by peer")
    failures = 0

    def _maybe_fail(self):
        if type(self).fail_next > 0:
            type(self).fail_next -= 1
            type(self).failures += 1
            raise type(self).error

    def pipe_file(self, path, value, **kw):
        self._maybe_fail()
        return super().pipe_file(path, value, **kw)

    def cat_file(self, path, start=None, end=None, **kw):
        self._maybe_fail()
        return super().cat_file(path, start, end, **kw)


@pytest.fixture
def flaky():
    FlakyMemoryFS.fail_next, FlakyMemoryFS.failures = 0, 0
    FlakyMemoryFS.error = ConnectionResetError("connection reset by peer")
    fs = FlakyMemoryFS(skip_instance_cache=True)
    root = f"/flaky-{uuid.uuid4().hex}"
    yield fs, root
    FlakyMemoryFS.fail_next = 0
    if fs.exists(root):
        fs.rm(root, recursive=True)


def test_transient_errors_are_retried_with_backoff(flaky):
    fs, root = flaky
    cfg = bcfg()
    cfg.store.retry_initial_s, cfg.store.retry_multiplier, cfg.store.retry_max_s = 0.1, 2.0, 0.3
    sleeps = []
    store = S.BufferStore(root, cfg.store, fs=fs, sleep=sleeps.append)
    buf, smp = fresh(cfg)
    FlakyMemoryFS.fail_next = 3
    store.commit(buf, 0, smp.state_dict())
    assert FlakyMemoryFS.failures == 3 and store.retries == 3
    assert len(sleeps) == 3 and 0.05 <= sleeps[0] <= 0.1 and 0.1 <= sleeps[1] <= 0.2 and sleeps[2] <= 0.3
    FlakyMemoryFS.fail_next = 2
    got = new_buffer(cfg)
    S.BufferStore(root, cfg.store, fs=fs, sleep=lambda s: None).restore(got)
    assert_same(buf, got)


def test_persistent_or_permanent_errors_raise_typed_errors(flaky):
    fs, root = flaky
    cfg = bcfg()
    cfg.store.retry_attempts = 3
    store = S.BufferStore(root, cfg.store, fs=fs, sleep=lambda s: None)
    buf, smp = fresh(cfg)
    store.commit(buf, 0, smp.state_dict())
    grow(buf, smp, 1, np.random.default_rng(0))
    FlakyMemoryFS.fail_next = 10
    with pytest.raises(S.StoreUnavailableError, match="3 times"):
        store.commit(buf, 1, smp.state_dict())
    assert FlakyMemoryFS.failures == 3
    # nothing of the failed commit is visible; the next commit is a full snapshot
    FlakyMemoryFS.fail_next = 0
    assert store._force_snapshot
    store.commit(buf, 2, smp.state_dict())
    got = new_buffer(cfg)
    assert S.BufferStore(root, cfg.store, fs=fs).restore(got).step == 2
    assert_same(buf, got)
    # a permanent error is not retried
    FlakyMemoryFS.error, FlakyMemoryFS.fail_next, FlakyMemoryFS.failures = PermissionError("denied"), 5, 0
    with pytest.raises(PermissionError):
        store.commit(buf, 3, smp.state_dict())
    assert FlakyMemoryFS.failures == 1


def test_is_transient_classification():
    class Http(Exception):
        def __init__(self, code):
            self.code = code
    assert S.is_transient(ConnectionResetError()) and S.is_transient(TimeoutError())
    assert S.is_transient(Http(503)) and S.is_transient(Http(429)) and S.is_transient(Http("500"))
    assert not S.is_transient(Http(404)) and not S.is_transient(FileNotFoundError())
    assert not S.is_transient(PermissionError()) and not S.is_transient(ValueError())


def test_manifest_is_written_after_its_data(url):
    """The manifest references only complete files (size and checksum match)."""
    cfg = bcfg()
    buf, smp = fresh(cfg)
    store = S.BufferStore(url, cfg.store)
    run_steps(store, buf, smp, 4, np.random.default_rng(9))
    m = json.loads(store.fs.cat_file(_files(store, "manifests")[-1]))
    for e in [m["snapshot"], *m["segments"]]:
        data = store.fs.cat_file(store._path(e["path"]))
        assert len(data) == e["size"] and S._sha256(data) == e["sha256"]
