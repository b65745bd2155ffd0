"""histopathologic-cancer-detection: Kaggle's download, extracted, is ``train_labels.csv``
(id,label; id 40 hex digits, label 1 for 41% of the patches), ``train/`` (one 96x96 RGB TIFF
``<id>.tif`` per row), ``test/`` (57,458 TIFFs against 220,025 train) and
``sample_submission.csv`` (id,label = 0); MLE-bench's preparer reads ``train_labels.csv``,
``train/`` and the number of files in ``test/`` (its test share). Made up here: 24x24 RGB TIFFs
of pink H&E-stained tissue with scattered small purple nuclei (and a few dark lymphocytes) and a
per-slide stain strength; a positive patch has a cluster of large dark tumour nuclei touching its
central 8x8 region (the centre third, as Kaggle's 32x32 of 96x96), while a third of the negatives
have such a cluster only in the outer ring, which does not count; 4% of labels are flipped.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pandas as pd
from PIL import Image

SIZE = 24
#: Kaggle's train_labels.csv: 89,117 of 220,025 patches are positive.
P_TUMOUR = 89117 / 220025
#: Kaggle's test/ holds 57,458 patches against train/'s 220,025.
TEST_SHARE = 57458 / 220025


def _nuclei(img: np.ndarray, rng: np.random.Generator, centres: np.ndarray, colour,
            radius: tuple[float, float]) -> None:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE]
    for cy, cx in centres:
        r = rng.uniform(*radius)
        img[(yy - cy) ** 2 + (xx - cx) ** 2 <= r * r] = np.asarray(colour) * rng.uniform(0.8, 1.1)


def _image(rng: np.random.Generator, tumour: bool) -> np.ndarray:
    stain = rng.uniform(0.8, 1.15, 3)  # slides differ in staining
    img = np.array([235, 175, 205]) * stain + rng.normal(0, 9, (SIZE, SIZE, 3))
    normal = np.array([120, 60, 150]) * stain
    _nuclei(img, rng, rng.uniform(0, SIZE, (int(rng.poisson(12)), 2)), normal, (0.6, 1.3))
    lymphocytes = rng.uniform(0, SIZE, (int(rng.poisson(2)), 2))  # small, dark, anywhere
    _nuclei(img, rng, lymphocytes, np.array([80, 30, 110]) * stain, (0.5, 1.0))
    if tumour:  # a cluster reaching into the centre
        around = rng.uniform(SIZE / 3 - 1, 2 * SIZE / 3 + 1, 2)
    elif rng.random() < 1 / 3:  # a cluster in the outer ring only
        side = rng.integers(4)
        edge = rng.uniform(1, 5)
        along = rng.uniform(1, SIZE - 1)
        around = np.array([[edge, along], [SIZE - 1 - edge, along],
                           [along, edge], [along, SIZE - 1 - edge]][side])
    else:
        around = None
    if around is not None:
        cluster = around + rng.normal(0, 2.0, (int(rng.integers(3, 7)), 2))
        _nuclei(img, rng, cluster, np.array([85, 35, 115]) * stain, (1.0, 1.7))
    return np.clip(img, 0, 255).astype(np.uint8)


def _ids(rng: np.random.Generator, n: int) -> list[str]:
    return ["".join("0123456789abcdef"[d] for d in row) for row in rng.integers(0, 16, (n, 40))]


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    n_test = max(round(n_rows * TEST_SHARE), 4)
    ids = _ids(rng, n_rows + n_test)
    train_ids, test_ids = ids[:n_rows], ids[n_rows:]
    label = (rng.random(n_rows) < P_TUMOUR).astype(int)
    flipped = rng.random(n_rows) < 0.04
    for folder, names, shows in (("train", train_ids, label ^ flipped),
                                 ("test", test_ids, rng.random(n_test) < P_TUMOUR)):
        (raw / folder).mkdir()
        for name, tumour in zip(names, shows):
            Image.fromarray(_image(rng, bool(tumour))).save(raw / folder / f"{name}.tif")
    pd.DataFrame({"id": train_ids, "label": label}).to_csv(raw / "train_labels.csv", index=False)
    pd.DataFrame({"id": test_ids, "label": 0}).to_csv(raw / "sample_submission.csv", index=False)
