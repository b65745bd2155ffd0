"""The MLE-Ideator's warm-start examples (``build_ideator_sft_examples``), synthesised from the
measured (weaker, stronger) seed-corpus pairs: "replace the weaker script's model line with the
stronger one's" as a refine idea (and as a revert idea when the weaker script came after the
stronger one), plus the implementer step that follows such an idea.

Nothing here imports JAX at import time (``build_ideator_sft_examples`` imports
``ace_jax.train.sft`` lazily).
"""
from __future__ import annotations

import json
import re
from typing import Any, Optional, Sequence

import ml_collections

from ace_jax.env import agent
from ace_jax.ideator.ideator import default_config, format_idea, idea_category, parse_idea
from ace_jax.ideator.prompts import render_ideator_messages, request_from_state, score_text

_CLASS = re.compile(r"\b([A-Z][A-Za-z0-9_]*)\(")
_PREP = re.compile(r"Scaler|Vectorizer|Imputer|Encoder|PolynomialFeatures|PCA|Transformer")


def _model_line(code: str) -> Optional[str]:
    lines = [ln.strip() for ln in code.splitlines() if ln.strip().startswith("model = ")]
    return lines[0] if len(lines) == 1 else None


def _new_imports(weak: str, strong: str) -> list[str]:
    have = {ln.strip() for ln in weak.splitlines()}
    return [ln.strip() for ln in strong.splitlines()
            if ln.strip().startswith(("import ", "from ")) and ln.strip() not in have]


_RATIONALES = {
    "model_choice": "a stronger model family fits this data better than the current one, so the "
                    "dev score should improve.",
    "hyperparameters": "the current setting under-fits or over-fits; the new value should "
                       "generalise better on the dev split.",
    "data_preparation": "scaled inputs let the model weigh every feature fairly, which should "
                        "improve the dev score.",
    "feature_engineering": "richer features give the model more signal, so the dev score should "
                           "improve.",
    "ensembling": "averaging several models reduces variance, so the dev score should improve.",
    "other": "the change removes a weakness of the current script, so the dev score should "
             "improve.",
}


def synthesise_idea(weak_code: str, strong_code: str, weak_score: Optional[float],
                    strong_score: Optional[float], *, revert: bool = False) -> Optional[str]:
    """An idea text turning ``weak_code`` into ``strong_code`` (seed-corpus scripts that differ in
    their single ``model = ...`` line), or None when they do not.

    refine: "the current model scores <weak>; ..." / Action: replace the model line (and add the
    imports it needs). revert (the weaker script came after the stronger one): "the last change
    lowered the score from <strong> to <weak>; ..." / Action: go back to the earlier model line.
    """
    w, s = _model_line(weak_code), _model_line(strong_code)
    if w is None or s is None or w == s:
        return None
    imports = _new_imports(weak_code, strong_code)
    classes_w, classes_s = set(_CLASS.findall(w)), set(_CLASS.findall(s))
    est_w, est_s = (sorted(c for c in cs if not _PREP.search(c)) for cs in (classes_w, classes_s))
    added_prep = sorted(c for c in classes_s - classes_w if _PREP.search(c))
    if est_w != est_s:
        lead = f"Switch the model from {' + '.join(est_w)} to {' + '.join(est_s)}"
    elif added_prep:
        lead = f"Add {' + '.join(added_prep)} before the {' + '.join(est_s)} and adjust its settings"
    else:
        lead = f"Tune the {' + '.join(est_s)} hyperparameters"
    action = f"{lead}: replace `{w}` with `{s}`"
    if imports:
        action += " and add " + ", ".join(f"`{i}`" for i in imports)
    action += "."
    category = idea_category(action)
    if revert:
        analysis = (f"the last change lowered the score from {score_text(strong_score)} to "
                    f"{score_text(weak_score)}; go back to the earlier model.")
        rationale = "The earlier model scored better on the dev split, so restoring it recovers " \
                    "the lost score."
        return format_idea("revert", analysis, action, rationale)
    analysis = (f"the current model scores {score_text(weak_score)}; the next step is to improve "
                f"the {category.replace('_', ' ')}.")
    return format_idea("refine", analysis, action, _RATIONALES[category].capitalize())


