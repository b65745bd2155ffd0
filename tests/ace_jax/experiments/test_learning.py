"""The multi-seed learning runner: one whole run per seed, then the gain table and the curves."""
import json
import os
import subprocess

from ace_jax.experiments import ablation, learning


def test_each_seed_is_a_whole_run_and_the_gains_are_tabled(tmp_path, monkeypatch, capsys):
    calls = []

    class Done:
        returncode = 0

    real_run = subprocess.run

    def fake_run(cmd, **kw):  # writes the metrics a real run would (the job itself is tested
        if cmd[1:3] != ["-m", "ace_jax"] or "--print_config" in cmd:
            return real_run(cmd, **kw)  # e.g. matplotlib's font cache; the config's fingerprint
        calls.append(cmd)
        workdir = next(a.split("=", 1)[1] for a in cmd if a.startswith("--config.workdir="))
        seed = int(next(a.split("=", 1)[1] for a in cmd if a.startswith("--config.seed=")))
        os.makedirs(workdir, exist_ok=True)
        with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
            for s in range(20):
                f.write(json.dumps({"step": s, "rollout/valid_rate": (seed + 1) * s / 100,
                                    "score/dev_norm_all": 0.5, "grpo/zero_var_frac": 0.25}) + "\n")
        return Done()

    monkeypatch.setattr(ablation.subprocess, "run", fake_run)
    root = str(tmp_path / "learning")
    rc = learning.main(["--root", root, "--seeds", "0,1", "--steps", "20",
                        "--config.rl.group_size=4"])
    assert rc == 0
    assert len(calls) == 2
    for seed, cmd in enumerate(calls):
        assert {f"--config.seed={seed}", "--config.rl.num_steps=20",
                "--config.rl.group_size=4", "--config=configs/local.py"} <= set(cmd)
        assert "--config.model.init_from_run" not in " ".join(cmd)  # each seed its own warm start
    out = capsys.readouterr().out
    assert "| default | rollout/valid_rate |" in out and "| 2 |" in out
    assert open(os.path.join(root, "gains.md")).read().strip() == out.strip()
    assert os.path.getsize(os.path.join(root, "curves.png")) > 1000
    # Run again: both seeds are reused, nothing starts.
    assert learning.main(["--root", root, "--seeds", "0,1", "--steps", "20",
                          "--config.rl.group_size=4"]) == 0
    assert len(calls) == 2


def test_eval_table_shows_intervals_over_runs():
    mean, low, high = ablation.mean_interval([0.2, 0.4])
    row = dict(label="after", runs=2, valid=mean, valid_low=low, valid_high=high,
               human_rank=0.5, steps_to_first_valid=1.5, never_valid=0.0)
    text = ablation.format_eval_table([row])
    assert f"| after | 2 | 0.30 [{low:.2f}, {high:.2f}] | 0.500 | 1.50 | 0.00 |" in text
