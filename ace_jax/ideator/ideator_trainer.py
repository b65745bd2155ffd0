"""MLE-Ideator training with the AceGRPO trainer: the trained policy is the IDEATOR.

A variant is a config (``configs/ideator.py``: ``mode = "ideator"``), not a fork: ``IdeatorEnv`` is
an environment (``ace_jax.env.environment.Environment``) plugged into the one ``Trainer`` loop
(``make_trainer``; ``python -m ace_jax`` builds it for ``mode = "ideator"``), which keeps
its asynchrony, checkpointing, exact resume, metrics and Evolving Data Buffer. What the
environment changes, per RL step:

  LP sampler -> B buffer states (task, the implementer's code + history, its best score)
  -> the IDEATOR prompt of each state (``prompts.render_ideator_messages`` of
     ``prompts.request_from_state``) -> G ideas per state (behaviour log-probs recorded)
  -> ``ideator.parse_idea`` (strict; a reply cut by the token budget is invalid)
  -> each valid idea goes to a FROZEN implementer (``interface.ChatPolicy``), which takes ONE step:
     ``agent.render_messages(state, task, advice=<the idea's Action>)`` -> one script
  -> the sandbox runs it on the dev split -> reward ``ideator_ternary`` against the state's
     score (+1 strictly better, 0 not better / failed / the implementer wrote no script,
     -1 the idea is malformed) -> GRPO trains only the ideator (its prompt + idea tokens)
  -> the implementer's script and result become a child state in the buffer, as usual.

The implementer is chosen by ``ideator.implementer``:

* ``"self"``: a frozen copy of the initial policy weights (after the warm start). It is saved to
  ``<workdir>/implementer/`` right after the warm start, so a resumed run uses the same weights.
* ``"run:<dir>"``: ``policy.JaxPolicy.from_run`` of a training run directory (e.g. an AceGRPO run).
* ``"hf:<dir>"``: ``policy.JaxPolicy.from_hf`` of an HF directory.
* ``"openai:<base_url>#<model>"``: ``openai_policy.OpenAIPolicy`` (vLLM, ``launch/serve.py``, an
  API); the key comes from ``OPENAI_API_KEY``.

Tests (and notebooks) may pass any ``ChatPolicy`` as ``make_trainer(cfg, implementer=...)``.

Per-step metrics added to the trainer's: ``ideator/format_valid_rate``,
``ideator/category/<name>`` (share of the valid ideas in each of ``ideator.CATEGORIES``),
``ideator/verb/<refine|revert>``, ``ideator/invalid/<reason>`` (share of all ideas),
``ideator/implementer_valid_rate`` (share of valid ideas the implementer turned into a script),
``ideator/improve_rate`` (share of all ideas whose script beat the state's score),
``perf/implementer_seconds``. Rollout logs carry the idea, its category and the implementer's reply.

The implementer's sampling is seeded from ``(seed, step)``, so re-submitting the rollouts in flight
after a restart reproduces the same scripts.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
from flax import nnx

from ace_jax.env import agent, rewards
from ace_jax.env.environment import EnvContext
from ace_jax.ideator import ideator, prompts, sft_examples
from ace_jax.runtime import checkpoint as ckpt_lib
from ace_jax.runtime import multihost
from ace_jax.train import sft
from ace_jax.train.rollouts import Rollout, StepRollouts
from ace_jax.train.setup import SetupError
from ace_jax.train.trainer import Trainer
from models import tokenizer as tok_lib
from sandbox.grading import improves

log = logging.getLogger("ace_jax.ideator.ideator_trainer")


def default_config() -> ml_collections.ConfigDict:
    """The ``ideator`` config section of an ideator run: ``ideator.default_config()`` (prompt and
    parsing) plus the training keys below."""
    c = ideator.default_config()
    # The frozen implementer: "self" or a policy spec, "run:<dir>[@step]" | "hf:<dir>" |
    # "openai:<base_url>#<model>" (ace_jax.policy.policy.parse_policy_spec).
    c.implementer = "self"
    c.implementer_max_new_tokens = 0     # its token budget per script (0: sampling.max_new_tokens)
    c.implementer_max_prompt_tokens = 0  # its prompts keep their last tokens (0: rl.max_prompt_tokens)
    c.implementer_temperature = 0.5      # its sampling temperature (0: greedy)
    c.implementer_timeout_s = 120.0      # openai: per request
    c.implementer_pad_batch = True       # JAX implementers: pad each call to B*G conversations
    #                                      (one compiled batch shape instead of one per count)
    # Why help is asked in the training prompts ("stagnation" | "seek_help"; advice.REASONS).
    c.reason = "stagnation"
    # Examples added to the warm start (sft_examples.IDEATOR_SFT_KINDS; () for none).
    c.sft_kinds = sft_examples.IDEATOR_SFT_KINDS
    return c


def parse_implementer_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """("self", {}) or ``policy.parse_policy_spec(spec)`` (run / hf / openai) of an implementer.

    Raises:
      SetupError: neither "self" nor a policy spec.
    """
    from ace_jax.policy import policy

    spec = (spec or "").strip()
    if spec == "self":
        return "self", {}
    try:
        return policy.parse_policy_spec(spec)
    except policy.PolicySpecError as e:
        raise SetupError(f"ideator.implementer={spec!r}: expected 'self' or a policy spec "
                         f"({e})") from e


@dataclasses.dataclass
class IdeatorAction:
    """The outcome of one ideator sample, as the trainer and the rewards see it.

    ``valid`` and ``idea`` follow ``agent.Action`` (what ``rewards.ideator_ternary`` reads):
    ``valid`` is the idea's format, ``idea`` the Action text handed to the implementer. ``code``
    is the implementer's script (None when the idea was invalid or the implementer wrote none).
    """

    parsed: ideator.ParsedIdea
    implementer: Optional[agent.ParsedAction] = None  # the implementer's parsed reply
    implementer_text: str = ""
    implementer_error: Optional[str] = None           # the policy's error, if it gave no reply
    current_score: Optional[float] = None             # the state's score when submitted

    @property
    def valid(self) -> bool:
        return self.parsed.valid

    @property
    def idea(self) -> Optional[str]:
        return self.parsed.action if self.parsed.valid else None

    @property
    def reason(self) -> Optional[ideator.IdeaError]:
        return None if self.parsed.valid else self.parsed.reason

    @property
    def category(self) -> Optional[str]:
        return ideator.idea_category(self.parsed) if self.parsed.valid else None

    @property
    def code(self) -> Optional[str]:
        a = self.implementer
        return a.code if a is not None and a.valid else None


def make_trainer(cfg: ml_collections.ConfigDict, *, progress: bool = True,
                 implementer: Any = None) -> Trainer:
    """The AceGRPO trainer with the ideator environment (``cfg.mode == "ideator"``)."""
    return Trainer(cfg, progress=progress, env=IdeatorEnv(cfg, implementer=implementer))


class IdeatorEnv:
    """MLE-Ideator's environment (see the module docstring): the trained policy writes an idea
    for a buffer state, a frozen implementer turns it into one script, the sandbox runs it.

    Args:
      cfg: a full config with an ``ideator`` section (``configs/ideator.py``).
      implementer: an ``interface.ChatPolicy`` to use instead of ``cfg.ideator.implementer``.

    Raises:
      SetupError: a bad ``ideator`` section, here before any heavy work, or (``bind``) an
        implementer context the model cannot hold / an implementer that cannot be loaded.
    """

    mode = "ideator"

    def __init__(self, cfg: ml_collections.ConfigDict, *, implementer: Any = None):
        if "ideator" not in cfg:
            raise SetupError("an ideator run needs an 'ideator' config section "
                             "(see configs/ideator.py)")
        icfg = cfg.ideator
        if icfg.advice_text not in ideator.ADVICE_MODES:
            raise SetupError(f"ideator.advice_text={icfg.advice_text!r}; valid: "
                             f"{ideator.ADVICE_MODES}")
        unknown = set(icfg.sft_kinds) - set(sft_examples.IDEATOR_SFT_KINDS)
        if unknown:
            raise SetupError(f"ideator.sft_kinds has unknown kinds {sorted(unknown)}; valid: "
                             f"{sft_examples.IDEATOR_SFT_KINDS}")
        self.cfg = cfg
        self.impl_kind, self.impl_args = (("injected", {}) if implementer is not None
                                          else parse_implementer_spec(icfg.implementer))
        impl_dir = self.impl_args.get("workdir") or self.impl_args.get("path")
        if impl_dir and "://" not in impl_dir and not os.path.isdir(impl_dir):
            raise SetupError(f"ideator.implementer: {impl_dir!r} is not a directory")
        self.impl_max_new = int(icfg.implementer_max_new_tokens or cfg.sampling.max_new_tokens)
        self.impl_max_prompt = int(icfg.implementer_max_prompt_tokens or cfg.rl.max_prompt_tokens)
        self.implementer = implementer
        self.ctx: Optional[EnvContext] = None
        self._impl_seconds: dict[int, float] = {}
        self._warm_model: Any = None   # the policy this process warm-started (a fresh run)

    def bind(self, ctx: EnvContext) -> None:
        self.ctx = ctx
        self.cfg = ctx.cfg   # the run's resolved config (lp.seed / sft.seed = the seed)
        if self.impl_kind == "self":
            n = self.impl_max_new + self.impl_max_prompt
            max_pos = ctx.model.config.max_position_embeddings
            if n > max_pos:
                raise SetupError(f"ideator implementer prompt + new tokens = {n} exceed the "
                                 f"model's max_position_embeddings ({max_pos})")
        if self.implementer is None and self.impl_kind in ("run", "hf", "openai"):
            self.implementer = self._build_external_implementer()

    # ------------------------------------------------------------------ the implementer

    @property
    def snapshot_dir(self) -> str:
        """Where the "self" implementer's frozen weights are kept."""
        return os.path.join(self.ctx.workdir, "implementer")

    def _jax_policy_kwargs(self) -> dict:
        return dict(max_new_tokens=self.impl_max_new,
                    temperature=float(self.cfg.ideator.implementer_temperature),
                    max_prompt_tokens=self.impl_max_prompt,
                    prompt_bucket=int(self.cfg.sampling.prompt_bucket))

    def _build_external_implementer(self):
        from ace_jax.policy import interface, openai_policy, policy

        args = self.impl_args
        if self.impl_kind == "openai":
            return openai_policy.OpenAIPolicy(
                args["base_url"], args["model"],
                timeout_s=float(self.cfg.ideator.implementer_timeout_s),
                max_tokens=self.impl_max_new,
                temperature=float(self.cfg.ideator.implementer_temperature),
                name=f"implementer:{args['model']}")
        try:
            if self.impl_kind == "run":
                return policy.JaxPolicy.from_run(args["workdir"], step=args["step"],
                                                 **self._jax_policy_kwargs())
            return policy.JaxPolicy.from_hf(args["path"], **self._jax_policy_kwargs())
        except interface.PolicyError as e:
            raise SetupError(f"ideator.implementer={self.cfg.ideator.implementer!r}: {e}") from e

    def _save_snapshot(self, model: Any) -> None:
        """Saves ``model``'s (the warm-started policy's) weights as the frozen "self"
        implementer."""
        with ckpt_lib.Checkpointer(self.snapshot_dir, keep=1, async_save=False) as c:
            c.delete_after(-1)   # a warm start that crashed before its first commit left one
            replicate = self.ctx.replicate   # global arrays: multi-host saves
            c.save(ckpt_lib.TrainState(step=0, params=nnx.state(model, nnx.Param),
                                       opt_state={"unused": replicate(jnp.zeros(()))},
                                       rng=replicate(jax.random.key(0)),
                                       sampler_state={"what": "frozen ideator implementer"}),
                   force=True)

    def _self_implementer(self):
        """The frozen "self" implementer: the saved snapshot if there is one (a resumed run),
        else the warm-started policy (a fresh run; the learner trains a copy of it)."""
        from ace_jax.policy import policy

        model = None
        if os.path.isdir(self.snapshot_dir) or "://" in self.snapshot_dir:
            with ckpt_lib.Checkpointer(self.snapshot_dir, keep=None, async_save=False) as c:
                steps = c.all_steps()
                if steps:
                    graphdef, params = nnx.split(self.ctx.model, nnx.Param)
                    model = nnx.merge(graphdef, c.restore_params(steps[-1], params))
        if model is None:
            if self._warm_model is None:  # resumed, but the run never saved a frozen copy
                raise SetupError(f"ideator.implementer='self' but {self.snapshot_dir} holds no "
                                 "frozen implementer: this run was started with another "
                                 "implementer; resume it with that one")
            model = self._warm_model
        return policy.JaxPolicy(model, self.ctx.tokenizer, name="implementer:self",
                                **self._jax_policy_kwargs())

    def _get_implementer(self):
        if self.implementer is None:
            self.implementer = self._self_implementer()
        return self.implementer

    def _implementer_seed(self, step: int) -> int:
        return (int(self.cfg.seed) * 1_000_003 + int(step)) % (2 ** 31 - 1)

    # ------------------------------------------------------------------ the environment

    def tokenizer_texts(self, cfg, tasks) -> list[str]:
        """A tokenizer trained here also sees ideator prompts and ideas."""
        return [ex.prompt + ex.completion for ex in sft_examples.build_ideator_sft_examples(
            tasks, cfg.agent, cfg.ideator, kinds=("idea", "idea_revert"),
            seed_corpus_seed=cfg.tasks.seed)]

    def sft_examples(self) -> list:
        tasks, cfg = self.ctx.tasks, self.cfg
        examples = []
        if tuple(cfg.sft.kinds):
            examples += sft.build_sft_examples(tasks, cfg.sft, cfg.agent)
        if tuple(cfg.ideator.sft_kinds):
            examples += sft_examples.build_ideator_sft_examples(
                tasks, cfg.agent, cfg.ideator, kinds=tuple(cfg.ideator.sft_kinds),
                seed_corpus_seed=cfg.tasks.seed)
        if not examples:
            raise SetupError("sft.enabled but neither sft.kinds nor ideator.sft_kinds gives "
                             "an example")
        return examples

    def after_warm_start(self, model: Any) -> None:
        self._warm_model = model
        if self.impl_kind == "self":
            self._save_snapshot(model)

    def prompt_text(self, state) -> str:
        task = self.ctx.task_by_id[state.task_id]
        request = prompts.request_from_state(state, task, reason=self.cfg.ideator.reason)
        return tok_lib.render_chat(prompts.render_ideator_messages(request, self.cfg.ideator),
                                   add_generation_prompt=True, enable_thinking=False)

    def execute(self, s: StepRollouts) -> None:
        """Parses every idea, lets the frozen implementer take one step for each valid one (one
        batched call) and sends the scripts of this process's share (``multihost.my_share``;
        all of them on one host) to its sandbox pool; the trainer gathers every process's
        results, as for the code agent."""
        step, rollouts, ctx = s.step, s.rollouts, self.ctx
        icfg = self.cfg.ideator
        asks: list[tuple[int, list[dict]]] = []
        for i, r in enumerate(rollouts):
            parsed = ideator.parse_idea(r.text, icfg, truncated=s.cut_by_budget(i))
            state = r.state
            r.action = IdeatorAction(parsed=parsed, current_score=state.score)
            if parsed.valid:
                asks.append((i, prompts.implementer_prompt_with_idea(
                    state, ctx.task_by_id[r.task_id], parsed, self.cfg.agent,
                    advice_text=icfg.advice_text)))
        t0 = time.perf_counter()
        if asks:
            replies = self._ask_implementer([m for _, m in asks], step)
            for (i, _), c in zip(asks, replies):
                a = rollouts[i].action
                a.implementer_text = c.text or ""
                if c.error:
                    a.implementer_error = str(c.error)
                else:
                    a.implementer = agent.parse_action(
                        c.text, max_code_chars=self.cfg.agent.max_code_chars)
        self._impl_seconds[step] = time.perf_counter() - t0
        mine = multihost.my_share(len(rollouts))
        s.futures = [ctx.submit(ctx.task_by_id[r.task_id], r.action.code)
                     if r.action.code is not None and i in mine else None
                     for i, r in enumerate(rollouts)]

    def _ask_implementer(self, conversations: list, step: int) -> list:
        """One batched implementer call, the same replies on every process. A JAX implementer
        runs on every process (its generation is collective, or the same program with the same
        keys), its batch padded to B*G (one compiled shape); any other (an HTTP endpoint) is
        asked by each process for its share of the conversations and the replies are gathered.
        Never raises: an exception becomes an error Completion for every conversation asked."""
        from ace_jax.policy import interface, policy

        impl = self._get_implementer()
        if multihost.is_multi_process() and not isinstance(impl, policy.JaxPolicy):
            mine = multihost.my_share(len(conversations))
            own = self._call_implementer(impl, [conversations[i] for i in mine], step)
            return [interface.Completion(**d) for d in multihost.allgather_json(
                [dataclasses.asdict(c) for c in own])]
        return self._call_implementer(impl, conversations, step)

    def _call_implementer(self, impl: Any, conversations: list, step: int) -> list:
        from ace_jax.policy import interface, policy

        n = len(conversations)
        if not n:
            return []
        convs = list(conversations)
        full = self.cfg.rl.batch_states * self.cfg.rl.group_size
        if isinstance(impl, policy.JaxPolicy) and self.cfg.ideator.implementer_pad_batch \
                and n < full:
            convs += [convs[-1]] * (full - n)
        try:
            out = impl.complete(convs, seed=self._implementer_seed(step))[:n]
            if len(out) != n:
                raise RuntimeError(f"{len(out)} replies for {n} conversations")
        except Exception as e:  # noqa: BLE001 - one bad call must not end the run
            log.warning("implementer call failed at step %d: %s", step, e)
            out = [interface.Completion(text="", error=f"{type(e).__name__}: {str(e)[:200]}",
                                        finish_reason="error") for _ in range(n)]
        return out

    def record(self, r: Rollout) -> dict:
        a: IdeatorAction = r.action
        p = a.parsed
        return dict(
            idea_valid=p.valid, idea_error=None if p.valid else str(p),
            verb=p.verb if p.valid else None, idea_action=p.action if p.valid else None,
            category=a.category, implementer_text=a.implementer_text,
            implementer_valid=None if a.implementer is None else a.implementer.valid,
            implementer_error=a.implementer_error, current_score=a.current_score)

    def metrics(self, p: StepRollouts) -> dict[str, float]:
        m = {}
        acts: list[IdeatorAction] = [r.action for r in p.rollouts]
        n = len(acts)
        valid = [a for a in acts if a.valid]
        nv = max(len(valid), 1)
        m["ideator/format_valid_rate"] = len(valid) / n
        cats = [a.category for a in valid]
        for c in ideator.CATEGORIES:
            m[f"ideator/category/{c}"] = cats.count(c) / nv
        for v in ideator.VERBS:
            m[f"ideator/verb/{v}"] = sum(a.parsed.verb == v for a in valid) / nv
        for e in ideator.IdeaError:
            m[f"ideator/invalid/{e.value}"] = sum(a.reason is e for a in acts) / n
        m["ideator/implementer_valid_rate"] = sum(a.code is not None for a in valid) / nv
        improved = 0
        for r in p.rollouts:
            new = rewards.valid_score(r.result)
            if new is None:
                continue
            tgt = self.ctx.targets[r.task_id]
            cur = tgt.baseline if r.action.current_score is None else r.action.current_score
            improved += improves(new, cur, tgt.lower_is_better)
        m["ideator/improve_rate"] = improved / n
        m["perf/implementer_seconds"] = self._impl_seconds.pop(p.step, 0.0)
        return m
