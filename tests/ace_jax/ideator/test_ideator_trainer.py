"""The MLE-Ideator trainer: config, setup errors, and real RL steps on a tiny setting.

* ``test_scripted_ideas_*``: the real loop (sandbox, rewards, GRPO step, buffer, metrics) for two
  steps, with the ideator's generator replaced by one that writes a fixed valid idea and a fixed
  malformed one per group, and a scripted implementer (a small ChatPolicy class), so the rewards
  are known: -1 malformed, +1 / 0 by the executed script's dev score against the state's.
* ``test_launch_*``: ``python -m ace_jax --config=configs/ideator.py`` for two steps with a
  tiny model, a tiny warm start (code and idea examples) and the "self" implementer (a frozen
  copy of the warm-started policy, saved under <workdir>/implementer).
"""
import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from ace_jax import config_utils
from ace_jax.ideator import ideator, ideator_trainer, sft_examples
from ace_jax.policy.interface import Completion
from ace_jax.runtime import generate
from ace_jax.train.trainer import SetupError
from models import qwen3
from sandbox import seed_corpus

REPO = pathlib.Path(__file__).resolve().parents[3]
TINY_MODEL = dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
IDEA = ("Analysis: refine: the current model is weak.\n"
        "Action: Switch the model to LogisticRegression with StandardScaler.\n"
        "Rationale: A linear model fits iris well.")
JUNK = "I think you should try harder."


def tiny_cfg(tmp_path, tasks_dir):
    c = config_utils.load_config_file(str(REPO / "configs/ideator.py"))
    c.workdir = str(tmp_path / "run")
    c.tasks.cache_dir = str(tasks_dir)
    c.tasks.ids = ("iris-species",)
    c.model.overrides.update(TINY_MODEL)
    c.sft.enabled = False
    c.rl.num_steps = 2
    c.rl.batch_states = 2
    c.rl.group_size = 2
    c.rl.max_prompt_tokens = 512
    c.sampling.max_new_tokens = 64
    c.ideator.implementer_max_new_tokens = 8
    c.sandbox.backend = "process"
    return c


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory):
    from sandbox.tasks import registry

    d = tmp_path_factory.mktemp("tasks")
    registry.load_task("iris-species", d, prepare_if_missing=True)
    return d


# ------------------------------------------------------------------------------------ config


def test_config_loads_and_overrides():
    c = config_utils.load_config_file(str(REPO / "configs/ideator.py"))
    assert c.mode == "ideator" and c.rl.reward == "ideator_ternary"
    assert c.ideator.implementer == "self" and c.rl.seed_with_references
    assert c.ideator.reason == "stagnation" and "stagnation_steps" not in c.ideator  # evaluate's flag
    assert set(c.ideator.sft_kinds) == set(sft_examples.IDEATOR_SFT_KINDS)
    for key in ideator.default_config().keys():   # the prompt / parse keys are all there
        assert key in c.ideator
    # The local base is unchanged where the ideator does not differ.
    local = config_utils.load_config_file(str(REPO / "configs/local.py"))
    assert c.model.to_dict() == local.model.to_dict() and local.mode == "acegrpo"
    assert c.rl.max_prompt_tokens + c.sampling.max_new_tokens <= \
        c.model.overrides.max_position_embeddings
    config_utils.check_overrides(c, ["--config.ideator.implementer=openai:http://h/v1#m",
                                     "--config.ideator.max_action_chars=300", "--config.mode=x"])
    with pytest.raises(config_utils.ConfigKeyError, match="ideator.implementer"):
        config_utils.check_overrides(c, ["--config.ideator.implementor=self"])


def test_implementer_specs():
    parse = ideator_trainer.parse_implementer_spec
    assert parse("self") == ("self", {})
    assert parse("run:runs/local") == ("run", {"workdir": "runs/local", "step": None})
    assert parse("run:runs/local@30") == ("run", {"workdir": "runs/local", "step": 30})
    assert parse("hf:/m/qwen") == ("hf", {"path": "/m/qwen"})
    assert parse("openai:http://127.0.0.1:8000/v1#qwen3") == (
        "openai", {"base_url": "http://127.0.0.1:8000/v1", "model": "qwen3"})
    for bad in ("", "me", "run:", "openai:x/v1#m", "gpt:foo", "self:x"):
        with pytest.raises(SetupError):
            parse(bad)


