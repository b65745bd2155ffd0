"""MLE-Ideator: the ideator's prompt, its strictly parsed answer, idea categories, the Advisor.

The implementer (the coding agent of ``ace_jax.env.agent``) asks for help with an ``AdviceRequest``
(``ace_jax.env.advice``); the ideator answers with ONE idea in a fixed, labelled format::

    Analysis: <refine|revert>: <one or two sentences>
    Action: <one concrete instruction or code change>
    Rationale: <why it should improve the dev score>

* ``render_ideator_messages(request, cfg)``: the chat messages for the ideator: the task brief
  (``agent.describe_task``), the implementer's attempts (kind, status, score, stderr tail), the
  current score and script, the goal and the required answer format (last, so a prompt cut from
  the left keeps it).
* ``parse_idea(text, cfg)``: an ``Idea`` or an ``IdeaFormatError`` (a typed reason from
  ``IdeaError`` and a detail), never an exception. The rules are listed on ``parse_idea``.
* ``idea_category(idea)``: one of ``CATEGORIES`` by a transparent keyword count
  (``CATEGORY_PATTERNS``; see the function).
* ``Ideator(policy, cfg)``: the ``advice.Advisor`` over any ``policy.ChatPolicy``: a policy error,
  a reply cut by the token budget or a malformed idea give ``Advice(valid=False, error=...)``.
* ``implementer_prompt_with_idea(state, task, idea, agent_cfg)``: the implementer's next-step
  messages carrying the idea (``agent.render_messages(..., advice=)``).
* ``build_ideator_sft_examples(tasks, ...)``: warm-start examples synthesised from the measured
  (weaker, stronger) seed-corpus pairs: "replace the weaker script's model line with the stronger
  one's" as a refine idea (and as a revert idea when the weaker script came after the stronger
  one), plus the implementer step that follows such an idea.

Nothing here imports JAX (``build_ideator_sft_examples`` imports ``ace_jax.train.sft`` lazily), so an
HTTP-only advisor needs none.
"""
from __future__ import annotations

import dataclasses
import enum
import json
import re
from typing import Any, Optional, Sequence, Union

import ml_collections

from ace_jax.env import agent
from ace_jax.env.advice import Advice, AdviceRequest, Attempt
from models.tokenizer import ENDOFTEXT, IM_END

FIELDS = ("Analysis", "Action", "Rationale")
VERBS = ("refine", "revert")
CATEGORIES = ("feature_engineering", "data_preparation", "model_choice", "hyperparameters",
              "ensembling", "other")
REASON_TEXT = {
    "seek_help": "The implementer asked for help.",
    "stagnation": "The implementer's score stopped improving.",
}
ADVICE_MODES = ("action", "action_rationale", "full")


def default_config() -> ml_collections.ConfigDict:
    """The ``ideator`` config section: how the ideator prompt is rendered and ideas are parsed.

    ``description`` and ``max_columns_chars`` have the meaning of the ``agent`` section's keys of
    the same names (the task brief is ``agent.describe_task(task, <this section>)``).
    """
    c = ml_collections.ConfigDict()
    # Prompt
    c.description = "brief"        # "full" (the task's markdown page) | "brief" (id, metric, columns)
    c.max_columns_chars = 80       # brief mode: feature / submission column lists are cut to this
    c.max_attempts = 4             # most recent implementer attempts shown (0: none)
    c.stderr_tail_chars = 160      # characters of a failed attempt's stderr tail shown
    c.max_code_chars = 4000        # the current script is cut at a line beyond this (marker added)
    c.show_system = True           # include the system turn (the ideator's role; ~40 tokens)
    # Parsing (parse_idea)
    c.min_field_chars = 3          # each field (Analysis after its verb, Action, Rationale)
    c.max_analysis_chars = 400     # Analysis text after the verb
    c.max_action_chars = 1200
    c.max_rationale_chars = 400
    # What the implementer is handed: "action" (the Action text), "action_rationale" (Action,
    # then "Why: <Rationale>") or "full" (the three fields as written).
    c.advice_text = "action"
    return c


