"""The task page of a procedural instance (``describe``): files, columns, target, metric, format.

Three wordings (``InstanceSpec.wording``), so instances of one kind do not read alike.
"""
from __future__ import annotations

from sandbox.tasks.procedural_schema import Column, InstanceSpec

_METRIC_TEXT = {
    "accuracy": ("accuracy", "the share of rows whose predicted label is exactly right"),
    "macro_f1": ("macro-averaged F1", "the unweighted mean over the classes of each class's F1"),
    "log_loss": ("multi-class log loss", "natural log; each row of probabilities is divided by "
                 "its sum and clipped to [1e-15, 1 - 1e-15]"),
    "auc": ("ROC AUC", "the area under the ROC curve of your score for the positive class `1`"),
    "rmse": ("RMSE", "root mean squared error"),
    "mae": ("MAE", "mean absolute error"),
    "rmsle": ("RMSLE", "root mean squared logarithmic error, sqrt(mean((log(1 + p) - "
              "log(1 + y))^2)); predictions must be > -1"),
}


def _column_type(c: Column) -> str:
    kind = {"num": "numeric", "int": "integer", "cat": "categorical", "text": "text"}[c.ftype]
    if c.ftype == "cat":
        kind += ": " + ", ".join(f"`{l}`" for l in c.levels)
    if c.ftype == "text":
        kind += ": space-separated tokens"
    return kind + (", has missing values" if c.missing > 0 else "")


def _describe_column(c: Column) -> str:
    return f"`{c.name}` ({_column_type(c)})"


def describe(spec: InstanceSpec, n_train: int, n_test: int,
             target_cols: tuple[str, ...]) -> str:
    """The task page (markdown): files, columns, target, metric and direction, format."""
    name, what = _METRIC_TEXT[spec.metric]
    direction = "lower is better" if spec.metric_info.lower_is_better else "higher is better"
    kind = spec.metric_info.kind
    tgt, idc = f"`{spec.target}`", f"`{spec.id_column}`"
    if spec.target_type == "regression":
        goal = f"predict {tgt}, a numeric quantity"
    elif spec.target_type == "binary":
        goal = (f"predict {tgt}, a binary outcome (" + " / ".join(f"`{l}`" for l in spec.labels)
                + ")")
    else:
        goal = (f"predict {tgt}, one of {len(spec.labels)} classes ("
                + ", ".join(f"`{l}`" for l in spec.labels) + ")")
    if kind == "label":
        fmt = f"{tgt} holds the predicted label."
    elif kind == "probability":
        fmt = ("one column per class (" + ", ".join(f"`{c}`" for c in target_cols)
               + ") holding its predicted probability.")
    elif kind == "score":
        fmt = (f"{tgt} holds a score for the positive class `1` (a probability or any real; "
               "higher = more likely).")
    else:
        fmt = f"{tgt} holds the predicted value."
    header = ",".join([spec.id_column, *target_cols])
    cols = "\n".join(f"- {_describe_column(c)}" for c in spec.columns)
    missing = ("Some columns have missing values (empty cells).\n\n" if spec.has_missing else "")
    files = [
        f"`train.csv` ({n_train} rows): {idc}, the features and the target {tgt}",
        f"`test.csv` ({n_test} rows): {idc} and the features, without the target",
        "`sample_submission.csv`: a valid submission with a trivial prediction",
    ]
    synth = "The data is synthetic (procedurally generated)."
    if spec.wording == 0:
        return (
            f"# {spec.title.capitalize()}\n\n## Overview\n\nEach row describes one {spec.entity}. "
            f"Your goal: {goal}. {synth}\n\n## Data\n\n" + "\n".join(f"- {f}." for f in files)
            + f"\n\nFeature columns:\n\n{cols}\n\n{missing}Ids are random; row order carries no "
            f"information.\n\n## Evaluation\n\nThe metric is **{name}** ({what}); {direction}. "
            f"Half of the test rows are scored after every run, the other half only in the final "
            f"evaluation.\n\n## Submission File\n\nWrite `./submission/submission.csv` with a "
            f"header "
            f"and one row per test {idc}: {fmt}\n\n```\n{header}\n...\n```\n")
    if spec.wording == 1:
        return (
            f"# Task: {spec.title}\n\n{synth} The rows are {spec.entity} records; {goal}.\n\n"
            f"### Files (in `./input`)\n\n" + "\n".join(f"* {f}" for f in files)
            + f"\n\n### Columns\n\nThe id column is {idc}. Features:\n\n"
            + cols.replace("- ", "* ") + f"\n\n{missing}### Scoring\n\nSubmissions are ranked by "
            f"{name} ({direction}): {what}. The hidden test rows are split in two halves: one "
            f"scored after each run, one kept for the final score.\n\n### What to submit\n\n"
            f"`./submission/submission.csv`, every test {idc} exactly once; {fmt}\n\n"
            f"```\n{header}\n```\n")
    return (
        f"# {spec.title.title()}: {spec.target}\n\n## Problem\n\nA synthetic table of "
        f"{spec.entity}s. Using the labelled rows of `train.csv`, {goal} for every row of "
        f"`test.csv`.\n\n## Evaluation metric\n\n{name}, {direction} ({what}). One half of the "
        f"test set gives the score you see after a run; the other half is held out.\n\n"
        f"## Data description\n\n" + "\n".join(f"{i}. {f}" for i, f in enumerate(files, 1))
        + "\n\n| column | type |\n|---|---|\n"
        + "\n".join(f"| `{c.name}` | {_column_type(c)} |" for c in spec.columns)
        + f"\n\n{missing}## Submission format\n\nA CSV at `./submission/submission.csv` with the "
        f"columns {', '.join(f'`{c}`' for c in (spec.id_column, *target_cols))}, one row per "
        f"test id: {fmt}\n\n```\n{header}\n...\n```\n")
