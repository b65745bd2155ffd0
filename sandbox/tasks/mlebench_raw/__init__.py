"""Small synthetic raw files in the exact layout Kaggle ships, for MLE-bench Lite's competitions.

MLE-bench's users start from Kaggle's download of a competition and run MLE-bench's own
``prepare.py`` on it. Kaggle's files cannot be fetched here, so for each of MLE-bench Lite's 22
competitions (``LITE``, MLE-bench's ``experiments/splits/low.txt``) one module of this package
writes made-up raw files with the names, columns, formats (csv, json, zip, images, audio,
TFRecords) and folder layout that competition's ``prepare.py`` reads, at tens of rows or images,
with a learnable signal. MLE-bench's preparer and grader then run on them unchanged.

One module per competition, named after its id (``-`` -> ``_``), each with::

    def write_raw(raw: pathlib.Path, n_rows: int, rng: numpy.random.Generator) -> None

``raw`` is the (empty, existing) folder ``mlebench prepare`` would have extracted Kaggle's download
into; ``n_rows`` the size of the training set (rows, images or clips). Each competition's baseline
script, a seed solution that reads ``./input`` and writes ``./submission/submission.csv``, is
``sandbox/seed_corpus/mlebench/<id>/01_baseline.py``.
"""
from __future__ import annotations

import importlib
import os
import pathlib

import numpy as np

#: MLE-bench Lite ("low complexity" split, ``experiments/splits/low.txt``), in its file order.
LITE = (
    "aerial-cactus-identification",
    "aptos2019-blindness-detection",
    "denoising-dirty-documents",
    "detecting-insults-in-social-commentary",
    "dog-breed-identification",
    "dogs-vs-cats-redux-kernels-edition",
    "histopathologic-cancer-detection",
    "jigsaw-toxic-comment-classification-challenge",
    "leaf-classification",
    "mlsp-2013-birds",
    "new-york-city-taxi-fare-prediction",
    "nomad2018-predict-transparent-conductors",
    "plant-pathology-2020-fgvc7",
    "random-acts-of-pizza",
    "ranzcr-clip-catheter-line-classification",
    "siim-isic-melanoma-classification",
    "spooky-author-identification",
    "tabular-playground-series-dec-2021",
    "tabular-playground-series-may-2022",
    "text-normalization-challenge-english-language",
    "text-normalization-challenge-russian-language",
    "the-icml-2013-whale-challenge-right-whale-redux",
)

#: Where the competitions' baseline scripts (seed solutions) live: ``<id>/NN_<name>.py``.
BASELINES_DIR = pathlib.Path(__file__).resolve().parents[2] / "seed_corpus" / "mlebench"


def module_name(competition_id: str) -> str:
    return __name__ + "." + competition_id.replace("-", "_")


def write_synthetic_raw(competition_id: str, raw_dir: "os.PathLike | str", *, n_rows: int = 60,
                        seed: int = 0) -> list[pathlib.Path]:
    """Writes made-up raw files of ``competition_id`` in Kaggle's layout into ``raw_dir``.

    Args:
      competition_id: one of ``LITE``.
      raw_dir: the folder to write (created).
      n_rows: size of the training set (rows, images or clips; at least 20).
      seed: seed of the made-up data.

    Returns:
      the files written (sorted).

    Raises:
      ValueError: an id outside ``LITE``, or ``n_rows`` < 20.
    """
    if competition_id not in LITE:
        raise ValueError(f"no synthetic raw files for {competition_id!r}: only MLE-bench Lite's "
                         f"{len(LITE)} competitions have them ({', '.join(LITE[:3])}, ...); "
                         "other competitions need Kaggle's files")
    if n_rows < 20:
        raise ValueError(f"n_rows={n_rows}: need at least 20 (MLE-bench's preparers hold out a "
                         "tenth or more as test answers)")
    raw = pathlib.Path(raw_dir)
    raw.mkdir(parents=True, exist_ok=True)
    module = importlib.import_module(module_name(competition_id))
    rng = np.random.default_rng([seed, sum(map(ord, competition_id))])
    module.write_raw(raw, n_rows, rng)
    return sorted(p for p in raw.rglob("*") if p.is_file())


def baseline_scripts(competition_id: str) -> list[pathlib.Path]:
    """The committed baseline scripts (seed solutions) of a competition, sorted by name."""
    return sorted((BASELINES_DIR / competition_id).glob("[0-9][0-9]_*.py"))
