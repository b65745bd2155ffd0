"""The run's config schema: one owner per section, the config files are diffs over it, and
`validate` refuses each impossible combination with a message that names the keys."""
import pathlib

import pytest

from ace_jax import config_utils
from ace_jax.config_utils import ConfigError
from ace_jax.curriculum import buffer, learnability
from ace_jax.env import agent, rewards
from ace_jax.rl import grpo, learner
from ace_jax.runtime import checkpoint, engine_config, generate, sampler_layout, sharding
from ace_jax.train import config as run_config, probe, sft
from sandbox import pool

REPO = pathlib.Path(__file__).resolve().parents[3]
OWNERS = {"model": run_config.model_config, "mesh": sharding.default_config,
          "sampler_mesh": sampler_layout.default_config,
          "rl": run_config.rl_config, "sampling": generate.default_config,
          "engine": engine_config.default_config,
          "grpo": grpo.default_config, "optim": learner.default_config,
          "buffer": buffer.default_config, "lp": learnability.default_config,
          "sandbox": pool.default_config, "agent": agent.default_config,
          "rewards": rewards.default_config, "sft": sft.default_config,
          "tasks": run_config.tasks_config, "checkpoint": checkpoint.default_config,
          "probe": probe.default_config}


def _load(name):
    return config_utils.load_config_file(str(REPO / "configs" / name))


@pytest.fixture
def cfg(tmp_path):
    c = _load("local.py")
    c.workdir = str(tmp_path / "run")
    return c


# ------------------------------------------------------------------------------- the schema

def test_default_config_is_every_owners_default():
    c = run_config.default_config()
    assert set(c.keys()) == {"name", "mode", "workdir", "seed", "compile_cache_dir",
                             *run_config.SECTIONS}
    assert set(OWNERS) == set(run_config.SECTIONS)
    for name, owner in OWNERS.items():
        want = owner().to_dict()
        for key in run_config.DERIVED_SEEDS:   # the run's seed drives them
            section, field = key.split(".")
            if section == name:
                want[field] = config_utils.RUN_SEED
        assert c[name].to_dict() == want, name


def test_one_seed_drives_the_run():
    c = run_config.default_config()
    c.seed = 7
    r = run_config.resolve_seeds(c)
    assert (r.lp.seed, r.sft.seed, r.seed) == (7, 7, 7)
    assert c.lp.seed == config_utils.RUN_SEED          # a copy: the input is unchanged
    c.lp.seed = 3                                        # an explicit seed stays
    assert (run_config.resolve_seeds(c).lp.seed, run_config.resolve_seeds(c).sft.seed) == (3, 7)
    with pytest.raises(config_utils.ConfigError, match="lp.seed=-1.*resolve_seeds"):
        learnability.Sampler.from_config(run_config.default_config().lp)


def test_sampling_section_mirrors_sampling_config():
    d = generate.SamplingConfig()
    s = generate.default_config()
    assert s.to_dict() == {k: getattr(d, k) for k in s}
    generate.SamplingConfig(**s.to_dict())   # every key is a SamplingConfig field


def test_the_temperature_is_stated_once():
    assert "temperature" not in learner.default_config()
    with pytest.raises(config_utils.ConfigKeyError, match="optim.temperature"):
        config_utils.check_overrides(_load("local.py"), ["--config.optim.temperature=0.5"])


@pytest.mark.parametrize("name", ["local.py", "ace30b.py", "ideator.py"])
def test_config_files_are_diffs_over_the_schema(name):
    """Same keys as the schema, except what a config may fill (model presets' overrides /
    runtime keys) and the optional sections; no key of its own."""
    c = _load(name)
    free = ("model.overrides.", "model.runtime.") + tuple(
        s + "." for s in run_config.OPTIONAL_SECTIONS)

    def keys(x):
        return {k for k in config_utils.flat_keys(x) if not k.startswith(free)}

    assert keys(c) == keys(run_config.default_config())
    assert set(c.keys()) - set(run_config.default_config().keys()) <= \
        set(run_config.OPTIONAL_SECTIONS)


def test_local_values_that_matter():
    c = _load("local.py")
    assert (c.name, c.workdir, c.sampling.temperature, c.sampling.max_new_tokens) == \
        ("local", "runs/local", 0.5, 384)
    assert (c.rl.num_steps, c.rl.batch_states, c.rl.group_size, c.rl.max_prompt_tokens) == \
        (20, 4, 4, 768)
    assert len(c.tasks.ids) == 6 and c.model.overrides.max_position_embeddings == 2048
    a = _load("ace30b.py")
    assert (a.rl.batch_states, a.rl.group_size, a.optim.microbatches, a.sampling.temperature) \
        == (64, 8, 2, 1.0)
    assert (a.optim.share_prompts, a.optim.prompt_split) == (True, "within_groups")


