"""The production dry run: compile what trains for the target slice, and report its memory.

``python launch/tpu_train.py --config=configs/ace30b.py --dry_run`` calls `run_dry_run(config)`,
prints `format_report` and, last, `summary` as one JSON line (exit status 1 when a program does
not fit). Nothing is allocated and no weights are read:

1. the policy is built with ``nnx.eval_shape`` (parameter shapes and logical axes only), the
   optimizer state with ``jax.eval_shape(tx.init, ...)``;
2. every sharding comes from the trainer's own `placement.Placement` (``config.mesh`` and its
   rules) over the abstract devices of ``dry_run.topology`` (XLA's TPU compiler, libtpu, runs on
   any host: `ace_jax.runtime.tpu_compile`), over real devices given as ``devices=`` (e.g. 8 simulated CPU
   devices in the tests), or, with neither, over an `AbstractMesh` of ``dry_run.num_chips``;
3. THE jitted functions the trainer runs, `learner.jit_learner_step` and `generate._rollout`, are
   traced, lowered and (with devices) COMPILED from ``ShapeDtypeStruct`` inputs carrying those
   shardings; the model takes the target's code paths (``ModelConfig.platform``: splash attention
   and ``ragged_dot`` MoE on TPU). XLA's per-chip figures (arguments, temporaries, outputs,
   aliases, their peak against the chip's HBM as the compiler states it, FLOPs, compile time)
   are reported per program;
4. beside them an analytic table: exact per-device bytes of parameters, optimizer state, gradient
   buffers, batch and KV cache from the shardings, and labelled estimates of the activations,
   with its difference from the compiled peak;
5. time is projected with the formulas of ``reference/qwen3_moe_spec.md`` §5.4-5.5: training FLOPs
   ``rows x T x (6 N_act + 6 L nq d T)`` at the stated MFU, prefill FLOPs at the same MFU, decode as
   HBM-bandwidth bound ``M x (replicas x bf16 weights + KV bytes read) / (chips x BW x eff)``.

Units: bytes and decimal GB (1 GB = 1e9 B; the compiler's own messages print GiB), FLOP,
seconds. "Per device" means per chip.

The decode estimate assumes ``dry_run.decode_replicas`` model replicas each reading its weights
once per step (spec §5.5), while `ace_jax.runtime.generate` runs in the training (FSDP) layout; the
report also gives the worst case where XLA all-gathers the weights every step.
"""
from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from ace_jax.rl import learner
from ace_jax.rl.rollout_batch import TrainBatch
from ace_jax.runtime import generate, placement as placement_lib, sharding, tpu_compile
from models import configs as model_configs
from models import qwen3
from models.attention import resolve_attention_impl

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
    c.platform = "tpu"               # lowering target for the abstract mesh (no topology)
    c.lower = True                   # trace + lower the learner step and the rollout
    # With a topology and libtpu installed, both programs are COMPILED by XLA's TPU compiler for
    # that slice (one abstract device per chip; num_chips and hbm_gb_per_chip then come from the
    # compiler) and their real per-chip memory is reported; "" = the abstract plan only.
    c.topology = ""                  # e.g. "v5p:4x4x4" (64 chips)
    c.max_hbm_fraction = 1.0         # a compiled program "fits" when its peak <= this x HBM
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
    over `devices` (e.g. the abstract TPU devices of `tpu_compile.topology_devices`)."""
    try:
        if devices is not None:
            return sharding.make_mesh(config.mesh, list(devices)), False
        n = int(config.dry_run.num_chips)
        if n < 1:
            raise DryRunConfigError(f"dry_run.num_chips must be >= 1, got {n}")
        sizes = sharding.resolve_mesh_shape(config.mesh, n)
    except sharding.MeshConfigError as e:
        raise DryRunConfigError(f"mesh: {e}") from None
    kinds = {"auto": jax.sharding.AxisType.Auto, "explicit": jax.sharding.AxisType.Explicit}
    if config.mesh.axis_types not in kinds:
        raise DryRunConfigError(f"mesh.axis_types must be one of {sorted(kinds)}, got "
                                f"{config.mesh.axis_types!r}")
    mesh = AbstractMesh(tuple(sizes[a] for a in sharding.MESH_AXES), sharding.MESH_AXES,
                        axis_types=(kinds[config.mesh.axis_types],) * len(sharding.MESH_AXES))
    return mesh, True


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


def _abstract_batch(n: int, p: int, m: int, place: placement_lib.Placement) -> TrainBatch:
    """A TrainBatch of ShapeDtypeStructs carrying the placement's batch shardings."""
    t = p + m
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt)  # noqa: E731
    batch = TrainBatch(input_ids=s((n, t), jnp.int32), positions=s((n, t), jnp.int32),
                       attention_mask=s((n, t), jnp.bool_), completion_mask=s((n, m), jnp.float32),
                       behaviour_logprobs=s((n, m), jnp.float32), rewards=s((n,), jnp.float32),
                       ref_logprobs=s((n, m), jnp.float32))
    return jax.tree.map(_with_sharding, batch, place.batch(batch))


