"""MLE-bench's competition files as a host reads them: ``config.yaml`` (the grader, the declared
data files), the answers, ``leaderboard.csv`` (a Git LFS pointer recognised), and MLE-bench's own
grade function (the staged copy beside the data, else the installed package's).

``sandbox.tasks.mlebench`` builds a ``Task`` from them; names used by callers are re-exported
there.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import pathlib
import sys
import types
from typing import Any, Callable, Optional

import pandas as pd

log = logging.getLogger("sandbox.tasks.mlebench")

#: MLE-bench grader names -> our metric names.
GRADER_ALIASES = {
    "accuracy": "accuracy", "multi-class-accuracy": "accuracy", "classification-accuracy": "accuracy",
    "multi-class-classification-accuracy": "accuracy",
    "auc-roc": "auc", "roc-auc": "auc", "auc": "auc", "column-wise-roc-auc": "auc",
    "mean-column-wise-roc-auc": "auc",
    "multi-class-log-loss": "log_loss", "log-loss": "log_loss", "logloss": "log_loss",
    "log_loss": "log_loss",
    "rmse": "rmse", "root-mean-squared-error": "rmse", "mae": "mae", "mean-absolute-error": "mae",
    "rmsle": "rmsle", "mean-column-wise-rmsle": "rmsle",
    "f1-macro": "macro_f1", "macro-f1": "macro_f1", "macro_f1": "macro_f1",
    "root_mean_squared_error": "rmse", "column-wise roc auc": "auc",
}

#: Every grader name of MLE-bench's 82 competition configs -> whether lower scores are better.
#: MLE-bench infers the direction from the leaderboard; this table gives it where the leaderboard
#: is a Git LFS pointer (a pip install without ``git lfs pull``) and our metric has no twin.
GRADER_LOWER_IS_BETTER = {
    **{name: False for name in (
        "AUC", "MAP@12", "MAP@5", "accuracy", "auc-roc", "auroc-multi-label",
        "column-wise ROC AUC", "column-wise-spearman", "dice-coefficient", "dice-hausdorff-combo",
        "f0.5-score", "f1-score", "global-dice", "jaccard-similarity",
        "jigsaw-unintended-bias-in-toxicity-classification-score", "kendall-tau",
        "label-ranking-average-precision", "mAP-at-IoU>0.4", "macro-f1-score", "map-at-5",
        "matthews-correlation-coefficient", "mean-average-precision", "mean-column-wise-roc-auc",
        "mean-precision-intersection-over-union-at-different-thresholds", "micro-f1-score",
        "modified-laplace-log-likelihood", "multi-class-classification-accuracy",
        "pearson-correlation-coefficient", "probabilistic-f1-score", "quadratic-weighted-kappa",
        "weighted-auroc", "word-level-jaccard-score")},
    **{name: True for name in (
        "KL-divergence", "average-haversine-distance", "levenhstein-distance",
        "levenshtein-distance", "log-loss", "log-mean-absolute-error", "mean-absolute-error",
        "mean-angular-error", "mean-column-wise-rmsle", "multi-class-log-loss",
        "root-mean-squared-error", "root_mean_squared_error", "top-1-classification-error",
        "weighted-multi-label-log-loss")},
}


class UnsupportedGraderError(NotImplementedError):
    """The competition's grader is neither importable (mlebench) nor one of our metrics."""


class LeaderboardError(ValueError):
    """A ``leaderboard.csv`` that is there but unusable (a Git LFS pointer, no numeric scores)."""


#: First line of a Git LFS pointer file (what a checkout without ``git lfs pull`` holds).
GIT_LFS_POINTER_HEADER = "version https://git-lfs.github.com/spec/v1"


def read_config(path: pathlib.Path) -> dict:
    try:
        import yaml
    except ImportError as e:  # pragma: no cover - PyYAML ships with flax/orbax
        raise ImportError("reading MLE-bench config.yaml needs PyYAML (pip install pyyaml)") from e
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data


def _mlebench_importable() -> bool:
    try:
        return importlib.util.find_spec("mlebench") is not None
    except (ImportError, ValueError):
        return False


