"""tabular-playground-series-dec-2021: random forest on the raw features baseline."""
import os

import pandas as pd
from sklearn.ensemble import RandomForestClassifier
from sklearn.metrics import accuracy_score
from sklearn.model_selection import train_test_split

train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X = train.drop(columns=["Id", "Cover_Type"])
y = train["Cover_Type"]
X_test = test.drop(columns=["Id"])
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0)

model = RandomForestClassifier(n_estimators=200, random_state=0, n_jobs=1)
model.fit(X_tr, y_tr)
print(f"VALIDATION_METRIC: {accuracy_score(y_va, model.predict(X_va)):.5f}")

model.fit(X, y)
os.makedirs("./submission", exist_ok=True)
pd.DataFrame({"Id": test["Id"], "Cover_Type": model.predict(X_test)}).to_csv(
    "./submission/submission.csv", index=False)
