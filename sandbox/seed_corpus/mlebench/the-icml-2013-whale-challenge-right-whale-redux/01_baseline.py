"""the-icml-2013-whale-challenge-right-whale-redux: spectrogram band energies + up-sweep features,
logistic regression."""
import io
import os
import warnings
import zipfile

with warnings.catch_warnings():                      # aifc: deprecated, still in Python 3.11
    warnings.simplefilter("ignore", DeprecationWarning)
    import aifc

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

FRAME, HOP = 128, 32


def read_clips(path):
    """{clip file name: samples} of the .aif files in a zip."""
    out = {}
    with zipfile.ZipFile(path) as z:
        for name in sorted(z.namelist()):
            if name.endswith(".aif"):
                with aifc.open(io.BytesIO(z.read(name))) as a:
                    rate = a.getframerate()
                    x = np.frombuffer(a.readframes(a.getnframes()), dtype=">i2").astype(float)
                out[os.path.basename(name)] = (x, rate)
    return out


def features(x, rate):
    """Log energy per 0-400 Hz spectrogram band (mean and max over time), and how the loudest
    frequency between 50 and 300 Hz moves over time (an up-call sweeps upwards)."""
    n = 1 + (len(x) - FRAME) // HOP
    frames = np.stack([x[i * HOP:i * HOP + FRAME] for i in range(n)]) * np.hanning(FRAME)
    spec = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    freqs = np.fft.rfftfreq(FRAME, 1.0 / rate)
    low = spec[:, freqs <= 400]
    band = (freqs >= 50) & (freqs <= 300)
    peak = freqs[band][spec[:, band].argmax(axis=1)]
    w = spec[:, band].max(axis=1)
    w = w / w.sum()
    t = np.arange(n) - np.sum(w * np.arange(n))
    slope = np.sum(w * t * (peak - np.sum(w * peak))) / max(np.sum(w * t * t), 1e-9)
    return np.concatenate([np.log1p(low.mean(axis=0)), np.log1p(low.max(axis=0)),
                           [slope, np.log1p(w.max())]])


train = read_clips("./input/train2.zip")
test = read_clips("./input/test2.zip")
X = np.stack([features(*v) for v in train.values()])
y = np.array([int(name[-5]) for name in train])            # ..._TRAIN<idx>_<label>.aif
X_test = np.stack([features(*v) for v in test.values()])
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)

model = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))
model.fit(X_tr, y_tr)
score = roc_auc_score(y_va, model.predict_proba(X_va)[:, 1])
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(X, y)
pred = dict(zip(test, model.predict_proba(X_test)[:, 1]))
sub = pd.read_csv("./input/sampleSubmission.csv")
sub["probability"] = sub["clip"].map(pred).fillna(0.0)
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
