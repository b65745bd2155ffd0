"""The training batch built from grouped rollouts, in the exact layout the sampler used.

A row is ``[left-padded prompt (P) | completion (M)]``: the prompt sits right-aligned in its P
slots as in ``generate.left_pad`` and the completion follows at slots P..P+M-1, so positions,
masks and hence log-probabilities are the ones the sampler saw.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ace_jax import generate


class TrainBatch(NamedTuple):
    """One learner batch of N rows (N = number of prompts x group size).

    Attributes:
      input_ids: int32 [N, P + M] prompt (left-padded) then completion (right-padded).
      positions: int32 [N, P + M] position ids, 0 at each row's first real prompt token.
      attention_mask: bool [N, P + M] real tokens (prompt and completion up to its length).
      completion_mask: float32 [N, M] 1 on the completion tokens that are trained.
      behaviour_logprobs: float32 [N, M] the sampler's log-probs of the completion tokens.
      rewards: float32 [N] one scalar per completion; rows are group-major (G per prompt).
      ref_logprobs: float32 [N, M] frozen reference log-probs (zeros when the KL term is off).
    """

    input_ids: jax.Array
    positions: jax.Array
    attention_mask: jax.Array
    completion_mask: jax.Array
    behaviour_logprobs: jax.Array
    rewards: jax.Array
    ref_logprobs: jax.Array

    @property
    def prompt_len(self) -> int:
        return self.input_ids.shape[1] - self.completion_mask.shape[1]


def make_train_batch(prompts: Sequence[Sequence[int]], gen: generate.GenerationResult,
                     rewards, *, prompt_bucket: int, pad_id: int,
                     ref_logprobs=None) -> TrainBatch:
    """Builds a TrainBatch from the prompts and the grouped generation that answered them.

    ``rewards`` float [N]; rows are ordered as in ``gen`` (prompt-major, G samples each).
    """
    ids, pos, mask = generate.left_pad(prompts, prompt_bucket, pad_id)
    idx = np.asarray(gen.prompt_index)
    tokens = np.asarray(gen.tokens)
    lengths = np.asarray(gen.lengths)
    n, m = tokens.shape
    comp_mask = (np.arange(m)[None, :] < lengths[:, None])
    next_pos = pos[idx, -1][:, None] + 1 + np.arange(m)[None, :]
    rew = np.asarray(rewards, np.float32)
    if rew.shape != (n,):
        raise ValueError(f"rewards must have shape ({n},), got {rew.shape}")
    ref = np.zeros((n, m), np.float32) if ref_logprobs is None else np.asarray(ref_logprobs)
    return TrainBatch(
        input_ids=jnp.asarray(np.concatenate([ids[idx], tokens], axis=1)),
        positions=jnp.asarray(np.concatenate([pos[idx], next_pos], axis=1).astype(np.int32)),
        attention_mask=jnp.asarray(np.concatenate([mask[idx], comp_mask], axis=1)),
        completion_mask=jnp.asarray(comp_mask.astype(np.float32)),
        behaviour_logprobs=jnp.asarray(np.asarray(gen.logprobs, np.float32)),
        rewards=jnp.asarray(rew),
        ref_logprobs=jnp.asarray(ref, dtype=jnp.float32),
    )


def completion_logits(model, batch: TrainBatch) -> tuple[jax.Array, jax.Array]:
    """Runs the policy on full rows; returns (logits float32 [N, M, V] that predict the completion
    tokens, router aux loss scalar).

    Only the M positions that predict completion tokens go through the lm_head (the prompt
    positions' [N, P, V] logits are never formed), which saves that share of the lm_head matmul
    in the forward and the backward pass.
    """
    out = model(batch.input_ids, batch.positions, attention_mask=batch.attention_mask,
                compute_logits=False)
    p = batch.prompt_len
    m = batch.completion_mask.shape[1]
    return model.lm_logits(out.hidden_states[:, p - 1:p - 1 + m, :]), out.aux_loss


def token_logprobs(logits: jax.Array, tokens: jax.Array, temperature: float):
    """log_softmax(logits / T) at ``tokens``: logits [N, M, V], tokens [N, M] -> float32 [N, M].

    Uses the same temperature convention as ``generate.sample_token`` (greedy counts as T = 1).
    """
    t = temperature if temperature > 0 else 1.0
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    return jnp.take_along_axis(logp, tokens[..., None], axis=-1)[..., 0]


def token_entropy(logits: jax.Array, temperature: float) -> jax.Array:
    """Entropy of each next-token distribution: logits [N, M, V] -> float32 [N, M] (nats)."""
    t = temperature if temperature > 0 else 1.0
    logp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)
