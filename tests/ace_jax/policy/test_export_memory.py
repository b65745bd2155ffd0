"""The streaming export (ace_jax/policy/export.py) of a run big enough for the memory bound to
matter: ~34 MB of fp32 parameters in many arrays, saved from a 2-host layout (fsdp 4 x expert 2:
every array in chunks of its shards, as a pod run saves it).

The bound: the export's peak resident memory (in a process of its own, measured by getrusage)
stays below half the model's bytes plus one shard. A non-streaming export holds the whole model
at least once (the old one held it twice: restored model + its host copy); this one holds one
block (here: 8 experts' slice of every layer of one expert projection, 14% of the model) plus
tensorstore's decode buffers, and writes each HF tensor into its file as it is made (no shard
is assembled in memory), so half the model is a bound it passes with room and a model-holding
export cannot.
"""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from tests.ace_jax.policy import run_dirs

REPO = pathlib.Path(__file__).resolve().parents[3]
SHARD = 4_000_000


@pytest.fixture(scope="module")
def medium_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("medium") / "run")
    saved, model_cfg = run_dirs.make_run(workdir, run_dirs.MEDIUM, dict(fsdp=4, expert=2))
    return workdir, saved, model_cfg


def _export_in_subprocess(workdir, out, **kwargs) -> dict:
    code = ("import dataclasses, json, sys\n"
            "from ace_jax.policy import export\n"
            "export.return_freed_memory()\n"
            f"r = export.export_run({workdir!r}, {out!r}, **{kwargs!r})\n"
            "print('RESULT ' + json.dumps(dataclasses.asdict(r)))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)   # the export uses no device: one is enough
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_export_peak_memory_is_a_block_not_the_model(medium_run, tmp_path):
    from ace_jax.policy import runs

    workdir, saved, _ = medium_run
    params = sum(v.nbytes for v in saved.values())
    r = _export_in_subprocess(workdir, str(tmp_path / "hf"), max_shard_bytes=SHARD)
    assert r["tensor_bytes"] == params
    largest_param = max(v.nbytes for v in saved.values())
    print(f"\nexport of {params / 1e6:.1f} MB of parameters (largest {largest_param / 1e6:.1f} MB) "
          f"in {r['seconds']:.1f} s: peak RSS +{r['peak_rss_bytes'] / 1e6:.1f} MB, buffers "
          f"{r['peak_buffer_bytes'] / 1e6:.1f} MB, largest block {r['largest_block_bytes'] / 1e6:.1f} MB")
    assert r["peak_rss_bytes"] < params / 2 + SHARD, r
    # the block is a chunk range (8 of 16 experts, every layer), not the stacked parameter
    assert r["largest_block_bytes"] == largest_param // 2
    assert r["peak_buffer_bytes"] <= r["largest_block_bytes"] + largest_param // (6 * 16)
    # the restore plan of the same mesh predicts that block
    assert runs.restore_plan(workdir)["export_block"]["bytes"] == r["largest_block_bytes"]
    shards = sorted(f for f in r["files"] if f.startswith("model-"))
    assert len(shards) >= params // SHARD
    for f in shards:   # each shard within the bound (+ its header) unless one tensor is larger
        assert os.path.getsize(tmp_path / "hf" / f) <= SHARD + 64 * 1024, f


def test_streamed_export_holds_the_saved_parameters(medium_run, tmp_path):
    """Every tensor of the export, read back through the parameter table, equals what was saved
    (blocks of several layers and experts land in the right keys)."""
    from ace_jax.policy import export
    from models import hf_mapping

    workdir, saved, model_cfg = medium_run
    result = export.export_run(workdir, str(tmp_path / "hf"), max_shard_bytes=SHARD)
    assert result.step == 1 and result.largest_block_bytes < result.tensor_bytes / 4
    config, flat = hf_mapping.load_hf_checkpoint(tmp_path / "hf")
    assert config.num_experts == model_cfg.num_experts
    assert flat.keys() == saved.keys()
    for k, v in saved.items():
        np.testing.assert_array_equal(flat[k], v, err_msg=k)
    # bfloat16: the same values rounded, half the bytes
    bf16 = export.export_run(workdir, str(tmp_path / "bf16"), dtype="bfloat16")
    assert bf16.tensor_bytes == result.tensor_bytes // 2
    _, flat = hf_mapping.load_hf_checkpoint(tmp_path / "bf16", dtype="float32")
    np.testing.assert_allclose(flat["layers/0/mlp/experts/up_proj"],
                               saved["layers/0/mlp/experts/up_proj"], rtol=1e-2, atol=1e-6)
