"""Tests for ace_jax.runtime.checkpoint: exact resume, corruption handling with fallback, mismatches."""
import logging
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ace_jax.runtime import checkpoint as ck

D_IN, D_OUT, BATCH = 5, 3, 8
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2, weight_decay=1e-3))


def init_state(seed, d_in=D_IN):
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"dense": {"kernel": jax.random.normal(k1, (d_in, D_OUT)),
                        "bias": jnp.zeros((D_OUT,))},
              "scale": jnp.ones(())}
    return ck.TrainState(step=0, params=params, opt_state=TX.init(params), rng=k2,
                         sampler_state={"cursor": 0, "history": []})


@jax.jit
def train_step(params, opt_state, rng):
    rng, data_key, noise_key = jax.random.split(rng, 3)
    x = jax.random.normal(data_key, (BATCH, D_IN))
    y = jnp.tanh(x[:, :D_OUT]) + 0.1 * jax.random.normal(noise_key, (BATCH, D_OUT))

    def loss_fn(p):
        pred = (x @ p["dense"]["kernel"] + p["dense"]["bias"]) * p["scale"]
        return jnp.mean((pred - y) ** 2)

    grads = jax.grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, rng


def run(state, n):
    params, opt_state, rng = state.params, state.opt_state, state.rng
    sampler = dict(state.sampler_state)
    for _ in range(n):
        params, opt_state, rng = train_step(params, opt_state, rng)
        sampler = {"cursor": sampler["cursor"] + BATCH,
                   "history": sampler["history"] + [sampler["cursor"]]}
    return ck.TrainState(step=state.step + n, params=params, opt_state=opt_state, rng=rng,
                         sampler_state=sampler)


def assert_bitwise_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x.reshape(-1).view(np.uint8), y.reshape(-1).view(np.uint8))


def test_resume_is_bitwise_exact(tmp_path):
    straight = run(init_state(0), 5)

    with ck.Checkpointer(str(tmp_path), keep=2) as mgr:
        assert mgr.restore_latest(init_state(1)) is None
        s = init_state(0)
        for _ in range(3):
            s = run(s, 1)
            assert mgr.save(s)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [2, 3]

    # a fresh manager and a differently initialised target, as a new process would have
    with ck.Checkpointer(str(tmp_path), keep=2) as mgr2:
        restored = mgr2.restore_latest(init_state(123))
    assert restored.step == 3
    assert restored.sampler_state == {"cursor": 24, "history": [0, 8, 16]}
    assert jnp.issubdtype(restored.rng.dtype, jax.dtypes.prng_key)
    resumed = run(restored, 2)
    assert resumed.step == 5 and resumed.sampler_state == straight.sampler_state
    assert_bitwise_equal(resumed.params, straight.params)
    assert_bitwise_equal(resumed.opt_state, straight.opt_state)
    assert_bitwise_equal(resumed.rng, straight.rng)
    assert isinstance(resumed.opt_state[1][0], optax.ScaleByAdamState)


def test_sharded_save_and_restore_into_target_shardings(tmp_path):
    from ace_jax.runtime import sharding as sh
    cfg = sh.default_config()
    mesh = sh.make_mesh(cfg, devices=jax.devices()[:2]) if jax.device_count() >= 2 else None
    if mesh is None:
        pytest.skip(f"needs >= 2 devices, have {jax.device_count()}")
    axes = {"dense": {"kernel": (None, "embed"), "bias": ("embed",)}, "scale": ()}
    state = init_state(0, d_in=4)
    state.params = {"dense": {"kernel": jnp.ones((4, 4)), "bias": jnp.arange(4.0)},
                    "scale": jnp.ones(())}
    shard = sh.shardings_for(axes, state.params, mesh, sh.DEFAULT_RULES)
    state.params = sh.place(state.params, shard)
    state.opt_state = sh.init_sharded_optimizer_state(TX, state.params, shard, mesh)
    with ck.Checkpointer(str(tmp_path)) as mgr:
        mgr.save(state)
    target = ck.TrainState(0, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                          sharding=x.sharding),
                                           state.params),
                           state.opt_state, jax.random.key(9), None)
    with ck.Checkpointer(str(tmp_path)) as mgr:
        out = mgr.restore(0, target)
    assert out.params["dense"]["kernel"].sharding.spec == shard["dense"]["kernel"].spec
    np.testing.assert_array_equal(out.params["dense"]["bias"], np.arange(4.0))


