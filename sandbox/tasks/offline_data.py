"""The raw data of the offline task suite: one loader per task, each returning a ``RawTable``.

Sources (all on disk offline): scikit-learn's bundled ``load_*`` datasets (iris, wine,
breast_cancer, digits, diabetes, linnerud) and sample photos; matplotlib's ``mpl-data/sample_data``
(a digital elevation model, a topography/bathymetry grid, Google daily prices 2004-2008); and two
**synthetic** tables (``support-tickets``, text; ``sensor-forecast``, time series) generated with
the fixed ``DATA_SEED``, since no text corpus or multi-series time-series set ships offline.
``source_data_paths`` lists the package folders the data comes from (hidden inside the sandbox).
How a table becomes a task (split, ids, files) is ``sandbox.tasks.offline_suite``.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import pathlib
from typing import Optional

import numpy as np
import pandas as pd

DATA_SEED = 20_261_129  # fixed seed of the synthetic generators and patch sampling (not the split)


@dataclasses.dataclass(frozen=True)
class RawTable:
    """A labelled table before splitting.

    Attributes:
      features: [n, f] the columns the agent sees.
      target: [n, k] the target column(s) as named in train.csv (labels as strings).
      time: [n] sort key for a time-based split, or None for a random split.
    """

    features: pd.DataFrame
    target: pd.DataFrame
    time: Optional[np.ndarray] = None


# ------------------------------------------------------------------------------------------------
# Hidden source paths
# ------------------------------------------------------------------------------------------------

def _package_dir(name: str) -> Optional[pathlib.Path]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def source_data_paths() -> tuple[str, ...]:
    """Host paths of the packaged datasets the suite is built from (hidden inside the sandbox)."""
    paths = []
    sk = _package_dir("sklearn")
    if sk is not None:
        paths += [sk / "datasets" / d for d in ("data", "images", "descr")]
    mpl = _package_dir("matplotlib")
    if mpl is not None:
        paths.append(mpl / "mpl-data" / "sample_data")
    return tuple(str(p) for p in paths if p.exists())


# ------------------------------------------------------------------------------------------------
# Loaders
# ------------------------------------------------------------------------------------------------

def _clean(name: str) -> str:
    out = "".join(ch if ch.isalnum() else "_" for ch in name.lower()).strip("_")
    while "__" in out:
        out = out.replace("__", "_")
    return out


def _sk_frame(loader, **kw) -> tuple[pd.DataFrame, np.ndarray, list[str]]:
    b = loader(**kw)
    cols = [_clean(c) for c in b.feature_names]
    return pd.DataFrame(np.asarray(b.data), columns=cols), np.asarray(b.target), list(
        getattr(b, "target_names", []))


def load_iris() -> RawTable:
    from sklearn import datasets
    X, y, names = _sk_frame(datasets.load_iris)
    X.columns = ["sepal_length_cm", "sepal_width_cm", "petal_length_cm", "petal_width_cm"]
    return RawTable(X, pd.DataFrame({"species": [str(names[i]) for i in y]}))


def load_wine_cultivar() -> RawTable:
    from sklearn import datasets
    X, y, _ = _sk_frame(datasets.load_wine)
    return RawTable(X, pd.DataFrame({"cultivar": [f"cultivar_{i + 1}" for i in y]}))


def load_wine_alcohol() -> RawTable:
    from sklearn import datasets
    X, _, _ = _sk_frame(datasets.load_wine)
    return RawTable(X.drop(columns=["alcohol"]), X[["alcohol"]])


def load_breast_cancer() -> RawTable:
    from sklearn import datasets
    X, y, _ = _sk_frame(datasets.load_breast_cancer)
    return RawTable(X, pd.DataFrame({"malignant": (y == 0).astype(int)}))  # sklearn: 0 = malignant


def load_digits() -> RawTable:
    from sklearn import datasets
    b = datasets.load_digits()
    X = pd.DataFrame(b.data.astype(np.int64), columns=[f"pixel_{i}" for i in range(64)])
    return RawTable(X, pd.DataFrame({"digit": [str(int(v)) for v in b.target]}))


def load_diabetes() -> RawTable:
    from sklearn import datasets
    b = datasets.load_diabetes(scaled=False)
    X = pd.DataFrame(b.data, columns=["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"])
    return RawTable(X, pd.DataFrame({"progression": b.target.astype(np.float64)}))


def load_linnerud() -> RawTable:
    from sklearn import datasets
    b = datasets.load_linnerud()
    X = pd.DataFrame(b.data, columns=[_clean(c) for c in b.feature_names])
    Y = pd.DataFrame(b.target, columns=[_clean(c) for c in b.target_names])
    return RawTable(X, Y)


def _mpl_sample(name: str) -> pathlib.Path:
    mpl = _package_dir("matplotlib")
    if mpl is None:
        raise FileNotFoundError("matplotlib is not installed; its sample data is needed")
    path = mpl / "mpl-data" / "sample_data" / name
    if not path.exists():
        raise FileNotFoundError(f"matplotlib sample data file missing: {path}")
    return path


def load_photo_patches(per_image: int = 600, size: int = 8) -> RawTable:
    """Grayscale 8x8 patches (pixel values 0-255) sampled from three bundled photos."""
    from PIL import Image
    sk = _package_dir("sklearn")
    sources = {"temple": sk / "datasets" / "images" / "china.jpg",
               "flower": sk / "datasets" / "images" / "flower.jpg",
               "portrait": _mpl_sample("grace_hopper.jpg")}
    rng = np.random.default_rng(DATA_SEED)
    rows, labels = [], []
    for label, path in sources.items():
        with Image.open(path) as im:
            g = np.asarray(im.convert("L"), dtype=np.int64)
        ys = rng.integers(0, g.shape[0] - size, per_image)
        xs = rng.integers(0, g.shape[1] - size, per_image)
        for y0, x0 in zip(ys, xs):
            rows.append(g[y0:y0 + size, x0:x0 + size].ravel())
            labels.append(label)
    X = pd.DataFrame(np.stack(rows), columns=[f"pixel_{i}" for i in range(size * size)])
    return RawTable(X, pd.DataFrame({"photo": labels}))


def load_terrain(n: int = 3000) -> RawTable:
    """Elevation (m) at random points of a 344x403 digital elevation model (Jacksboro fault, TN)."""
    d = np.load(_mpl_sample("jacksboro_fault_dem.npz"))
    z = d["elevation"].astype(np.float64)
    rng = np.random.default_rng(DATA_SEED)
    flat = rng.choice(z.size, size=n, replace=False)
    i, j = np.unravel_index(flat, z.shape)
    lon = float(d["xmin"]) + j * float(d["dx"])
    lat = float(d["ymin"]) - i * float(d["dy"])
    X = pd.DataFrame({"longitude": np.round(lon, 6), "latitude": np.round(lat, 6)})
    return RawTable(X, pd.DataFrame({"elevation_m": z[i, j]}))


def load_topobathy(n: int = 3000) -> RawTable:
    """Height above sea level (m; negative = depth) at random points of a 91x120 coastal grid."""
    d = np.load(_mpl_sample("topobathy.npz"))
    z = d["topo"].astype(np.float64)
    rng = np.random.default_rng(DATA_SEED + 1)
    flat = rng.choice(z.size, size=n, replace=False)
    i, j = np.unravel_index(flat, z.shape)
    X = pd.DataFrame({"longitude": np.round(d["longitude"].astype(np.float64)[j], 5),
                      "latitude": np.round(d["latitude"].astype(np.float64)[i], 5)})
    return RawTable(X, pd.DataFrame({"height_m": z[i, j]}))


def load_goog_volume() -> RawTable:
    """Daily GOOG prices 2004-2008; target = natural log of the day's traded volume."""
    p = np.load(_mpl_sample("goog.npz"))["price_data"]
    dates = p["date"].astype("datetime64[D]")
    X = pd.DataFrame({"date": dates.astype(str),
                      "day_of_week": pd.to_datetime(dates).dayofweek.astype(np.int64),
                      "open": p["open"], "high": p["high"], "low": p["low"], "close": p["close"]})
    y = pd.DataFrame({"log_volume": np.round(np.log(p["volume"].astype(np.float64)), 6)})
    return RawTable(X, y, time=dates.astype(np.int64))


