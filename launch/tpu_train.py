"""Train an agent with AceGRPO: the project's main job.

  python launch/tpu_train.py --config=configs/local.py              # 2-core CPU, the default
  python launch/tpu_train.py --config=configs/ace30b.py             # TPU pod (every host)
  python launch/tpu_train.py --config=configs/ace30b.py --dry_run   # memory / step-time plan
  python launch/tpu_train.py --config=configs/local.py --config.rl.group_size=8
  python launch/tpu_train.py --config=configs/local.py:smoke        # a minutes-long smoke run

Any setting is overridable with --config.<section>.<key>=<value>; a misspelt key is refused with
the list of valid keys, and a config whose values cannot work together (ace_jax/train/config.py,
``validate``) is refused before any heavy work. Re-running the same command after an
interruption resumes the run.
"""
import sys


from absl import app, flags
from ml_collections import config_flags

from ace_jax import config_utils

_CONFIG = config_flags.DEFINE_config_file("config", "configs/local.py", "Path to a config file.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Build the model, learner and generation steps "
                             "abstractly and print the per-device memory and step-time plan.")
_NO_PROGRESS = flags.DEFINE_bool("no_progress", False, "Disable the terminal progress bar.")
_PRINT_CONFIG = flags.DEFINE_bool("print_config", False, "Print the resolved run config (JSON, "
                                  "its fingerprint last) and exit: what a run of this command "
                                  "would use.")


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
    from ace_jax.train import trainer

    sharding.maybe_initialize_distributed(cfg.mesh)
    from ace_jax.train import config as run_config

    try:
        run_config.validate(cfg)
    except config_utils.ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    compile_cache.enable(cfg.get("compile_cache_dir", ""))
    if cfg.mode == "ideator":   # MLE-Ideator (configs/ideator.py)
        from ace_jax.ideator import ideator_trainer

        t = ideator_trainer.make_trainer(cfg, progress=not _NO_PROGRESS.value)
    else:   # "acegrpo" (validate refused any other mode)
        t = trainer.Trainer(cfg, progress=not _NO_PROGRESS.value)
    try:
        summary = t.run()
    finally:
        t.close()
    from ace_jax.train import summary as summary_lib

    print(summary_lib.format_run_summary(summary), flush=True)


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
    path = "configs/local.py"
    for a in argv:
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
    try:
        cfg = config_utils.load_config_file(path)
        config_utils.check_overrides(cfg, argv)
    except (config_utils.ConfigKeyError, FileNotFoundError, AttributeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    _precheck_overrides(sys.argv[1:])
    app.run(main)