def import_grade_fn(spec: str, competition_dir: Optional[pathlib.Path] = None,
                     ) -> tuple[Optional[Callable[[pd.DataFrame, pd.DataFrame], Any]], str]:
    """MLE-bench's grade function of ``config.yaml``'s ``"module.path:function"``.

    When ``competition_dir`` holds the grader's own file (``grade.py``, as ``stage`` puts it beside
    the data) and is not the installed package's folder, that staged copy is imported, as a
    package of its own so its relative imports (``from .classes import ...``) resolve: the host
    grades with the grader of the MLE-bench that prepared the data. Either way the grader imports
    ``mlebench`` itself, so nothing is imported without it.

    Returns:
      ``(grade_fn, source)``: source ``"mlebench:staged"`` or ``"mlebench"``; ``(None, why)`` when
      ``mlebench`` or the module is not importable.
    """
    if not spec or ":" not in spec:
        return None, f"config.yaml's grader.grade_fn {spec!r} is no 'module:function'"
    module, _, name = spec.partition(":")
    parts = module.split(".")
    if parts[0] == "mlebench" and not _mlebench_importable():
        return None, "mlebench is not installed"
    if (parts[0] == "mlebench" and competition_dir is not None
            and (competition_dir / f"{parts[-1]}.py").is_file()):
        installed = _installed_competition_dir(competition_dir.name)
        if installed is None or installed.resolve() != competition_dir.resolve():
            pkg = "_mlebench_staged_" + "".join(c if c.isalnum() else "_" for c in
                                                str(competition_dir.resolve()))
            if pkg not in sys.modules:
                holder = types.ModuleType(pkg)
                holder.__path__ = [str(competition_dir)]
                sys.modules[pkg] = holder
            try:
                return getattr(importlib.import_module(f"{pkg}.{parts[-1]}"), name), "mlebench:staged"
            except (ImportError, AttributeError) as e:
                log.warning("the staged grader %s does not import (%s: %s); trying the installed "
                            "mlebench's", competition_dir / f"{parts[-1]}.py", type(e).__name__, e)
    try:
        return getattr(importlib.import_module(module), name), "mlebench"
    except (ImportError, AttributeError) as e:
        return None, f"its grade_fn {spec!r} does not import ({type(e).__name__}: {e})"


def _installed_competition_dir(competition_id: str) -> Optional[pathlib.Path]:
    """The installed ``mlebench`` package's ``competitions/<id>/`` (None without it)."""
    try:
        spec = importlib.util.find_spec("mlebench")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    d = pathlib.Path(list(spec.submodule_search_locations)[0]) / "competitions" / competition_id
    return d if d.is_dir() else None


def find_competition_dir(competition_id: str, data_dir: "os.PathLike | str") -> pathlib.Path:
    """The folder with ``config.yaml`` / ``description.md`` / ``leaderboard.csv`` of a competition.

    ``<data_dir>/<id>/`` when it holds ``config.yaml`` (staged beside the data by
    ``launch/stage_mlebench.py``, or hand-made); else the installed ``mlebench`` package's
    ``competitions/<id>/`` when that package is importable and has the folder; else
    ``<data_dir>/<id>/``. The path may not exist; ``load_mlebench_task`` names the missing file.
    """
    beside = pathlib.Path(data_dir) / competition_id
    if (beside / "config.yaml").is_file():
        return beside
    return _installed_competition_dir(competition_id) or beside


def is_git_lfs_pointer(path: "os.PathLike | str") -> bool:
    """True when the file's first line is a Git LFS pointer header (the content is not fetched)."""
    with open(path, "rb") as f:
        head = f.read(len(GIT_LFS_POINTER_HEADER) + 2)
    return head.decode("utf-8", errors="replace").startswith(GIT_LFS_POINTER_HEADER)


