"""Production: AceGRPO with Qwen3-30B-A3B on MLE-bench competitions, on a TPU v5p-128 pod (64 chips).

  # first, on any machine (no TPU, no weights): memory and step-time plan, learner + rollout lowered
  python launch/tpu_train.py --config=configs/ace30b.py --dry_run
  # then on every worker of the pod (scripts/tpu_pod_run.sh does this; see docs/tpu.md)
  python launch/tpu_train.py --config=configs/ace30b.py \
      --config.model.hf_path=gs://my-bucket/Qwen3-30B-A3B --config.workdir=gs://my-bucket/runs/ace30b

The run config is ``ace_jax.train.config.default_config()`` (the same sections as
configs/local.py, each the ``default_config()`` of the module that reads it); this file states
what differs for the pod, plus the ``dry_run`` section (hardware and projection assumptions,
ace_jax/train/dry_run.py). Every ``YOUR_BUCKET`` / ``/mnt/...`` value is a placeholder to
override on the command line.

Sizes (reference/qwen3_moe_spec.md §5): 64 states x G=8 = 512 rollouts per step, 8k-token prompts
+ 4k new tokens; the learner holds one group (8 rollouts) per chip and shares its prompt in 2
microbatches of 4 rows. Memory is fp32 master weights + fp32 AdamW moments + fp32 gradients =
16 B/param (488.5 GB), fully sharded over 64 chips; compute in bfloat16 with full remat. Compiled
by XLA's TPU compiler for v5p:4x4x4 (`--dry_run`, docs/tpu.md): learner step 60.5 GB and rollout
28.8 GB per chip at 8k + 4k tokens, with the speed of the compiled programs beside them; at 28k +
4k turn prompt sharing off (docs/tpu.md).
"""
import ml_collections

from ace_jax.train import config as run_config, dry_run


ARGS = ("", "rehearsal")

#: The rehearsal's model (scripts/pod_rehearsal.sh): Qwen3-MoE's architecture at toy width, the
#: real Qwen3 vocabulary (its tokenizer is the one in the HF folder), as many KV heads as the
#: sampler's tensor axis (one per device, as the pod) and 8 experts for expert x tensor = 2 x 4.
REHEARSAL_MODEL = dict(vocab_size=151936, hidden_size=128, intermediate_size=256,
                       moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=128, num_experts=8, num_experts_per_tok=2,
                       max_position_embeddings=4096, tie_word_embeddings=False)