# --------------------------------------------------------------------------------------------------
# Prompt

SYSTEM_PROMPT = (
    "You are an expert machine learning engineer advising an implementer agent that writes and "
    "runs Python solutions for a prediction task. You do not write the script: you give ONE idea "
    "for the implementer's next step that should improve the dev score.")

FORMAT_INSTRUCTIONS = (
    "Answer with exactly these three labelled lines, in this order, and nothing else:\n"
    "Analysis: <refine|revert>: <one or two sentences>\n"
    "Action: <one concrete instruction or code change>\n"
    "Rationale: <why it should improve the dev score>\n"
    "Use refine to build on the current script, revert to go back to an earlier, better one.")


def _score_text(score: Optional[float]) -> str:
    return "none" if score is None else f"{score:.4g}"


def _attempt_lines(attempts: Sequence[Attempt], cfg: ml_collections.ConfigDict) -> str:
    if cfg.max_attempts <= 0 or not attempts:
        return ""
    shown = list(attempts)[-cfg.max_attempts:]
    first = len(attempts) - len(shown) + 1
    lines = []
    for n, a in enumerate(shown, start=first):
        line = f"{n}. {a.kind}: {a.status}"
        if a.dev_score is not None:
            line += f", score {_score_text(a.dev_score)}"
        tail = (a.stderr_tail or "").strip()
        if a.status != "ok" and tail and cfg.stderr_tail_chars > 0:
            line += "\n   " + tail[-cfg.stderr_tail_chars:].replace("\n", " | ")
        lines.append(line)
    return "\n".join(lines)


def _code_block(code: str, max_chars: int) -> str:
    code = code.strip("\n")
    if max_chars > 0 and len(code) > max_chars:
        head = code[:max_chars]
        if "\n" in head:
            head = head[: head.rindex("\n")]
        code = head + "\n# ... (cut)"
    return f"{agent.FENCE}python\n{code}\n{agent.FENCE}"


def render_ideator_messages(request: AdviceRequest, cfg: Optional[ml_collections.ConfigDict] = None
                            ) -> list[dict[str, str]]:
    """The ideator's chat messages for ``request``.

    User turn, in order: the task brief, the goal (metric and direction, current best score), the
    implementer's attempts (oldest first, at most ``cfg.max_attempts``: kind, status, score, the
    stderr tail of failures), the current script, why help is asked, and the required answer
    format (last).

    Args:
      request: the ``advice.AdviceRequest`` (its ``task`` is a ``sandbox.tasks.base.Task``).
      cfg: the ``ideator`` section (``default_config()`` when None).

    Returns:
      [system (if cfg.show_system), user] message dicts.

    Raises:
      agent.AgentError: the config names an unknown description mode.
    """
    cfg = cfg or default_config()
    task = request.task
    direction = "lower is better" if task.lower_is_better else "higher is better"
    parts = [agent.describe_task(task, cfg),
             f"Goal: improve the dev score ({task.metric}, {direction}). "
             f"Current best score: {_score_text(request.current_score)}."]
    hist = _attempt_lines(request.attempts, cfg)
    if hist:
        parts.append(f"Implementer's attempts:\n{hist}")
    if request.current_code.strip():
        parts.append(f"Current script:\n{_code_block(request.current_code, cfg.max_code_chars)}")
    else:
        parts.append("Current script: none yet.")
    parts.append(REASON_TEXT.get(request.reason, f"Reason for help: {request.reason}."))
    parts.append(FORMAT_INSTRUCTIONS)
    messages = []
    if cfg.show_system:
        messages.append({"role": "system", "content": SYSTEM_PROMPT})
    messages.append({"role": "user", "content": "\n\n".join(parts)})
    return messages


def request_from_state(state: Any, task: Any, reason: str = "stagnation") -> AdviceRequest:
    """An ``AdviceRequest`` for a buffer ``State``: its history as attempts (their code is not
    stored in the buffer, so ``Attempt.code`` is empty), its best score and its (latest) code."""
    attempts = [Attempt(step=i, kind=h.action, code="", status=h.status, dev_score=h.score,
                        stderr_tail=h.stderr_tail or "")
                for i, h in enumerate(getattr(state, "history", None) or [])]
    return AdviceRequest(task=task, attempts=attempts, current_score=state.score,
                         current_code=state.code, reason=reason)


