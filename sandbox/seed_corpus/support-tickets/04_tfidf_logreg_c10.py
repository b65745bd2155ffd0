"""support-tickets: tfidf logreg c10 baseline."""
import os

import numpy as np
import pandas as pd
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import f1_score
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline

train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X = train["text"]
y = train["category"]
X_test = test["text"]
X_tr, X_va, y_tr, y_va = train_test_split(X, y, test_size=0.2, random_state=0, stratify=y)

model = make_pipeline(TfidfVectorizer(), LogisticRegression(C=10.0, max_iter=2000))
model.fit(X_tr, y_tr)
score = f1_score(y_va, model.predict(X_va), average="macro")
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(X, y)
sub = pd.DataFrame({"id": test["id"], "category": model.predict(X_test)})
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
