"""The offline MLE task suite: real tasks built from datasets shipped inside installed pip packages.

Every task is an ``OfflineTaskSpec`` registered in ``sandbox.tasks.registry``: a loader that returns
the raw table (features + target) and a description. ``prepare(out_dir, seed)`` is shared:

  1. load the raw table (host side; the package data is hidden from the sandbox);
  2. split rows into train (60 %) and test (40 %): stratified by class for classification, by time
     (last 40 % of the series is test) where the task has a time axis;
  3. split the test rows (seeded, stratified for classification) into a dev half (the per-step RL
     signal) and a final half (evaluation only);
  4. shuffle rows within every file and re-key them with random 8-hex-digit ids (not row order);
  5. write MLE-bench's layout: public/{train,test,sample_submission}.csv + description.md,
     private/answers_{dev,test}.csv, task.json.

Same seed -> byte-identical files; another seed -> another split and other ids.

The data (scikit-learn's and matplotlib's bundled datasets, and two synthetic tables) and one
loader per task are in ``sandbox.tasks.offline_data``.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Callable, Optional

import numpy as np
import pandas as pd

from sandbox import grading
from sandbox.tasks import base
from sandbox.tasks import registry
from sandbox.tasks.offline_data import (RawTable, load_breast_cancer, load_diabetes,
                                        load_digits, load_goog_volume, load_iris, load_linnerud,
                                        load_photo_patches, load_sensor_forecast,
                                        load_support_tickets, load_terrain, load_topobathy,
                                        load_wine_alcohol, load_wine_cultivar, source_data_paths)

TRAIN_FRACTION = 0.6


@dataclasses.dataclass(frozen=True)
class OfflineTaskSpec:
    """One offline task: data loader + description + metric.

    Attributes:
      task_id: registry name.
      title: description title.
      overview: what the task is (markdown).
      columns_note: what the feature columns mean (markdown).
      metric: a ``sandbox.grading`` metric name; its kind fixes the submission format:
        label -> one column named like the target with a class label; probability -> one column
        per class; score -> one column (probability/score of the positive class, binary AUC);
        real -> one column per target.
      load: returns the RawTable (called on the host only).
      source: host-side note on where the data comes from.
      time_limit_s, memory_limit_mb: per-execution budget.
      extra_hidden_paths: more host paths to hide from the sandbox (e.g. a tfds data dir).
    """

    task_id: str
    title: str
    overview: str
    columns_note: str
    metric: str
    load: Callable[[], RawTable]
    source: str
    time_limit_s: float = 120.0
    memory_limit_mb: int = 2048
    extra_hidden_paths: tuple[str, ...] = ()

    def hidden_paths(self) -> tuple[str, ...]:
        """Host paths of the packaged sources to hide inside the sandbox (this host's install)."""
        return source_data_paths() + tuple(self.extra_hidden_paths)

    def prepare(self, out_dir: "os.PathLike | str", seed: int = 0) -> base.Task:
        """Writes the task into ``out_dir`` (created; existing files overwritten); returns the Task."""
        return prepare_table(self, pathlib.Path(out_dir), seed)


# ------------------------------------------------------------------------------------------------
# Generic prepare
# ------------------------------------------------------------------------------------------------

def _random_ids(rng: np.random.Generator, n: int) -> np.ndarray:
    ids: list[str] = []
    seen: set[str] = set()
    while len(ids) < n:
        for v in rng.integers(0, 2**32, size=n - len(ids), dtype=np.uint64):
            s = f"{int(v):08x}"
            if s not in seen:
                seen.add(s)
                ids.append(s)
    return np.array(ids[:n], dtype=object)


def _split(rng: np.random.Generator, idx: np.ndarray, frac: float,
           strata: Optional[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Splits positions ``idx`` into (first, second) with ~frac in first, per stratum if given."""
    if strata is None:
        perm = rng.permutation(idx)
        k = int(round(frac * len(idx)))
        return np.sort(perm[:k]), np.sort(perm[k:])
    first, second = [], []
    for c in sorted(set(strata[idx])):
        members = rng.permutation(idx[strata[idx] == c])
        k = int(round(frac * len(members)))
        first.append(members[:k])
        second.append(members[k:])
    return np.sort(np.concatenate(first)), np.sort(np.concatenate(second))


def _submission_layout(spec: OfflineTaskSpec, target: pd.DataFrame):
    """Returns (target_columns, labels, to_answers) for the metric's kind."""
    kind = grading.get_metric(spec.metric).kind
    if kind in ("label", "probability"):
        if target.shape[1] != 1:
            raise ValueError(f"{spec.task_id}: classification needs one target column")
        labels = tuple(sorted(target.iloc[:, 0].astype(str).unique(), key=_label_key))
        if kind == "label":
            return (target.columns[0],), labels, lambda t: t.astype(str)
        return labels, labels, lambda t: pd.DataFrame(
            {c: (t.iloc[:, 0].astype(str) == c).astype(int) for c in labels}, index=t.index)
    if kind == "score":
        vals = set(target.iloc[:, 0].unique())
        if target.shape[1] != 1 or not vals <= {0, 1}:
            raise ValueError(f"{spec.task_id}: AUC tasks need one 0/1 target column")
        return (target.columns[0],), None, lambda t: t.astype(int)
    return tuple(target.columns), None, lambda t: t.astype(np.float64)


def _label_key(s: str):
    return (0, int(s), s) if s.lstrip("-").isdigit() else (1, 0, s)


def _trivial_prediction(spec: OfflineTaskSpec, train_answers: pd.DataFrame, n: int,
                        columns: tuple[str, ...]) -> pd.DataFrame:
    """The sample submission's values: class priors, majority class, positive rate or train mean."""
    kind = grading.get_metric(spec.metric).kind
    if kind == "label":
        mode = train_answers.iloc[:, 0].value_counts().sort_index().idxmax()
        return pd.DataFrame({columns[0]: [mode] * n})
    means = train_answers.astype(np.float64).mean(axis=0).round(6)
    return pd.DataFrame({c: np.full(n, means[c]) for c in columns})


def _description(spec: OfflineTaskSpec, n_train: int, n_test: int, columns: tuple[str, ...],
                 target_names: list[str], labels) -> str:
    m = grading.get_metric(spec.metric)
    direction = "lower is better" if m.lower_is_better else "higher is better"
    metric_text = {
        "accuracy": "**accuracy**: the fraction of test rows whose predicted label is exactly right",
        "macro_f1": "**macro-averaged F1**: the unweighted mean over classes of each class's F1 score",
        "log_loss": "**multi-class log loss** (natural log): rows of probabilities are divided by "
                    "their sum and clipped to [1e-15, 1 - 1e-15]",
        "auc": "**area under the ROC curve** of your score for the positive class",
        "rmse": "**root mean squared error**" + (" (averaged over the target columns)"
                                                 if len(columns) > 1 else ""),
        "mae": "**mean absolute error**" + (" (averaged over the target columns)"
                                            if len(columns) > 1 else ""),
        "rmsle": "**root mean squared log error**",
    }[spec.metric]
    if m.kind == "label":
        fmt = (f"`{columns[0]}` holds the predicted label, one of: "
               + ", ".join(f"`{l}`" for l in labels) + ".")
    elif m.kind == "probability":
        fmt = "one column per class holding the predicted probability of that class."
    elif m.kind == "score":
        fmt = (f"`{columns[0]}` holds the predicted probability (or any score; higher = more "
               f"likely) that the row is positive.")
    else:
        fmt = ("the predicted value" + ("s" if len(columns) > 1 else "") + " of "
               + ", ".join(f"`{c}`" for c in columns) + ".")
    header = ",".join(["id", *columns])
    return (
        f"# {spec.title}\n\n## Overview\n\n{spec.overview.strip()}\n\n## Data\n\n"
        f"- `train.csv`: {n_train} rows: `id`, the feature columns, and the target "
        + ", ".join(f"`{t}`" for t in target_names) + ".\n"
        f"- `test.csv`: {n_test} rows: `id` and the same feature columns, without the target.\n"
        f"- `sample_submission.csv`: a correctly formatted submission with a trivial prediction.\n\n"
        f"{spec.columns_note.strip()}\n\n"
        f"Ids are random and rows are shuffled; row order carries no information.\n\n"
        f"## Evaluation\n\nSubmissions are scored with {metric_text} ({direction}). Half of the test "
        f"rows are scored after every run; the other half is held out for the final evaluation.\n\n"
        f"## Submission File\n\nWrite `./submission/submission.csv` with a header and exactly one row "
        f"per test `id`: {fmt}\n\n```\n{header}\n...\n```\n")


def _to_csv(df: pd.DataFrame, path: pathlib.Path) -> None:
    df.to_csv(path, index=False, lineterminator="\n")


def prepare_table(spec: OfflineTaskSpec, out_dir: pathlib.Path, seed: int) -> base.Task:
    """The shared deterministic prepare (see the module docstring). Returns the Task."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    raw = spec.load()
    n = len(raw.features)
    if len(raw.target) != n:
        raise ValueError(f"{spec.task_id}: {n} feature rows but {len(raw.target)} target rows")
    feats = raw.features.reset_index(drop=True)
    target = raw.target.reset_index(drop=True)
    target_cols, labels, to_answers = _submission_layout(spec, target)
    kind = grading.get_metric(spec.metric).kind
    strata = target.iloc[:, 0].astype(str).to_numpy() if kind in ("label", "probability", "score") else None

    rng = np.random.default_rng([seed, 7])
    idx = np.arange(n)
    if raw.time is not None:
        order = np.argsort(raw.time, kind="stable")
        k = int(round(TRAIN_FRACTION * n))
        train_idx, test_idx = np.sort(order[:k]), np.sort(order[k:])
    else:
        train_idx, test_idx = _split(rng, idx, TRAIN_FRACTION, strata)
    dev_idx, final_idx = _split(rng, test_idx, 0.5, strata)
    ids = _random_ids(rng, n)
    train_idx, test_idx = rng.permutation(train_idx), rng.permutation(test_idx)

    out_dir = pathlib.Path(out_dir)
    pub, priv = out_dir / "public", out_dir / "private"
    pub.mkdir(parents=True, exist_ok=True)
    priv.mkdir(parents=True, exist_ok=True)

    train = pd.concat([pd.DataFrame({"id": ids[train_idx]}),
                       feats.iloc[train_idx].reset_index(drop=True),
                       target.iloc[train_idx].reset_index(drop=True)], axis=1)
    test = pd.concat([pd.DataFrame({"id": ids[test_idx]}),
                      feats.iloc[test_idx].reset_index(drop=True)], axis=1)
    _to_csv(train, pub / "train.csv")
    _to_csv(test, pub / "test.csv")

    answers_all = to_answers(target)
    answers_all.insert(0, "id", ids)
    dev_set = set(dev_idx.tolist())
    for name, part in (("dev", [i for i in test_idx if i in dev_set]),
                       ("test", [i for i in test_idx if i not in dev_set])):
        _to_csv(answers_all.iloc[part].reset_index(drop=True), priv / base.ANSWER_FILES[name])

    train_answers = to_answers(target.iloc[train_idx])
    sample = _trivial_prediction(spec, train_answers, len(test_idx), target_cols)
    sample.insert(0, "id", ids[test_idx])
    _to_csv(sample, pub / "sample_submission.csv")

    description = _description(spec, len(train_idx), len(test_idx), target_cols,
                               list(target.columns), labels)
    (pub / "description.md").write_text(description)

    task = base.Task(
        task_id=spec.task_id, description=description, public_dir=pub.resolve(),
        private_dir=priv.resolve(), metric=spec.metric,
        lower_is_better=grading.get_metric(spec.metric).lower_is_better,
        id_column="id", target_columns=target_cols, labels=labels if kind == "label" else None,
        time_limit_s=spec.time_limit_s, memory_limit_mb=spec.memory_limit_mb,
        hidden_paths=spec.hidden_paths(), seed=int(seed), source=spec.source)
    task.baseline_score = task.grade(pub / "sample_submission.csv", "dev")
    base.write_task_json(task, out_dir)
    return task


# ------------------------------------------------------------------------------------------------
# The suite
# ------------------------------------------------------------------------------------------------

SUITE: tuple[OfflineTaskSpec, ...] = (
    OfflineTaskSpec(
        "iris-species", "Iris species",
        "Predict the species of an iris flower from four measurements of its petals and sepals.",
        "Features: `sepal_length_cm`, `sepal_width_cm`, `petal_length_cm`, `petal_width_cm`.",
        "log_loss", load_iris, "sklearn load_iris (150 rows)"),
    OfflineTaskSpec(
        "wine-cultivar", "Wine cultivar",
        "Predict which of three cultivars a wine comes from, given 13 results of its chemical "
        "analysis.",
        "Features: 13 chemical measurements (alcohol, malic acid, ash, flavanoids, colour "
        "intensity, proline, ...).",
        "macro_f1", load_wine_cultivar, "sklearn load_wine (178 rows)"),
    OfflineTaskSpec(
        "wine-alcohol", "Wine alcohol content",
        "Predict a wine's alcohol content (% vol) from the other 12 results of its chemical "
        "analysis.",
        "Features: 12 chemical measurements (malic acid, ash, magnesium, phenols, flavanoids, "
        "colour intensity, hue, proline, ...). Target: `alcohol` in % vol.",
        "mae", load_wine_alcohol, "sklearn load_wine (178 rows), alcohol column as target"),
    OfflineTaskSpec(
        "breast-cancer-diagnosis", "Breast tumour diagnosis",
        "Predict whether a breast mass is malignant from 30 features computed from a digitised "
        "image of a fine needle aspirate.",
        "Features: mean, standard error and worst value of 10 cell-nucleus measurements (radius, "
        "texture, perimeter, area, smoothness, ...). Target: `malignant` (1 = malignant, "
        "0 = benign).",
        "auc", load_breast_cancer, "sklearn load_breast_cancer (569 rows)"),
    OfflineTaskSpec(
        "digits-8x8", "Handwritten digits (8x8)",
        "Classify 8x8 grayscale images of handwritten digits (0-9).",
        "Features: `pixel_0` ... `pixel_63`, row-major 8x8 image, integer intensities 0-16. "
        "Target: `digit`. Submission columns `0` ... `9` are class probabilities.",
        "log_loss", load_digits, "sklearn load_digits (1797 images)"),
    OfflineTaskSpec(
        "diabetes-progression", "Diabetes disease progression",
        "Predict a quantitative measure of diabetes progression one year after baseline from ten "
        "baseline variables.",
        "Features: `age` (years), `sex` (1 or 2), `bmi`, `bp` (mean blood pressure), `s1`-`s6` "
        "(six blood serum measurements). Target: `progression`.",
        "rmse", load_diabetes, "sklearn load_diabetes(scaled=False) (442 rows)"),
    OfflineTaskSpec(
        "linnerud-physiology", "Physiology from exercise (tiny, multi-target)",
        "Predict three physiological measurements of middle-aged men from three exercise results. "
        "The data set is tiny (20 people), so scores are noisy.",
        "Features: `chins`, `situps`, `jumps`. Targets: `weight` (lb), `waist` (in), `pulse` "
        "(beats/min).",
        "mae", load_linnerud, "sklearn load_linnerud (20 rows; smoke-test task)"),
    OfflineTaskSpec(
        "photo-patches", "Which photo is this patch from?",
        "Each row is an 8x8 grayscale patch cut at a random position from one of three "
        "photographs (a temple, a flower, a portrait). Predict the photo.",
        "Features: `pixel_0` ... `pixel_63`, row-major 8x8 patch, intensities 0-255. Target: "
        "`photo`.",
        "accuracy", load_photo_patches,
        "sklearn sample images china.jpg, flower.jpg + matplotlib grace_hopper.jpg (1800 patches)"),
    OfflineTaskSpec(
        "terrain-elevation", "Terrain elevation",
        "Predict the ground elevation at points of a hilly region from their coordinates "
        "(spatial interpolation of a digital elevation model).",
        "Features: `longitude`, `latitude` (degrees). Target: `elevation_m` (metres).",
        "rmse", load_terrain, "matplotlib sample_data jacksboro_fault_dem.npz (3000 points)"),
    OfflineTaskSpec(
        "coastal-topobathy", "Coastal topography and bathymetry",
        "Predict the height above sea level (negative below sea level) at points of a coastal "
        "region from their coordinates.",
        "Features: `longitude` (degrees east, 0-360), `latitude` (degrees). Target: `height_m`.",
        "rmse", load_topobathy, "matplotlib sample_data topobathy.npz (3000 points)"),
    OfflineTaskSpec(
        "goog-volume", "Daily trading volume (time series)",
        "Estimate the traded volume of one stock on each trading day from that day's prices. The "
        "test days come after all training days (time-based split).",
        "Features: `date` (YYYY-MM-DD), `day_of_week` (0 = Monday), `open`, `high`, `low`, "
        "`close` (USD). Target: `log_volume`, the natural log of the number of shares traded.",
        "rmse", load_goog_volume, "matplotlib sample_data goog.npz (1047 trading days)"),
    OfflineTaskSpec(
        "support-tickets", "Support ticket routing (synthetic text)",
        "Route customer-support tickets to one of five queues from their text. The tickets are "
        "**synthetic** (generated from templates), some mention several topics, and a few labels "
        "are wrong.",
        "Features: `text` (free text). Target: `category` (billing, shipping, technical, account, "
        "returns).",
        "macro_f1", load_support_tickets, "SYNTHETIC: template generator in offline_suite.py"),
    OfflineTaskSpec(
        "sensor-forecast", "Next-hour sensor forecast (synthetic time series)",
        "Each row is the last 24 hourly readings of one sensor; predict the next reading. The "
        "series are **synthetic** (daily cycle, drift and autocorrelated noise, one series per "
        "row).",
        "Features: `hour` (hour of day of the reading to predict), `lag_24` ... `lag_1` (the "
        "readings 24 hours ago ... 1 hour ago). Target: `next_value`.",
        "mae", load_sensor_forecast, "SYNTHETIC: AR(1) + daily cycle generator in offline_suite.py"),
)

for _spec in SUITE:
    registry.register(_spec)
