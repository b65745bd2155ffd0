"""breast-cancer-diagnosis: knn15 scaled baseline."""
import os

import numpy as np
import pandas as pd
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split
from sklearn.neighbors import KNeighborsClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X = train.drop(columns=["id", "malignant"])
y = train["malignant"]
X_test = test.drop(columns=["id"])
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)

model = make_pipeline(StandardScaler(), KNeighborsClassifier(n_neighbors=15))
model.fit(X_tr, y_tr)
score = roc_auc_score(y_va, model.predict_proba(X_va)[:, 1])
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(X, y)
sub = pd.DataFrame({"id": test["id"], "malignant": model.predict_proba(X_test)[:, 1]})
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
