"""photo-patches: dummy baseline."""
import os

import numpy as np
import pandas as pd
from sklearn.dummy import DummyClassifier
from sklearn.metrics import accuracy_score
from sklearn.model_selection import train_test_split

train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X = train.drop(columns=["id", "photo"])
y = train["photo"]
X_test = test.drop(columns=["id"])
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)

model = DummyClassifier(strategy="most_frequent")
model.fit(X_tr, y_tr)
score = accuracy_score(y_va, model.predict(X_va))
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(X, y)
sub = pd.DataFrame({"id": test["id"], "photo": model.predict(X_test)})
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
