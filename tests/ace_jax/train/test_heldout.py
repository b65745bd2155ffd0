"""The held-out probe's promise (issue 51): a held-out procedural instance's prompt never reaches
the buffer, the SFT examples, a training generation or a learner batch, while the probe measures
it and writes ``probe/heldout_*``.

One tiny run of ``configs/local.py:procedural_smoke`` (2 training instances; 2 held-out
instances and 2 of the held-out family in ``probe.heldout_tasks``), with the SFT warm start on,
in-process (``test_trainer.run_loop``). What the trainer does is intercepted at its boundaries
by wrapping methods of the classes (``monkeypatch``), so nothing of the loop itself changes:

* SFT: ``CodeAgentEnv.sft_examples`` (what ``Trainer._warm_start`` trains on);
* generation: ``generation.host_generate`` (every prompt the policy is sampled on), marked as
  the probe's while ``Trainer._probe`` runs;
* batches: ``Learner.step`` (the token ids of every batch the learner updates on) and
  ``Trainer._learn`` (the rollouts it was built from);
* afterwards the buffer as committed (``<workdir>/buffer``), the rollouts log
  (``<workdir>/rollouts/*.jsonl``) and ``metrics.jsonl``.

A held-out task is found in a text by its id (every prompt names its task) and by its task page
(``agent.describe_task``, what the prompt shows of it); its rendered draft prompt is the probe's.
"""
import math
import pathlib

import numpy as np
import pytest

from ace_jax import config_utils
from ace_jax.curriculum import buffer as buffer_lib, buffer_store
from ace_jax.env import agent
from ace_jax.rl import learner as learner_lib
from ace_jax.train import environment, generation, sft, trainer
from models import tokenizer as tok_lib
from sandbox.tasks import procedural, registry, targets
from tests.ace_jax.train.test_trainer import TINY, run_loop


