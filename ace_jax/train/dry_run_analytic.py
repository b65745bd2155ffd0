"""The dry run's analytic plan (``ace_jax.train.dry_run``): exact per-device bytes of parameters,
optimizer state, gradient buffers, batch and KV cache from the shardings, labelled estimates of
the activations (``memory_plan``), and the time of one RL step projected with the formulas of
``reference/qwen3_moe_spec.md`` §5.4-5.5 (``time_projection``): training FLOPs
``rows x T x (6 N_act + 6 L nq d T)`` at the stated MFU, prefill FLOPs at the same MFU, decode as
HBM-bandwidth bound ``M x (replicas x bf16 weights + KV bytes read) / (chips x BW x eff)``.

Units: bytes and decimal GB (1 GB = 1e9 B), FLOP, seconds. "Per device" means per chip.
"""
from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from ace_jax.runtime import generate, placement as placement_lib, sharding
from models import configs as model_configs
from models.attention import resolve_attention_impl

GB = 1e9


def _dtype_bytes(dtype: Any) -> int:
    return int(np.dtype(jnp.dtype(dtype)).itemsize)


def _shard_bytes(shape: tuple[int, ...], dtype: Any, sh: NamedSharding) -> int:
    """Bytes one device holds of a global array of `shape` laid out by `sh`."""
    return int(math.prod(sh.shard_shape(tuple(shape)))) * _dtype_bytes(dtype)


def _tree_device_bytes(sds_tree: Any, sharding_tree: Any) -> int:
    leaves = jax.tree.leaves(sds_tree)
    shs = jax.tree.leaves(sharding_tree, is_leaf=lambda x: isinstance(x, NamedSharding))
    if len(leaves) != len(shs):
        raise ValueError(f"{len(leaves)} arrays but {len(shs)} shardings")
    return sum(_shard_bytes(x.shape, x.dtype, s) for x, s in zip(leaves, shs))



def _axes_dims(spec: PartitionSpec, ndim: int) -> list[tuple[str, ...]]:
    out = []
    for i in range(ndim):
        e = spec[i] if i < len(spec) else None
        out.append(() if e is None else (e,) if isinstance(e, str) else tuple(e))
    return out


def _gathered_bytes(params: nnx.State, shardings: nnx.State, mesh, dtype: Any, *,
                    layer_only: bool) -> int:
    """Bytes of weights on a device after the FSDP all-gather (the mesh axes on each weight's
    'embed' dim are gathered; expert / tensor sharding stays), in `dtype`: of ONE decoder layer
    (`layer_only`) or of the whole model (what one decode step gathers in the training layout)."""
    sizes = dict(mesh.shape)
    total = 0
    flat_p = dict(nnx.to_flat_state(params))
    flat_s = dict(nnx.to_flat_state(shardings))
    for path, var in flat_p.items():
        axes = tuple(var.get_metadata()["out_sharding"])
        stacked = bool(axes) and axes[0] == "layers"
        if layer_only and not stacked:
            continue
        spec = flat_s[path].get_value().spec
        shape = list(var.shape)
        for dim, (name, mesh_axes) in enumerate(zip(axes, _axes_dims(spec, len(shape)))):
            if name != "embed":
                shape[dim] //= math.prod(sizes[a] for a in mesh_axes) if mesh_axes else 1
        n = math.prod(shape[1:]) if (stacked and layer_only) else math.prod(shape)
        total += n * _dtype_bytes(dtype)
    return total


def _batch_shards(mesh, rules, rows: int) -> int:
    """How many ways `rows` rows are split over the mesh by the 'batch' rule (divisibility aware)."""
    spec = sharding.logical_to_pspec(("batch",), rules, shape=(rows,), mesh=mesh)
    axes = _axes_dims(spec, 1)[0]
    sizes = dict(mesh.shape)
    return math.prod(sizes[a] for a in axes) if axes else 1


def _axis_shards(mesh, rules, logical: str, dim: int) -> int:
    spec = sharding.logical_to_pspec((logical,), rules, shape=(dim,), mesh=mesh)
    axes = _axes_dims(spec, 1)[0]
    sizes = dict(mesh.shape)
    return math.prod(sizes[a] for a in axes) if axes else 1


