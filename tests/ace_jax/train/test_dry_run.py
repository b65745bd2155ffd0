"""The production dry run: abstract build + lowering, per-device memory by hand, spec formulas."""
import importlib.util
import math
import pathlib

import jax
import pytest

from ace_jax.runtime import tpu_compile
from ace_jax.train import dry_run, dry_run_analytic, dry_run_programs, dry_run_report, dry_run_speed

ROOT = pathlib.Path(__file__).resolve().parents[3]

# A reduced ace30b: tiny Qwen3-MoE whose every sharded dim divides 8.
L, H, V, NQ, NKV, D, E, K, IM = 2, 64, 512, 4, 2, 16, 8, 2, 32


def _ace30b():
    spec = importlib.util.spec_from_file_location("ace30b_config", ROOT / "configs" / "ace30b.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.get_config()


def reduced_config(**mesh):
    cfg = _ace30b()
    cfg.model.preset = "tiny_moe"
    cfg.model.overrides.update(dict(
        vocab_size=V, hidden_size=H, moe_intermediate_size=IM, num_hidden_layers=L,
        num_attention_heads=NQ, num_key_value_heads=NKV, head_dim=D, num_experts=E,
        num_experts_per_tok=K, max_position_embeddings=512))
    cfg.mesh.fsdp = mesh.get("fsdp", 4)
    cfg.mesh.expert = mesh.get("expert", 2)
    cfg.rl.batch_states, cfg.rl.group_size = 8, 4          # 32 rows
    cfg.rl.max_prompt_tokens = 40                           # bucketed to 64
    cfg.sampling.prompt_bucket = 32
    cfg.sampling.max_new_tokens = 16
    cfg.optim.microbatches = 4                              # 8 rows per microbatch = 1 per device
    cfg.dry_run.num_chips = 8
    cfg.dry_run.topology = ""                               # the abstract plan (tests below opt in)
    cfg.engine.kind = "static"          # the paged engine's programs: the test of them opts in
    return cfg


def _hand_param_bytes_per_device(chips=8):
    """Every weight is split 8 ways (embed over fsdp x expert, or experts over expert and embed
    over fsdp) except q_norm / k_norm [L, D], which are replicated; fp32 master weights."""
    per_layer = (H * NQ * D + 2 * H * NKV * D + NQ * D * H      # q, k, v, o
                 + H * E                                        # router
                 + 3 * E * H * IM                               # experts
                 + 2 * H)                                       # input / post-attention norms
    sharded = L * per_layer + V * H + H + H * V                 # + embed, final norm, lm_head
    replicated = 2 * L * D
    return 4 * (sharded // chips + replicated), sharded + replicated


def test_reduced_config_memory_matches_hand_computation():
    report = dry_run.run_dry_run(reduced_config())
    params_dev, total = _hand_param_bytes_per_device()
    assert report["model"]["total_params"] == total
    train = {i["name"]: i["bytes"] for i in report["memory"]["train"]}
    assert train["params (master, float32)"] == params_dev
    # AdamW mu + nu are params-shaped; the two int32 step counters (adam, schedule) replicated.
    assert train["optimizer state (AdamW mu, nu)"] == 2 * params_dev + 2 * 4
    assert train["gradient accumulator"] == params_dev
    # Batch: 32 rows over 8 devices = 4 rows of 64 + 16 tokens.
    rows, t, m = 4, 80, 16
    assert train["batch (TrainBatch)"] == rows * t * (4 + 4 + 1) + rows * m * 4 * 3 + rows * 4
    # KV cache (the TPU sampler shares each prompt's keys among its G = 4 rows): K and V in bf16,
    # [L, 8 prompts, 64 slots, NKV, D] and [L, 32 rows, 16 new slots, NKV, D], rows split 8 ways
    gen = {i["name"]: i["bytes"] for i in report["memory"]["generate"]}
    assert gen["KV cache, 8 prompts x 64 + 32 rows x 16 slots"] == (
        2 * L * (8 // 8) * 64 * NKV * D * 2 + 2 * L * (32 // 8) * m * NKV * D * 2)
    # the MoE routing record: uint8 [rows, T, L, K], in the total only with routing replay R3
    record = next(i for i in report["memory"]["train"] if i["name"] == "MoE routing record (R3)")
    assert record["bytes"] == 0
    assert f"{L * K} B/token, {rows * t * L * K / 1e6:.1f} MB/device" in record["note"]
    assert report["shapes"]["rows_per_device_microbatch"] == 1
    assert report["mesh"]["shape"] == dict(data=1, fsdp=4, tensor=1, expert=2)
    assert report["mesh"]["abstract"] is True
    for name in ("learner_step", "generate_rollout"):
        assert report["lowering"][name]["ok"], report["lowering"][name]
        assert report["lowering"][name]["hlo_chars"] > 1000
    text = dry_run_report.format_report(report)
    assert "learner_step       ok" in text and "TOTAL" in text


def test_reduced_config_compiles_on_8_devices_and_xla_agrees():
    """On the 8 simulated CPU devices the learner step compiles; XLA's per-device argument size is
    exactly our params + optimizer state + batch + step counter, minus ref_logprobs (unused with
    beta = 0, so jit drops it)."""
    cfg = reduced_config()
    cfg.model.overrides.remat_policy = "none"       # compiles faster on CPU; same arguments
    cfg.dry_run.lower = False                       # only the compile path
    assert len(jax.devices()) == 8
    report = dry_run.run_dry_run(cfg, devices=jax.devices(), compile=True)
    assert report["mesh"]["abstract"] is False
    comp = report["compiled"]["learner_step"]
    assert comp["ok"], comp
    train = {i["name"]: i["bytes"] for i in report["memory"]["train"]}
    ref_logprobs = 4 * 16 * 4                        # 4 rows x 16 tokens fp32 per device
    ours = (train["params (master, float32)"] + train["optimizer state (AdamW mu, nu)"]
            + train["batch (TrainBatch)"] - ref_logprobs + 4)
    assert comp["argument_bytes"] == ours
    # The updated state is donated: XLA aliases it to the output.
    assert comp["alias_bytes"] >= train["params (master, float32)"] * 3


def test_routing_replay_puts_the_record_in_the_learner_batch():
    """grpo.routing_replay = "R3": the abstract batch the learner step is lowered with carries
    the routing record uint8 [32 rows, 80 tokens, L, K] split as the batch's rows (4 rows per
    device), its line counts those bytes exactly and the learner total grows by as much; off,
    the batch has no record and the line is 0."""
    off = dry_run.run_dry_run(reduced_config())
    cfg = reduced_config()
    cfg.grpo.routing_replay = "R3"
    on = dry_run.run_dry_run(cfg)
    rows, t = 4, 80
    record = rows * t * L * K
    lines = {r["name"]: r for r in on["memory"]["train"]}
    assert lines["MoE routing record (R3)"]["bytes"] == record == on["memory"]["routes_bytes"]
    assert "exact, from shardings" in lines["MoE routing record (R3)"]["note"]
    assert off["memory"]["routes_bytes"] == 0
    assert on["memory"]["train_total"] - off["memory"]["train_total"] == record
    batch_line = lambda r: next(i["bytes"] for i in r["memory"]["train"]  # noqa: E731
                                if i["name"] == "batch (TrainBatch)")
    assert batch_line(on) == batch_line(off)             # the record is not counted twice
    assert on["lowering"]["learner_step"]["ok"], on["lowering"]["learner_step"]
    assert on["memory"]["routes_compiled_bytes"] is None  # lowered, not compiled
    assert dry_run_report.summary(on)["learner_routes_mb"] == round(record / 1e6, 3)
    assert "learner_routes_mb" not in dry_run_report.summary(off)


def test_routing_replay_compiled_learner_takes_the_record(monkeypatch):
    """On the 8 simulated CPU devices, with R3: the compiled learner step's arguments are those
    of the run without a record (params + optimizer state + batch + step counter, minus the
    unused ref_logprobs: `test_reduced_config_compiles_on_8_devices_and_xla_agrees`) plus the
    record's shard, 4 rows x 80 tokens x L x K bytes per device; the report reads the same
    bytes back from the compiled program's input `routes`."""
    monkeypatch.setattr(dry_run, "cost_programs", lambda *a, **k: {})   # not what this checks
    cfg = reduced_config()
    cfg.model.overrides.remat_policy = "none"
    cfg.dry_run.lower = False
    cfg.grpo.routing_replay = "R3"
    report = dry_run.run_dry_run(cfg, devices=jax.devices(), compile=True)
    comp = report["compiled"]["learner_step"]
    assert comp["ok"], comp
    train = {i["name"]: i["bytes"] for i in report["memory"]["train"]}
    record = 4 * 80 * L * K
    without = (train["params (master, float32)"] + train["optimizer state (AdamW mu, nu)"]
               + train["batch (TrainBatch)"] - 4 * 16 * 4 + 4)
    assert comp["argument_bytes"] == without + record, (comp["argument_bytes"], without)
    assert report["memory"]["routes_compiled_bytes"] == record == train["MoE routing record (R3)"]
    text = dry_run_report.format_report(report)
    assert "the MoE routing record (R3)" in text


def test_entry_parameter_bytes_reads_one_chips_shard():
    """From optimised HLO (TPU-style tiled layouts included): the entry parameters whose
    argument path ends in the name, at their per-chip shapes; nothing else counts."""
    hlo = "\n".join([
        "%fused (p: u8[2]) -> u8[2] {",
        '  %p = u8[9,9]{1,0} parameter(0), metadata={op_name="batch.routes"}',
        "}",
        "",
        "ENTRY %main.0_spmd (param: s32[], param.1: u8[4,80,2,2]) -> s32[] {",
        '  %param = s32[4,80]{1,0:T(8,128)} parameter(0), sharding={replicated}, '
        'metadata={op_name="batch.input_ids"}',
        '  %param.1 = u8[4,80,2,2]{3,2,1,0:T(2,128)(4,1)} parameter(1), sharding={devices=[8,1,1,1]'
        '<=[8]}, metadata={op_name="batch.routes"}',
        '  %param.2 = f32[7]{0} parameter(2), metadata={op_name="state.routes_like"}',
        "  %add = s32[] add(%param, %param)",
        "}",
    ])
    assert dry_run_programs.entry_parameter_bytes(hlo, "routes") == 4 * 80 * 2 * 2
    assert dry_run_programs.entry_parameter_bytes(hlo, "input_ids") == 4 * 80 * 4
    assert dry_run_programs.entry_parameter_bytes(hlo, "rewards") == 0
    assert dry_run_programs.entry_parameter_bytes("no entry", "routes") == 0


def test_full_30b_config_lowers_and_matches_spec():
    cfg = _ace30b()
    cfg.dry_run.topology = ""           # lowering only: compiling 48 layers takes many minutes
    report = dry_run.run_dry_run(cfg)
    assert report["lowering"]["learner_step"]["ok"], report["lowering"]
    assert report["lowering"]["generate_rollout"]["ok"], report["lowering"]
    # ace30b's sampler is the paged engine: its decode call and prefill lower at its shapes
    assert report["lowering"]["engine_decode"]["ok"], report["lowering"]
    assert report["lowering"]["engine_prefill"]["ok"], report["lowering"]
    assert report["hardware"]["chips"] == 64
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == set(dry_run.SPEC_REFERENCE["qwen3_30b_a3b"])
    assert all(c["ok"] for c in checks.values()), checks
    assert report["model"]["total_params"] == 30_532_122_624
    # fp32 params fully sharded over 64 chips: 122.13 GB / 64 (spec 5.2), a little replication.
    train = {i["name"]: i["bytes"] for i in report["memory"]["train"]}
    assert 122.13e9 / 64 <= train["params (master, float32)"] <= 1.01 * 122.13e9 / 64
    assert report["time"]["train_s"] > 0 and report["time"]["decode_s"] > 0
    assert "cross-checks" in dry_run_report.format_report(report)


def test_spec_formulas_reproduce_section_5():
    from models import configs
    mc = configs.get_model_config("qwen3_30b_a3b", dtype="bfloat16")
    n_act = 3_041_865_728
    # 5.4: 61.7 GFLOP/token at S = 36,864; 512 rollouts -> 1.165e18 FLOP.
    f = dry_run_analytic.training_flops(mc, n_act, 512, 36_864)
    assert f / (512 * 36_864) == pytest.approx(61.7e9, rel=2e-3)
    assert f == pytest.approx(1.165e18, rel=2e-3)
    # 5.5: v5p-128 (64 chips x 459 TFLOP/s) at 40% MFU: 99 s.
    assert f / (64 * 459e12 * 0.4) == pytest.approx(99, rel=0.01)
    # 5.3: 96 KiB of KV per token.
    assert dry_run_analytic.kv_bytes_per_token(mc) == 98_304
    # 5.5: P = 32k, 512 rollouts, 4,096 new tokens, 8 replicas on v5p-128 at 50% BW: ~104 s.
    t = dry_run_analytic.decode_seconds(steps=4096, rows=512, context_start=32_768,
                                        weight_bytes=61.06e9, kv_per_token=98_304, replicas=8,
                                        chips=64, hbm_bw_gbps=2765, efficiency=0.5)
    assert t == pytest.approx(104, rel=0.01)


def test_bad_configs_are_named():
    cfg = reduced_config()
    cfg.optim.microbatches = 3
    with pytest.raises(dry_run.DryRunConfigError, match="optim.microbatches"):
        dry_run.run_dry_run(cfg)
    cfg = reduced_config()
    cfg.dry_run.mfu = 1.5
    with pytest.raises(dry_run.DryRunConfigError, match="dry_run.mfu"):
        dry_run.run_dry_run(cfg)
    cfg = reduced_config()
    cfg.sampling.max_new_tokens = 1000
    with pytest.raises(dry_run.DryRunConfigError, match="max_position_embeddings"):
        dry_run.run_dry_run(cfg)
    cfg = reduced_config()
    del cfg["dry_run"]
    with pytest.raises(dry_run.DryRunConfigError, match="dry_run"):
        dry_run.run_dry_run(cfg)
    with pytest.raises(dry_run.DryRunConfigError, match="compile=True needs devices"):
        dry_run.run_dry_run(reduced_config(), compile=True)
    cfg = reduced_config()
    cfg.mesh.fsdp = 3
    with pytest.raises(dry_run.DryRunConfigError, match="mesh: .*(needs 6 devices|do not split)"):
        dry_run.run_dry_run(cfg)


def test_ace30b_has_the_local_sections():
    spec = importlib.util.spec_from_file_location("local_config", ROOT / "configs" / "local.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    local, prod = mod.get_config(), _ace30b()
    assert set(local.keys()) <= set(prod.keys()), set(local.keys()) - set(prod.keys())
    for section in local.keys():
        if hasattr(local[section], "keys"):
            missing = set(local[section].keys()) - set(prod[section].keys())
            assert not missing, (section, missing)
    assert prod.model.hf_path.startswith("gs://")
    assert prod.tasks.source == "mlebench"
    assert prod.checkpoint.directory.startswith("gs://") and prod.buffer.store.url.startswith("gs://")
    assert (prod.mesh.data, prod.mesh.tensor, prod.mesh.expert) == (1, 1, 4)   # fsdp x expert
    assert math.prod((16, 4)) == prod.dry_run.num_chips


needs_libtpu = pytest.mark.skipif(not tpu_compile.libtpu_available(),
                                  reason="libtpu (XLA's TPU compiler) is not installed")


@needs_libtpu
def test_reduced_config_compiled_by_the_tpu_compiler_fits():
    """The trainer's own jitted learner step and rollout, compiled by XLA's TPU compiler for 8 v5p
    chips (fsdp=4 x expert=2), splash attention included: both fit with a compiled peak under
    64 MB per chip (the reduced model holds ~0.3 MB of state per chip; the rest is the
    compiler's temporaries), and the summary says so."""
    cfg = reduced_config()
    cfg.dry_run.topology = "v5p:2x2x2"
    report = dry_run.run_dry_run(cfg)
    s = dry_run_report.summary(report)
    assert s["compiled"] and s["topology"] == "v5p:2x2x2" and s["chips"] == 8, s
    assert 90 < s["hbm_gb"] < 110, s                    # v5p: 95.74 GiB per chip
    assert (s["prompt_tokens"], s["new_tokens"]) == (64, 16)
    assert s["fits"] and s["learner_fits"] and s["rollout_fits"], s
    assert 0 < s["learner_peak_gb"] < 0.064 and 0 < s["rollout_peak_gb"] < 0.064, s
    learner, rollout = report["compiled"]["learner_step"], report["compiled"]["generate_rollout"]
    assert report["mesh"]["platform"] == "tpu" and report["model"]["attention_impl"] == "splash"
    assert learner["mosaic_kernels"] >= 2, learner     # splash forward and backward kernels
    assert rollout["mosaic_kernels"] >= 1, rollout     # splash in the prefill
    train = {i["name"]: i["bytes"] for i in report["memory"]["train"]}
    # XLA's arguments: params + optimizer state + batch (+ step), as the shardings say; the TPU
    # layout pads these tiny arrays to (8, 128) tiles, hence the factor
    state = train["params (master, float32)"] + train["optimizer state (AdamW mu, nu)"]
    assert state < learner["argument_bytes"] < 8 * (state + train["batch (TrainBatch)"])
    assert learner["alias_bytes"] >= state            # the donated state is updated in place
    text = dry_run_report.format_report(report)
    assert "compiled by XLA's TPU compiler for v5p:2x2x2" in text and "PEAK" in text

    report["max_hbm_fraction"] = 1e-6                  # a budget nothing fits in
    s = dry_run_report.summary(report)
    assert not s["fits"] and not s["learner_fits"] and not s["rollout_fits"], s


@needs_libtpu
def test_unknown_topology_is_named():
    cfg = reduced_config()
    cfg.dry_run.topology = "v9z:3x3"
    with pytest.raises(dry_run.DryRunConfigError, match="v9z:3x3.*v5p:2x2x2"):
        dry_run.run_dry_run(cfg)
    cfg.dry_run.topology = "v5p:2x2x1"                  # 4 chips for a mesh of 8
    with pytest.raises(dry_run.DryRunConfigError, match="mesh: .*8 devices.*4 available"):
        dry_run.run_dry_run(cfg)


def test_without_libtpu_nothing_is_compiled_and_the_report_says_so(monkeypatch):
    monkeypatch.setattr(tpu_compile, "libtpu_available", lambda: False)
    cfg = reduced_config()
    cfg.dry_run.topology = "v5p:2x2x2"
    cfg.dry_run.lower = False
    report = dry_run.run_dry_run(cfg)
    assert report["compiled"] == {} and "libtpu is not installed" in report["not_compiled"]
    s = dry_run_report.summary(report)
    assert s["compiled"] is False and s["topology"] is None
    assert "pip install" in dry_run_report.format_report(report)


# ------------------------------------------------------------------------------------ speed

def test_collective_bytes_from_optimised_hlo():
    """Per kind, from result shapes: all-gather the result, all-reduce twice the operand,
    reduce-scatter the operand (result x group), async starts once (results half)."""
    hlo = "\n".join([
        "%ag = bf16[32,8]{1,0:T(8,128)(2,1)} all-gather(%p), replica_groups={{0,1,2,3},{4,5,6,7}}",
        "%ar = (bf16[32,2048]{1,0}, bf16[32,8]{1,0}) all-reduce(%a, %b), replica_groups={{0,1}}",
        "%rs = f32[8,2048]{1,0} reduce-scatter(%x), replica_groups=[2,4]<=[8], dimensions={0}",
        "%ags = (bf16[8,2048]{1,0}, bf16[64,2048]{1,0}) all-gather-start(%y), replica_groups={{0,1}}",
        "%agd = bf16[64,2048]{1,0} all-gather-done(%ags)",
        "%cp = (f32[16]{0}, f32[16]{0}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%z)",
        "%a2a = s32[4,4]{1,0} all-to-all(%w), replica_groups={{0,1,2,3}}",
        "%add = f32[8]{0} add(%u, %v)",
        # the mesh form of the groups (newer XLA): the named axes' sizes multiply, 2 x 2 = 4
        "%rs2 = bf16[8]{0:T(128)} reduce-scatter(%q), channel_id=3, "
        "replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=4] {'axis_0','axis_1'}, dimensions={0}",
    ])
    got = tpu_compile.collective_bytes(hlo)
    assert got["all-gather"] == 32 * 8 * 2 + 64 * 2048 * 2
    assert got["all-reduce"] == 2 * (32 * 2048 * 2 + 32 * 8 * 2)
    assert got["reduce-scatter"] == 8 * 2048 * 4 * 4 + 8 * 2 * 4
    assert got["collective-permute"] == 16 * 4 and got["all-to-all"] == 16 * 4
    assert got["total"] == sum(got[k] for k in tpu_compile.COLLECTIVES)
    # ops and ring hops: ag 4 // 2, ar 2 x (2 // 2), rs 4 // 2, ag-start 2 // 2 (its -done
    # skipped), cp 1, a2a 4 // 2, rs2 4 // 2
    got = tpu_compile.collective_hops(hlo)
    assert (got["ops"], got["hops"]) == (7, 2 + 2 + 2 + 1 + 1 + 2 + 2)
    assert got["by_group"] == {"all-gather x4": [1, 2], "all-reduce x2": [1, 2],
                               "reduce-scatter x4": [2, 4], "all-gather x2": [1, 1],
                               "collective-permute x1": [1, 1], "all-to-all x4": [1, 2]}


def test_roofline_names_the_binding_term_and_layers_extrapolate():
    chip = dict(peak_tflops_bf16=100.0, hbm_gbps=1000.0, ici_gbps=200.0)
    one = dict(flops=1e12, hbm_bytes=2e9, collective_bytes={"total": 1e8})
    two = dict(flops=3e12, hbm_bytes=3e9, collective_bytes={"total": 1e8})
    cost = dry_run_speed.extrapolate(one, two, 4)            # + 3 layers of (2e12, 1e9, 0)
    assert cost == dict(flops=7e12, hbm_bytes=5e9, collective_bytes=1e8, hops=0.0, axis_bytes=1e8)
    r = dry_run_speed.roofline(cost, chip)
    assert r["bound"] == "flops" and r["seconds"] == pytest.approx(0.07)
    assert r["hbm_s"] == pytest.approx(0.005) and r["ici_s"] == pytest.approx(0.001)


def test_the_serial_figure_adds_ici_per_axis_and_a_latency_per_hop():
    """max(FLOP, HBM) + collective bytes / one axis's ICI + hops x hop latency; layers
    extrapolate the hops too; an op over two torus axes (``axis_bytes``) counts half its
    bytes; no figure for a chip without the constants."""
    chip = dict(peak_tflops_bf16=100.0, hbm_gbps=1000.0, ici_gbps=1200.0, ici_axis_gbps=200.0,
                hop_latency_us=1.0)
    one = dict(flops=1e9, hbm_bytes=2e9, collective_bytes={"total": 1e8},
               collective_hops=dict(ops=3, hops=10))
    two = dict(flops=2e9, hbm_bytes=3e9, collective_bytes={"total": 2e8},
               collective_hops=dict(ops=6, hops=20))
    cost = dry_run_speed.extrapolate(one, two, 3)     # 4e9 HBM bytes, 3e8 coll bytes, 30 hops
    s = dry_run_speed.serial(cost, chip)
    assert s["compute_s"] == pytest.approx(4e-3) and s["ici_axis_s"] == pytest.approx(1.5e-3)
    assert s["hops"] == 30 and s["latency_s"] == pytest.approx(30e-6)
    assert s["seconds"] == pytest.approx(4e-3 + 1.5e-3 + 30e-6)
    # the max figure is never above the serial one
    assert dry_run_speed.roofline(cost, chip)["seconds"] <= s["seconds"]
    assert dry_run_speed.serial(cost, dict(chip, hop_latency_us=None)) is None
    # the same bytes, half of them in ops over a plane of two axes: 3e8 -> 2.25e8 axis-bytes
    for c, total in ((one, 1e8), (two, 2e8)):
        c["collective_hops"]["axis_bytes"] = 0.75 * total
    s = dry_run_speed.serial(dry_run_speed.extrapolate(one, two, 3), chip)
    assert s["ici_axis_s"] == pytest.approx(2.25e8 / 200e9)
    # a layer's collectives by kind and group: the 2-layer program's less the 1-layer one's
    one["collective_hops"]["by_group"] = {"all-reduce x4": [1, 4], "all-gather x16": [2, 16]}
    two["collective_hops"]["by_group"] = {"all-reduce x4": [2, 8], "all-gather x16": [2, 16],
                                          "all-to-all x16": [1, 8]}
    assert dry_run_speed.hops_per_layer(one, two) == {"all-reduce x4": [1, 4],
                                                      "all-to-all x16": [1, 8]}


def test_the_step_estimate_adds_a_host_round_trip_per_engine_call():
    """The paged engine's rollout pays ``host_round_trip_s`` once per ``sync_every`` decode
    steps (4,096 new tokens / 32 = 128 calls); the static generator's none."""
    cost = dict(ok=True, flops=1e9, hbm_bytes=1e9, collective_bytes={"total": 1e6},
                collective_hops=dict(ops=1, hops=2, axis_bytes=1e6, by_group={}))
    names = [f"{p}{s}_L{n}" for p in ("", "paged_") for s in ("decode_step", "decode_last")
             for n in (1, 2)] + ["reshard", "learner_microbatch_L1", "learner_microbatch_L2"]
    compiled = {k: dict(cost) for k in names}
    shp = dict(rows=64, new_tokens=4096, prompt_len=1024, group_size=8, prompts=8, microbatches=1)
    fill = dict(decode_step=1.0, decode_last=2.0, mean=1.5)

    def speed(kind, trip):
        return dry_run_speed.speed_section(
            compiled, dry=dry_run.default_config(), shp=shp, layers=4, chips=8, n_act=10**9,
            prefill_s=0.5, decode_min=dict(total=1e9, weights=5e8, kv=5e8), key_blocks=fill, paged_pages=fill,
            engine_kind=kind, slots=64, sync_every=32, host_round_trip_s=trip)

    base, paged = speed("paged", 0.0), speed("paged", 0.01)
    assert paged["host_round_trips_s"] == pytest.approx(128 * 0.01)
    assert paged["step_s_estimate"] == pytest.approx(base["step_s_estimate"] + 1.28)
    assert speed("static", 0.01)["host_round_trips_s"] == 0.0
    assert "host round trips 1.28" in "\n".join(dry_run_speed.format_speed(paged))
    # the serial floor: the engine's serial step with its HBM term at the bound's 1e9 bytes
    floor, step = paged["decode_serial_floor"], paged["paged_decode_serial"]
    min_s = 1e9 / (float(dry_run.default_config().hbm_bw_gbps) * 1e9)
    assert floor["seconds"] == pytest.approx(min_s + step["ici_axis_s"] + step["latency_s"])
    assert paged["decode_serial_floor_tok_s_chip"] == pytest.approx(64 / 8 / floor["seconds"])
    assert "serial floor:" in "\n".join(dry_run_speed.format_speed(paged))


def test_useful_fraction_waits_for_the_longest_row_and_idles_to_the_call_end():
    """Tokens kept / slot-steps: one wave of rows ends with its longest; a row's slot idles to
    the end of its call; with more rows than slots, a freed slot takes the next row at a call's
    start."""
    one_wave = dry_run_speed.useful_fraction([1, 2, 3, 4], slots=4)
    assert one_wave == dict(steps=4.0, fraction=10 / 16)
    # calls of 3 steps: the rollout's 4 steps take 2 calls
    assert dry_run_speed.useful_fraction([1, 2, 3, 4], slots=4, sync_every=3) == dict(
        steps=6.0, fraction=10 / 24)
    # 2 slots, calls of 2: rows 4 and 1 first; the 1-row's slot frees at step 2 and takes the
    # 3-row (steps 2-5, its slot idle at 5); the 4-row's slot frees at 4 and takes the 2-row
    # (steps 4-6): 6 steps
    got = dry_run_speed.useful_fraction([4, 1, 3, 2], slots=2, sync_every=2)
    assert got == dict(steps=6.0, fraction=10 / 12)
    with pytest.raises(ValueError):
        dry_run_speed.useful_fraction([0, 3], slots=2)
    assert dry_run_speed.completion_lengths("0.25,1", 5, 100) == [25, 100, 25, 100, 25]
    assert dry_run_speed.completion_lengths("0.001", 2, 100) == [1, 1]
    for bad in ("0,1", "1.5", "a,b", ""):
        with pytest.raises(ValueError, match="completion_mix"):
            dry_run_speed.completion_lengths(bad, 4, 100)


def test_decode_key_blocks_and_the_average_step_between_two_programs():
    """M = 4096 new tokens, 512-slot key blocks: own slots only (a shared prefix) -> step 2047
    reads 4 blocks, the last 8, the mean over the rollout 4.5 (one step at 2048 would read 5);
    with the prompt in the own slots (P = 1000) the blocks count from slot 1000. The average
    step's cost is the two programs' interpolated at the mean: affine in the blocks read."""
    shp = dict(prompt_len=1000, new_tokens=4096)
    kb = dry_run_programs.decode_key_blocks(shp, shared_prefix=True)
    assert kb == dict(decode_step=4.0, decode_last=8.0, mean=4.5)
    kb = dry_run_programs.decode_key_blocks(shp, shared_prefix=False)
    # step i reads ceil((1001 + i) / 512) blocks: 6 at i = 2047, 10 at i = 4095
    assert kb["decode_step"] == 6.0 and kb["decode_last"] == 10.0
    assert kb["mean"] == pytest.approx(sum(-(-(1001 + i) // 512) for i in range(4096)) / 4096)
    step = dict(flops=1.0, hbm_bytes=4e9, collective_bytes=1e8)
    last = dict(flops=1.0, hbm_bytes=8e9, collective_bytes=1e8)   # + 1e9 bytes per block
    got = dry_run_speed.at_blocks(step, last, dict(decode_step=4.0, decode_last=8.0, mean=4.5))
    assert got == pytest.approx(dict(flops=1.0, hbm_bytes=4.5e9, collective_bytes=1e8))
    # tiny rollouts: both programs read one block, the step's cost stands
    kb = dry_run_programs.decode_key_blocks(dict(prompt_len=8, new_tokens=4), shared_prefix=True)
    assert kb == dict(decode_step=1.0, decode_last=1.0, mean=1.0)
    assert dry_run_speed.at_blocks(step, last, kb) == step


def test_paged_decode_pages_count_the_own_pages_past_the_prompt():
    """The paged step reads its group's prompt pages as a shared prefix and its own pages: the
    prompt's last partial page (P % page slots) onwards. P = 1000, pages of 128: 104 own slots
    before the first new token; step i reads ceil((104 + i + 1) / 128) own pages."""
    assert dry_run_programs.own_pages(1000, 128, 0) == 1
    assert dry_run_programs.own_pages(1000, 128, 23) == 1 and dry_run_programs.own_pages(1000, 128, 24) == 2
    assert dry_run_programs.own_pages(1024, 128, 127) == 1   # a whole-page prompt: no partial page
    pages = dry_run_programs.paged_decode_pages(dict(prompt_len=1000, new_tokens=4096), 128)
    assert pages["decode_step"] == -(-(104 + 2048) // 128) == 17
    assert pages["decode_last"] == -(-(104 + 4096) // 128) == 33
    assert pages["mean"] == pytest.approx(sum(-(-(104 + i + 1) // 128) for i in range(4096)) / 4096)


@needs_libtpu
def test_sampler_layout_decode_moves_tokens_not_weights():
    """The reduced ace30b compiled for 8 v5p chips: in the sampler's own layout (experts over
    8 chips, tokens travel) one decode layer moves under a quarter of a layer's expert weights
    over ICI (its 32 rows of tokens); in the learner's layout ("shared", weights gathered) over
    half of them (7/8 are gathered) and more than 4x the sampler's. The summary carries the
    speed fields."""
    per_layer = {}
    for layout in ("own", "shared"):
        cfg = reduced_config()
        cfg.dry_run.topology = "v5p:2x2x2"
        cfg.sampler_mesh.layout = layout
        # experts over all 8 chips, dense weights replicated (ace30b's tensor-parallel sampler
        # adds the attention's all-reduces: what this test isolates is the MoE's traffic)
        cfg.sampler_mesh.tensor, cfg.sampler_mesh.moe_parallelism = 1, "expert"
        cfg.sampler_mesh.rules.experts = "expert"
        cfg.engine.page_size = 8          # the paged programs' rows read 1 and 2 own pages
        report = dry_run.run_dry_run(cfg)
        costs = report["cost_programs"]
        assert all(c["ok"] for c in costs.values()), {k: c["error"] for k, c in costs.items()}
        per_layer[layout] = (costs["decode_step_L2"]["collective_bytes"]["total"]
                             - costs["decode_step_L1"]["collective_bytes"]["total"])
        s, speed = dry_run_report.summary(report), report["speed"]
        for key in ("decode_tok_s_chip", "decode_min_tok_s_chip", "decode_hbm_gb",
                    "decode_collective_gb", "reshard_s", "learner_flops_ratio", "step_s_estimate"):
            assert key in s and speed[key] >= 0, (key, s)
        assert speed["decode_tok_s_chip"] > 0 and speed["learner_flops_ratio"] > 0, speed
        # the roofline is the compiled program's: t = max of its three terms
        d = speed["decode"]
        assert d["seconds"] == max(d["flops_s"], d["hbm_s"], d["ici_s"]) > 0
        assert "tokens/s per chip" in dry_run_report.format_report(report)
        # the paged engine's step: its prompt pages once per group, its pool split with its
        # rows (nothing gathered: no more collective bytes than the static step's), and one
        # more own page per row costs the kernel's declared K / V bytes of that page for the
        # chip's rows (32 rows / 8 chips x 8 slots x (K + V of 2 heads x 16 dims, bf16, + 4 B)),
        # plus the page table's bookkeeping
        assert s["paged_decode_tok_s_chip"] > 0 and s["paged_decode_hbm_gb"] > 0, s
        assert speed["paged_decode_own_pages"] == dict(decode_step=1.0, decode_last=2.0, mean=1.5)
        for n in (1, 2):
            assert (costs[f"paged_decode_step_L{n}"]["collective_bytes"]["total"]
                    <= costs[f"decode_step_L{n}"]["collective_bytes"]["total"]), costs
        page_kv = 32 // 8 * 8 * (2 * 2 * D * 2 + 4)
        grew = costs["paged_decode_last_L1"]["hbm_bytes"] - costs["paged_decode_step_L1"]["hbm_bytes"]
        assert page_kv <= grew < 3 * page_kv, (grew, page_kv)
        # the serial figure of the engine the config runs: its collectives' hops read from the
        # HLO, never faster than the same step's max figure
        eng = s["decode_engine"]
        tok_max = speed["paged_decode_tok_s_chip" if eng == "paged" else "decode_tok_s_chip"]
        assert s["decode_tok_s_chip_serial"] == round(speed[f"{eng}_decode_tok_s_chip_serial"], 1)
        assert speed[f"{eng}_decode_serial"]["hops"] > 0, speed[f"{eng}_decode_serial"]
        assert speed[f"{eng}_decode_serial"]["per_layer"], speed[f"{eng}_decode_serial"]
        assert 0 < speed[f"{eng}_decode_tok_s_chip_serial"] <= tok_max
        # its floor (HBM at the bytes a step must read) is never below it
        assert s["decode_serial_floor_tok_s_chip"] >= s["decode_tok_s_chip_serial"], s
        # the default mix's rows end at 1/4 ... 1 of the budget: the learner keeps under 5/8
        # of the serial figure's tokens
        assert s["decode_useful_tok_s_chip"] <= 0.625 * s["decode_tok_s_chip_serial"] + 0.1
    expert_weights = 3 * E * H * IM * 2                         # one layer, bf16
    assert per_layer["own"] < expert_weights / 4, per_layer    # 32 rows x H, not the weights
    assert per_layer["shared"] > expert_weights / 2, per_layer  # the gathered weights (7/8 of them)
    assert per_layer["shared"] > 4 * per_layer["own"], per_layer


@needs_libtpu
def test_the_paged_engine_compiled_by_the_tpu_compiler_holds_its_pool():
    """engine.kind='paged' (the trainer's sampler): the dry run compiles the engine's decode call
    and prefill at the config's engine shapes in the sampler layout, and the summary's ``fits``
    covers them. Their arguments are what the engine holds: twice the page pool makes the
    decode call's arguments grow by at least the extra pages' K / V bytes per chip (16,384
    more pages per row shard x 2 layers x 8 slots x 2 KV heads x 16 dims x bf16, K and V; the
    TPU pads the 32-byte rows to tiles, hence the upper bound), and the donated pool is updated
    in place (aliased by as much). (The pools are large on purpose: the compiler keeps a pool
    of a few hundred kB in on-chip memory, outside the arguments' HBM bytes.)"""
    def run(num_pages):
        cfg = reduced_config()
        cfg.dry_run.topology = "v5p:2x2x2"
        cfg.engine.kind = "paged"
        cfg.engine.update(slots=32, page_size=8, shared_prefixes=8, prefix_rows=4,
                          num_pages=num_pages, sync_every=4, prefill_chunk=16)
        return dry_run.run_dry_run(cfg)

    report = run(32768)
    s = dry_run_report.summary(report)
    assert s["fits"] and s["engine_fits"] and 0 < s["engine_peak_gb"] < 2, s
    comp = report["compiled"]
    assert comp["engine_decode"]["ok"] and comp["engine_prefill"]["ok"], comp
    assert comp["engine_decode"]["mosaic_kernels"] >= 1     # the Pallas paged-attention kernel
    # the pool-sized copies in the compiled calls' HLO (issue 49), per chip: at this toy head
    # dim (16) the TPU's default layout for the pool puts its pages minor (no padding) where
    # the kernel takes it row-major (dims padded to 128 lanes), so the decode call converts K
    # and V on entry; at ace30b's (head dim 128, 128-slot pages) there is none
    # (tests/ace_jax/train/test_dry_run_engine.py)
    chip = 32768 // 2 * L * 8 * NKV * D * 2
    assert report["lowering"]["engine_decode"]["pool_chip_bytes"] == chip
    copies = report["lowering"]["engine_decode"]["pool_copies"]
    assert s["engine_pool_copies"] == len(copies) >= 2, copies
    assert all(c["bytes"] >= chip for c in copies)
    assert s["engine_prefill_pool_copies"] == len(report["lowering"]["engine_prefill"]["pool_copies"])
    text = dry_run_report.format_report(report)
    assert "engine_decode" in text and "engine_prefill" in text
    bigger = run(65536)["compiled"]["engine_decode"]
    grew = bigger["argument_bytes"] - comp["engine_decode"]["argument_bytes"]
    extra = 32768 // 2 * L * 8 * NKV * D * 2 * 2
    assert extra <= grew <= 16 * extra, (grew, extra)
    assert bigger["alias_bytes"] - comp["engine_decode"]["alias_bytes"] == grew
    # co-resident (issue 49 item 4): the rollout beside the learner's state, the learner step
    # beside what the engine holds between calls (its weights, their slices, the pool)
    me, gb = report["memory"], 1e9
    state = sum(v["bytes"] for v in me["train"] if v["name"].startswith(("params", "optimizer")))
    assert me["learner_state_bytes"] == state > 0
    peak = max(comp[k]["peak_bytes"] for k in ("engine_decode", "engine_prefill"))
    assert s["rollout_coresident_gb"] == round((peak + state) / gb, 3)
    assert s["learner_coresident_gb"] == round(
        (comp["learner_step"]["peak_bytes"] + comp["engine_decode"]["argument_bytes"]) / gb, 3)
    assert s["coresident_fits"]
    alone = max(comp[k]["peak_bytes"] for k in comp)   # a budget each program fits in alone
    together = max(peak + state,
                   comp["learner_step"]["peak_bytes"] + comp["engine_decode"]["argument_bytes"])
    assert together > alone, (together, alone)
    report["max_hbm_fraction"] = (alone + together) / 2 / me["hbm_bytes"]
    tight = dry_run_report.summary(report)
    assert tight["learner_fits"] and tight["rollout_fits"] and tight["engine_fits"], tight
    assert not tight["coresident_fits"] and not tight["fits"], tight
    report["max_hbm_fraction"] = 1e-6                  # a budget nothing fits in
    assert not dry_run_report.summary(report)["engine_fits"]
