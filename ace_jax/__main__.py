"""Train an agent: the library's entry point for a training run (the project's main job).

  python -m ace_jax --config=configs/local.py              # 2-core CPU, the default
  python -m ace_jax --config=configs/ace30b.py             # TPU pod (every host)
  python -m ace_jax --config=configs/ace30b.py --dry_run   # memory / step-time plan
  python -m ace_jax --config=configs/local.py --config.rl.group_size=8
  python -m ace_jax --config=configs/local.py:smoke        # a minutes-long smoke run
  python -m ace_jax --config=configs/ideator.py            # MLE-Ideator (mode "ideator")

(``launch/tpu_train.py`` takes the same flags.) Any setting is overridable with
``--config.<section>.<key>=<value>``; a misspelt key is refused with the list of valid keys, and a
config whose values cannot work together (``ace_jax.train.config.validate``) is refused before any
heavy work. The config's ``mode`` picks the environment (``ENVIRONMENTS``). Re-running the same
command after an interruption resumes the run.

The package's entry point, above every room: it wires every environment to the trainer, so it
may import any room (``ace_jax.ideator`` included) and nothing imports it but tests
(tests/test_layout.py). It sits at the top of ``ace_jax/`` because a room's ``__main__.py`` obeys
its room's declared imports, and the ``train`` room imports nothing of ``ideator``.
"""
import sys

from absl import app, flags
from ml_collections import config_flags

from ace_jax import config_utils
from ace_jax.registry import Registry, UnknownNameError

DEFAULT_CONFIG = "configs/local.py"

_CONFIG = config_flags.DEFINE_config_file("config", DEFAULT_CONFIG, "Path to a config file.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Build the model, learner and generation steps "
                             "abstractly and print the per-device memory and step-time plan.")
_NO_PROGRESS = flags.DEFINE_bool("no_progress", False, "Disable the terminal progress bar.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Print the resolved run config (JSON, "
                                  "its fingerprint last) and exit: what a run of this command "
                                  "would use.")

# The config's ``mode`` -> a function of the config giving the run's environment
# (``ace_jax.env.environment.Environment``, whose ``mode`` is that name).
ENVIRONMENTS: Registry = Registry("mode")


@ENVIRONMENTS.register("acegrpo")
def _code_agent(cfg):
    from ace_jax.train import environment

    return environment.CodeAgentEnv()


@ENVIRONMENTS.register("ideator")
def _ideator(cfg):
    from ace_jax.ideator import ideator_trainer

    return ideator_trainer.IdeatorEnv(cfg)


def environment_factory(cfg):
    """The function building the environment of ``cfg.mode``.

    Raises:
      config_utils.ConfigError: an unknown ``mode`` (the message lists the valid ones).
    """
    try:
        return ENVIRONMENTS.get(cfg.mode)
    except UnknownNameError as e:
        raise config_utils.ConfigError(f"config {e}") from None


def build_trainer(cfg, *, progress: bool = True):
    """The ``Trainer`` of a run config, with the environment its ``mode`` names.

    Raises:
      config_utils.ConfigError: an unknown ``mode`` (the message lists the valid ones).
      ace_jax.train.setup.SetupError: what ``Trainer`` refuses.
    """
    from ace_jax.train import trainer

    return trainer.Trainer(cfg, progress=progress, env=environment_factory(cfg)(cfg))


def main(argv):
    del argv
    from ace_jax.train import logs

    logs.configure_logging()   # warnings and errors; --verbosity=0 shows INFO (Orbax's too)
    cfg = _CONFIG.value
    if _PRINT_CONFIG.value:
        from ace_jax.train import config as run_config

        resolved = run_config.resolve_seeds(cfg)
        print(run_config.config_json(resolved))
        print(run_config.fingerprint(resolved), flush=True)
        return
    if _DRY_RUN.value:
        return _dry_run(cfg)
    from ace_jax.runtime import compile_cache, sharding
    from ace_jax.train import config as run_config, summary as summary_lib

    sharding.maybe_initialize_distributed(cfg.mesh)
    try:
        environment_factory(cfg)   # an unknown mode, before any heavy work
        run_config.validate(cfg)
    except config_utils.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    compile_cache.enable(cfg.compile_cache_dir)
    t = build_trainer(cfg, progress=not _NO_PROGRESS.value)
    try:
        summary = t.run()
    finally:
        t.close()
    print(summary_lib.format_run_summary(summary, tasks=t.tasks), flush=True)


def _dry_run(cfg) -> None:
    """Prints the plan, then its one-line JSON summary; exits 1 when a program does not fit."""
    import json

    from ace_jax.train import dry_run, dry_run_report

    try:
        report = dry_run.run_dry_run(cfg)
    except dry_run.DryRunConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(dry_run_report.format_report(report))
    result = dry_run_report.summary(report)
    print(json.dumps(result), flush=True)
    if not result["fits"]:
        sys.exit(1)


def _precheck_overrides(argv):
    """Refuses misspelt --config.* keys with the valid keys, before absl parses them
    (``--config=path[:arg]`` as ``ml_collections.config_flags`` reads it)."""
    if any(a in ("--help", "-h", "--helpfull", "--helpshort") for a in argv):
        return
    path = DEFAULT_CONFIG
    for a in argv:
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
    try:
        cfg = config_utils.load_config_file(path)
        config_utils.check_overrides(cfg, argv)
    except (config_utils.ConfigKeyError, FileNotFoundError, AttributeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run() -> None:
    """The command line: checks the overrides, then absl runs ``main``."""
    _precheck_overrides(sys.argv[1:])
    app.run(main)


if __name__ == "__main__":
    run()