_TICKETS = {
    "billing": [
        "I was charged {amount} twice for my {plan} subscription this month.",
        "My invoice shows a fee of {amount} that I do not recognise.",
        "Can you explain why my bill went up to {amount}?",
        "The payment with my card ending {digits} failed but the money left my account.",
        "Please send a corrected invoice, the VAT number is missing.",
        "I want a refund of the {amount} overcharge on my last statement.",
        "Why was I billed for {plan} after I downgraded?",
    ],
    "shipping": [
        "My {product} still has not arrived after {days} days.",
        "The tracking number says delivered but nothing came to my door.",
        "Can I change the delivery address for order {order}?",
        "The courier left my {product} in the rain and the box is soaked.",
        "Shipping to my country was supposed to take {days} days, it has been longer.",
        "Order {order} is stuck in customs, what should I do?",
        "Is express delivery available for the {product}?",
    ],
    "technical": [
        "The {product} app crashes every time I open settings on my {device}.",
        "After the latest update the {product} will not connect to wifi.",
        "I get error code {digits} when I try to sync.",
        "The screen on my {product} flickers and then goes black.",
        "Bluetooth pairing with my {device} fails with a timeout.",
        "The firmware update froze at {pct} percent.",
        "Battery drains in {days} hours since the update, it used to last a week.",
    ],
    "account": [
        "I cannot log in, the password reset email never arrives.",
        "Please change the email address on my account to my new one.",
        "My account was locked after too many attempts.",
        "How do I enable two factor authentication?",
        "Someone else seems to have access to my profile.",
        "I want to delete my account and all my data.",
        "The verification code sent to my phone expires immediately.",
    ],
    "returns": [
        "I would like to return the {product}, it is not what I expected.",
        "The {product} arrived damaged, can I get a replacement?",
        "How do I print the return label for order {order}?",
        "I sent the {product} back {days} days ago and have no update.",
        "Can I exchange the {product} for a different size?",
        "The return window closed yesterday, can you make an exception?",
        "The replacement {product} has the same defect as the first one.",
    ],
}
_FILLER = [
    "Hello,", "Hi team,", "Good morning.", "Thanks in advance.", "Please help.",
    "This is the second time I write about this.", "Regards.", "I have been a customer for years.",
    "Not happy at all.", "Any update would be appreciated.", "Thank you!", "Urgent please.",
]
_SLOTS = {
    "amount": lambda r: f"${r.integers(5, 400)}.{r.integers(0, 100):02d}",
    "plan": lambda r: str(r.choice(["basic", "premium", "family", "pro", "student"])),
    "digits": lambda r: str(r.integers(1000, 9999)),
    "product": lambda r: str(r.choice(["headphones", "smart watch", "speaker", "tablet", "camera",
                                       "router", "keyboard", "charger"])),
    "days": lambda r: str(r.integers(2, 30)),
    "order": lambda r: f"#{r.integers(100000, 999999)}",
    "device": lambda r: str(r.choice(["phone", "laptop", "car", "tv", "tablet"])),
    "pct": lambda r: str(r.integers(5, 99)),
}


