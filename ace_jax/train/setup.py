"""Building a run from its config, before the loop: output folder, tasks, seed solutions,
tokenizer, model and the supervised warm start.

Everything here is checked before any heavy work and fails with a ``SetupError`` that says what
to change. ``ace_jax.train.trainer.Trainer`` calls these in its ``__init__`` / ``run``; the loop
itself lives in ``trainer``.
"""
from __future__ import annotations

import logging
import os
import pathlib
import socket
import tempfile
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import ml_collections
from flax import nnx

from ace_jax.curriculum import buffer as buffer_lib, seeds
from ace_jax.env import tasks as tasks_lib
from ace_jax.runtime import checkpoint as ckpt_lib, multihost, storage
from ace_jax.train import sft
from models import configs as model_configs, qwen3, tokenizer as tok_lib

log = logging.getLogger("ace_jax.train.setup")


class SetupError(RuntimeError):
    """A problem found before any heavy work starts (paths, credentials, tasks, tokenizer)."""


def check_gcs_credentials(path: str) -> None:
    """SetupError unless Google credentials are available for ``path`` (a gs:// URL).

    Skipped against a storage emulator (``STORAGE_EMULATOR_HOST``). Looks for application-default
    credentials (env var, gcloud's file, or the metadata server of a GCE / TPU VM).
    """
    if os.environ.get("STORAGE_EMULATOR_HOST"):
        return
    import google.auth
    import google.auth.exceptions

    try:
        google.auth.default()
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise SetupError(f"{path} needs Google Cloud credentials and none were found: set "
                         "GOOGLE_APPLICATION_CREDENTIALS to a service-account key, run `gcloud "
                         "auth application-default login`, or run on a TPU VM with a service "
                         f"account ({e})") from e


def _probe_name() -> str:
    """A probe file name no other process writes (the hosts of one run probe the same folder)."""
    return f".write_probe.{socket.gethostname()}.{os.getpid()}"


def check_writable(path: str) -> None:
    """Fails early (SetupError) when ``path`` (local or gs://) cannot be written."""
    if path.startswith("gs://"):
        check_gcs_credentials(path)
        try:
            import fsspec

            fs, root = fsspec.core.url_to_fs(path)
            fs.makedirs(root, exist_ok=True)
            probe = root.rstrip("/") + "/" + _probe_name()
            fs.pipe(probe, b"ok")
            fs.rm(probe)
        except FileNotFoundError as e:   # what GCS answers for a bucket that does not exist
            bucket = path[len("gs://"):].split("/", 1)[0]
            raise SetupError(f"cannot write to {path}: the bucket gs://{bucket} does not exist "
                             f"(create it in the TPU's region: gcloud storage buckets create "
                             f"gs://{bucket} --location=REGION) [{e}]") from e
        except Exception as e:  # noqa: BLE001 - reported with the path and the reason
            raise SetupError(f"cannot write to {path}: {type(e).__name__}: {e}") from e
        return
    p = pathlib.Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / _probe_name()
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise SetupError(f"output folder {path!r} is not writable: {e}") from e


def load_tasks(cfg: ml_collections.ConfigDict, ids: Optional[Sequence[str]] = None) -> list:
    """The configured tasks to train on (``ace_jax.env.tasks.load_tasks`` of ``cfg.tasks``), or
    the tasks ``ids`` of the same source (the probe's held-out tasks); SetupError if unusable
    (an unknown id, a missing data_dir, a task without a baseline)."""
    t = cfg.tasks
    try:
        return tasks_lib.load_tasks(tuple(t.ids if ids is None else ids), source=t.source, cache_dir=t.cache_dir,
                                    data_dir=t.get("data_dir", ""), seed=t.seed, training=True)
    except tasks_lib.TaskLoadError as e:
        raise SetupError(str(e)) from e


def load_evaluation_seeds(paths: str, task_by_id: Mapping) -> list[buffer_lib.SeedSolution]:
    """The seed solutions of ``rl.seed_solutions`` (comma-separated ``seed_solutions.jsonl``
    files written by ``launch/evaluate.py``) for this run's tasks; those of other tasks are
    skipped. Raises SetupError for an unreadable or malformed file, and when the files hold
    solutions but none for this run's tasks (most likely the wrong file)."""
    out, skipped = [], set()
    for path in [p.strip() for p in (paths or "").split(",") if p.strip()]:
        try:
            sols = seeds.read_seed_solutions(path)
        except seeds.SeedFileError as e:
            raise SetupError(f"rl.seed_solutions: {e}") from None
        out += [s for s in sols if s.task_id in task_by_id]
        skipped |= {s.task_id for s in sols if s.task_id not in task_by_id}
    if skipped and not out:
        raise SetupError(f"rl.seed_solutions ({paths}) holds solutions only for tasks this run "
                         f"does not train on: {sorted(skipped)}; its tasks: {sorted(task_by_id)}")
    if skipped:
        log.info("rl.seed_solutions: skipped the solutions of tasks not in this run: %s",
                 sorted(skipped))
    return out


