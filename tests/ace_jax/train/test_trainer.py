"""Setup errors of the trainer are clear and come before any heavy work."""
import pytest

from ace_jax import config_utils
from ace_jax.curriculum import seeds
from ace_jax.train import trainer


@pytest.fixture
def cfg(tmp_path):
    c = config_utils.load_config_file("configs/local.py")
    c.workdir = str(tmp_path / "run")
    c.tasks.cache_dir = str(tmp_path / "tasks")
    return c


def test_gs_without_credentials_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("NO_GCE_CHECK", "true")           # not on a GCE VM: no metadata server
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path))  # no gcloud application-default file
    with pytest.raises(trainer.SetupError, match="credentials"):
        trainer.check_writable("gs://some-bucket/run")


def test_unknown_task_is_refused_with_the_available_ones(cfg):
    cfg.tasks.ids = ("iris-species", "no-such-task")
    with pytest.raises(trainer.SetupError, match="no-such-task.*available"):
        trainer.Trainer(cfg, progress=False)


def test_unknown_reward_and_bad_group_size(cfg):
    cfg.rl.reward = "nope"
    with pytest.raises(KeyError, match="acegrpo_step"):
        trainer.Trainer(cfg, progress=False)
    cfg.rl.reward = "acegrpo_step"
    cfg.rl.group_size = 1
    with pytest.raises(trainer.SetupError, match="group_size"):
        trainer.Trainer(cfg, progress=False)


def test_missing_mlebench_dir(cfg, tmp_path):
    cfg.tasks.source = "mlebench"
    cfg.tasks.data_dir = str(tmp_path / "absent")
    with pytest.raises(trainer.SetupError, match="not a directory"):
        trainer.Trainer(cfg, progress=False)


def test_tokenizer_that_does_not_match_the_model(cfg, tmp_path):
    from flax import nnx

    from models import configs, hf_mapping, qwen3, tokenizer

    tok_dir = tmp_path / "tok"
    tokenizer.train_bpe_tokenizer(["print('hello world')\n" * 50, "import numpy as np\n" * 50],
                                  300, str(tok_dir))
    small = qwen3.Qwen3ForCausalLM(configs.tiny_dense(vocab_size=128), rngs=nnx.Rngs(0))
    hf_dir = tmp_path / "hf"
    hf_mapping.export_hf(small, small.config, str(hf_dir))
    cfg.model.hf_path = str(hf_dir)
    cfg.model.tokenizer_path = str(tok_dir)
    cfg.tasks.ids = ("iris-species",)
    with pytest.raises(trainer.SetupError, match="do not belong together"):
        trainer.Trainer(cfg, progress=False)


def test_medal_level_from_a_task_report():
    from sandbox.grading import medal_report, medal_thresholds

    thr = medal_thresholds([0.1 * i for i in range(1, 21)], lower_is_better=False)
    levels = [trainer.medal_level(medal_report(s, thr)) for s in (2.5, thr.silver, thr.bronze, 0.0)]
    assert levels == [3, 2, 1, 0]


def test_init_from_run_takes_the_runs_weights_and_tokenizer(cfg, tmp_path):
    import jax
    import numpy as np
    from flax import nnx

    from tests.run_fixture import make_tiny_run

    model, tok = make_tiny_run(str(tmp_path / "warm"))
    cfg.model.init_from_run = str(tmp_path / "warm")
    cfg.tasks.ids = ("iris-species",)
    t = trainer.Trainer(cfg, progress=False)
    assert len(t.tokenizer) == len(tok)
    want = jax.tree.leaves(nnx.state(model, nnx.Param))
    got = jax.tree.leaves(nnx.state(t.model, nnx.Param))
    assert len(want) == len(got)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert t._warm_start() == {}  # no SFT on top of the run's weights


def test_init_from_run_that_is_not_a_run(cfg, tmp_path):
    from tests.run_fixture import make_tiny_run

    make_tiny_run(str(tmp_path / "warm"))
    import shutil

    shutil.rmtree(tmp_path / "warm" / "checkpoints")
    cfg.model.init_from_run = str(tmp_path / "warm")
    cfg.tasks.ids = ("iris-species",)
    with pytest.raises(trainer.SetupError, match="no checkpoint"):
        trainer.Trainer(cfg, progress=False)


def test_root_child_metrics():
    m = trainer.root_child_metrics([True, True, False, False, False], [True, False, True, False, False])
    assert m == {"rollout/root_frac": 0.4, "rollout/valid_rate_root": 0.5,
                 "rollout/valid_rate_child": pytest.approx(1 / 3)}
    assert trainer.root_child_metrics([True, True], [False, True]) == {
        "rollout/root_frac": 1.0, "rollout/valid_rate_root": 0.5}  # no child rollouts: no key


def test_seed_solutions_of_an_evaluation_seed_the_buffer(cfg, tmp_path):
    from ace_jax.curriculum import buffer
    from tests.run_fixture import make_tiny_run

    make_tiny_run(str(tmp_path / "warm"))
    cfg.model.init_from_run = str(tmp_path / "warm")
    cfg.tasks.ids = ("iris-species",)
    code = "print('an earlier valid attempt')\n"
    sols = seeds.write_seed_solutions(
        [buffer.SeedSolution("iris-species", code, 0.9),
         buffer.SeedSolution("wine-cultivar", "print(1)\n", 0.8)],  # not a task of this run
        tmp_path / "eval" / "seed_solutions.jsonl")
    cfg.rl.seed_solutions = str(sols)
    t = trainer.Trainer(cfg, progress=False)
    t._seed_buffer()
    roots = sorted((s.code, s.score, s.origin) for s in t.buffer.states.values())
    assert roots == [("", None, "seed"), (code, 0.9, "evaluation")]


@pytest.mark.parametrize("content, match", [
    (None, "cannot read"),
    ('{"task_id": "iris-species", "code": "x"}\n', "line 1: not a seed solution"),
    ('{"task_id": "iris-species", "code": "x", "score": 1}\nnot json\n', "line 2"),
    ('{"task_id": "iris-species", "code": "x", "score": NaN}\n', "line 1"),
    ('{"task_id": "wine-cultivar", "code": "x", "score": 1}\n', "only for tasks this run"),
])
def test_bad_seed_solutions_are_setup_errors(cfg, tmp_path, content, match):
    path = tmp_path / "seed_solutions.jsonl"
    if content is not None:
        path.write_text(content)
    cfg.rl.seed_solutions = str(path)
    cfg.tasks.ids = ("iris-species",)
    with pytest.raises(trainer.SetupError, match=match):
        trainer.Trainer(cfg, progress=False)