def lfs_pull_hint(path: pathlib.Path) -> str:
    """Where to run ``git lfs pull``: the mle-bench checkout holding ``mlebench/competitions``."""
    parts = path.resolve().parts
    if "competitions" in parts:
        i = len(parts) - 1 - parts[::-1].index("competitions")
        if i >= 2 and parts[i - 1] == "mlebench":
            root = pathlib.Path(*parts[: i - 1])
            return (f"run `git lfs fetch --all && git lfs pull` in the mle-bench checkout "
                    f"({root}), then reinstall mlebench if it was installed from a copy "
                    "(pip install -e .)")
    return "run `git lfs fetch --all && git lfs pull` in the mle-bench checkout it came from"


def read_leaderboard(path: "os.PathLike | str") -> list[float]:
    """Scores of an MLE-bench ``leaderboard.csv`` in file order (best first), NaN rows dropped.

    Raises:
      LeaderboardError: the file is a Git LFS pointer (the message says what to run), is empty,
        has no ``score`` column or holds a non-numeric score.
    """
    path = pathlib.Path(path)
    if is_git_lfs_pointer(path):
        raise LeaderboardError(
            f"{path}: this leaderboard.csv is a Git LFS pointer, not the leaderboard; "
            f"{lfs_pull_hint(path)}")
    try:
        lb = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise LeaderboardError(f"{path}: empty file; expected a 'score' column") from None
    if "score" not in lb.columns:
        raise LeaderboardError(f"{path}: no 'score' column (columns: {list(lb.columns)})")
    scores = pd.to_numeric(lb["score"], errors="coerce")
    bad = scores.isna() & lb["score"].notna()
    if bad.any():
        raise LeaderboardError(
            f"{path}: non-numeric score {lb['score'][bad].iloc[0]!r} on row {int(bad.idxmax())}")
    return [float(s) for s in scores.dropna()]


class DeclaredFileError(FileNotFoundError):
    """A file a competition's ``config.yaml`` declares is missing (or lies outside its folder)."""


def read_answers(path: "os.PathLike | str", id_column: Optional[str] = None) -> Any:
    """An answers file as MLE-bench's ``load_answers`` reads it: a ``.csv`` as a DataFrame (the id
    column as stripped strings when given and present), a ``.jsonl`` as a list of dicts.

    Raises:
      ValueError: another kind of file (MLE-bench grades only these two).
    """
    path = pathlib.Path(path)
    if path.suffix == ".csv":
        df = pd.read_csv(path, float_precision="round_trip",
                         dtype={id_column: str} if id_column else None)
        if id_column and id_column in df.columns:
            df[id_column] = df[id_column].str.strip()
        return df
    if path.suffix == ".jsonl":
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    raise ValueError(f"{path}: answers of kind {path.suffix!r}; MLE-bench grades .csv and .jsonl")


def declared_files(competition_id: str, config: dict, data_dir: "os.PathLike | str",
                   ) -> dict[str, pathlib.Path]:
    """The data files a competition's ``config.yaml`` declares (``dataset:``), resolved.

    MLE-bench writes them relative to its data dir (``<id>/prepared/private/answers.csv``). Every
    declared entry is returned (``answers``, ``sample_submission``, ``gold_submission`` where
    declared), as ``data_dir / path``; nothing is checked to exist here.

    Raises:
      ValueError: ``dataset`` lacks ``answers`` or ``sample_submission``, or a path leaves the
        competition's own folder.
    """
    dataset = config.get("dataset") or {}
    missing = [k for k in ("answers", "sample_submission") if not dataset.get(k)]
    if missing:
        raise ValueError(f"competition {competition_id!r}: config.yaml's dataset declares no "
                         f"{' and no '.join(missing)} (it has {sorted(dataset)})")
    root = pathlib.Path(data_dir)
    out = {}
    for key, rel in dataset.items():
        rel = pathlib.PurePosixPath(str(rel))
        if rel.is_absolute() or ".." in rel.parts or rel.parts[:1] != (competition_id,):
            raise ValueError(f"competition {competition_id!r}: config.yaml declares {key} "
                             f"{str(rel)!r}, outside the competition's folder {competition_id}/")
        out[str(key)] = root.joinpath(*rel.parts)
    return out
