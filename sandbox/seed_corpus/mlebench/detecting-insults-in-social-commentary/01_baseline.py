"""detecting-insults-in-social-commentary: word + character n-gram TF-IDF, logistic regression."""
import os

import pandas as pd
from scipy.sparse import hstack
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split


def clean(comments):
    """Drops the wrapping quotes and turns the escapes (\\xa0, \\n) into spaces."""
    return (comments.str.strip('"').str.replace(r"\\x[0-9a-f]{2}|\\n", " ", regex=True)
            .str.lower())


train = pd.read_csv("./input/train.csv")
test = pd.read_csv("./input/test.csv")
text, y = clean(train["Comment"]), train["Insult"].values
text_test = clean(test["Comment"])
t_tr, t_va, y_tr, y_va = train_test_split(text, y, test_size=0.2, random_state=0, stratify=y)


def fit(texts, labels):
    words = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True)
    chars = TfidfVectorizer(analyzer="char_wb", ngram_range=(2, 4), sublinear_tf=True)
    X = hstack([words.fit_transform(texts), chars.fit_transform(texts)]).tocsr()
    model = LogisticRegression(C=4.0, max_iter=2000).fit(X, labels)
    return lambda t: model.predict_proba(
        hstack([words.transform(t), chars.transform(t)]).tocsr())[:, 1]


score = roc_auc_score(y_va, fit(t_tr, y_tr)(t_va))
print(f"VALIDATION_METRIC: {score:.5f}")

predict = fit(text, y)
sub = pd.DataFrame({"Insult": predict(text_test), "Date": test["Date"],
                    "Comment": test["Comment"]})
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