# ------------------------------------------------------------------ corruption and fallback

def saved_steps(tmp_path, steps=(1, 2, 3)):
    s = init_state(0)
    states = {}
    with ck.Checkpointer(str(tmp_path), keep=5) as mgr:
        for step in steps:
            s = run(s, 1)
            s.step = step
            mgr.save(s)
            states[step] = s
    return states


def data_files(step_dir: pathlib.Path, item="params"):
    files = [p for p in (step_dir / item).rglob("*") if p.is_file() and p.parent.name == "d"]
    assert files, f"no array data files under {step_dir / item}"
    return files


def corrupt_delete_array_file(d):
    for f in data_files(d):
        f.unlink()


def corrupt_truncate_array_file(d):
    for f in data_files(d):
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def corrupt_missing_commit_marker(d):
    (d / "commit_success.txt").unlink()


def corrupt_garbage_checkpoint_metadata(d):
    (d / "_CHECKPOINT_METADATA").write_text("\x00garbage{")


def corrupt_garbage_meta_json(d):
    (d / "meta" / "metadata").write_text("not json at all")


def corrupt_garbage_array_metadata(d):
    (d / "params" / "_METADATA").write_text("{{{{")


def corrupt_missing_item(d):
    import shutil
    shutil.rmtree(d / "opt_state")


