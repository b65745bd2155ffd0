"""leaf-classification: Kaggle's download holds ``train.csv.zip`` (``train.csv``: id, species, then
64 columns each of margin1..margin64, shape1..shape64, texture1..texture64, rows sorted by id; 990
leaves, 10 of each of the 99 species), ``test.csv.zip`` (``test.csv``: the 594 other ids, no
species), ``sample_submission.csv.zip`` (id and one probability column per species, 1/99) and
``images.zip`` (``images/<id>.jpg``, a binary silhouette of every leaf, white on black, ids 1..1584
shared by train and test). MLE-bench's preparer reads ``train.csv.zip`` and ``images.zip``. Here
the leaves are made up: about six leaves per species of a random subset of MLE-bench's 99 species
names (all 99 from about 600 training rows up), margin and texture columns are histograms (counts
over 128 and 1024, as Kaggle's look) drawn around a profile of the species, shape is a smooth
contour-distance curve of the species plus noise, and each image (a few dozen pixels a side) is a
lobed silhouette whose lobes and elongation follow the species.
"""
from __future__ import annotations

import importlib
import io
import pathlib
import zipfile

import numpy as np
import pandas as pd
from PIL import Image

from sandbox.tasks.mlebench_raw._zip import zip_csv, zip_entry

_PER_SPECIES = 6


def _species_names() -> list[str]:
    # the 99 names the grader's columns use (MLE-bench's copy of Kaggle's species list)
    classes = importlib.import_module("mlebench.competitions.leaf-classification.classes")
    return list(classes.CLASSES)


def _silhouette(rng: np.random.Generator, lobes: int, elong: float, depth: float) -> bytes:
    h, w = (int(v) for v in rng.integers(28, 48, size=2))
    yy, xx = np.mgrid[0:h, 0:w]
    y = (yy - h / 2) / (h / 2 - 1)
    x = (xx - w / 2) / (w / 2 - 1)
    rot = rng.uniform(0, np.pi)
    u, v = x * np.cos(rot) + y * np.sin(rot), -x * np.sin(rot) + y * np.cos(rot)
    theta, r = np.arctan2(v * elong, u), np.hypot(u, v * elong)
    edge = 0.8 * (1 - depth + depth * np.abs(np.cos(lobes * theta / 2))) * rng.uniform(0.85, 1)
    img = np.where(r < edge, 255, 0).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img, mode="L").save(buf, format="JPEG", quality=75)
    return buf.getvalue()


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    names = _species_names()
    n_species = int(min(len(names), max(2, n_rows // _PER_SPECIES)))
    species = sorted(str(s) for s in rng.choice(names, size=n_species, replace=False))
    n_test = max(n_rows // 3, 1)  # Kaggle: 990 train, 594 test leaves
    ids = rng.permutation(np.arange(1, n_rows + n_test + 1))
    train_ids, test_ids = np.sort(ids[:n_rows]), np.sort(ids[n_rows:])
    # each species: a margin and a texture profile, a shape curve, a silhouette
    profile = {s: {"margin": rng.dirichlet(np.full(64, 0.6)),
                   "texture": rng.dirichlet(np.full(64, 0.3)),
                   "shape": 6e-4 + 3e-4 * np.cos(np.linspace(0, 2 * np.pi, 64)
                                                 * rng.integers(1, 5) + rng.uniform(0, np.pi)),
                   "lobes": int(rng.integers(1, 8)), "elong": rng.uniform(1, 2.5),
                   "depth": rng.uniform(0, 0.5)} for s in species}
    # every species appears; the rest at random
    label = np.concatenate([species, rng.choice(species, size=max(n_rows + n_test - n_species, 0))])
    label = rng.permutation(label)[:n_rows + n_test]
    leaf_of = dict(zip(np.concatenate([train_ids, test_ids]), label))

    def row(i: int) -> dict:
        p = profile[leaf_of[i]]
        # a leaf's histograms: its species' profile blended with a leaf-specific one
        mix = rng.uniform(0.35, 0.65)
        margin = rng.multinomial(128, mix * p["margin"] + (1 - mix) * rng.dirichlet(np.ones(64)))
        texture = rng.multinomial(1024, mix * p["texture"]
                                  + (1 - mix) * rng.dirichlet(np.full(64, 0.3)))
        margin, texture = margin / 128, texture / 1024
        shape = np.abs(p["shape"] * rng.normal(1, 0.1) + rng.normal(0, 1.5e-4, 64))
        return {"id": int(i), "species": str(leaf_of[i]),
                **{f"margin{k + 1}": round(v, 6) for k, v in enumerate(margin)},
                **{f"shape{k + 1}": round(v, 6) for k, v in enumerate(shape)},
                **{f"texture{k + 1}": round(v, 6) for k, v in enumerate(texture)}}

    train = pd.DataFrame([row(i) for i in train_ids])
    test = pd.DataFrame([row(i) for i in test_ids]).drop(columns=["species"])
    zip_csv(raw / "train.csv.zip", "train.csv", train)
    zip_csv(raw / "test.csv.zip", "test.csv", test)
    sample = pd.DataFrame({"id": test_ids, **{s: 1 / len(names) for s in names}})
    zip_csv(raw / "sample_submission.csv.zip", "sample_submission.csv", sample)
    with zipfile.ZipFile(raw / "images.zip", "w", zipfile.ZIP_DEFLATED) as z:
        for i in sorted(leaf_of):
            p = profile[leaf_of[i]]
            leaf = _silhouette(rng, p["lobes"], p["elong"], p["depth"])
            z.writestr(zip_entry(f"images/{i}.jpg"), leaf)
