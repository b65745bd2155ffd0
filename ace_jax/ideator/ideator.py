"""MLE-Ideator's ideas: the ``ideator`` config section, the idea format, its strict parser and
the idea categories.

The implementer (the coding agent of ``ace_jax.env.agent``) asks for help with an ``AdviceRequest``
(``ace_jax.env.advice``); the ideator answers with ONE idea in a fixed, labelled format::

    Analysis: <refine|revert>: <one or two sentences>
    Action: <one concrete instruction or code change>
    Rationale: <why it should improve the dev score>

* ``parse_idea(text, cfg)``: an ``Idea`` or an ``IdeaFormatError`` (a typed reason from
  ``IdeaError`` and a detail), never an exception. The rules are listed on ``parse_idea``.
  ``format_idea`` writes the format.
* ``idea_category(idea)``: one of ``CATEGORIES`` by a transparent keyword count
  (``CATEGORY_PATTERNS``; see the function).

The rest of MLE-Ideator: the ideator's prompt (``ace_jax.ideator.prompts``), the
``advice.Advisor`` over a policy (``ace_jax.ideator.advisor.Ideator``) and its warm-start examples
(``ace_jax.ideator.sft_examples``). Nothing here imports JAX, so an HTTP-only advisor needs none.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from typing import Optional, Union

import ml_collections

from ace_jax.env import agent
from models.tokenizer import ENDOFTEXT, IM_END

FIELDS = ("Analysis", "Action", "Rationale")
VERBS = ("refine", "revert")
CATEGORIES = ("feature_engineering", "data_preparation", "model_choice", "hyperparameters",
              "ensembling", "other")
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
