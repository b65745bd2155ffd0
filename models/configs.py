"""Qwen3 / Qwen3-MoE model configurations: `ModelConfig`, HF ``config.json`` I/O, named presets.

`ModelConfig` uses Hugging Face field names (``hidden_size``, ``num_experts``, ...) so a reader can
compare it with a Hub ``config.json`` field by field. A few runtime fields are ours, not HF's:
``dtype`` (compute dtype), ``param_dtype``, ``moe_dispatch``, ``remat_policy``, ``scan_layers``,
``attention_impl``, ``platform`` (`target_platform` resolves the platform the model's code paths are
chosen for).

Layer kinds follow HF's rule (``Qwen3MoeDecoderLayer.__init__``): layer ``i`` is a sparse MoE layer
iff ``num_experts > 0`` and ``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``;
otherwise it is a dense SwiGLU MLP of width ``intermediate_size``. Maximal runs of consecutive
layers of the same kind form `LayerGroup`s; each group is one stacked (scanned) parameter tree in
`models.qwen3`. Every released Qwen3 model has exactly one group.

Presets: `get_model_config(name)` with ``qwen3_0_6b, qwen3_1_7b, qwen3_4b, qwen3_8b,
qwen3_30b_a3b, qwen3_235b_a22b`` (values of the original Qwen3 releases) and ``tiny_dense,
tiny_moe`` (tests and the local CPU policy). Parameter counts: `models.qwen3.param_counts` (it
needs the module).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax.core import FrozenDict

__all__ = [
    "UnsupportedConfigError",
    "LayerGroup",
    "ATTENTION_IMPLS",
    "PLATFORMS",
    "target_platform",
    "ModelConfig",
    "get_model_config",
    "model_config_names",
    "qwen3_0_6b",
    "qwen3_1_7b",
    "qwen3_4b",
    "qwen3_8b",
    "qwen3_30b_a3b",
    "qwen3_235b_a22b",
    "tiny_dense",
    "tiny_moe",
]


class UnsupportedConfigError(ValueError):
    """A config value this port does not implement (the message names the field and the value)."""


COMPUTE_DTYPES = ("float32", "bfloat16")
PARAM_DTYPES = ("float32", "bfloat16")
MOE_DISPATCH = ("dense", "ragged", "capacity")
MOE_PARALLELISM = ("gather", "expert", "expert_tensor")  # see models.moe_sharding
MOE_PARTIALS = ("float32", "compute")  # see models.moe_sharding.expert_parallel_dispatch
ATTENTION_IMPLS = ("auto", "dot", "blockwise", "splash")  # see models.attention
PLATFORMS = ("auto", "cpu", "gpu", "tpu")
# Fields of ModelConfig that are ours, not HF's (not in config.json; from_hf_dict takes them as kwargs).
RUNTIME_FIELDS = ("dtype", "param_dtype", "moe_dispatch", "moe_capacity_factor", "moe_parallelism", "moe_partials",
                  "remat_policy",
                  "scan_layers",
                  "attention_impl", "platform")
# remat policy name -> name of the jax.checkpoint_policies entry (None: save nothing but the layer input).
REMAT_POLICIES: Mapping[str, str | None] = {
    "none": None,  # no jax.checkpoint at all
    "full": None,  # jax.checkpoint, nothing saved: recompute the whole layer in the backward pass
    "dots_saveable": "dots_saveable",
    "dots_with_no_batch_dims_saveable": "dots_with_no_batch_dims_saveable",
}
# YaRN keys HF reads (`_compute_yarn_parameters`), besides rope_type / rope_theta.
_YARN_KEYS = (
    "factor",
    "original_max_position_embeddings",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
)


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """A maximal run of consecutive decoder layers of one kind; stored and scanned as one stack.

    Attributes:
      kind: "dense" (SwiGLU MLP of width ``intermediate_size``) or "moe" (sparse MoE block).
      start: index of the first layer of the run (HF layer index).
      count: number of layers in the run (>= 1).
    """

    kind: str
    start: int
    count: int


def _as_int_tuple(value: Any, field: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int) and not isinstance(value, bool):
        return (value,)
    try:
        out = tuple(value)
    except TypeError as exc:
        raise UnsupportedConfigError(f"{field} must be an int or a list of ints, got {value!r}") from exc
    for v in out:
        if not isinstance(v, int) or isinstance(v, bool):
            raise UnsupportedConfigError(f"{field} must contain ints, got {value!r}")
    return out


def _normalise_rope_scaling(rope_scaling: Any) -> FrozenDict | None:
    """Returns None for default RoPE, a FrozenDict with rope_type='yarn' for YaRN; else raises."""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise UnsupportedConfigError(f"rope_scaling must be None or a dict, got {rope_scaling!r}")
    d = dict(rope_scaling)
    rope_type = d.pop("rope_type", None) or d.pop("type", None) or "default"
    d.pop("type", None)
    d.pop("rope_theta", None)  # v5 rope_parameters carry theta; ModelConfig keeps it in rope_theta
    if d.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedConfigError(
            f"rope_scaling.partial_rotary_factor={d['partial_rotary_factor']!r}: only full rotary (1.0) is supported"
        )
    d.pop("partial_rotary_factor", None)
    if rope_type == "default":
        if d:
            raise UnsupportedConfigError(f"rope_scaling: default RoPE takes no parameters, got {sorted(d)}")
        return None
    if rope_type != "yarn":
        raise UnsupportedConfigError(
            f"rope_scaling.rope_type={rope_type!r} is not supported (supported: 'default', 'yarn')"
        )
    unknown = sorted(set(d) - set(_YARN_KEYS))
    if unknown:
        raise UnsupportedConfigError(f"rope_scaling (yarn): unsupported keys {unknown}; known keys {list(_YARN_KEYS)}")
    if d.get("factor") is None:
        raise UnsupportedConfigError("rope_scaling (yarn): 'factor' is required")
    if float(d["factor"]) < 1.0:
        raise UnsupportedConfigError(f"rope_scaling (yarn): factor must be >= 1, got {d['factor']!r}")
    d = {k: v for k, v in d.items() if v is not None}
    return FrozenDict({"rope_type": "yarn", **d})


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture (HF field names) plus runtime choices of the Flax Qwen3 / Qwen3-MoE port.

    Architecture fields mean exactly what they mean in HF ``Qwen3Config`` / ``Qwen3MoeConfig``;
    ``num_experts == 0`` is a dense Qwen3. Sizes are counts (tokens, features, heads, layers).

    Runtime fields (not HF's):
      dtype: compute dtype of activations and of the weights as used ("float32" | "bfloat16").
      param_dtype: storage dtype of the parameters ("float32" default: master weights).
      moe_dispatch: "dense" (reference: all experts on all tokens) | "ragged" (dropless sorted grouped
        matmul, default) | "capacity" (per-expert buffers of ceil(moe_capacity_factor * N * k / E)
        slots, batched matmuls; assignments beyond capacity are dropped, in token order).
      moe_capacity_factor: slots per expert relative to a perfectly balanced load (capacity only).
      moe_parallelism: how the "ragged" dispatch runs under a device mesh (`models.moe_sharding`):
        "gather" (default: each device gathers the layer's expert weights and keeps its tokens) |
        "expert" (expert parallelism: each device of the 'expert' mesh axis keeps E / n experts,
        the tokens travel to them and back) | "expert_tensor" (the same over the 'expert' and
        'tensor' axes together: a decode layout whose dense weights are tensor-parallel keeps
        its experts split over every chip). No effect without a mesh.
      moe_partials: the dtype the expert-parallel dispatch sums the devices' partial outputs in:
        "float32" (default: the k expert outputs of a token summed in fp32, as on one device) |
        "compute" (the compute dtype: half the bytes written and reduce-scattered; with bf16 it
        rounds each device's share of a token's sum to bf16 before the sum, as HF's eager loop
        rounds each expert's add). The sampler's layout may choose it; no effect otherwise.
      remat_policy: "none" | "full" | "dots_saveable" | "dots_with_no_batch_dims_saveable";
        jax.checkpoint around each decoder layer.
      scan_layers: run each `LayerGroup` with one ``jax.lax.scan`` (True) or unroll it (False).
      attention_impl: "dot" (exact [B, T, S] mask, the HF-parity reference) | "blockwise" (pure-JAX
        flash attention, memory O(T x block)) | "splash" (Pallas TPU kernel) | "auto" (splash on TPU,
        else dot up to ``models.attention.DOT_MAX_KEYS`` keys and blockwise above); see
        `models.attention`.
      platform: "cpu" | "gpu" | "tpu": the platform whose code paths the model takes (CPU fast
        paths, kernels); "auto" (default) = ``jax.default_backend()`` at trace time. Set it when
        the compile target is not the host's backend (a CPU host compiling ahead of time for TPU).

    The instance is immutable and hashable (it is static module metadata under ``jax.jit``);
    ``rope_scaling`` is stored as a ``flax.core.FrozenDict`` (or None for default RoPE).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    moe_intermediate_size: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False
    router_aux_loss_coef: float = 0.001
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Any = None
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    attention_dropout: float = 0.0
    use_sliding_window: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 151643
    eos_token_id: int | tuple[int, ...] | None = 151645
    pad_token_id: int | None = None
    # --- runtime fields (ours) ---
    dtype: str = "float32"
    param_dtype: str = "float32"
    moe_dispatch: str = "ragged"
    moe_capacity_factor: float = 1.25
    moe_parallelism: str = "gather"
    moe_partials: str = "float32"
    remat_policy: str = "none"
    scan_layers: bool = True
    attention_impl: str = "auto"
    platform: str = "auto"

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass normalisation)
        set_("mlp_only_layers", _as_int_tuple(self.mlp_only_layers, "mlp_only_layers"))
        if isinstance(self.eos_token_id, (list, tuple)):
            set_("eos_token_id", _as_int_tuple(self.eos_token_id, "eos_token_id"))
        set_("rope_scaling", _normalise_rope_scaling(self.rope_scaling))
        set_("rope_theta", float(self.rope_theta))
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "decoder_sparse_step",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise UnsupportedConfigError(f"{name} must be a positive int, got {value!r}")
        if self.hidden_act != "silu":
            raise UnsupportedConfigError(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.attention_bias:
            raise UnsupportedConfigError("attention_bias=True is not supported (Qwen3 has no q/k/v/o biases)")
        if self.use_sliding_window:
            raise UnsupportedConfigError(
                "use_sliding_window=True is not supported: this port implements full causal attention only"
            )
        if self.attention_dropout:
            raise UnsupportedConfigError(f"attention_dropout={self.attention_dropout!r} is not supported (only 0.0)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedConfigError(f"head_dim={self.head_dim} must be even for rotate-half RoPE")
        if self.num_experts < 0:
            raise UnsupportedConfigError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts > 0:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise UnsupportedConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size < 1:
                raise UnsupportedConfigError(
                    f"moe_intermediate_size must be positive for an MoE model, got {self.moe_intermediate_size}"
                )
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers:
            raise UnsupportedConfigError(
                f"mlp_only_layers has indices outside [0, {self.num_hidden_layers}): {bad_layers}"
            )
        if any(g.kind == "dense" for g in self.layer_groups()) and self.intermediate_size < 1:
            raise UnsupportedConfigError(
                f"intermediate_size must be positive when a layer is dense, got {self.intermediate_size}"
            )
        if self.dtype not in COMPUTE_DTYPES:
            raise UnsupportedConfigError(f"dtype={self.dtype!r}; valid: {list(COMPUTE_DTYPES)}")
        if self.param_dtype not in PARAM_DTYPES:
            raise UnsupportedConfigError(f"param_dtype={self.param_dtype!r}; valid: {list(PARAM_DTYPES)}")
        if self.moe_dispatch not in MOE_DISPATCH:
            raise UnsupportedConfigError(f"moe_dispatch={self.moe_dispatch!r}; valid: {list(MOE_DISPATCH)}")
        if self.moe_parallelism not in MOE_PARALLELISM:
            raise UnsupportedConfigError(f"moe_parallelism={self.moe_parallelism!r}; valid: {list(MOE_PARALLELISM)}")
        if self.moe_partials not in MOE_PARTIALS:
            raise UnsupportedConfigError(f"moe_partials={self.moe_partials!r}; valid: {list(MOE_PARTIALS)}")
        if not self.moe_capacity_factor > 0:
            raise UnsupportedConfigError(f"moe_capacity_factor must be > 0, got {self.moe_capacity_factor!r}")
        if self.remat_policy not in REMAT_POLICIES:
            raise UnsupportedConfigError(f"remat_policy={self.remat_policy!r}; valid: {list(REMAT_POLICIES)}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise UnsupportedConfigError(f"attention_impl={self.attention_impl!r}; valid: {list(ATTENTION_IMPLS)}")
        if self.platform not in PLATFORMS:
            raise UnsupportedConfigError(f"platform={self.platform!r}; valid: {list(PLATFORMS)}")

    # ------------------------------------------------------------------ layer structure
    @property
    def is_moe(self) -> bool:
        """True iff at least one layer is a sparse MoE layer."""
        return any(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    def is_moe_layer(self, i: int) -> bool:
        """HF's rule: sparse iff num_experts > 0, i not in mlp_only_layers, (i+1) % decoder_sparse_step == 0."""
        if not 0 <= i < self.num_hidden_layers:
            raise IndexError(f"layer index {i} outside [0, {self.num_hidden_layers})")
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def layer_groups(self) -> list[LayerGroup]:
        """Maximal runs of consecutive layers of the same kind, in layer order."""
        groups: list[LayerGroup] = []
        for i in range(self.num_hidden_layers):
            kind = "moe" if self.is_moe_layer(i) else "dense"
            if groups and groups[-1].kind == kind:
                last = groups[-1]
                groups[-1] = LayerGroup(kind, last.start, last.count + 1)
            else:
                groups.append(LayerGroup(kind, i, 1))
        return groups

    @property
    def num_moe_layers(self) -> int:
        return sum(g.count for g in self.layer_groups() if g.kind == "moe")

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF config.json I/O
    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], **runtime: Any) -> "ModelConfig":
        """Builds a config from a HF ``config.json`` dict (model_type ``qwen3`` or ``qwen3_moe``).

        Accepts both the v4 form (top-level ``rope_theta`` / ``rope_scaling``) and transformers v5's
        ``rope_parameters``. Keys that do not change the math (``torch_dtype``, ``use_cache``,
        ``architectures``, ...) are ignored. ``runtime`` sets our runtime fields (dtype, ...).

        Raises:
          UnsupportedConfigError: naming the field, for anything this port does not implement.
        """
        d = dict(d)
        model_type = d.get("model_type")
        if model_type not in ("qwen3", "qwen3_moe"):
            raise UnsupportedConfigError(f"model_type={model_type!r}; supported: 'qwen3', 'qwen3_moe'")
        bad_runtime = sorted(set(runtime) - set(RUNTIME_FIELDS))
        if bad_runtime:
            raise TypeError(f"from_hf_dict: unknown runtime fields {bad_runtime}")
        required = [
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
        ]
        missing = [k for k in required if k not in d]
        if missing:
            raise UnsupportedConfigError(f"config.json lacks required fields {missing}")
        if model_type == "qwen3" and "intermediate_size" not in d:
            raise UnsupportedConfigError("config.json lacks required field 'intermediate_size'")

        # Sliding window: HF only slides when use_sliding_window is true (layer_types derive from it).
        if d.get("use_sliding_window", False):
            raise UnsupportedConfigError("use_sliding_window=True is not supported (full attention only)")
        layer_types = d.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise UnsupportedConfigError(
                f"layer_types={sorted(set(layer_types))}: only 'full_attention' layers are supported"
            )

        # RoPE: v5 rope_parameters {rope_type, rope_theta, ...} or v4 rope_theta + rope_scaling.
        rope_parameters = d.get("rope_parameters")
        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        if rope_parameters is not None:
            if not isinstance(rope_parameters, Mapping):
                raise UnsupportedConfigError(f"rope_parameters must be a dict, got {rope_parameters!r}")
            if any(isinstance(v, Mapping) for v in rope_parameters.values()):
                raise UnsupportedConfigError("rope_parameters nested per layer type is not supported")
            rope_theta = rope_parameters.get("rope_theta", rope_theta)
            rope_scaling = rope_scaling or dict(rope_parameters)
        if rope_theta is None:
            rope_theta = 10000.0  # HF PreTrainedConfig.default_theta
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rtype == "yarn":  # HF standardize_rope_params default
                rope_scaling.setdefault("original_max_position_embeddings", d.get("max_position_embeddings", 32768))
        if d.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedConfigError(f"partial_rotary_factor={d['partial_rotary_factor']!r} is not supported")

        is_moe_type = model_type == "qwen3_moe"
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or (128 if not is_moe_type else d["hidden_size"] // num_heads)
        num_experts = d.get("num_experts", d.get("num_local_experts", 128)) if is_moe_type else 0
        kwargs = dict(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 6144),
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=num_heads,
            # HF class defaults when the key is absent: 4 (qwen3_moe) / 32 (qwen3); explicit null -> nq
            num_key_value_heads=(d.get("num_key_value_heads", 4 if is_moe_type else 32) or num_heads),
            head_dim=head_dim,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=d.get("hidden_act", "silu"),
            attention_bias=bool(d.get("attention_bias", False)),
            attention_dropout=d.get("attention_dropout", 0.0) or 0.0,
            use_sliding_window=False,
            initializer_range=d.get("initializer_range", 0.02),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            pad_token_id=d.get("pad_token_id"),
        )
        if is_moe_type:
            kwargs.update(
                moe_intermediate_size=d.get("moe_intermediate_size", 768),
                num_experts=num_experts,
                num_experts_per_tok=d.get("num_experts_per_tok", 8),
                decoder_sparse_step=d.get("decoder_sparse_step", 1),
                mlp_only_layers=d.get("mlp_only_layers") or (),
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                router_aux_loss_coef=d.get("router_aux_loss_coef", 0.001),
            )
        kwargs.update(runtime)
        return cls(**kwargs)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` dict, in the Hub's v4.51 style (``rope_theta``, ``rope_scaling``).

        ``model_type`` is ``qwen3_moe`` when ``num_experts > 0`` else ``qwen3``. ``torch_dtype`` is
        ``bfloat16`` (the Hub convention; the exporter may override it). Runtime fields are omitted.
        """
        is_moe_type = self.num_experts > 0
        d: dict[str, Any] = {
            "architectures": ["Qwen3MoeForCausalLM" if is_moe_type else "Qwen3ForCausalLM"],
            "model_type": "qwen3_moe" if is_moe_type else "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "use_cache": True,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": None if self.rope_scaling is None else dict(self.rope_scaling),
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": self.num_hidden_layers,
            "attention_dropout": 0.0,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "torch_dtype": "bfloat16",
        }
        if self.pad_token_id is not None:
            d["pad_token_id"] = self.pad_token_id
        if is_moe_type:
            d.update(
                moe_intermediate_size=self.moe_intermediate_size,
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                norm_topk_prob=self.norm_topk_prob,
                router_aux_loss_coef=self.router_aux_loss_coef,
                output_router_logits=False,
            )
        return d


# ---------------------------------------------------------------------------------------------- presets
# Values of the original Qwen3 releases (spec section 3). The runtime defaults of the real presets
# are the production choices: bf16 compute, fp32 master params, ragged dispatch, full remat, scan.
_QWEN3_COMMON = dict(
    vocab_size=151936,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1_000_000.0,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
    dtype="bfloat16",
    param_dtype="float32",
    moe_dispatch="ragged",
    remat_policy="full",
    scan_layers=True,
)


def _preset(arch: dict[str, Any], overrides: dict[str, Any]) -> ModelConfig:
    return ModelConfig(**{**_QWEN3_COMMON, **arch, **overrides})


def qwen3_0_6b(**overrides: Any) -> ModelConfig:
    """Qwen3-0.6B (dense, tied embeddings; 596,049,920 params)."""
    return _preset(dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                   num_key_value_heads=8, tie_word_embeddings=True), overrides)


def qwen3_1_7b(**overrides: Any) -> ModelConfig:
    """Qwen3-1.7B (dense, tied embeddings; 1,720,574,976 params)."""
    return _preset(dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                   num_key_value_heads=8, tie_word_embeddings=True), overrides)


def qwen3_4b(**overrides: Any) -> ModelConfig:
    """Qwen3-4B (dense, tied embeddings; 4,022,468,096 params)."""
    return _preset(dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                   num_key_value_heads=8, tie_word_embeddings=True), overrides)


def qwen3_8b(**overrides: Any) -> ModelConfig:
    """Qwen3-8B (dense, untied lm_head; 8,190,735,360 params)."""
    return _preset(dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                   num_key_value_heads=8, tie_word_embeddings=False), overrides)


def qwen3_30b_a3b(**overrides: Any) -> ModelConfig:
    """Qwen3-30B-A3B (48 MoE layers, 128 experts, top-8; 30,532,122,624 params)."""
    return _preset(dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_hidden_layers=48,
                   num_attention_heads=32, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                   norm_topk_prob=True, decoder_sparse_step=1, router_aux_loss_coef=0.001,
                   tie_word_embeddings=False), overrides)


def qwen3_235b_a22b(**overrides: Any) -> ModelConfig:
    """Qwen3-235B-A22B (94 MoE layers, 128 experts, top-8; 235,093,634,560 params)."""
    return _preset(dict(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=94,
                   num_attention_heads=64, num_key_value_heads=4, num_experts=128, num_experts_per_tok=8,
                   norm_topk_prob=True, decoder_sparse_step=1, router_aux_loss_coef=0.001,
                   tie_word_embeddings=False), overrides)


def tiny_dense(**overrides: Any) -> ModelConfig:
    """A tiny dense Qwen3 for tests (fp32, vocab 256, hidden 32, 2 layers, GQA 4/2, head_dim 16)."""
    base = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=512,
                tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, dtype="float32",
                param_dtype="float32", moe_dispatch="ragged", remat_policy="none", scan_layers=True)
    return ModelConfig(**{**base, **overrides})


def tiny_moe(**overrides: Any) -> ModelConfig:
    """A tiny Qwen3-MoE for tests (fp32, vocab 256, hidden 32, 2 layers, 8 experts top-2, width 16)."""
    base = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                num_experts_per_tok=2, norm_topk_prob=True, rope_theta=10000.0, max_position_embeddings=512,
                tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, dtype="float32",
                param_dtype="float32", moe_dispatch="ragged", remat_policy="none", scan_layers=True)
    return ModelConfig(**{**base, **overrides})


_PRESETS: dict[str, Callable[..., ModelConfig]] = {
    "qwen3_0_6b": qwen3_0_6b,
    "qwen3_1_7b": qwen3_1_7b,
    "qwen3_4b": qwen3_4b,
    "qwen3_8b": qwen3_8b,
    "qwen3_30b_a3b": qwen3_30b_a3b,
    "qwen3_235b_a22b": qwen3_235b_a22b,
    "tiny_dense": tiny_dense,
    "tiny_moe": tiny_moe,
}


def model_config_names() -> list[str]:
    """Names accepted by `get_model_config`."""
    return sorted(_PRESETS)


def get_model_config(name: str, **overrides: Any) -> ModelConfig:
    """The named preset, with ``overrides`` (any `ModelConfig` field) applied.

    Raises:
      KeyError: for an unknown name; the message lists the valid names.
    """
    try:
        factory = _PRESETS[name]
    except KeyError:
        raise KeyError(f"unknown model config {name!r}; valid names: {model_config_names()}") from None
    return factory(**overrides)


def target_platform(config: ModelConfig | str) -> str:
    """The platform ("cpu" | "gpu" | "tpu") whose code paths a model of ``config`` takes.

    ``config``: a `ModelConfig` or the value of its ``platform`` field. "auto" resolves to
    ``jax.default_backend()`` (call it at trace time); CUDA / ROCm backends count as "gpu".
    """
    platform = config.platform if isinstance(config, ModelConfig) else config
    if platform not in PLATFORMS:
        raise UnsupportedConfigError(f"platform={platform!r}; valid: {list(PLATFORMS)}")
    if platform != "auto":
        return platform
    backend = jax.default_backend()
    return "gpu" if backend in ("cuda", "rocm") else backend


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """HF's YaRN ``get_mscale``: 0.1 * mscale * ln(scale) + 1 for scale > 1, else 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0
