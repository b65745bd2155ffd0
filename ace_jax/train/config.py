"""The run's config schema: which sections a run has, who owns each, and the cross-checks.

Every section is the ``default_config()`` of the module that reads it, so each constant is
documented next to its use; `default_config` assembles them into the whole run config (the one
place that lists the sections) and ``configs/*.py`` state only what differs from it:

  =============  ==============================================  ==============================
  section        owner                                           what
  =============  ==============================================  ==============================
  (top level)    `default_config`                                name, workdir, seed, XLA cache
  ``model``      `model_config`                                  the policy
  ``mesh``       ``ace_jax.runtime.sharding.default_config``     device mesh and sharding rules
  ``sampler_mesh`` ``ace_jax.runtime.sampler_layout...``         the sampler's own layout
  ``rl``         `rl_config`                                     the RL loop
  ``sampling``   ``ace_jax.runtime.generate.default_config``     rollout sampling
  ``engine``     ``ace_jax.runtime.engine_config...``            the rollout engine
  ``grpo``       ``ace_jax.rl.grpo.default_config``              the GRPO loss
  ``optim``      ``ace_jax.rl.learner.default_config``           optimizer and schedule
  ``buffer``     ``ace_jax.curriculum.buffer.default_config``    the Evolving Data Buffer
  ``lp``         ``ace_jax.curriculum.learnability...``          the LP sampler
  ``sandbox``    ``sandbox.pool.default_config``                 execution pool
  ``agent``      ``ace_jax.env.agent.default_config``            prompts and actions
  ``rewards``    ``ace_jax.env.rewards.default_config``          reward shaping constants
  ``sft``        ``ace_jax.train.sft.default_config``            the warm start
  ``tasks``      `tasks_config`                                  which tasks
  ``checkpoint`` ``ace_jax.runtime.checkpoint.default_config``   Orbax checkpoints
  ``probe``      ``ace_jax.train.probe.default_config``          the sampler-neutral probe
  =============  ==============================================  ==============================

Optional sections, added by the configs that use them: ``dry_run``
(``ace_jax.train.dry_run.default_config``, what ``--dry_run`` projects onto; ``configs/ace30b.py``)
and, with ``mode = "ideator"``, ``ideator`` (``ace_jax.ideator.ideator_trainer.default_config``;
``configs/ideator.py``).

`validate` holds the checks that read more than one key (batch / group sizes, the mesh against
the devices, the context length against the model, ...); it raises
``config_utils.ConfigError`` whose message names the keys.
"""
from __future__ import annotations

import hashlib
import json
from typing import Optional

import ml_collections

from ace_jax import config_utils
from ace_jax.config_utils import ConfigError
from ace_jax.curriculum import buffer, learnability
from ace_jax.env import agent, rewards, tasks
from ace_jax.registry import UnknownNameError
from ace_jax.rl import grpo, learner
from ace_jax.runtime import (checkpoint, compile_cache, engine_config, generate, sampler_layout,
                             sharding)
from models import moe_sharding
from ace_jax.train import probe, sft
from sandbox import pool

__all__ = ["ConfigError", "SECTIONS", "OPTIONAL_SECTIONS", "default_config",
           "model_config", "rl_config", "tasks_config", "validate", "check_context"]

# The sections of `default_config`, in its order, and the optional ones (see the module doc).
SECTIONS = ("model", "mesh", "sampler_mesh", "rl", "sampling", "engine", "grpo", "optim", "buffer", "lp", "sandbox",
            "agent", "rewards", "sft", "tasks", "checkpoint", "probe")
OPTIONAL_SECTIONS = ("dry_run", "ideator")


def model_config() -> ml_collections.ConfigDict:
    """The ``model`` section: the policy (read by ``ace_jax.train.trainer``)."""
    c = ml_collections.ConfigDict()
    c.preset = "tiny_moe"             # a models.configs preset (used when hf_path is empty)
    c.hf_path = ""                    # a local or gs:// HF directory to load instead of a preset
    c.tokenizer_path = ""             # "" = train a BPE on the task suite into <workdir>/tokenizer
    # A run directory whose newest checkpoint (and tokenizer) start this run instead of a fresh
    # init + warm start; e.g. a warm-start-only run (--config.rl.num_steps=0) shared by ablations.
    c.init_from_run = ""
    # With hf_path: keyword arguments of models.hf_mapping.load_hf_model, applied on top of the
    # directory's config.json (dtype, param_dtype, remat_policy, moe_dispatch, ...).
    c.runtime = ml_collections.ConfigDict(dict(dtype="float32"))
    # Without hf_path: models.configs.ModelConfig fields applied to the preset (the vocabulary
    # size is the tokenizer's).
    c.overrides = ml_collections.ConfigDict()
    return c


