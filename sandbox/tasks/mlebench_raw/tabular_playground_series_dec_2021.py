"""tabular-playground-series-dec-2021 (Forest Cover Type, GAN-made): Kaggle's download is
``train.csv`` (Id from 0, 54 features, Cover_Type), ``test.csv`` (Id from 4,000,000, no
Cover_Type) and ``sample_submission.csv`` (Id,Cover_Type = 2). Made up: the rows, whose label is
the band of Elevation with 10% of labels random."""
from __future__ import annotations

import pathlib
from typing import Any

import numpy as np
import pandas as pd

#: tabular-playground-series-dec-2021 (Forest Cover Type, GAN-made): feature columns and ranges.
_COVER_NUMERIC = {
    "Elevation": (1800, 3900), "Aspect": (0, 360), "Slope": (0, 60),
    "Horizontal_Distance_To_Hydrology": (0, 1400), "Vertical_Distance_To_Hydrology": (-150, 560),
    "Horizontal_Distance_To_Roadways": (0, 7000), "Hillshade_9am": (0, 255),
    "Hillshade_Noon": (0, 255), "Hillshade_3pm": (0, 255),
    "Horizontal_Distance_To_Fire_Points": (0, 7000),
}
#: Elevation bands (upper edges, metres) -> Cover_Type; the learnable signal.
_COVER_BANDS = ((2250, 4), (2500, 3), (2800, 6), (3100, 2), (3400, 1), (10_000, 7))


def _cover_rows(ids: np.ndarray, rng: np.random.Generator, with_target: bool) -> pd.DataFrame:
    """Rows in Kaggle's column order: Id, 10 numeric features, Wilderness_Area1-4,
    Soil_Type1-40 (one-hot each), [Cover_Type]: the band of Elevation, 10% of labels random."""
    n = len(ids)
    cols: dict[str, Any] = {"Id": ids}
    for name, (lo, hi) in _COVER_NUMERIC.items():
        cols[name] = rng.integers(lo, hi, n)
    area, soil = rng.integers(0, 4, n), rng.integers(0, 40, n)
    for k in range(4):
        cols[f"Wilderness_Area{k + 1}"] = (area == k).astype(int)
    for k in range(40):
        cols[f"Soil_Type{k + 1}"] = (soil == k).astype(int)
    if with_target:
        edges = np.array([e for e, _ in _COVER_BANDS])
        label = np.array([c for _, c in _COVER_BANDS])[np.searchsorted(edges, cols["Elevation"],
                                                                       side="right")]
        noise = rng.random(n) < 0.1
        label[noise] = rng.choice([c for _, c in _COVER_BANDS], int(noise.sum()))
        cols["Cover_Type"] = label
    return pd.DataFrame(cols)


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    """Kaggle's tabular-playground-series-dec-2021 download, extracted: ``train.csv`` (Id from 0,
    features, Cover_Type), ``test.csv`` (Id from 4,000,000 as on Kaggle, no Cover_Type) and
    ``sample_submission.csv`` (Id,Cover_Type = 2)."""
    n_test = max(n_rows // 3, 1)
    _cover_rows(np.arange(n_rows), rng, True).to_csv(raw / "train.csv", index=False)
    test_ids = np.arange(4_000_000, 4_000_000 + n_test)
    _cover_rows(test_ids, rng, False).to_csv(raw / "test.csv", index=False)
    pd.DataFrame({"Id": test_ids, "Cover_Type": 2}).to_csv(raw / "sample_submission.csv",
                                                           index=False)
