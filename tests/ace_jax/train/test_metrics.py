"""Metric writers: JSONL, resume truncation, TensorBoard events, progress bar, config dump, plots."""
import io
import json
import os

import ml_collections
import numpy as np
import pytest

from ace_jax.train import metrics


def _png_ok(path):
    with open(path, "rb") as f:
        head = f.read(8)
    assert head == b"\x89PNG\r\n\x1a\n"
    assert os.path.getsize(path) > 2000


def _write_run(workdir, steps, **kw):
    with metrics.MetricWriter(workdir, progress=False, **kw) as w:
        for s in steps:
            w.write(s, {"reward/mean": 0.1 * s, "rollout/valid_rate": np.float32(s / 10),
                        "grpo/zero_var_frac": np.array([0.5])})
    return os.path.join(workdir, metrics.METRICS_FILE)


def test_write_and_read_back(tmp_path):
    import jax.numpy as jnp
    w = metrics.MetricWriter(str(tmp_path), tensorboard=False, progress=False)
    rec = w.write(3, {"reward/mean": jnp.asarray(0.25), "n": 7, "flag": True,
                      metrics.task_scalar("spaceship", "dev_score"): np.float64(0.75)})
    w.write(4, {"reward/mean": float("nan")})
    w.close()
    assert rec["step"] == 3 and rec["reward/mean"] == 0.25
    recs = metrics.read_metrics(str(tmp_path))          # a directory resolves to metrics.jsonl
    assert [r["step"] for r in recs] == [3, 4]
    assert recs[0]["task/spaceship/dev_score"] == 0.75 and recs[0]["n"] == 7.0
    assert recs[0]["flag"] == 1.0 and np.isnan(recs[1]["reward/mean"])
    assert isinstance(recs[0]["time"], float)


def test_bad_input_is_rejected(tmp_path):
    w = metrics.MetricWriter(str(tmp_path), tensorboard=False, progress=False)
    with pytest.raises(TypeError, match="'loss'"):
        w.write(1, {"loss": "high"})
    with pytest.raises(TypeError, match="'vec'"):
        w.write(1, {"vec": np.zeros(3)})
    with pytest.raises(ValueError, match="reserved"):
        w.write(1, {"step": 1.0})
    with pytest.raises(ValueError, match="non-negative"):
        w.write(-1, {"a": 1.0})
    w.write(5, {"a": 1.0})
    with pytest.raises(ValueError, match="resume"):
        w.write(4, {"a": 1.0})
    w.close()
    with pytest.raises(RuntimeError, match="closed"):
        w.write(6, {"a": 1.0})
    with pytest.raises(ValueError, match="task_id"):
        metrics.task_scalar("a/b", "dev_score")
    with pytest.raises(FileNotFoundError):
        metrics.read_metrics(str(tmp_path / "nope.jsonl"))


def test_resume_truncates_later_steps_and_torn_line(tmp_path):
    path = _write_run(str(tmp_path), range(1, 7), tensorboard=False)
    with open(path, "a") as f:                      # kill -9 in the middle of a write
        f.write('{"step": 7, "reward/me')
    w = metrics.MetricWriter(str(tmp_path), tensorboard=False, progress=False)
    w.resume(4)                                     # restored the checkpoint of step 4
    for s in (5, 6, 7):
        w.write(s, {"reward/mean": 100.0 + s})
    w.close()
    recs = metrics.read_metrics(path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6, 7]
    assert [r["reward/mean"] for r in recs[4:]] == [105.0, 106.0, 107.0]
    with open(path) as f:
        assert all(json.loads(line) for line in f)  # every line parses: the torn one is gone
    w2 = metrics.MetricWriter(str(tmp_path), tensorboard=False, progress=False)
    with pytest.raises(ValueError, match="below the last step"):
        w2.write(3, {"a": 1.0})                     # restart without resume() is refused
    w2.close()
    w3 = metrics.MetricWriter(str(tmp_path), tensorboard=False, progress=False)
    w3.resume(0)                                    # a fresh run over an old workdir
    w3.close()
    assert metrics.read_metrics(path) == []


def test_resume_before_any_finished_step(tmp_path):
    """Killed after the first iteration's checkpoint, before step 0 was learned on: resume(-1)
    drops every line (step 0's included), and the run writes step 0 again."""
    path = _write_run(str(tmp_path), range(0, 2), tensorboard=False)
    w = metrics.MetricWriter(str(tmp_path), tensorboard=False, progress=False)
    w.resume(-1)
    w.write(0, {"reward/mean": 1.5})
    w.close()
    assert [(r["step"], r["reward/mean"]) for r in metrics.read_metrics(path)] == [(0, 1.5)]
    w = metrics.MetricWriter(str(tmp_path), tensorboard=False, progress=False)
    with pytest.raises(ValueError, match=">= -1"):
        w.resume(-2)
    w.close()


