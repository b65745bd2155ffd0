"""The streaming export from a gs:// run to a gs:// folder (the pod's case: checkpoints and
exports in the bucket), against the local gcp-storage-emulator, with the checkpoint written
without OCDBT (as the rehearsal writes it against the emulator) and with it; in a subprocess so
the emulator's environment does not leak."""
import os
import subprocess
import sys

import pytest

GCS_SCRIPT = r'''
import os, socket, sys, tempfile
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
url = f"http://127.0.0.1:{port}"
os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                  GOOGLE_AUTH_TOKEN_FOR_TESTING="fake")
from gcp_storage_emulator.server import create_server
server = create_server("127.0.0.1", port, in_memory=True, default_bucket="bkt")
server.start()
try:
    import json
    import gcsfs, jax, numpy as np, optax
    from flax import nnx
    from ace_jax.policy import export
    from ace_jax.runtime import checkpoint as ck, storage
    from models import hf_mapping, qwen3
    from tests.run_fixture import make_tiny_run
    for ocdbt in (False, True):
        root = f"gs://bkt/run{int(ocdbt)}"
        local = tempfile.mkdtemp()
        model, _ = make_tiny_run(local)
        cfg = json.load(open(os.path.join(local, "config.json")))
        cfg["checkpoint"].update(directory=root + "/checkpoints", use_ocdbt=ocdbt)
        json.dump(cfg, open(os.path.join(local, "config.json"), "w"))
        storage.upload_dir(os.path.join(local, "tokenizer"), root + "/tokenizer")
        storage.write_text(root + "/config.json", open(os.path.join(local, "config.json")).read())
        params = nnx.state(model, nnx.Param)
        with ck.Checkpointer(root + "/checkpoints", use_ocdbt=ocdbt, async_save=False) as c:
            c.save(ck.TrainState(3, params, optax.adam(0.1).init(params), jax.random.key(0), {}),
                   force=True)
        r = export.export_run(root, f"gs://bkt/export{int(ocdbt)}", max_shard_bytes="30kB")
        assert r.step == 3 and sum(f.startswith("model-") for f in r.files) > 1, r.files
        assert "tokenizer.json" in r.files and "config.json" in r.files, r.files
        _, flat = hf_mapping.load_hf_checkpoint(f"gs://bkt/export{int(ocdbt)}")
        for k, v in qwen3.flat_params(model).items():
            np.testing.assert_array_equal(flat[k], np.asarray(v), err_msg=k)
    print("GCS_EXPORT_OK")
finally:
    server.stop()
'''


def test_gcs_run_exports_to_gcs():
    pytest.importorskip("gcp_storage_emulator")
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", GCS_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=400, cwd=root)
    assert "GCS_EXPORT_OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
