"""The production dry run: build everything abstractly, lower it, and project memory and time.

``python launch/tpu_train.py --config=configs/ace30b.py --dry_run`` calls `run_dry_run(config)` and
prints `format_report`. Nothing is allocated and no weights are read:

1. the policy is built with ``nnx.eval_shape`` (parameter shapes and logical axes only), the
   optimizer state with ``jax.eval_shape(tx.init, ...)``;
2. shardings come from ``config.mesh`` and its rules table (`ace_jax.sharding`), over a
   ``jax.sharding.AbstractMesh`` of ``config.dry_run.num_chips`` devices (or over real devices when
   `run_dry_run` is given ``devices=``, e.g. 8 simulated CPU devices in the tests);
3. the GRPO learner step (`ace_jax.learner._learner_step`) and the grouped generation rollout
   (`ace_jax.generate._rollout`) are traced and LOWERED ahead of time for
   ``config.dry_run.platform`` from ``ShapeDtypeStruct`` inputs that carry those shardings, which
   proves that they trace and that the shardings are consistent. With real devices and
   ``compile=True`` the learner step is also compiled and XLA's ``memory_analysis()`` is reported;
4. memory per device is computed from the shardings (exact for parameters, optimizer state,
   gradient buffers, batch, KV cache) and from formulas for the activations (estimates, labelled);
5. time is projected with the formulas of ``reference/qwen3_moe_spec.md`` §5.4-5.5: training FLOPs
   ``rows x T x (6 N_act + 6 L nq d T)`` at the stated MFU, prefill FLOPs at the same MFU, decode as
   HBM-bandwidth bound ``M x (replicas x bf16 weights + KV bytes read) / (chips x BW x eff)``.

Units: bytes and decimal GB (1 GB = 1e9 B), FLOP, seconds. "Per device" means per chip.

Known limits that the report states rather than hides: this port's attention materialises the
[T, S] score matrix (no flash / splash kernel) and the learner computes fp32 logits for whole rows
before slicing the completion, both of which the estimate counts; the decode estimate assumes
``dry_run.decode_replicas`` model replicas each reading its weights once per step (spec §5.5),
while `ace_jax.generate` runs in the training (FSDP) layout, where XLA either moves the small
decode activations (cheap) or all-gathers weights every step; the report also gives that worst
case.
"""
from __future__ import annotations

import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from ace_jax import generate, learner, sharding
from ace_jax.rollout_batch import TrainBatch
from models import configs as model_configs
from models import qwen3

GB = 1e9

# Published numbers of reference/qwen3_moe_spec.md §5 that the report checks itself against.
SPEC_REFERENCE: dict[str, dict[str, float]] = {
    "qwen3_30b_a3b": {
        "total_params": 30_532_122_624,          # §5.1
        "matmul_active_params": 3_041_865_728,   # §5.1 N_act (layers + lm_head)
        "kv_bytes_per_token": 98_304,            # §5.3 (bf16)
        "state_bytes_per_param": 16.0,           # §5.2 fp32 params + Adam mu, nu + fp32 grads
    },
}


def default_config() -> ml_collections.ConfigDict:
    """The ``dry_run`` config section: the target hardware and the projection's assumptions."""
    c = ml_collections.ConfigDict()
    c.chip = "TPU v5p"
    c.num_chips = 64                 # chips (not TensorCores: v5p-128 = 64 chips)
    c.hbm_gb_per_chip = 95.0         # decimal GB
    c.peak_tflops_bf16 = 459.0       # per chip, dense bf16
    c.hbm_bw_gbps = 2765.0           # per chip, GB/s
    c.ici_gbps = 1200.0              # per chip, bidirectional GB/s (half is used as receive BW)
    c.mfu = 0.4                      # assumed model-FLOPs utilisation of training and prefill
    c.hbm_bw_efficiency = 0.5        # assumed fraction of peak HBM bandwidth reached by decode
    c.decode_replicas = 8            # model replicas during decode (spec §5.5: 8 on v5p-128)
    c.prompt_tokens = 0              # 0: rl.max_prompt_tokens rounded up to sampling.prompt_bucket
    c.new_tokens = 0                 # 0: sampling.max_new_tokens
    c.platform = "tpu"               # lowering target for the abstract mesh
    c.lower = True                   # trace + lower the learner step and the rollout
    return c


