"""Baseline scripts of the procedural task family, rendered on demand from each instance's schema.

``baseline_scripts(task_id)`` returns 8 short scikit-learn scripts for any procedural instance
(train, held-out or held-out family): they are the "teams" of its reference leaderboard
(``python -m sandbox.procedural_sweep``). Only those of the **training** instances are seed
scripts, i.e. SFT corpus (``sandbox.seed_corpus.list_scripts`` refuses a held-out instance).
Nothing is written to disk: a script is a pure function of the instance, like its data.

Every script has the offline corpus's shape (``sandbox/seed_corpus/generate.py``): read
``./input``, find the id / target / feature columns in the data (``render``), impute + scale
numeric columns, impute + one-hot categorical ones, count-vectorise a token column, hold out
20 % of train, print ``VALIDATION_METRIC: <float>``, refit on all of train, write
``./submission/submission.csv``.
"""
from __future__ import annotations

import functools
import json

from sandbox.seed_corpus import SeedScript

CLASSIFIERS = (
    ("dummy", "from sklearn.dummy import DummyClassifier", "DummyClassifier(strategy=\"{dummy}\")"),
    ("logreg_c0.1", "from sklearn.linear_model import LogisticRegression",
     "LogisticRegression(C=0.1, max_iter=1000)"),
    ("logreg_c10", "from sklearn.linear_model import LogisticRegression",
     "LogisticRegression(C=10.0, max_iter=1000)"),
    ("knn15", "from sklearn.neighbors import KNeighborsClassifier",
     "KNeighborsClassifier(n_neighbors=15)"),
    ("tree_depth3", "from sklearn.tree import DecisionTreeClassifier",
     "DecisionTreeClassifier(max_depth=3, random_state=0)"),
    ("rf50", "from sklearn.ensemble import RandomForestClassifier",
     "RandomForestClassifier(n_estimators=50, min_samples_leaf=2, random_state=0)"),
    ("extra_trees", "from sklearn.ensemble import ExtraTreesClassifier",
     "ExtraTreesClassifier(n_estimators=50, min_samples_leaf=2, random_state=0)"),
    ("hgb", "from sklearn.ensemble import HistGradientBoostingClassifier",
     "HistGradientBoostingClassifier(max_iter=100, random_state=0)"),
)
REGRESSORS = (
    ("mean", "from sklearn.dummy import DummyRegressor", "DummyRegressor(strategy=\"mean\")"),
    ("ridge_a100", "from sklearn.linear_model import Ridge", "Ridge(alpha=100.0)"),
    ("ridge_a1", "from sklearn.linear_model import Ridge", "Ridge(alpha=1.0)"),
    ("knn10", "from sklearn.neighbors import KNeighborsRegressor",
     "KNeighborsRegressor(n_neighbors=10, weights=\"distance\")"),
    ("tree_depth4", "from sklearn.tree import DecisionTreeRegressor",
     "DecisionTreeRegressor(max_depth=4, random_state=0)"),
    ("rf50", "from sklearn.ensemble import RandomForestRegressor",
     "RandomForestRegressor(n_estimators=50, min_samples_leaf=2, random_state=0)"),
    ("extra_trees", "from sklearn.ensemble import ExtraTreesRegressor",
     "ExtraTreesRegressor(n_estimators=50, min_samples_leaf=2, random_state=0)"),
    ("hgb", "from sklearn.ensemble import HistGradientBoostingRegressor",
     "HistGradientBoostingRegressor(max_iter=100, random_state=0)"),
)
# (weak, strong) model names; the sweep's dev scores say which really improve.
CLASSIFIER_PAIRS = (("dummy", "logreg_c10"), ("logreg_c0.1", "logreg_c10"), ("tree_depth3", "rf50"),
                    ("knn15", "hgb"), ("extra_trees", "hgb"))
REGRESSOR_PAIRS = (("mean", "ridge_a1"), ("ridge_a100", "ridge_a1"), ("tree_depth4", "rf50"),
                   ("knn10", "hgb"), ("extra_trees", "hgb"))

