"""What the rollout engine hands back: a sample (`Completion`: its tokens, behaviour
log-probs, finish reason, policy versions and MoE routing record), and the completions of a
batch of prompts as `generate.Generator.generate` returns them (`generation_result`), which is
how `engine.Engine.generate` keeps the static generator's contract.
"""
from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple

import numpy as np

from ace_jax.runtime import generate
from ace_jax.runtime.engine_programs import NO_ROUTE


class Completion(NamedTuple):
    """One finished sample: ``tokens`` / ``logprobs`` (behaviour log-probs, float32) of its
    ``len(tokens)`` generated tokens (EOS / stop tokens included), ``finish_reason`` a
    `generate.FinishReason` (None for a sample still running, `Engine.snapshot`). With
    ``record_routes`` and an MoE policy, the routing record (R3): ``routes`` uint8
    [len(tokens), L_moe, k], the experts each MoE layer sent each generated token to (the last
    token included: it is forwarded in the step that samples it), and ``prompt_routes`` uint8
    [len(prompt), L_moe, k], the prompt's (shared by the request's samples); None otherwise.
    ``versions`` int32 [len(tokens)]: the policy version (`Engine.update_weights`) whose
    parameters sampled each token."""

    request: int
    sample: int
    tokens: list[int]
    logprobs: np.ndarray
    finish_reason: int | None
    routes: np.ndarray | None = None
    prompt_routes: np.ndarray | None = None
    versions: np.ndarray | None = None


def generation_result(done: Iterable[Completion], prompt_of: Mapping[int, int], prompts: int,
                      group_size: int, max_new_tokens: int, pad_id: int
                      ) -> generate.GenerationResult:
    """The completions ``done`` of the requests of ``prompts`` prompts (``prompt_of``: request
    id -> prompt index), ``group_size`` samples each, as a `generate.GenerationResult` of host
    (numpy) arrays: rows prompt-major (row ``b * group_size + g``: sample g of prompt b),
    ``max_new_tokens`` wide, padded with ``pad_id``; the routing record when they carry one."""
    g, m = group_size, max_new_tokens
    n = prompts * g
    tokens = np.full((n, m), pad_id, np.int32)
    logprobs = np.zeros((n, m), np.float32)
    lengths = np.zeros((n,), np.int32)
    reason = np.zeros((n,), np.int32)
    routes, prompt_routes = None, [None] * prompts
    versions = np.zeros((n, m), np.int32)
    for c in done:
        row = prompt_of[c.request] * g + c.sample
        tokens[row, :len(c.tokens)] = c.tokens
        logprobs[row, :len(c.tokens)] = c.logprobs
        lengths[row], reason[row] = len(c.tokens), c.finish_reason
        versions[row, :len(c.tokens)] = c.versions
        if c.routes is not None:
            if routes is None:
                routes = np.full((n, m) + c.routes.shape[1:], NO_ROUTE, np.uint8)
            routes[row, :len(c.tokens)] = c.routes
            prompt_routes[prompt_of[c.request]] = c.prompt_routes
    prompt_index = np.repeat(np.arange(prompts, dtype=np.int32), g)
    # host arrays (as the trainer wants them): no transfer, no per-shape program
    return generate.GenerationResult(tokens, logprobs, lengths, reason, prompt_index,
                                     routes, None if routes is None else tuple(prompt_routes),
                                     versions)