class DryRunConfigError(ValueError):
    """A config value the dry run cannot use (the message names the field)."""


# ------------------------------------------------------------------------------------ helpers

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


def _with_sharding(sds: Any, sh: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(sds.shape, sds.dtype, sharding=sh)


def _section(config: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
    if name not in config:
        raise DryRunConfigError(f"the config has no {name!r} section")
    return config[name]


def build_model_config(config: ml_collections.ConfigDict) -> model_configs.ModelConfig:
    """The policy's `ModelConfig` from the ``model`` section: the preset with ``overrides``, and,
    when ``hf_path`` is set, the ``runtime`` fields the real run applies on top of its config.json
    (which the dry run does not read: the architecture comes from the preset)."""
    m = _section(config, "model")
    overrides = dict(m.get("overrides", {}) or {})
    if m.get("hf_path", "") and "runtime" in m:
        overrides.update(dict(m.runtime))
    return model_configs.get_model_config(m.preset, **overrides)


def build_mesh(config: ml_collections.ConfigDict, devices: Any = None):
    """(mesh, is_abstract): an `AbstractMesh` of ``dry_run.num_chips`` devices, or a real mesh
    over `devices`."""
    if devices is not None:
        return sharding.make_mesh(config.mesh, list(devices)), False
    n = int(config.dry_run.num_chips)
    if n < 1:
        raise DryRunConfigError(f"dry_run.num_chips must be >= 1, got {n}")
    sizes = sharding.resolve_mesh_shape(config.mesh, n)
    kinds = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    if config.mesh.axis_types not in kinds:
        raise DryRunConfigError(f"mesh.axis_types must be one of {sorted(kinds)}, got "
                                f"{config.mesh.axis_types!r}")
    mesh = AbstractMesh(tuple(sizes[a] for a in sharding.MESH_AXES), sharding.MESH_AXES,
                        axis_types=(kinds[config.mesh.axis_types],) * len(sharding.MESH_AXES))
    return mesh, True


def _param_shardings(params: nnx.State, mesh, rules) -> nnx.State:
    """A State of NamedShardings (inside the Param wrappers) from each Param's logical axes."""
    def one(var):
        axes = tuple(var.get_metadata()["out_sharding"])
        return var.replace(sharding.logical_sharding(axes, var.shape, mesh, rules))
    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


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


# ------------------------------------------------------------------------------------ the run

def _shapes(config, mc) -> dict[str, int]:
    rl, smp, dry = config.rl, config.sampling, config.dry_run
    bucket = int(smp.prompt_bucket)
    p = int(dry.prompt_tokens) or int(math.ceil(int(rl.max_prompt_tokens) / bucket) * bucket)
    m = int(dry.new_tokens) or int(smp.max_new_tokens)
    b, g = int(rl.batch_states), int(rl.group_size)
    k = int(config.optim.microbatches)
    n = b * g
    for name, v in (("prompt tokens", p), ("new tokens", m), ("rl.batch_states", b),
                    ("rl.group_size", g), ("optim.microbatches", k)):
        if v < 1:
            raise DryRunConfigError(f"{name} must be >= 1, got {v}")
    if n % k:
        raise DryRunConfigError(f"rows = rl.batch_states x rl.group_size = {n} is not divisible by "
                                f"optim.microbatches = {k}")
    if p + m > mc.max_position_embeddings:
        raise DryRunConfigError(f"prompt {p} + new {m} tokens exceed the model's "
                                f"max_position_embeddings = {mc.max_position_embeddings}")
    return dict(prompts=b, group_size=g, rows=n, prompt_len=p, new_tokens=m, seq_len=p + m,
                microbatches=k, rows_per_microbatch=n // k)


def _abstract_batch(n: int, p: int, m: int, bsh1: NamedSharding, bsh2: NamedSharding) -> TrainBatch:
    t = p + m
    s2 = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=bsh2)  # noqa: E731
    return TrainBatch(input_ids=s2((n, t), jnp.int32), positions=s2((n, t), jnp.int32),
                      attention_mask=s2((n, t), jnp.bool_), completion_mask=s2((n, m), jnp.float32),
                      behaviour_logprobs=s2((n, m), jnp.float32),
                      rewards=jax.ShapeDtypeStruct((n,), jnp.float32, sharding=bsh1),
                      ref_logprobs=s2((n, m), jnp.float32))


def _lower(traced, platform: str | None):
    return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()


def run_dry_run(config: ml_collections.ConfigDict, *, devices: Any = None,
                compile: bool = False) -> dict:
    """Build, shard and lower the learner step and the rollout abstractly; project memory and time.

    Args:
      config: a full run config (sections model, mesh, rl, sampling, grpo, optim, dry_run).
      devices: None (default) for an `AbstractMesh` of ``dry_run.num_chips`` chips lowered for
        ``dry_run.platform``; or a list of real devices (e.g. ``jax.devices()``) to build a real
        mesh, in which case ``num_chips`` is ``len(devices)`` and the default platform is used.
      compile: with real devices, also compile the learner step and report XLA's memory analysis.

    Returns a report dict (see `format_report`); memory values are bytes per device.
    """
    if "dry_run" not in config:
        raise DryRunConfigError("the config has no 'dry_run' section (see ace_jax.dry_run.default_config)")
    dry = config.dry_run
    if compile and devices is None:
        raise DryRunConfigError("compile=True needs real devices (pass devices=jax.devices())")
    for name in ("mfu", "hbm_bw_efficiency"):
        if not 0 < float(dry[name]) <= 1:
            raise DryRunConfigError(f"dry_run.{name} must be in (0, 1], got {dry[name]}")
    t_start = time.perf_counter()
    mc = build_model_config(config)
    shp = _shapes(config, mc)
    mesh, abstract_mesh = build_mesh(config, devices)
    chips = int(math.prod(dict(mesh.shape).values()))
    rules = sharding.rules_from_config(config.mesh.rules.to_dict()
                                       if isinstance(config.mesh.rules, ml_collections.ConfigDict)
                                       else config.mesh.rules)
    platform = str(dry.platform) if abstract_mesh else None

    # ---- abstract policy, optimizer state, shardings
    t0 = time.perf_counter()
    model = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model, nnx.Param)
    total, active = qwen3.param_counts(mc)
    n_act = matmul_active_params(mc, total, active)
    psh = _param_shardings(params, mesh, rules)
    tx, schedule = learner.make_optimizer(config.optim)
    opt = jax.eval_shape(tx.init, params)
    osh = sharding.optimizer_state_shardings(tx, opt, psh, mesh)
    rep = NamedSharding(mesh, PartitionSpec())
    build_s = time.perf_counter() - t0

    n, p, m, t = shp["rows"], shp["prompt_len"], shp["new_tokens"], shp["seq_len"]
    b, g = shp["prompts"], shp["group_size"]
    bsh1 = sharding.logical_sharding(sharding.batch_axes(1), (n,), mesh, rules)
    bsh2 = sharding.logical_sharding(sharding.batch_axes(2), (n, t), mesh, rules)
    batch = _abstract_batch(n, p, m, bsh1, bsh2)

    # ---- exact per-device bytes of the state
    cdt, pdt = mc.dtype, mc.param_dtype
    cb = _dtype_bytes(cdt)
    params_b = _tree_device_bytes(params, psh)
    opt_b = _tree_device_bytes(opt, osh)
    batch_b = sum(_shard_bytes(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(batch))
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
    scores = rows_dev * heads_dev * t * t * (4 + 4 + cb)  # fp32 scores, masked fp32, probs
    mask = rows_dev * t * t                                # bool [B, T, T], shared by all layers
    moe_ws = tok_dev * kk * (2 * H + 3 * im) * cb + tok_dev * H * 4
    logits = rows_dev * t * vocab_dev * 4 + 2 * rows_dev * m * vocab_dev * 4
    gathered = 2 * _gathered_bytes(params, psh, mesh, cdt, layer_only=True)

    train_items = [
        ("params (master, %s)" % pdt, params_b, "exact, from shardings"),
        ("optimizer state (AdamW mu, nu)", opt_b, "exact, from shardings"),
        ("gradient accumulator", params_b, "exact: params-shaped, %s" % pdt),
        ("microbatch gradient", params_b, "exact: params-shaped, live while accumulating"),
        ("batch (TrainBatch)", batch_b, "exact, from shardings"),
        ("gathered layer weights x2", gathered, "FSDP all-gather of one layer, double-buffered (%s)" % cdt),
        ("saved activations", saved, saved_note),
        ("attention scores, one layer", scores, "materialised [T,T] fp32 scores+probs (no flash kernel)"),
        ("attention mask", mask, "bool [rows, T, T]"),
        ("MoE dispatch buffers, one layer" if mc.is_moe else "MLP buffers, one layer", moe_ws,
         "sorted token copies + SwiGLU intermediates"),
        ("logits", logits, "fp32 full rows + 2 completion log-softmax copies"),
    ]

    # ---- generation memory (per device)
    kv_tok = kv_bytes_per_token(mc)
    kv_axes = sharding.kv_cache_axes(5)
    kv_shape = (L, n, t, nkv, d)
    kv_sh = sharding.logical_sharding(kv_axes, kv_shape, mesh, rules)
    kv_b = 2 * _shard_bytes(kv_shape, cdt, kv_sh)
    pre_shape = (L, b, t, nkv, d)
    pre_b = 2 * _shard_bytes(pre_shape, cdt, sharding.logical_sharding(kv_axes, pre_shape, mesh, rules))
    b_dev = math.ceil(b / _batch_shards(mesh, rules, b))
    pre_scores = b_dev * heads_dev * p * t * (4 + 4 + cb)
    pre_logits = b_dev * p * vocab_dev * 4
    gen_items = [
        ("params (master, %s)" % pdt, params_b, "resident"),
        ("optimizer state (AdamW mu, nu)", opt_b, "resident (time-shared slice)"),
        ("KV cache, %d rows x %d slots" % (n, t), kv_b, "exact, from shardings (%s)" % cdt),
        ("prefill KV cache before sharing", pre_b, "exact: %d prompts, repeated G times after" % b),
        ("prefill attention scores, one layer", pre_scores, "materialised [P, P+M] fp32 (no flash kernel)"),
        ("prefill logits", pre_logits, "fp32 [prompts, P, V]"),
        ("gathered layer weights x2", gathered, "FSDP all-gather of one layer (%s)" % cdt),
    ]
    hbm = float(dry.hbm_gb_per_chip) * GB
    train_total = sum(v for _, v, _ in train_items)
    gen_total = sum(v for _, v, _ in gen_items)

    # ---- time
    peak = float(dry.peak_tflops_bf16) * 1e12 * chips
    train_f = training_flops(mc, n_act, n, t)
    if float(config.grpo.beta) > 0:
        train_f *= 4.0 / 3.0  # a reference-policy forward pass
    train_s = train_f / (peak * float(dry.mfu))
    pre_f = prefill_flops(mc, n_act, b, p)
    pre_s = pre_f / (peak * float(dry.mfu))
    replicas = max(1, min(int(dry.decode_replicas), chips))
    eff = float(dry.hbm_bw_efficiency)
    # Target rollout layout (spec 5.5-5.6): `replicas` model replicas, each reads its bf16
    # weights once per step.
    dec_s = decode_seconds(steps=m, rows=n, context_start=p, weight_bytes=total * cb,
                           kv_per_token=kv_tok, replicas=replicas, chips=chips,
                           hbm_bw_gbps=float(dry.hbm_bw_gbps), efficiency=eff)
    # Worst case of the layout ace_jax.generate runs in today (the training layout): XLA may
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

    # ---- lowering
    lowering: dict[str, dict] = {}
    compiled: dict[str, Any] = {}
    if dry.lower or compile:
        state_sh = learner.LearnerState(psh, osh, rep)
        state_in = learner.LearnerState(
            jax.tree.map(_with_sharding, params, psh),
            jax.tree.map(_with_sharding, opt, osh),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=rep))
        step_fn = functools.partial(learner._learner_step, graphdef, tx, schedule, config.grpo,
                                    config.optim, g)
        jitted = jax.jit(step_fn, in_shardings=(state_sh, batch_sharding_tree(batch)),
                         out_shardings=(state_sh, None), donate_argnums=(0,))
        lowering["learner_step"], lowered = _trace_and_lower(jitted, (state_in, batch), platform)
        if compile and lowered is not None:
            compiled["learner_step"] = _compile_memory(lowered)

        sampling = generate.SamplingConfig(
            max_new_tokens=m, group_size=g, temperature=float(config.sampling.temperature),
            eos_ids=_eos_ids(mc), prompt_bucket=int(config.sampling.prompt_bucket))
        knobs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                             generate.SamplingKnobs.from_config(sampling))
        psh_b = sharding.logical_sharding(sharding.batch_axes(2), (b, p), mesh, rules)
        ids = jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=psh_b)
        msk = jax.ShapeDtypeStruct((b, p), jnp.bool_, sharding=psh_b)
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
        p_in = jax.tree.map(_with_sharding, params, psh)
        args = (graphdef, m, g, None, p_in, knobs, ids, ids, msk, key)  # placement: none
        lowering["generate_rollout"], _ = _trace_and_lower(generate._rollout, args, platform)

    report = {
        "model": dict(preset=config.model.preset, hf_path=str(config.model.get("hf_path", "")),
                      total_params=total, active_params=active, matmul_active_params=n_act,
                      layers=L, hidden=H, vocab=V, experts=mc.num_experts, top_k=mc.num_experts_per_tok,
                      dtype=cdt, param_dtype=pdt, remat=mc.remat_policy, moe_dispatch=mc.moe_dispatch),
        "hardware": dict(chip=str(dry.chip), chips=chips, hbm_gb_per_chip=float(dry.hbm_gb_per_chip),
                         peak_tflops_bf16=float(dry.peak_tflops_bf16), hbm_bw_gbps=float(dry.hbm_bw_gbps),
                         mfu=float(dry.mfu), hbm_bw_efficiency=float(dry.hbm_bw_efficiency),
                         decode_replicas=replicas),
        "mesh": dict(shape=dict(mesh.shape), abstract=abstract_mesh, platform=platform or jax.default_backend()),
        "shapes": dict(shp, rows_per_device_microbatch=rows_dev, tokens_per_device_microbatch=tok_dev),
        "memory": dict(
            train=[dict(name=a, bytes=int(v), note=c) for a, v, c in train_items],
            generate=[dict(name=a, bytes=int(v), note=c) for a, v, c in gen_items],
            train_total=int(train_total), generate_total=int(gen_total), hbm_bytes=hbm,
            train_fits=bool(train_total <= hbm), generate_fits=bool(gen_total <= hbm),
            state_bytes_per_param=(params_b + opt_b + params_b) * chips / max(total, 1),
            params_global_bytes=params_global_b),
        "time": dict(train_flops=train_f, train_s=train_s, prefill_flops=pre_f, prefill_s=pre_s,
                     decode_s=dec_s, decode_worst_case_s=dec_worst_s,
                     decode_gathered_bytes_per_step=gathered_step,
                     step_s=step_s, step_worst_case_s=train_s + pre_s + dec_worst_s,
                     kv_bytes_per_token=kv_tok,
                     generated_tokens=n * m, decode_tokens_per_s=n * m / dec_s if dec_s else 0.0,
                     train_flops_per_token=train_f / (n * t)),
        "lowering": lowering,
        "compiled": compiled,
        "timings_s": dict(build=build_s, total=time.perf_counter() - t_start),
    }
    report["checks"] = _spec_checks(config.model.preset, report)
    return report