def decode_min_bytes(layout, params: nnx.State, mc: model_configs.ModelConfig, rows: int,
                     prompt_len: int, new_fill: int, group_size: int,
                     shared_prefix: bool) -> dict[str, float]:
    """What one decode step must read from HBM per device, at least (exact from the sampler's
    shardings): its weights once (the embedding table excepted: a step gathers N of its rows)
    and the K / V of its rows' ``prompt_len`` prompt slots and ``new_fill`` new ones; with
    ``shared_prefix`` (`generate.shared_prefix_decode`) a prompt's slots once per group of
    ``group_size`` rows. ``layout``: a `sampler_layout.SamplerLayout`; ``params``: the learner's
    abstract Param state. Bytes."""
    sampler = layout.abstract_params(params)
    flat = jax.tree_util.tree_leaves_with_path(sampler)
    weights = sum(_shard_bytes(x.shape, x.dtype, x.sharding) for path, x in flat
                  if "embed_tokens" not in jax.tree_util.keystr(path))
    kv_sh = layout.placement.sharding(("batch",), (rows,))
    rows_per_device = int(kv_sh.shard_shape((rows,))[0])
    kv_heads_split = mc.num_key_value_heads // int(layout.placement.sharding(
        ("kv_heads",), (mc.num_key_value_heads,)).shard_shape((mc.num_key_value_heads,))[0])
    prompts = max(1, rows_per_device // group_size) if shared_prefix else rows_per_device
    slots = prompts * prompt_len + rows_per_device * new_fill
    kv = slots * kv_bytes_per_token(mc) / kv_heads_split
    return dict(weights=float(weights), kv=float(kv), total=float(weights + kv))


def matmul_active_params(mc: model_configs.ModelConfig, total: int, active: int) -> int:
    """Spec §5.1's N_act: parameters a token multiplies (per-token active, minus the embedding
    lookup table unless it is tied to the lm_head, minus the final norm)."""
    n = active - mc.hidden_size  # final norm
    if not mc.tie_word_embeddings:
        n -= mc.vocab_size * mc.hidden_size
    return n


def training_flops(mc: model_configs.ModelConfig, n_act: int, rows: int, seq_len: int) -> float:
    """Model FLOPs of one training pass (forward + backward) over `rows` sequences of `seq_len`
    tokens, spec §5.4: rows x T x (6 N_act + 6 L nq d T) (causal attention, average context T/2)."""
    per_token = 6.0 * n_act + 6.0 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * seq_len
    return float(rows) * seq_len * per_token


def prefill_flops(mc: model_configs.ModelConfig, n_act: int, prompts: int, prompt_len: int) -> float:
    """Forward FLOPs of prefilling `prompts` prompts of `prompt_len` tokens (2 N_act per token plus
    causal attention 2 L nq d P per token)."""
    per_token = 2.0 * n_act + 2.0 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim * prompt_len
    return float(prompts) * prompt_len * per_token


def kv_bytes_per_token(mc: model_configs.ModelConfig, dtype: Any = None) -> int:
    """K and V of one token over all layers: 2 x L x nkv x d x bytes (spec §5.3)."""
    return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * _dtype_bytes(dtype or mc.dtype)


def decode_seconds(*, steps: int, rows: int, context_start: int, weight_bytes: float,
                   kv_per_token: int, replicas: int, chips: int, hbm_bw_gbps: float,
                   efficiency: float) -> float:
    """Bandwidth-bound decode time (spec §5.5): every step each replica reads its weights once and
    every row reads its KV cache (average context ``context_start + steps / 2``)."""
    per_step = replicas * weight_bytes + rows * (context_start + steps / 2.0) * kv_per_token
    return steps * per_step / (chips * hbm_bw_gbps * GB * efficiency)



# ------------------------------------------------------------------------------------ memory

def memory_plan(mc: model_configs.ModelConfig, shp: dict[str, int], mesh, place, params: nnx.State,
                psh: nnx.State, opt: Any, osh: Any, batch: Any, *, total: int, target: str,
                optim: ml_collections.ConfigDict) -> dict:
    """Per-device memory of the learner step and of generation.

    Args: the policy's config, the run's shapes (``dry_run._shapes``), the mesh and the trainer's
    ``Placement``, the abstract params and optimizer state with their shardings, the abstract
    ``TrainBatch`` (carrying its shardings), the total parameter count, the platform the model
    is lowered for and the ``optim`` section. The MoE routing record (``batch.routes``, uint8
    ``[rows, T, L_moe, k]``, present with ``grpo.routing_replay = "R3"``) has its own line, exact
    from its sharding (0 bytes without it), and is not in the batch's line.

    Returns a dict: ``train`` and ``generate`` (lists of ``(name, bytes, note)``), their totals
    ``train_total`` and ``generate_total``, ``params_bytes``, ``opt_bytes``, ``routes_bytes``
    (per device),
    ``params_global_bytes`` and the learner's ``rows_per_device_microbatch`` /
    ``tokens_per_device_microbatch``.
    """
    rules = place.rules_dict
    n, p, m, t = shp["rows"], shp["prompt_len"], shp["new_tokens"], shp["seq_len"]
    b = shp["prompts"]

    # ---- exact per-device bytes of the state
    cdt, pdt = mc.dtype, mc.param_dtype
    cb = _dtype_bytes(cdt)
    params_b = _tree_device_bytes(params, psh)
    opt_b = _tree_device_bytes(opt, osh)
    routes = getattr(batch, "routes", None)
    routes_b = 0 if routes is None else _shard_bytes(routes.shape, routes.dtype, routes.sharding)
    batch_b = sum(_shard_bytes(x.shape, x.dtype, x.sharding)
                  for x in jax.tree.leaves(batch._replace(routes=None)))
    params_global_b = total * _dtype_bytes(pdt)

    # ---- activation estimates (per device, one microbatch of the learner)
    L, H, V = mc.num_hidden_layers, mc.hidden_size, mc.vocab_size
    nq, nkv, d = mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim
    rows_mb = shp["rows_per_microbatch"]
    rows_dev = math.ceil(rows_mb / _batch_shards(mesh, rules, rows_mb))
    heads_dev = math.ceil(nkv / _axis_shards(mesh, rules, "kv_heads", nkv)) * (nq // nkv)
    vocab_dev = math.ceil(V / _axis_shards(mesh, rules, "vocab", V))
    tok_dev = rows_dev * t
    kk = mc.num_experts_per_tok if mc.is_moe else 1
    im = mc.moe_intermediate_size if mc.is_moe else mc.intermediate_size
    if mc.remat_policy in ("full",):
        saved = L * tok_dev * H * cb
        saved_note = "remat full: each layer's input"
    elif mc.remat_policy in ("dots_saveable", "dots_with_no_batch_dims_saveable"):
        per_tok = (2 * H + (nq + 2 * nkv) * d + nq * d + kk * (2 * im + H)) * cb
        saved = L * (tok_dev * per_tok + rows_dev * heads_dev * t * t * cb)
        saved_note = f"remat {mc.remat_policy}: matmul outputs incl. attention scores (rough)"
    else:
        per_tok = (6 * H + 3 * (nq + 2 * nkv) * d + kk * (4 * im + 2 * H)) * cb
        saved = L * (tok_dev * per_tok + rows_dev * heads_dev * t * t * (4 + 2 * cb))
        saved_note = "no remat: every layer's intermediates incl. attention probs (rough)"
    attn = resolve_attention_impl(mc.attention_impl, str(target), t)
    blk = 512                                              # splash / blockwise block (both sides)
    if attn == "dot":
        scores = rows_dev * heads_dev * t * t * (4 + 4 + cb)  # fp32 scores, masked fp32, probs
        scores_note = "materialised [T,T] fp32 scores+probs (attention_impl dot)"
        mask, mask_note = rows_dev * t * t, "bool [rows, T, T]"
    else:
        scores = rows_dev * heads_dev * blk * blk * (4 + 4 + cb)
        scores_note = f"{attn}: one [{blk},{blk}] block of scores+probs, never [T,T]"
        mask, mask_note = 2 * rows_dev * t * 4, "int32 segment ids of queries and keys"
    chunk = int(optim.logprob_chunk_tokens)
    moe_ws = tok_dev * kk * (2 * H + 3 * im) * cb + tok_dev * H * 4
    if chunk:   # completion log-probs in chunks: fp32 logits, p and dz of one chunk
        logits, logits_note = 3 * min(chunk, rows_dev * m) * vocab_dev * 4, \
            f"completion log-probs in chunks of {chunk} tokens (fp32 logits, p, dz)"
    else:
        logits, logits_note = 3 * rows_dev * m * vocab_dev * 4, \
            "fp32 completion logits, p, dz of whole rows"
    gathered = 2 * _gathered_bytes(params, psh, mesh, cdt, layer_only=True)

    train_items = [
        ("params (master, %s)" % pdt, params_b, "exact, from shardings"),
        ("optimizer state (AdamW mu, nu)", opt_b, "exact, from shardings"),
        ("gradient accumulator", params_b, "exact: params-shaped, %s" % pdt),
        ("microbatch gradient", params_b, "exact: params-shaped, live while accumulating"),
        ("batch (TrainBatch)", batch_b, "exact, from shardings"),
        ("gathered layer weights x2", gathered, "FSDP all-gather of one layer, double-buffered (%s)" % cdt),
        ("saved activations", saved, saved_note),
        ("attention scores, one layer", scores, scores_note),
        ("attention mask", mask, mask_note),
        ("MoE dispatch buffers, one layer" if mc.is_moe else "MLP buffers, one layer", moe_ws,
         "sorted token copies + SwiGLU intermediates"),
        ("logits", logits, logits_note),
    ]
    if mc.is_moe:   # the sampler's routing record in the TrainBatch (grpo.routing_replay=R3)
        per_tok = mc.num_moe_layers * mc.num_experts_per_tok          # uint8 ids
        rec = math.ceil(n / _batch_shards(mesh, rules, n)) * t * per_tok
        train_items.append((
            "MoE routing record (R3)", routes_b,
            f"uint8 [rows, T, {mc.num_moe_layers} MoE layers, top-{mc.num_experts_per_tok}]: "
            f"{per_tok} B/token, {rec / 1e6:.1f} MB/device"
            + ("; exact, from shardings (a learner input)" if routes is not None
               else " with grpo.routing_replay=R3 (off: 0)")))

    # ---- generation memory (per device)
    kv_axes = placement_lib.KV_CACHE_AXES["standard"][0]

    def kv_bytes(rows, slots):
        shape = (L, rows, slots, nkv, d)
        return 2 * _shard_bytes(shape, cdt, place.sharding(kv_axes, shape))

    if generate.shared_prefix_decode(mc, shp["group_size"], m):  # prompts once, G rows share them
        kv_item = ("KV cache, %d prompts x %d + %d rows x %d slots" % (b, p, n, m),
                   kv_bytes(b, p) + kv_bytes(n, m),
                   "exact, from shardings (%s); each prompt's keys shared by its G rows" % cdt)
        pre_item = ("prefill KV cache", 0, "the prompts' cache above, filled in place")
    else:
        kv_item = ("KV cache, %d rows x %d slots" % (n, t), kv_bytes(n, t),
                   "exact, from shardings (%s)" % cdt)
        pre_item = ("prefill KV cache before sharing", kv_bytes(b, t),
                    "exact: %d prompts, repeated G times after" % b)
    b_dev = math.ceil(b / _batch_shards(mesh, rules, b))
    pre_scores = b_dev * heads_dev * (p * t if attn == "dot" else blk * blk) * (4 + 4 + cb)
    gen_items = [
        ("params (master, %s)" % pdt, params_b, "resident"),
        ("optimizer state (AdamW mu, nu)", opt_b, "resident (time-shared slice)"),
        kv_item,
        pre_item,
        ("prefill attention scores, one layer", pre_scores, scores_note.replace("T,T", "P,P")),
        ("prefill logits", b_dev * vocab_dev * 4, "fp32 [prompts, V]: the last position only"),
        ("gathered layer weights x2", gathered, "FSDP all-gather of one layer (%s)" % cdt),
    ]
    train_total = sum(v for _, v, _ in train_items)
    gen_total = sum(v for _, v, _ in gen_items)
    return dict(train=train_items, generate=gen_items, train_total=train_total,
                generate_total=gen_total, params_bytes=params_b, opt_bytes=opt_b,
                routes_bytes=routes_b,
                params_global_bytes=params_global_b, rows_per_device_microbatch=rows_dev,
                tokens_per_device_microbatch=tok_dev)


# ------------------------------------------------------------------------------------ time

def time_projection(mc: model_configs.ModelConfig, shp: dict[str, int],
                    dry: ml_collections.ConfigDict, *, n_act: int, total: int, chips: int,
                    replicas: int, grpo_beta: float, params: nnx.State, psh: nnx.State,
                    mesh) -> dict:
    """The time of one RL step (the report's ``time`` section): training and prefill FLOPs at
    ``dry.mfu``, decode bandwidth bound with ``replicas`` model replicas, and the worst case of
    the training layout (XLA all-gathers the FSDP weights every decode step)."""
    n, p, m, t = shp["rows"], shp["prompt_len"], shp["new_tokens"], shp["seq_len"]
    b = shp["prompts"]
    cdt = mc.dtype
    cb = _dtype_bytes(cdt)
    kv_tok = kv_bytes_per_token(mc)
    peak = float(dry.peak_tflops_bf16) * 1e12 * chips
    train_f = training_flops(mc, n_act, n, t)
    if float(grpo_beta) > 0:
        train_f *= 4.0 / 3.0  # a reference-policy forward pass
    train_s = train_f / (peak * float(dry.mfu))
    pre_f = prefill_flops(mc, n_act, b, p)
    pre_s = pre_f / (peak * float(dry.mfu))
    eff = float(dry.hbm_bw_efficiency)
    # Target rollout layout (spec 5.5-5.6): `replicas` model replicas, each reads its bf16
    # weights once per step.
    dec_s = decode_seconds(steps=m, rows=n, context_start=p, weight_bytes=total * cb,
                           kv_per_token=kv_tok, replicas=replicas, chips=chips,
                           hbm_bw_gbps=float(dry.hbm_bw_gbps), efficiency=eff)
    # Worst case of the layout ace_jax.runtime.generate runs in today (the training layout): XLA may
    # all-gather the FSDP-sharded weights on every device at every decode step (ICI bound, and
    # every device reads its gathered copy from HBM). It may instead move the (small) decode
    # activations and keep weights in place (it does for the reduced test config on 8 CPU
    # devices); only a TPU compile shows which.
    gathered_step = _gathered_bytes(params, psh, mesh, cdt, layer_only=False)
    ici_s = m * gathered_step / (float(dry.ici_gbps) / 2 * GB * eff)
    hbm_cur_s = decode_seconds(steps=m, rows=n, context_start=p, weight_bytes=gathered_step,
                               kv_per_token=kv_tok, replicas=chips, chips=chips,
                               hbm_bw_gbps=float(dry.hbm_bw_gbps), efficiency=eff)
    dec_worst_s = max(ici_s, hbm_cur_s)
    step_s = train_s + pre_s + dec_s
    return dict(train_flops=train_f, train_s=train_s, prefill_flops=pre_f, prefill_s=pre_s,
                decode_s=dec_s, decode_worst_case_s=dec_worst_s,
                decode_gathered_bytes_per_step=gathered_step,
                step_s=step_s, step_worst_case_s=train_s + pre_s + dec_worst_s,
                kv_bytes_per_token=kv_tok,
                generated_tokens=n * m, decode_tokens_per_s=n * m / dec_s if dec_s else 0.0,
                train_flops_per_token=train_f / (n * t))
