"""MLE-Ideator on the embedded default: train a tiny IDEATOR with GRPO, on one 2-core CPU.

  python launch/tpu_train.py --config=configs/ideator.py
  python launch/tpu_train.py --config=configs/ideator.py --config.ideator.implementer=run:runs/local

The same trainer as AceGRPO (``configs/local.py``, which this file starts from); ``mode = "ideator"``
makes ``launch/tpu_train.py`` plug in the ideator's environment
(``ace_jax.ideator.ideator_trainer.make_trainer``): the trained policy writes ideas
(``Analysis / Action / Rationale``) for buffer states, a FROZEN implementer turns each valid idea
into one script, the sandbox grades it, and ``ideator_ternary`` rewards the idea (+1 the
script beats the state's score, 0 not / failed, -1 malformed idea).

The implementer (``ideator.implementer``) defaults to ``"self"``: a frozen copy of this run's own
warm-started policy, so the run works offline. The warm start therefore teaches both roles: the
local code examples (draft / improve / debug), ideas synthesised from the measured weaker ->
stronger seed-corpus pairs (refine and revert), and the implementer step that follows such an
idea (``sft_examples.build_ideator_sft_examples``). Other implementers: ``"run:<dir>"`` (a trained
AceGRPO run), ``"hf:<dir>"``, ``"openai:<base_url>#<model>"``.

Only what differs from ``configs/local.py`` is set here; every key is documented in the
``default_config()`` of the module that reads it (``ace_jax.ideator.ideator_trainer`` for ``ideator``).
"""
import os

from ace_jax import config_utils
from ace_jax.ideator import ideator_trainer


def get_config():
    c = config_utils.load_config_file(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                   "local.py"))
    c.name = "ideator"
    c.mode = "ideator"                 # launch/tpu_train.py builds the ideator environment
    c.workdir = "runs/ideator"

    c.rl.reward = "ideator_ternary"
    c.rl.num_steps = 8
    c.rl.batch_states = 2              # B states per step
    c.rl.group_size = 4                # G ideas per state
    # The ideator advises implementer trajectories: seed the buffer with the reference solutions
    # (code + measured dev score) as well as the empty drafts.
    c.rl.seed_with_references = True
    c.rl.max_prompt_tokens = 768       # ideator prompts (task, attempts, script, format)

    c.sampling.max_new_tokens = 160    # an idea is ~60-110 tokens with the trained BPE
    c.optim.decay_steps = c.rl.num_steps
    # The library's LP prior (u0=1 inherited from the parent group, T=1 while exploring), not
    # local.py's sharper one: the README's ideator results were measured with it.
    c.lp.prior, c.lp.u0, c.lp.temperature_start = "parent", 1.0, 1.0
    c.lp.explore_steps = 3
    c.lp.anneal_steps = 6

    # The probe measures the code agent; the ideator is measured by evaluating its advice
    # (launch/evaluate.py, notebooks/ideator.ipynb).
    c.probe.every, c.probe.heldout_tasks = 0, ()

    c.ideator = ideator_trainer.default_config()
    c.ideator.implementer = "self"     # frozen copy of the warm-started policy (offline)
    c.ideator.implementer_max_new_tokens = 384   # a whole script
    c.ideator.implementer_temperature = 0.5      # = the local policy's RL temperature
    c.ideator.show_system = False      # short prompts for the tiny policy (as agent.show_system)

    # Warm start: local's code examples + the ideator examples (194 in all for the six tasks); the
    # implementer examples (prompt with advice + script, <= ~780 tokens) are the longest, hence
    # the 800 bucket. Measured once: after 300 steps, 39 of 40 ideas sampled at T=0.5 for
    # reference-solution states parse; after 62 steps (a capped run on a loaded machine), 1 of 64.
    c.sft.steps = 300
    c.sft.seconds = 600.0             # a safety net: 300 steps take ~5 min on 2 idle cores
    c.sft.buckets = (448, 800)
    return c
