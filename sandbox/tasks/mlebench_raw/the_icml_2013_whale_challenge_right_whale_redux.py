"""the-icml-2013-whale-challenge-right-whale-redux: Kaggle's download, extracted, is ``train2.zip``
(folder ``train2/``: four days of 2 s, 2 kHz, 16-bit mono AIFF clips named
``YYYYMMDD_HHMMSS_<sss>s<d>ms_TRAIN<idx>_<label>.aif``, label 1 for a right whale up-call, 0 for
noise, idx in time order), ``test2.zip`` (folder ``test2/``: three later days,
``..._Test<idx>.aif``, unlabelled) and ``sampleSubmission.csv`` (``clip,probability`` = 0 per
test clip); MLE-bench's preparer reads only ``train2.zip`` and needs exactly four days in it: the
first two become its training set, the last two its test set. Here the first two days hold
``n_rows`` clips and the last two ``max(n_rows // 2, 12)``, 30% of each labelled 1, and
``test2.zip`` has ``max(n_rows // 6, 6)`` clips. Made up here: short clips (0.5 s, 2 kHz, 16-bit
big-endian AIFF) of low-frequency ocean noise, sometimes a ship's constant tone or another
animal's down-sweep, and for label 1 an up-call, a tone sweeping up from about 90 to 200 Hz at a
random signal-to-noise ratio.
"""
from __future__ import annotations

import math
import pathlib
import struct

import numpy as np
import pandas as pd

from sandbox.tasks.mlebench_raw._zip import write_zip

RATE = 2_000
SECONDS = 0.5
TRAIN_DAYS = ("20090328", "20090329", "20090330", "20090331")
TEST_DAYS = ("20090404", "20090405", "20090406")
POSITIVE_SHARE = 0.3


def _extended(x: float) -> bytes:
    """``x`` (> 0) as the 80-bit IEEE extended float of AIFF's COMM chunk."""
    exponent = math.floor(math.log2(x))
    return struct.pack(">HQ", 16383 + exponent, int(x * 2 ** (63 - exponent)))


def _aiff(samples: np.ndarray) -> bytes:
    """A mono 16-bit AIFF file (FORM/AIFF with COMM and SSND chunks) of ``samples`` at RATE."""
    data = samples.astype(">i2").tobytes()
    comm = b"COMM" + struct.pack(">IhIh", 18, 1, len(samples), 16) + _extended(RATE)
    ssnd = b"SSND" + struct.pack(">III", 8 + len(data), 0, 0) + data
    return b"FORM" + struct.pack(">I", 4 + len(comm) + len(ssnd)) + b"AIFF" + comm + ssnd


def _clip(label: int, rng: np.random.Generator) -> np.ndarray:
    n = int(RATE * SECONDS)
    t = np.arange(n) / RATE
    # ocean noise: most of its power at low frequencies (integrated white noise), plus a floor
    x = np.cumsum(rng.normal(0.0, 25.0, n))
    x -= np.convolve(x, np.ones(50) / 50, "same")
    x += rng.normal(0.0, 60.0, n)
    if rng.random() < 0.3:                                   # a ship: a constant tone
        x += rng.uniform(50.0, 300.0) * np.sin(2 * np.pi * rng.uniform(60, 300) * t
                                               + rng.uniform(0, 6))
    if rng.random() < 0.2:                                   # another animal: a down-sweep
        f0, f1 = rng.uniform(180, 300), rng.uniform(60, 150)
        x += rng.uniform(80.0, 300.0) * np.sin(2 * np.pi * (f0 * t + (f1 - f0) * t ** 2 / 2))
    if label:                                                # right whale up-call
        start, dur = rng.uniform(0.0, 0.15), rng.uniform(0.25, 0.35)
        f0, f1 = rng.uniform(70, 110), rng.uniform(170, 230)
        tau = np.clip(t - start, 0.0, dur)
        env = np.sin(np.pi * tau / dur) ** 2
        amp = np.exp(rng.uniform(np.log(40.0), np.log(600.0)))
        x += amp * env * np.sin(2 * np.pi * (f0 * tau + (f1 - f0) * tau ** 2 / (2 * dur)))
    return np.clip(np.round(x), -32768, 32767).astype(np.int16)


def _stamps(days: tuple[str, ...], counts: list[int], rng: np.random.Generator) -> list[str]:
    """``YYYYMMDD_HHMMSS_<sss>s<d>ms`` of clips within 15-minute files, sorted, per day."""
    out = []
    for day, count in zip(days, counts):
        quarter = rng.integers(0, 96, count)
        tenths = rng.choice(9000, count, replace=False)      # offset within the quarter hour
        for q, d in sorted(zip(quarter.tolist(), tenths.tolist())):
            out.append(f"{day}_{q // 4:02d}{q % 4 * 15:02d}00_{d // 10:03d}s{d % 10}ms")
    return out


def _labels(n: int, rng: np.random.Generator) -> np.ndarray:
    y = np.zeros(n, int)
    y[rng.choice(n, max(round(POSITIVE_SHARE * n), 1), replace=False)] = 1
    return y


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    n_test = max(n_rows // 2, 12)
    counts = [n_rows - n_rows // 2, n_rows // 2, n_test - n_test // 2, n_test // 2]
    stamps = _stamps(TRAIN_DAYS, counts, rng)
    labels = np.concatenate([_labels(n_rows, rng), _labels(n_test, rng)])
    train = {f"train2/{s}_TRAIN{i}_{y}.aif": _aiff(_clip(y, rng))
             for i, (s, y) in enumerate(zip(stamps, labels))}
    write_zip(raw / "train2.zip", train, folders=True)
    n_old_test = max(n_rows // 6, 6)
    old = _stamps(TEST_DAYS, [n_old_test - 2 * (n_old_test // 3)] + [n_old_test // 3] * 2, rng)
    clips = [f"{s}_Test{i}.aif" for i, s in enumerate(old)]
    test = {f"test2/{c}": _aiff(_clip(int(rng.random() < POSITIVE_SHARE), rng)) for c in clips}
    write_zip(raw / "test2.zip", test, folders=True)
    pd.DataFrame({"clip": clips, "probability": 0}).to_csv(raw / "sampleSubmission.csv",
                                                            index=False)