def _lower(traced, platform: str | None):
    return traced.lower(lowering_platforms=(platform,)) if platform else traced.lower()


def run_dry_run(config: ml_collections.ConfigDict, *, devices: Any = None,
                compile: bool | None = None) -> dict:
    """Build, shard, lower (and compile) the learner step and the rollout; project memory and time.

    Args:
      config: a full run config (sections model, mesh, rl, sampling, grpo, optim, dry_run).
      devices: None (default): the abstract TPU devices of ``dry_run.topology`` when it is set and
        libtpu is installed, else an `AbstractMesh` of ``dry_run.num_chips`` chips lowered for
        ``dry_run.platform``; or a list of real devices (e.g. ``jax.devices()``).
      compile: compile both programs and report XLA's memory analysis; None (default) = whenever
        the devices are real or a topology's (never for an `AbstractMesh`).

    Returns a report dict (see `format_report` and `summary`); memory values are bytes per device.
    Raises DryRunConfigError for a config it cannot use (unknown topology, a mesh that does not
    divide the chips, shapes), and tpu_compile.LibtpuMissingError never: without libtpu the report
    says that nothing was compiled.
    """
    if "dry_run" not in config:
        raise DryRunConfigError("the config has no 'dry_run' section (see ace_jax.train.dry_run.default_config)")
    dry = config.dry_run
    for name in ("mfu", "hbm_bw_efficiency"):
        if not 0 < float(dry[name]) <= 1:
            raise DryRunConfigError(f"dry_run.{name} must be in (0, 1], got {dry[name]}")
    t_start = time.perf_counter()
    topology = str(dry.get("topology", "") or "")
    not_compiled = ""
    if devices is None and topology:
        if tpu_compile.libtpu_available():
            try:
                devices = list(tpu_compile.topology_devices(topology))
            except (tpu_compile.TopologyError, tpu_compile.LibtpuMissingError) as e:
                raise DryRunConfigError(f"dry_run.topology: {e}") from None
        else:
            not_compiled = (f"libtpu is not installed: nothing was compiled for {topology} "
                            f"(`pip install \"jax[tpu]=={jax.__version__}\"` adds XLA's TPU "
                            "compiler; it runs without a TPU)")
    if compile and devices is None:
        raise DryRunConfigError("compile=True needs devices (a dry_run.topology with libtpu "
                                "installed, or devices=jax.devices())")
    mesh, abstract_mesh = build_mesh(config, devices)
    compile = (not abstract_mesh) if compile is None else compile
    chips = int(math.prod(dict(mesh.shape).values()))
    target = dry.platform if abstract_mesh else devices[0].platform
    mc = build_model_config(config).replace(platform=str(target))
    shp = _shapes(config, mc)
    place = placement_lib.Placement.create(mesh, config.mesh.rules)
    rules = place.rules_dict
    platform = str(dry.platform) if abstract_mesh else None
    hbm = float(dry.hbm_gb_per_chip) * GB
    if compile and target == "tpu":
        hbm = float(tpu_compile.hbm_bytes(devices[0]))

    # ---- abstract policy, optimizer state, shardings (the trainer's own Placement)
    t0 = time.perf_counter()
    model = nnx.eval_shape(lambda: qwen3.Qwen3ForCausalLM(mc, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(model, nnx.Param)
    total, active = qwen3.param_counts(mc)
    n_act = matmul_active_params(mc, total, active)
    psh = place.params(params)
    tx, schedule = learner.make_optimizer(config.optim)
    opt = jax.eval_shape(tx.init, params)
    state_sh = learner.state_shardings(place, params, config.optim)
    osh = state_sh.opt_state
    rep = sharding.replicated(mesh)
    build_s = time.perf_counter() - t0

    n, p, m, t = shp["rows"], shp["prompt_len"], shp["new_tokens"], shp["seq_len"]
    b, g = shp["prompts"], shp["group_size"]
    batch = _abstract_batch(n, p, m, place)

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
    chunk = int(config.optim.get("logprob_chunk_tokens", 0) or 0)
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

    # ---- generation memory (per device)
    kv_tok = kv_bytes_per_token(mc)
    kv_axes = placement_lib.KV_CACHE_AXES["standard"][0]
    kv_shape = (L, n, t, nkv, d)
    kv_b = 2 * _shard_bytes(kv_shape, cdt, place.sharding(kv_axes, kv_shape))
    pre_shape = (L, b, t, nkv, d)
    pre_b = 2 * _shard_bytes(pre_shape, cdt, place.sharding(kv_axes, pre_shape))
    b_dev = math.ceil(b / _batch_shards(mesh, rules, b))
    pre_scores = b_dev * heads_dev * (p * t if attn == "dot" else blk * blk) * (4 + 4 + cb)
    gen_items = [
        ("params (master, %s)" % pdt, params_b, "resident"),
        ("optimizer state (AdamW mu, nu)", opt_b, "resident (time-shared slice)"),
        ("KV cache, %d rows x %d slots" % (n, t), kv_b, "exact, from shardings (%s)" % cdt),
        ("prefill KV cache before sharing", pre_b, "exact: %d prompts, repeated G times after" % b),
        ("prefill attention scores, one layer", pre_scores, scores_note.replace("T,T", "P,P")),
        ("prefill logits", b_dev * vocab_dev * 4, "fp32 [prompts, V]: the last position only"),
        ("gathered layer weights x2", gathered, "FSDP all-gather of one layer (%s)" % cdt),
    ]
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

    # ---- lowering and compiling THE functions the trainer runs (learner.jit_learner_step,
    # generate._rollout), with the trainer's Placement
    lowering: dict[str, dict] = {}
    compiled: dict[str, tpu_compile.CompiledProgram] = {}
    if dry.lower or compile:
        state_in = jax.tree.map(_with_sharding, learner.LearnerState(
            params, opt, jax.ShapeDtypeStruct((), jnp.int32)), state_sh)
        jitted = learner.jit_learner_step(graphdef, config.grpo, config.optim, g, place, params)
        with place.context():
            lowering["learner_step"], lowered = _trace_and_lower(jitted, (state_in, batch), platform)
        if compile:
            compiled["learner_step"] = _compile(lowered, lowering["learner_step"])

        sampling = generate.SamplingConfig(
            max_new_tokens=m, group_size=g, temperature=float(config.sampling.temperature),
            eos_ids=generate.model_eos_ids(mc), prompt_bucket=int(config.sampling.prompt_bucket))
        knobs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep),
                             generate.SamplingKnobs.from_config(sampling))
        prompt_sh = place.sharding(sharding.batch_axes(2), (b, p))
        ids = jax.ShapeDtypeStruct((b, p), jnp.int32, sharding=prompt_sh)
        msk = jax.ShapeDtypeStruct((b, p), jnp.bool_, sharding=prompt_sh)
        key = jax.eval_shape(lambda: jax.random.key(0))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
        p_in = jax.tree.map(_with_sharding, params, psh)
        args = (graphdef, m, g, place, p_in, knobs, ids, ids, msk, key)
        with place.context():
            lowering["generate_rollout"], lowered = _trace_and_lower(generate._rollout, args,
                                                                     platform)
        if compile:
            compiled["generate_rollout"] = _compile(lowered, lowering["generate_rollout"])

    report = {
        "model": dict(preset=config.model.preset, hf_path=str(config.model.get("hf_path", "")),
                      total_params=total, active_params=active, matmul_active_params=n_act,
                      layers=L, hidden=H, vocab=V, experts=mc.num_experts, top_k=mc.num_experts_per_tok,
                      dtype=cdt, param_dtype=pdt, remat=mc.remat_policy, moe_dispatch=mc.moe_dispatch,
                      attention_impl=resolve_attention_impl(mc.attention_impl, str(target), t)),
        "hardware": dict(chip=str(dry.chip), chips=chips, hbm_gb_per_chip=float(dry.hbm_gb_per_chip),
                         peak_tflops_bf16=float(dry.peak_tflops_bf16), hbm_bw_gbps=float(dry.hbm_bw_gbps),
                         mfu=float(dry.mfu), hbm_bw_efficiency=float(dry.hbm_bw_efficiency),
                         decode_replicas=replicas),
        "mesh": dict(shape=dict(mesh.shape), abstract=abstract_mesh, platform=str(target)),
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
        "compiled": {k: v.to_dict() for k, v in compiled.items()},
        "not_compiled": not_compiled if not compiled else "",
        "max_hbm_fraction": float(dry.get("max_hbm_fraction", 1.0)),
        "topology": topology if compiled else "",
        "timings_s": dict(build=build_s, total=time.perf_counter() - t_start),
    }
    report["checks"] = _spec_checks(config.model.preset, report)
    return report