def test_setup_errors_come_before_heavy_work(tmp_path):
    c = config_utils.load_config_file(str(REPO / "configs/ideator.py"))
    c.workdir = str(tmp_path / "run")
    c.ideator.implementer = "run:" + str(tmp_path / "absent")
    with pytest.raises(SetupError, match="not a directory"):
        ideator_trainer.make_trainer(c, progress=False)
    c.ideator.implementer = "nonsense"
    with pytest.raises(SetupError, match="expected 'self' or a policy spec"):
        ideator_trainer.make_trainer(c, progress=False)
    c.ideator.implementer = "self"
    c.ideator.sft_kinds = ("poems",)
    with pytest.raises(SetupError, match="poems"):
        ideator_trainer.make_trainer(c, progress=False)
    del c["ideator"]
    with pytest.raises(SetupError, match="ideator"):
        ideator_trainer.make_trainer(c, progress=False)


# ------------------------------------------------------------------------------------ scripted


class ScriptedImplementer:
    """A frozen implementer that answers, in turn: the iris logistic-regression script, a reply
    with no code block, and an endpoint error."""

    name = "scripted-implementer"

    def __init__(self):
        self.script = next(s.code for s in seed_corpus.list_scripts("iris-species")
                           if s.name == "03_logreg_c1.py")
        self.calls = []
        self.n = 0

    def complete(self, conversations, *, seed=0):
        self.calls.append((list(conversations), seed))
        out = []
        for _ in conversations:
            k = self.n % 3
            self.n += 1
            out.append(Completion(text=f"```python\n{self.script}```") if k == 0 else
                       Completion(text="I would rather not.") if k == 1 else
                       Completion(text="", error="timeout after 1 s", finish_reason="error"))
        return out


