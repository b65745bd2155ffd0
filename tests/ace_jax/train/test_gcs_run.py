"""A run whose workdir is gs:// (a real GCS emulator): every artefact lands in the bucket, none in
a local folder named ``gs:``, and the run is found again by its URL (``policy.resolve_run``)."""
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]

SCRIPT = r'''
import os, socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
url = f"http://127.0.0.1:{port}"
os.environ.update(STORAGE_EMULATOR_HOST=url, TENSORSTORE_GCS_HTTP_URL=url,
                  GOOGLE_AUTH_TOKEN_FOR_TESTING="fake", FSSPEC_GS_TOKEN="anon")
from gcp_storage_emulator.server import create_server
server = create_server("127.0.0.1", port, in_memory=True, default_bucket="bkt")
server.start()
try:
    import gcsfs
    from ace_jax import config_utils
    from ace_jax.policy import policy
    from ace_jax.train import trainer
    cfg = config_utils.load_config_file(sys.argv[1] + "/configs/local.py:smoke")
    cfg.workdir = "gs://bkt/run"
    cfg.tasks.cache_dir = sys.argv[2]
    cfg.rl.num_steps = 2
    cfg.probe.heldout_tasks = ()
    t = trainer.Trainer(cfg, progress=False)
    try:
        t.run()
    finally:
        t.close()
    fs = gcsfs.GCSFileSystem(token="anon")
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls("bkt/run"))
    print("TOP", names)
    print("ROLLOUTS", sorted(p.rsplit("/", 1)[-1] for p in fs.ls("bkt/run/rollouts")))
    print("TOKENIZER", fs.exists("bkt/run/tokenizer/tokenizer.json"))
    run = policy.resolve_run("gs://bkt/run")
    print("RESOLVED", run.checkpoint_dir, os.path.exists(os.path.join(run.tokenizer_dir,
                                                                      "tokenizer.json")))
finally:
    server.stop()
'''


@pytest.mark.slow
def test_a_gs_workdir_keeps_every_artefact_in_the_bucket(tmp_path):
    pytest.importorskip("gcp_storage_emulator")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(JAX_PLATFORMS="cpu", NO_GCE_CHECK="true", HOME=str(tmp_path / "home"),
               PYTHONPATH=str(REPO))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(REPO), str(tmp_path / "tasks")],
                         cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = {x.split(" ", 1)[0]: x.split(" ", 1)[1] for x in out.stdout.splitlines()
             if x.split(" ", 1)[0] in ("TOP", "ROLLOUTS", "TOKENIZER", "RESOLVED")}
    top = eval(lines["TOP"])
    assert {"checkpoints", "buffer", "metrics.jsonl", "config.json", "rollouts",
            "tokenizer"} <= set(top), top
    assert eval(lines["ROLLOUTS"]) == ["000000.jsonl", "000001.jsonl"]
    assert lines["TOKENIZER"] == "True"
    assert lines["RESOLVED"] == "gs://bkt/run/checkpoints True"
    assert os.listdir(cwd) == []          # nothing local: no folder named gs:
