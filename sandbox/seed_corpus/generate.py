"""Writes the seed corpus: ~10 short, uniform baseline scripts per offline task.

Run ``python -m sandbox.seed_corpus.generate`` after changing a task's columns or the model list;
the outputs (``sandbox/seed_corpus/<task_id>/NN_<model>.py`` and ``pairs.json``) are committed as
plain files. Every script has the same shape: read ./input, hold out 20 % of train, fit, print
``VALIDATION_METRIC: <float>``, refit on all of train, write ./submission/submission.csv.
"""
from __future__ import annotations

import json
import pathlib

CORPUS_DIR = pathlib.Path(__file__).resolve().parent

# task_id -> (kind, target column(s), extra drop columns, text column or None, metric)
TASKS = {
    "iris-species": ("proba", "species", [], None, "log_loss"),
    "wine-cultivar": ("label", "cultivar", [], None, "macro_f1"),
    "wine-alcohol": ("real", "alcohol", [], None, "mae"),
    "breast-cancer-diagnosis": ("score", "malignant", [], None, "auc"),
    "digits-8x8": ("proba", "digit", [], None, "log_loss"),
    "diabetes-progression": ("real", "progression", [], None, "rmse"),
    "linnerud-physiology": ("multi", ["weight", "waist", "pulse"], [], None, "mae"),
    "photo-patches": ("label", "photo", [], None, "accuracy"),
    "terrain-elevation": ("real", "elevation_m", [], None, "rmse"),
    "coastal-topobathy": ("real", "height_m", [], None, "rmse"),
    "goog-volume": ("real", "log_volume", ["date"], None, "rmse"),
    "support-tickets": ("label", "category", [], "text", "macro_f1"),
    "sensor-forecast": ("real", "next_value", [], None, "mae"),
}

# name -> (imports, constructor). Classifiers, regressors and text pipelines.
CLASSIFIERS = [
    ("dummy", "from sklearn.dummy import DummyClassifier", "DummyClassifier(strategy=\"{dummy}\")"),
    ("logreg_c0.01", "from sklearn.linear_model import LogisticRegression\n"
     "from sklearn.pipeline import make_pipeline\nfrom sklearn.preprocessing import StandardScaler",
     "make_pipeline(StandardScaler(), LogisticRegression(C=0.01, max_iter=2000))"),
    ("logreg_c1", "from sklearn.linear_model import LogisticRegression\n"
     "from sklearn.pipeline import make_pipeline\nfrom sklearn.preprocessing import StandardScaler",
     "make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))"),
    ("knn1", "from sklearn.neighbors import KNeighborsClassifier",
     "KNeighborsClassifier(n_neighbors=1)"),
    ("knn15_scaled", "from sklearn.neighbors import KNeighborsClassifier\n"
     "from sklearn.pipeline import make_pipeline\nfrom sklearn.preprocessing import StandardScaler",
     "make_pipeline(StandardScaler(), KNeighborsClassifier(n_neighbors=15))"),
    ("tree_depth3", "from sklearn.tree import DecisionTreeClassifier",
     "DecisionTreeClassifier(max_depth=3, random_state=0)"),
    ("naive_bayes", "from sklearn.naive_bayes import GaussianNB", "GaussianNB()"),
    ("rf50", "from sklearn.ensemble import RandomForestClassifier",
     "RandomForestClassifier(n_estimators=50, random_state=0)"),
    ("rf300", "from sklearn.ensemble import RandomForestClassifier",
     "RandomForestClassifier(n_estimators=300, min_samples_leaf=2, random_state=0)"),
    ("hgb", "from sklearn.ensemble import HistGradientBoostingClassifier",
     "HistGradientBoostingClassifier(max_iter=100, random_state=0)"),
]
REGRESSORS = [
    ("mean", "from sklearn.dummy import DummyRegressor", "DummyRegressor(strategy=\"mean\")"),
    ("linear", "from sklearn.linear_model import LinearRegression", "LinearRegression()"),
    ("ridge_scaled", "from sklearn.linear_model import Ridge\n"
     "from sklearn.pipeline import make_pipeline\nfrom sklearn.preprocessing import StandardScaler",
     "make_pipeline(StandardScaler(), Ridge(alpha=1.0))"),
    ("knn1", "from sklearn.neighbors import KNeighborsRegressor", "KNeighborsRegressor(n_neighbors=1)"),
    ("knn10_scaled", "from sklearn.neighbors import KNeighborsRegressor\n"
     "from sklearn.pipeline import make_pipeline\nfrom sklearn.preprocessing import StandardScaler",
     "make_pipeline(StandardScaler(), KNeighborsRegressor(n_neighbors=10, weights=\"distance\"))"),
    ("tree_depth3", "from sklearn.tree import DecisionTreeRegressor",
     "DecisionTreeRegressor(max_depth=3, random_state=0)"),
    ("rf50", "from sklearn.ensemble import RandomForestRegressor",
     "RandomForestRegressor(n_estimators=50, random_state=0)"),
    ("rf300", "from sklearn.ensemble import RandomForestRegressor",
     "RandomForestRegressor(n_estimators=300, min_samples_leaf=2, random_state=0)"),
    ("extra_trees", "from sklearn.ensemble import ExtraTreesRegressor",
     "ExtraTreesRegressor(n_estimators=300, random_state=0)"),
    ("hgb", "from sklearn.ensemble import HistGradientBoostingRegressor",
     "HistGradientBoostingRegressor(max_iter=300, learning_rate=0.05, random_state=0)"),
]
TEXT = [
    ("dummy", "from sklearn.dummy import DummyClassifier", "DummyClassifier(strategy=\"{dummy}\")"),
    ("count_nb", "from sklearn.feature_extraction.text import CountVectorizer\n"
     "from sklearn.naive_bayes import MultinomialNB\nfrom sklearn.pipeline import make_pipeline",
     "make_pipeline(CountVectorizer(), MultinomialNB())"),
    ("tfidf_logreg_c0.1", "from sklearn.feature_extraction.text import TfidfVectorizer\n"
     "from sklearn.linear_model import LogisticRegression\nfrom sklearn.pipeline import make_pipeline",
     "make_pipeline(TfidfVectorizer(), LogisticRegression(C=0.1, max_iter=2000))"),
    ("tfidf_logreg_c10", "from sklearn.feature_extraction.text import TfidfVectorizer\n"
     "from sklearn.linear_model import LogisticRegression\nfrom sklearn.pipeline import make_pipeline",
     "make_pipeline(TfidfVectorizer(), LogisticRegression(C=10.0, max_iter=2000))"),
    ("tfidf_bigram_logreg", "from sklearn.feature_extraction.text import TfidfVectorizer\n"
     "from sklearn.linear_model import LogisticRegression\nfrom sklearn.pipeline import make_pipeline",
     "make_pipeline(TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True), "
     "LogisticRegression(C=10.0, max_iter=2000))"),
    ("tfidf_char_svm", "from sklearn.feature_extraction.text import TfidfVectorizer\n"
     "from sklearn.pipeline import make_pipeline\nfrom sklearn.svm import LinearSVC",
     "make_pipeline(TfidfVectorizer(analyzer=\"char_wb\", ngram_range=(2, 4)), LinearSVC(C=0.5))"),
    ("tfidf_knn5", "from sklearn.feature_extraction.text import TfidfVectorizer\n"
     "from sklearn.neighbors import KNeighborsClassifier\nfrom sklearn.pipeline import make_pipeline",
     "make_pipeline(TfidfVectorizer(), KNeighborsClassifier(n_neighbors=5))"),
    ("tfidf_rf", "from sklearn.ensemble import RandomForestClassifier\n"
     "from sklearn.feature_extraction.text import TfidfVectorizer\nfrom sklearn.pipeline import make_pipeline",
     "make_pipeline(TfidfVectorizer(min_df=2), RandomForestClassifier(n_estimators=200, random_state=0))"),
]
# (weak, strong) script names per model family; the sweep records whether each really improves.
CLASSIFIER_PAIRS = [("dummy", "logreg_c1"), ("logreg_c0.01", "logreg_c1"), ("knn1", "knn15_scaled"),
                    ("tree_depth3", "rf300"), ("rf50", "rf300"), ("naive_bayes", "hgb")]
REGRESSOR_PAIRS = [("mean", "ridge_scaled"), ("linear", "hgb"), ("knn1", "knn10_scaled"),
                   ("tree_depth3", "rf300"), ("rf50", "rf300"), ("ridge_scaled", "extra_trees")]
TEXT_PAIRS = [("dummy", "count_nb"), ("tfidf_logreg_c0.1", "tfidf_logreg_c10"),
              ("tfidf_knn5", "tfidf_bigram_logreg"), ("tfidf_rf", "tfidf_char_svm")]

METRIC_IMPORT = {
    "log_loss": "from sklearn.metrics import log_loss",
    "macro_f1": "from sklearn.metrics import f1_score",
    "accuracy": "from sklearn.metrics import accuracy_score",
    "auc": "from sklearn.metrics import roc_auc_score",
    "rmse": None, "mae": None,
}
VAL_LINE = {
    "log_loss": "score = log_loss(y_va, model.predict_proba(X_va), labels=model.classes_)",
    "macro_f1": "score = f1_score(y_va, model.predict(X_va), average=\"macro\")",
    "accuracy": "score = accuracy_score(y_va, model.predict(X_va))",
    "auc": "score = roc_auc_score(y_va, model.predict_proba(X_va)[:, 1])",
    "rmse": "score = np.sqrt(np.mean((model.predict(X_va) - y_va) ** 2))",
    "mae": "score = np.mean(np.abs(model.predict(X_va) - y_va))",
}


def _submission_lines(kind: str, target) -> str:
    if kind == "proba":
        return ("sub = pd.DataFrame(model.predict_proba(X_test), columns=[str(c) for c in model.classes_])\n"
                "sub.insert(0, \"id\", test[\"id\"])")
    if kind == "score":
        return f"sub = pd.DataFrame({{\"id\": test[\"id\"], \"{target}\": model.predict_proba(X_test)[:, 1]}})"
    if kind == "multi":
        return "sub = pd.DataFrame(model.predict(X_test), columns=TARGETS)\nsub.insert(0, \"id\", test[\"id\"])"
    return f"sub = pd.DataFrame({{\"id\": test[\"id\"], \"{target}\": model.predict(X_test)}})"


def render(task_id: str, name: str, imports: str, ctor: str) -> str:
    """One baseline script for ``task_id`` with the model ``ctor``."""
    kind, target, drop, text, metric = TASKS[task_id]
    classification = kind in ("proba", "label", "score")
    ctor = ctor.format(dummy="prior" if kind in ("proba", "score") else "most_frequent")
    sk = [l for l in imports.split("\n")]
    if kind == "multi" and ctor.startswith("HistGradientBoosting"):  # single-output model
        ctor = f"MultiOutputRegressor({ctor})"
        sk.append("from sklearn.multioutput import MultiOutputRegressor")
    if kind == "multi":  # tiny data: at most 9 rows in the 80 % fit split
        ctor = ctor.replace("n_neighbors=10", "n_neighbors=5")
    lib = ["import os", "", "import numpy as np", "import pandas as pd"]
    if METRIC_IMPORT[metric]:
        sk.append(METRIC_IMPORT[metric])
    sk.append("from sklearn.model_selection import train_test_split")
    lines = lib + sorted(set(sk)) + ["", "train = pd.read_csv(\"./input/train.csv\")",
                                     "test = pd.read_csv(\"./input/test.csv\")"]
    if kind == "multi":
        lines += [f"TARGETS = {target!r}".replace("'", "\""),
                  "X = train.drop(columns=[\"id\", *TARGETS])", "y = train[TARGETS].values"]
    elif text:
        lines += [f"X = train[\"{text}\"]", f"y = train[\"{target}\"]"]
    else:
        cols = ", ".join(f"\"{c}\"" for c in ["id", *drop, target])
        lines += [f"X = train.drop(columns=[{cols}])", f"y = train[\"{target}\"]"]
    if text:
        lines.append(f"X_test = test[\"{text}\"]")
    else:
        cols = ", ".join(f"\"{c}\"" for c in ["id", *drop])
        lines.append(f"X_test = test.drop(columns=[{cols}])")
    strat = ", stratify=y" if classification else ""
    lines += [f"X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0{strat})",
              "", f"model = {ctor}", "model.fit(X_tr, y_tr)", VAL_LINE[metric],
              "print(f\"VALIDATION_METRIC: {score:.5f}\")", "", "model.fit(X, y)",
              _submission_lines(kind, target),
              "os.makedirs(\"./submission\", exist_ok=True)",
              "sub.to_csv(\"./submission/submission.csv\", index=False)"]
    doc = f"\"\"\"{task_id}: {name.replace('_', ' ')} baseline.\"\"\""
    return doc + "\n" + "\n".join(lines) + "\n"


def models_for(task_id: str):
    kind, _, _, text, _ = TASKS[task_id]
    if text:
        return TEXT, TEXT_PAIRS
    if kind in ("real", "multi"):
        return REGRESSORS, REGRESSOR_PAIRS
    return CLASSIFIERS, CLASSIFIER_PAIRS


def main() -> None:
    pairs = {}
    for task_id in TASKS:
        models, task_pairs = models_for(task_id)
        d = CORPUS_DIR / task_id
        d.mkdir(exist_ok=True)
        for old in d.glob("*.py"):
            old.unlink()
        names = {}
        for i, (name, imports, ctor) in enumerate(models, start=1):
            fname = f"{i:02d}_{name.replace('.', '')}.py"
            names[name] = fname
            (d / fname).write_text(render(task_id, name, imports, ctor))
        pairs[task_id] = [[names[w], names[s]] for w, s in task_pairs]
    (CORPUS_DIR / "pairs.json").write_text(json.dumps(pairs, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