# --------------------------------------------------------------------------------------------------
# Ideas


class IdeaError(str, enum.Enum):
    """Why a reply is not a valid idea (stable strings, safe to log and to use as metric keys)."""

    EMPTY = "empty"                      # nothing but whitespace / special tokens
    TRUNCATED = "truncated"              # cut by the token budget (the caller says so)
    SPECIAL_TOKEN = "special_token"      # a chat special token (<|...|>) inside the text
    PREAMBLE = "preamble"                # text before the Analysis line
    BAD_LABEL = "bad_label"              # a field label in another spelling (**Action:**, action:)
    EXTRA_FIELD = "extra_field"          # another labelled line (Idea:, Note:, Code:, ...)
    MISSING_FIELD = "missing_field"      # one of the three labels is absent
    DUPLICATE_FIELD = "duplicate_field"  # a label appears twice
    WRONG_ORDER = "wrong_order"          # labels not in the order Analysis, Action, Rationale
    BAD_VERB = "bad_verb"                # Analysis does not start with "refine:" or "revert:"
    EMPTY_FIELD = "empty_field"          # a field (or the Analysis text after its verb) is blank
    TOO_SHORT = "too_short"              # a field shorter than min_field_chars
    TOO_LONG = "too_long"                # a field longer than its max_*_chars
    EXTRA_TEXT = "extra_text"            # a second paragraph in Analysis or after the Rationale


@dataclasses.dataclass(frozen=True)
class Idea:
    """A well-formed idea. ``verb`` is "refine" or "revert"; ``analysis`` is the text after it."""

    verb: str
    analysis: str
    action: str
    rationale: str

    @property
    def valid(self) -> bool:
        return True

    @property
    def category(self) -> str:
        return idea_category(self)

    def text(self) -> str:
        """The canonical text (``parse_idea(idea.text()) == idea``)."""
        return format_idea(self.verb, self.analysis, self.action, self.rationale)

    def advice(self, mode: str = "action") -> str:
        """What the implementer is handed (``ADVICE_MODES``)."""
        if mode == "action":
            return self.action
        if mode == "action_rationale":
            return f"{self.action}\nWhy: {self.rationale}"
        if mode == "full":
            return self.text()
        raise ValueError(f"advice mode must be one of {ADVICE_MODES}, got {mode!r}")


@dataclasses.dataclass(frozen=True)
class IdeaFormatError:
    """A reply that is not a valid idea: ``reason`` says how, ``detail`` in words."""

    reason: IdeaError
    detail: str = ""

    @property
    def valid(self) -> bool:
        return False

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


ParsedIdea = Union[Idea, IdeaFormatError]


def format_idea(verb: str, analysis: str, action: str, rationale: str) -> str:
    """The idea text in the required format (what ``parse_idea`` accepts).

    Raises:
      ValueError: an unknown verb.
    """
    if verb not in VERBS:
        raise ValueError(f"verb must be one of {VERBS}, got {verb!r}")
    return (f"Analysis: {verb}: {analysis.strip()}\nAction: {action.strip()}\n"
            f"Rationale: {rationale.strip()}")


_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)
_LABEL = re.compile(r"^(Analysis|Action|Rationale):(.*)$")
# A line that looks like a field label: optional markdown (#, *, -) around ONE capitalised word
# followed by a colon, or one of our three labels in any case / decoration.
_LABEL_LIKE = re.compile(r"^[#*_\s-]{0,6}([A-Za-z]+)[*_]{0,3}\s*:[*_]{0,3}(\s|$)")
_OUR_LABELS = {f.lower() for f in FIELDS}
_VERB = re.compile(r"^(refine|revert)\s*:\s*(.*)$", re.IGNORECASE | re.DOTALL)
_SPECIAL = re.compile(r"<\|[a-z_]+\|>")


