"""ranzcr-clip-catheter-line-classification: downsampled pixels, a logistic regression a class."""
import os

import numpy as np
import pandas as pd
from PIL import Image
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


def features(path):
    img = Image.open(path).convert("L")
    return np.asarray(img.resize((16, 16)), dtype=float).ravel() / 255


train = pd.read_csv("./input/train.csv")
sample = pd.read_csv("./input/sample_submission.csv")
classes = list(sample.columns[1:])
X = np.stack([features(f"./input/train/{uid}.jpg") for uid in train["StudyInstanceUID"]])
Y = train[classes].to_numpy()
X_test = np.stack([features(f"./input/test/{uid}.jpg") for uid in sample["StudyInstanceUID"]])


def fit_predict(X_fit, Y_fit, X_new):
    proba = np.zeros((len(X_new), Y_fit.shape[1]))
    for k in range(Y_fit.shape[1]):
        if Y_fit[:, k].min() == Y_fit[:, k].max():  # one value only: predict it
            proba[:, k] = Y_fit[0, k]
            continue
        model = make_pipeline(StandardScaler(), LogisticRegression(C=0.05, max_iter=2000))
        proba[:, k] = model.fit(X_fit, Y_fit[:, k]).predict_proba(X_new)[:, 1]
    return proba


X_tr, X_va, Y_tr, Y_va = train_test_split(X, Y, test_size=0.2, random_state=0)
P_va = fit_predict(X_tr, Y_tr, X_va)
aucs = [roc_auc_score(Y_va[:, k], P_va[:, k]) for k in range(len(classes))
        if Y_va[:, k].min() < Y_va[:, k].max()]
print(f"VALIDATION_METRIC: {np.mean(aucs):.5f}")

sub = pd.DataFrame(fit_predict(X, Y, X_test), columns=classes)
sub.insert(0, "StudyInstanceUID", sample["StudyInstanceUID"])
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
