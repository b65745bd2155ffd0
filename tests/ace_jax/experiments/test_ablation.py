"""The ablation runner: override rendering, failure reporting, the summary table."""
import json
import os

import numpy as np
import pytest

from ace_jax.experiments import ablation


def test_override_args_render_tuples_and_scalars():
    args = ablation._override_args({"rl.num_steps": 3, "tasks.ids": ("iris-species",),
                                    "lp.sampler": "uniform"})
    assert args == ["--config.rl.num_steps=3", "--config.tasks.ids=('iris-species',)",
                    "--config.lp.sampler=uniform"]


def test_a_failed_run_is_reported_not_raised(tmp_path):
    res = ablation.run_job(str(tmp_path / "run"), {"rl.no_such_key": 1}, timeout_s=120)
    assert res.error is not None and "exit code 2" in res.error
    assert "no_such_key" in res.error  # the typo check names the key


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_summary_table_first_and_last_windows(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"step": s, "k": float(s)} for s in range(10)])
    b = _write(tmp_path / "b.jsonl", [{"step": s, "k": 2.0 * s} for s in range(10)])
    (row,) = ablation.summary_table({"lp": [a, b]}, keys=("k",), window=5)
    # first 5: means 2 and 4 -> 3; last 5: means 7 and 14 -> 10.5; s.e. = std([7, 14], ddof=1)/sqrt 2
    assert row["first"] == pytest.approx(3.0)
    assert row["last"] == pytest.approx(10.5)
    assert row["last_se"] == pytest.approx(np.std([7.0, 14.0], ddof=1) / np.sqrt(2))
    assert row["n"] == 2
    assert "| lp | k | 3.000 | 10.500 ± 3.500 | 2 |" in ablation.format_table([row])


def test_a_finished_job_is_reused_only_with_the_same_resolved_config(tmp_path, monkeypatch):
    """Reuse keys on the resolved config's contents (``--print_config``, run for real), not on
    the config's path and overrides: an edit of the config file reruns the job."""
    calls, real_run = [], ablation.subprocess.run

    class Done:
        returncode = 0

    def fake_run(cmd, **kw):  # the training run itself is exercised by the notebook test
        if "--print_config" in cmd or cmd[0] == "git":
            return real_run(cmd, **kw)
        calls.append(cmd)
        return Done()

    monkeypatch.setattr(ablation.subprocess, "run", fake_run)
    config = tmp_path / "cfg.py"
    source = (ablation.REPO + "/configs/local.py")
    config.write_text(open(source).read())
    workdir = str(tmp_path / "run")
    first = ablation.run_job(workdir, {"rl.num_steps": 2}, config=str(config))
    again = ablation.run_job(workdir, {"rl.num_steps": 2}, config=str(config))
    other = ablation.run_job(workdir, {"rl.num_steps": 3}, config=str(config))
    assert not first.reused and again.reused and not other.reused
    assert len(calls) == 2
    # the marker names the code the run ran on (this checkout's HEAD)
    with open(os.path.join(workdir, ablation.DONE_MARKER)) as f:
        head = real_run(["git", "rev-parse", "HEAD"], cwd=ablation.REPO, capture_output=True,
                        text=True).stdout.strip()
        assert [c["commit"] for c in json.load(f)["commits"]] == [head]
    # the same path and overrides, other contents: not reused
    config.write_text(open(source).read().replace("c.sft.steps = 200", "c.sft.steps = 199"))
    edited = ablation.run_job(workdir, {"rl.num_steps": 3}, config=str(config))
    assert not edited.reused and len(calls) == 3
    # the seed drives the whole run: seed=0 written out or left to the default is one config
    assert ablation.config_fingerprint(workdir, {"seed": 0}, str(config)) == \
        ablation.config_fingerprint(workdir, {"seed": 0, "lp.seed": 0, "sft.seed": 0},
                                    str(config))