def load_support_tickets(n: int = 1500) -> RawTable:
    """SYNTHETIC customer-support tickets (template sentences, slot fillers, cross-category noise
    sentences and 6 % label noise), 5 categories with unequal priors."""
    rng = np.random.default_rng(DATA_SEED)
    cats = list(_TICKETS)
    prior = np.array([0.3, 0.25, 0.2, 0.15, 0.1])

    def fill(template: str) -> str:
        return template.format(**{k: f(rng) for k, f in _SLOTS.items() if "{" + k + "}" in template})

    texts, labels = [], []
    for _ in range(n):
        c = cats[rng.choice(len(cats), p=prior)]
        parts = []
        if rng.random() < 0.6:
            parts.append(str(rng.choice(_FILLER)))
        for t in rng.choice(_TICKETS[c], size=rng.integers(1, 3), replace=False):
            parts.append(fill(str(t)))
        if rng.random() < 0.3:  # an off-topic sentence from another category
            other = cats[rng.choice([i for i in range(len(cats)) if cats[i] != c])]
            parts.insert(int(rng.integers(0, len(parts) + 1)), fill(str(rng.choice(_TICKETS[other]))))
        if rng.random() < 0.5:
            parts.append(str(rng.choice(_FILLER)))
        label = c if rng.random() >= 0.06 else cats[rng.integers(len(cats))]
        text = " ".join(parts)
        texts.append(text.lower() if rng.random() < 0.2 else text)
        labels.append(label)
    return RawTable(pd.DataFrame({"text": texts}), pd.DataFrame({"category": labels}))


def load_sensor_forecast(n: int = 2000, lags: int = 24) -> RawTable:
    """SYNTHETIC hourly sensor readings: per series a level, a daily cycle, a slow trend and AR(1)
    noise; each row is one independent series' last 24 hourly values and the next value."""
    rng = np.random.default_rng(DATA_SEED)
    rows, hours, ys = [], [], []
    for _ in range(n):
        level = rng.uniform(10, 50)
        amp = rng.uniform(0, 12)
        phase = rng.uniform(0, 2 * np.pi)
        trend = rng.normal(0, 0.05)
        phi = rng.uniform(0.3, 0.95)
        sigma = rng.uniform(0.3, 2.5)
        start = int(rng.integers(0, 24))
        t = np.arange(lags + 1)
        hour = (start + t) % 24
        noise = np.zeros(lags + 1)
        noise[0] = rng.normal(0, sigma / np.sqrt(1 - phi**2))
        for k in range(1, lags + 1):
            noise[k] = phi * noise[k - 1] + rng.normal(0, sigma)
        x = level + amp * np.sin(2 * np.pi * hour / 24 + phase) + trend * t + noise
        x = np.round(x, 3)
        rows.append(x[:lags])
        hours.append(int(hour[-1]))
        ys.append(x[-1])
    X = pd.DataFrame(np.stack(rows), columns=[f"lag_{lags - k}" for k in range(lags)])
    X.insert(0, "hour", hours)
    return RawTable(X, pd.DataFrame({"next_value": ys}))
