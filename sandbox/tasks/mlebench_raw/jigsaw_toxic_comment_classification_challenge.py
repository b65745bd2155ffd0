"""jigsaw-toxic-comment-classification-challenge: Kaggle's download, extracted, is four zips, each
holding the csv of its name: ``train.csv.zip`` (id,comment_text,toxic,severe_toxic,obscene,threat,
insult,identity_hate: 159,571 Wikipedia talk-page comments, 16-hex-digit ids, text quoted and often
multi-line), ``test.csv.zip`` (id,comment_text: 153,164), ``test_labels.csv.zip`` (id and the six
labels, all -1 on the 89,186 test rows not scored) and ``sample_submission.csv.zip`` (id and 0.5
in each class); MLE-bench's preparer reads all four. Made up here: short talk-page comments; each
class has its own words (a severely toxic comment also shouts in capitals), which appear in most
comments of that class and now and then in others. The classes are far more common than on Kaggle
(where threat is 0.3%) so that each has positives at tens of rows, and in each half of the scored
test rows (every other id in sorted order) one comment has all six labels and one none, so every
column's AUC is defined.
"""
from __future__ import annotations

import csv
import pathlib

import numpy as np
import pandas as pd

from sandbox.tasks.mlebench_raw._zip import zip_csv

CLASSES = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]
#: P(toxic); P(class | toxic) for the other five (P(class | not toxic) is 2% each).
P_TOXIC = 0.35
P_GIVEN_TOXIC = {"severe_toxic": 0.25, "obscene": 0.5, "threat": 0.2, "insult": 0.5,
                 "identity_hate": 0.2}
#: Kaggle's test.csv has 153,164 comments against train.csv's 159,571; 58% of them unscored (-1).
TEST_SHARE = 153164 / 159571
P_UNSCORED = 89186 / 153164

_WORDS = {
    "toxic": "stupid idiotic dumb worthless ridiculous garbage".split(),
    "severe_toxic": "scum filth disgusting".split(),
    "obscene": "crap damn freaking bloody hell".split(),
    "threat": "kill hurt destroy punch".split(),
    "insult": "moron loser clown fool idiot".split(),
    "identity_hate": "vermin yourkind subhuman".split(),
}
_NEUTRAL = ("the article page edit source citation please thanks wikipedia talk section revert "
            "i you this that is was for not be have with as on added removed image consensus "
            "policy discussion reference user sentence paragraph vandalism history notable "
            "content template link").split()


def _labels(rng: np.random.Generator, n: int) -> np.ndarray:
    y = np.zeros((n, len(CLASSES)), int)
    y[:, 0] = rng.random(n) < P_TOXIC
    for k, c in enumerate(CLASSES[1:], 1):
        p = np.where(y[:, 0] == 1, P_GIVEN_TOXIC[c], 0.02)
        y[:, k] = rng.random(n) < p
    return y


def _comment(rng: np.random.Generator, labels: np.ndarray) -> str:
    words = list(rng.choice(_NEUTRAL, int(rng.integers(6, 25))))
    for c, on in zip(CLASSES, labels):
        if (on and rng.random() < 0.85) or (not on and rng.random() < 0.04):
            for w in rng.choice(_WORDS[c], int(rng.integers(1, 3))):
                words.insert(int(rng.integers(0, len(words) + 1)), str(w))
    text = " ".join(words)
    if labels[1] and rng.random() < 0.7:
        text = text.upper()
    elif rng.random() < 0.5:
        text = text[0].upper() + text[1:]
    if rng.random() < 0.3:  # Kaggle's comments often run over several lines
        cut = int(rng.integers(1, len(text)))
        text = text[:cut].rstrip() + "\n\n" + text[cut:].lstrip()
    return text + str(rng.choice([".", "!", "?", " ", ". (talk)"]))


def _ids(rng: np.random.Generator, n: int) -> list[str]:
    ids: set[str] = set()
    while len(ids) < n:
        ids.add("".join("0123456789abcdef"[d] for d in rng.integers(0, 16, 16)))
    return list(rng.permutation(sorted(ids)))


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    n_test = max(round(n_rows * TEST_SHARE), 20)
    ids = _ids(rng, n_rows + n_test)
    train_ids, test_ids = ids[:n_rows], ids[n_rows:]

    y = _labels(rng, n_rows)
    for k in range(len(CLASSES)):  # each class at least twice in train
        if y[:, k].sum() < 2:
            y[rng.choice(n_rows, 2, replace=False), k] = 1
    y[:, 0] |= y[:, 1:].max(axis=1) & (rng.random(n_rows) < 0.9)
    train = pd.DataFrame({"id": train_ids, "comment_text": [_comment(rng, r) for r in y]})
    train[CLASSES] = y

    y_test = _labels(rng, n_test)
    scored = rng.random(n_test) >= P_UNSCORED
    order = np.argsort(test_ids)  # rows in sorted id order
    for half in (order[0::2], order[1::2]):
        a, b = rng.choice(half, 2, replace=False)
        y_test[a], y_test[b], scored[a], scored[b] = 1, 0, True, True
    test = pd.DataFrame({"id": test_ids, "comment_text": [_comment(rng, r) for r in y_test]})
    labels = pd.DataFrame(np.where(scored[:, None], y_test, -1), columns=CLASSES)
    labels.insert(0, "id", test_ids)

    zip_csv(raw / "train.csv.zip", "train.csv", train, quoting=csv.QUOTE_NONNUMERIC)
    zip_csv(raw / "test.csv.zip", "test.csv", test, quoting=csv.QUOTE_NONNUMERIC)
    zip_csv(raw / "test_labels.csv.zip", "test_labels.csv", labels)
    sample = pd.DataFrame({"id": test_ids, **{c: 0.5 for c in CLASSES}})
    zip_csv(raw / "sample_submission.csv.zip", "sample_submission.csv", sample)
