"""terrain-elevation: linear baseline."""
import os

import numpy as np
import pandas as pd
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import train_test_split

train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X = train.drop(columns=["id", "elevation_m"])
y = train["elevation_m"]
X_test = test.drop(columns=["id"])
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0)

model = LinearRegression()
model.fit(X_tr, y_tr)
score = np.sqrt(np.mean((model.predict(X_va) - y_va) ** 2))
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(X, y)
sub = pd.DataFrame({"id": test["id"], "elevation_m": model.predict(X_test)})
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