CORRUPTIONS = {
    # OCDBT keeps zarr metadata and chunks in the same data files: whichever read comes first fails
    "deleted array file": (corrupt_delete_array_file, "(array metadata|reading array data).*3/params"),
    "truncated array file": (corrupt_truncate_array_file, "(array metadata|reading array data).*3/params"),
    "missing commit marker": (corrupt_missing_commit_marker, "missing commit marker"),
    "garbage checkpoint metadata": (corrupt_garbage_checkpoint_metadata, "_CHECKPOINT_METADATA"),
    "garbage meta json": (corrupt_garbage_meta_json, "unreadable meta JSON"),
    "garbage array metadata": (corrupt_garbage_array_metadata, "array metadata"),
    "missing item": (corrupt_missing_item, "missing item"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_corrupt_latest_is_reported_and_skipped(tmp_path, kind, caplog):
    states = saved_steps(tmp_path)
    corrupt, message = CORRUPTIONS[kind]
    corrupt(tmp_path / "3")
    with ck.Checkpointer(str(tmp_path), keep=5) as mgr:
        with pytest.raises(ck.CheckpointCorruptError, match=f"step 3 .*{message}") as err:
            mgr.restore(3, init_state(7))
        assert err.value.step == 3
        with caplog.at_level(logging.WARNING, logger="ace_jax.runtime.checkpoint"):
            restored = mgr.restore_latest(init_state(7))
    assert restored.step == 2
    assert_bitwise_equal(restored.params, states[2].params)
    assert any("skipping checkpoint" in r.getMessage() and "step 3" in r.getMessage()
               for r in caplog.records)
    # the corrupt step was moved aside: the resumed run can save step 3 again and restore it
    assert (tmp_path / "3.corrupt").is_dir() and not (tmp_path / "3").exists()
    with ck.Checkpointer(str(tmp_path), keep=5) as mgr:
        assert mgr.save(run(restored, 1))
    with ck.Checkpointer(str(tmp_path), keep=5) as mgr:
        again = mgr.restore_latest(init_state(7))
    assert again.step == 3
    assert_bitwise_equal(again.params, states[3].params)


def test_unfinalised_save_dir_is_ignored_and_named(tmp_path, caplog):
    saved_steps(tmp_path, steps=(1, 2))
    os.rename(tmp_path / "2", tmp_path / "2.orbax-checkpoint-tmp-1234")
    with ck.Checkpointer(str(tmp_path), keep=5) as mgr:
        with caplog.at_level(logging.WARNING, logger="ace_jax.runtime.checkpoint"):
            restored = mgr.restore_latest(init_state(7))
        assert restored.step == 1
        assert any("unfinished checkpoint save" in r.getMessage() for r in caplog.records)
        with pytest.raises(ck.CheckpointCorruptError, match="step 2 .*never finalised"):
            mgr.restore(2, init_state(7))
        with pytest.raises(FileNotFoundError, match="step 9"):
            mgr.restore(9, init_state(7))


def test_all_corrupt_raises(tmp_path):
    saved_steps(tmp_path, steps=(1, 2))
    for step in (1, 2):
        corrupt_missing_commit_marker(tmp_path / str(step))
    with ck.Checkpointer(str(tmp_path)) as mgr:
        with pytest.raises(ck.CheckpointCorruptError, match="step 2"):
            mgr.restore_latest(init_state(7))


def test_a_lost_peer_while_restoring_is_not_a_corrupt_checkpoint(tmp_path, monkeypatch):
    """Multi-process: a collective that fails because another process died, while a step is
    read, raises PeerLostError; the step is neither skipped nor quarantined as corrupt."""
    from ace_jax.runtime import multihost

    class JaxRuntimeError(RuntimeError):
        pass

    saved_steps(tmp_path, steps=(1, 2))
    with ck.Checkpointer(str(tmp_path), keep=5) as mgr:
        monkeypatch.setattr(multihost, "is_multi_process", lambda: True)
        monkeypatch.setattr(multihost, "barrier", lambda *a, **k: None)

        def lost(*a, **k):
            raise JaxRuntimeError("UNKNOWN: Gloo AllGather failed: Connection closed by peer")

        monkeypatch.setattr(mgr._manager, "restore", lost)
        with pytest.raises(multihost.PeerLostError, match="restoring checkpoint step 2 failed"):
            mgr.restore_latest(init_state(7))
        monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]


# ------------------------------------------------------------------ mismatches and bad input

def test_restore_into_other_model_size_names_first_mismatching_leaf(tmp_path):
    saved_steps(tmp_path, steps=(1,))
    with ck.Checkpointer(str(tmp_path)) as mgr:
        with pytest.raises(ck.CheckpointMismatchError,
                           match=r"params: leaf 'dense/kernel' is \(5, 3\) float32 .* "
                                 r"\(6, 3\) float32"):
            mgr.restore_latest(init_state(0, d_in=6))
        other = init_state(0)
        other.params = dict(other.params, extra=jnp.zeros(2))
        other.opt_state = TX.init(other.params)
        with pytest.raises(ck.CheckpointMismatchError, match="target leaf 'extra'"):
            mgr.restore(1, other)
        fewer = init_state(0)
        fewer.params = {"dense": fewer.params["dense"]}
        fewer.opt_state = TX.init(fewer.params)
        with pytest.raises(ck.CheckpointMismatchError, match="has leaf 'scale'"):
            mgr.restore(1, fewer)
        half = init_state(0)
        half.params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), half.params)
        with pytest.raises(ck.CheckpointMismatchError, match="bfloat16"):
            mgr.restore(1, half)


def test_non_json_sampler_state_is_rejected(tmp_path):
    s = init_state(0)
    s.sampler_state = {"array": np.zeros(3)}
    with ck.Checkpointer(str(tmp_path)) as mgr:
        with pytest.raises(TypeError, match="sampler_state is not JSON-serialisable"):
            mgr.save(s)


