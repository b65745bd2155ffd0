"""ranzcr-clip-catheter-line-classification: Kaggle's download holds ``train.csv``
(StudyInstanceUID, the 11 binary labels ``ETT - Abnormal`` .. ``Swan Ganz Catheter Present``,
PatientID), ``train_annotations.csv`` (StudyInstanceUID,label,data: the polyline of one tube as
``[[x, y], ...]``, for a third of the studies), ``train/<uid>.jpg`` (30,083 greyscale chest X-rays),
``test/`` (3,582), ``train_tfrecords/``, ``test_tfrecords/`` and ``sample_submission.csv``;
MLE-bench's preparer reads only ``train.csv``, ``train_annotations.csv`` and ``train/``, so only
those are written. The X-rays are made up: 32x32 greyscale (lungs, spine, noise) with a bright
polyline for each tube whose course depends on its label (an endotracheal tube ending too deep or
too high, a nasogastric tube ending in the stomach, short of it, in a lung or off the image, a
central line ending in the vena cava, short of it or up the neck, a Swan-Ganz catheter into the
pulmonary artery); every tube drawn has an annotation row for half of the studies. Labels are drawn
per tube type (the rarer ones far more often than on Kaggle) and independently per CVC class.
Since the grade is the mean ROC AUC over MLE-bench's 9 graded classes, the rows MLE-bench's split
(``train_test_split(test_size=0.1, random_state=0)``) holds out carry every label on exactly half of
them (so any half of them almost surely holds both values of every class: the dev split grades
on one), and each graded class has two positives and two negatives in the rest.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pandas as pd
from PIL import Image, ImageDraw
from sklearn.model_selection import train_test_split

LABELS = ("ETT - Abnormal", "ETT - Borderline", "ETT - Normal", "NGT - Abnormal",
          "NGT - Borderline", "NGT - Incompletely Imaged", "NGT - Normal", "CVC - Abnormal",
          "CVC - Borderline", "CVC - Normal", "Swan Ganz Catheter Present")
#: The classes MLE-bench grades (its classes.py): all but CVC - Normal and Swan Ganz.
GRADED = LABELS[:9]
SIZE = 32
#: One of each group or none (first entry), with these probabilities.
ETT = ((None, 0.45), ("ETT - Abnormal", 0.10), ("ETT - Borderline", 0.15), ("ETT - Normal", 0.30))
NGT = ((None, 0.40), ("NGT - Abnormal", 0.10), ("NGT - Borderline", 0.12),
       ("NGT - Incompletely Imaged", 0.15), ("NGT - Normal", 0.23))
CVC = (("CVC - Abnormal", 0.20), ("CVC - Borderline", 0.30), ("CVC - Normal", 0.60))
SWAN = 0.05

#: Tube course (polyline through these points, jittered) for each label.
COURSE = {
    "ETT - Normal": [(16, 0), (16, 6), (16, 11)],
    "ETT - Borderline": [(16, 0), (16, 6), (16, 14)],
    "ETT - Abnormal": [(16, 0), (16, 9), (17, 19)],
    "NGT - Normal": [(14, 0), (15, 12), (16, 24), (20, 28)],
    "NGT - Borderline": [(14, 0), (15, 12), (16, 21)],
    "NGT - Abnormal": [(14, 0), (15, 8), (9, 14), (8, 19)],
    "NGT - Incompletely Imaged": [(14, 0), (15, 12), (15, 18)],
    "CVC - Normal": [(30, 2), (23, 6), (18, 10)],
    "CVC - Borderline": [(30, 2), (25, 5), (22, 7)],
    "CVC - Abnormal": [(30, 2), (23, 6), (21, 1)],
    "Swan Ganz Catheter Present": [(2, 4), (10, 8), (17, 12), (21, 14)],
}


def _xray(tubes: list[str], rng: np.random.Generator) -> tuple[Image.Image, list[list]]:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(float)
    img = np.full((SIZE, SIZE), 110.0)
    for cx in (9.0, 23.0):  # dark lungs
        img[((yy - 13) / 10) ** 2 + ((xx - cx) / 6) ** 2 <= 1] = 45.0
    img[:, 15:18] += 50.0  # spine
    img += rng.normal(0, 14, img.shape) * rng.uniform(0.6, 1.4)
    pil = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "L")
    draw = ImageDraw.Draw(pil)
    paths = []
    for label in tubes:
        pts = [(int(np.clip(x + rng.integers(-1, 2), 0, SIZE - 1)),
                int(np.clip(y + rng.integers(-1, 2), 0, SIZE - 1))) for x, y in COURSE[label]]
        draw.line(pts, fill=int(rng.integers(200, 256)), width=1)
        paths.append([label, [list(p) for p in pts]])
    return pil, paths


def _both_values(table: pd.DataFrame, rows: np.ndarray, need: int,
                 rng: np.random.Generator) -> None:
    """Flips labels in ``rows`` until each graded class has ``need`` 1s and ``need`` 0s there."""
    if len(rows) < 2 * need:
        return
    for label in GRADED:
        col = table.columns.get_loc(label)
        for value in (1, 0):
            while (table.iloc[rows, col] == value).sum() < need:
                others = rows[table.iloc[rows, col].to_numpy() != value]
                table.iloc[rng.choice(others), col] = value


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    uids: list[str] = []
    while len(uids) < n_rows:
        uid = "1.2.826.0.1.3680043.8.498." + str(rng.integers(1, 10)) + "".join(
            map(str, rng.integers(0, 10, 37)))
        if uid not in uids:
            uids.append(uid)
    table = pd.DataFrame(0, index=range(n_rows), columns=list(LABELS))
    for group in (ETT, NGT):
        names, p = zip(*group)
        for i, name in enumerate(rng.choice(len(names), size=n_rows, p=p)):
            if names[name] is not None:
                table.loc[i, names[name]] = 1
    for name, p in CVC:
        table[name] = (rng.random(n_rows) < p).astype(int)
    table["Swan Ganz Catheter Present"] = (rng.random(n_rows) < SWAN).astype(int)

    train_rows, test_rows = train_test_split(np.arange(n_rows), test_size=0.1, random_state=0)
    for name in LABELS:      # every label on half of the held-out rows
        table.loc[test_rows, name] = rng.permutation(np.arange(len(test_rows)) % 2)
    _both_values(table, train_rows, 2, rng)

    patients = [rng.bytes(5).hex()[:9] for _ in range(max(n_rows // 8, 2))]
    table.insert(0, "StudyInstanceUID", uids)
    table["PatientID"] = rng.choice(patients, size=n_rows)

    (raw / "train").mkdir(parents=True, exist_ok=True)
    annotations = []
    for i, uid in enumerate(uids):
        tubes = [label for label in LABELS if table.loc[i, label]]
        img, paths = _xray(tubes, rng)
        img.save(raw / "train" / f"{uid}.jpg", quality=90)
        if paths and rng.random() < 0.5:
            annotations += [(uid, label, str(points)) for label, points in paths]
    table.to_csv(raw / "train.csv", index=False)
    pd.DataFrame(annotations, columns=["StudyInstanceUID", "label", "data"]).to_csv(
        raw / "train_annotations.csv", index=False)
