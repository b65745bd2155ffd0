"""Evaluate an agent policy on MLE tasks: episodes, medals, HumanRank, reports.

  python launch/evaluate.py --policy=run:runs/local --tasks=iris-species,wine-cultivar \\
      --seeds=0,1,2 --max_steps=4 --out=runs/local/eval
  python launch/evaluate.py --policy=run:runs/local@200 ...           # a given checkpoint step
  python launch/evaluate.py --policy=hf:/path/to/Qwen3-0.6B ...
  python launch/evaluate.py --policy=openai:http://127.0.0.1:8000/v1#qwen3 ...
  python launch/evaluate.py ... --ideator=openai:http://host/v1#big-model   # MLE-Ideator advisor

On a pod (a ``run:`` policy too large for one chip): start the same command on every host. Every
host loads the run onto the run's own mesh (each reading only its shards of the checkpoint: a
collective), process 0 runs the evaluation (tasks, sandbox, reports) and samples, and every
engine call it makes is replayed by the other hosts (``JaxPolicy`` ``multihost="leader"``,
``ace_jax.policy.mirror.follow``), which do nothing else and exit when it ends.
``--distributed`` / ``--coordinator_address`` / ``--num_processes`` / ``--process_id`` set up
``jax.distributed`` as the trainer's ``mesh.*`` keys do (auto: on a TPU VM, or when the
environment names several processes).

Writes to --out: results.json, report.md, per_task.png, best_dev.png, seed_solutions.jsonl and
episodes/<task>__seed<k>.jsonl (one line per step), and prints the table. A gs:// --out is
written locally: each episode's log is copied there as the episode ends, the rest when the
evaluation ends. Semantics and metric definitions:
``ace_jax/eval/runner.py`` (episodes) and ``ace_jax/eval/scoring.py`` (metrics).
"""
import logging
import os
import shutil
import tempfile

from absl import app, flags

from ace_jax.policy import mirror

_POLICY = flags.DEFINE_string("policy", None, "run:<workdir>[@step] | hf:<dir> | "
                              "openai:<base_url>#<model>")
_TASKS = flags.DEFINE_string("tasks", "", "Comma-separated task ids; empty: the run's "
                             "tasks.ids (run: policies) or the whole offline suite.")
_SEEDS = flags.DEFINE_string("seeds", "0,1,2", "Comma-separated episode seeds.")
_MAX_STEPS = flags.DEFINE_integer("max_steps", 4, "Implementer steps per episode.")
_TIME_BUDGET = flags.DEFINE_float("time_budget_s", 0.0, "Wall-clock seconds per episode, "
                                  "checked before each step; 0 = no budget.")
_OUT = flags.DEFINE_string("out", None, "Output directory (a local path or gs://).")
_WORKERS = flags.DEFINE_integer("workers", 2, "Sandbox workers, and episodes run at once.")
_BACKEND = flags.DEFINE_string("backend", "bwrap", "Sandbox backend: bwrap | process | docker.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Tokens per completion (default: the "
                                "run's sampling.max_new_tokens, or the policy's default).")
_TEMP = flags.DEFINE_float("temperature", None, "Sampling temperature (default: the run's, or "
                           "the policy's default).")
_MAX_PROMPT = flags.DEFINE_integer("max_prompt_tokens", None, "Prompt tokens kept (JAX policies).")
_IDEATOR = flags.DEFINE_string("ideator", "", "Advisor policy spec (same syntax as --policy); "
                               "needs ace_jax/ideator/advisor.py.")
_STAGNATION = flags.DEFINE_integer("stagnation_steps", 2, "Non-improving steps that trigger an "
                                   "advice request (with --ideator); <= 0: only on seek_help.")
_CACHE = flags.DEFINE_string("cache_dir", "", "Prepared offline tasks (prepared there if "
                             "missing); empty: the run's tasks.cache_dir, else cache/tasks.")
_TASK_SEED = flags.DEFINE_integer("task_seed", 0, "Seed the tasks were prepared with (its "
                                  "reference leaderboard must exist).")
_EXEC_LIMIT = flags.DEFINE_float("exec_time_limit_s", 0.0, "Per-execution wall-clock limit; "
                                 "0 = the run's sandbox.max_time_limit_s, else the task's own.")
_NO_PROGRESS = flags.DEFINE_bool("no_progress", False, "Disable the progress bar.")
_POD = mirror.define_pod_flags()
flags.adopt_module_key_flags(mirror)   # they show in --help


def _ints(text: str, name: str) -> list:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise app.UsageError(f"--{name} must be comma-separated integers, got {text!r}") from None


def _make_pool(backend: str, workers: int):
    from sandbox.backends import SandboxUnavailableError
    from sandbox.pool import SandboxPool, resolve_preload

    try:  # warm interpreters where the backend has them, as in training
        return SandboxPool(backend, num_workers=workers, preload=resolve_preload("auto", backend))
    except SandboxUnavailableError as e:
        raise app.UsageError(f"sandbox backend {backend!r} is unavailable here ({e}); "
                             "use --backend=process (no isolation beyond rlimits)") from None