#: Modules a warm sandbox interpreter should import for these scripts (``procedural_sweep``).
PRELOAD = ("numpy", "pandas", "sklearn.compose", "sklearn.dummy", "sklearn.ensemble",
           "sklearn.feature_extraction.text", "sklearn.impute", "sklearn.linear_model",
           "sklearn.metrics", "sklearn.model_selection", "sklearn.neighbors", "sklearn.pipeline",
           "sklearn.preprocessing", "sklearn.tree")

_METRIC_IMPORT = {
    "log_loss": "from sklearn.metrics import log_loss",
    "macro_f1": "from sklearn.metrics import f1_score",
    "accuracy": "from sklearn.metrics import accuracy_score",
    "auc": "from sklearn.metrics import roc_auc_score",
}
_VAL_LINES = {
    "log_loss": ["score = log_loss(y_va, model.predict_proba(X_va), labels=model.classes_)"],
    "macro_f1": ["score = f1_score(y_va, model.predict(X_va), average=\"macro\")"],
    "accuracy": ["score = accuracy_score(y_va, model.predict(X_va))"],
    "auc": ["score = roc_auc_score(y_va, model.predict_proba(X_va)[:, 1])"],
    "rmse": ["score = np.sqrt(np.mean((model.predict(X_va) - y_va) ** 2))"],
    "mae": ["score = np.mean(np.abs(model.predict(X_va) - y_va))"],
    "rmsle": ["pred = np.clip(model.predict(X_va), 0, None)",
              "score = np.sqrt(np.mean((np.log1p(pred) - np.log1p(y_va)) ** 2))"],
}


def _spec(task_id: str):
    from sandbox.tasks import procedural
    from sandbox.tasks.procedural_schema import make_spec, parse_task_id

    if task_id not in set(procedural.all_ids()):
        raise KeyError(f"{task_id!r} is not a registered procedural instance")
    return make_spec(*parse_task_id(task_id))


def models_for(task_id: str):
    """(models, pairs) of an instance: classifiers or regressors."""
    spec = _spec(task_id)
    if spec.target_type == "regression":
        return REGRESSORS, REGRESSOR_PAIRS
    return CLASSIFIERS, CLASSIFIER_PAIRS


def script_name(i: int, model: str) -> str:
    return f"{i:02d}_{model.replace('.', '')}.py"


def _list_literal(names: list[str], indent: int) -> str:
    items = [json.dumps(n) for n in names]
    lines, cur = [], ""
    for it in items:
        piece = it + ", "
        if cur and len(cur) + len(piece) + indent > 96:
            lines.append(cur.rstrip())
            cur = ""
        cur += piece
    lines.append(cur.rstrip().rstrip(","))
    return "[" + ("\n" + " " * (indent + 1)).join(lines) + "]"


def _merge_imports(lines: set[str]) -> list[str]:
    """``from m import a`` lines merged per module, sorted."""
    by_mod: dict[str, set[str]] = {}
    for line in lines:
        mod, names = line[len("from "):].split(" import ")
        by_mod.setdefault(mod, set()).update(n.strip() for n in names.split(","))
    return [f"from {m} import {', '.join(sorted(ns))}" for m, ns in sorted(by_mod.items())]