def test_resume_must_precede_writes(tmp_path):
    w = metrics.MetricWriter(str(tmp_path), tensorboard=False, progress=False)
    w.write(1, {"a": 1.0})
    with pytest.raises(RuntimeError, match="before the first write"):
        w.resume(0)
    w.close()


def test_tensorboard_events_contain_tags_and_purge(tmp_path):
    _write_run(str(tmp_path), [1, 2, 3])
    w = metrics.MetricWriter(str(tmp_path), progress=False)
    w.resume(2)
    w.write(3, {"reward/mean": 9.0})
    w.close()
    tb = metrics.read_tensorboard_scalars(str(tmp_path / metrics.TENSORBOARD_DIR))
    assert {"reward/mean", "rollout/valid_rate", "grpo/zero_var_frac"} <= set(tb)
    assert tb["reward/mean"][-1] == (3, 9.0)
    np.testing.assert_allclose([v for _, v in tb["reward/mean"][:2]], [0.1, 0.2], rtol=1e-6)
    # The resumed writer marked a session restart at step 3: the first run's step-3 events are
    # purged (as TensorBoard does), the resumed value stands.
    assert [s for s, _ in tb["rollout/valid_rate"]] == [1, 2]
    assert [s for s, _ in tb["reward/mean"]] == [1, 2, 3]
    starts = [ev.step for f in os.listdir(tmp_path / metrics.TENSORBOARD_DIR)
              for ev in metrics._read_events(str(tmp_path / metrics.TENSORBOARD_DIR / f))
              if ev.HasField("session_log")]
    assert starts == [3]


class _FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_only_on_tty(tmp_path):
    tty = _FakeTTY()
    with metrics.MetricWriter(str(tmp_path / "a"), tensorboard=False, progress_total=10,
                              progress_file=tty) as w:
        w.write(1, {"reward/mean": 0.5, "rollout/valid_rate": 0.25, "other": 1.0})
        w.write(2, {"reward/mean": 0.75, "perf/gen_tokens_per_s": 1234.0})
    out = tty.getvalue()
    assert "2/10" in out and "reward=0.75" in out and "tok/s=1234" in out and "other" not in out
    plain = io.StringIO()                           # not a TTY: no bar, only the step lines
    with metrics.MetricWriter(str(tmp_path / "b"), tensorboard=False, progress_total=10,
                              progress_file=plain) as w:
        w.write(1, {"reward/mean": 0.5})
    assert plain.getvalue() == "step 1/10  reward 0.5\n"


def test_one_line_per_step_with_the_watched_numbers(tmp_path):
    out = io.StringIO()
    with metrics.MetricWriter(str(tmp_path), tensorboard=False, progress_total=20,
                              progress_file=out) as w:
        for step in (1, 2):
            w.write(step, {"reward/mean": 0.3125, "rollout/valid_rate": 0.5,
                           "score/dev_norm_mean": 0.78125, "perf/learn_seconds": 2.06,
                           "perf/gen_seconds": 5.25, "perf/sandbox_scripts": 16.0,
                           "perf/sandbox_run_seconds": 9.34, "perf/sandbox_wait_seconds": 0.0,
                           "grpo/loss": 0.01, "lp/mean": 3.0})
    lines = out.getvalue().splitlines()
    # the scripts the sandbox ran and their time, apart from the time the step waited for them
    assert lines == ["step 1/20  reward 0.312  valid 0.5  score 0.781  learn 2.1s  gen 5.2s  "
                     "scripts 16  ran 9.3s  waited 0.0s", lines[0].replace("step 1/", "step 2/")]


def test_step_line_above_the_bar_and_off_on_request(tmp_path):
    tty = _FakeTTY()
    with metrics.MetricWriter(str(tmp_path / "a"), tensorboard=False, progress_total=5,
                              progress_file=tty) as w:
        w.write(1, {"reward/mean": 0.5, "perf/gen_seconds": 3.0})
    assert "step 1/5  reward 0.5  gen 3.0s\n" in tty.getvalue() and "1/5 [" in tty.getvalue()
    quiet = io.StringIO()
    with metrics.MetricWriter(str(tmp_path / "b"), tensorboard=False, progress_file=quiet,
                              step_lines=False) as w:
        w.write(1, {"reward/mean": 0.5})
    assert quiet.getvalue() == ""


