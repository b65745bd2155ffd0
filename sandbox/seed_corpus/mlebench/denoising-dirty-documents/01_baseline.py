"""denoising-dirty-documents: per-pixel random forest on local filters of the noisy page."""
import os
from pathlib import Path

import numpy as np
import pandas as pd
from PIL import Image
from scipy import ndimage
from sklearn.ensemble import RandomForestRegressor
from sklearn.metrics import root_mean_squared_error
from sklearn.model_selection import train_test_split


def load(path):
    return np.asarray(Image.open(path).convert("L"), dtype=np.float64) / 255.0


def features(img):
    """One row per pixel: its value, neighbourhood means, a background estimate (local max)."""
    back = ndimage.maximum_filter(img, size=7)
    cols = [img, ndimage.uniform_filter(img, 3), ndimage.uniform_filter(img, 5),
            ndimage.minimum_filter(img, 3), back, img - back, np.full_like(img, np.median(img))]
    return np.stack([c.ravel() for c in cols], axis=1)


train_names = sorted(p.name for p in Path("./input/train").glob("*.png"))
X_img = {n: load(Path("./input/train") / n) for n in train_names}
y_img = {n: load(Path("./input/train_cleaned") / n) for n in train_names}


def stack(names, max_rows=None):
    X = np.concatenate([features(X_img[n]) for n in names])
    y = np.concatenate([y_img[n].ravel() for n in names])
    if max_rows and len(y) > max_rows:  # a random subset of pixels keeps the fit fast
        keep = np.random.default_rng(0).choice(len(y), max_rows, replace=False)
        X, y = X[keep], y[keep]
    return X, y


def model():
    return RandomForestRegressor(n_estimators=40, min_samples_leaf=10, random_state=0)


tr, va = train_test_split(train_names, test_size=0.2, random_state=0)
X_tr, y_tr = stack(tr, max_rows=30_000)
X_va, y_va = stack(va)
m = model().fit(X_tr, y_tr)
score = root_mean_squared_error(y_va, np.clip(m.predict(X_va), 0, 1))
print(f"VALIDATION_METRIC: {score:.5f}")

X, y = stack(train_names, max_rows=30_000)
m = model().fit(X, y)
ids, values = [], []
for path in sorted(Path("./input/test").glob("*.png")):
    img = load(path)
    pred = np.clip(m.predict(features(img)), 0, 1).reshape(img.shape)
    rows, cols = np.indices(img.shape)
    ids += [f"{path.stem}_{r + 1}_{c + 1}" for r, c in zip(rows.ravel(), cols.ravel())]
    values.append(pred.ravel())
os.makedirs("./submission", exist_ok=True)
pd.DataFrame({"id": ids, "value": np.concatenate(values)}).to_csv(
    "./submission/submission.csv", index=False)