def scripted_generator(tokenizer, texts):
    """A Generator stand-in: sample j of every group is ``texts[j]`` followed by <|im_end|>."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")

    class ScriptedGenerator:
        def __init__(self, model, sampling, **kw):
            self.sampling = sampling

        def update_weights(self, params, version=None):
            pass

        def generate(self, prompts, key, sampling=None):
            s = sampling or self.sampling
            g, m = s.group_size, s.max_new_tokens
            n = len(prompts) * g
            tokens = np.full((n, m), s.pad_id, np.int32)
            lengths = np.zeros((n,), np.int32)
            for i in range(n):
                ids = tokenizer.encode(texts[i % g], add_special_tokens=False)[:m - 1] + [eos]
                tokens[i, :len(ids)] = ids
                lengths[i] = len(ids)
            return generate.GenerationResult(
                tokens, np.full((n, m), -2.0, np.float32), lengths,
                np.ones((n,), np.int32), np.repeat(np.arange(len(prompts)), g).astype(np.int32))

    return ScriptedGenerator


def test_scripted_ideas_get_ternary_rewards_and_metrics(tmp_path, tasks_dir, monkeypatch):
    cfg = tiny_cfg(tmp_path, tasks_dir)
    impl = ScriptedImplementer()
    t = ideator_trainer.make_trainer(cfg, progress=False, implementer=impl)
    monkeypatch.setattr(generate, "Generator", scripted_generator(t.tokenizer, [IDEA, JUNK]))
    try:
        summary = t.run()
    finally:
        t.close()
    assert summary["steps"] == 2
    workdir = pathlib.Path(cfg.workdir)

    # The implementer saw one batched call per step, with the idea's Action as advice.
    assert len(impl.calls) == 2 and all(len(c) == 2 for c, _ in impl.calls)   # B valid ideas
    advice = ideator.parse_idea(IDEA).action
    for convs, _ in impl.calls:
        for conv in convs:
            assert f"Advice from an expert (follow it in this step):\n{advice}" in conv[-1]["content"]
    assert impl.calls[0][1] != impl.calls[1][1]                      # seeded per step

    rows = [json.loads(x) for p in sorted((workdir / "rollouts").glob("*.jsonl"))
            for x in p.read_text().splitlines()]
    assert len(rows) == 2 * 2 * 2
    lower = True  # iris-species: log loss
    for r in rows:
        assert r["reward"] in (-1.0, 0.0, 1.0)
        if not r["idea_valid"]:
            assert r["reward"] == -1.0 and r["idea_error"].startswith("preamble")
            assert r["status"] is None and r["category"] is None
            continue
        assert r["category"] == "model_choice" and r["verb"] == "refine"
        if r["status"] == "ok":
            cur = r["current_score"]
            better = cur is None or (r["dev_score"] < cur if lower else r["dev_score"] > cur)
            assert r["reward"] == (1.0 if better else 0.0)
        else:   # no script (no code block / endpoint error): nothing ran
            assert r["status"] is None and r["reward"] == 0.0
            assert r["implementer_error"] or r["implementer_valid"] is False
    assert {r["reward"] for r in rows} >= {-1.0}
    assert any(r["status"] == "ok" for r in rows)

    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert m["ideator/format_valid_rate"] == 0.5 == m["rollout/format_valid_rate"]
        assert m["ideator/category/model_choice"] == 1.0
        assert sum(m[f"ideator/category/{c}"] for c in ideator.CATEGORIES) == pytest.approx(1.0)
        assert m["ideator/invalid/preamble"] == 0.5 and m["ideator/verb/refine"] == 1.0
        assert 0.0 <= m["ideator/implementer_valid_rate"] <= 1.0
        assert 0.0 <= m["ideator/improve_rate"] <= 0.5
        assert "perf/implementer_seconds" in m and np.isfinite(m["grpo/loss"])
        assert -1.0 <= m["reward/mean"] <= 1.0

    # Executed scripts became child states; the snapshot of a "self" implementer is not needed.
    from ace_jax.curriculum import buffer, buffer_store

    buf = buffer.EvolvingBuffer(cfg.buffer, list(t.targets.values()))
    buffer_store.BufferStore(str(workdir / "buffer")).restore(buf)
    children = [s for s in buf.states.values() if s.origin == "rollout"]
    assert len(children) == sum(r["status"] is not None for r in rows) > 0
    assert all(s.code == impl.script.strip("\n") + "\n" for s in children)
    assert not (workdir / "implementer").exists()    # only a "self" implementer is saved

    # The "self" implementer: a snapshot of the policy, restored from disk (as on a resume).
    monkeypatch.undo()
    t.env._save_snapshot(t.model)
    saved = [np.asarray(x) for x in jax.tree.leaves(nnx.state(t.model, nnx.Param))]
    t.env.ctx = dataclasses.replace(   # the context's model: not what was saved
        t.env.ctx, model=qwen3.Qwen3ForCausalLM(t.model.config, rngs=nnx.Rngs(123)))
    frozen = t.env._self_implementer()
    assert frozen.name == "implementer:self"
    restored = [np.asarray(x) for x in jax.tree.leaves(nnx.state(frozen.model, nnx.Param))]
    assert all(np.array_equal(a, b) for a, b in zip(saved, restored))
    (c,) = frozen.complete([[{"role": "user", "content": "Write a script."}]], seed=0)
    assert c.ok and 1 <= c.completion_tokens <= cfg.ideator.implementer_max_new_tokens
    # A resumed run (no warm start in this process) without a saved copy is refused.
    shutil.rmtree(workdir / "implementer")
    t.env._warm_model = None
    with pytest.raises(SetupError, match="no frozen implementer"):
        t.env._self_implementer()


# ------------------------------------------------------------------------------------ launch


def test_launch_two_steps_with_the_self_implementer(tmp_path, tasks_dir):
    workdir = tmp_path / "run"
    over = [f"--config.model.overrides.{k}={v}" for k, v in TINY_MODEL.items()]
    cmd = [sys.executable, "-m", "ace_jax", "--config=configs/ideator.py",
           f"--config.workdir={workdir}", f"--config.tasks.cache_dir={tasks_dir}",
           "--config.tasks.ids=('iris-species',)", *over,
           "--config.sft.steps=2", "--config.sft.seconds=0", "--config.sft.batch_size=2",
           "--config.sft.buckets=(800,)",
           "--config.sft.kinds=('draft',)", "--config.ideator.sft_kinds=('idea',)",
           "--config.rl.num_steps=2", "--config.rl.batch_states=1", "--config.rl.group_size=2",
           "--config.sampling.max_new_tokens=16", "--config.ideator.implementer_max_new_tokens=8",
           "--config.sandbox.backend=process", "--no_progress"]
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    metrics = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [0, 1]
    for m in metrics:
        assert "ideator/format_valid_rate" in m and "ideator/category/other" in m
    rows = [json.loads(x) for p in sorted((workdir / "rollouts").glob("*.jsonl"))
            for x in p.read_text().splitlines()]
    assert len(rows) == 4 and all(r["reward"] in (-1.0, 0.0, 1.0) for r in rows)
    assert (workdir / "implementer").is_dir()           # the frozen "self" weights
