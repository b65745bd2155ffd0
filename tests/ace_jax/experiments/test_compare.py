"""The comparison runner: arm overrides win over the runner's, and the export keeps the warm
starts and the commits each run ran on."""
import json
import os

from ace_jax.experiments import ablation, compare


def _finished_run(workdir, records, commits=None):
    os.makedirs(workdir)
    with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    marker = {"fingerprint": f"fp-{os.path.basename(workdir)}"}
    if commits is not None:
        marker["commits"] = commits
    with open(os.path.join(workdir, ablation.DONE_MARKER), "w") as f:
        json.dump(marker, f)


def test_an_arm_overrides_the_runner_s_steps_and_warm_start(tmp_path, monkeypatch):
    """An SFT-control arm (rl.num_steps=0, no init_from_run) keeps its own values; the other
    arms start from the seed's warm start with the comparison's step count."""
    jobs = []

    def fake_run_jobs(batch, **kw):
        jobs.extend(batch)
        return [ablation.RunResult(workdir, 0.0) for _, workdir, _ in batch]

    monkeypatch.setattr(ablation, "run_jobs", fake_run_jobs)
    compare.run(str(tmp_path), {"lp": {}, "sft": {"rl.num_steps": 0, "model.init_from_run": "",
                                                  "sft.steps": 300}}, [3], 20, progress=False)
    by_label = {label: o for label, _, o in jobs}
    assert by_label["warm3"]["rl.num_steps"] == 0
    assert by_label["lp/seed3"]["rl.num_steps"] == 20
    assert by_label["lp/seed3"]["model.init_from_run"] == str(tmp_path / "warm3")
    assert by_label["sft/seed3"]["rl.num_steps"] == 0
    assert by_label["sft/seed3"]["model.init_from_run"] == ""
    assert by_label["sft/seed3"]["sft.steps"] == 300 and by_label["sft/seed3"]["seed"] == 3


def test_export_keeps_the_warm_starts_and_each_run_s_commits(tmp_path):
    root = tmp_path / "runs"
    commits = [{"commit": "a" * 40, "dirty": False}, {"commit": "b" * 40, "dirty": True}]
    _finished_run(str(root / "warm0"), [{"step": 0, "probe/heldout_valid_rate": 0.25}],
                  commits[:1])
    _finished_run(str(root / "lp" / "seed0"), [{"step": 0, "rollout/valid_rate": 0.5},
                                              {"step": 20, "probe/heldout_valid_rate": 0.5}],
                  commits)
    out = tmp_path / "results"
    info = compare.export(str(out), str(root), {"lp": {}}, [0, 1], command="c", config="x",
                          warm_root=str(root))
    assert [(r["arm"], r["seed"]) for r in info["runs"]] == [("warm", 0), ("lp", 0)]
    assert info["runs"][1]["commits"] == commits and not info["complete"]   # seed 1 is missing
    rows = compare.read_csv(str(out / "metrics.csv.gz"))
    assert [(r["arm"], r["step"], r.get("probe/heldout_valid_rate")) for r in rows] == [
        ("warm", 0, 0.25), ("lp", 0, None), ("lp", 20, 0.5)]
    assert json.loads((out / "runs.json").read_text()) == info


def test_an_export_keeps_the_runs_an_earlier_export_of_the_same_settings_wrote(tmp_path):
    """Seeds run on another machine (their folders gone) stay in the raw data when the next
    seeds are exported, and only while the settings are the same."""
    out = str(tmp_path / "results")
    first, second = tmp_path / "first", tmp_path / "second"
    _finished_run(str(first / "warm0"), [{"step": 0, "probe/heldout_valid_rate": 0.25}])
    _finished_run(str(first / "lp" / "seed0"), [{"step": 20, "probe/heldout_valid_rate": 0.5}])
    compare.export(out, str(first), {"lp": {"x": 1}}, [0, 2], command="c", config="x",
                   warm_root=str(first))                 # seed 2 planned, not run
    _finished_run(str(second / "warm1"), [{"step": 0, "probe/heldout_valid_rate": 0.125}])
    _finished_run(str(second / "lp" / "seed1"), [{"step": 20, "probe/heldout_valid_rate": 0.75}])
    info = compare.export(out, str(second), {"lp": {"x": 1}}, [1], command="c", config="x",
                          warm_root=str(second))
    assert info["seeds"] == [0, 1, 2] and not info["complete"]   # seed 2 is still planned
    assert [(r["arm"], r["seed"], r["fingerprint"]) for r in info["runs"]] == [
        ("warm", 0, "fp-warm0"), ("warm", 1, "fp-warm1"), ("lp", 0, "fp-seed0"),
        ("lp", 1, "fp-seed1")]
    rows = compare.read_csv(str(tmp_path / "results" / "metrics.csv.gz"))
    assert [(r["arm"], r["seed"], r["probe/heldout_valid_rate"]) for r in rows] == [
        ("warm", 0, 0.25), ("warm", 1, 0.125), ("lp", 0, 0.5), ("lp", 1, 0.75)]
    # another arm setting: the earlier runs are another experiment's and are not kept
    info = compare.export(out, str(second), {"lp": {"x": 2}}, [1], command="c", config="x",
                          warm_root=str(second))
    assert [(r["arm"], r["seed"]) for r in info["runs"]] == [("warm", 1), ("lp", 1)]


def test_the_procedural_heldout_runner_runs_the_plan_s_settings(tmp_path):
    """results/procedural_heldout/run.sh runs plan.md's command with the seeds it is given: the
    settings compare parses from it (config, overrides, arms) are the committed runs.json's, so
    its runs join the committed ones on export."""
    import pathlib
    import subprocess

    folder = pathlib.Path(__file__).resolve().parents[3] / "results" / "procedural_heldout"
    out = subprocess.run(["bash", str(folder / "run.sh"), "command", "7"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[out.index("--seeds") + 1] == "7"
    assert compare.main(out + ["--export_only", "--root", str(tmp_path / "runs"),
                               "--results", str(tmp_path)]) == 0
    ours = json.loads((tmp_path / "procedural_heldout" / "runs.json").read_text())
    committed = json.loads((folder / "runs.json").read_text())
    for key in ("config", "overrides", "arms"):
        assert ours[key] == committed[key], key
    assert ours["seeds"] == [7] and ours["runs"] == []
