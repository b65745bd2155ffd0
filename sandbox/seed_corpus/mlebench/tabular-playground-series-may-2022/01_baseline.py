"""tabular-playground-series-may-2022: logistic regression on the features and f_27's letter
counts."""
import os

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

LETTERS = np.frombuffer(b"ABCDEFGHIJKLMNOPQRST", dtype=np.uint8)


def features(df):
    """Numeric columns, one-hot f_30, and how often each letter occurs in the string f_27."""
    X = df.drop(columns=["id", "f_27", "target"], errors="ignore").astype(float)
    for v in (0, 1, 2):
        X[f"f_30_{v}"] = (df["f_30"] == v).astype(float)
    chars = np.frombuffer(df["f_27"].str.ljust(10).str[:10].str.cat().encode(), dtype=np.uint8)
    counts = (chars.reshape(len(df), 10)[:, :, None] == LETTERS).sum(axis=1)
    for i, c in enumerate(LETTERS):
        X[f"n_{chr(c)}"] = counts[:, i]
    return X


train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X, y = features(train), train["target"]
X_test = features(test)
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)

model = make_pipeline(StandardScaler(), LogisticRegression(C=0.3, max_iter=2000))
model.fit(X_tr, y_tr)
score = roc_auc_score(y_va, model.predict_proba(X_va)[:, 1])
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(X, y)
sub = pd.DataFrame({"id": test["id"], "target": model.predict_proba(X_test)[:, 1]})
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
