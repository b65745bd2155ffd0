"""tabular-playground-series-may-2022: Kaggle's download, extracted, is ``train.csv`` (900,000
rows: ``id``, the 31 features ``f_00``..``f_30`` and the binary ``target``), ``test.csv`` (700,000
rows, ids from 900,000, no ``target``) and ``sample_submission.csv`` (``id,target`` = 0.5);
MLE-bench's preparer reads only ``train.csv`` and splits off exactly 100,000 rows
(``test_size=100_000``) as its test set, so ``train.csv`` here has ``n_rows + 100_000`` rows (about
13 MB: the preparer cannot run on fewer) and the prepared training set has ``n_rows``;
``test.csv`` has ``max(n_rows // 3, 1)``. Made up here, in Kaggle's columns and types:
``f_00``-``f_06`` and ``f_19``-``f_26`` normal floats (two decimals), ``f_07``-``f_18`` small
integer counts, ``f_27`` a 10-letter string over A-T, ``f_28`` a wide float, ``f_29`` 0/1 and
``f_30`` 0/1/2; ``target`` is drawn from a logistic model of a few floats, the count of the letter
``A`` in ``f_27`` and ``f_30``, so about half the rows are positive and a linear model learns it.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pandas as pd

#: MLE-bench's prepare.py holds out exactly this many rows of train.csv as its test set.
PREPARER_TEST_ROWS = 100_000
#: f_27's letters and how often each is drawn (skewed to the first letters, as on Kaggle).
_LETTERS = np.array(list("ABCDEFGHIJKLMNOPQRST"))
_LETTER_P = np.exp(-0.35 * np.arange(len(_LETTERS)))
_LETTER_P /= _LETTER_P.sum()


def _rows(ids: np.ndarray, rng: np.random.Generator, with_target: bool) -> pd.DataFrame:
    """Rows in Kaggle's column order: id, f_00 .. f_30, [target]."""
    n = len(ids)
    cols: dict[str, object] = {"id": ids}
    for k in range(0, 7):
        cols[f"f_{k:02d}"] = np.round(rng.normal(0.0, 1.0, n), 2)
    for k in range(7, 19):
        cols[f"f_{k:02d}"] = rng.poisson(1.0 + 0.4 * (k - 7), n)
    for k in range(19, 27):
        cols[f"f_{k:02d}"] = np.round(rng.normal(0.0, 1.6, n), 2)
    letters = rng.choice(_LETTERS, size=(n, 10), p=_LETTER_P)
    cols["f_27"] = ["".join(r) for r in letters]
    cols["f_28"] = np.round(rng.normal(0.0, 240.0, n), 1)
    cols["f_29"] = rng.integers(0, 2, n)
    cols["f_30"] = rng.integers(0, 3, n)
    if with_target:
        n_a = (letters == "A").sum(axis=1)
        logit = (1.1 * cols["f_00"] - 0.9 * cols["f_01"] + 0.45 * cols["f_21"]
                 + 0.6 * (n_a - n_a.mean()) + 0.8 * (cols["f_30"] == 2) - 0.25
                 + 0.3 * cols["f_29"] * (cols["f_30"] == 0))
        cols["target"] = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(int)
    return pd.DataFrame(cols)


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    n_train = n_rows + PREPARER_TEST_ROWS
    _rows(np.arange(n_train), rng, True).to_csv(raw / "train.csv", index=False)
    test_ids = np.arange(900_000, 900_000 + max(n_rows // 3, 1))   # Kaggle's test ids follow
    _rows(test_ids, rng, False).to_csv(raw / "test.csv", index=False)
    pd.DataFrame({"id": test_ids, "target": 0.5}).to_csv(raw / "sample_submission.csv",
                                                          index=False)
