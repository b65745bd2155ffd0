"""plant-pathology-2020-fgvc7: Kaggle's download holds ``train.csv`` (image_id ``Train_0`` ..
``Train_1820`` and one-hot columns healthy, multiple_diseases, rust, scab: exactly one 1 a row),
``test.csv`` (``Test_0`` ..), ``sample_submission.csv`` and ``images/`` with every ``Train_i.jpg``
and ``Test_i.jpg``; MLE-bench's preparer reads only ``train.csv`` and the ``images/Train_*.jpg``
(renaming its 10% test split to ``Test_*``), so only those are written. The leaves are made up: a
24x24 green leaf on a dark background with 1-5 orange spots for rust, 1-5 dark olive blotches for
scab, both for multiple_diseases and none for healthy, under random lighting, plus noise; labels
follow Kaggle's shares (28/5/34/33%, multiple_diseases raised to 8%). Since the grade is the mean
column-wise ROC AUC, the rows that MLE-bench's split (``train_test_split(test_size=0.1,
random_state=0)``) holds out are relabelled where needed so that every class occurs among them (and
in each half of them by sorted id, when a half has 4 or more rows), and every class occurs twice in
the rest. With one label a row, fewer than 4 held-out rows (n_rows < 31) leave a class out and its
AUC undefined.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pandas as pd
from PIL import Image
from sklearn.model_selection import train_test_split

CLASSES = ("healthy", "multiple_diseases", "rust", "scab")
SHARES = (0.28, 0.08, 0.33, 0.31)
SIZE = 24


def _cover(label: np.ndarray, rows: np.ndarray, need: int, rng: np.random.Generator) -> None:
    """Relabels rows of ``label`` (in ``rows``) until every class occurs ``need`` times there,
    taking rows from the most frequent class."""
    if len(rows) < need * len(CLASSES):
        return
    for c in range(len(CLASSES)):
        while (label[rows] == c).sum() < need:
            counts = np.bincount(label[rows], minlength=len(CLASSES))
            donors = rows[label[rows] == counts.argmax()]
            label[rng.choice(donors)] = c


def _leaf(cls: int, rng: np.random.Generator) -> Image.Image:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(float)
    img = np.array([40.0, 35.0, 30.0]) + rng.normal(0, 12, (SIZE, SIZE, 3))
    cy, cx = rng.uniform(10, 14, 2)
    leaf = ((yy - cy) / rng.uniform(8, 11)) ** 2 + ((xx - cx) / rng.uniform(5, 8)) ** 2 <= 1
    img[leaf] = np.array([70.0, 150.0, 50.0]) + rng.normal(0, 15, (int(leaf.sum()), 3))
    name = CLASSES[cls]
    few = lambda: int(rng.integers(1, 6))  # noqa: E731
    spots = {"rust": [("rust", few())], "scab": [("scab", few())],
             "multiple_diseases": [("rust", few()), ("scab", few())]}.get(name, [])
    colour = {"rust": [230.0, 140.0, 30.0], "scab": [70.0, 60.0, 25.0]}
    for kind, count in spots:
        for _ in range(count):
            sy, sx = rng.normal([cy, cx], 3.5)
            r = rng.uniform(1.0, 2.2)
            spot = leaf & (((yy - sy) ** 2 + (xx - sx) ** 2) <= r * r)
            img[spot] = np.array(colour[kind]) + rng.normal(0, 15, (int(spot.sum()), 3))
    img *= rng.uniform(0.7, 1.3)  # lighting
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    label = rng.choice(len(CLASSES), size=n_rows, p=SHARES)
    train_rows, test_rows = train_test_split(np.arange(n_rows), test_size=0.1, random_state=0)
    # MLE-bench renames its test rows Test_0, Test_1, ... in split order; halves by sorted name
    by_name = test_rows[np.argsort([f"Test_{j}" for j in range(len(test_rows))])]
    for half in (by_name[::2], by_name[1::2]):
        _cover(label, half, 1, rng)
    _cover(label, test_rows, 1, rng)
    _cover(label, train_rows, 2, rng)
    ids = [f"Train_{i}" for i in range(n_rows)]
    (raw / "images").mkdir(parents=True, exist_ok=True)
    for image_id, c in zip(ids, label):
        _leaf(c, rng).save(raw / "images" / f"{image_id}.jpg", quality=90)
    onehot = {name: (label == c).astype(int) for c, name in enumerate(CLASSES)}
    pd.DataFrame({"image_id": ids, **onehot}).to_csv(raw / "train.csv", index=False)