def rl_config() -> ml_collections.ConfigDict:
    """The ``rl`` section: the RL loop (read by ``ace_jax.train.trainer``)."""
    c = ml_collections.ConfigDict()
    c.num_steps = 20
    # A budget of generated completion tokens (every step's, every dynamic-sampling round's):
    # no new step goes out once the run has generated this many; 0 = rl.num_steps alone. For
    # comparisons at equal generation cost (e.g. dynamic sampling against plain GRPO).
    c.token_budget = 0
    c.batch_states = 4                # B states sampled by the LP sampler per step
    c.group_size = 4                  # G completions per state (GRPO compares within a group)
    # policy versions a rollout may lag behind the learner: the sandbox runs step t while the
    # trainer generates t+1 and learns on t-1 (1); 0 = synchronous
    c.max_staleness = 1
    # Partial rollouts (ace_jax.train.partial_rollouts; the paged engine only). Off: each step
    # submits its B groups and drains them (a step lasts as long as its longest sample). On:
    # the engine holds ceil(partial_factor * B) groups, a step takes the first B that
    # complete, the others decode on under the new weights (each token stamped with the
    # policy version that sampled it). The factor: benchmarks/bench_rollouts.py (docs/offpolicy.md,
    # results/partial_rollouts/raw.jsonl): on a log-uniform length mix, 3 brings the decode
    # row-steps per useful token from 2.66 (drained) to 1.05 at the default bound; 4 to the same.
    c.partial_rollouts = False
    c.partial_factor = 3.0
    # With partial rollouts: the most learner updates between the parameters that sampled a
    # token and the update that learns on it (>= rl.max_staleness + 1); a step waits for a
    # group that would otherwise pass it.
    c.max_token_staleness = 3
    c.reward = "acegrpo_step"         # a name in ace_jax.env.rewards
    c.max_prompt_tokens = 768         # longer prompts keep their last tokens (counted in metrics)
    # Dynamic sampling (Trainer._refill): groups whose rewards all agree carry no gradient; up
    # to dynamic_sampling_rounds more generation rounds per step (0 = off) look for signal.
    # "dapo": draw new states for the missing informative groups (DAPO's refill);
    # "reinforce_ada": G more samples of each state whose samples so far all agree, then a
    # group of G balanced between its best and worst samples, its advantages from the mean and
    # std of all the state's samples (Reinforce-Ada's resampling and global baseline).
    c.dynamic_sampling = "dapo"
    c.dynamic_sampling_rounds = 0
    # The buffer starts from one empty draft per task; True also seeds the reference solutions
    # of the seed corpus as improvable states (as on MLE-bench, which ships none).
    c.seed_with_references = False
    # Comma-separated seed_solutions.jsonl files of earlier evaluations (launch/evaluate.py
    # --out; gs:// too): their valid attempts on this run's tasks become root states (origin
    # "evaluation").
    c.seed_solutions = ""
    return c


def tasks_config() -> ml_collections.ConfigDict:
    """The ``tasks`` section: which tasks the run trains on (read by ``ace_jax.train.trainer``)."""
    c = ml_collections.ConfigDict()
    c.source = "offline"              # offline (the bundled suite) | mlebench
    c.ids = ()                        # () = every task of the source
    c.cache_dir = "cache/tasks"       # offline: where the suite is prepared
    c.data_dir = ""                   # mlebench: the folder of prepared competitions (or gs://)
    c.seed = 0                        # the seed the tasks are prepared with
    return c


DYNAMIC_SAMPLING = ("dapo", "reinforce_ada")   # rl.dynamic_sampling (Trainer._refill)


def _check_partial(rl: ml_collections.ConfigDict, minibatches: int) -> None:
    """``rl.partial_factor`` >= 1; with partial rollouts on, ``rl.max_token_staleness`` (in
    policy versions: ``grpo.minibatches`` per learned step) leaves room for a token to wait one
    step beyond the executions' lag: >= (rl.max_staleness + 1) x grpo.minibatches."""
    f = rl.partial_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not f >= 1:
        raise ConfigError(f"rl.partial_factor must be a number >= 1 (groups the engine holds "
                          f"per group a step takes), got {f!r}")
    bound, least = rl.max_token_staleness, (int(rl.max_staleness) + 1) * int(minibatches)
    if rl.partial_rollouts and (isinstance(bound, bool) or not isinstance(bound, int)
                                or bound < least):
        raise ConfigError(f"rl.max_token_staleness must be an int >= (rl.max_staleness + 1) x "
                          f"grpo.minibatches = {least} with partial rollouts on, got {bound!r}")


