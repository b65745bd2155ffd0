"""new-york-city-taxi-fare-prediction: Kaggle's download holds ``train.csv`` (about 55M rides:
key,fare_amount,pickup_datetime,pickup_longitude,pickup_latitude,dropoff_longitude,dropoff_latitude,
passenger_count; ``key`` is the pickup time plus a unique suffix such as
``2009-06-15 17:26:21.0000001``, ``pickup_datetime`` reads ``2009-06-15 17:26:21 UTC``),
``test.csv`` (9914 rides, no fare), ``sample_submission.csv`` (key,fare_amount = 11.35) and
``GCP-Coupons-Instructions.rtf``. MLE-bench's preparer reads ``train.csv`` and the rtf and holds
out exactly 9914 rows of ``train.csv`` as its test set, so ``train.csv`` here has ``n_rows + 9914``
rows (about 1 MB). The rides are made up: pickups around Manhattan between 2009 and mid-2015, trip
lengths log-normal; the fare follows the meter (2.50 plus a per-km rate that rose in September
2012, on a road distance about 1.3 times the straight line), an evening/rush-hour surcharge and
noise, rounded to 10 cents; about 1.5% of rides have zero coordinates, as many of Kaggle's do.
``test.csv`` and ``sample_submission.csv`` are a third of ``n_rows`` long (unused by the
preparer); the rtf is a stub.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pandas as pd

_N_TEST = 9914  # rows MLE-bench's preparer takes from train.csv as its test set
_START = np.datetime64("2009-01-01T00:00:00")
_SPAN_S = int((np.datetime64("2015-07-01T00:00:00") - _START) / np.timedelta64(1, "s"))
_RATE_CHANGE = np.datetime64("2012-09-04T00:00:00")

_RTF = (r"{\rtf1\ansi\deff0 {\fonttbl {\f0 Helvetica;}}" "\n"
        r"\f0\fs24 Google Cloud Platform coupons: placeholder text (made-up file).\par" "\n}\n")


def _rides(n: int, rng: np.random.Generator) -> pd.DataFrame:
    secs = np.sort(rng.choice(_SPAN_S, size=n, replace=False))
    when = _START + secs.astype("timedelta64[s]")
    stamp = pd.Series(when).dt.strftime("%Y-%m-%d %H:%M:%S")
    suffix = rng.integers(1, 200, size=n)  # Kaggle's keys: time + '.000000' + a small integer
    key = [f"{s}.000000{k}" for s, k in zip(stamp, suffix)]
    p_lon = rng.normal(-73.978, 0.02, n)
    p_lat = rng.normal(40.752, 0.025, n)
    km = np.clip(rng.lognormal(np.log(2.8), 0.75, n), 0.1, 40)
    angle = rng.uniform(0, 2 * np.pi, n)
    d_lon = p_lon + km * np.cos(angle) / (111.32 * np.cos(np.radians(40.75)))
    d_lat = p_lat + km * np.sin(angle) / 110.57
    hour = pd.Series(when).dt.hour.to_numpy()
    weekday = pd.Series(when).dt.day_of_week.to_numpy()
    rate = np.where(when < _RATE_CHANGE, 1.24, 1.55)
    extra = np.where((hour >= 20) | (hour < 6), 0.5, 0.0) + np.where(
        (weekday < 5) & (hour >= 16) & (hour < 20), 1.0, 0.0)
    fare = 2.5 + rate * 1.3 * km * rng.lognormal(0, 0.12, n) + extra + rng.exponential(0.8, n)
    passengers = rng.choice([0, 1, 2, 3, 4, 5, 6], size=n,
                            p=[0.005, 0.69, 0.15, 0.045, 0.02, 0.06, 0.03])
    rides = pd.DataFrame({
        "key": key, "fare_amount": np.round(fare, 1),
        "pickup_datetime": stamp + " UTC",
        "pickup_longitude": np.round(p_lon, 6), "pickup_latitude": np.round(p_lat, 6),
        "dropoff_longitude": np.round(d_lon, 6), "dropoff_latitude": np.round(d_lat, 6),
        "passenger_count": passengers})
    zero = rng.random(n) < 0.015
    rides.loc[zero, ["pickup_longitude", "pickup_latitude", "dropoff_longitude",
                     "dropoff_latitude"]] = 0.0
    return rides


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    train = _rides(n_rows + _N_TEST, rng)
    train = train.iloc[rng.permutation(len(train))]  # Kaggle's file is not in time order
    train.to_csv(raw / "train.csv", index=False)
    test = _rides(max(n_rows // 3, 1), rng).drop(columns=["fare_amount"])
    test.to_csv(raw / "test.csv", index=False)
    pd.DataFrame({"key": test["key"], "fare_amount": 11.35}).to_csv(
        raw / "sample_submission.csv", index=False)
    (raw / "GCP-Coupons-Instructions.rtf").write_text(_RTF)
