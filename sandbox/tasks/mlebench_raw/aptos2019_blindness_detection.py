"""aptos2019-blindness-detection: Kaggle's download, extracted, is ``train.csv`` (id_code,diagnosis;
id_code 12 hex digits, diagnosis 0-4 in Kaggle's shares 49/10/27/5/8%), ``train_images/`` (one
RGB PNG fundus photograph ``<id_code>.png`` per row, of various sizes), ``test.csv`` (id_code),
``test_images/`` (1,928 against 3,662 train) and ``sample_submission.csv`` (id_code,diagnosis =
0); MLE-bench's preparer reads only ``train.csv`` and ``train_images/``. Made up here: small
fundus images (a red-orange disc with a bright optic disc on a black background, 21x28 to 30x40
px, random exposure and colour balance) whose count of yellow exudates and dark red
haemorrhages, and slight paling of the disc, grow with the grade; 12% of grades are off by one.
"""
from __future__ import annotations

import io
import pathlib

import numpy as np
import pandas as pd
from PIL import Image

#: Kaggle's train.csv: 1,805 / 370 / 999 / 193 / 295 images of grades 0-4.
GRADE_SHARES = np.array([1805, 370, 999, 193, 295]) / 3662
#: Kaggle's test_images/ holds 1,928 images against train_images/' 3,662.
TEST_SHARE = 1928 / 3662
#: (height, width) of the made-up photographs: cameras differ, so do Kaggle's sizes.
SIZES = ((24, 32), (32, 32), (21, 28), (30, 40))


def _dots(img: np.ndarray, rng: np.random.Generator, inside: np.ndarray, n: int, colour,
          radius: tuple[float, float]) -> None:
    """Paints ``n`` round spots of ``colour`` at random places inside the fundus."""
    h, w = inside.shape
    yy, xx = np.mgrid[0:h, 0:w]
    ys, xs = np.nonzero(inside)
    for k in rng.integers(0, len(ys), n):
        r = rng.uniform(*radius)
        spot = ((yy - ys[k]) ** 2 + (xx - xs[k]) ** 2 <= r * r) & inside
        img[spot] = np.asarray(colour, float) * rng.uniform(0.85, 1.15)


def _image(rng: np.random.Generator, grade: int) -> bytes:
    h, w = SIZES[rng.integers(len(SIZES))]
    yy, xx = np.mgrid[0:h, 0:w].astype(float)
    cy, cx, r = (h - 1) / 2, (w - 1) / 2, min(h, w) * rng.uniform(0.46, 0.52)
    dist = np.hypot(yy - cy, xx - cx) / r
    inside = dist <= 1
    exposure = rng.uniform(0.6, 1.3)
    tint = rng.uniform(0.85, 1.15, 3)  # the camera's colour balance
    fundus = np.array([190, 85, 35]) + np.array([3, 4, 2]) * grade  # paler with the grade
    img = fundus * tint * exposure * (1 - 0.35 * dist[..., None] ** 2)
    img += rng.normal(0, 5, img.shape)
    oy, ox = cy + rng.uniform(-2, 2), cx + rng.choice([-1, 1]) * r * 0.45  # optic disc
    disc = np.hypot(yy - oy, xx - ox) <= r * 0.18
    img[disc] = np.array([245, 200, 120]) * min(exposure, 1.0)
    retina = inside & ~disc
    _dots(img, rng, retina, int(rng.poisson(0.3 + 0.9 * grade)), (235, 215, 90), (0.7, 1.6))
    _dots(img, rng, retina, int(rng.poisson(0.3 + 1.0 * grade)), (90, 15, 10), (0.5, 1.3))
    img[~inside] = rng.integers(0, 6)  # the black surround
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _ids(rng: np.random.Generator, n: int) -> list[str]:
    return ["".join("0123456789abcdef"[d] for d in row) for row in rng.integers(0, 16, (n, 12))]


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    n_test = max(round(n_rows * TEST_SHARE), 4)
    ids = _ids(rng, n_rows + n_test)
    train_ids, test_ids = ids[:n_rows], ids[n_rows:]
    diagnosis = rng.choice(5, n_rows, p=GRADE_SHARES)
    seen = diagnosis.copy()  # the grade the image shows; the label is off by one for 8%
    off = rng.random(n_rows) < 0.12
    seen[off] = np.clip(seen[off] + rng.choice([-1, 1], int(off.sum())), 0, 4)
    for folder, names, grades in (("train_images", train_ids, seen),
                                  ("test_images", test_ids,
                                   rng.choice(5, n_test, p=GRADE_SHARES))):
        (raw / folder).mkdir()
        for name, grade in zip(names, grades):
            (raw / folder / f"{name}.png").write_bytes(_image(rng, int(grade)))
    pd.DataFrame({"id_code": train_ids, "diagnosis": diagnosis}).to_csv(raw / "train.csv",
                                                                        index=False)
    pd.DataFrame({"id_code": test_ids}).to_csv(raw / "test.csv", index=False)
    pd.DataFrame({"id_code": test_ids, "diagnosis": 0}).to_csv(raw / "sample_submission.csv",
                                                               index=False)