def main(argv):
    from ace_jax.train import logs

    logs.configure_logging()
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from ace_jax import config_utils
    from ace_jax.curriculum import buffer
    from ace_jax.env import agent, tasks as tasks_lib
    from ace_jax.eval import harness, reports, run_config
    from ace_jax.policy import interface, policy as policy_lib, runs
    from ace_jax.runtime import storage

    _POD.start()   # the compilation cache and jax.distributed, before any JAX backend
    sampling = dict(max_new_tokens=_MAX_NEW.value, temperature=_TEMP.value,
                    max_prompt_tokens=_MAX_PROMPT.value, multihost="leader")
    import jax

    if jax.process_index() != 0:   # a pod's other hosts: load the same policies, lend the chips
        _follow(sampling)
        return
    try:
        kind, args = policy_lib.parse_policy_spec(_POLICY.value)
        run_cfg = runs.read_run_config(args["workdir"]) if kind == "run" else {}
        agent_cfg = run_config.run_agent_config(args["workdir"]) if kind == "run" \
            else agent.default_config()
        buffer_cfg = run_config.run_buffer_config(args["workdir"]) if kind == "run" \
            else buffer.default_config()
    except (interface.PolicyError, config_utils.ConfigKeyError, config_utils.ConfigError) as e:
        raise app.UsageError(str(e)) from None
    seeds = _ints(_SEEDS.value, "seeds")
    try:
        tasks = run_config.run_tasks([t.strip() for t in _TASKS.value.split(",") if t.strip()],
                                     run_cfg, cache_dir=_CACHE.value, task_seed=_TASK_SEED.value,
                                     exec_time_limit_s=_EXEC_LIMIT.value)
    except tasks_lib.TaskLoadError as e:
        raise app.UsageError(str(e)) from None
    try:
        policy = policy_lib.policy_from_spec(_POLICY.value, **sampling)
        advisor = run_config.advisor_from_spec(_IDEATOR.value, **sampling) \
            if _IDEATOR.value else None
    except (policy_lib.PolicySpecError, harness.EvaluationError) as e:
        raise app.UsageError(str(e)) from None
    # a gs:// --out: written to a local folder, each episode log copied as it ends, the rest
    # uploaded when the evaluation ends
    out = tempfile.mkdtemp(prefix="ace_jax_eval_") if storage.is_url(_OUT.value) else _OUT.value
    on_episode = _episode_uploader(out, _OUT.value) if out != _OUT.value else None
    try:
        pool = _make_pool(_BACKEND.value, _WORKERS.value)
    except BaseException:
        mirror.release_followers()
        raise
    try:
        result = harness.evaluate(
            policy, tasks, pool, seeds=seeds, max_steps=_MAX_STEPS.value,
            time_budget_s=_TIME_BUDGET.value or None, advisor=advisor,
            stagnation_steps=_STAGNATION.value, agent_cfg=agent_cfg, buffer_cfg=buffer_cfg,
            out_dir=out, episode_workers=_WORKERS.value,
            serialize_policy=kind != "openai", progress=not _NO_PROGRESS.value,
            on_episode=on_episode)
    finally:
        pool.close()
        mirror.release_followers()   # a pod's other hosts return from follow()
    result.config.update(policy_spec=_POLICY.value, ideator_spec=_IDEATOR.value or None,
                         backend=_BACKEND.value, task_seed=_TASK_SEED.value)
    paths = reports.write_reports(result, out)
    if out != _OUT.value:
        storage.upload_dir(out, _OUT.value)
        paths = {k: storage.join(_OUT.value, os.path.relpath(v, out)) for k, v in paths.items()}
        shutil.rmtree(out)
    print(reports.format_table(result))
    for name, path in sorted(paths.items()):
        print(f"{name}: {path}")


def _follow(sampling: dict) -> None:
    """A pod host other than process 0: builds the same policies as process 0 (collective
    loads), then replays process 0's engine calls until it has finished."""
    from ace_jax.eval import run_config
    from ace_jax.policy import policy as policy_lib

    policy_lib.policy_from_spec(_POLICY.value, **sampling)
    if _IDEATOR.value:
        run_config.advisor_from_spec(_IDEATOR.value, **sampling)
    calls = mirror.follow()
    logging.info("process 0 has finished: replayed %d engine calls", calls)


def _episode_uploader(local_out: str, url: str):
    """A ``harness.evaluate`` ``on_episode`` copying each finished episode's log from the local
    ``local_out`` to the same place under ``url``; a failed copy is logged (the final upload
    copies every file again)."""
    from ace_jax.runtime import storage

    def upload(episode, log_path):
        try:
            with open(log_path, encoding="utf-8") as f:
                storage.write_text(storage.join(url, os.path.relpath(log_path, local_out)),
                                   f.read())
        except Exception as e:  # noqa: BLE001 - the evaluation goes on; the end retries
            logging.warning("episode log %s not copied to %s yet: %s", log_path, url, e)
    return upload


if __name__ == "__main__":
    flags.mark_flags_as_required(["policy", "out"])
    app.run(main)