def batch_sharding_tree(batch: TrainBatch) -> TrainBatch:
    """The shardings carried by an abstract batch, as a TrainBatch of NamedShardings."""
    return jax.tree.map(lambda x: x.sharding, batch)


def _eos_ids(mc) -> tuple[int, ...]:
    eos = mc.eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, tuple) else (int(eos),)


def _trace_and_lower(jitted, args, platform):
    """({ok, trace_s, lower_s, hlo_chars | error}, lowered or None)."""
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    try:
        traced = jitted.trace(*args)
        out["trace_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        lowered = _lower(traced, platform)
        out["lower_s"] = time.perf_counter() - t1
        out["hlo_chars"] = len(lowered.as_text())
        out["ok"] = True
        return out, lowered
    except Exception as e:  # reported, not raised: the memory plan is still useful
        out["ok"] = False
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
        return out, None


def _compile_memory(lowered) -> dict:
    t0 = time.perf_counter()
    try:
        ma = lowered.compile().memory_analysis()
    except Exception as e:
        return dict(ok=False, error=f"{type(e).__name__}: {str(e)[:2000]}")
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "alias_size_in_bytes",
              "temp_size_in_bytes", "generated_code_size_in_bytes")
    out = {f: int(getattr(ma, f)) for f in fields if ma is not None and hasattr(ma, f)}
    out.update(ok=True, compile_s=time.perf_counter() - t0)
    return out