def render(task_id: str, name: str, imports: str, ctor: str) -> str:
    """One baseline script for instance ``task_id`` with the model ``ctor``.

    The script reads the column roles from the data, not from a list of this instance's names:
    the id is test.csv's first column, the target the train.csv column test.csv lacks, the
    numeric features those pandas reads as numbers and the rest categorical (a token column,
    in the held-out family only, is named and count-vectorised). So the script of one model
    and one metric is the same text on every instance of the training kinds, and a policy that
    reads the prompt's metric can write a valid one for an instance it never saw: the prompt
    (``ace_jax.env.agent.brief_description``) names the columns but not their types."""
    spec = _spec(task_id)
    metric = spec.metric
    classification = spec.target_type != "regression"
    kind = {"log_loss": "proba", "auc": "score"}.get(metric, "label" if classification else "real")
    ctor = ctor.format(dummy="prior" if kind in ("proba", "score") else "most_frequent")
    text = spec.text_column
    sk = {imports, "from sklearn.compose import ColumnTransformer",
          "from sklearn.impute import SimpleImputer",
          "from sklearn.model_selection import train_test_split",
          "from sklearn.pipeline import make_pipeline",
          "from sklearn.preprocessing import OneHotEncoder, StandardScaler"}
    parts = ["(\"num\", make_pipeline(SimpleImputer(strategy=\"median\"), StandardScaler()), NUM)",
             "(\"cat\", make_pipeline(SimpleImputer(strategy=\"most_frequent\"), "
             "OneHotEncoder(handle_unknown=\"ignore\")), CAT)"]
    if text:
        sk.add("from sklearn.feature_extraction.text import CountVectorizer")
        parts.append("(\"text\", CountVectorizer(token_pattern=r\"\\S+\"), TEXT)")
    if metric in _METRIC_IMPORT:
        sk.add(_METRIC_IMPORT[metric])
    lines = ["import os", "", "import numpy as np", "import pandas as pd"]
    lines += _merge_imports(sk) + ["", "train = pd.read_csv(\"./input/train.csv\")",
                           "test = pd.read_csv(\"./input/test.csv\")",
                           "ID = test.columns[0]",
                           "TARGET = [c for c in train.columns if c not in test.columns][0]",
                           "X, y = train.drop(columns=[ID, TARGET]), train[TARGET]",
                           "X_test = test.drop(columns=[ID])"]
    if text:
        lines.append(f"TEXT = {json.dumps(text)}")
    lines += ["NUM = list(X.select_dtypes(\"number\").columns)",
              "CAT = [c for c in X.columns if c not in NUM"
              + (" and c != TEXT]" if text else "]"),
              "prep = ColumnTransformer([\n    " + ",\n    ".join(parts) + "],\n"
              "    sparse_threshold=0)",
              f"model = make_pipeline(prep, {ctor})"]
    strat = ", stratify=y" if classification else ""
    lines += ["X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, "
              f"random_state=0{strat})",
              "model.fit(X_tr, y_tr)", *_VAL_LINES[metric],
              "print(f\"VALIDATION_METRIC: {score:.5f}\")", "", "model.fit(X, y)"]
    if kind == "proba":
        lines += [("sub = pd.DataFrame(model.predict_proba(X_test), "
                   "columns=[str(c) for c in model.classes_])"),
                  "sub.insert(0, ID, test[ID])"]
    elif kind == "score":
        lines.append("sub = pd.DataFrame({ID: test[ID], "
                     "TARGET: model.predict_proba(X_test)[:, 1]})")
    elif metric == "rmsle":
        lines.append("sub = pd.DataFrame({ID: test[ID], "
                     "TARGET: np.clip(model.predict(X_test), 0, None)})")
    else:
        lines.append("sub = pd.DataFrame({ID: test[ID], TARGET: model.predict(X_test)})")
    lines += ["os.makedirs(\"./submission\", exist_ok=True)",
              "sub.to_csv(\"./submission/submission.csv\", index=False)"]
    doc = f"\"\"\"{name.replace('_', ' ')} baseline.\"\"\""
    return doc + "\n" + "\n".join(lines) + "\n"


def baseline_scripts(task_id: str) -> list[SeedScript]:
    """The 8 baseline scripts of any registered procedural instance, ordered by file name.

    KeyError for an id that is not a registered procedural instance."""
    return list(_baseline_scripts(task_id))


@functools.lru_cache(maxsize=None)
def _baseline_scripts(task_id: str) -> tuple[SeedScript, ...]:
    models, _ = models_for(task_id)
    return tuple(SeedScript(task_id, script_name(i, name), render(task_id, name, imports, ctor))
                 for i, (name, imports, ctor) in enumerate(models, start=1))


def declared_pairs(task_id: str) -> list[tuple[str, str]]:
    """(weaker, stronger) script file names of an instance."""
    models, pairs = models_for(task_id)
    names = {m[0]: script_name(i, m[0]) for i, m in enumerate(models, start=1)}
    return [(names[w], names[s]) for w, s in pairs]
