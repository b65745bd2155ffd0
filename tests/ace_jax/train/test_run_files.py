"""Run-level files (the config, metrics, TensorBoard, rollouts, the buffer) are written by
process 0 alone: a process that is not the writer leaves only its checkpoint shards."""
import os

import pytest

from ace_jax import config_utils
from ace_jax.train import metrics as metrics_lib, trainer

TINY = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16)


@pytest.mark.slow
def test_a_process_that_is_not_the_writer_writes_no_run_level_file(tmp_path):
    from sandbox import seed_corpus
    from sandbox.tasks import registry

    from ace_jax.train import sft

    task = registry.load_task("iris-species", tmp_path / "tasks", prepare_if_missing=True)
    sft.build_tokenizer([task], seed_corpus.list_scripts("iris-species"), 400,
                        str(tmp_path / "tok"))
    cfg = config_utils.load_config_file("configs/local.py")
    cfg.workdir = str(tmp_path / "run")
    cfg.tasks.cache_dir = str(tmp_path / "tasks")
    cfg.tasks.ids = ("iris-species",)
    cfg.model.tokenizer_path = str(tmp_path / "tok")
    cfg.model.overrides.update(TINY)
    cfg.sft.enabled = False
    cfg.rl.update(dict(num_steps=1, batch_states=1, group_size=2))
    cfg.sampling.max_new_tokens = 8
    cfg.sandbox.backend = "process"
    cfg.probe.every = 0

    t = trainer.Trainer(cfg, progress=False)
    # what the trainer of process 1 of a multi-host run holds (jax.process_index() != 0)
    t.is_writer = False
    t.metrics.close()
    t.metrics = metrics_lib.MetricWriter(t.workdir, progress=False, tensorboard=False,
                                         jsonl=False)
    try:
        summary = t.run()
    finally:
        t.close()
    assert summary["steps"] == 1
    # its checkpoint shards (Orbax: every process writes its own) and nothing else
    assert sorted(os.listdir(cfg.workdir)) == ["checkpoints"]