# A run config holds RUN_SEED (-1) here by default: the run's ``seed`` (`resolve_seeds`).
DERIVED_SEEDS = ("lp.seed", "sft.seed")


def default_config() -> ml_collections.ConfigDict:
    """The whole run config: every section's owner default (see the module doc). A config file
    starts from this and sets what differs; ``name`` and ``workdir`` it must set."""
    c = ml_collections.ConfigDict()
    c.name = ""                       # the run's name (the end-of-run summary says it)
    # the environment: "acegrpo" (the code agent, ace_jax.train.environment) or "ideator"
    # (MLE-Ideator, configs/ideator.py); `python -m ace_jax` maps it (its ENVIRONMENTS)
    c.mode = "acegrpo"
    c.workdir = ""                    # checkpoints, buffer, metrics, tokenizer (local or gs://)
    c.seed = 0
    # XLA's persistent compilation cache (ace_jax.runtime.compile_cache), enabled by the
    # launchers: later runs of the same setting (a resume, the next seed) skip compiling. "" = off.
    c.compile_cache_dir = compile_cache.DEFAULT_DIR
    c.model = model_config()
    c.mesh = sharding.default_config()
    c.sampler_mesh = sampler_layout.default_config()
    c.rl = rl_config()
    c.sampling = generate.default_config()
    c.engine = engine_config.default_config()
    c.grpo = grpo.default_config()
    c.optim = learner.default_config()
    c.buffer = buffer.default_config()
    c.lp = learnability.default_config()
    c.sandbox = pool.default_config()
    c.agent = agent.default_config()
    c.rewards = rewards.default_config()
    c.sft = sft.default_config()
    c.tasks = tasks_config()
    c.checkpoint = checkpoint.default_config()
    c.probe = probe.default_config()
    for key in DERIVED_SEEDS:   # the run's seed drives them (`resolve_seeds`)
        section, name = key.split(".")
        c[section][name] = config_utils.RUN_SEED
    return c