def _strip_end(text: str) -> str:
    text = text.replace("\r\n", "\n").strip()
    changed = True
    while changed:
        changed = False
        for s in (IM_END, ENDOFTEXT):
            if text.endswith(s):
                text = text[: -len(s)].rstrip()
                changed = True
    return text


def parse_idea(text: str, cfg: Optional[ml_collections.ConfigDict] = None, *,
               truncated: bool = False) -> ParsedIdea:
    """Parses an ideator reply STRICTLY into an ``Idea`` or an ``IdeaFormatError`` (never raises
    on content).

    Normalisation: ``\\r\\n`` -> ``\\n``; surrounding whitespace and trailing ``<|im_end|>`` /
    ``<|endoftext|>`` are removed; a leading ``<think>...</think>`` block (a reasoning model's
    transport artefact) is dropped. Then, in this order:

    1. ``truncated`` (the caller saw the token budget run out) -> TRUNCATED; nothing left -> EMPTY;
       any other ``<|...|>`` special token -> SPECIAL_TOKEN.
    2. The first line must start with ``Analysis:`` -> else PREAMBLE.
    3. Outside fenced code blocks, every line that looks like a label (one word + colon, maybe in
       markdown ``**`` / ``#``) must be exactly ``Analysis:``, ``Action:`` or ``Rationale:`` at
       the start of the line: another spelling of those three -> BAD_LABEL, any other word
       (``Idea:``, ``Note:``, ``Code:``) -> EXTRA_FIELD.
    4. Each of the three labels exactly once (DUPLICATE_FIELD, MISSING_FIELD), in the order
       Analysis, Action, Rationale (WRONG_ORDER).
    5. Analysis is ``<refine|revert>: <text>`` (verb case-insensitive, stored lower-case) ->
       else BAD_VERB.
    6. Every field (Analysis after its verb) is non-blank (EMPTY_FIELD), at least
       ``cfg.min_field_chars`` long (TOO_SHORT) and at most ``cfg.max_<field>_chars`` (TOO_LONG).
    7. Analysis and Rationale are one paragraph each (no blank line inside; text after the
       Rationale's paragraph is trailing junk) -> EXTRA_TEXT. Action may span lines and
       paragraphs (a code change).

    Field texts are returned stripped; inner line breaks of Analysis / Rationale become spaces.

    Raises:
      TypeError: ``text`` is not a str (a caller bug, not a model outcome).
    """
    if not isinstance(text, str):
        raise TypeError(f"text must be str, got {type(text).__name__}")
    cfg = cfg or default_config()
    if truncated:
        return IdeaFormatError(IdeaError.TRUNCATED, "the reply was cut by the token budget")
    text = _strip_end(_THINK.sub("", _strip_end(text), count=1))
    if not text:
        return IdeaFormatError(IdeaError.EMPTY, "no text")
    m = _SPECIAL.search(text)
    if m:
        return IdeaFormatError(IdeaError.SPECIAL_TOKEN, f"special token {m.group(0)} in the text")
    lines = text.split("\n")
    if not lines[0].startswith("Analysis:"):
        return IdeaFormatError(IdeaError.PREAMBLE, f"the reply must start with 'Analysis:', "
                                                   f"got {lines[0][:40]!r}")
    found: list[tuple[str, int]] = []   # (label, line index)
    in_code = False
    for i, line in enumerate(lines):
        if line.lstrip().startswith(agent.FENCE):
            in_code = not in_code
            continue
        if in_code:
            continue
        m = _LABEL.match(line)
        if m:
            found.append((m.group(1), i))
            continue
        like = _LABEL_LIKE.match(line)
        if like:
            word = like.group(1)
            if word.lower() in _OUR_LABELS:
                return IdeaFormatError(IdeaError.BAD_LABEL,
                                       f"line {i + 1}: write the label as '{word.capitalize()}:' "
                                       f"at the start of the line, got {line[:40]!r}")
            if word[0].isupper():
                return IdeaFormatError(IdeaError.EXTRA_FIELD, f"line {i + 1}: unexpected field "
                                                              f"{word!r}")
    labels = [lab for lab, _ in found]
    for f in FIELDS:
        if labels.count(f) > 1:
            return IdeaFormatError(IdeaError.DUPLICATE_FIELD, f"{f!r} appears {labels.count(f)} times")
    missing = [f for f in FIELDS if f not in labels]
    if missing:
        return IdeaFormatError(IdeaError.MISSING_FIELD, f"missing {', '.join(missing)}")
    if labels != list(FIELDS):
        return IdeaFormatError(IdeaError.WRONG_ORDER, f"fields in the order {labels}, expected "
                                                      f"{list(FIELDS)}")
    bounds = [i for _, i in found] + [len(lines)]
    raw = {}
    for k, (label, start) in enumerate(found):
        first = _LABEL.match(lines[start]).group(2)
        raw[label] = "\n".join([first] + lines[start + 1:bounds[k + 1]]).strip()
    vm = _VERB.match(raw["Analysis"])
    if not vm:
        return IdeaFormatError(IdeaError.BAD_VERB, "Analysis must start with 'refine:' or "
                                                   f"'revert:', got {raw['Analysis'][:30]!r}")
    verb, analysis = vm.group(1).lower(), vm.group(2).strip()
    fields = {"Analysis": analysis, "Action": raw["Action"], "Rationale": raw["Rationale"]}
    limits = {"Analysis": cfg.max_analysis_chars, "Action": cfg.max_action_chars,
              "Rationale": cfg.max_rationale_chars}
    for name in FIELDS:
        value = fields[name]
        if not value:
            return IdeaFormatError(IdeaError.EMPTY_FIELD, f"{name} is empty")
        if len(value) < cfg.min_field_chars:
            return IdeaFormatError(IdeaError.TOO_SHORT, f"{name} has {len(value)} characters "
                                                        f"< {cfg.min_field_chars}")
        if limits[name] > 0 and len(value) > limits[name]:
            return IdeaFormatError(IdeaError.TOO_LONG, f"{name} has {len(value)} characters "
                                                       f"> {limits[name]}")
    for name in ("Analysis", "Rationale"):
        if re.search(r"\n\s*\n", fields[name]):
            where = "after the Rationale" if name == "Rationale" else "in the Analysis"
            return IdeaFormatError(IdeaError.EXTRA_TEXT, f"a second paragraph {where}")
        fields[name] = " ".join(fields[name].split())
    return Idea(verb=verb, analysis=fields["Analysis"], action=fields["Action"],
                rationale=fields["Rationale"])