def get_config(arg=None) -> ml_collections.ConfigDict:
    """The pod's config; ``configs/ace30b.py:rehearsal``: the same run with only the model's size,
    the batch and the step counts shrunk, for scripts/pod_rehearsal.sh (2 hosts of 4 CPU devices
    on one machine)."""
    if (arg or "") not in ARGS:
        raise ValueError(f"configs/ace30b.py:{arg}: unknown setting; valid: {', '.join(ARGS[1:])}")
    c = run_config.default_config()
    c.name = "ace30b"
    c.workdir = "gs://YOUR_BUCKET/runs/ace30b"   # checkpoints, buffer, metrics (TensorBoard)

    # The policy: Qwen3-30B-A3B read from a HF safetensors directory (copy it to GCS once, see
    # docs/tpu.md). bf16 compute, fp32 master weights (GRPO learning rates ~1e-6 vanish in bf16).
    c.model.preset = "qwen3_30b_a3b"
    c.model.hf_path = "gs://YOUR_BUCKET/Qwen3-30B-A3B"
    c.model.tokenizer_path = "gs://YOUR_BUCKET/Qwen3-30B-A3B"   # the HF tokenizer.json beside it
    # moe_parallelism="expert": the learner's MoE is expert-parallel over the 4-chip expert axis
    # (tokens travel; weights gathered over fsdp only): the compiler's roofline for a learner step
    # is 28.8 s (HBM-bound) against 103.5 s (FLOP-bound) with "gather" (docs/tpu.md, Speed).
    runtime = dict(dtype="bfloat16", param_dtype="float32", remat_policy="full",
                   moe_dispatch="ragged", moe_parallelism="expert", scan_layers=True)
    c.model.runtime = ml_collections.ConfigDict(runtime)        # applied on top of config.json
    c.model.overrides = ml_collections.ConfigDict(runtime)      # the preset (dry run, no hf_path)

    # v5p-128 = 64 chips: fsdp x expert = 16 x 4. Expert weights are split over 'expert' (32 of
    # the 128 experts per chip group) and 'fsdp'; every other weight over fsdp x expert (rules).
    c.mesh.fsdp = -1                  # 64 / 4 = 16
    c.mesh.expert = 4

    # The sampler decodes in a layout of its own (ace_jax/runtime/sampler_layout.py), resharded
    # from the learner once per step, weights in bf16: expert x tensor = 16 x 4. The experts are
    # split over both axes (2 of the 128 per chip, kept in place: tokens travel, "expert_tensor"),
    # the attention, its KV cache (1 KV head per chip) and the lm_head tensor-parallel over the 4
    # chips of a tensor group, which decode the same 32 rows (8 rows per chip). The compiled
    # decode step reads ~9.6 GB per chip at 8k + 4k against ~12.6 GB with tensor = 1 (dense
    # weights replicated) (docs/tpu.md, Speed).
    c.sampler_mesh.layout = "own"
    c.sampler_mesh.tensor = 4
    c.sampler_mesh.moe_parallelism = "expert_tensor"
    c.sampler_mesh.rules.experts = "expert,tensor"
    # the 16 devices' partial MoE outputs of a token summed in bf16 (HF's eager loop adds each
    # expert's output in bf16 too): half the bytes per layer a decode step writes and reduce-
    # scatters; the learner keeps fp32 (docs/tpu.md, Speed)
    c.sampler_mesh.moe_partials = "compute"
    # the rollout engine: the paged engine (continuous batching, one compile for every prompt
    # length) in this sampler layout; the dry run compiles its decode call and prefill at these
    # shapes (docs/tpu.md). Pages of 128 slots (the TPU lane width; the paged kernel DMAs 4
    # pages per grid step). 512 slots = 64 prompts x G 8, in 16 row shards over 'expert' (32
    # slots, 4 prompts each); each prompt's full pages read once per step for its 8 samples
    # (64 shared prefixes). The pool, per shard: page 0, 4 requests of at most 328 pages (a
    # prompt of at most 64 pages, 8k; 8 samples of at most 33 own pages: 4k plus the copy of
    # the prompt's last partial page) and 31 to spare (a new request binds sooner as samples
    # end), 1,344 pages = 4.2 GB per chip (48 layers x 128 slots x 1 KV head per chip x 128 x
    # K, V in bf16). Longer prompts need more pages or run fewer requests at once: at 28k,
    # --config.engine.num_pages=31744 (1,984 per shard, 6.2 GB per chip; docs/tpu.md).
    c.engine.kind = "paged"
    c.engine.page_size = 128
    c.engine.slots = 512
    c.engine.shared_prefixes = 64
    c.engine.prefix_rows = 8
    c.engine.num_pages = 16 * 1344
    c.engine.sync_every = 32           # decode steps per host round trip
    c.engine.prefill_chunk = 1024      # prompt tokens per prefill call (one prompt per shard)

    c.rl.num_steps = 400
    c.rl.batch_states = 64            # B states sampled by the LP sampler per step
    c.rl.group_size = 8               # G completions per state (512 rollouts per step)
    c.rl.max_prompt_tokens = 8192     # task description + current code + execution history
    # rl.seed_with_references stays False: MLE-bench ships no reference solutions, seeds are
    # drafts; rl.seed_solutions may name seed_solutions.jsonl of earlier evaluations (gs:// too).

    c.sampling.max_new_tokens = 4096  # a full solution script with reasoning
    c.sampling.temperature = 1.0
    c.sampling.prompt_bucket = 1024

    c.grpo.epsilon_high = 0.28        # clip-higher (DAPO)
    c.optim.learning_rate = 1e-6
    c.optim.warmup_steps = 10
    c.optim.decay_steps = 400
    # Each group's 8k prompt runs once per microbatch, not once per row: the 8 rows of a group
    # sit on one chip, and each of the 2 microbatches takes 4 of them (prompt + 4 completions =
    # 24k positions per chip, against 8 x 12k without sharing). Compiled: learner FLOPs 4.39x
    # 6 N_act T (8.69 without), roofline 14.7 s (28.8 s), 60.5 GB per chip (33.9 GB).
    c.optim.share_prompts = True
    c.optim.prompt_split = "within_groups"
    c.optim.microbatches = 2

    c.buffer.capacity = 16384
    c.buffer.store.url = "gs://YOUR_BUCKET/runs/ace30b/buffer"
    c.lp.explore_steps = 40
    c.lp.anneal_steps = 300
    # The buffer starts with one draft state per competition, fewer than the 64 states of a batch
    # (MLE-bench Lite has 22): the first steps draw states with replacement, then the executions'
    # children fill the buffer (found by the pod rehearsal: without it step 0 stops).
    c.lp.allow_repeats = True

    # sandbox: the Kaggle stack's own venv (`setup` builds it with scripts/build_sandbox_env.sh;
    # relative to the checkout, where every worker runs), bwrap (MLE-bench tasks are refused by
    # the process backend: their private answers lie on the host).
    c.sandbox.backend = "bwrap"       # process | bwrap | docker
    c.sandbox.python = ".sandbox-venv/bin/python"
    # Time: MLE-bench tasks allow 3,600 s per execution; a step's executions must end before its
    # rollouts count (the pipeline overlaps one step), and the host runs its 32 rollouts per step
    # (512 / 16 hosts) in 2 waves of 16 workers, so 600 s caps a step's sandbox time at ~20 min
    # (most scripts end in well under a minute) and leaves a script room for a real model fit.
    c.sandbox.max_time_limit_s = 600.0
    # Memory, per v5p host (448 GB of RAM, 208 vCPUs): each execution's process tree gets its
    # task's budget (16 GiB for MLE-bench tasks) in a memory cgroup; the pool checks at start that
    # 16 workers x (16 GiB + 2 GiB /tmp tmpfs + 2 GiB working dir on /dev/shm) + 64 idle warm
    # interpreters x 256 MiB = 336 GiB fit in the host's RAM less 64 GiB for the trainer (its
    # host-side weights, buffers and the OS), else it stops with the numbers.
    c.sandbox.num_workers = 16        # per host; x threads 8 = 128 of the 208 vCPUs
    c.sandbox.max_memory_mb = 16384   # = MLE-bench tasks' own budget; the worst case is known now
    c.sandbox.reserve_gb = 64.0
    # Warm interpreters (sandbox.preload="auto": numpy, pandas, sklearn) kept idle per task,
    # ~200 MB each: enough for every worker to find one of its task's.
    c.sandbox.max_idle_warm = 64
    c.sandbox.backend_options.threads = 8
    c.sandbox.backend_options.disk_mb = 2048
    c.sandbox.backend_options.submission_max_mb = 1024

    c.agent.description = "full"      # the competition's markdown page
    c.agent.max_history = 5
    c.agent.max_code_chars = 16000
    c.sft.enabled = False             # warm start = the instruct model itself

    c.tasks.source = "mlebench"       # prepared competitions (`mlebench prepare`), see docs/tpu.md
    # the competitions staged into the bucket by launch/stage_mlebench.py (docs/tpu.md, section 4);
    # each host fetches only these, public and private files separately, into tasks.cache_dir
    # (a bucket is never downloaded whole: ids=() with a gs:// data_dir is refused)
    c.tasks.ids = ("spooky-author-identification", "random-acts-of-pizza")
    c.tasks.data_dir = "gs://YOUR_BUCKET/mlebench"

    c.checkpoint.directory = "gs://YOUR_BUCKET/runs/ace30b/checkpoints"
    c.checkpoint.keep = 3
    c.checkpoint.save_interval_steps = 10

    # What --dry_run projects onto (spec §5.2, Google Cloud v5p figures).
    c.dry_run = dry_run.default_config()
    c.dry_run.chip = "TPU v5p"
    c.dry_run.num_chips = 64          # v5p-128 counts TensorCores: 64 chips, 4x4x4
    c.dry_run.hbm_gb_per_chip = 95.0
    c.dry_run.peak_tflops_bf16 = 459.0
    c.dry_run.hbm_bw_gbps = 2765.0
    c.dry_run.ici_gbps = 1200.0       # bidirectional, per chip
    c.dry_run.mfu = 0.4
    c.dry_run.hbm_bw_efficiency = 0.5
    c.dry_run.decode_replicas = 8     # 8-chip rollout replicas (spec §5.5-5.6)
    c.dry_run.prompt_tokens = 0       # 0: rl.max_prompt_tokens (8192)
    c.dry_run.new_tokens = 0          # 0: sampling.max_new_tokens (4096)
    # Compiled by XLA's TPU compiler for this slice when libtpu is installed (it runs on any host);
    # each program must stay under 90% of a chip's HBM.
    c.dry_run.topology = "v5p:4x4x4"
    c.dry_run.max_hbm_fraction = 0.9
    if arg == "rehearsal":
        _rehearsal(c)
    return c