def _spec_checks(preset: str, report: dict) -> list[dict]:
    ref = SPEC_REFERENCE.get(preset)
    if not ref:
        return []
    ours = dict(total_params=report["model"]["total_params"],
                matmul_active_params=report["model"]["matmul_active_params"],
                kv_bytes_per_token=report["time"]["kv_bytes_per_token"],
                state_bytes_per_param=report["memory"]["state_bytes_per_param"])
    out = []
    for name, want in ref.items():
        got = ours[name]
        ok = abs(got - want) <= 0.02 * abs(want)   # sharding padding may add a little per device
        out.append(dict(name=name, ours=got, spec=want, ok=bool(ok)))
    return out


# ------------------------------------------------------------------------------------ printing

def _gb(x: float) -> str:
    """Bytes in decimal units, right-aligned: '   1.91 GB', ' 286.55 kB'."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:9.2f} {unit}"
    return f"{x:9.0f} B "


def _count(n: float) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3f}{unit}"
    return f"{n:.0f}"


def format_report(report: dict) -> str:
    """A plain-text rendering of `run_dry_run`'s report (per-device memory, time, lowering)."""
    mo, hw, sh, me, ti = (report[k] for k in ("model", "hardware", "shapes", "memory", "time"))
    mesh = report["mesh"]
    lines = [
        f"== ace-jax dry run: {mo['preset']} on {hw['chips']} x {hw['chip']} ==",
        f"model   {_count(mo['total_params'])} params, {_count(mo['active_params'])} active "
        f"({_count(mo['matmul_active_params'])} matmul), {mo['layers']} layers, "
        f"{mo['experts']} experts top-{mo['top_k']}, compute {mo['dtype']}, master {mo['param_dtype']}, "
        f"remat {mo['remat']}, moe {mo['moe_dispatch']}",
        "mesh    " + " x ".join(f"{a}={s}" for a, s in mesh["shape"].items())
        + f"  ({'abstract' if mesh['abstract'] else 'real devices'}, lowered for {mesh['platform']})",
        f"batch   {sh['prompts']} states x G={sh['group_size']} = {sh['rows']} rollouts of "
        f"{sh['prompt_len']} prompt + {sh['new_tokens']} new = {sh['seq_len']} tokens; "
        f"{sh['microbatches']} microbatches, {sh['rows_per_device_microbatch']} row(s) per device each",
        "",
        f"-- memory per device, learner step (HBM {hw['hbm_gb_per_chip']:.0f} GB) --",
    ]
    for item in me["train"]:
        lines.append(f"  {item['name']:<38}{_gb(item['bytes'])}   {item['note']}")
    lines.append(f"  {'TOTAL':<38}{_gb(me['train_total'])}   "
                 f"{'fits' if me['train_fits'] else 'DOES NOT FIT'} "
                 f"({100 * me['train_total'] / me['hbm_bytes']:.0f}% of HBM)")
    lines.append("")
    lines.append("-- memory per device, generation --")
    for item in me["generate"]:
        lines.append(f"  {item['name']:<38}{_gb(item['bytes'])}   {item['note']}")
    lines.append(f"  {'TOTAL':<38}{_gb(me['generate_total'])}   "
                 f"{'fits' if me['generate_fits'] else 'DOES NOT FIT'} "
                 f"({100 * me['generate_total'] / me['hbm_bytes']:.0f}% of HBM)")
    row = lambda name, secs, note: f"  {name:<38}{secs:9.1f} s    {note}"  # noqa: E731
    lines += [
        "",
        f"-- time per RL step (MFU {hw['mfu']:.0%}, bandwidth efficiency {hw['hbm_bw_efficiency']:.0%}) --",
        row("train (fwd + bwd)", ti["train_s"], f"{ti['train_flops']:.3e} FLOP, "
            f"{ti['train_flops_per_token'] / 1e9:.1f} GFLOP/token"),
        row("prefill", ti["prefill_s"], f"{ti['prefill_flops']:.3e} FLOP"),
        row(f"decode ({hw['decode_replicas']} model replicas)", ti["decode_s"],
            f"HBM bound, {ti['generated_tokens']} tokens, {ti['kv_bytes_per_token']} B KV/token"),
        row("step", ti["step_s"], "lower bound: no sampling, host or sandbox overhead"),
        row("decode, worst case", ti["decode_worst_case_s"],
            f"if XLA all-gathers the FSDP weights every step "
            f"({_gb(ti['decode_gathered_bytes_per_step']).strip()}/device/step)"),
        row("step, worst case", ti["step_worst_case_s"], ""),
        "",
        "-- lowering --",
    ]
    for name, r in report["lowering"].items():
        if r.get("ok"):
            lines.append(f"  {name:<18} ok   trace {r['trace_s']:.1f} s, lower {r['lower_s']:.1f} s, "
                         f"{r['hlo_chars'] / 1e6:.1f} M chars of StableHLO")
        else:
            lines.append(f"  {name:<18} FAILED  {r.get('error', '')}")
    if not report["lowering"]:
        lines.append("  skipped (dry_run.lower = False)")
    for name, r in report.get("compiled", {}).items():
        if r.get("ok"):
            lines.append(f"  {name:<18} compiled in {r['compile_s']:.1f} s: arguments "
                         f"{_gb(r['argument_size_in_bytes']).strip()}, temporaries "
                         f"{_gb(r['temp_size_in_bytes']).strip()} per device (XLA)")
        else:
            lines.append(f"  {name:<18} compile FAILED  {r.get('error', '')}")
    if report["checks"]:
        lines += ["", "-- cross-checks against reference/qwen3_moe_spec.md §5 --"]
        for c in report["checks"]:
            lines.append(f"  {c['name']:<24} ours {c['ours']:>18,.2f}  spec {c['spec']:>18,.2f}  "
                         f"{'ok' if c['ok'] else 'MISMATCH'}")
    lines.append(f"\n(dry run took {report['timings_s']['total']:.1f} s)")
    return "\n".join(lines)