IDEATOR_SFT_KINDS = ("idea", "idea_revert", "advised_improve")


def _measured_pairs(seed: int) -> list[dict]:
    from sandbox import seed_corpus

    path = seed_corpus.RESULTS_DIR / f"seed{seed}" / "pairs.json"
    if not path.exists():
        return []
    return [r for r in json.loads(path.read_text()) if r.get("improves")]


def build_ideator_sft_examples(tasks: Sequence[Any], agent_cfg: Optional[ml_collections.ConfigDict]
                               = None, ideator_cfg: Optional[ml_collections.ConfigDict] = None, *,
                               kinds: Sequence[str] = IDEATOR_SFT_KINDS,
                               seed_corpus_seed: int = 0) -> list:
    """Warm-start examples (``ace_jax.train.sft.SFTExample``) for the ideator format, from the measured
    improving (weaker, stronger) pairs of the seed corpus (``sandbox/seed_corpus``).

    Kinds:
      idea: ideator prompt for a state holding the weaker script (history: one ok draft with its
        dev score) -> a refine idea "replace the model line with the stronger script's".
      idea_revert: the state ran the stronger script, then the weaker one (a worse score) -> a
        revert idea back to the stronger model line.
      advised_improve: the implementer prompt for the weaker state carrying the refine idea's
        Action as advice -> the stronger script (teaches the implementer to follow an idea).

    Prompts are rendered exactly as the trainer renders them (``render_ideator_messages`` of
    ``request_from_state`` with reason "stagnation"; ``agent.render_prompt``); completions are the
    exact texts ``parse_idea`` / ``agent.parse_action`` accept.
    """
    from ace_jax.curriculum.buffer import State, StepSummary
    from ace_jax.train import sft
    from models.tokenizer import render_chat
    from sandbox.seed_corpus import CORPUS_DIR

    unknown = set(kinds) - set(IDEATOR_SFT_KINDS)
    if unknown:
        raise ValueError(f"unknown ideator SFT kinds {sorted(unknown)}; expected a subset of "
                         f"{IDEATOR_SFT_KINDS}")
    ideator_cfg = ideator_cfg or default_config()
    by_id = {t.task_id: t for t in tasks}
    out = []

    def state(task_id, code, history, score):
        return State(state_id=0, task_id=task_id, parent_id=None, depth=len(history), code=code,
                     history=history, score=score, origin="seed", created_step=0)

    def ideator_prompt(st, task):
        msgs = render_ideator_messages(request_from_state(st, task), ideator_cfg)
        return render_chat(msgs, add_generation_prompt=True, enable_thinking=False)

    for row in _measured_pairs(seed_corpus_seed):
        task = by_id.get(row["task_id"])
        if task is None:
            continue
        weak = (CORPUS_DIR / task.task_id / row["weak"]).read_text()
        strong = (CORPUS_DIR / task.task_id / row["strong"]).read_text()
        wd, sd = float(row["weak_dev"]), float(row["strong_dev"])
        refine = synthesise_idea(weak, strong, wd, sd)
        if refine is None:
            continue
        st = state(task.task_id, weak, [StepSummary("draft", "ok", wd, "")], wd)
        if "idea" in kinds:
            out.append(sft.SFTExample(ideator_prompt(st, task), refine, "idea", task.task_id))
        if "idea_revert" in kinds:
            hist = [StepSummary("draft", "ok", sd, ""), StepSummary("improve", "ok", wd, "")]
            rst = state(task.task_id, weak, hist, sd)  # "improves": the stronger is the best
            text = synthesise_idea(weak, strong, wd, sd, revert=True)
            out.append(sft.SFTExample(ideator_prompt(rst, task), text, "idea_revert",
                                      task.task_id))
        if "advised_improve" in kinds:
            idea = parse_idea(refine, ideator_cfg)
            advice = idea.advice(ideator_cfg.advice_text)
            prompt = agent.render_prompt(st, task, agent_cfg, advice=advice)
            out.append(sft.SFTExample(prompt, agent.completion_target(strong), "advised_improve",
                                      task.task_id))
    return out