def procedural_cfg(tmp_path):
    c = config_utils.load_config_file("configs/local.py:procedural_smoke")
    c.workdir = str(tmp_path / "run")
    c.tasks.cache_dir = str(tmp_path / "tasks")
    c.model.overrides.update(TINY)
    c.sft.steps, c.sft.batch_size = 2, 2
    c.rl.update(dict(num_steps=3, batch_states=2, group_size=2))
    c.sampling.max_new_tokens = 8
    c.probe.every = 2
    return c


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The run and everything seen at its boundaries."""
    tmp = tmp_path_factory.mktemp("heldout")
    cfg = procedural_cfg(tmp)
    seen = dict(sft=[], sampled=[], batches=[], learned=[])
    mp = pytest.MonkeyPatch()

    sft_examples = environment.CodeAgentEnv.sft_examples

    def record_sft(self):
        out = sft_examples(self)
        seen["sft"] += list(out)
        return out

    probe_fn, sample_fn = trainer.Trainer._probe, generation.host_generate
    in_probe = [False]
    sampled = []     # (in the probe, prompt token ids), decoded after the run

    def record_probe(self, *a, **kw):
        in_probe[0] = True
        try:
            return probe_fn(self, *a, **kw)
        finally:
            in_probe[0] = False

    def record_sample(generator, prompts, *a, **kw):
        sampled.extend((in_probe[0], list(p)) for p in prompts)
        return sample_fn(generator, prompts, *a, **kw)

    learn_fn, step_fn = trainer.Trainer._learn, learner_lib.Learner.step

    def record_learn(self, s, learn_on=None):
        on = learn_on or s
        seen["learned"] += [(r.task_id, r.state_id) for r in on.rollouts]
        return learn_fn(self, s, learn_on)

    def record_step(self, batch):
        ids, mask = np.asarray(batch.input_ids), np.asarray(batch.attention_mask)
        seen["batches"] += [row[m.astype(bool)].tolist() for row, m in zip(ids, mask)]
        return step_fn(self, batch)

    mp.setattr(environment.CodeAgentEnv, "sft_examples", record_sft)
    mp.setattr(trainer.Trainer, "_probe", record_probe)
    mp.setattr(generation, "host_generate", record_sample)
    mp.setattr(trainer.Trainer, "_learn", record_learn)
    mp.setattr(learner_lib.Learner, "step", record_step)
    try:
        out = run_loop(cfg)
    finally:
        mp.undo()
    wd = pathlib.Path(cfg.workdir)
    tok = tok_lib.load_tokenizer(str(wd / "tokenizer"))
    seen["batch_texts"] = [tok.decode(row, skip_special_tokens=False) for row in seen["batches"]]
    seen["sampled"] = [(probing, tok.decode(p, skip_special_tokens=False))
                       for probing, p in sampled]
    # the committed buffer, restored against the training tasks' targets
    tasks = [registry.load_task(t, cfg.tasks.cache_dir, seed=cfg.tasks.seed)
             for t in cfg.tasks.ids]
    buf = buffer_lib.EvolvingBuffer(cfg.buffer, [targets.task_targets(t) for t in tasks])
    buffer_store.BufferStore(str(wd / "buffer")).restore(buf)
    heldout = [registry.load_task(t, cfg.tasks.cache_dir, seed=cfg.tasks.seed)
               for t in cfg.probe.heldout_tasks]
    return dict(cfg=cfg, out=out, seen=seen, buffer=buf, heldout=heldout)


def _marks(run):
    """Per held-out task: strings any prompt of it holds (its id, its task page) and its
    rendered draft prompt (the probe's)."""
    cfg = run["cfg"]
    out = {}
    for t in run["heldout"]:
        draft = buffer_lib.State(state_id=-1, task_id=t.task_id, parent_id=None, depth=0,
                                 code="", history=[], score=None, origin="probe",
                                 created_step=0)
        out[t.task_id] = (f"Task: {t.task_id}", agent.describe_task(t, cfg.agent),
                          agent.render_prompt(draft, t, cfg.agent))
    return out


def _leaks(texts, marks):
    return sorted({(tid, i) for text in texts for tid, ms in marks.items()
                   for i, m in enumerate(ms) if m in text})


def test_the_smoke_config_splits_as_the_family_does(run):
    cfg = run["cfg"]
    assert [procedural.instance_split(t) for t in cfg.tasks.ids] == ["train"] * 2
    assert sorted(procedural.instance_split(t) for t in cfg.probe.heldout_tasks) == \
        ["heldout", "heldout", "heldout_family", "heldout_family"]


def test_the_probe_saw_the_held_out_prompts(run):
    """Not vacuous: the probe sampled every held-out draft prompt (its ids decode to it)."""
    marks = _marks(run)
    probed = [text for in_probe, text in run["seen"]["sampled"] if in_probe]
    for tid, (head, page, draft) in marks.items():
        assert any(head in p and page in p for p in probed), tid
        assert any(p == draft for p in probed), tid


def test_no_held_out_prompt_reaches_sft(run):
    examples = run["seen"]["sft"]
    assert examples and {e.task_id for e in examples} <= set(run["cfg"].tasks.ids)
    assert not _leaks([e.prompt + e.completion for e in examples], _marks(run))
    for t in run["heldout"]:   # and SFT cannot be built on one: it has no seed scripts
        with pytest.raises(KeyError, match="held out"):
            sft.build_sft_examples([t], sft.default_config(), run["cfg"].agent)


def test_no_held_out_prompt_is_generated_on_in_training(run):
    rl = [text for in_probe, text in run["seen"]["sampled"] if not in_probe]
    assert rl and not _leaks(rl, _marks(run))


def test_no_held_out_prompt_reaches_a_batch(run):
    seen, train = run["seen"], set(run["cfg"].tasks.ids)
    steps = run["cfg"].rl.num_steps
    rows = steps * run["cfg"].rl.batch_states * run["cfg"].rl.group_size
    assert len(seen["batches"]) == len(seen["learned"]) == rows
    assert {tid for tid, _ in seen["learned"]} <= train
    assert all(sid >= 0 for _, sid in seen["learned"])   # buffer states, never a probe state
    assert not _leaks(seen["batch_texts"], _marks(run))
    # the batches are the training prompts: each names a training task
    assert all(any(f"Task: {t}" in text for t in train) for text in seen["batch_texts"])


def test_no_held_out_task_in_the_buffer_or_the_rollouts_log(run):
    train, held = set(run["cfg"].tasks.ids), set(run["cfg"].probe.heldout_tasks)
    states = list(run["buffer"].states.values())
    assert states and {s.task_id for s in states} <= train
    rows = [r for rs in run["out"]["rollouts"].values() for r in rs]
    assert len(rows) == run["cfg"].rl.num_steps * 4
    assert {r["task_id"] for r in rows} <= train
    ids = {s.state_id for s in states}
    assert all(r["state_id"] in ids for r in rows)
    assert not [r for r in rows if r["task_id"] in held]


def test_the_held_out_probe_metrics_are_written(run):
    probes = run["out"]["probes"]
    assert [(step, p["probe/updates"]) for step, p in probes] == [(0, 0), (2, 2), (3, 3)]
    for _, p in probes:
        for group in ("heldout", "heldout_instances", "heldout_family"):
            for m in ("valid_rate", "score"):
                assert math.isfinite(p[f"probe/{group}_{m}"]), (group, m)
        assert p["probe/heldout_valid_rate"] == p["probe/valid_rate_heldout"]
        assert "probe/valid_rate_train" in p      # the in-distribution probe stays


def test_a_held_out_instance_in_tasks_ids_stops_the_trainer(tmp_path):
    c = config_utils.load_config_file("configs/local.py:procedural_smoke")
    c.workdir, c.tasks.cache_dir = str(tmp_path / "run"), str(tmp_path / "tasks")
    c.tasks.ids = tuple(c.tasks.ids) + ("proc-tokens-005",)
    with pytest.raises(trainer.SetupError, match="held-out procedural instances.*proc-tokens-005"):
        trainer.Trainer(c, progress=False)
