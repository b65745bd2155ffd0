"""spooky-author-identification: TF-IDF words + logistic regression baseline."""
import os

import pandas as pd
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import log_loss
from sklearn.model_selection import train_test_split
from sklearn.pipeline import make_pipeline

train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
X_tr, X_va, y_tr, y_va = train_test_split(train["text"], train["author"], test_size=0.2,
                                          random_state=0, stratify=train["author"])

model = make_pipeline(TfidfVectorizer(sublinear_tf=True), LogisticRegression(C=4.0, max_iter=1000))
model.fit(X_tr, y_tr)
score = log_loss(y_va, model.predict_proba(X_va), labels=model.classes_)
print(f"VALIDATION_METRIC: {score:.5f}")

model.fit(train["text"], train["author"])
sub = pd.DataFrame(model.predict_proba(test["text"]), columns=list(model.classes_))
sub = sub.reindex(columns=["EAP", "HPL", "MWS"], fill_value=1e-3)
sub = sub.div(sub.sum(axis=1), axis=0)
sub.insert(0, "id", test["id"])
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