# --------------------------------------------------------------------------------------------------
# Categories

# Each category is a list of case-insensitive regular expressions; see ``idea_category``.
CATEGORY_PATTERNS: dict[str, tuple[str, ...]] = {
    "ensembling": (
        r"\bensembl", r"\bstack(ing|ed)?\b|Stacking(Classifier|Regressor)", r"\bblend",
        r"\bvot(e|ing)\b|Voting(Classifier|Regressor)", r"\bbagging\b|Bagging(Classifier|Regressor)",
        r"\baverag\w*\b[^.]*\b(predictions|probabilities|models|outputs|seeds)\b",
    ),
    "feature_engineering": (
        r"\bfeature (engineering|selection|extraction|crosses|interactions?)\b",
        r"\b(new|extra|additional|derived|interaction|polynomial|engineered|ratio|aggregate)"
        r" features?\b",
        r"PolynomialFeatures|\bPCA\b|\bSVD\b|\bembeddings?\b",
        r"\bn-?grams?\b|ngram_range|\bbigrams?\b|\bchar(acter)?[- ]level\b|char_wb",
        r"\bTfidf(Vectorizer)?\b|\btf-?idf\b|CountVectorizer|\bbag of words\b",
        r"\b(log|sqrt|box-?cox|power) transform", r"\b(lag|rolling|date|time|text) features?\b",
        r"\btarget encod|\bone-?hot\b|OneHotEncoder",
    ),
    "data_preparation": (
        r"\bscal(e|es|ed|ing)\b|StandardScaler|MinMaxScaler|RobustScaler",
        r"\bnormali[sz]|\bstandardi[sz]",
        r"\bimput|SimpleImputer|\bmissing values?\b|\bfillna\b|\bNaNs?\b",
        r"\boutliers?\b|\bclip(ping)? (the )?(target|values)\b", r"\bclean(ing|s)?\b",
        r"\b(over|under|re)-?sampl|\bSMOTE\b|\baugment", r"\bclass[_ ]weight|\bimbalanc",
        r"\bdeduplicat|\bduplicates?\b", r"\bstratif",
        r"\bcross-?validat|\bk-?fold\b|\bhold-?out\b|\btrain(ing)? split\b|\btest_size\b",
    ),
    "hyperparameters": (
        r"\bhyper-?param", r"\btun(e|ed|ing)\b", r"\bgrid ?search|GridSearchCV|RandomizedSearchCV|\boptuna\b",
        r"\blearning[_ ]rate\b", r"\bn_estimators\b|\bnumber of (trees|estimators|neighbou?rs|iterations|epochs)\b",
        r"\bmax_depth\b|\b(tree )?depth\b", r"\bmax_iter\b|\bepochs?\b|\biterations\b",
        r"\bn_neighbors\b|\bneighbou?rs\b", r"\bregulari[sz]", r"(?<![A-Za-z_])(C|alpha|gamma|l2)\s*=",
        r"\bmin_samples_(leaf|split)\b", r"\b(increase|decrease|raise|lower|reduce)\b",
    ),
    "model_choice": (
        r"\b(replace|switch|swap|change)\b[^.]*\b(model|classifier|regressor|estimator)",
        r"\b(switch|move|change) to\b",
        r"random ?forest|extra ?trees|gradient ?boosting|\bxgb|xgboost|lightgbm|\blgbm|catboost",
        r"logistic ?regression|linear ?regression|\bridge\b|\blasso\b|elastic ?net|\bsvm\b|\bsv[cr]\b|linearsvc",
        r"\bk-?nearest|kneighbors|\bknn\b", r"decision ?tree", r"naive ?bayes|gaussiannb|multinomialnb",
        r"neural (net|network)|\bmlp\w*|\bcnn\b|\btransformer\b", r"\bdummy\w*",
    ),
}
_CATEGORY_PRIORITY = ("ensembling", "feature_engineering", "data_preparation", "hyperparameters",
                      "model_choice")
