"""Warm start: a tokenizer trained on the task texts and seed corpus, and a short supervised stage.

The tiny local policy starts from random weights. Before RL it is taught, by next-token
cross-entropy on completion tokens only, to answer agent prompts with the seed corpus' scripts:

* ``build_tokenizer(tasks, corpus, vocab_size, out_dir)``: a byte-level BPE (Qwen3 pre-tokeniser
  and special tokens, ``models.tokenizer.train_bpe_tokenizer``) trained on the rendered agent
  prompts of every task and the corpus scripts in their completion format (deterministic).
* ``build_sft_examples(tasks, cfg)``: (prompt, completion) text pairs. Prompts are rendered exactly
  as the RL agent renders them (``agent.render_prompt``), completions by
  ``agent.completion_target``. Kinds: *draft* (empty state -> each reference script of the task),
  *improve* (a state holding the weaker script of a measured pair, with its dev score in the
  history -> the stronger script) and *debug* (a state holding a script with one import line
  removed, with the NameError it raises -> the original script).
* ``train_sft(model, tokenizer, examples, cfg)``: AdamW on the masked CE, one jitted step, batches of
  similar length (padded to one of a few ``cfg.buckets`` widths, to bound recompilation), a tqdm bar,
  and a budget: stop after ``cfg.steps`` steps or ``cfg.seconds`` seconds, whichever comes first.
  Deterministic for a seed (batch order; the model's init is the caller's).

The trainer runs them in order (``ace_jax.train.setup.load_tokenizer`` and ``setup.warm_start``).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import random
import re
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from flax import nnx

from ace_jax import config_utils
from ace_jax.curriculum.buffer import State, StepSummary
from ace_jax.env import agent
from ace_jax.rl import learner
from models.tokenizer import ENDOFTEXT, IM_END, train_bpe_tokenizer

EXAMPLE_KINDS = ("draft", "improve", "debug")


class SFTError(ValueError):
    """Bad SFT input (no examples, an unknown kind, an example that cannot fit, ...)."""


def default_config() -> ml_collections.ConfigDict:
    """The ``sft`` config section (warm start)."""
    c = ml_collections.ConfigDict()
    c.enabled = True             # the trainer runs the warm start only when True
    c.vocab_size = 1024          # trained BPE vocabulary (warm_start), 5 added tokens included
    # Example kinds built by build_sft_examples. Drafts only by default: on the local 2-core budget
    # (~200 steps) adding improve / debug examples halved the draft epochs and the warm-started
    # policy wrote no valid draft (benchmarks/bench_warm_start.py); add them when steps allow.
    c.kinds = ("draft",)
    c.debug_per_task = 3         # synthetic debug examples per task (0: none)
    c.steps = 200                # optimizer steps (upper bound; also the cosine decay length)
    c.seconds = 240.0            # wall-clock budget (compilation included); <= 0: no limit
    c.batch_size = 8             # sequences per step
    c.learning_rate = 3e-3       # peak AdamW learning rate
    c.warmup_steps = 10
    c.end_lr_ratio = 0.1         # cosine decay to lr * end_lr_ratio at ``steps``
    c.weight_decay = 0.0
    c.max_grad_norm = 1.0
    c.aux_loss_coef = 0.01       # MoE router load-balancing loss weight
    # Batch widths (tokens): each example is padded to the smallest bucket that holds it, so at most
    # len(buckets) shapes are compiled; longer examples are dropped (never truncated).
    c.buckets = (448, 768)       # local sizes: drafts <= ~430 tokens, improve / debug <= ~780
    c.seed = 0                   # batch order, synthetic examples (a run's config: -1 = its seed)
    return c


# --------------------------------------------------------------------------------------------------
# Tokenizer


def tokenizer_texts(tasks: Sequence[Any], corpus: Sequence[Any], agent_cfg=None) -> list[str]:
    """The BPE training corpus: draft prompts of every task (brief and full description) and every
    corpus script in its completion format (``corpus`` items have ``.code``)."""
    texts = []
    for task in tasks:
        empty = _state(task.task_id, "", [], None)
        for mode in agent.DESCRIPTION_MODES:
            cfg = (agent_cfg or agent.default_config()).copy_and_resolve_references()
            cfg.description = mode
            texts.append(agent.render_prompt(empty, task, cfg))
    texts += [agent.completion_target(s.code) for s in corpus]
    return texts


def build_tokenizer(tasks: Sequence[Any], corpus: Sequence[Any], vocab_size: int, out_dir: str,
                    agent_cfg=None, extra_texts: Sequence[str] = ()):
    """Trains and saves the byte-level BPE (deterministic); returns it loaded from ``out_dir``.

    Args:
      tasks: ``sandbox.tasks.base.Task`` list (their prompts are part of the corpus).
      corpus: seed scripts (objects with ``.code``, e.g. ``sandbox.seed_corpus.SeedScript``).
      vocab_size: total vocabulary including the 5 Qwen3 added tokens.
      out_dir: where ``tokenizer.json`` / ``tokenizer_config.json`` are written.
      agent_cfg: the ``agent`` section the prompts are rendered with.
      extra_texts: more training texts (e.g. the ideator's prompts and ideas), after the others.
    """
    texts = tokenizer_texts(tasks, corpus, agent_cfg) + list(extra_texts)
    if not texts:
        raise SFTError("build_tokenizer: no tasks and no corpus scripts")
    return train_bpe_tokenizer(texts, vocab_size, out_dir)


# --------------------------------------------------------------------------------------------------
# Examples


@dataclasses.dataclass(frozen=True)
class SFTExample:
    """One supervised pair; ``kind`` in EXAMPLE_KINDS, ``task_id`` for bookkeeping."""

    prompt: str
    completion: str
    kind: str
    task_id: str

    def __iter__(self):  # unpacks as (prompt, completion)
        return iter((self.prompt, self.completion))


def _state(task_id: str, code: str, history: list, score: Optional[float]) -> State:
    return State(state_id=0, task_id=task_id, parent_id=None, depth=len(history), code=code,
                 history=history, score=score, origin="seed", created_step=0)


_IMPORT = re.compile(r"^from [\w.]+ import (\w+)$")


def break_import(code: str, rng: random.Random) -> Optional[tuple[str, str]]:
    """Removes one ``from x import Name`` line whose name is used later; returns (broken code, the
    stderr tail Python would print) or None if the script has no such line."""
    lines = code.split("\n")
    cands = []
    for i, line in enumerate(lines):
        m = _IMPORT.match(line.strip())
        if m and re.search(rf"\b{m.group(1)}\b", "\n".join(lines[i + 1:])):
            cands.append((i, m.group(1)))
    if not cands:
        return None
    i, name = rng.choice(cands)
    broken = "\n".join(lines[:i] + lines[i + 1:])
    return broken, f"NameError: name '{name}' is not defined"


def build_sft_examples(tasks: Sequence[Any], cfg: Optional[ml_collections.ConfigDict] = None,
                       agent_cfg: Optional[ml_collections.ConfigDict] = None, *,
                       seed_corpus_seed: int = 0) -> list[SFTExample]:
    """(prompt, completion) examples for ``tasks`` from ``sandbox.seed_corpus``.

    Args:
      tasks: the tasks (each needs seed scripts in ``sandbox.seed_corpus``).
      cfg: the ``sft`` section (``kinds``, ``debug_per_task``, ``seed``).
      agent_cfg: the ``agent`` section used to render prompts (must be the RL run's).
      seed_corpus_seed: which committed sweep's measured pairs / scores to use.

    Returns:
      Examples grouped by task then kind (draft, improve, debug), deterministic.
    """
    from sandbox import seed_corpus

    cfg = cfg or default_config()
    agent_cfg = agent_cfg or agent.default_config()
    unknown = set(cfg.kinds) - set(EXAMPLE_KINDS)
    if unknown:
        raise SFTError(f"unknown sft.kinds {sorted(unknown)}; expected a subset of {EXAMPLE_KINDS}")
    pairs = seed_corpus.improvement_pairs(seed=seed_corpus_seed)
    weak_scores = _measured_weak_scores(seed_corpus_seed)
    rng = random.Random(config_utils.section_seed(cfg.seed, "sft.seed"))
    out: list[SFTExample] = []
    for task in tasks:
        scripts = seed_corpus.list_scripts(task.task_id)
        if not scripts:
            raise SFTError(f"no seed scripts for task {task.task_id!r}")
        if "draft" in cfg.kinds:
            prompt = agent.render_prompt(_state(task.task_id, "", [], None), task, agent_cfg)
            out += [SFTExample(prompt, agent.completion_target(s.code), "draft", task.task_id)
                    for s in scripts]
        if "improve" in cfg.kinds:
            for weak, strong in pairs:
                if weak.task_id != task.task_id:
                    continue
                score = weak_scores.get((task.task_id, weak.name))
                hist = [StepSummary("draft", "ok", score, "")]
                st = _state(task.task_id, weak.code, hist, score)
                out.append(SFTExample(agent.render_prompt(st, task, agent_cfg),
                                      agent.completion_target(strong.code), "improve", task.task_id))
        if "debug" in cfg.kinds and cfg.debug_per_task > 0:
            order = list(scripts)
            rng.shuffle(order)
            made = 0
            for s in order:
                broken = break_import(s.code, rng)
                if broken is None:
                    continue
                hist = [StepSummary("draft", "runtime_error", None,
                                    "Traceback (most recent call last):\n" + broken[1])]
                st = _state(task.task_id, broken[0], hist, None)
                out.append(SFTExample(agent.render_prompt(st, task, agent_cfg),
                                      agent.completion_target(s.code), "debug", task.task_id))
                made += 1
                if made >= cfg.debug_per_task:
                    break
    if not out:
        raise SFTError(f"no SFT examples for tasks {[t.task_id for t in tasks]} and kinds {tuple(cfg.kinds)}")
    return out


def _measured_weak_scores(seed: int) -> dict[tuple[str, str], float]:
    import json

    from sandbox import seed_corpus

    path = seed_corpus.RESULTS_DIR / f"seed{seed}" / "pairs.json"
    rows = json.loads(path.read_text()) if path.exists() else []
    rows += seed_corpus.procedural_pair_rows(seed)
    return {(r["task_id"], r["weak"]): float(r["weak_dev"]) for r in rows}


# --------------------------------------------------------------------------------------------------
# Tokenisation and batching


@dataclasses.dataclass
class TokenizedExample:
    """ids int [L] = prompt + completion + EOS; ``prompt_len`` tokens of prompt."""

    ids: np.ndarray
    prompt_len: int


def tokenize_examples(tokenizer, examples: Sequence[Any], max_len: int) -> tuple[list[TokenizedExample], int]:
    """Tokenises (prompt, completion) pairs; appends ``<|im_end|>``. Returns (kept, dropped count):
    examples longer than ``max_len`` are dropped, never truncated (a cut completion would teach
    the policy to leave its code block open)."""
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    kept, dropped = [], 0
    for ex in examples:
        prompt, completion = tuple(ex)
        p = tokenizer.encode(prompt, add_special_tokens=False)
        c = tokenizer.encode(completion, add_special_tokens=False) + [eos]
        if len(p) + len(c) > max_len:
            dropped += 1
            continue
        if not p:
            raise SFTError("an example has an empty prompt")
        kept.append(TokenizedExample(np.asarray(p + c, np.int32), len(p)))
    return kept, dropped


def bucket_width(length: int, buckets: Sequence[int]) -> Optional[int]:
    """The smallest bucket >= ``length`` (None when the sequence is longer than every bucket)."""
    for b in sorted(buckets):
        if length <= b:
            return int(b)
    return None


def make_batches(examples: Sequence[TokenizedExample], batch_size: int, buckets: Sequence[int],
                 pad_id: int, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """One epoch of length-bucketed batches in a random order (``rng``).

    Each example goes to the smallest width in ``buckets`` that holds it (so there are at most
    ``len(buckets)`` compiled shapes); within a bucket the examples are shuffled and cut into
    batches of ``batch_size`` (a last, smaller one is padded with empty rows); the batches of all
    buckets are then shuffled. Each batch holds ``input_ids`` int32 [B, W], ``positions`` int32
    [B, W], ``attention_mask`` bool [B, W] and ``loss_mask`` float32 [B, W] (1 where position t's
    target, token t + 1, is a completion token).

    Raises:
      SFTError: an example is longer than the largest bucket.
    """
    by_width: dict[int, list[TokenizedExample]] = collections.defaultdict(list)
    for e in examples:
        w = bucket_width(len(e.ids), buckets)
        if w is None:
            raise SFTError(f"an example of {len(e.ids)} tokens exceeds the largest bucket {max(buckets)}")
        by_width[w].append(e)
    batches = []
    for width in sorted(by_width):
        group = by_width[width]
        perm = rng.permutation(len(group))
        for start in range(0, len(group), batch_size):
            chunk = [group[i] for i in perm[start:start + batch_size]]
            ids = np.full((batch_size, width), pad_id, np.int32)
            att = np.zeros((batch_size, width), bool)
            loss = np.zeros((batch_size, width), np.float32)
            for r, e in enumerate(chunk):
                n = len(e.ids)
                ids[r, :n] = e.ids
                att[r, :n] = True
                loss[r, e.prompt_len - 1:n - 1] = 1.0   # predicts tokens prompt_len .. n-1
            pos = np.broadcast_to(np.arange(width, dtype=np.int32), (batch_size, width)).copy()
            batches.append(dict(input_ids=ids, positions=pos, attention_mask=att, loss_mask=loss))
    return [batches[i] for i in rng.permutation(len(batches))]


# --------------------------------------------------------------------------------------------------
# Training


def masked_ce(logits: jax.Array, input_ids: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean next-token cross-entropy (nats/token) over positions where ``loss_mask`` is 1.

    logits float [B, T, V] at positions 0..T-1 predict ids 1..T; the last position has no target
    (its mask must be 0). Returns (mean loss, number of counted tokens).
    """
    targets = jnp.concatenate([input_ids[:, 1:], jnp.zeros_like(input_ids[:, :1])], axis=1)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    n = jnp.sum(loss_mask)
    return jnp.sum(nll * loss_mask) / jnp.maximum(n, 1.0), n


def _optim_key(cfg) -> tuple:
    return (float(cfg.learning_rate), int(cfg.warmup_steps), int(cfg.steps), float(cfg.end_lr_ratio),
            float(cfg.weight_decay), float(cfg.max_grad_norm), float(cfg.aux_loss_coef))


def _optimizer_config(lr, warmup, steps, end_ratio, weight_decay, max_grad_norm
                      ) -> ml_collections.ConfigDict:
    """The ``optim`` section that gives the warm start's optimizer to ``learner.make_optimizer``:
    AdamW (default betas / eps) with linear warmup, cosine decay to ``lr * end_ratio`` at
    ``steps``, and global-norm clipping."""
    c = learner.default_config()
    c.update(dict(learning_rate=lr, warmup_steps=warmup, decay_steps=steps,
                  end_lr_ratio=end_ratio, weight_decay=weight_decay, max_grad_norm=max_grad_norm))
    return c


@functools.lru_cache(maxsize=8)
def _compiled_step(graphdef, lr, warmup, steps, end_ratio, weight_decay, max_grad_norm, aux_coef):
    """(optimizer, jitted step) for a model structure and optimizer settings; cached so that a
    second SFT run of the same model and settings reuses the compiled step."""
    tx, _ = learner.make_optimizer(
        _optimizer_config(lr, warmup, steps, end_ratio, weight_decay, max_grad_norm))
    return tx, jax.jit(functools.partial(_sft_step, graphdef, tx, aux_coef), donate_argnums=(0, 1))


def _sft_step(graphdef, tx, aux_coef, params, opt_state, batch):
    def loss_fn(p):
        model = nnx.merge(graphdef, p)
        out = model(batch["input_ids"], batch["positions"], attention_mask=batch["attention_mask"])
        ce, n = masked_ce(out.logits, batch["input_ids"], batch["loss_mask"])
        return ce + aux_coef * out.aux_loss, (ce, n)

    (_, (ce, n)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, dict(loss=ce, tokens=n, grad_norm=optax.global_norm(grads))


def train_sft(model: nnx.Module, tokenizer, examples: Sequence[Any],
              cfg: Optional[ml_collections.ConfigDict] = None, *, progress: bool = True
              ) -> tuple[nnx.Module, dict[str, Any]]:
    """Supervised warm start: CE on completion tokens only, AdamW, jitted step.

    Args:
      model: a ``models.qwen3.Qwen3ForCausalLM``; updated in place (and returned).
      tokenizer: the HF tokenizer (``<|im_end|>`` is the EOS appended to every completion,
        ``<|endoftext|>`` pads).
      examples: (prompt_text, completion_text) pairs (``SFTExample`` or tuples).
      cfg: the ``sft`` section.
      progress: show a tqdm bar.

    Returns:
      (model, metrics) with metrics: ``steps``, ``seconds`` (wall, compilation included),
      ``tokens`` (completion tokens trained on), ``examples``, ``dropped`` (too long),
      ``losses`` (per-step mean CE, nats/token), ``first_loss``, ``final_loss`` (mean of the last
      10 steps), ``stopped_by`` ("steps" | "seconds").
    """
    cfg = cfg or default_config()
    if cfg.steps < 1 or cfg.batch_size < 1:
        raise SFTError(f"sft.steps and sft.batch_size must be >= 1, got {cfg.steps}, {cfg.batch_size}")
    toks, dropped = tokenize_examples(tokenizer, examples, max(cfg.buckets))
    if not toks:
        raise SFTError(f"no SFT example fits the largest bucket {max(cfg.buckets)} ({dropped} dropped)")
    vocab = model.config.vocab_size
    if len(tokenizer) > vocab:
        raise SFTError(f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab}")
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    rng = np.random.default_rng(config_utils.section_seed(cfg.seed, "sft.seed"))

    graphdef, params = nnx.split(model, nnx.Param)
    params = jax.tree.map(jnp.copy, params)
    tx, step_fn = _compiled_step(graphdef, *_optim_key(cfg))
    opt_state = tx.init(params)

    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=cfg.steps, desc="sft", unit="step")
    t0 = time.perf_counter()
    losses, tokens, steps, stopped_by = [], 0, 0, "steps"
    batches: list = []
    while steps < cfg.steps:
        if not batches:
            batches = make_batches(toks, cfg.batch_size, cfg.buckets, pad_id, rng)
        batch = batches.pop(0)
        params, opt_state, m = step_fn(params, opt_state, batch)
        loss = float(m["loss"])  # blocks: the time budget measures finished steps
        if not math.isfinite(loss):
            raise SFTError(f"SFT loss became {loss} at step {steps}; lower sft.learning_rate")
        losses.append(loss)
        tokens += int(m["tokens"])
        steps += 1
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}")
        if cfg.seconds > 0 and time.perf_counter() - t0 >= cfg.seconds:
            stopped_by = "seconds" if steps < cfg.steps else "steps"
            break
    if bar is not None:
        bar.close()
    nnx.update(model, params)
    metrics = dict(steps=steps, seconds=time.perf_counter() - t0, tokens=tokens, examples=len(toks),
                   dropped=dropped, losses=losses, first_loss=losses[0],
                   final_loss=float(np.mean(losses[-10:])), stopped_by=stopped_by)
    return model, metrics
