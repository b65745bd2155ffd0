"""The AceGRPO loop: LP sampler -> prompts -> grouped generation -> sandbox -> rewards -> GRPO
update -> buffer children -> metrics, checkpoint and buffer commit.

Building a run (output folder, tasks, tokenizer, model, warm start) is ``ace_jax.train.setup``;
this module is the loop. What completions mean (prompts, execution, extra logs and metrics) is
the environment's (``ace_jax.env.environment``: the code agent by default, the MLE-Ideator's
ideator -> frozen implementer with ``mode = "ideator"``). One iteration is ``Trainer.step()``,
which reads top to bottom:

  1. select B states (LP sampler)         4. execute: parse the actions, submit them to the sandbox
  2. render their prompts                 -- the step is now IN FLIGHT --
  3. generate G completions each          5. reward the oldest step in flight once it may be
     (behaviour log-probs recorded)          learned on (with ``rl.dynamic_sampling_rounds``,
                                             a refill of groups without signal), 6. GRPO
                                             update, 7. every execution becomes a child
                                             state, 8. persist

Bounded staleness (``rl.max_staleness`` = k; k = 0: synchronous): the
executions of up to k steps stay in flight while the learner updates on an older one, so every
batch is learned on by a policy at most k updates newer than the one that generated it. The
objective sees the lag through the behaviour log-probs recorded at generation: by default
(``grpo.proximal="behaviour"``) the clip is taken against them, so the clip absorbs lag and
sampler-vs-learner mismatch together; ``grpo.proximal="learner"`` is decoupled PPO with a
bounded behaviour weight (``docs/offpolicy.md``). ``offpolicy/*`` metrics measure both.
k = 0 is fully synchronous (generate, execute and learn on the same step); k = 1, the default,
overlaps the sandbox runs of step t with generating step t+1 and learning on step t-1.

Persistence and exact resume. After an iteration ``i`` that is a multiple of
``checkpoint.save_interval_steps`` (and after the last one) the trainer saves (1) an Orbax
checkpoint tagged ``i`` (params, optimizer state, RNG, and as JSON the steps still in flight) and
then (2) a buffer commit tagged ``i``, once that checkpoint is on disk: at once when
``checkpoint.async_save`` is off; otherwise the checkpoint is written in the background and the
commit (of a copy of the buffer taken at ``i``) lands at the next iteration. On restart the
trainer takes the newest iteration present in both (the checkpoint manager keeps the previous
one), restores the metrics file to it, re-submits the steps that were in flight and replays
from there: the RNG stream continues where it was, so the replayed iterations are the same.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import logging
import os
import sys
import time
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from ace_jax.curriculum import buffer as buffer_lib, buffer_store, learnability, seeds
from ace_jax import config_utils
from ace_jax.env import agent, rewards
from ace_jax.env.environment import EnvContext, Environment
from ace_jax.rl import grpo, learner as learner_lib
from ace_jax.runtime import (checkpoint as ckpt_lib, generate, multihost,
                             placement as placement_lib, sampler_layout, storage)
from ace_jax.train import (config as train_config, environment, generation, metrics as metrics_lib,
                           dynamic_sampling, partial_rollouts, probe as probe_lib,
                           rollout_log, setup, step_metrics, summary as summary_lib)
from ace_jax.train.rollouts import StepRollouts
from ace_jax.train.setup import (SetupError, check_writable, load_evaluation_seeds,
                                 load_tasks)
from sandbox.pool import SandboxPool
from sandbox.result import ExecutionResult, Status
from sandbox.tasks import targets as targets_lib

log = logging.getLogger("ace_jax.train.trainer")


def max_staleness(cfg: ml_collections.ConfigDict) -> int:
    """k: how many RL steps' executions may still be in flight when the learner updates
    (``rl.max_staleness``, checked by ``config.validate``; 0: synchronous)."""
    return int(cfg.rl.max_staleness)


class Trainer:
    """Wires the parts of one AceGRPO run from a config (``configs/*.py``) and runs it; ``env``:
    the environment the policy acts in (default ``environment.CodeAgentEnv()``; its ``mode``
    must be the config's).

    Everything that can be wrong with the setup (paths, tasks, tokenizer / model mismatch, reward
    name, GRPO mode) is checked in ``__init__``, before any heavy work.
    """

    def __init__(self, cfg: ml_collections.ConfigDict, *, progress: bool = True,
                 env: Optional[Environment] = None):
        cfg = train_config.resolve_seeds(cfg)   # lp.seed / sft.seed = -1: the run's seed
        self.cfg = cfg
        self.env = env if env is not None else environment.CodeAgentEnv()
        self.workdir = cfg.workdir
        check_writable(self.workdir)
        try:   # every check of the config alone (config.validate), before any heavy work
            train_config.validate(cfg)
        except config_utils.ConfigError as e:
            raise SetupError(str(e)) from e
        if self.env.mode != cfg.mode:
            raise SetupError(f"config mode={cfg.mode!r} but the environment is "
                             f"{type(self.env).__name__} (mode {self.env.mode!r}): build the "
                             "run with `python -m ace_jax` (its build_trainer)")
        self.max_staleness = max_staleness(cfg)
        self.tasks = load_tasks(cfg)
        self.task_by_id = {t.task_id: t for t in self.tasks}
        self.targets = {t.task_id: targets_lib.task_targets(t) for t in self.tasks}
        self.evaluation_seeds = load_evaluation_seeds(cfg.rl.seed_solutions, self.task_by_id)
        # the sampler-neutral measure (ace_jax.train.probe; None when probe.every is 0)
        self.probe = probe_lib.Probe.from_config(
            cfg, self.tasks, setup.load_tasks(cfg, cfg.probe.heldout_tasks)
            if cfg.probe.every and cfg.probe.heldout_tasks else ())
        self.tokenizer = setup.load_tokenizer(
            cfg, self.workdir, self.tasks, lambda: self.env.tokenizer_texts(cfg, self.tasks))
        # one mesh over every process's devices, one Placement for every sharding
        self.placement = placement_lib.Placement.from_config(cfg.mesh)
        self.model = setup.build_model(cfg, self.tokenizer, self.placement)
        # the sampler's own mesh and code paths, or the learner's ("shared")
        self.sampler_layout = sampler_layout.SamplerLayout.from_config(
            cfg.sampler_mesh, self.placement, self.model.config)
        self.sampling = generation.sampling_config(cfg, self.tokenizer)
        self.eos_ids, self.pad_id = self.sampling.eos_ids, self.sampling.pad_id
        try:   # the model's config is known only now (an HF checkpoint or an earlier run's)
            train_config.check_context(cfg, self.model.config.max_position_embeddings)
        except config_utils.ConfigError as e:
            raise SetupError(str(e)) from e
        ck = cfg.checkpoint
        self.async_save = bool(ck.async_save)
        self.checkpointer = ckpt_lib.Checkpointer(
            ck.directory or os.path.join(self.workdir, "checkpoints"),
            keep=max(2, ck.keep),   # the previous one too: its buffer commit may be the newest
            save_interval_steps=int(ck.save_interval_steps), async_save=self.async_save,
            use_ocdbt=bool(ck.use_ocdbt))
        # Pruning ranks states by the potential that selects them (the configured LP).
        self.buffer = buffer_lib.EvolvingBuffer(
            cfg.buffer, list(self.targets.values()),
            potential_fn=learnability.pruning_potential(cfg.lp))
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
        self.compile_clock = metrics_lib.CompileClock()   # started by run()
        self.pool: Optional[SandboxPool] = None
        self.learner: Optional[learner_lib.Learner] = None
        self.generator: Any = None          # generation.build: an Engine or a Generator
        self.partial: Optional[partial_rollouts.PartialRollouts] = None   # rl.partial_rollouts
        self.next_step = 0                  # the next RL step to generate
        self.generated_tokens = 0           # completion tokens generated by RL steps so far
        self.iteration = 0                  # loop iterations done (checkpoint / commit tag)
        self.rng = self.placement.replicate(jax.random.key(cfg.seed))
        # the steps whose executions may still be running, oldest first (at most k + 1)
        self.in_flight: collections.deque[StepRollouts] = collections.deque()
        self._uncommitted: Optional[tuple] = None   # (iteration, buffer copy, sampler state)
        self.best_scores: dict[str, Optional[float]] = {t: None for t in self.task_by_id}
        self.env.bind(EnvContext(
            cfg=cfg, workdir=self.workdir, tasks=self.tasks, task_by_id=self.task_by_id,
            targets=self.targets, model=self.model, tokenizer=self.tokenizer,
            replicate=self.placement.replicate,
            submit=lambda task, code: self.pool.submit(task, code)))

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, Any]:
        """Warm start (if no checkpoint), then RL until ``rl.num_steps`` steps (or
        ``rl.token_budget`` generated tokens) are learned on; returns a summary."""
        cfg = self.cfg
        t_start = time.perf_counter()
        self.pool = SandboxPool.from_config(cfg.sandbox, tasks=self.tasks)
        self.compile_clock.start()
        self.learner = self._make_learner()
        self.generator, self.partial = generation.build(cfg, self.model, self.sampling,
                                                        self.placement, self.sampler_layout)
        warm = {}
        if not self._restore():
            warm = self._warm_start()
            self.learner = self._make_learner()
            generation.update_weights(self.generator, self.learner)
            self._seed_buffer()
            if self.is_writer:   # run-level files: process 0 writes them, once for the run
                self.metrics.write_config(cfg)
            self._persist()
        if self.is_writer:   # the GRPO mode, on the terminal at every start
            print(grpo.describe(cfg.grpo), file=sys.stderr, flush=True)
        if multihost.is_multi_process():   # each host: did it join, and which mesh
            print(f"process {jax.process_index()} of {jax.process_count()}: "
                  f"{jax.local_device_count()} of {jax.device_count()} devices, mesh "
                  f"{dict(self.placement.mesh.shape)}", file=sys.stderr, flush=True)
        last: dict = {}
        # a lost host surfaces as the runtime's error of a collective (a jitted step's, a
        # gather's, Orbax's barrier's): PeerLostError says so, and that the same command resumes
        with multihost.lost_peer_guard(lambda: f"the RL loop (iteration {self.iteration})"):
            while not self.done:
                last = self.step() or last
            probed = self._probe(final=True)   # after the last update: a line of its own
            if probed:
                self.metrics.write(self.next_step, probed)
            self._commit_saved()
            if self.partial is not None:   # groups drawn but never taken (the run is over)
                self.partial.cancel_all()
        self.metrics.flush()
        return {"steps": self.next_step, "generated_tokens": self.generated_tokens,
                "minutes": (time.perf_counter() - t_start) / 60, "warm_start": warm,
                "last": last, "name": cfg.name, "workdir": self.workdir,
                "checkpoints": str(self.checkpointer.directory),
                "metrics": storage.join(self.workdir, metrics_lib.METRICS_FILE),
                "tensorboard": storage.join(self.workdir, metrics_lib.TENSORBOARD_DIR),
                "curves": summary_lib.run_curves(self.metrics.jsonl_path)}

    @property
    def generating(self) -> bool:
        """Whether another RL step goes out: fewer than ``rl.num_steps`` so far and the
        ``rl.token_budget`` (when set) not yet spent."""
        budget = self.cfg.rl.token_budget
        return self.next_step < self.cfg.rl.num_steps and not (
            budget and self.generated_tokens >= budget)

    @property
    def done(self) -> bool:
        return not self.generating and not self.in_flight

    def step(self) -> Optional[dict]:
        """One loop iteration: a new RL step goes out (1-4), the oldest step in flight is learned
        on once more than k are in flight or none is left to generate (5-7), then 8. Returns the
        metrics of the step learned on (None if none was)."""
        t0, c0 = time.perf_counter(), self.compile_clock.total
        k = self.max_staleness
        if self.generating and len(self.in_flight) <= k:
            step = self.next_step
            if self.partial is None:
                states = self._select(step)                              # 1. select
                prompts, truncated = self._prompts(states)               # 2. prompts
                out = self._generate(step, states, prompts)              # 3. generate
                out.truncated = truncated
            else:                                     # 1-3 over the groups kept in flight
                out = self._collect(step)
            self.env.execute(out)                                        # 4. execute
            self.in_flight.append(out)
            self.next_step = step + 1
        metrics = None
        if len(self.in_flight) > k or (self.in_flight and not self.generating):
            done = self.in_flight.popleft()     # the oldest: generated at most k updates ago
            probed = self._probe()              # the parameters before this update, when due
            wait_s = self._wait_results(done)
            self._reward(done)                                           # 5. reward
            learn_on = self._refill(done)       # dynamic sampling (when configured)
            learn, learn_s = self._learn(done, learn_on)                 # 6. learn
            self._grow_buffer(done)                                      # 7. grow the buffer
            self._log_rollouts(done)
            metrics = self._step_metrics(done, learn, wait_s, learn_s)
            metrics.update(probed)
            metrics["perf/step_seconds"] = time.perf_counter() - t0
            metrics["perf/compile_seconds"] = self.compile_clock.total - c0
            self.metrics.write(done.step, metrics)
        self.iteration += 1
        self._persist(final=self.done)                                   # 8. persist
        return metrics

    # ------------------------------------------------------------------ 1-4: a step goes out

    def _select(self, step: int, n: Optional[int] = None,
                minimum: Optional[int] = None) -> list[buffer_lib.State]:
        """``n`` states (default ``rl.batch_states``; with ``minimum``, as many as are eligible
        down to it) from the sampler, marked sampled."""
        slots = self.sampler.select(self.buffer.stats, step, n or self.cfg.rl.batch_states,
                                    data_parallel_size=1, minimum=minimum)
        ids = self.buffer.ids_for_slots(slots)
        self.buffer.mark_sampled(ids, step)
        return [self.buffer.get(i) for i in ids]

    def _prompts(self, states: Sequence[buffer_lib.State]) -> tuple[list[list[int]], int]:
        """The states' prompt token ids (`_prompt_ids`); and how many were cut."""
        out = [self._prompt_ids(self.env.prompt_text(s)) for s in states]
        return [ids for ids, _ in out], sum(cut for _, cut in out)

    def _prompt_ids(self, text: str) -> tuple[list[int], bool]:
        """A prompt's token ids keeping its last ``rl.max_prompt_tokens``; whether it was cut."""
        limit = self.cfg.rl.max_prompt_tokens
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return (ids[-limit:], True) if len(ids) > limit else (ids, False)

    def _generate(self, step: int, states: Sequence[buffer_lib.State],
                  prompts: list[list[int]]) -> StepRollouts:
        """G completions per prompt with the current policy; the arrays come back to the host
        (numpy) and stay arrays up to the learner."""
        self.rng, key = jax.random.split(self.rng)
        t0 = time.perf_counter()
        gen = generation.host_generate(self.generator, prompts, key)
        return self._step_rollouts(step, states, prompts, gen, time.perf_counter() - t0)

    def _collect(self, step: int) -> StepRollouts:
        """Partial rollouts (1-3): the engine is topped up with newly selected states' groups,
        then the step takes B complete groups (``partial_rollouts.PartialRollouts.collect``),
        learned on after the k steps in flight before it."""
        t0, truncated = time.perf_counter(), 0

        def draw(n):   # at least what a step takes, more when the buffer has them
            nonlocal truncated
            states = self._select(step, n, minimum=max(
                0, self.cfg.rl.batch_states - len(self.partial.groups)))
            prompts, cut = self._prompts(states)
            truncated += cut
            return [partial_rollouts.NewGroup(s, p) for s, p in zip(states, prompts)]

        self.partial.top_up(draw, step)
        # the version that will learn on this step: one update (grpo.minibatches optimizer
        # steps) per step still in flight before it
        groups = self.partial.collect(int(self.learner.state.step) + len(self.in_flight)
                                      * self.partial.per_step)
        gen = partial_rollouts.generation(self.partial, groups, pad_id=self.pad_id,
                                          max_new_tokens=self.cfg.sampling.max_new_tokens)
        out = self._step_rollouts(step, [g.state for g in groups], [g.prompt for g in groups],
                                  gen, time.perf_counter() - t0)
        out.truncated, out.group_ids = truncated, [g.seq for g in groups]
        return out

    def _step_rollouts(self, step: int, states: Sequence[buffer_lib.State],
                       prompts: list[list[int]], gen: generate.GenerationResult,
                       gen_s: float) -> StepRollouts:
        """The step's rollouts of generation ``gen`` (host arrays) of ``states``' prompts; a
        row's policy version is that of its oldest token (the current one without versions)."""
        self.generated_tokens += int(gen.lengths.sum())
        return StepRollouts.from_generation(
            step, states, prompts, gen, gen_s, version=int(self.learner.state.step),
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False))

    # ------------------------------------------------------------------ the probe

    def _probe(self, final: bool = False) -> dict[str, float]:
        """The ``probe/*`` metrics of the current parameters when the probe is due after this
        many learner updates (``ace_jax.train.probe``) or after the ``final`` one; {}
        otherwise. Every host runs it (the generation is collective; each host executes every
        probe action)."""
        updates = int(self.learner.state.step)
        if self.probe is None or not (final or self.probe.due(updates)):
            return {}
        t0 = time.perf_counter()
        m = self.probe.run(
            lambda ps: self._prompt_ids(agent.render_prompt(
                ps.state, self.probe.tasks[ps.state.task_id], self.cfg.agent))[0],
            lambda prompts, key, n: generation.host_generate(
                self.generator, prompts, key, dataclasses.replace(self.sampling, group_size=n)),
            self.pool, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
            max_code_chars=self.cfg.agent.max_code_chars, rewards_cfg=self.cfg.rewards)
        return {**m, "probe/updates": float(updates),
                "perf/probe_seconds": time.perf_counter() - t0}

    # ------------------------------------------------------------------ 5-7: learn on a step

    def _wait_results(self, s: StepRollouts) -> float:
        """Sets every rollout's result: this process's executions, then (multi-host) everyone's,
        gathered so that every process holds the same results. Returns the seconds waited."""
        t0 = time.perf_counter()
        mine = multihost.my_share(len(s.rollouts))
        own = [None if s.futures[i] is None else s.futures[i].result().to_dict() for i in mine]
        if multihost.is_multi_process():
            log.info("process %d of %d ran %d of the %d executions of step %d",
                     jax.process_index(), jax.process_count(), len(own) - own.count(None),
                     len(s.rollouts), s.step)
        for r, d in zip(s.rollouts, multihost.allgather_json(own)):
            r.result = None if d is None else ExecutionResult.from_dict(d)
        return time.perf_counter() - t0

    def _reward(self, s: StepRollouts) -> None:
        rs = s.rollouts
        out = rewards.compute_rewards(
            self.cfg.rl.reward, [r.action for r in rs], [r.result for r in rs],
            [r.state.score for r in rs], [self.targets[r.task_id] for r in rs], self.cfg.rewards)
        for r, x in zip(rs, out):
            r.reward = x

    def _refill(self, s: StepRollouts) -> StepRollouts:
        """Dynamic sampling (``ace_jax.train.dynamic_sampling.refill``; ``s`` itself unless
        ``rl.dynamic_sampling_rounds`` > 0): what the learner learns on (B groups of G)."""
        cfg = self.cfg.rl
        # the sampler's clock is the newest step generated (k steps may be newer than s)
        clock = max(s.step, self.next_step - 1)

        def roll_out(states):
            prompts, truncated = self._prompts(states)
            more = self._generate(s.step, states, prompts)
            more.truncated = truncated
            self.env.execute(more)
            self._wait_results(more)
            self._reward(more)
            return more

        return dynamic_sampling.refill(
            s, kind=cfg.dynamic_sampling, rounds=cfg.dynamic_sampling_rounds,
            batch_states=cfg.batch_states, group_size=cfg.group_size,
            atol=self.cfg.grpo.zero_variance_atol, draw=lambda n: self._select(clock, n),
            roll_out=roll_out, eps=self.cfg.grpo.advantage_eps,
            std_ddof=self.cfg.grpo.advantage_std_ddof,
            normalise=self.cfg.grpo.advantage_estimator != "drgrpo")

    def _learn(self, s: StepRollouts, learn_on: Optional[StepRollouts] = None
               ) -> tuple[dict, float]:
        """One GRPO update on the step's batch (``learn_on``: the groups dynamic sampling
        kept; default ``s``); the generator gets the new weights. Returns (learner metrics,
        seconds)."""
        t0 = time.perf_counter()
        s.learner_version = int(self.learner.state.step)
        learn_on = learn_on or s
        learn_on.learner_version = s.learner_version
        batch = learn_on.train_batch(
            prompt_bucket=self.cfg.sampling.prompt_bucket, pad_id=self.pad_id,
            shardings=None if self.learner.placement is None else self.learner.placement.batch)
        learn = self.learner.step(batch)
        learn = {k: float(v) for k, v in jax.device_get(learn).items()}
        generation.update_weights(self.generator, self.learner)
        return learn, time.perf_counter() - t0

    def _grow_buffer(self, s: StepRollouts) -> None:
        """Every execution becomes a child state; invalid-format completions count only in the
        parent's group statistics (they have no code to start from)."""
        g = self.cfg.rl.group_size
        for b in range(len(s.rollouts) // g):
            group = s.rollouts[b * g:(b + 1) * g]
            parent = group[0].state
            children = [buffer_lib.Child(code=r.action.code, result=r.result, reward=r.reward,
                                         action=agent.step_kind(parent))
                        for r in group if r.result is not None]
            extra = [r.reward for r in group if r.result is None]
            self.buffer.add_children(parent.state_id, children, s.step + 1,
                                     extra_rewards=extra)
            for r in group:
                if r.result is not None and r.result.status is Status.OK:
                    tgt = self.targets[r.task_id]
                    self.best_scores[r.task_id] = tgt.better(self.best_scores[r.task_id],
                                                             r.result.dev_score)

    def _log_rollouts(self, s: StepRollouts) -> None:
        """The step's lines of the rollouts log (`rollout_log`; process 0 writes them)."""
        if self.is_writer:
            rollout_log.write(self.workdir, s, self.cfg.rl.group_size, self.env.record)

    def _step_metrics(self, s: StepRollouts, learn: dict, wait_s: float, learn_s: float) -> dict:
        rs = s.rollouts
        m = step_metrics.rollout_metrics(s, self.targets, self.cfg.rewards)
        m.update({
            "perf/gen_tokens_per_s": s.gen_tokens / max(s.gen_seconds, 1e-9),
            "perf/gen_seconds": s.gen_seconds, "perf/sandbox_wait_seconds": wait_s,
            "perf/learn_seconds": learn_s,
            "perf/learn_tokens_per_s": learn.get("tokens", 0.0) / max(learn_s, 1e-9),
            "perf/sandbox_utilization": self.pool.utilization(),
            # CPU the step's executions took from the host (the learner shares its cores).
            "perf/sandbox_cpu_seconds": sum(r.result.cpu_s or 0.0 for r in rs
                                            if r.result is not None),
            "offpolicy/staleness": float(s.staleness),
            # per completion token: learner version minus the version that sampled it
            "offpolicy/token_staleness_mean": float(np.mean(s.token_staleness() if s.gen_tokens
                                                            else 0)),
            "buffer/size": len(self.buffer),
        })
        m.update({(k if k.startswith("offpolicy/") else f"grpo/{k}"): v for k, v in learn.items()})
        m["grpo/zero_var_frac"] = learn.get("frac_zero_variance_groups", 0.0)
        m.update(step_metrics.lp_metrics(s.step, self.sampler, self.buffer))
        m.update(step_metrics.best_score_metrics(self.best_scores, self.task_by_id),
                 **generation.engine_metrics(self.generator), **self.env.metrics(s))
        return m

    # ------------------------------------------------------------------ 8: persist / resume

    def _train_state(self) -> ckpt_lib.TrainState:
        meta = {"learner_step": int(self.learner.state.step), "next_step": self.next_step,
                "generated_tokens": self.generated_tokens,
                "best_scores": self.best_scores,
                "in_flight": [s.to_json() for s in self.in_flight],
                "partial": None if self.partial is None else self.partial.to_json()}
        return ckpt_lib.TrainState(step=self.iteration, params=self.learner.params,
                                   opt_state=self.learner.state.opt_state, rng=self.rng,
                                   sampler_state=meta)

    def _persist(self, *, final: bool = False) -> None:
        """Checkpoint first, then the buffer commit, both tagged with the loop iteration; on the
        iterations ``checkpoint.save_interval_steps`` divides (and the ``final`` one) only."""
        self._commit_saved()      # the previous save's commit, once its checkpoint is on disk
        if not self.checkpointer.save(self._train_state(), force=final):  # every process: its shards
            return
        # the buffer is identical on every process: one writer
        if self.is_writer:
            if self.async_save:   # committed when the checkpoint is complete (next iteration)
                self._uncommitted = (self.iteration, copy.deepcopy(self.buffer),
                                     self.sampler.state_dict())
                self.buffer.export_delta()   # the copy carries these changes to its commit
            else:
                self._uncommitted = (self.iteration, self.buffer, self.sampler.state_dict())
        if not self.async_save:
            self._commit_saved()

    def _commit_saved(self) -> None:
        """Waits for the checkpoint being written, then commits the buffer of its iteration.
        A save that failed raises here, and its buffer commit is dropped (taken off before the
        wait), so a later call (``close``) cannot commit a buffer whose checkpoint is missing:
        the run resumes from the last iteration with both."""
        pending, self._uncommitted = self._uncommitted, None
        self.checkpointer.wait_until_finished()
        if pending is not None:
            iteration, buf, sampler_state = pending
            # a remote workdir's metrics are uploaded every ~30 s: up to date before the commit
            # a resume restarts from, so a killed run's steps keep their lines
            self.metrics.sync()
            self.store.commit(buf, iteration, sampler_state)

    def _restore(self) -> bool:
        """Restores checkpoint + buffer of the newest iteration present in both; False if none."""
        target = self._train_state()
        steps, ckpt = self.checkpointer.all_steps(), self.checkpointer
        info = self.store.restore(self.buffer) if steps else None
        if steps and info is None:   # killed before its first buffer commit landed: afresh
            log.warning("checkpoints %s dropped (no buffer commit)", ckpt.delete_after(-1))
        if info is None:
            return False
        buf_step, usable = info.step, [s for s in steps if s <= info.step]
        if not usable:
            raise SetupError(f"checkpoints exist at steps {steps} but the buffer store has step "
                             f"{buf_step}: the run directory is inconsistent")
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
        finished = self.next_step - 1 - len(self.in_flight)
        self.metrics.resume(finished)
        if self.is_writer:   # on the terminal as the GRPO mode is: a relaunch says it resumed
            print(f"resumed at iteration {step} (buffer commit {info.seq}, {len(self.buffer)} "
                  f"states, {len(self.in_flight)} steps in flight)", file=sys.stderr, flush=True)
        return True

    def _install(self, state: ckpt_lib.TrainState) -> None:
        meta = state.sampler_state or {}
        self.learner.state = learner_lib.LearnerState(
            state.params, state.opt_state, jnp.asarray(meta.get("learner_step", 0), jnp.int32))
        generation.update_weights(self.generator, self.learner)
        self.rng = state.rng
        self.iteration = int(state.step)
        self.next_step = int(meta.get("next_step", 0))
        self.generated_tokens = int(meta.get("generated_tokens", 0))
        self.best_scores.update(meta.get("best_scores", {}))
        saved = meta.get("in_flight")
        if saved is None:   # a checkpoint of an older version: at most one step, as "pending"
            saved = [meta["pending"]] if meta.get("pending") else []
        for d in saved:      # their executions are run again
            s = StepRollouts.from_json(d, max_new_tokens=self.cfg.sampling.max_new_tokens,
                                       pad_id=self.pad_id, eos_ids=self.eos_ids,
                                       group_size=self.cfg.rl.group_size)
            for r in s.rollouts:
                r.state = self.buffer.get(r.state_id)
            self.env.execute(s)
            self.in_flight.append(s)
        if self.partial is not None and meta.get("partial"):   # the groups still decoding
            self.partial.restore(meta["partial"], self.buffer.get)

    # ------------------------------------------------------------------ warm start

    def _seed_buffer(self) -> None:
        """The states a fresh run starts from: an empty draft per task, the seed corpus's
        reference solutions (``rl.seed_with_references``) and the valid attempts of earlier
        evaluations (``rl.seed_solutions``, origin "evaluation")."""
        cfg = self.cfg
        self.buffer.seed(seeds.reference_solutions(self.tasks, cfg.tasks.seed)
                         if cfg.rl.seed_with_references else ())
        seeds.add_seed_states(self.buffer, self.evaluation_seeds)

    def _warm_start(self) -> dict:
        """Supervised warm start on the seed corpus (only when no checkpoint exists and the
        weights do not come from another run's checkpoint)."""
        self.model, info = setup.warm_start(self.cfg, self.model, self.tokenizer,
                                            self.env.sft_examples, self.placement,
                                            progress=self.progress)
        self.env.after_warm_start(self.model)
        return info

    def _make_learner(self) -> learner_lib.Learner:
        return learner_lib.Learner.create(self.model, self.cfg.grpo, self.cfg.optim,
                                          group_size=self.cfg.rl.group_size,
                                          placement=self.placement,
                                          temperature=self.cfg.sampling.temperature)

    def close(self) -> None:
        self.compile_clock.stop()
        if self.pool is not None:
            self.pool.close()
        try:
            self._commit_saved()   # a checkpoint written in the background gets its commit
        finally:
            self.checkpointer.close()
            self.metrics.close()
