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


def test_one_changed_probe_value_fails_the_check_of_the_budget_table(tmp_path, capsys):
    """A change to one probe score of one run (lp, seed 2, its last probe) in the raw CSV
    changes its gain, its paired differences and their corrected statistics: caught."""
    root = _copy_repo(tmp_path)
    raw = root / "results/samplers_budget/metrics.csv.gz"
    rows = compare.read_csv(str(raw))
    last = max((r for r in rows if r["arm"] == "lp" and r["seed"] == 2 and "probe/score" in r),
               key=lambda r: r["step"])
    last["probe/score"] += 0.01
    compare.write_csv(rows, str(raw))
    assert tables.main(["--check", "--root", str(root)]) == 1
    assert "docs/results.md: samplers_budget" in capsys.readouterr().out
    assert tables.main(["--root", str(root)]) == 0
    assert tables.main(["--check", "--root", str(root)]) == 0


def test_sign_flip_p_is_the_exact_enumeration():
    import itertools

    def enumerate_p(d):
        sums = [abs(sum(s * x for s, x in zip(signs, d)))
                for signs in itertools.product((1, -1), repeat=len(d))]
        return sum(x >= abs(sum(d)) - 1e-12 for x in sums) / len(sums)

    # 4 of 5 positive, equal magnitudes: |sum| >= 3 when 0, 1, 4 or 5 signs are negative:
    # (1 + 5 + 5 + 1) / 32, the two-sided sign test
    assert compare.sign_flip_p([1.0, 1.0, 1.0, 1.0, -1.0]) == 12 / 32
    # 4 of 5 positive, the negative one the smallest: only itself, all positive and their
    # mirrors reach the observed sum: 4 / 32
    assert compare.sign_flip_p([0.1, 0.2, 0.3, 0.4, -0.05]) == 4 / 32
    assert compare.sign_flip_p([0.3, 0.1, 0.2, 0.5, 0.4]) == 2 / 32      # the floor at n = 5
    assert compare.sign_flip_p([0.0] * 5) == 1.0
    rng = np.random.default_rng(0)
    for n in (1, 2, 5, 8):
        d = list(rng.normal(0.05, 0.1, n))
        assert compare.sign_flip_p(d) == enumerate_p(d)
    assert np.isnan(compare.sign_flip_p([]))
    with pytest.raises(ValueError, match="enumerates"):
        compare.sign_flip_p([0.1] * (compare.SIGN_FLIP_MAX_SEEDS + 1))


def test_holm_and_the_t_p():
    from scipy import stats

    # sorted 0.01, 0.03, 0.04 -> 3 x 0.01, 2 x 0.03, max(0.06, 1 x 0.04)
    assert compare.holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert compare.holm([0.5, 0.4]) == pytest.approx([0.8, 0.8])
    held = compare.holm([0.02, float("nan"), 0.3])      # no test: not counted in m
    assert held[0] == pytest.approx(0.04) and np.isnan(held[1]) and held[2] == pytest.approx(0.3)
    d = [0.094, -0.011, 0.128, 0.057, 0.083]
    assert compare.paired_t_p(d) == pytest.approx(stats.ttest_1samp(d, 0).pvalue)
    assert np.isnan(compare.paired_t_p([0.0, 0.0, 0.0])) and np.isnan(compare.paired_t_p([1.0]))