def _compile(lowered, lowering: dict) -> tpu_compile.CompiledProgram:
    """The compiled program, or (lowering failed) a failed one that carries the lowering error."""
    if lowered is None:
        return tpu_compile.CompiledProgram(ok=False, compile_s=0.0,
                                           error=f"not lowered: {lowering.get('error', '')}")
    return tpu_compile.compile_program(lowered)


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


_KNOBS = {
    "learner_step": "raise optim.microbatches (fewer rows per chip at once), shorten "
                    "rl.max_prompt_tokens / sampling.max_new_tokens, or add chips",
    "generate_rollout": "lower rl.batch_states (fewer rows, smaller KV cache), shorten "
                        "rl.max_prompt_tokens / sampling.max_new_tokens, or add chips",
}


def summary(report: dict) -> dict:
    """The one-line JSON result: topology, chips, HBM, and per program the compiled peak per chip
    (decimal GB) and whether everything fits. Without a compile, the analytic totals stand in
    for the peaks (``compiled`` false)."""
    hw, me, sh = report["hardware"], report["memory"], report["shapes"]
    comp = report["compiled"]
    frac = report["max_hbm_fraction"]
    out = dict(topology=report["topology"] or None, chips=hw["chips"],
               hbm_gb=round(me["hbm_bytes"] / GB, 3), compiled=bool(comp),
               prompt_tokens=sh["prompt_len"], new_tokens=sh["new_tokens"],
               batch_states=sh["prompts"], group_size=sh["group_size"])
    fits = True
    for name, key, analytic in (("learner_step", "learner", me["train_total"]),
                                ("generate_rollout", "rollout", me["generate_total"])):
        c = comp.get(name)
        peak = c["peak_bytes"] if c else analytic
        ok = (c["ok"] and peak <= frac * me["hbm_bytes"]) if c else peak <= frac * me["hbm_bytes"]
        out[f"{key}_peak_gb"] = round(peak / GB, 3)
        out[f"{key}_fits"] = bool(ok)
        if c:
            out[f"{key}_compile_s"] = round(c["compile_s"], 1)
            out[f"{key}_tflops"] = round(c["flops"] / 1e12, 3)
            if not c["ok"] and not c["oom"]:
                out[f"{key}_error"] = c["error"][:300]
        fits = fits and ok
    out["fits"] = fits
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
    comp = report.get("compiled", {})
    if comp:
        hbm = me["hbm_bytes"]
        lines += ["", f"-- compiled by XLA's TPU compiler for {report['topology'] or mesh['platform']} "
                      f"(per chip; HBM {hbm / GB:.2f} GB) --"]
        analytic = {"learner_step": me["train_total"], "generate_rollout": me["generate_total"]}
        for name, r in comp.items():
            if r["ok"]:
                lines.append(
                    f"  {name:<18} arguments {_gb(r['argument_bytes']).strip()}, temporaries "
                    f"{_gb(r['temp_bytes']).strip()}, outputs {_gb(r['output_bytes']).strip()}, "
                    f"aliased {_gb(r['alias_bytes']).strip()}")
                lines.append(
                    f"  {'':<18} PEAK {_gb(r['peak_bytes']).strip()} = "
                    f"{100 * r['peak_bytes'] / hbm:.0f}% of HBM "
                    f"({'fits' if r['peak_bytes'] <= report['max_hbm_fraction'] * hbm else 'DOES NOT FIT'}); "
                    f"analytic estimate {_gb(analytic[name]).strip()} "
                    f"({(analytic[name] - r['peak_bytes']) / GB:+.2f} GB); "
                    f"{r['flops'] / 1e12:.1f} TFLOP (XLA cost analysis: loop bodies counted once); "
                    f"compiled in {r['compile_s']:.0f} s")
            elif r["oom"]:
                lines.append(f"  {name:<18} DOES NOT FIT: the compiler needs "
                             f"{_gb(r['peak_bytes']).strip()} of temporaries, "
                             f"{(r['peak_bytes'] - hbm) / GB:.1f} GB over HBM; to fit: "
                             f"{_KNOBS.get(name, '')}")
            else:
                lines.append(f"  {name:<18} compile FAILED  {r['error']}")
    elif report.get("not_compiled"):
        lines += ["", f"-- not compiled: {report['not_compiled']} --"]
    if report["checks"]:
        lines += ["", "-- cross-checks against reference/qwen3_moe_spec.md §5 --"]
        for c in report["checks"]:
            lines.append(f"  {c['name']:<24} ours {c['ours']:>18,.2f}  spec {c['spec']:>18,.2f}  "
                         f"{'ok' if c['ok'] else 'MISMATCH'}")
    lines.append(f"\n(dry run took {report['timings_s']['total']:.1f} s)")
    return "\n".join(lines)
