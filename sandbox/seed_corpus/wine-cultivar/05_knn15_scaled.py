"""wine-cultivar: knn15 scaled baseline."""
import os

import numpy as np
import pandas as pd
from sklearn.metrics import f1_score
from sklearn.model_selection import train_test_split
from sklearn.neighbors import KNeighborsClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X = train.drop(columns=["id", "cultivar"])
y = train["cultivar"]
X_test = test.drop(columns=["id"])
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)

model = make_pipeline(StandardScaler(), KNeighborsClassifier(n_neighbors=15))
model.fit(X_tr, y_tr)
score = f1_score(y_va, model.predict(X_va), average="macro")
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(X, y)
sub = pd.DataFrame({"id": test["id"], "cultivar": model.predict(X_test)})
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
