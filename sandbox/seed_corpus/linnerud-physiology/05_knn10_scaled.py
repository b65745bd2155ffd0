"""linnerud-physiology: knn10 scaled baseline."""
import os

import numpy as np
import pandas as pd
from sklearn.model_selection import train_test_split
from sklearn.neighbors import KNeighborsRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
TARGETS = ["weight", "waist", "pulse"]
X = train.drop(columns=["id", *TARGETS])
y = train[TARGETS].values
X_test = test.drop(columns=["id"])
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0)

model = make_pipeline(StandardScaler(), KNeighborsRegressor(n_neighbors=5, weights="distance"))
model.fit(X_tr, y_tr)
score = np.mean(np.abs(model.predict(X_va) - y_va))
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(X, y)
sub = pd.DataFrame(model.predict(X_test), columns=TARGETS)
sub.insert(0, "id", test["id"])
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