def test_gain_table_gives_each_seed_s_gain_and_its_t_interval(tmp_path):
    # Three seeds whose last-10 minus first-10 means are 10, 20 and 30 (k = g * step / 10).
    files = [_write(tmp_path / f"s{g}.jsonl", [{"step": s, "k": g * s / 10.0} for s in range(20)])
             for g in (10, 20, 30)]
    short = _write(tmp_path / "short.jsonl", [{"step": s, "k": 1.0} for s in range(15)])
    (row,) = ablation.gain_table({"lp": files + [short]}, keys=("k",), window=10)
    half = 4.302652729911275 * 10.0 / np.sqrt(3)  # t(0.975, df=2) * std([10, 20, 30]) / sqrt(3)
    assert row["n"] == 3  # the 15-step run is left out: its windows would overlap
    assert row["gain"] == pytest.approx(20.0)
    assert (row["gain_low"], row["gain_high"]) == pytest.approx((20.0 - half, 20.0 + half))
    assert not row["excludes_zero"]  # [-4.8, 44.8]: three seeds this far apart prove nothing
    assert row["mean"] == pytest.approx(np.mean([g * 9.5 / 10 for g in (10, 20, 30)]))
    steady = [_write(tmp_path / f"t{g}.jsonl", [{"step": s, "k": g * s / 10.0} for s in range(20)])
              for g in (19, 20, 21)]
    (row,) = ablation.gain_table({"lp": steady}, keys=("k",), window=10)
    assert row["excludes_zero"] and row["gain_low"] > 0
    text = ablation.format_gain_table([row])
    assert "| lp | k |" in text and "+20.000 [" in text and "| 3 |" in text


def test_paired_differences_are_per_seed_after_minus_before():
    before = {"values": {"valid": [0.2, 0.4, 0.3], "human_rank": [0.1, 0.2, 0.3],
                         "steps_to_first_valid": [2.0, float("nan"), 3.0],
                         "never_valid": [0.5, 0.5, 0.5]}}
    after = {"values": {"valid": [0.4, 0.55, 0.55], "human_rank": [0.1, 0.2, 0.3],
                        "steps_to_first_valid": [1.0, 1.0, 2.0],
                        "never_valid": [0.5, 0.5, 0.5]}}
    rows = {r["metric"]: r for r in ablation.paired_differences(before, after)}
    # valid: diffs 0.2, 0.15, 0.25 -> mean 0.2, sd 0.05, t(0.975, 2) = 4.303
    assert abs(rows["valid"]["diff"] - 0.2) < 1e-9
    assert abs(rows["valid"]["high"] - (0.2 + 4.302653 * 0.05 / 3 ** 0.5)) < 1e-5
    assert rows["valid"]["excludes_zero"] and rows["valid"]["n"] == 3
    assert rows["human_rank"]["diff"] == 0 and not rows["human_rank"]["excludes_zero"]
    assert rows["steps_to_first_valid"]["n"] == 2  # the seed without a value on one side is out
    assert abs(rows["steps_to_first_valid"]["diff"] + 1.0) < 1e-9
    text = ablation.format_differences(ablation.paired_differences(before, after))
    assert "| valid | +0.200 [" in text and "after - before [95% CI" in text


def test_gain_differences_pair_the_settings_by_seed(tmp_path):
    # k = g * step / 10 over 20 steps: the gain (last 10 - first 10 means) is g.
    def run(setting, seed, g):
        path = tmp_path / setting / f"seed{seed}" / "metrics.jsonl"
        path.parent.mkdir(parents=True)
        return _write(path, [{"step": s, "k": g * s / 10.0} for s in range(20)])

    lp = [run("lp", 0, 3.0), run("lp", 1, 5.0), run("lp", 2, 9.0)]
    uniform = [run("uniform", 2, 8.0), run("uniform", 0, 1.0)]  # seed 1 failed; another order
    (row,) = ablation.gain_differences({"lp": lp, "uniform": uniform}, "lp", "uniform",
                                       keys=("k",), window=10)
    # paired by seed: seed0 3 - 1 = 2, seed2 9 - 8 = 1 (unpaired: (3+5+9)/3 - 4.5 = 1.17)
    assert row["n"] == 2 and row["diff"] == pytest.approx(1.5)
    half = 12.706204736174707 * np.std([2.0, 1.0], ddof=1) / np.sqrt(2)
    assert (row["low"], row["high"]) == pytest.approx((1.5 - half, 1.5 + half))
    text = ablation.format_differences([row], label="lp - uniform")
    assert "| metric | lp - uniform [95% CI over seeds] | seeds |" in text
    assert "| k | +1.500 [" in text


def test_plot_curves_writes_a_figure(tmp_path):
    files = [_write(tmp_path / f"s{g}.jsonl", [{"step": s, "k": g * s} for s in range(12)])
             for g in (1, 2)]
    out = ablation.plot_curves({"lp": files, "uniform": files[:1]}, ("k",),
                               str(tmp_path / "c.png"))
    assert (tmp_path / "c.png").stat().st_size > 1000 and out.endswith("c.png")
