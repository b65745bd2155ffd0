"""ace_jax.policy.runs: ``load_run_model`` against a real tiny run directory (its model,
tokenizer and checkpoint, and what it raises when one is missing or of another size)."""
import json
import os
import shutil

import numpy as np
from flax import nnx
import pytest

from ace_jax.policy.interface import PolicyError
from ace_jax.policy.runs import load_run_model
from ace_jax.runtime import checkpoint as ckpt_lib
from models.qwen3 import flat_params
from tests.run_fixture import make_tiny_run


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("runs") / "run")
    model, tokenizer = make_tiny_run(workdir)
    return workdir, model, tokenizer


def _copy_run(src: str, dst) -> str:
    shutil.copytree(src, dst)
    return str(dst)


def test_checkpoint_of_another_model_size_raises_mismatch(tiny_run, tmp_path):
    workdir = _copy_run(tiny_run[0], tmp_path / "run")
    path = os.path.join(workdir, "config.json")
    cfg = json.load(open(path))
    cfg["model"]["overrides"]["hidden_size"] = 64
    json.dump(cfg, open(path, "w"))
    with pytest.raises(ckpt_lib.CheckpointMismatchError, match="hidden|embed|64|32"):
        load_run_model(workdir)


def test_no_checkpoint_or_absent_step_raises_policy_error(tiny_run, tmp_path):
    workdir = _copy_run(tiny_run[0], tmp_path / "run")
    with pytest.raises(PolicyError, match=r"no checkpoint of step 7 .*have \[1\]"):
        load_run_model(workdir, step=7)
    shutil.rmtree(os.path.join(workdir, "checkpoints"))
    with pytest.raises(PolicyError, match="no checkpoint"):
        load_run_model(workdir)
    assert not os.path.exists(os.path.join(workdir, "checkpoints")), "must not create it"
    os.makedirs(os.path.join(workdir, "checkpoints"))
    with pytest.raises(PolicyError, match="no checkpoint"):
        load_run_model(workdir)


def test_newest_complete_checkpoint_is_used_when_a_newer_one_is_unfinished(tiny_run, tmp_path):
    workdir = _copy_run(tiny_run[0], tmp_path / "run")
    ckpts = os.path.join(workdir, "checkpoints")
    shutil.copytree(os.path.join(ckpts, "1"), os.path.join(ckpts, "2"))
    os.remove(os.path.join(ckpts, "2", ckpt_lib.COMMIT_MARKER))
    _, _, step = load_run_model(workdir)
    assert step == 1
    with pytest.raises(ckpt_lib.CheckpointCorruptError):
        load_run_model(workdir, step=2)


def test_run_started_from_another_run_uses_that_runs_model_and_tokenizer(tiny_run, tmp_path):
    """A run with model.init_from_run trains the parent's model with the parent's tokenizer,
    whatever its own model.preset says (as Trainer._build_model / _load_tokenizer do)."""
    parent, model, _ = tiny_run
    child = _copy_run(parent, tmp_path / "child")
    shutil.rmtree(os.path.join(child, "tokenizer"))
    path = os.path.join(child, "config.json")
    cfg = json.load(open(path))
    cfg["model"].update(init_from_run=parent, preset="qwen3_0_6b", overrides={})
    json.dump(cfg, open(path, "w"))
    restored, tokenizer, step = load_run_model(child)
    assert step == 1 and restored.config == model.config
    np.testing.assert_array_equal(np.asarray(flat_params(restored)["norm/scale"]),
                                  np.asarray(flat_params(model)["norm/scale"]))


def test_a_run_restores_straight_into_the_placements_shardings(tiny_run):
    """``model.init_from_run`` on a mesh: every parameter comes back already sharded as the
    placement says (no copy on one device first), with the saved values."""
    import jax

    from ace_jax.runtime import placement as placement_lib, sharding

    workdir, model, _ = tiny_run
    cfg = sharding.default_config()
    cfg.fsdp, cfg.expert = 4, 2
    place = placement_lib.Placement.from_config(cfg)
    restored, _, _ = load_run_model(workdir, shardings=place.params)
    want = place.params(nnx.state(restored, nnx.Param))
    got = nnx.state(restored, nnx.Param)
    saved = flat_params(model)
    sharded = 0
    for (path, leaf), (_, sh) in zip(jax.tree_util.tree_leaves_with_path(got),
                                     jax.tree_util.tree_leaves_with_path(want)):
        assert leaf.sharding == sh, path
        sharded += len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
    assert sharded > 0
    for k, v in flat_params(restored).items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(saved[k]), err_msg=k)


def test_run_of_an_hf_model_reads_only_its_config(tiny_run, tmp_path):
    """model.hf_path: the architecture comes from the HF config.json; no HF weights are read."""
    from models import hf_mapping

    parent, model, _ = tiny_run
    hf_dir = hf_mapping.export_hf(model, model.config, tmp_path / "hf", dtype="float32")
    for f in hf_dir.glob("model*.safetensors*"):
        f.unlink()  # weights are not needed, only config.json
    workdir = _copy_run(parent, tmp_path / "run")
    path = os.path.join(workdir, "config.json")
    cfg = json.load(open(path))
    cfg["model"].update(hf_path=str(hf_dir), runtime={"moe_dispatch": "dense"})
    json.dump(cfg, open(path, "w"))
    restored, _, _ = load_run_model(workdir)
    assert restored.config.moe_dispatch == "dense"
    assert restored.config.replace(moe_dispatch=model.config.moe_dispatch) == model.config
    np.testing.assert_array_equal(np.asarray(flat_params(restored)["norm/scale"]),
                                  np.asarray(flat_params(model)["norm/scale"]))


def test_missing_tokenizer_raises_policy_error(tiny_run, tmp_path):
    workdir = _copy_run(tiny_run[0], tmp_path / "run")
    shutil.rmtree(os.path.join(workdir, "tokenizer"))
    with pytest.raises(PolicyError, match="no tokenizer"):
        load_run_model(workdir)
