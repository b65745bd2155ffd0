"""Tests of ace_jax.train.sft: tokenizer, example rendering, completion-only masking, training, determinism.

Tiny shapes: a 2-layer hidden-32 Qwen3-MoE, a 300-token BPE, a handful of examples, a few steps.
"""
import numpy as np
import pytest
from flax import nnx

from ace_jax.curriculum.buffer import State
from ace_jax.env import agent
from ace_jax.train import sft
from models import configs, qwen3
from models.tokenizer import ENDOFTEXT, IM_END, IM_START
from sandbox import seed_corpus
from sandbox.tasks import registry
from tests.numerics import assert_close

TASK_IDS = ("iris-species", "linnerud-physiology")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    cache = tmp_path_factory.mktemp("tasks")
    return [registry.load_task(t, cache, prepare_if_missing=True) for t in TASK_IDS]


@pytest.fixture(scope="module")
def tok(tasks, tmp_path_factory):
    corpus = [s for t in TASK_IDS for s in seed_corpus.list_scripts(t)]
    return sft.build_tokenizer(tasks, corpus, 300, str(tmp_path_factory.mktemp("tok")))


def tiny_cfg(**over):
    c = sft.default_config()
    c.update(dict(steps=6, seconds=0.0, batch_size=2, learning_rate=1e-2, warmup_steps=0,
                  buckets=(64, 96), seed=0))
    c.update(over)
    return c


def tiny_model(seed=0, max_positions=256):
    cfg = configs.tiny_moe(vocab_size=304, num_experts=4, max_position_embeddings=max_positions)
    return qwen3.Qwen3ForCausalLM(cfg, rngs=nnx.Rngs(seed))


# Short synthetic examples (a fixed prompt / answer language) so a few steps move the loss.
TOY = [(f"<|im_start|>user\nrow {i}<|im_end|>\n<|im_start|>assistant\n", f"```python\nx = {i % 3}\n```")
       for i in range(8)]


def test_tokenizer_round_trips_chat_tokens(tok, tasks):
    assert len(tok) <= 300
    st = State(0, tasks[0].task_id, None, 0, "", [], None, "seed", 0)
    prompt = agent.render_prompt(st, tasks[0])
    ids = tok.encode(prompt + agent.completion_target("x = 1\n") + IM_END, add_special_tokens=False)
    assert tok.decode(ids) == prompt + agent.completion_target("x = 1\n") + IM_END
    for special in (IM_START, IM_END, ENDOFTEXT, "<think>", "</think>"):
        sid = tok.convert_tokens_to_ids(special)
        assert tok.encode(special, add_special_tokens=False) == [sid]
        assert ids.count(sid) == prompt.count(special) + (special == IM_END)


def test_tokenizer_is_deterministic(tasks, tmp_path):
    corpus = seed_corpus.list_scripts("iris-species")
    sft.build_tokenizer(tasks[:1], corpus, 280, str(tmp_path / "a"))
    sft.build_tokenizer(tasks[:1], corpus, 280, str(tmp_path / "b"))
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()


def test_examples_use_the_agent_format(tasks):
    ex = sft.build_sft_examples(tasks, tiny_cfg(kinds=("draft", "improve", "debug")))
    kinds = {e.kind for e in ex}
    assert kinds == {"draft", "improve", "debug"}
    iris = [s.code for s in seed_corpus.list_scripts("iris-species")]
    for e in ex:
        prompt, completion = e  # unpacks as a pair
        action = agent.parse_action(completion)
        assert isinstance(action, agent.Action)
        assert completion == agent.completion_target(action.code)
        assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert f"Step: {e.kind}." in prompt
        if e.task_id == "iris-species":
            assert action.code.strip() in [c.strip() for c in iris]
    drafts = [e for e in ex if e.kind == "draft" and e.task_id == "iris-species"]
    st = State(0, "iris-species", None, 0, "", [], None, "seed", 0)
    assert drafts[0].prompt == agent.render_prompt(st, tasks[0])   # exactly as the RL agent renders
    assert len(drafts) == len(iris)
    debug = [e for e in ex if e.kind == "debug"][0]
    assert "runtime_error" in debug.prompt and "NameError: name '" in debug.prompt
    only = sft.build_sft_examples(tasks, tiny_cfg(kinds=("draft",)))
    assert {e.kind for e in only} == {"draft"}
    with pytest.raises(sft.SFTError, match="unknown sft.kinds"):
        sft.build_sft_examples(tasks, tiny_cfg(kinds=("draft", "explore")))


def test_break_import():
    import random
    code = "from a import B\nfrom c import D\nx = B()\n"
    broken, err = sft.break_import(code, random.Random(0))
    assert broken == "from c import D\nx = B()\n" and err == "NameError: name 'B' is not defined"
    assert sft.break_import("import os\nprint(1)\n", random.Random(0)) is None