def test_the_budget_table_corrects_for_its_family_of_three(tmp_path):
    gains = {"lp": [0.3, 0.4, 0.2, 0.5, 0.3], "uniform": [0.1, 0.45, 0.1, 0.3, 0.2],
             "dapo": [0.3, 0.3, 0.3, 0.3, 0.3], "reinforce_ada": [0.0, 0.1, 0.1, 0.2, 0.1]}
    text = tables.samplers_budget(str(_experiment(tmp_path, gains, name="samplers_budget")))
    assert "family-wise 95% interval (Bonferroni, 3 pairs)" in text
    diffs = {a: [x - y for x, y in zip(gains["lp"], gains[a])] for a in gains if a != "lp"}
    p_t = [compare.paired_t_p(d) for d in diffs.values()]
    p_flip = [compare.sign_flip_p(d) for d in diffs.values()]
    for i, (arm, d) in enumerate(diffs.items()):
        row = next(x for x in text.splitlines() if x.startswith(f"| probe/score | lp - {arm} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        mean, low, high = ablation.mean_interval(d, 1 - 0.05 / 3)
        assert cells[4:10] == [f"{sum(x > 0 for x in d)} of 5", f"{p_t[i]:.3f}",
                               f"{p_flip[i]:.4f}", f"{compare.holm(p_t)[i]:.3f}",
                               f"{compare.holm(p_flip)[i]:.4f}",
                               f"{mean:+.3f} [{low:+.3f}, {high:+.3f}]"]
    # lp - uniform: 4 of 5 above 0, the one below the smallest in size
    assert diffs["uniform"][1] < 0 and p_flip[0] == 4 / 32
    assert "- With 5 paired seeds the exact sign-flip p is never below 2 / 2^5 = 0.0625." in text
    assert "- probe/score: Holm (t) rejects " in text


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


def _staleness_runner():
    """benchmarks/bench_offpolicy_staleness.py as a module (it is a script, not a package)."""
    import importlib.util

    path = pathlib.Path(tables.REPO) / tables.STALENESS_RUNNER
    spec = importlib.util.spec_from_file_location("bench_offpolicy_staleness", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _bench_result(speed, valid=(0.2, 0.4), score=(0.1, 0.3)):
    """A JSON result of bench_local_run.py (the fields a staleness line keeps, and one more)."""
    return {"steps": 20, "minutes": 4.5, "rl_steps_per_min": speed,
            "rl_steps_per_min_with_compile": speed - 0.5, "compile_s": 2.54,
            "compiles_after_first_step": 0, "valid_first5": valid[0], "valid_last5": valid[1],
            "score_first5": score[0], "score_last5": score[1], "learns": True}


def test_the_staleness_table_of_no_run_yet_says_so_and_a_missing_file_is_an_error(tmp_path):
    folder = tmp_path / "results" / "offpolicy_staleness"
    folder.mkdir(parents=True)
    (folder / "raw.jsonl").write_text("")
    text = tables.offpolicy_staleness(str(tmp_path / "results"))
    assert text == ("No runs yet: `python benchmarks/bench_offpolicy_staleness.py` writes them "
                    "to `results/offpolicy_staleness/raw.jsonl`.")
    (folder / "raw.jsonl").unlink()
    doc = "<!-- table:offpolicy_staleness -->\n<!-- /table:offpolicy_staleness -->\n"
    with pytest.raises(tables.TableError, match="its raw data is missing"):
        tables.render(doc, str(tmp_path / "results"))


def test_the_staleness_runner_writes_the_lines_the_table_reads(tmp_path):
    runner = _staleness_runner()
    raw = tmp_path / "results" / "offpolicy_staleness" / "raw.jsonl"
    for k, seed, speed in ((2, 0, 9.75), (0, 0, 8.88), (1, 0, 9.0), (1, 0, 9.26)):  # k=1 rerun
        line = runner.record(k, seed, _bench_result(speed), overrides=[], head="23d0d3c",
                             dirty=False, date="2026-12-03T00:00:00+00:00")
        written = runner.merge(raw, line)
    assert [(r["k"], r["seed"], r["rl_steps_per_min"]) for r in written] == [
        (0, 0, 8.88), (1, 0, 9.26), (2, 0, 9.75)]                 # the rerun replaced its line
    assert [json.loads(x) for x in raw.read_text().splitlines()] == written
    assert set(written[0]) == {"k", "seed", "commit", "dirty", "date", "cpus", "overrides",
                               *runner.KEEP} and "learns" not in written[0]
    text = tables.offpolicy_staleness(str(tmp_path / "results"))
    assert text.splitlines() == [
        "| k | seed | commit | RL steps | RL steps / min (compile excluded) | with compile | "
        "compile s | valid first 5 -> last 5 | score first 5 -> last 5 |",
        "|---|---|---|---|---|---|---|---|---|",
        "| 0 | 0 | 23d0d3c | 20 | 8.88 | 8.38 | 2.5 | 0.20 -> 0.40 | 0.100 -> 0.300 |",
        "| 1 | 0 | 23d0d3c | 20 | 9.26 | 8.76 | 2.5 | 0.20 -> 0.40 | 0.100 -> 0.300 |",
        "| 2 | 0 | 23d0d3c | 20 | 9.75 | 9.25 | 2.5 | 0.20 -> 0.40 | 0.100 -> 0.300 |"]
    with pytest.raises(ValueError, match="lacks"):           # a run with no timed RL step
        runner.record(0, 0, {"steps": 0}, overrides=[], head="x", dirty=False)


def test_the_staleness_table_averages_seeds_and_names_a_run_off_the_setting(tmp_path):
    runner = _staleness_runner()
    raw = tmp_path / "results" / "offpolicy_staleness" / "raw.jsonl"
    speeds = {(0, 0): 8.0, (0, 1): 9.0, (0, 2): 10.0, (1, 0): 9.5}
    for (k, seed), speed in speeds.items():
        runner.merge(raw, runner.record(
            k, seed, _bench_result(speed), head="abc1234", dirty=(k, seed) == (1, 0),
            overrides=["--config.rl.num_steps=3"] if (k, seed) == (0, 2) else []))
    text = tables.offpolicy_staleness(str(tmp_path / "results"))
    assert "| 1 | 0 | abc1234+dirty | 20 | 9.50 |" in text
    mean, low, high = ablation.mean_interval([8.0, 9.0, 10.0])
    assert f"| 0 | 3 | {mean:.2f} [{low:.2f}, {high:.2f}] |" in text
    assert "| 1 | 1 | 9.50 (n = 1: no interval) |" in text
    assert text.splitlines()[-1] == "k = 0, seed 2: with `--config.rl.num_steps=3`."


def test_a_new_staleness_run_fails_the_check_until_the_tables_are_regenerated(tmp_path, capsys):
    root = _copy_repo(tmp_path)
    assert tables.main(["--check", "--root", str(root)]) == 0
    runner = _staleness_runner()
    runner.merge(root / "results/offpolicy_staleness/raw.jsonl", runner.record(
        0, 0, _bench_result(8.88), overrides=[], head="23d0d3c", dirty=False))
    assert tables.main(["--check", "--root", str(root)]) == 1
    assert "docs/offpolicy.md: offpolicy_staleness" in capsys.readouterr().out
    assert tables.main(["--root", str(root)]) == 0
    assert "| 0 | 0 | 23d0d3c | 20 | 8.88 |" in (root / "docs/offpolicy.md").read_text()
    assert tables.main(["--check", "--root", str(root)]) == 0


def test_the_partial_rollouts_table_reads_the_benchmarks_lines_and_a_change_fails_the_check(
        tmp_path, capsys):
    """Each raw line of benchmarks/bench_rollouts.py is one row; one changed value (a lost
    sample) fails `--check` on docs/offpolicy.md until the tables are regenerated."""
    root = _copy_repo(tmp_path)
    raw = root / "results/partial_rollouts/raw.jsonl"
    lines = raw.read_text().splitlines()
    table = tables.TABLES.get("partial_rollouts")(str(root / "results"))
    assert len(table.splitlines()) == 2 + len(lines)
    first = json.loads(lines[0])
    assert f"| {first['useful_speedup']:.2f}x |" in table
    first["lost"] = 1
    raw.write_text("\n".join([json.dumps(first)] + lines[1:]) + "\n")
    assert tables.main(["--check", "--root", str(root)]) == 1
    assert "docs/offpolicy.md: partial_rollouts" in capsys.readouterr().out
    assert tables.main(["--root", str(root)]) == 0
    assert "| 1 | 0 |" in tables.TABLES.get("partial_rollouts")(str(root / "results"))


def _heldout_results(tmp_path):
    """A results/procedural_heldout of two seeds (warm, lp and sft finished); returns (key, the
    warm starts' probe per seed, the arms' last probe per seed)."""
    key = "probe/heldout_valid_rate"
    warm, final = {0: 0.2, 1: 0.3}, {"lp": {0: 0.5, 1: 0.4}, "sft": {0: 0.25, 1: 0.35}}
    rows = [{"arm": "warm", "seed": s, "step": 0, "probe/updates": 0.0, key: v}
            for s, v in warm.items()]
    for s in warm:
        rows.append({"arm": "lp", "seed": s, "step": 0, "rollout/generated_tokens": 10.0})
        rows.append({"arm": "lp", "seed": s, "step": 2, "probe/updates": 2.0,
                     key: final["lp"][s]})
        rows.append({"arm": "sft", "seed": s, "step": 0, "probe/updates": 0.0,
                     key: final["sft"][s]})
    folder = tmp_path / "procedural_heldout"
    folder.mkdir(parents=True)
    compare.write_csv(rows, str(folder / "metrics.csv.gz"))
    c = {"commit": "f" * 40, "dirty": False}
    runs = [{"arm": a, "seed": s, "fingerprint": "x", "commits": [c]}
            for a in ("warm", "lp", "sft") for s in warm]
    (folder / "runs.json").write_text(json.dumps({
        "arms": {a: {} for a in tables.PROCEDURAL_ARMS}, "seeds": [0, 1], "runs": runs,
        "complete": False}))
    return key, warm, final


def test_the_heldout_table_measures_every_arm_from_its_seed_s_warm_start(tmp_path):
    """results/procedural_heldout: the arms probe only after their last update (probe.at_start
    = False) and the SFT control only once (rl.num_steps = 0); each gain is taken from the warm
    start's probe of the same seed, and lp - warm is the default's gain itself. Runs list the
    commits they ran on."""
    key, warm, final = _heldout_results(tmp_path)
    text = tables.procedural_heldout(str(tmp_path))
    assert text.startswith("4 of 12 runs finished (incomplete")
    gain = {a: [final[a][s] - warm[s] for s in warm] for a in final}
    row = next(x for x in text.splitlines() if x.startswith(f"| {key} | lp - warm |"))
    mean, low, high = ablation.mean_interval(gain["lp"])
    assert f"| {mean:+.3f} [{low:+.3f}, {high:+.3f}] |" in row
    row = next(x for x in text.splitlines() if x.startswith(f"| {key} | lp - sft |"))
    mean, low, high = ablation.mean_interval([a - b for a, b in zip(gain["lp"], gain["sft"])])
    assert f"| {mean:+.3f} [{low:+.3f}, {high:+.3f}] |" in row
    assert "| fffffff | 6: warm/0, warm/1, lp/0, lp/1, sft/0, sft/1 |" in text
    assert "Decision" not in text                        # not before every planned seed is in
    info = json.loads((tmp_path / "procedural_heldout" / "runs.json").read_text())
    (tmp_path / "procedural_heldout" / "runs.json").write_text(json.dumps({**info,
                                                                           "complete": True}))
    decided = tables.procedural_heldout(str(tmp_path)).split(
        f"Decision (plan.md's rule, on {key}):\n")[1].splitlines()
    assert decided[0].startswith("- (1) lp - warm: ") and decided[5].startswith("- (6) lp - sft: ")
    assert decided[-1].startswith("- configs/local.py's default: ")


def test_the_heldout_figure_plots_the_table_s_numbers_seed_by_seed(tmp_path):
    """The figure's points are the per-seed gains and differences the table summarises; --figures
    writes it under docs/figures of the checkout it is given (a PNG)."""
    key, warm, final = _heldout_results(tmp_path / "results")
    gains, diffs = tables.paired_points(str(tmp_path / "results"), "procedural_heldout",
                                        tables.PROCEDURAL_ARMS, tables.PROCEDURAL_PAIRS, key,
                                        baseline=compare.WARM)
    want = {a: {s: pytest.approx(final[a][s] - warm[s]) for s in warm} for a in final}
    assert {a: g for a, g in gains.items() if g} == {**want, compare.WARM: {0: 0.0, 1: 0.0}}
    assert diffs[("lp", "sft")] == {s: pytest.approx(final["lp"][s] - final["sft"][s])
                                    for s in warm}
    assert diffs[("lp", compare.WARM)] == want["lp"] and diffs[("lp", "dapo")] == {}
    assert tables.main(["--figures", "--root", str(tmp_path)]) == 0   # no docs there: figures
    png = (tmp_path / tables.FIGURE_DIR / "procedural_heldout.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    with pytest.raises(SystemExit):
        tables.main(["--figures", "--check"])


def test_the_heldout_decision_follows_the_plan_s_rule_once_every_seed_is_in():
    """plan.md's rule on a known family of ten seeds: a claim in words needs both Holm-adjusted
    p below 0.05, a t-test alone is named as such, the rest is "no difference detected" with the
    detectable effect; the default switches only on a significant positive test (1)."""
    seeds = range(10)
    rng = np.random.default_rng(0)
    per_pair = {
        ("lp", compare.WARM): {s: 0.10 + 0.01 * (s % 3) for s in seeds},      # all up: claimed
        ("lp", "uniform"): {s: float(v) for s, v in zip(seeds, rng.normal(0, 0.05, 10))},
        ("lp", "uniform_cap"): dict(zip(seeds, [0.05] * 7 + [-0.01] * 3)),    # 3 below 0
        ("lp", "dapo"): {s: float(v) for s, v in zip(seeds, rng.normal(0, 0.05, 10))},
        ("lp", "reinforce_ada"): {s: float(v) for s, v in zip(seeds, rng.normal(0, 0.05, 10))},
        ("lp", "sft"): {s: -0.08 - 0.01 * (s % 2) for s in seeds},            # all down
    }
    tests = tables.family_tests(per_pair)
    assert tests[("lp", "sft")]["holm_flip"] < 0.05 and tests[("lp", "uniform")]["holm_t"] > 0.05
    lines = tables.heldout_decision(per_pair)
    assert lines[0].startswith("- (1) lp - warm: RL raises the held-out valid rate (Holm p ")
    assert lines[5].startswith("- (6) lp - sft: RL behind more SFT (")
    assert "no difference detected; the smallest effect this design detects" in lines[1]
    # 7 of 10 above 0: the t-test rejects (Holm p 0.027), the sign-flip test (16 of 1024
    # assignments, Holm p 0.0625) does not
    assert tests[("lp", "uniform_cap")]["holm_t"] < 0.05 < tests[("lp", "uniform_cap")]["holm_flip"]
    assert "significant by the t-test, not by the sign-flip test" in lines[2]
    assert lines[-1] == ("- configs/local.py's default: switches to the procedural family "
                         "(test (1) is significant and positive).")
    per_pair[("lp", compare.WARM)] = {s: -v for s, v in per_pair[("lp", compare.WARM)].items()}
    assert tables.heldout_decision(per_pair)[-1].endswith("keeps the offline suite (test (1) is "
                                                          "not significant and positive).")
