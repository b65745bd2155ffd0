"""text-normalization-challenge-english-language: the commonest `after` of each `before` seen in
training, the `before` itself otherwise."""
import os

import numpy as np
import pandas as pd

read = dict(dtype={"before": str, "after": str}, keep_default_na=False)
train = pd.read_csv("./input/en_train.csv.zip", **read)
test = pd.read_csv("./input/en_test_2.csv.zip", **read)


def fit(df):
    counts = df.groupby(["before", "after"]).size().reset_index(name="n")
    best = counts.sort_values("n", ascending=False, kind="stable").drop_duplicates("before")
    return dict(zip(best["before"], best["after"]))


def predict(lookup, before):
    return [lookup.get(b, b) for b in before]


sentences = train["sentence_id"].unique()
rng = np.random.default_rng(0)
held_out = set(rng.choice(sentences, max(1, len(sentences) // 5), replace=False))
va = train["sentence_id"].isin(held_out)
pred = predict(fit(train[~va]), train.loc[va, "before"])
score = float(np.mean(np.array(pred) == train.loc[va, "after"].values))
print(f"VALIDATION_METRIC: {score:.5f}")

sub = pd.DataFrame({"id": test["sentence_id"].astype(str) + "_" + test["token_id"].astype(str),
                    "after": predict(fit(train), test["before"])})
os.makedirs("./submission", exist_ok=True)
sub.to_csv("./submission/submission.csv", index=False)