def test_from_config_and_interval(tmp_path):
    cfg = ck.default_config()
    cfg.directory = str(tmp_path)
    cfg.save_interval_steps = 2
    with ck.Checkpointer.from_config(cfg) as mgr:
        s = init_state(0)
        saved = []
        for step in range(1, 5):
            s.step = step
            saved.append(mgr.save(s))
        assert saved == [False, True, False, True]
    assert mgr.all_steps() == [2, 4]
    with pytest.raises(ValueError, match="directory is empty"):
        ck.Checkpointer.from_config(ck.default_config())


# ------------------------------------------------------------------ gs:// against the emulator

GCS_SCRIPT = r'''
import os, socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
url = f"http://127.0.0.1:{port}"
os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                  GOOGLE_AUTH_TOKEN_FOR_TESTING="fake")
from gcp_storage_emulator.server import create_server
server = create_server("127.0.0.1", port, in_memory=True, default_bucket="bkt")
server.start()
try:
    import gcsfs, jax, jax.numpy as jnp, numpy as np, optax
    from ace_jax.runtime import checkpoint as ck
    tx = optax.adam(1e-3)
    p = {"w": jnp.arange(6.0).reshape(2, 3)}
    with ck.Checkpointer("gs://bkt/run", keep=1) as m:
        for step in (1, 2):
            m.save(ck.TrainState(step, jax.tree.map(lambda x: x * step, p), tx.init(p),
                                 jax.random.key(step), {"step": step}))
    listing = gcsfs.GCSFileSystem(token="anon").ls("bkt/run")
    assert sorted(x.rsplit("/", 1)[-1] for x in listing) == ["2"], listing
    with ck.Checkpointer("gs://bkt/run") as m:
        r = m.restore_latest(ck.TrainState(0, {"w": jnp.zeros((2, 3))}, tx.init(p),
                                           jax.random.key(0)))
    assert r.step == 2 and r.sampler_state == {"step": 2}
    np.testing.assert_array_equal(r.params["w"], 2 * np.arange(6.0).reshape(2, 3))
    np.testing.assert_array_equal(jax.random.key_data(r.rng),
                                  jax.random.key_data(jax.random.key(2)))
    # a save cut short in a bucket: a step folder written in place, without its commit marker,
    # that Orbax does not list; delete_after removes it too
    gcsfs.GCSFileSystem(token="anon").pipe("bkt/run/3/params/d", b"partial")
    for fs in list(gcsfs.GCSFileSystem._cache.values()):   # as a new process sees the bucket
        fs.invalidate_cache()
    with ck.Checkpointer("gs://bkt/run") as m:
        assert m.all_steps() == [2, 3], m.all_steps()
        assert m.delete_after(2) == [3] and m.all_steps() == [2]
    print("GCS_ROUND_TRIP_OK")
finally:
    server.stop()
'''


def test_gcs_round_trip_against_emulator():
    """gs:// save (keep=1), listing and restore through gcsfs + tensorstore against the local
    gcp-storage-emulator, in a subprocess so the emulator env vars do not leak."""
    import subprocess
    import sys
    pytest.importorskip("gcp_storage_emulator")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.run([sys.executable, "-c", GCS_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=240)
    assert "GCS_ROUND_TRIP_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


def test_relative_directory_is_made_absolute(tmp_path, monkeypatch):
    """A relative directory (the local config's runs/local) works: Orbax needs absolute paths."""
    import jax.numpy as jnp

    from ace_jax.runtime.checkpoint import Checkpointer, TrainState

    monkeypatch.chdir(tmp_path)
    state = TrainState(step=1, params={"w": jnp.ones(3)}, opt_state={"m": jnp.zeros(3)},
                       rng=jax.random.key(0), sampler_state={"a": 1})
    with Checkpointer("runs/rel/checkpoints", keep=2, async_save=False) as ck:
        assert ck.save(state, force=True)
        ck.wait_until_finished()
        assert ck.all_steps() == [1]
        back = ck.restore(1, state)
    assert back.sampler_state == {"a": 1}
    assert (tmp_path / "runs/rel/checkpoints/1").is_dir()

