"""plant-pathology-2020-fgvc7: colour features + multinomial logistic regression."""
import os

import numpy as np
import pandas as pd
from PIL import Image
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

CLASSES = ["healthy", "multiple_diseases", "rust", "scab"]


def features(path):
    img = np.asarray(Image.open(path).convert("RGB").resize((32, 32)), dtype=float) / 255
    px = img.reshape(-1, 3)
    r, g, b = px.T
    orange = ((r > g) & (r > 0.5)).mean()  # rust-like pixels
    dark_olive = ((r < 0.4) & (g < 0.4) & (r > b) & (g > b + 0.05)).mean()
    small = np.asarray(Image.open(path).convert("RGB").resize((4, 4)), dtype=float).ravel() / 255
    return np.concatenate([px.mean(0), px.std(0), [orange, dark_olive], small])


train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X = np.stack([features(f"./input/images/{i}.jpg") for i in train["image_id"]])
y = train[CLASSES].to_numpy().argmax(1)
X_test = np.stack([features(f"./input/images/{i}.jpg") for i in test["image_id"]])


def fit_predict(X_fit, y_fit, X_new):
    model = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
    model.fit(X_fit, y_fit)
    proba = np.zeros((len(X_new), len(CLASSES)))
    proba[:, model.classes_] = model.predict_proba(X_new)
    return proba


stratify = y if np.bincount(y, minlength=4).min() >= 2 else None
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0, stratify=stratify)
p_va = fit_predict(X_tr, y_tr, X_va)
aucs = [roc_auc_score(y_va == c, p_va[:, c]) for c in range(4) if 0 < (y_va == c).sum() < len(y_va)]
print(f"VALIDATION_METRIC: {np.mean(aucs):.5f}")

sub = pd.DataFrame(fit_predict(X, y, X_test), columns=CLASSES)
sub.insert(0, "image_id", test["image_id"])
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
