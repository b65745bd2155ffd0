"""XLA's persistent compilation cache (ace_jax/runtime/compile_cache.py): a second process that
compiles the same program reads it from the folder the first one wrote, and gets the same
result. Each process is a fresh interpreter: the cache is process-wide jax state."""
import json
import os
import subprocess
import sys

from ace_jax.runtime import compile_cache

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp
from ace_jax.runtime import compile_cache

hits = []
jax.monitoring.register_event_listener(
    lambda name, **kw: hits.append(name) if name == "/jax/compilation_cache/cache_hits" else None)
compile_cache.enable(sys.argv[1], min_compile_seconds=0)
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0) * 3.0)
out = f(jnp.arange(64.0).reshape(8, 8) / 64)
print(json.dumps({"hits": len(hits), "out": [float(v) for v in out]}))
"""


def _run(cache_dir, env=None, cwd=REPO) -> dict:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(cache_dir)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_what_the_first_compiled(tmp_path):
    cache = tmp_path / "xla cache"            # created by enable, a space in the path
    first = _run(cache)
    assert first["hits"] == 0
    assert any(cache.iterdir()), "nothing was written"
    second = _run(cache)
    assert second["hits"] >= 1
    assert second["out"] == first["out"]


def test_a_shared_bucket_cache_is_written_once_and_read_by_the_next_process(gcs_emulator,
                                                                          tmp_path):
    """The pod's setting: compile_cache_dir=gs://... (against the GCS emulator): the first
    process writes its programs to the bucket, the next reads them; nothing local."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(gcs_emulator.env(), JAX_PLATFORMS="cpu", HOME=str(tmp_path / "home"))
    url = "gs://" + gcs_emulator.prefix() + "/xla_cache"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    first = _run(url, env, cwd)
    assert first["hits"] == 0
    assert gcs_emulator.fs().find(url[len("gs://"):]), "nothing was written to the bucket"
    second = _run(url, env, cwd)
    assert second["hits"] >= 1 and second["out"] == first["out"]
    assert os.listdir(cwd) == []                       # no local folder named gs:


def test_an_empty_path_leaves_the_cache_off():
    assert compile_cache.enable("") is None


def test_no_path_is_the_default_folder(tmp_path):
    code = "from ace_jax.runtime import compile_cache; print(compile_cache.enable(None))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = tmp_path / ".cache" / "ace_jax" / "xla"
    assert proc.stdout.strip().splitlines()[-1] == str(want) and want.is_dir()