_COMPILED = {k: tuple(re.compile(p, re.IGNORECASE) for p in v) for k, v in CATEGORY_PATTERNS.items()}


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline backtick spans."""
    text = re.sub(r"```.*?(```|$)", " ", text, flags=re.DOTALL)
    return re.sub(r"`[^`\n]*`", " ", text)


def category_scores(text: str) -> dict[str, int]:
    """For each category, how many of its ``CATEGORY_PATTERNS`` match ``text`` (each pattern
    counts once, however often it matches)."""
    return {k: sum(1 for p in pats if p.search(text)) for k, pats in _COMPILED.items()}


def idea_category(idea: Union[Idea, str]) -> str:
    """The idea's category, one of ``CATEGORIES``.

    A transparent keyword classifier: every category has a list of regular expressions
    (``CATEGORY_PATTERNS``); the score of a category is the number of its patterns that match a
    text (``category_scores``). Ensembling is decisive (an ensemble idea names the models it
    combines, which would otherwise count for model_choice): any ensembling match wins. Else the
    category with the highest score wins; ties go to the earlier of feature_engineering,
    data_preparation, hyperparameters, model_choice (the more specific intent first). The texts
    tried, in order, until one matches anything:

    1. the Action's prose: the Action with its code (backtick spans and fenced blocks) removed,
       so the parameter names inside a quoted code line do not outvote what the sentence says;
    2. the whole Action, code included;
    3. the Rationale and the Analysis.

    When nothing matches, "other". A plain string is classified as if it were the Action.
    """
    action = idea if isinstance(idea, str) else idea.action
    texts = [_prose(action), action]
    if not isinstance(idea, str):
        texts.append(f"{idea.rationale}\n{idea.analysis}")
    for text in texts:
        scores = category_scores(text)
        if scores["ensembling"] > 0:
            return "ensembling"
        best = max(scores.values())
        if best > 0:
            return next(k for k in _CATEGORY_PRIORITY if scores[k] == best)
    return "other"


# --------------------------------------------------------------------------------------------------
# The advisor


class Ideator:
    """An ``advice.Advisor`` over any ``policy.ChatPolicy`` (a JAX policy, an OpenAI endpoint).

    ``advise(request, seed=)`` renders ``render_ideator_messages``, asks the policy for one reply
    and parses it. Never raises for the policy's behaviour: a Completion with ``error``, an
    exception from the policy, a reply cut by the token budget (``finish_reason == "length"``)
    or a malformed idea all give ``Advice(instruction=None, valid=False, error=...)``.
    """

    def __init__(self, policy: Any, cfg: Optional[ml_collections.ConfigDict] = None):
        self.policy = policy
        self.cfg = cfg or default_config()
        if self.cfg.advice_text not in ADVICE_MODES:
            raise ValueError(f"ideator.advice_text must be one of {ADVICE_MODES}, "
                             f"got {self.cfg.advice_text!r}")

    def messages(self, request: AdviceRequest) -> list[dict[str, str]]:
        return render_ideator_messages(request, self.cfg)

    def advise(self, request: AdviceRequest, *, seed: int = 0) -> Advice:
        return self.advise_batch([request], seed=seed)[0]

    def advise_batch(self, requests: Sequence[AdviceRequest], *, seed: int = 0) -> list[Advice]:
        """``advise`` for several requests in one policy call (one batch for a JAX policy)."""
        if not requests:
            return []
        try:
            completions = self.policy.complete([self.messages(r) for r in requests], seed=seed)
            if len(completions) != len(requests):
                raise RuntimeError(f"the policy returned {len(completions)} replies for "
                                   f"{len(requests)} conversations")
        except Exception as e:  # noqa: BLE001 - an advisor must not crash the episode
            err = f"policy error: {type(e).__name__}: {str(e)[:200]}"
            return [Advice(instruction=None, valid=False, error=err) for _ in requests]
        return [self.advice_from_completion(c) for c in completions]

    def advice_from_completion(self, completion: Any) -> Advice:
        """The ``Advice`` of one ``policy.Completion``."""
        if getattr(completion, "error", None):
            return Advice(instruction=None, valid=False, error=f"policy error: {completion.error}",
                          raw=completion.text or "")
        text = completion.text or ""
        parsed = parse_idea(text, self.cfg,
                            truncated=getattr(completion, "finish_reason", "stop") == "length")
        if not parsed.valid:
            return Advice(instruction=None, valid=False, error=f"format: {parsed}", raw=text)
        return Advice(instruction=parsed.advice(self.cfg.advice_text), valid=True,
                      category=idea_category(parsed), raw=text)


def implementer_prompt_with_idea(state: Any, task: Any, idea: Union[Idea, str],
                                 agent_cfg: Optional[ml_collections.ConfigDict] = None, *,
                                 advice_text: str = "action") -> list[dict[str, str]]:
    """The implementer's messages for its next step from ``state``, carrying ``idea`` (an
    ``Idea``, rendered per ``advice_text``, or an instruction string) as the expert advice."""
    text = idea if isinstance(idea, str) else idea.advice(advice_text)
    return agent.render_messages(state, task, agent_cfg, advice=text)


# --------------------------------------------------------------------------------------------------
# Warm-start examples


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
        analysis = (f"the last change lowered the score from {_score_text(strong_score)} to "
                    f"{_score_text(weak_score)}; go back to the earlier model.")
        rationale = "The earlier model scored better on the dev split, so restoring it recovers " \
                    "the lost score."
        return format_idea("revert", analysis, action, rationale)
    analysis = (f"the current model scores {_score_text(weak_score)}; the next step is to improve "
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