def test_smoke_is_local_with_the_launch_tests_overrides():
    smoke = config_utils.load_config_file(str(REPO / "configs/local.py") + ":smoke")
    want = _load("local.py")
    want.model.overrides.update(dict(hidden_size=32, intermediate_size=64,
                                     moe_intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, head_dim=16))
    want.sft.update(dict(steps=3, seconds=0.0, batch_size=4, debug_per_task=0))
    want.rl.update(dict(num_steps=5, batch_states=2, group_size=2))
    want.sampling.max_new_tokens = 24
    want.sandbox.backend = "process"
    want.tasks.ids = ("iris-species", "wine-cultivar")
    want.probe.every, want.probe.heldout_tasks = 2, ("linnerud-physiology",)
    assert config_utils.flat_dict(smoke) == config_utils.flat_dict(want)
    with pytest.raises(ValueError, match="smoke"):
        config_utils.load_config_file(str(REPO / "configs/local.py") + ":nope")


# ------------------------------------------------------------------------------- validate

def test_the_shipped_configs_validate():
    run_config.validate(_load("local.py"), num_devices=1, num_processes=1)
    run_config.validate(_load("local.py"), num_devices=8, num_processes=1)
    run_config.validate(_load("ideator.py"), num_devices=1, num_processes=1)
    run_config.validate(_load("ace30b.py"), num_devices=64, num_processes=16)
    run_config.validate(config_utils.load_config_file(str(REPO / "configs/local.py:smoke")),
                        num_devices=1, num_processes=1)


def _set(c, key, value):
    *path, last = key.split(".")
    for p in path:
        c = c[p]
    c[last] = value


@pytest.mark.parametrize("key, value, match", [
    ("workdir", "", "workdir is empty"),
    ("rl.group_size", 1, r"rl.batch_states must be >= 1 and rl.group_size >= 2 \(GRPO compares "
                         r"within a group\), got 4, 1"),
    ("rl.batch_states", 0, "rl.batch_states must be >= 1"),
    ("rl.reward", "nope", "rl.reward: unknown reward 'nope'.*acegrpo_step"),
    ("grpo.beta", -1.0, "grpo.beta must be >= 0"),
    ("grpo.beta", 0.04, "grpo.beta=0.04: the KL term needs reference log-probs"),
    ("grpo.proximal", "old", "grpo.proximal must be one of"),
    ("rl.max_staleness", -1, r"rl.max_staleness must be an int >= 0, got -1"),
    ("optim.microbatches", 3, "rows = rl.batch_states x rl.group_size = 16 is not divisible by "
                              "optim.microbatches = 3"),
    ("optim.microbatches", 0, "optim.microbatches = 0"),
    ("sampling.temperature", -1.0, "sampling: temperature must be >= 0"),
    ("sampling.top_p", 0.0, "sampling: top_p must be in"),
    ("sampling.max_new_tokens", 0, "sampling: max_new_tokens must be >= 1"),
    ("tasks.source", "kaggle", "tasks.source='kaggle'; valid: offline, mlebench"),
    ("mesh.expert", 3, r"mesh: .*do not split.* \(jax sees 8 devices in 1 processes\)"),
    ("mesh.fsdp", 4, r"mesh: mesh .* needs 4 devices, 8 available \(jax sees 8 devices"),
    ("mesh.axis_types", "manual", "mesh: mesh.axis_types must be one of"),
    ("mesh.distributed", "sometimes", "mesh: mesh.distributed must be auto | always | never"),
    ("rl.max_prompt_tokens", 1700, r"rl.max_prompt_tokens \+ sampling.max_new_tokens = 2084 "
                                   r"exceeds the model's max_position_embeddings \(2048\)"),
    ("model.preset", "gpt5", "model: .*unknown model config 'gpt5'"),
    ("engine.kind", "vllm", "engine.kind must be one of"),
    ("engine.max_context", 512, "engine.max_context = 512 is below rl.max_prompt_tokens"),
    ("engine.num_pages", 10, "engine.num_pages = 10 cannot hold one row of 1152 tokens"),
    ("sampler_mesh.moe_parallelism", "expert_tensor",
     r"'expert_tensor' splits the experts over 'expert' and 'tensor': set sampler_mesh.rules.experts"),
])
def test_each_check_names_its_keys(cfg, key, value, match):
    _set(cfg, key, value)
    with pytest.raises(ConfigError, match=match):
        run_config.validate(cfg, num_devices=8, num_processes=1)