def test_batches_mask_only_completion_tokens(tok):
    toks, dropped = sft.tokenize_examples(tok, TOY[:3], max_len=96)
    assert dropped == 0
    batches = sft.make_batches(toks, 2, (64, 96), tok.convert_tokens_to_ids(ENDOFTEXT), np.random.default_rng(0))
    rows = [(b, r) for b in batches for r in range(2) if b["attention_mask"][r].any()]
    assert len(rows) == 3
    eos = tok.convert_tokens_to_ids(IM_END)
    for b, r in rows:
        ids, mask = b["input_ids"][r], b["loss_mask"][r]
        n = int(b["attention_mask"][r].sum())
        e = next(t for t in toks if len(t.ids) == n and (t.ids == ids[:n]).all())
        targets = ids[1:n][mask[:n - 1] == 1]
        assert targets.tolist() == e.ids[e.prompt_len:].tolist()     # exactly the completion + EOS
        assert targets[-1] == eos and mask[n - 1:].sum() == 0
    long = [(" ".join(str(i) for i in range(100)), "```python\nx = 1\n```")]
    assert sft.tokenize_examples(tok, long, max_len=96)[1] == 1


def test_prompt_tokens_do_not_contribute_to_the_loss(tok):
    import jax.numpy as jnp
    toks, _ = sft.tokenize_examples(tok, TOY[:2], max_len=96)
    b = sft.make_batches(toks, 2, (64,), 0, np.random.default_rng(0))[0]
    logits = np.random.default_rng(1).normal(size=b["input_ids"].shape + (304,)).astype(np.float32)
    base, n = sft.masked_ce(jnp.asarray(logits), jnp.asarray(b["input_ids"]), jnp.asarray(b["loss_mask"]))
    assert int(n) == int(b["loss_mask"].sum()) > 0
    changed = logits.copy()
    changed[b["loss_mask"] == 0] *= 7.0     # perturb every position whose target is not completion
    again, _ = sft.masked_ce(jnp.asarray(changed), jnp.asarray(b["input_ids"]), jnp.asarray(b["loss_mask"]))
    assert_close(float(again), float(base), reduction_len=logits.shape[-1])
    changed[b["loss_mask"] == 1] *= 3.0
    third, _ = sft.masked_ce(jnp.asarray(changed), jnp.asarray(b["input_ids"]), jnp.asarray(b["loss_mask"]))
    assert abs(float(third) - float(base)) > 1e-3


def test_sft_loss_decreases_and_is_deterministic(tok):
    model, m = sft.train_sft(tiny_model(), tok, TOY, tiny_cfg(steps=12), progress=False)
    assert m["steps"] == 12 and m["stopped_by"] == "steps" and m["dropped"] == 0
    assert np.mean(m["losses"][-3:]) < 0.7 * np.mean(m["losses"][:3])
    assert m["tokens"] > 0
    _, m2 = sft.train_sft(tiny_model(), tok, TOY, tiny_cfg(steps=12), progress=False)
    assert m2["losses"] == m["losses"]
    _, m3 = sft.train_sft(tiny_model(), tok, TOY, tiny_cfg(steps=12, seed=1), progress=False)
    assert m3["losses"] != m["losses"]       # another batch order


def test_sft_updates_the_model_in_place_and_respects_the_time_budget(tok):
    model = tiny_model()
    before = np.asarray(model.embed_tokens.embedding[...]).copy()
    out, m = sft.train_sft(model, tok, TOY, tiny_cfg(steps=12, seconds=1e-3), progress=False)
    assert out is model and m["steps"] == 1 and m["stopped_by"] == "seconds"
    assert not np.allclose(np.asarray(model.embed_tokens.embedding[...]), before)


def test_sft_errors(tok):
    with pytest.raises(sft.SFTError, match="largest bucket"):
        sft.train_sft(tiny_model(), tok, [(" ".join(str(i) for i in range(100)), "```python\nx\n```")], tiny_cfg(), progress=False)
    small = qwen3.Qwen3ForCausalLM(configs.tiny_moe(vocab_size=256, num_experts=4), rngs=nnx.Rngs(0))
    with pytest.raises(sft.SFTError, match="vocab_size"):
        sft.train_sft(small, tok, TOY, tiny_cfg(), progress=False)


def test_warm_start_end_to_end(tasks, tmp_path):
    """The trainer's warm start: its tokenizer (trained into <workdir>/tokenizer), then SFT."""
    from ace_jax import config_utils
    from ace_jax.runtime import placement as placement_lib
    from ace_jax.train import setup

    cfg = config_utils.load_config_file("configs/local.py")
    cfg.sft.update(dict(tiny_cfg(kinds=("draft",), steps=2, buckets=(1536,), vocab_size=300)))
    cfg.agent.show_system = False
    tok = setup.load_tokenizer(cfg, str(tmp_path), tasks[:1])
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file() and len(tok) <= 300
    model, m = setup.warm_start(cfg, tiny_model(max_positions=2048), tok,
                                lambda: sft.build_sft_examples(tasks[:1], cfg.sft, cfg.agent),
                                placement_lib.Placement.from_config(cfg.mesh), progress=False)
    assert m["steps"] == 2 and m["examples"] == len(seed_corpus.list_scripts(TASK_IDS[0]))
    assert np.isfinite(m["final_loss"]) and "losses" not in m
    cfg.sft.enabled = False
    assert setup.warm_start(cfg, model, tok, None, None) == (model, {})