def test_format_step_line_leaves_out_absent_numbers_and_shows_nan():
    assert metrics.format_step_line(7, {}) == "step 7"
    line = metrics.format_step_line(7, {"rollout/valid_rate": float("nan"),
                                        "perf/learn_seconds": 12.34}, total=9)
    assert line == "step 7/9  valid nan  learn 12.3s"
    assert metrics.format_step_line(1, {"x": 2.0}, fields={"ex": ("x", "")}) == "step 1  ex 2"


def test_write_config(tmp_path):
    cfg = ml_collections.ConfigDict({"rl": {"group_size": 8, "reward": "acegrpo_step"},
                                     "tasks": {"ids": ("a", "b")}})
    w = metrics.MetricWriter(str(tmp_path), progress=False)
    txt, js = w.write_config(cfg)
    w.close()
    assert json.load(open(js))["rl"]["group_size"] == 8
    assert "acegrpo_step" in open(txt).read()
    with pytest.raises(TypeError, match="ConfigDict"):
        metrics.MetricWriter(str(tmp_path / "x"), progress=False).write_config(42)


def test_smooth_ema():
    v = np.array([1.0, 1.0, 1.0, np.nan, 3.0])
    np.testing.assert_allclose(metrics.smooth_ema(v[:3], 0.9), [1.0, 1.0, 1.0])  # debiased
    s = metrics.smooth_ema(v, 0.5)
    assert np.isnan(s[3]) and 1.0 < s[4] < 3.0
    np.testing.assert_array_equal(metrics.smooth_ema(v, 0.0), v)
    with pytest.raises(ValueError):
        metrics.smooth_ema(v, 1.0)


def test_plot_curves(tmp_path):
    path = _write_run(str(tmp_path / "run"), range(1, 21), tensorboard=False)
    out = str(tmp_path / "fig" / "curves.png")
    plotted = metrics.plot_curves(path, out, smooth=0.6)
    assert plotted == ["rollout/valid_rate", "reward/mean", "grpo/zero_var_frac"]
    _png_ok(out)
    with pytest.raises(ValueError, match="available"):
        metrics.plot_curves(path, out, keys=("nope",))


def test_remote_workdir_uploads_and_resumes(tmp_path):
    """An fsspec URL workdir (memory:// here, gs:// in production) is staged locally and uploaded;
    a writer on another machine (another staging dir) resumes from the remote file."""
    import fsspec
    url = f"memory://ace-metrics-{os.getpid()}/run"
    fs = fsspec.filesystem("memory")
    w = metrics.MetricWriter(url, progress=False, local_dir=str(tmp_path / "a"), sync_interval_s=0)
    for s in range(1, 5):
        w.write(s, {"reward/mean": float(s)})
    w.write_config(ml_collections.ConfigDict({"seed": 3}))
    w.close()
    root = url[len("memory://"):]
    remote_lines = fs.cat_file(f"{root}/{metrics.METRICS_FILE}").decode().splitlines()
    assert [json.loads(x)["step"] for x in remote_lines] == [1, 2, 3, 4]
    assert fs.exists(f"{root}/config.json")
    assert any("tfevents" in p for p in fs.find(f"{root}/{metrics.TENSORBOARD_DIR}"))
    w2 = metrics.MetricWriter(url, progress=False, local_dir=str(tmp_path / "b"), sync_interval_s=3600)
    w2.resume(2)                          # truncation is uploaded at once
    assert len(fs.cat_file(f"{root}/{metrics.METRICS_FILE}").decode().splitlines()) == 2
    w2.write(3, {"reward/mean": 30.0})    # within the sync interval: not uploaded yet
    assert len(fs.cat_file(f"{root}/{metrics.METRICS_FILE}").decode().splitlines()) == 2
    w2.close()                            # close uploads
    recs = [json.loads(x) for x in fs.cat_file(f"{root}/{metrics.METRICS_FILE}").decode().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in recs] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    fs.rm(url[len("memory://"):].split("/")[0], recursive=True)


def test_compile_clock_counts_xla_compiles_only_while_started():
    import jax
    import jax.numpy as jnp

    clock = metrics.CompileClock().start()
    try:
        jax.jit(lambda x: jnp.sin(x) * 3.0 + 1.25)(jnp.arange(7.0)).block_until_ready()
        assert clock.total > 0.0
    finally:
        clock.stop()
    stopped = clock.total
    jax.jit(lambda x: jnp.cos(x) - 0.5)(jnp.arange(5.0)).block_until_ready()
    assert clock.total == stopped

