"""digits-8x8: logreg c1 baseline."""
import os

import numpy as np
import pandas as pd
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X = train.drop(columns=["id", "digit"])
y = train["digit"]
X_test = test.drop(columns=["id"])
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)

model = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=2000))
model.fit(X_tr, y_tr)
score = log_loss(y_va, model.predict_proba(X_va), labels=model.classes_)
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(X, y)
sub = pd.DataFrame(model.predict_proba(X_test), columns=[str(c) for c in model.classes_])
sub.insert(0, "id", test["id"])
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