def build_model_config(cfg: ml_collections.ConfigDict, vocab_size: int | None):
    overrides = dict(cfg.model.overrides)
    if vocab_size is not None:
        overrides["vocab_size"] = vocab_size
    return model_configs.get_model_config(cfg.model.preset, **overrides)


def load_tokenizer(cfg: ml_collections.ConfigDict, workdir: str, tasks: Sequence[Any],
                   extra_texts=lambda: ()):
    """The run's tokenizer: ``model.tokenizer_path`` (local or gs://), else the one of
    ``model.init_from_run``, else a byte-level BPE trained (once, by process 0) on the tasks'
    prompts, their seed scripts and ``extra_texts()`` into ``<workdir>/tokenizer`` (local or
    gs://). A gs:// tokenizer is read from a local copy (``runtime.storage.local_copy``) of
    its tokenizer files alone (``models.tokenizer.TOKENIZER_FILES``): ``model.tokenizer_path``
    may be an HF model folder, whose weights are not downloaded."""
    path = cfg.model.get("tokenizer_path", "") or ""
    init_run = cfg.model.get("init_from_run", "") or ""
    if not path and init_run:
        path = storage.join(init_run, "tokenizer")
    if path:
        return tok_lib.load_tokenizer(storage.local_copy(path, files=tok_lib.TOKENIZER_FILES))
    path = storage.join(workdir, "tokenizer")
    if jax.process_index() == 0 and not storage.exists(storage.join(path, "tokenizer.json")):
        from sandbox import seed_corpus

        corpus = [s for t in tasks for s in seed_corpus.list_scripts(t.task_id)]
        with tempfile.TemporaryDirectory() as tmp:
            local = path if not storage.is_url(path) else tmp
            sft.build_tokenizer(tasks, corpus, cfg.sft.vocab_size, local, agent_cfg=cfg.agent,
                                extra_texts=list(extra_texts()))
            if local != path:
                storage.upload_dir(local, path)
    multihost.barrier("tokenizer")   # the others read what process 0 wrote
    return tok_lib.load_tokenizer(storage.local_copy(path, files=tok_lib.TOKENIZER_FILES))


def build_model(cfg: ml_collections.ConfigDict, tokenizer, placement):
    """The policy, placed by ``placement``: ``model.init_from_run``'s newest checkpoint, an HF
    checkpoint (``model.hf_path``) or a seeded init of ``model.preset``."""
    if cfg.model.get("init_from_run", ""):
        from ace_jax.policy import interface, runs

        try:
            # straight into the placement's shardings: each host reads only its slices
            model, _, step = runs.load_run_model(cfg.model.init_from_run,
                                                 shardings=placement.params)
        except (interface.PolicyError, ckpt_lib.CheckpointError) as e:
            raise SetupError(f"model.init_from_run={cfg.model.init_from_run!r}: {e}") from e
        log.info("initial weights: %s step %d (no warm start)", cfg.model.init_from_run, step)
        placement.place_params(model)
        return model
    if cfg.model.hf_path:
        from models import hf_mapping

        # each host reads only the slices of the safetensors that its devices hold
        model = hf_mapping.load_hf_model(cfg.model.hf_path, shardings=placement.params,
                                         **dict(cfg.model.runtime))
    else:
        model_cfg = build_model_config(cfg, len(tokenizer))
        model = placement.init_model(
            lambda: qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(cfg.seed)))
    if len(tokenizer) > model.config.vocab_size:
        raise SetupError(f"the tokenizer has {len(tokenizer)} tokens but the model's "
                         f"vocab_size is {model.config.vocab_size}: they do not belong together")
    return model


def warm_start(cfg: ml_collections.ConfigDict, model, tokenizer,
               examples: Callable[[], Sequence[Any]], placement, *, progress: bool = True
               ) -> tuple[Any, dict]:
    """The supervised warm start (``sft.train_sft`` on ``examples()``) under ``placement``;
    returns (model, its info without the per-step losses). A no-op ((model, {})) when
    ``sft.enabled`` is off or the weights come from another run (``model.init_from_run``)."""
    if not cfg.sft.enabled or cfg.model.get("init_from_run", ""):
        return model, {}
    examples = examples()
    with placement.context():   # e.g. splash attention runs under shard_map on TPU
        model, info = sft.train_sft(model, tokenizer, examples, cfg.sft, progress=progress)
    placement.place_params(model)
    log.info("warm start: %d steps in %.0f s, loss %.3f -> %.3f", info["steps"],
             info["seconds"], info["first_loss"], info["final_loss"])
    return model, {k: v for k, v in info.items() if k != "losses"}
