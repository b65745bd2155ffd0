"""dogs-vs-cats-redux-kernels-edition: Kaggle's download, extracted, is ``train.zip``
(``train/cat.<k>.jpg`` and ``train/dog.<k>.jpg``, 12,500 each, the label only in the file name),
``test.zip`` (``test/<n>.jpg``, n = 1..12,500) and ``sample_submission.csv`` (id,label = 0.5, the
probability of a dog); MLE-bench's preparer extracts both zips and splits only the train images
(it writes its own sample submission). Made up here: RGB JPEGs of various sizes (20-32 x
24-40 px) of an animal-shaped blob on a random indoor/outdoor background; a dog's fur is drawn
from warm browns and golds, a cat's from greys, whites and gingers, and 15% of each are black, so
the fur colour carries the label with real overlap.
"""
from __future__ import annotations

import io
import pathlib

import numpy as np
import pandas as pd
from PIL import Image

from sandbox.tasks.mlebench_raw._zip import write_zip

#: Kaggle's test.zip holds 12,500 images against train.zip's 25,000.
TEST_SHARE = 0.5
#: Fur colours (RGB) of each class; black fur (the last) is as common in both.
FUR = {"dog": ((150, 100, 55), (205, 160, 90), (95, 60, 35), (35, 30, 28)),
       "cat": ((125, 125, 135), (220, 218, 212), (200, 125, 65), (35, 30, 28))}
FUR_P = {"dog": (0.45, 0.3, 0.1, 0.15), "cat": (0.5, 0.25, 0.1, 0.15)}


def _image(rng: np.random.Generator, animal: str) -> bytes:
    h, w = int(rng.integers(20, 33)), int(rng.integers(24, 41))
    yy, xx = np.mgrid[0:h, 0:w].astype(float)
    back = rng.uniform(50, 220) + rng.normal(0, 25, 3)  # a room, a lawn, a sofa
    img = back + (yy / h - 0.5)[..., None] * rng.normal(0, 40, 3) + rng.normal(0, 10, (h, w, 3))
    fur = np.asarray(FUR[animal][rng.choice(4, p=FUR_P[animal])], float)
    fur = fur * rng.uniform(0.8, 1.2) + rng.normal(0, 12, 3)
    cy, cx = h * rng.uniform(0.4, 0.6), w * rng.uniform(0.35, 0.65)
    ry, rx = h * rng.uniform(0.3, 0.4), w * rng.uniform(0.25, 0.35)
    body = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1
    head = ((yy - cy + ry) / (ry * 0.55)) ** 2 + ((xx - cx) / (rx * 0.6)) ** 2 <= 1
    animal_px = body | head
    img[animal_px] = fur + rng.normal(0, 14, (int(animal_px.sum()), 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=85)
    return buf.getvalue()


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    n_cats = n_rows // 2
    train = {f"train/{animal}.{k}.jpg": _image(rng, animal)
             for animal, count in (("cat", n_cats), ("dog", n_rows - n_cats))
             for k in range(count)}
    write_zip(raw / "train.zip", train)
    n_test = max(round(n_rows * TEST_SHARE), 4)
    write_zip(raw / "test.zip", {f"test/{i}.jpg": _image(rng, str(rng.choice(["cat", "dog"])))
                            for i in range(1, n_test + 1)})
    pd.DataFrame({"id": range(1, n_test + 1), "label": 0.5}).to_csv(
        raw / "sample_submission.csv", index=False)
