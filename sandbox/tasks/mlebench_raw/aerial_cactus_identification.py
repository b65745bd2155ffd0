"""aerial-cactus-identification: Kaggle's download, extracted, is ``train.csv`` (id,has_cactus; the
id is the image's file name, 32 hex digits + ``.jpg``; about 75% have a cactus), ``train.zip``
(``train/<id>`` 32x32 RGB JPEGs), ``test.zip`` (``test/<id>``, 4,000 against 17,500 train) and
``sample_submission.csv`` (id,has_cactus = 0.5); MLE-bench's preparer reads only ``train.csv``
and ``train.zip``. Made up here: 32x32 sandy aerial patches with textured ground and dark shrubs;
a cactus is a dark green elongated column at a random place and angle (3% of labels flipped), so
the colour statistics of an image carry the label.
"""
from __future__ import annotations

import io
import pathlib

import numpy as np
import pandas as pd
from PIL import Image

from sandbox.tasks.mlebench_raw._zip import write_zip

SIZE = 32
#: Kaggle's train.csv: 13,136 of 17,500 images have a cactus.
P_CACTUS = 0.75
#: Kaggle's test.zip holds 4,000 images against train.zip's 17,500.
TEST_SHARE = 4000 / 17500


def _blob(img: np.ndarray, rng: np.random.Generator, colour, length: float, width: float) -> None:
    """Blends an ellipse of ``colour`` (length x width px, random place and angle) into ``img``."""
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(float)
    cy, cx = rng.uniform(6, SIZE - 6, 2)
    angle = rng.uniform(0, np.pi)
    u = (xx - cx) * np.cos(angle) + (yy - cy) * np.sin(angle)
    v = -(xx - cx) * np.sin(angle) + (yy - cy) * np.cos(angle)
    inside = (u / (length / 2)) ** 2 + (v / (width / 2)) ** 2
    alpha = np.clip(1.5 - inside, 0, 1)[..., None]
    img[:] = img * (1 - alpha) + np.asarray(colour, float) * alpha


def _image(rng: np.random.Generator, cactus: bool) -> bytes:
    light = rng.uniform(0.7, 1.2)
    ground = np.array([165, 145, 115]) * light + rng.normal(0, 6, 3)
    coarse = rng.normal(0, 14, (4, 4, 1))  # low-frequency relief, upsampled to 32x32
    img = ground + np.kron(coarse, np.ones((8, 8, 1))) + rng.normal(0, 9, (SIZE, SIZE, 3))
    for _ in range(int(rng.poisson(1.5))):  # shrubs and shadows, in both classes
        shade = rng.uniform(60, 110)
        _blob(img, rng, (shade, shade * 0.95, shade * 0.7), rng.uniform(3, 7), rng.uniform(3, 6))
    if cactus:
        green = np.array([70, 95, 60]) * rng.uniform(0.7, 1.2)
        _blob(img, rng, green, rng.uniform(14, 28), rng.uniform(3.5, 6))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _ids(rng: np.random.Generator, n: int) -> list[str]:
    digits = rng.integers(0, 16, (n, 32))
    return ["".join("0123456789abcdef"[d] for d in row) + ".jpg" for row in digits]


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    n_test = max(round(n_rows * TEST_SHARE), 4)
    ids = _ids(rng, n_rows + n_test)
    train_ids, test_ids = ids[:n_rows], ids[n_rows:]
    has_cactus = (rng.random(n_rows) < P_CACTUS).astype(int)
    flipped = rng.random(n_rows) < 0.03
    images = {f"train/{i}": _image(rng, bool(c ^ f))
              for i, c, f in zip(train_ids, has_cactus, flipped)}
    pd.DataFrame({"id": train_ids, "has_cactus": has_cactus}).to_csv(raw / "train.csv",
                                                                     index=False)
    write_zip(raw / "train.zip", images)
    write_zip(raw / "test.zip",
              {f"test/{i}": _image(rng, rng.random() < P_CACTUS) for i in test_ids})
    pd.DataFrame({"id": test_ids, "has_cactus": 0.5}).to_csv(raw / "sample_submission.csv",
                                                             index=False)
