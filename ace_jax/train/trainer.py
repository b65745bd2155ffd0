"""The AceGRPO loop: LP sampler -> prompts -> grouped generation -> sandbox -> rewards -> GRPO
update -> buffer children -> metrics, checkpoint and buffer commit.

One RL step t (see DESIGN.md):

  select B states (LP sampler) -> render prompts -> G completions each (behaviour log-probs)
  -> parse actions -> B*G sandbox executions (graded on the hidden dev split) -> rewards
  -> GRPO learner step -> every execution becomes a child state -> metrics / persistence

Asynchronous mode (``rl.async_rollouts``, the default): the executions of step t run in the
sandbox pool while the trainer generates step t+1 and learns on step t-1, so the rollouts the
learner trains on are at most ``rl.max_staleness`` (= 1) policy versions old; the clipped ratio
uses the behaviour log-probs recorded at generation, so this stays correct off-policy.
``async_rollouts=False`` waits for each step's executions before generating the next.

Persistence and exact resume. At the end of every iteration the trainer saves, in this order,
(1) an Orbax checkpoint (params, optimizer state, RNG, and as JSON the sampler state plus the
rollouts still in flight) and (2) a buffer commit tagged with the same step. On restart it takes
the newest step present in both (the checkpoint manager keeps the previous step), restores the
metrics file to that step, and re-submits the in-flight rollouts: no state is lost or stored twice
and the RNG stream continues where it was.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import sys
import time
from typing import Any, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

from ace_jax.curriculum import buffer as buffer_lib, buffer_store, learnability, seeds
from ace_jax.env import agent, rewards
from ace_jax.rl import grpo, learner as learner_lib, rollout_batch
from ace_jax.runtime import (checkpoint as ckpt_lib, generate, multihost,
                             placement as placement_lib, sharding)
from ace_jax.train import metrics as metrics_lib, sft
from models import configs as model_configs, qwen3, tokenizer as tok_lib
from sandbox.pool import SandboxPool
from sandbox.result import ExecutionResult, Status
from sandbox.tasks import registry

log = logging.getLogger("ace_jax.train.trainer")


class SetupError(RuntimeError):
    """A problem found before any heavy work starts (paths, credentials, tasks, tokenizer)."""


@dataclasses.dataclass
class Rollout:
    """One completion of one state and, once executed, its outcome.

    Attributes:
      state_id / task_id: where it started.
      prompt: prompt token ids; completion: completion token ids (length = its true length).
      logprobs: behaviour log-probs of the completion tokens (float, same length).
      text: decoded completion; action: ``agent.Action`` or ``agent.InvalidAction``.
      result: the sandbox's ExecutionResult (None for an invalid format).
      reward: from the reward registry.
      policy_version: learner step of the params that generated it.
    """

    state_id: int
    task_id: str
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]
    text: str
    policy_version: int
    action: Any = None
    result: Optional[ExecutionResult] = None
    reward: float = 0.0

    def to_json(self) -> dict:
        return dict(state_id=self.state_id, task_id=self.task_id, prompt=self.prompt,
                    completion=self.completion, logprobs=self.logprobs, text=self.text,
                    policy_version=self.policy_version)


@dataclasses.dataclass
class PendingStep:
    """The rollouts of one RL step whose executions may still be running."""

    step: int
    rollouts: list[Rollout]
    futures: list[Any]
    gen_seconds: float
    gen_tokens: int
    truncated: int = 0   # prompts cut to rl.max_prompt_tokens


# --------------------------------------------------------------------------------------- setup

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


def check_writable(path: str) -> None:
    """Fails early (SetupError) when ``path`` (local or gs://) cannot be written."""
    if path.startswith("gs://"):
        check_gcs_credentials(path)
        try:
            import fsspec

            fs, root = fsspec.core.url_to_fs(path)
            fs.makedirs(root, exist_ok=True)
            probe = root.rstrip("/") + "/.write_probe"
            fs.pipe(probe, b"ok")
            fs.rm(probe)
        except Exception as e:  # noqa: BLE001 - reported with the path and the reason
            raise SetupError(f"cannot write to {path}: {type(e).__name__}: {e}") from e
        return
    p = pathlib.Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / ".write_probe"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise SetupError(f"output folder {path!r} is not writable: {e}") from e


def load_tasks(cfg: ml_collections.ConfigDict) -> list:
    """The configured tasks (SetupError if unusable).

    A task without a reference leaderboard trains with the fallback of ``buffer.TaskTargets``
    (headroom 1, rewards relative to its baseline); its medals and HumanRank are not reported.
    A task whose sample submission does not grade has no baseline: SetupError (says why).
    """
    if cfg.tasks.source == "offline":
        ids = list(cfg.tasks.ids) or registry.list_tasks()
        unknown = sorted(set(ids) - set(registry.list_tasks()))
        if unknown:
            raise SetupError(f"unknown task ids {unknown}; available: {registry.list_tasks()}")
        tasks = registry.load_suite(cfg.tasks.cache_dir, cfg.tasks.seed, ids)
    elif cfg.tasks.source == "mlebench":
        from sandbox.tasks import mlebench

        data_dir = cfg.tasks.data_dir
        if not data_dir or not os.path.isdir(data_dir):
            raise SetupError(f"tasks.data_dir={data_dir!r} is not a directory of prepared "
                             "MLE-bench competitions")
        ids = list(cfg.tasks.ids) or sorted(os.listdir(data_dir))
        try:
            tasks = [mlebench.load_mlebench_task(i, data_dir, seed=cfg.tasks.seed) for i in ids]
        except (FileNotFoundError, mlebench.UnsupportedGraderError,
                mlebench.LeaderboardError) as e:
            raise SetupError(f"cannot load an MLE-bench task: {e}") from e
    else:
        raise SetupError(f"tasks.source={cfg.tasks.source!r}; valid: offline, mlebench")
    for t in tasks:
        if t.baseline_score is None:
            why = getattr(t, "baseline_error", "") or "it has no baseline score"
            raise SetupError(f"task {t.task_id}: {why} (the baseline anchors the rewards)")
        if not t.leaderboard:
            log.warning("task %s has no reference leaderboard: headroom 1 and rewards relative "
                        "to its baseline %.6g; medals and HumanRank n/a", t.task_id,
                        t.baseline_score)
    return tasks


def task_targets(task) -> buffer_lib.TaskTargets:
    """Score anchors of ``task`` (``rewards.task_targets``; gold / median None without a
    reference leaderboard)."""
    return rewards.task_targets(task)


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


# --------------------------------------------------------------------------------------- trainer

class Trainer:
    """Wires the parts of one AceGRPO run from a config (``configs/*.py``) and runs it.

    Everything that can be wrong with the setup (paths, tasks, tokenizer / model mismatch, reward
    name, GRPO mode) is checked in ``__init__``, before any heavy work.
    """

    def __init__(self, cfg: ml_collections.ConfigDict, *, progress: bool = True):
        self.cfg = cfg
        self.workdir = cfg.workdir
        check_writable(self.workdir)
        grpo.validate_config(cfg.grpo)
        rewards.get_reward(cfg.rl.reward)  # unknown name -> error listing the valid ones
        if cfg.rl.batch_states < 1 or cfg.rl.group_size < 2:
            raise SetupError(f"rl.batch_states must be >= 1 and rl.group_size >= 2 (GRPO compares "
                             f"within a group), got {cfg.rl.batch_states}, {cfg.rl.group_size}")
        self.tasks = load_tasks(cfg)
        self.task_by_id = {t.task_id: t for t in self.tasks}
        self.targets = {t.task_id: task_targets(t) for t in self.tasks}
        self.evaluation_seeds = load_evaluation_seeds(cfg.rl.seed_solutions,
                                                      self.task_by_id)
        self.tokenizer = self._load_tokenizer()
        try:  # one mesh over every process's devices, one Placement for every sharding
            self.placement = placement_lib.Placement.from_config(cfg.mesh)
        except (sharding.MeshConfigError, ValueError) as e:
            raise SetupError(f"mesh: {e} (jax sees {jax.device_count()} devices in "
                             f"{jax.process_count()} processes)") from e
        self.model = self._build_model()
        self.eos_ids = tuple(self.tokenizer.convert_tokens_to_ids([tok_lib.IM_END,
                                                                   tok_lib.ENDOFTEXT]))
        self.pad_id = int(self.tokenizer.convert_tokens_to_ids(tok_lib.ENDOFTEXT))
        self.sampling = generate.SamplingConfig(
            max_new_tokens=cfg.sampling.max_new_tokens, group_size=cfg.rl.group_size,
            temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k,
            top_p=cfg.sampling.top_p, eos_ids=self.eos_ids, pad_id=self.pad_id,
            prompt_bucket=cfg.sampling.prompt_bucket)
        if cfg.sampling.temperature > 0 and cfg.optim.temperature != cfg.sampling.temperature:
            raise SetupError(f"optim.temperature ({cfg.optim.temperature}) must equal "
                             f"sampling.temperature ({cfg.sampling.temperature}): the learner "
                             "recomputes the sampler's log-probs")
        ctx = cfg.rl.max_prompt_tokens + cfg.sampling.max_new_tokens
        if ctx > self.model.config.max_position_embeddings:
            raise SetupError(f"rl.max_prompt_tokens + sampling.max_new_tokens = {ctx} exceeds the "
                             f"model's max_position_embeddings "
                             f"({self.model.config.max_position_embeddings})")
        # Checkpoint and buffer commit are written synchronously, one after the other, so that
        # a crash between them is detectable (see the module docstring).
        self.checkpointer = ckpt_lib.Checkpointer(
            cfg.checkpoint.directory or os.path.join(self.workdir, "checkpoints"),
            keep=max(2, cfg.checkpoint.keep), save_interval_steps=1, async_save=False)
        self.buffer = buffer_lib.EvolvingBuffer(cfg.buffer, list(self.targets.values()))
        self.store = buffer_store.BufferStore(cfg.buffer.store.url or
                                              os.path.join(self.workdir, "buffer"),
                                              cfg.buffer.store)
        self.sampler = learnability.Sampler.from_config(cfg.lp)
        # One writer for the whole job: every host computes the same metrics, host 0 writes them.
        self.is_writer = jax.process_index() == 0
        self.metrics = metrics_lib.MetricWriter(
            self.workdir, progress_total=cfg.rl.num_steps, progress=progress,
            tensorboard=self.is_writer, jsonl=self.is_writer)
        self.progress = progress
        self.pool: Optional[SandboxPool] = None
        self.learner: Optional[learner_lib.Learner] = None
        self.generator: Optional[generate.Generator] = None
        self.next_step = 0                  # the next RL step to generate
        self.iteration = 0                  # loop iterations done (checkpoint / commit tag)
        self.rng = self.placement.replicate(jax.random.key(cfg.seed))
        self.pending: Optional[PendingStep] = None
        self.best_scores: dict[str, Optional[float]] = {t: None for t in self.task_by_id}

    # ------------------------------------------------------------------ building blocks

    def _seed_buffer(self) -> None:
        """The states a fresh run starts from: an empty draft per task, the seed corpus's
        reference solutions (``rl.seed_with_references``) and the valid attempts of earlier
        evaluations (``rl.seed_solutions``, origin "evaluation")."""
        cfg = self.cfg
        self.buffer.seed(seeds.reference_solutions(self.tasks, cfg.tasks.seed)
                         if cfg.rl.seed_with_references else ())
        seeds.add_seed_states(self.buffer, self.evaluation_seeds)

    def _load_tokenizer(self):
        path = self.cfg.model.get("tokenizer_path", "") or ""
        init_run = self.cfg.model.get("init_from_run", "") or ""
        if not path and init_run:
            path = os.path.join(init_run, "tokenizer")
        if path:
            if "://" in path:  # gs://...: copy the few small files next to the run
                import fsspec

                local = os.path.join(self.workdir, "tokenizer_cache")
                fs, root = fsspec.core.url_to_fs(path)
                fs.get(root.rstrip("/") + "/", local, recursive=True)
                path = local
            return tok_lib.load_tokenizer(path)
        local = os.path.join(self.workdir, "tokenizer")
        if jax.process_index() == 0 and not os.path.exists(os.path.join(local, "tokenizer.json")):
            from sandbox import seed_corpus

            corpus = [s for t in self.tasks for s in seed_corpus.list_scripts(t.task_id)]
            sft.build_tokenizer(self.tasks, corpus, self.cfg.sft.vocab_size, local,
                                agent_cfg=self.cfg.agent)
        multihost.barrier("tokenizer")   # the others read what process 0 wrote
        return tok_lib.load_tokenizer(local)

    def _build_model(self):
        cfg = self.cfg
        if cfg.model.get("init_from_run", ""):
            from ace_jax.policy import policy

            try:
                model, _, step = policy.load_run_model(cfg.model.init_from_run)
            except (policy.PolicyError, ckpt_lib.CheckpointError) as e:
                raise SetupError(f"model.init_from_run={cfg.model.init_from_run!r}: {e}") from e
            log.info("initial weights: %s step %d (no warm start)", cfg.model.init_from_run, step)
            self.placement.place_params(model)
            return model
        if cfg.model.hf_path:
            from models import hf_mapping

            # each host reads only the slices of the safetensors that its devices hold
            model = hf_mapping.load_hf_model(cfg.model.hf_path, shardings=self.placement.params,
                                             **dict(cfg.model.runtime))
        else:
            model_cfg = build_model_config(cfg, len(self.tokenizer))
            model = self.placement.init_model(
                lambda: qwen3.Qwen3ForCausalLM(model_cfg, rngs=nnx.Rngs(cfg.seed)))
        if len(self.tokenizer) > model.config.vocab_size:
            raise SetupError(f"the tokenizer has {len(self.tokenizer)} tokens but the model's "
                             f"vocab_size is {model.config.vocab_size}: they do not belong together")
        return model

    # ------------------------------------------------------------------ resume / warm start

    def _restore(self) -> bool:
        """Restores checkpoint + buffer of the newest step present in both; False if none."""
        target = self._train_state()
        steps = self.checkpointer.all_steps()
        if not steps:
            return False
        info = self.store.restore(self.buffer)
        buf_step = None if info is None else info.step
        usable = [s for s in steps if buf_step is None or s <= buf_step]
        if buf_step is None or not usable:
            raise SetupError(f"checkpoints exist at steps {steps} but the buffer store has "
                             f"{'no commit' if buf_step is None else f'step {buf_step}'}: "
                             "the run directory is inconsistent")
        step = max(usable)
        if step != buf_step:
            raise SetupError(f"the buffer store is at step {buf_step} but the newest usable "
                             f"checkpoint is step {step}; restore the buffer of that step")
        dropped = self.checkpointer.delete_after(step)  # saved, but its buffer commit never landed
        if dropped:
            log.warning("dropped checkpoints %s: their buffer commits were not written", dropped)
        state = self.checkpointer.restore(step, target)
        self._install(state)
        if info.sampler_state:
            self.sampler.load_state_dict(info.sampler_state)
        # Metrics lines exist for the RL steps already learned on; later lines are dropped.
        finished = self.next_step - 1 - (self.pending is not None)
        self.metrics.resume(finished)
        log.info("resumed at step %d (buffer commit %d, %d states)", step, info.seq,
                 len(self.buffer))
        return True

    def _install(self, state: ckpt_lib.TrainState) -> None:
        meta = state.sampler_state or {}
        self.learner.state = learner_lib.LearnerState(
            state.params, state.opt_state, jnp.asarray(meta.get("learner_step", 0), jnp.int32))
        self.generator.update_weights(self.learner.params)
        self.rng = state.rng
        self.iteration = int(state.step)
        self.next_step = int(meta.get("next_step", 0))
        self.best_scores.update(meta.get("best_scores", {}))
        pending = meta.get("pending")
        if pending:
            self.pending = self._submit(int(pending["step"]),
                                        [Rollout(**r) for r in pending["rollouts"]], 0.0, 0)

    def _train_state(self) -> ckpt_lib.TrainState:
        p = self.pending
        meta = {"learner_step": int(self.learner.state.step), "next_step": self.next_step,
                "best_scores": self.best_scores,
                "pending": None if p is None else
                {"step": p.step, "rollouts": [r.to_json() for r in p.rollouts]}}
        return ckpt_lib.TrainState(step=self.iteration, params=self.learner.params,
                                   opt_state=self.learner.state.opt_state, rng=self.rng,
                                   sampler_state=meta)

    def _persist(self) -> None:
        """Checkpoint first, then the buffer commit, both tagged with the loop iteration."""
        self.checkpointer.save(self._train_state(), force=True)   # every process: its shards
        self.checkpointer.wait_until_finished()
        if self.is_writer:   # the buffer is identical on every process: one writer
            self.store.commit(self.buffer, self.iteration, self.sampler.state_dict())

    def _warm_start(self) -> dict:
        """Supervised warm start on the seed corpus (only when no checkpoint exists and the
        weights do not come from another run's checkpoint)."""
        if not self.cfg.sft.enabled or self.cfg.model.get("init_from_run", ""):
            return {}
        examples = self._sft_examples()
        with self.placement.context():   # e.g. splash attention runs under shard_map on TPU
            model, info = sft.train_sft(self.model, self.tokenizer, examples, self.cfg.sft,
                                        progress=self.progress)
        self.placement.place_params(model)
        self.model = model
        log.info("warm start: %d steps in %.0f s, loss %.3f -> %.3f", info["steps"],
                 info["seconds"], info["first_loss"], info["final_loss"])
        return {k: v for k, v in info.items() if k != "losses"}

    def _sft_examples(self) -> list:
        """The warm start's (prompt, completion) examples (a hook: subclasses add their own)."""
        return sft.build_sft_examples(self.tasks, self.cfg.sft, self.cfg.agent)

    # ------------------------------------------------------------------ one RL step

    def _select(self, step: int) -> list[buffer_lib.State]:
        slots = self.sampler.select(self.buffer.stats, step, self.cfg.rl.batch_states,
                                    data_parallel_size=1)
        ids = self.buffer.ids_for_slots(slots)
        self.buffer.mark_sampled(ids, step)
        return [self.buffer.get(i) for i in ids]

    def _prompt_text(self, state) -> str:
        """The policy's prompt for ``state`` (a hook: the ideator trainer renders its own)."""
        return agent.render_prompt(state, self.task_by_id[state.task_id], self.cfg.agent)

    def _prompt_tokens(self, state) -> tuple[list[int], bool]:
        text = self._prompt_text(state)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        limit = self.cfg.rl.max_prompt_tokens
        return (ids[-limit:], True) if len(ids) > limit else (ids, False)

    def _generate(self, step: int) -> PendingStep:
        states = self._select(step)
        prompts, truncated = zip(*(self._prompt_tokens(s) for s in states))
        self.rng, key = jax.random.split(self.rng)
        t0 = time.perf_counter()
        out = self.generator.generate(list(prompts), key)
        tokens, logprobs, lengths = (multihost.host_value(out.tokens),
                                     multihost.host_value(out.logprobs),
                                     multihost.host_value(out.lengths))
        gen_s = time.perf_counter() - t0
        g = self.cfg.rl.group_size
        version = int(self.learner.state.step)
        rollouts = []
        for i in range(tokens.shape[0]):
            st = states[i // g]
            comp = tokens[i, :lengths[i]].tolist()
            rollouts.append(Rollout(
                state_id=st.state_id, task_id=st.task_id, prompt=list(prompts[i // g]),
                completion=comp, logprobs=logprobs[i, :lengths[i]].astype(float).tolist(),
                text=self.tokenizer.decode(comp, skip_special_tokens=False),
                policy_version=version))
        pending = self._submit(step, rollouts, gen_s, int(lengths.sum()))
        pending.truncated = int(sum(truncated))
        return pending

    def _submit(self, step: int, rollouts: list[Rollout], gen_s: float, gen_tokens: int
                ) -> PendingStep:
        """Parses every completion and sends the valid actions of this process's share
        (`multihost.my_share`; all of them on one host) to its sandbox pool."""
        mine = multihost.my_share(len(rollouts))
        futures = []
        for i, r in enumerate(rollouts):
            r.action = agent.parse_action(r.text, max_code_chars=self.cfg.agent.max_code_chars)
            futures.append(self.pool.submit(self.task_by_id[r.task_id], r.action.code)
                           if r.action.valid and i in mine else None)
        return PendingStep(step, rollouts, futures, gen_s, gen_tokens)

    def _wait_results(self, p: PendingStep) -> None:
        """Sets every rollout's result: this process's executions, then (multi-host) everyone's,
        gathered so that every process holds the same results."""
        mine = multihost.my_share(len(p.rollouts))
        own = [None if p.futures[i] is None else p.futures[i].result().to_dict() for i in mine]
        if multihost.is_multi_process():
            log.info("process %d of %d ran %d of the %d executions of step %d",
                     jax.process_index(), jax.process_count(), len(own) - own.count(None),
                     len(p.rollouts), p.step)
        for r, d in zip(p.rollouts, multihost.allgather_json(own)):
            r.result = None if d is None else ExecutionResult.from_dict(d)

    def _finish(self, p: PendingStep) -> dict[str, float]:
        """Waits for the executions of ``p``, rewards them, learns, grows the buffer, logs."""
        t0 = time.perf_counter()
        self._wait_results(p)
        wait_s = time.perf_counter() - t0
        reward_fn = rewards.get_reward(self.cfg.rl.reward)
        for r in p.rollouts:
            parent = self.buffer.get(r.state_id)
            r.reward = reward_fn(action=r.action, result=r.result, current_score=parent.score,
                                 targets=self.targets[r.task_id], cfg=self.cfg.rewards)
        t1 = time.perf_counter()
        learn = self.learner.step(self._train_batch(p))
        learn = {k: float(v) for k, v in jax.device_get(learn).items()}
        self.generator.update_weights(self.learner.params)
        learn_s = time.perf_counter() - t1
        self._grow_buffer(p)
        self._log_rollouts(p)
        return self._step_metrics(p, learn, wait_s, learn_s)

    def _log_rollouts(self, p: PendingStep) -> None:
        """Writes ``<workdir>/rollouts/<step>.jsonl``: every completion of the step with its
        state, parsed action, status, dev score and reward (rewritten identically on resume)."""
        if not self.is_writer:
            return
        d = pathlib.Path(self.workdir) / "rollouts"
        d.mkdir(exist_ok=True)
        rows = [json.dumps(self._rollout_record(p.step, r)) for r in p.rollouts]
        tmp = d / f"{p.step:06d}.jsonl.tmp"
        tmp.write_text("\n".join(rows) + "\n")
        os.replace(tmp, d / f"{p.step:06d}.jsonl")

    def _rollout_record(self, step: int, r: Rollout) -> dict:
        """One line of ``<workdir>/rollouts/<step>.jsonl`` (a hook: subclasses add fields)."""
        res = r.result
        return dict(
            step=step, state_id=r.state_id, task_id=r.task_id, text=r.text,
            valid_format=r.action.valid,
            invalid_reason=None if r.action.valid else r.action.reason.value,
            status=None if res is None else res.status.value,
            dev_score=None if res is None else res.dev_score,
            stderr_tail=None if res is None else res.stderr[-300:],
            reward=r.reward, policy_version=r.policy_version)

    def _train_batch(self, p: PendingStep) -> rollout_batch.TrainBatch:
        g = self.cfg.rl.group_size
        m = self.cfg.sampling.max_new_tokens
        n = len(p.rollouts)
        tokens = np.full((n, m), self.pad_id, np.int32)
        logprobs = np.zeros((n, m), np.float32)
        lengths = np.zeros((n,), np.int32)
        for i, r in enumerate(p.rollouts):
            tokens[i, :len(r.completion)] = r.completion
            logprobs[i, :len(r.completion)] = r.logprobs
            lengths[i] = len(r.completion)
        gen = generate.GenerationResult(tokens, logprobs, lengths, np.zeros((n,), np.int32),
                                        np.repeat(np.arange(n // g), g).astype(np.int32))
        prompts = [p.rollouts[b * g].prompt for b in range(n // g)]
        rew = np.asarray([r.reward for r in p.rollouts], np.float32)
        return rollout_batch.make_train_batch(prompts, gen, rew,
                                              prompt_bucket=self.cfg.sampling.prompt_bucket,
                                              pad_id=self.pad_id)

    def _grow_buffer(self, p: PendingStep) -> None:
        """Every execution becomes a child state; invalid-format completions count only in the
        parent's group statistics (they have no code to start from)."""
        g = self.cfg.rl.group_size
        for b in range(len(p.rollouts) // g):
            group = p.rollouts[b * g:(b + 1) * g]
            parent = self.buffer.get(group[0].state_id)
            children = [buffer_lib.Child(code=r.action.code, result=r.result, reward=r.reward,
                                         action=agent.step_kind(parent))
                        for r in group if r.result is not None]
            extra = [r.reward for r in group if r.result is None]
            self.buffer.add_children(parent.state_id, children, p.step + 1,
                                     extra_rewards=extra)
            for r in group:
                if r.result is not None and r.result.status is Status.OK:
                    tgt = self.targets[r.task_id]
                    self.best_scores[r.task_id] = tgt.better(self.best_scores[r.task_id],
                                                             r.result.dev_score)

    def _step_metrics(self, p: PendingStep, learn: dict, wait_s: float, learn_s: float) -> dict:
        rs = p.rollouts
        n = len(rs)
        rew = np.asarray([r.reward for r in rs])
        valid = [r for r in rs if r.result is not None and r.result.status is Status.OK]
        norm = [rewards.normalised_score(r.result.dev_score, self.targets[r.task_id],
                                         clip_low=self.cfg.rewards.norm_clip_low,
                                         clip_high=self.cfg.rewards.norm_clip_high) for r in valid]
        m = {
            "reward/mean": rew.mean(), "reward/std": rew.std(),
            "rollout/valid_rate": len(valid) / n,
            **root_child_metrics([self.buffer.get(r.state_id).depth == 0 for r in rs],
                                 [r.result is not None and r.result.status is Status.OK
                                  for r in rs]),
            "rollout/format_valid_rate": sum(r.action.valid for r in rs) / n,
            "score/dev_norm_mean": float(np.mean(norm)) if norm else 0.0,
            # Failures count as the baseline (0): improves with validity AND quality.
            "score/dev_norm_all": float(np.sum(norm)) / n,
            "rollout/completion_tokens_mean": float(np.mean([len(r.completion) for r in rs])),
            "rollout/prompt_truncated": float(p.truncated),
            "perf/gen_tokens_per_s": p.gen_tokens / max(p.gen_seconds, 1e-9),
            "perf/gen_seconds": p.gen_seconds, "perf/sandbox_wait_seconds": wait_s,
            "perf/learn_seconds": learn_s,
            "perf/learn_tokens_per_s": learn.get("tokens", 0.0) / max(learn_s, 1e-9),
            "perf/sandbox_utilization": self.pool.utilization(),
            "perf/staleness": float(int(self.learner.state.step) - 1 - rs[0].policy_version),
            "buffer/size": len(self.buffer),
        }
        for status in Status:
            m[f"rollout/status/{status.value}"] = sum(
                r.result is not None and r.result.status is status for r in rs) / n
        m["rollout/status/invalid_format"] = sum(not r.action.valid for r in rs) / n
        m.update({f"grpo/{k}": v for k, v in learn.items()})
        m["grpo/zero_var_frac"] = learn.get("frac_zero_variance_groups", 0.0)
        temp, rho = learnability.schedule(p.step, self.sampler.spec)
        m["lp/temperature"], m["lp/rho"] = float(temp), float(rho)
        lp = np.asarray(learnability.potential(learnability.lp_inputs(self.buffer.stats),
                                               self.sampler.spec))
        live = np.asarray(self.buffer.stats.valid)
        m["lp/mean"] = float(lp[live].mean()) if live.any() else 0.0
        m["lp/max"] = float(lp[live].max()) if live.any() else 0.0
        for task_id, best in self.best_scores.items():
            if best is None:
                continue
            task = self.task_by_id[task_id]
            m[metrics_lib.task_scalar(task_id, "best_dev_score")] = best
            if task.has_leaderboard:
                m[metrics_lib.task_scalar(task_id, "medal")] = medal_level(task.medal(best))
        return m

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        """Warm start (if no checkpoint), then RL until ``rl.num_steps``; returns a summary."""
        cfg = self.cfg
        t_start = time.perf_counter()
        self.pool = SandboxPool.from_config(cfg.sandbox)
        self.learner = self._make_learner()
        self.generator = generate.Generator(self.model, self.sampling, placement=self.placement)
        warm = {}
        if not self._restore():
            warm = self._warm_start()
            self.learner = self._make_learner()
            self.generator.update_weights(self.learner.params)
            self._seed_buffer()
            self.metrics.write_config(cfg)
            self._persist()
        if self.is_writer:   # the GRPO mode, on the terminal at every start
            print(grpo.describe(cfg.grpo), file=sys.stderr, flush=True)
        last: dict = {}
        while self.next_step < cfg.rl.num_steps or self.pending is not None:
            step = self.next_step
            t0 = time.perf_counter()
            new = self._generate(step) if step < cfg.rl.num_steps else None
            if cfg.rl.async_rollouts:
                done, self.pending = self.pending, new
            else:
                done = new
            if done is not None:
                last = self._finish(done)
                last["perf/step_seconds"] = time.perf_counter() - t0
                self.metrics.write(done.step, last)
            if new is not None:
                self.next_step = step + 1
            self.iteration += 1
            self._persist()
        return {"steps": cfg.rl.num_steps, "minutes": (time.perf_counter() - t_start) / 60,
                "warm_start": warm, "last": last}

    def _make_learner(self) -> learner_lib.Learner:
        return learner_lib.Learner.create(self.model, self.cfg.grpo, self.cfg.optim,
                                          group_size=self.cfg.rl.group_size,
                                          placement=self.placement)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        self.checkpointer.close()
        self.metrics.close()


def root_child_metrics(is_root: Sequence[bool], valid: Sequence[bool]) -> dict[str, float]:
    """Where a batch was drawn from and how the policy did there, from one flag pair per rollout:
    ``rollout/root_frac`` (share of rollouts on root states: the buffer's initial drafts and
    seeds) and ``rollout/valid_rate_root`` / ``rollout/valid_rate_child`` (each only when the
    batch has such rollouts). The aggregate valid rate moves with this mix as the buffer fills
    with children, so these separate a better policy from a harder batch."""
    m = {"rollout/root_frac": sum(is_root) / len(is_root)}
    for name, want in (("root", True), ("child", False)):
        hits = [v for v, root in zip(valid, is_root) if bool(root) is want]
        if hits:
            m[f"rollout/valid_rate_{name}"] = sum(hits) / len(hits)
    return m


def medal_level(report) -> int:
    """3 gold, 2 silver, 1 bronze, 0 none, from a ``sandbox.grading.MedalReport``."""
    return 3 if report.gold else 2 if report.silver else 1 if report.bronze else 0