def resolve_seeds(cfg: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy of ``cfg`` with each seed of ``DERIVED_SEEDS`` that is -1 set to the run's
    ``seed``: one ``--config.seed=k`` varies the whole run (initial weights, SFT order and its
    synthetic examples, generation, the sampler, the probe's states and keys). The task split
    (``tasks.seed``) stays fixed: it defines the benchmark."""
    cfg = ml_collections.ConfigDict(cfg.to_dict())
    for key in DERIVED_SEEDS:
        section, name = key.split(".")
        if section in cfg and cfg[section][name] == config_utils.RUN_SEED:
            cfg[section][name] = int(cfg.seed)
    return cfg


def config_json(cfg: ml_collections.ConfigDict) -> str:
    """The config as canonical JSON: sorted keys, tuples as lists, one line."""
    return json.dumps(cfg.to_dict(), sort_keys=True, default=repr)


def fingerprint(cfg: ml_collections.ConfigDict) -> str:
    """sha256 of `config_json` of ``resolve_seeds(cfg)``: equal for two configs exactly when a
    run of each would use the same values (a finished run is reused on it)."""
    return hashlib.sha256(config_json(resolve_seeds(cfg)).encode()).hexdigest()


# ------------------------------------------------------------------------------------ checks

def validate(cfg: ml_collections.ConfigDict, *, num_devices: Optional[int] = None,
             num_processes: Optional[int] = None) -> None:
    """Checks what can be checked of a run config before any heavy work; raises ConfigError.

    Checks: ``workdir`` is set; ``grpo`` (``grpo.validate_config``); ``rl.reward`` is
    registered and ``grpo.beta == 0`` (no reference model); ``rl.batch_states >= 1`` and ``rl.group_size >= 2``; ``rl.max_staleness``;
    ``optim.microbatches`` divides the rows of a step;
    ``optim.share_prompts`` (`learner.check_share_prompts`), ``grpo.minibatches``
    (`learner.check_minibatches`); the partial rollouts' knobs; the ``sampling`` values;
    ``tasks.source``; the ``mesh`` against the devices; and, for a preset model (no ``model.hf_path`` / ``model.init_from_run``), the
    context length against its ``max_position_embeddings`` (`check_context`; call it again once
    a loaded model's config is known).

    Args:
      cfg: a run config (`default_config` plus the config file's changes and overrides).
      num_devices / num_processes: what the mesh must cover; None: ``jax.device_count()`` /
        ``jax.process_count()`` (call it after ``sharding.maybe_initialize_distributed``).
    """
    if not cfg.get("workdir"):
        raise ConfigError("workdir is empty: set it in the config file or with --config.workdir")
    try:
        grpo.validate_config(cfg.grpo)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.grpo.beta:
        raise ConfigError(f"grpo.beta={cfg.grpo.beta:g}: the KL term needs reference log-probs, "
                          "which the trainer does not compute (no reference model is kept); "
                          "use grpo.beta=0")
    try:
        rewards.get_reward(cfg.rl.reward)
    except UnknownNameError as e:
        raise ConfigError(f"rl.reward: {e}") from None
    rl = cfg.rl
    if rl.batch_states < 1 or rl.group_size < 2:
        raise ConfigError(f"rl.batch_states must be >= 1 and rl.group_size >= 2 (GRPO compares "
                          f"within a group), got {rl.batch_states}, {rl.group_size}")
    if rl.dynamic_sampling not in DYNAMIC_SAMPLING:
        raise ConfigError(f"rl.dynamic_sampling={rl.dynamic_sampling!r}; valid: "
                          f"{', '.join(DYNAMIC_SAMPLING)}")
    rounds = rl.dynamic_sampling_rounds
    if rl.dynamic_sampling == "reinforce_ada" and rounds and \
            cfg.grpo.advantage_estimator not in ("grpo", "drgrpo"):
        raise ConfigError("rl.dynamic_sampling='reinforce_ada' computes its global-baseline "
                          "advantages as grpo.advantage_estimator 'grpo' or 'drgrpo' does, got "
                          f"{cfg.grpo.advantage_estimator!r}")
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 0:
        raise ConfigError(f"rl.dynamic_sampling_rounds must be an int >= 0 (0 = off), got "
                          f"{rounds!r}")
    if isinstance(rl.token_budget, bool) or not isinstance(rl.token_budget, int) \
            or rl.token_budget < 0:
        raise ConfigError(f"rl.token_budget must be an int >= 0 (0 = off), got "
                          f"{rl.token_budget!r}")
    _check_partial(rl, cfg.grpo.minibatches)
    k = rl.max_staleness
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ConfigError(f"rl.max_staleness must be an int >= 0, got {k!r}")
    rows, k = rl.batch_states * rl.group_size, cfg.optim.microbatches
    if k < 1 or rows % k:
        raise ConfigError(f"rows = rl.batch_states x rl.group_size = {rows} is not divisible by "
                          f"optim.microbatches = {k}")
    try:
        learner.check_share_prompts(cfg.optim, rl.batch_states, rl.group_size)
        learner.check_minibatches(cfg.grpo, cfg.optim, rows, rl.group_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    try:
        generate.SamplingConfig(group_size=rl.group_size, **cfg.sampling.to_dict())
    except (TypeError, ValueError) as e:
        raise ConfigError(f"sampling: {e}") from None
    if cfg.tasks.source not in tasks.SOURCES:
        raise ConfigError(f"tasks.source={cfg.tasks.source!r}; valid: {', '.join(tasks.SOURCES)}")
    errors = probe.validate(cfg)
    if cfg.probe.every and cfg.mode != "acegrpo":
        errors.append(f"probe.every={cfg.probe.every} with mode={cfg.mode!r}: the probe measures "
                      "the code agent (set probe.every=0)")
    if errors:
        raise ConfigError("; ".join(errors))
    _check_mesh(cfg.mesh, num_devices, num_processes)
    _check_sampler_mesh(cfg.sampler_mesh, num_devices)
    _check_engine(cfg, num_devices)
    if not cfg.model.get("hf_path", "") and not cfg.model.get("init_from_run", ""):
        from models import configs as model_configs

        try:
            mc = model_configs.get_model_config(cfg.model.preset, **dict(cfg.model.overrides))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"model: {e}") from None
        check_context(cfg, mc.max_position_embeddings)


def check_context(cfg: ml_collections.ConfigDict, max_position_embeddings: int) -> None:
    """ConfigError unless a prompt plus its completion fit the model's positions."""
    ctx = cfg.rl.max_prompt_tokens + cfg.sampling.max_new_tokens
    if ctx > max_position_embeddings:
        raise ConfigError(f"rl.max_prompt_tokens + sampling.max_new_tokens = {ctx} exceeds the "
                          f"model's max_position_embeddings ({max_position_embeddings})")


def _check_engine(cfg: ml_collections.ConfigDict, num_devices: Optional[int]) -> None:
    """The ``engine`` section: a known kind that runs on this mesh, and valid shapes."""
    import jax  # local: validate may run before the backend is chosen

    e = cfg.engine
    n = jax.device_count() if num_devices is None else num_devices
    ctx = cfg.rl.max_prompt_tokens + cfg.sampling.max_new_tokens
    try:
        engine_config.resolve_kind(e.kind, n)
        engine_config.engine_config(e, max_context=ctx)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if e.max_context and e.max_context < ctx:
        raise ConfigError(f"engine.max_context = {e.max_context} is below rl.max_prompt_tokens + "
                          f"sampling.max_new_tokens = {ctx} (0 = exactly that)")
    need = 2 + -(-max(e.max_context, ctx) // e.page_size)   # page 0, a row, a partial prompt page
    if e.num_pages and e.num_pages < need:
        raise ConfigError(f"engine.num_pages = {e.num_pages} cannot hold one row of "
                          f"{max(e.max_context, ctx)} tokens in pages of {e.page_size}: "
                          f"at least {need} (0 = room for every slot)")


def _check_sampler_mesh(sm: ml_collections.ConfigDict, num_devices: Optional[int]) -> None:
    """The ``sampler_mesh`` section: a known layout, and (own layout) a mesh over the devices."""
    import jax  # local: validate may run before the backend is chosen

    if sm.layout not in sampler_layout.LAYOUTS:
        raise ConfigError(f"sampler_mesh.layout must be one of {list(sampler_layout.LAYOUTS)}, "
                          f"got {sm.layout!r}")
    if sm.moe_parallelism not in moe_sharding.MOE_PARALLELISM:
        raise ConfigError(f"sampler_mesh.moe_parallelism must be one of "
                          f"{list(moe_sharding.MOE_PARALLELISM)}, got {sm.moe_parallelism!r}")
    if sm.moe_parallelism == "expert_tensor" and set(
            sharding.rules_from_config(sm.rules).get("experts") or ()) != {"expert", "tensor"}:
        raise ConfigError("sampler_mesh.moe_parallelism='expert_tensor' splits the experts over "
                          "'expert' and 'tensor': set sampler_mesh.rules.experts = "
                          f"'expert,tensor' (got {sm.rules.experts!r})")
    if sm.weight_dtype not in sampler_layout.WEIGHT_DTYPES:
        raise ConfigError(f"sampler_mesh.weight_dtype must be one of "
                          f"{list(sampler_layout.WEIGHT_DTYPES)}, got {sm.weight_dtype!r}")
    if sm.layout == "shared":
        return
    n = jax.device_count() if num_devices is None else num_devices
    try:
        sharding.resolve_mesh_shape(sm, n)
        sharding.rules_from_config(sm.rules)
    except sharding.MeshConfigError as e:
        raise ConfigError(f"sampler_mesh: {e} (jax sees {n} devices)") from None


def _check_mesh(mesh: ml_collections.ConfigDict, num_devices: Optional[int],
                num_processes: Optional[int]) -> None:
    if num_devices is None or num_processes is None:
        import jax

        num_devices = jax.device_count() if num_devices is None else num_devices
        num_processes = jax.process_count() if num_processes is None else num_processes
    try:
        if mesh.distributed not in ("auto", "always", "never"):
            raise sharding.MeshConfigError(f"mesh.distributed must be auto | always | never, "
                                           f"got {mesh.distributed!r}")
        if mesh.axis_types not in ("auto", "explicit"):
            raise sharding.MeshConfigError(f"mesh.axis_types must be one of "
                                           f"['auto', 'explicit'], got {mesh.axis_types!r}")
        sharding.resolve_mesh_shape(mesh, num_devices)
        sharding.rules_from_config(mesh.rules)
    except (sharding.MeshConfigError, ValueError, TypeError) as e:
        raise ConfigError(f"mesh: {e} (jax sees {num_devices} devices in {num_processes} "
                          f"processes)") from None
