"""The embedded default: AceGRPO on the offline MLE suite with a tiny Qwen3-MoE, on one 2-core CPU.

  python launch/tpu_train.py --config=configs/local.py
  python launch/tpu_train.py --config=configs/local.py --config.rl.group_size=4 --config.rl.num_steps=30

Every section is the ``default_config()`` of the module that reads it, so each constant is
documented next to its use; this file only states what differs for the local run.
"""
import ml_collections

from ace_jax.curriculum import buffer, learnability
from ace_jax.env import agent, rewards
from ace_jax.rl import grpo, learner
from ace_jax.runtime import checkpoint, sharding
from ace_jax.train import sft
from sandbox import pool


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.name = "local"
    c.workdir = "runs/local"          # checkpoints, buffer, metrics, tokenizer, warm start
    c.seed = 0

    # The policy: a tiny Qwen3-MoE (models.configs preset + overrides), compute in fp32 on CPU.
    c.model = ml_collections.ConfigDict()
    c.model.preset = "tiny_moe"
    c.model.hf_path = ""              # a local or gs:// HF directory to load instead of a preset
    c.model.tokenizer_path = ""       # "" = train a BPE on the task suite into <workdir>/tokenizer
    # A run directory whose newest checkpoint (and tokenizer) start this run instead of a fresh
    # init + warm start; e.g. a warm-start-only run (--config.rl.num_steps=0) shared by ablations.
    c.model.init_from_run = ""
    c.model.runtime = ml_collections.ConfigDict(dict(dtype="float32"))  # with hf_path
    c.model.overrides = ml_collections.ConfigDict(dict(
        vocab_size=1024, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_experts=4, num_experts_per_tok=2, max_position_embeddings=2048,
        tie_word_embeddings=True, dtype="float32", moe_dispatch="ragged", remat_policy="none"))

    c.mesh = sharding.default_config()          # 1 CPU device: fsdp = -1 = 1

    # The RL loop.
    c.rl = ml_collections.ConfigDict()
    c.rl.num_steps = 20
    c.rl.batch_states = 4             # B states sampled by the LP sampler per step
    c.rl.group_size = 4               # G completions per state
    c.rl.async_rollouts = True        # sandbox of step t overlaps generation / learning of t+1
    c.rl.max_staleness = 1            # policy versions a rollout may lag behind the learner
    c.rl.reward = "acegrpo_step"      # a name in ace_jax.env.rewards
    c.rl.max_prompt_tokens = 768      # longer prompts keep their last tokens (counted in metrics)
    # The buffer starts from one empty draft per task; the reference solutions are the warm
    # start's SFT targets. True also seeds them as improvable states (as on MLE-bench).
    c.rl.seed_with_references = False
    # Comma-separated seed_solutions.jsonl files of earlier evaluations (launch/evaluate.py
    # --out): their valid attempts on this run's tasks become root states (origin "evaluation").
    c.rl.seed_solutions = ""

    c.sampling = ml_collections.ConfigDict()
    c.sampling.max_new_tokens = 384
    # T=0.5: after 200 drafts-only SFT steps the 1M-parameter policy writes valid drafts ~25% of
    # the time at T=0.5 and almost never at T=1.0 (benchmarks/bench_warm_start.py); after this
    # config's 200 steps of all three kinds, ~40% (400 steps: ~85%).
    c.sampling.temperature = 0.5
    c.sampling.top_k = 0
    c.sampling.top_p = 1.0
    c.sampling.prompt_bucket = 64

    c.grpo = grpo.default_config()
    c.optim = learner.default_config()
    c.optim.learning_rate = 1e-4
    c.optim.decay_steps = 20
    c.optim.temperature = 0.5         # = sampling.temperature (the learner's log-prob convention)
    c.buffer = buffer.default_config()
    c.buffer.capacity = 2048
    c.lp = learnability.default_config()
    c.lp.explore_steps = 8
    c.lp.anneal_steps = 16
    # Focus on states whose groups have shown a reward spread: an unvisited state's uncertainty
    # prior is a low constant and the selection is sharp from the start. With the default prior
    # (u0=1, inherited from the parent group, T=1) the batch moves to fresh, ever deeper child
    # states within 5 steps, on which the tiny policy writes broken code, and the valid rate falls
    # (README, "does the embedded default learn?", run C).
    c.lp.prior = "constant"
    c.lp.u0 = 0.25
    c.lp.temperature_start = 0.2

    c.sandbox = pool.default_config()  # bwrap isolation, 2 workers
    c.sandbox.max_time_limit_s = 30.0  # per execution (min with each task's own budget); 0 = off

    c.agent = agent.default_config()
    c.agent.show_system = False       # short prompts for the tiny policy
    c.rewards = rewards.default_config()
    # Shaping for the tiny policy: code that does not compile scores below code that runs and
    # fails, so early groups (few valid submissions) still carry a gradient.
    c.rewards.r_syntax_error = -0.5
    c.sft = sft.default_config()       # warm start when no checkpoint exists
    # All three kinds: RL soon samples debug / improve states (children of earlier steps); a
    # drafts-only warm start never saw such prompts and mostly fails to close its code block there.
    c.sft.kinds = ("draft", "improve", "debug")
    # 200 steps (~3 min on 2 idle cores): ~40% valid drafts at T=0.5, room for RL to improve;
    # 400 steps memorise the corpus (~90% valid, loss 0.01) and leave RL nothing to gain.
    c.sft.steps = 200
    c.sft.seconds = 600.0              # a safety net on a busy machine

    c.tasks = ml_collections.ConfigDict()
    c.tasks.source = "offline"        # offline | mlebench
    # Six fast tabular / image tasks so that 20 steps fit in 15 minutes on 2 cores;
    # --config.tasks.ids="()" runs the whole offline suite.
    c.tasks.ids = ("iris-species", "wine-cultivar", "breast-cancer-diagnosis",
                   "diabetes-progression", "wine-alcohol", "digits-8x8")
    c.tasks.cache_dir = "cache/tasks"
    c.tasks.data_dir = ""             # mlebench: the directory of prepared competitions
    c.tasks.seed = 0

    c.checkpoint = checkpoint.default_config()
    c.checkpoint.keep = 2
    return c
