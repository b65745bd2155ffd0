"""BufferStore against a real GCS emulator (gcp-storage-emulator on loopback) through gcsfs."""
import json
import time

import numpy as np
import pytest

from ace_jax.curriculum import buffer_store as S
from tests.ace_jax.curriculum.test_buffer_store import assert_same, bcfg, fresh, grow, new_buffer, run_steps


def test_gcs_round_trip_and_crash_tail(gcs_emulator):
    fs = gcs_emulator.fs()
    root = gcs_emulator.prefix()
    cfg = bcfg()
    buf, smp = fresh(cfg)
    store = S.BufferStore(root, cfg.store, fs=fs)
    run_steps(store, buf, smp, 5, np.random.default_rng(0))  # a snapshot and segments
    got = new_buffer(cfg)
    info = S.BufferStore(root, cfg.store, fs=gcs_emulator.fs()).restore(got)
    assert info.step == 4 and info.dropped == []
    assert_same(buf, got)
    np.testing.assert_array_equal(info.sampler_state["key_data"], smp.state_dict()["key_data"])
    # crash: an orphan segment (no manifest) and a torn newest manifest -> previous commit
    grow(buf, smp, 5, np.random.default_rng(1))
    store.commit(buf, 5, smp.state_dict())
    fs.pipe_file(store._path("segments", f"{store._seq + 1:012d}.npz"), b"PK\x03\x04 half")
    newest = sorted(store._list("manifests"))[-1]
    raw = fs.cat_file(newest)
    fs.pipe_file(newest, raw[:20])
    again = new_buffer(cfg)
    info2 = S.BufferStore(root, cfg.store, fs=gcs_emulator.fs()).restore(again)
    assert info2.step == 4
    assert_same(got, again)


def test_gcs_transient_failure_is_retried(gcs_emulator, faulty_proxy):
    """The proxy answers 503 to one request at the HTTP transport; the commit still lands."""
    root = gcs_emulator.prefix()
    cfg = bcfg()
    buf, smp = fresh(cfg)
    store = S.BufferStore(root, cfg.store, fs=gcs_emulator.fs(faulty_proxy.endpoint))
    store.commit(buf, 0, smp.state_dict())
    faulty_proxy.fail_next = 1
    t = time.perf_counter()
    grow(buf, smp, 1, np.random.default_rng(2))
    store.commit(buf, 1, smp.state_dict())
    assert faulty_proxy.failed == 1 and faulty_proxy.fail_next == 0
    assert time.perf_counter() - t < 15
    got = new_buffer(cfg)
    S.BufferStore(root, cfg.store, fs=gcs_emulator.fs()).restore(got)
    assert_same(buf, got)


def test_gcs_permanent_http_error_is_not_swallowed(gcs_emulator, faulty_proxy):
    root = gcs_emulator.prefix()
    cfg = bcfg()
    buf, smp = fresh(cfg)
    store = S.BufferStore(root, cfg.store, fs=gcs_emulator.fs(faulty_proxy.endpoint))
    faulty_proxy.fail_status, faulty_proxy.fail_next = 403, 1
    with pytest.raises(Exception) as ei:
        store.commit(buf, 0, smp.state_dict())
    # gcsfs reports a 403 as OSError("Forbidden ..."): raised at once, not retried by us
    assert isinstance(ei.value, OSError) and "Forbidden" in str(ei.value)
    assert not isinstance(ei.value, S.StoreUnavailableError)
    assert faulty_proxy.failed == 1 and store.retries == 0
    faulty_proxy.fail_next = 0
    store.commit(buf, 1, smp.state_dict())  # the store recovers with a full snapshot
    got = new_buffer(cfg)
    assert S.BufferStore(root, cfg.store, fs=gcs_emulator.fs()).restore(got).step == 1
    assert_same(buf, got)


def test_gcs_url_with_storage_options(gcs_emulator):
    import gcsfs
    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        pytest.skip("gcsfs was imported before conftest set GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false; "
                    "its gRPC bucket-type probe stalls against the emulator")
    cfg = bcfg()
    buf, smp = fresh(cfg)
    url = f"gs://{gcs_emulator.prefix()}"
    opts = {"endpoint_url": gcs_emulator.endpoint, "token": "anon", "project": "test"}
    store = S.BufferStore(url, cfg.store, storage_options=opts)
    store.commit(buf, 0, smp.state_dict())
    got = new_buffer(cfg)
    assert S.BufferStore(url, cfg.store, storage_options=opts).restore(got).step == 0
    assert_same(buf, got)
    m = json.loads(store.fs.cat_file(sorted(store._list("manifests"))[-1]))
    assert m["snapshot"]["path"].startswith("snapshots/")