def test_partial_rollouts_knobs(cfg):
    """The factor is >= 1; with partial rollouts on, a token may wait at least one step beyond
    the executions' lag (rl.max_token_staleness >= rl.max_staleness + 1)."""
    cfg.rl.partial_rollouts, cfg.rl.max_staleness, cfg.rl.max_token_staleness = True, 1, 2
    run_config.validate(cfg, num_devices=1, num_processes=1)
    cfg.rl.max_token_staleness = 1
    with pytest.raises(ConfigError, match=r"rl.max_token_staleness must be an int >= "
                                          r"\(rl.max_staleness \+ 1\) x grpo.minibatches = 2 "
                                          r"with partial rollouts on"):
        run_config.validate(cfg, num_devices=1, num_processes=1)
    cfg.rl.max_token_staleness, cfg.grpo.minibatches = 3, 2   # versions: 2 per learned step
    with pytest.raises(ConfigError, match="grpo.minibatches = 4"):
        run_config.validate(cfg, num_devices=1, num_processes=1)
    cfg.grpo.minibatches = 1
    cfg.rl.partial_rollouts = False      # off: the bound is not read
    run_config.validate(cfg, num_devices=1, num_processes=1)
    cfg.rl.partial_factor = 0.5
    with pytest.raises(ConfigError, match="rl.partial_factor must be a number >= 1"):
        run_config.validate(cfg, num_devices=1, num_processes=1)


def test_share_prompts_needs_whole_groups_and_no_router_loss(cfg):
    cfg.optim.share_prompts = True
    cfg.rl.batch_states, cfg.optim.microbatches = 4, 2
    run_config.validate(cfg, num_devices=8, num_processes=1)
    cfg.optim.microbatches = 4 * cfg.rl.group_size       # divides the rows, not the groups
    with pytest.raises(ConfigError, match="whole groups: 4 groups are not divisible by "
                                          "optim.microbatches = "):
        run_config.validate(cfg, num_devices=8, num_processes=1)
    cfg.optim.microbatches, cfg.optim.aux_loss_coef = 1, 0.001
    with pytest.raises(ConfigError, match="optim.share_prompts needs optim.aux_loss_coef = 0, "
                                          "got 0.001"):
        run_config.validate(cfg, num_devices=8, num_processes=1)
    # the learner itself refuses it too (a Learner built without a run config)
    with pytest.raises(ValueError, match="optim.share_prompts needs"):
        learner.jit_learner_step(None, cfg.grpo, cfg.optim, cfg.rl.group_size)


def test_mesh_rules(cfg):
    cfg.mesh.rules.embed = "model"
    with pytest.raises(ConfigError, match=r"mesh: rule 'embed' names unknown mesh axes"):
        run_config.validate(cfg, num_devices=1, num_processes=1)


def test_a_loaded_model_is_checked_by_check_context(cfg):
    cfg.model.hf_path = "/somewhere/Qwen3"      # not read: the context needs the loaded model
    cfg.rl.max_prompt_tokens = 1 << 20
    run_config.validate(cfg, num_devices=1, num_processes=1)
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        run_config.check_context(cfg, 40960)
    run_config.check_context(cfg, 1 << 21)


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError) and run_config.ConfigError is ConfigError


def test_devices_default_to_jax(cfg):
    import jax

    cfg.mesh.fsdp = jax.device_count() + 1
    with pytest.raises(ConfigError, match=f"jax sees {jax.device_count()} devices"):
        run_config.validate(cfg)


# ------------------------------------------------------------------------------- the learner

@pytest.mark.slow   # two learner compiles (~1 min on a busy 2-core machine)
def test_the_learner_recomputes_logprobs_at_the_sampling_temperature():
    """On the first step the learner's log-probs equal the behaviour ones only at the
    temperature the learner is given (the trainer gives it ``sampling.temperature``)."""
    import numpy as np
    from flax import nnx

    from ace_jax.rl import rollout_batch
    from models import configs, qwen3

    prompts, g, m = [[11, 12, 13], [21, 22]], 2, 4
    model = qwen3.Qwen3ForCausalLM(configs.tiny_dense(), rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(1, 200, (len(prompts) * g, m)).astype(np.int32)
    gen = generate.GenerationResult(tokens, np.zeros(tokens.shape, np.float32),
                                    np.full((len(tokens),), m, np.int32),
                                    np.zeros((len(tokens),), np.int32),
                                    np.repeat(np.arange(len(prompts)), g).astype(np.int32))
    rew = np.asarray([0.0, 1.0, 1.0, 0.0], np.float32)
    batch = rollout_batch.make_train_batch(prompts, gen, rew, prompt_bucket=4, pad_id=0)
    behaviour, _, _ = rollout_batch.completion_logprobs(model, batch, 0.5)   # sampled at T=0.5
    batch = batch._replace(behaviour_logprobs=behaviour)
    diffs = {}
    for t in (0.5, 1.0):
        lrn = learner.Learner.create(model, grpo.default_config(), learner.default_config(),
                                     group_size=g, temperature=t)
        assert lrn.temperature == t
        diffs[t] = float(lrn.step(batch)["logprob_diff_max_abs"])
    assert diffs[0.5] < 1e-4 < diffs[1.0]
