"""denoising-dirty-documents: Kaggle's download holds ``train.zip`` (``train/<n>.png``, 144
greyscale scans of text pages, 540 pixels wide and 258 or 420 high, with stains, folds and fading
added), ``train_cleaned.zip`` (``train_cleaned/<n>.png``, the same pages clean: white paper, dark
text), ``test.zip`` (``test/<n>.png``, 72 noisy pages) and ``sampleSubmission.csv.zip``
(``id,value``: one row ``<image>_<row>_<col>`` per test pixel, 1-based, value 1). MLE-bench's
preparer reads ``train.zip`` and ``train_cleaned.zip``: it splits their pages into new train and
test pages and writes the test pages' clean pixels as answers. Here the pages are made up and tiny
(32 pixels wide, 15 or 25 high, numbered from 1 like Kaggle's, train and test numbers interleaved;
a third as many test pages as training pages): the clean page is white with rows of dark "words";
the noisy one sits on a smoothly varying stained background with a darker blotch, fainter ink and
pixel noise, so a per-pixel model of the noisy page and its neighbourhood learns the clean
intensity.
"""
from __future__ import annotations

import io
import pathlib
import zipfile

import numpy as np
from PIL import Image

from sandbox.tasks.mlebench_raw._zip import zip_entry

_WIDTH = 32
_HEIGHTS = (15, 25)  # Kaggle's 258 and 420 pixel pages, scaled to 32 wide


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode="L").save(buf, format="PNG")
    return buf.getvalue()


def _to8(a: np.ndarray) -> np.ndarray:
    return np.clip(np.round(a * 255), 0, 255).astype(np.uint8)


def _page(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One clean page and its noisy scan, uint8 greyscale."""
    h, w = int(rng.choice(_HEIGHTS)), _WIDTH
    clean = np.ones((h, w))
    ink = rng.uniform(0.05, 0.3)
    top = int(rng.integers(1, 3))
    line_h = int(rng.integers(1, 3))
    for y in range(top, h - line_h, line_h + int(rng.integers(2, 5))):
        x = int(rng.integers(0, 3))
        while x < w - 2:
            word = int(rng.integers(2, 7))
            clean[y:y + line_h, x:min(x + word, w)] = ink + rng.uniform(0, 0.1)
            x += word + int(rng.integers(1, 3))
    # the scan: smooth stain (background level varies across the page), a darker blotch,
    # faded ink (text lighter than clean), pixel noise
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    back = (rng.uniform(0.55, 0.9) + rng.uniform(-0.15, 0.15) * xx
            + rng.uniform(-0.15, 0.15) * yy)
    cy, cx, r = rng.uniform(0, h / max(h, w)), rng.uniform(0, 1), rng.uniform(0.1, 0.35)
    back = back - rng.uniform(0.1, 0.3) * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / r ** 2)
    text = clean < 0.99
    noisy = np.where(text, np.minimum(clean + rng.uniform(0.05, 0.25), back), back)
    noisy = noisy + rng.normal(0, 0.04, size=(h, w))
    return _to8(clean), _to8(noisy)


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    n_test = max(n_rows // 3, 1)  # Kaggle: 144 train, 72 test pages
    numbers = rng.permutation(np.arange(1, n_rows + n_test + 1))
    train_ids, test_ids = sorted(numbers[:n_rows]), sorted(numbers[n_rows:])
    with zipfile.ZipFile(raw / "train.zip", "w", zipfile.ZIP_DEFLATED) as zt, \
            zipfile.ZipFile(raw / "train_cleaned.zip", "w", zipfile.ZIP_DEFLATED) as zc:
        for i in train_ids:
            clean, noisy = _page(rng)
            zt.writestr(zip_entry(f"train/{i}.png"), _png(noisy))
            zc.writestr(zip_entry(f"train_cleaned/{i}.png"), _png(clean))
    rows = ["id,value"]
    with zipfile.ZipFile(raw / "test.zip", "w", zipfile.ZIP_DEFLATED) as zs:
        for i in test_ids:
            _, noisy = _page(rng)
            zs.writestr(zip_entry(f"test/{i}.png"), _png(noisy))
            h, w = noisy.shape
            rows += [f"{i}_{r}_{c},1" for r in range(1, h + 1) for c in range(1, w + 1)]
    with zipfile.ZipFile(raw / "sampleSubmission.csv.zip", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr(zip_entry("sampleSubmission.csv"), "\n".join(rows) + "\n")
