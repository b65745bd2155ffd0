"""mlsp-2013-birds: log FFT band energies of each wav, one logistic regression per species."""
import os

import numpy as np
import pandas as pd
from scipy.io import wavfile
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

D = "./input/essential_data"
N_SPECIES = 19
folds = pd.read_csv(f"{D}/CVfolds_2.txt")
names = pd.read_csv(f"{D}/rec_id2filename.txt").set_index("rec_id")["filename"]
labels = {}
with open(f"{D}/rec_labels_test_hidden.txt") as f:
    next(f)                                          # header: rec_id,[labels]
    for line in f:
        parts = line.strip().split(",")
        if len(parts) > 1 and parts[1] == "?":
            continue                                 # test recording
        labels[int(parts[0])] = [int(p) for p in parts[1:] if p != ""]


def band_energies(rec_id, n_bands=64):
    """Log energy of the (Hann-windowed) spectrum in n_bands equal bands from 0 to 8 kHz."""
    _, x = wavfile.read(f"{D}/src_wavs/{names[rec_id]}.wav")
    x = x.astype(float) if x.ndim == 1 else x.astype(float).mean(axis=1)
    power = np.abs(np.fft.rfft(x * np.hanning(len(x)))) ** 2
    return np.log1p(np.array([b.sum() for b in np.array_split(power, n_bands)]))


train_ids = folds.loc[folds["fold"] == 0, "rec_id"].to_numpy()
test_ids = folds.loc[folds["fold"] == 1, "rec_id"].to_numpy()
X = np.stack([band_energies(r) for r in train_ids])
X_test = np.stack([band_energies(r) for r in test_ids])
Y = np.zeros((len(train_ids), N_SPECIES))
for i, r in enumerate(train_ids):
    Y[i, labels.get(r, [])] = 1


def fit_predict(X_fit, Y_fit, X_new):
    """One scaled logistic regression per species (the training rate for a one-class species)."""
    scaler = StandardScaler().fit(X_fit)
    A, B = scaler.transform(X_fit), scaler.transform(X_new)
    P = np.zeros((len(X_new), N_SPECIES))
    for s in range(N_SPECIES):
        if Y_fit[:, s].min() == Y_fit[:, s].max():
            P[:, s] = Y_fit[:, s].mean()
        else:
            model = LogisticRegression(C=0.5, max_iter=2000).fit(A, Y_fit[:, s])
            P[:, s] = model.predict_proba(B)[:, 1]
    return P


X_tr, X_va, Y_tr, Y_va = train_test_split(X, Y, test_size=0.2, random_state=0)
score = roc_auc_score(Y_va.ravel(), fit_predict(X_tr, Y_tr, X_va).ravel())
print(f"VALIDATION_METRIC: {score:.5f}")

P = fit_predict(X, Y, X_test)
pred = {r * 100 + s: P[i, s] for i, r in enumerate(test_ids) for s in range(N_SPECIES)}
sub = pd.read_csv("./input/sample_submission.csv")   # Id = rec_id * 100 + species
sub["Probability"] = sub["Id"].map(pred).fillna(0.0)
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
