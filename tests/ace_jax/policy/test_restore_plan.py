"""Where ``load_run_model`` puts a run's parameters without a ``shardings`` argument: the run's
own mesh (``run_placement``) over every device, and what that leaves on each device
(``restore_plan``), at Qwen3-30B-A3B's shapes on the pod's 64 abstract v5p chips (no TPU, no
weights, nothing allocated) and, against real arrays, on this host's 8 CPU devices."""
import importlib.util
import json
import os
import pathlib

import jax
import numpy as np
import pytest
from flax import nnx

from ace_jax import config_utils
from ace_jax.policy import interface, mirror, policy, runs
from models import qwen3
from tests.run_fixture import make_tiny_run

REPO = pathlib.Path(__file__).resolve().parents[3]
GB = 1e9


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="needs libtpu (jax[tpu]) for the abstract v5p devices")
def test_30b_restores_a_sixty_fourth_per_chip_on_the_pod():
    from models import configs as model_configs

    cfg = config_utils.load_config_file(str(REPO / "configs/ace30b.py"))
    plan = runs.restore_plan(cfg, topology="v5p:4x4x4")
    mc = model_configs.get_model_config("qwen3_30b_a3b", **dict(cfg.model.overrides))
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(
        nnx.state(nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0))), nnx.Param)))
    per_chip = plan["per_device_bytes"]["max"]
    print(f"\nQwen3-30B-A3B fp32 on v5p:4x4x4 ({plan['devices']} chips, mesh {plan['mesh']}): "
          f"{plan['total_bytes'] / GB:.1f} GB of parameters, {per_chip / GB:.3f} GB per chip "
          f"(min {plan['per_device_bytes']['min'] / GB:.3f}), "
          f"{100 * plan['hbm_fraction']:.1f}% of its {plan['hbm_bytes'] / GB:.1f} GB HBM; "
          f"a streaming export of its gs:// checkpoint reads at most "
          f"{plan['export_block']['bytes'] / GB:.2f} GB at once ({plan['export_block']['name']}, "
          f"chunks {plan['export_block']['chunk']})")
    print(json.dumps(plan["largest"][:3], default=str))
    assert plan["devices"] == 64 and plan["mesh"] == dict(data=1, fsdp=16, tensor=1, expert=4)
    assert plan["param_dtype"] == "float32" and plan["total_bytes"] == 4 * n_params
    assert plan["total_bytes"] > 120 * GB              # the whole model would not fit one chip
    assert per_chip < 10 * GB and per_chip < 0.1 * plan["hbm_bytes"]
    assert per_chip <= plan["total_bytes"] / 64 * 1.01   # every weight split 64 ways (norms aside)
    assert plan["export_block"]["gcs"] is True and plan["export_block"]["bytes"] < 12 * GB


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    workdir = str(tmp_path_factory.mktemp("plan") / "run")
    model, _ = make_tiny_run(workdir)
    path = os.path.join(workdir, "config.json")
    cfg = json.load(open(path))
    cfg["mesh"].update(fsdp=-1, expert=2)
    json.dump(cfg, open(path, "w"))
    return workdir, model


def test_default_restore_uses_the_runs_mesh_and_matches_the_plan(tiny_run):
    workdir, saved = tiny_run
    restored, _, _ = runs.load_run_model(workdir)
    plan = runs.restore_plan(workdir)
    assert plan["mesh"] == dict(data=1, fsdp=4, tensor=1, expert=2) and plan["devices"] == 8
    per_device = {d: 0 for d in jax.devices()}
    want = {r["name"]: r for r in plan["largest"]}
    for name, x in qwen3.flat_params(restored).items():
        assert dict(x.sharding.mesh.shape) == plan["mesh"], name
        for s in x.addressable_shards:
            per_device[s.device] += s.data.nbytes
        if name in want:
            assert str(x.sharding.spec) == want[name]["spec"], name
        np.testing.assert_array_equal(np.asarray(x), np.asarray(qwen3.flat_params(saved)[name]))
    assert max(per_device.values()) == plan["per_device_bytes"]["max"]
    assert min(per_device.values()) == plan["per_device_bytes"]["min"]
    assert plan["per_device_bytes"]["max"] < plan["total_bytes"] / 4


def test_single_device_and_explicit_placements(tiny_run):
    workdir, _ = tiny_run
    one, _, _ = runs.load_run_model(workdir, shardings=runs.SINGLE_DEVICE)
    for x in qwen3.flat_params(one).values():
        assert x.sharding.device_set == {jax.devices()[0]}
    place = runs.run_placement(workdir, devices=jax.devices()[:4])   # refitted: fsdp 2 x expert 2
    assert dict(place.mesh.shape) == dict(data=1, fsdp=2, tensor=1, expert=2)
    four, _, _ = runs.load_run_model(workdir, shardings=place)
    assert {len(x.sharding.device_set) for x in qwen3.flat_params(four).values()} == {4}
    with pytest.raises(ValueError, match="shardings"):
        runs.load_run_model(workdir, shardings="everywhere")


def test_run_placement_refits_a_mesh_that_does_not_fit(tiny_run):
    cfg = json.load(open(os.path.join(tiny_run[0], "config.json")))
    cfg["mesh"].update(fsdp=16, expert=4, tensor=1)       # a 64-chip run served on 8 devices
    place = runs.run_placement(cfg)
    assert dict(place.mesh.shape) == dict(data=1, fsdp=2, tensor=1, expert=4)
    assert place.rules_dict["embed"] == ("fsdp", "expert")
    cfg["mesh"].update(fsdp=2, expert=3)
    assert dict(runs.run_placement(cfg).mesh.shape)["expert"] == 1


def test_from_run_puts_the_policy_and_its_engine_on_the_runs_mesh(tiny_run):
    workdir, _ = tiny_run
    sharded = policy.JaxPolicy.from_run(workdir, max_new_tokens=4)
    assert sharded.placement is not None and sharded.placement.mesh.size == 8
    assert not sharded.mirrored     # one process: nothing to mirror
    assert sharded.make_engine().placement is sharded.placement
    one = policy.JaxPolicy.from_run(workdir, max_new_tokens=4, placement=None)
    assert one.placement is None
    conv = [[{"role": "user", "content": "train a model"}]]
    assert sharded.complete(conv)[0].token_ids == one.complete(conv)[0].token_ids
    with pytest.raises(interface.PolicyError, match="process 0"):
        mirror.follow()
    mirror.release_followers()     # one process: a no-op
