"""Results tables from raw data: the repo's docs agree with their data, a changed raw value is
caught, a known input gives a known table; the raw-data format round-trips."""
import json
import pathlib
import shutil

import numpy as np
import pytest

from ace_jax.experiments import ablation, compare, tables


def test_the_docs_agree_with_the_committed_raw_data():
    assert tables.main(["--check"]) == 0


def _copy_repo(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(tables.REPO + "/results", root / "results")
    for doc in tables.DOCS:
        src = pathlib.Path(tables.REPO) / doc
        (root / doc).parent.mkdir(parents=True, exist_ok=True)
        if src.exists():
            shutil.copy(src, root / doc)
    return root


def test_one_changed_raw_value_fails_the_check(tmp_path, capsys):
    root = _copy_repo(tmp_path)
    assert tables.main(["--check", "--root", str(root)]) == 0
    raw = root / "results/routing_replay/local_bf16.jsonl"
    lines = raw.read_text().splitlines()
    first = json.loads(lines[0])
    first["R3"]["mismatch_k3"] *= 1.5
    raw.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    assert tables.main(["--check", "--root", str(root)]) == 1
    assert "docs/offpolicy.md: routing_replay" in capsys.readouterr().out
    # regenerating rewrites the doc, after which it checks again
    assert tables.main(["--root", str(root)]) == 0
    assert tables.main(["--check", "--root", str(root)]) == 0


def test_a_marker_without_a_table_is_an_error(tmp_path):
    root = _copy_repo(tmp_path)
    doc = root / "docs/offpolicy.md"
    doc.write_text(doc.read_text() + "\n<!-- table:nope -->\n<!-- /table:nope -->\n")
    assert tables.main(["--check", "--root", str(root)]) == 2


def _experiment(tmp_path, gains, name="offpolicy_k1"):
    """results/<name> with probe/score rising by gains[arm][seed] from 0.1 at update 0 (two
    steps generating 7 and 5 tokens, with 0 and 1 refill rounds)."""
    folder = tmp_path / "results" / name
    folder.mkdir(parents=True)
    rows = []
    for arm, per_seed in gains.items():
        for seed, g in enumerate(per_seed):
            rows += [{"arm": arm, "seed": seed, "step": 0, "probe/updates": 0.0,
                      "probe/score": 0.1, "rollout/valid_rate": 0.5,
                      "rollout/generated_tokens": 7.0, "rollout/refill_rounds": 0.0},
                     {"arm": arm, "seed": seed, "step": 1, "rollout/valid_rate": 0.5,
                      "rollout/generated_tokens": 5.0, "rollout/refill_rounds": 1.0},
                     {"arm": arm, "seed": seed, "step": 2, "probe/updates": 2.0,
                      "probe/score": 0.1 + g}]
    compare.write_csv(rows, str(folder / "metrics.csv.gz"))
    seeds = list(range(len(next(iter(gains.values())))))
    (folder / "runs.json").write_text(json.dumps({
        "arms": {a: {} for a in gains}, "seeds": seeds, "complete": True,
        "runs": [{"arm": a, "seed": s} for a in gains for s in seeds]}))
    return tmp_path / "results"


def test_a_known_input_gives_a_known_table(tmp_path):
    results = _experiment(tmp_path, {"behaviour": [0.1, 0.2, 0.3], "learner": [0.2, 0.2, 0.5]})
    text = tables.offpolicy_k1(str(results))
    assert text.startswith("6 of 6 runs finished.")
    lines = [x for x in text.splitlines() if x.startswith("| probe/score |")]
    gains = [c.strip() for c in lines[0].strip("|").split("|")]
    for cell, values in zip(gains[1:], ([0.1, 0.2, 0.3], [0.2, 0.2, 0.5])):
        mean, low, high = ablation.mean_interval(values)
        assert cell == f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"
    diff = [c.strip() for c in lines[1].strip("|").split("|")]
    sd = np.std([0.1, 0.0, 0.2], ddof=1)
    half = 4.302652729911275 * sd / np.sqrt(3)
    # t(0.975, 2) + t(0.8, 2) = 4.3027 + 1.0607
    assert diff == ["probe/score", "learner - behaviour", "0, 1, 2",
                    f"+0.100 [{0.1 - half:+.3f}, {0.1 + half:+.3f}]",
                    f"{(4.302652729911275 + 1.0606601717798212) * sd / np.sqrt(3):.3f}"]
    # keys no run has: no values, said so
    assert "| probe/humanrank | n/a (no runs) | n/a (no runs) |" in text
    assert "| probe/humanrank | learner - behaviour | none | n/a (no runs) | n/a |" in text


def test_the_budget_table_pairs_each_arm_with_lp_and_counts_the_cost(tmp_path):
    gains = {"lp": [0.3, 0.4], "uniform": [0.1, 0.3], "dapo": [0.2, 0.2],
             "reinforce_ada": [0.0, 0.1]}
    results = _experiment(tmp_path, gains, name="samplers_budget")
    text = tables.samplers_budget(str(results))
    for arm in ("uniform", "dapo", "reinforce_ada"):
        row = next(x for x in text.splitlines() if x.startswith(f"| probe/score | lp - {arm} |"))
        diff = [a - b for a, b in zip(gains["lp"], gains[arm])]
        mean, low, high = ablation.mean_interval(diff)
        assert f"| {mean:+.3f} [{low:+.3f}, {high:+.3f}] |" in row
    # each run of _experiment: 2 updates, 7 + 5 generated tokens
    assert "| lp | 2.0 (n = 2: no interval)" not in text
    assert "| lp | 2.0 [2.0, 2.0] | 12 [12, 12] | 0.50 |" in text


def test_gains_need_the_warm_start_probe(tmp_path):
    rows = [{"arm": "a", "seed": 0, "step": 3, "probe/updates": 3.0, "probe/score": 0.5},
            {"arm": "a", "seed": 0, "step": 6, "probe/updates": 6.0, "probe/score": 0.9}]
    assert tables.probe_gains(rows, "probe/score") == {}
    rows.insert(0, {"arm": "a", "seed": 0, "step": 0, "probe/updates": 0.0, "probe/score": 0.2})
    assert tables.probe_gains(rows, "probe/score") == {("a", 0): pytest.approx(0.7)}


def test_raw_data_round_trips_byte_for_byte(tmp_path):
    rows = [{"arm": "x", "seed": 1, "step": 0, "probe/score": 0.1 + 0.2, "reward/mean": -1.0},
            {"arm": "x", "seed": 1, "step": 1, "reward/mean": 0.25}]
    a, b = str(tmp_path / "a.csv.gz"), str(tmp_path / "b.csv.gz")
    compare.write_csv(rows, a)
    compare.write_csv(compare.read_csv(a), b)
    assert compare.read_csv(a) == rows
    assert open(a, "rb").read() == open(b, "rb").read()


def test_arms_parse_and_refuse_nonsense():
    assert compare.parse_arm("learner:grpo.proximal=learner,grpo.tis_cap=3") == (
        "learner", {"grpo.proximal": "learner", "grpo.tis_cap": "3"})
    assert compare.parse_arm("base:") == ("base", {})
    for bad in ("", ":a=1", "x:a", "a b:c=1"):
        with pytest.raises(ValueError):
            compare.parse_arm(bad)


def test_warm_starts_can_be_another_comparisons(tmp_path, monkeypatch):
    """``warm_root``: seed k's warm start is <warm_root>/warm<k>, the arms' runs stay under
    root and start from it."""
    jobs = []

    def run_jobs(batch, **kw):
        jobs.extend(batch)
        return [compare.ablation.RunResult(workdir=wd, seconds=0.0) for _, wd, _ in batch]
    monkeypatch.setattr(compare.ablation, "run_jobs", run_jobs)
    compare.run(str(tmp_path / "b"), {"x": {"rl.token_budget": 9}}, [3], 5,
                warm_root=str(tmp_path / "a"), progress=False)
    assert [(name, wd) for name, wd, _ in jobs] == [
        ("warm3", str(tmp_path / "a" / "warm3")), ("x/seed3", str(tmp_path / "b" / "x" / "seed3"))]
    assert jobs[1][2]["model.init_from_run"] == str(tmp_path / "a" / "warm3")
    assert jobs[1][2]["rl.token_budget"] == 9 and jobs[1][2]["rl.num_steps"] == 5


def test_export_keeps_finished_runs_and_says_if_complete(tmp_path):
    root = tmp_path / "runs"
    run = root / "a" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 0, "time": 1.0, "probe/updates": 0, "probe/score": 0.25,
                    "not/kept": 3}) + "\n")
    (run / ablation.DONE_MARKER).write_text(json.dumps({"fingerprint": "f0"}))
    info = compare.export(str(tmp_path / "out"), str(root), {"a": {}, "b": {"x": 1}}, [0],
                          command="cmd", config="configs/local.py")
    assert info["runs"] == [{"arm": "a", "seed": 0, "fingerprint": "f0"}]
    assert not info["complete"] and info["arms"] == {"a": {}, "b": {"x": "1"}}
    assert compare.read_csv(str(tmp_path / "out/metrics.csv.gz")) == [
        {"arm": "a", "seed": 0, "step": 0, "probe/updates": 0.0, "probe/score": 0.25}]


