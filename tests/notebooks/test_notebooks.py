"""Every notebook runs end to end on a reduced setting (its parameters cell overridden, as
papermill does), from the repository root, in a real Jupyter kernel."""
import json
import os

from tests.notebooks.nbrun import REPO, outputs_text, run_notebook


def _backend() -> str:
    from sandbox.backends.bwrap import bwrap_available

    return "bwrap" if bwrap_available()[0] else "process"


TINY_RUN = {"rl.batch_states": 1, "rl.group_size": 2, "sampling.max_new_tokens": 48,
            "tasks.ids": "('iris-species',)", "lp.explore_steps": 1, "lp.anneal_steps": 1,
            "sft.seconds": 120}
# the notebooks that do not show the probe run without it (a probe before the first update and
# after the last, per run: most of a 2-step run's time); the quickstart shows it
NO_PROBE = {"probe.every": 0}


def test_quickstart(tmp_path):
    nb = run_notebook(
        os.path.join(REPO, "notebooks", "quickstart.ipynb"),
        dict(workdir=str(tmp_path / "run"), rl_steps=2, sft_steps=5,
             overrides={**TINY_RUN, "tasks.cache_dir": str(tmp_path / "tasks")},
             eval_tasks=("iris-species",), eval_seeds=(0,), eval_max_steps=1,
             export_dir=str(tmp_path / "hf"), backend=_backend()),
        str(tmp_path / "quickstart.out.ipynb"))
    text = outputs_text(nb)
    assert "2 RL steps logged" in text
    assert "max |logit difference| transformers vs JAX" in text
    results = json.load(open(tmp_path / "run" / "eval" / "results.json"))
    assert results["overall"]["n_episodes"] == 1
    assert os.path.exists(tmp_path / "hf" / "config.json")


def test_ablation_lp_vs_uniform(tmp_path):
    root = tmp_path / "abl"
    nb = run_notebook(
        os.path.join(REPO, "notebooks", "ablation_lp_vs_uniform.ipynb"),
        dict(root=str(root), samplers=("lp", "uniform"), seeds=(0,),
             overrides={**TINY_RUN, **NO_PROBE, "tasks.cache_dir": str(tmp_path / "tasks"),
                        "sft.steps": 5, "rl.num_steps": 2, "optim.decay_steps": 2},
             eval_samplers=("lp", "uniform"), eval_tasks=("iris-species",), eval_max_steps=1,
             backend=_backend()),
        str(tmp_path / "ablation.out.ipynb"))
    text = outputs_text(nb)
    assert "2 runs in" in text
    assert (root / "figures" / "curves.png").stat().st_size > 1000
    summary = (root / "summary.md").read_text()
    assert "| uniform | rollout/valid_rate |" in summary and "| lp | grpo/zero_var_frac |" in summary
    assert "informative groups" in summary and "\n| uniform | " in summary.split("informative")[1]
    assert "| metric | gain: lp - uniform [95% CI over seeds] | seeds |" in summary
    assert "| rollout/valid_rate | " in summary.split("gain: lp - uniform")[1]
    evaluated = (root / "eval_summary.md").read_text()
    assert "before (warm start)" in evaluated and "after: lp" in evaluated
    assert "| metric | after: lp - uniform [95% CI over seeds] | seeds |" in evaluated
    assert "| human_rank | " in evaluated.split("after: lp - uniform")[1]


def test_ideator(tmp_path):
    root = tmp_path / "ideator"
    small = {**TINY_RUN, **NO_PROBE, "tasks.cache_dir": str(tmp_path / "tasks"), "sft.steps": 5,
             "rl.seed_with_references": True}
    nb = run_notebook(
        os.path.join(REPO, "notebooks", "ideator.ipynb"),
        dict(root=str(root), seeds=(0,), warm_overrides=small, rl_steps=1,
             implementer_overrides=small,    # the implementer's own warm start (configs/local.py)
             train_overrides={**small, "ideator.implementer_max_new_tokens": 48},
             eval_tasks=("iris-species",), eval_seeds=(0,), eval_max_steps=2,
             stagnation_steps=1, implementer_max_new_tokens=48, backend=_backend()),
        str(tmp_path / "ideator.out.ipynb"))
    text = outputs_text(nb)
    assert "seed 0: 1 ideator RL steps logged" in text
    assert (root / "seed0" / "implementer" / "config.json").exists()
    assert (root / "figures" / "ideator_curves.png").stat().st_size > 1000
    summary = (root / "eval_summary.md").read_text()
    assert "| setting | Avg@1 | Best@1 | valid | steps to first valid | advice requests |" in summary
    for setting in ("implementer alone", "+ untrained ideator", "+ trained ideator"):
        assert f"| {setting} | " in summary
    assert "| (+ trained ideator) - (implementer alone) [95% CI over seeds] |" in summary
    assert "| Best@1 | " in summary
    assert "| feature_engineering |" in (root / "categories.md").read_text()