def _rehearsal(c: ml_collections.ConfigDict) -> None:
    """What the rehearsal shrinks: the model (``REHEARSAL_MODEL``, read from the HF folder in the
    bucket like the real one), the batch (8 states x G 8 = one group per device of 8, as on the
    pod), the lengths, the engine's pool to match, the sandbox workers per host, the step counts
    and the lost-host timeout. Everything else is the pod's: the paged engine in the sampler's own
    layout, expert-parallel MoE, MLE-bench tasks from gs://, a gs:// workdir, the bwrap sandbox
    with the Kaggle stack."""
    c.name = "ace30b-rehearsal"
    c.tasks.ids = ("random-acts-of-pizza", "aerial-cactus-identification",
                   "tabular-playground-series-dec-2021")
    c.model.preset = "tiny_moe"        # what the dry run builds; the run reads config.json
    c.model.overrides.update(REHEARSAL_MODEL)
    c.model.runtime.update(dict(dtype="float32", param_dtype="float32"))
    c.model.overrides.update(dict(dtype="float32", param_dtype="float32"))
    c.rl.num_steps = 4
    c.rl.batch_states, c.rl.group_size = 8, 8
    c.rl.max_prompt_tokens = 2048
    c.sampling.max_new_tokens = 32
    c.sampling.prompt_bucket = 512
    c.optim.warmup_steps, c.optim.decay_steps = 1, 4
    # 8 row shards of 8 slots ('expert' 2 x ... : the engine's row shards over the sampler's batch
    # axes); per shard: page 0, a request of at most 16 prompt pages + 8 samples of 2 own pages.
    c.engine.slots = 64
    c.engine.shared_prefixes = 8
    c.engine.num_pages = 2 * 64
    c.engine.sync_every = 8
    c.engine.prefill_chunk = 512
    c.buffer.capacity = 256
    c.lp.explore_steps, c.lp.anneal_steps = 1, 4
    # 2 hosts share this machine's 24 GB: 2 workers each, 2 GiB per execution (the rehearsal's
    # competitions are a few hundred rows), 8 GB kept for each host's trainer
    c.sandbox.num_workers = 2
    c.sandbox.max_idle_warm = 4
    c.sandbox.max_memory_mb = 2048
    c.sandbox.reserve_gb = 8.0
    c.sandbox.backend_options.disk_mb = 512
    c.checkpoint.save_interval_steps = 1
    c.mesh.heartbeat_timeout_s = 20     # a lost host ends the others in 20 s, not JAX's 100
    c.dry_run.num_chips = 8
    c.dry_run.topology = "v5p:2x2x2"
