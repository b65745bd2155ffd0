"""jigsaw-toxic-comment-classification-challenge: TF-IDF words + characters, one logistic
regression per class."""
import os

import numpy as np
import pandas as pd
from scipy.sparse import hstack
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split

CLASSES = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]

train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
text, Y = train["comment_text"].fillna(""), train[CLASSES].values
text_test = test["comment_text"].fillna("")
t_tr, t_va, Y_tr, Y_va = train_test_split(text, Y, test_size=0.2, random_state=0)


def fit_predict(texts, labels, new_texts):
    words = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, lowercase=True)
    chars = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True,
                            lowercase=False)  # keeps the capitals of shouting
    X = hstack([words.fit_transform(texts), chars.fit_transform(texts)]).tocsr()
    X_new = hstack([words.transform(new_texts), chars.transform(new_texts)]).tocsr()
    out = np.zeros((len(new_texts), len(CLASSES)))
    for k in range(len(CLASSES)):
        if labels[:, k].min() == labels[:, k].max():  # one class only: predict it
            out[:, k] = labels[0, k]
        else:
            model = LogisticRegression(C=4.0, max_iter=2000, class_weight="balanced")
            out[:, k] = model.fit(X, labels[:, k]).predict_proba(X_new)[:, 1]
    return out


P_va = fit_predict(t_tr, Y_tr, t_va)
aucs = [roc_auc_score(Y_va[:, k], P_va[:, k]) for k in range(len(CLASSES))
        if len(set(Y_va[:, k])) == 2]  # mean column-wise AUC over the classes present
score = float(np.mean(aucs)) if aucs else 0.5
print(f"VALIDATION_METRIC: {score:.5f}")

sub = pd.DataFrame(fit_predict(text, Y, text_test), columns=CLASSES)
sub.insert(0, "id", test["id"])
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