def _ideator_room(tmp_path, avg):
    """results/ideator_room with a pilot and, per seed k of ``avg`` ({setting: [Avg@3 per seed]}),
    each setting's results.json.gz (valid 0.5, Best@3 = Avg@3 + 0.1)."""
    import gzip

    folder = tmp_path / "results" / "ideator_room"
    folder.mkdir(parents=True)
    (folder / "pilot.json").write_text(json.dumps({"rule": "r", "S": 200, "tried": [
        {"sft_steps": 200, "valid": 0.5, "human_rank": 0.378, "seed": 100}]}))
    for name, per_seed in avg.items():
        for seed, value in enumerate(per_seed):
            (folder / "raw" / f"seed{seed}").mkdir(parents=True, exist_ok=True)
            stats = {"human_rank": {"mean": value}, "best_at_k": {"mean": value + 0.1},
                     "valid": {"mean": 0.5}}
            with gzip.open(folder / "raw" / f"seed{seed}" / f"{name}.json.gz", "wt") as f:
                json.dump({"overall": {"stats": stats}}, f)
    return tmp_path / "results"


def test_the_ideator_table_waits_for_the_planned_seeds_then_pairs_them(tmp_path):
    alone = [0.3 + 0.01 * k for k in range(10)]
    trained = [a + d for a, d in zip(alone, [0.05, 0.1, 0.0, 0.08, 0.02, 0.06, 0.04, 0.1, 0.03, 0.07])]
    avg = {"implementer_alone": alone, "with_untrained_ideator": alone, "with_trained_ideator": trained}
    partial = tables.ideator_room(str(_ideator_room(tmp_path / "a", {k: v[:3] for k, v in avg.items()})))
    assert "3 of 10 planned run seeds finished." in partial and "no conclusion is drawn" in partial
    assert "| 200 | 0.500 | 0.378 |" in partial and "paired" not in partial
    text = tables.ideator_room(str(_ideator_room(tmp_path / "b", avg)))
    row = next(x for x in text.splitlines() if x.startswith("| with_trained_ideator - implementer_alone"))
    diff = [t - a for t, a in zip(trained, alone)]
    mean, low, high = ablation.mean_interval(diff)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == cells[2] == f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"  # Best@3 moves with Avg@3
    assert cells[3] == "+0.000 [+0.000, +0.000]"
    assert cells[4] == f"{tables.detectable_effect(diff):.3f}"
    assert "Decision (the plan's rule, on the primary interval): the trained ideator helps" in text
    noise = [0.02, -0.03, 0.01, -0.01, 0.0, 0.02, -0.02, 0.01, -0.01, 0.0]
    avg["with_trained_ideator"] = [a + d for a, d in zip(alone, noise)]
    text = tables.ideator_room(str(_ideator_room(tmp_path / "c", avg)))
    assert ("no difference detected; the smallest effect this design detects at the observed sd "
            f"is {tables.detectable_effect(noise):.3f}") in text
    avg["with_trained_ideator"] = [a - 0.05 - d for a, d in zip(alone, noise)]
    assert "hurts this implementer (interval entirely below 0)" in tables.ideator_room(
        str(_ideator_room(tmp_path / "d", avg)))
