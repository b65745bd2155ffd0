"""The files both text-normalization challenges ship (English and Russian alike): zipped csv of
tokens, ``<lang>_train.csv`` (sentence_id, token_id, class, before, after), the stage-2 test
``<lang>_test_2.csv`` (sentence_id, token_id, before) and its sample submission
``<lang>_sample_submission_2.csv`` (id = "<sentence>_<token>", after = before), every field
quoted as Kaggle's are."""
from __future__ import annotations

import csv
import pathlib
from typing import Callable

import numpy as np
import pandas as pd

from sandbox.tasks.mlebench_raw._zip import zip_csv

#: Sentences of the stage-2 test per training sentence.
TEST_SHARE = 0.1

Sentence = Callable[[np.random.Generator], list[tuple[str, str, str]]]


def _rows(sentence: Sentence, rng: np.random.Generator, n_sentences: int) -> pd.DataFrame:
    rows = [(s, t, *tok) for s in range(n_sentences) for t, tok in enumerate(sentence(rng))]
    return pd.DataFrame(rows, columns=["sentence_id", "token_id", "class", "before", "after"])


def write_raw(raw: pathlib.Path, lang: str, sentence: Sentence, n_rows: int,
              rng: np.random.Generator) -> None:
    """Writes the three zips for ``lang`` ("en", "ru"): ``n_rows`` training sentences and a tenth
    as many test sentences, each made by ``sentence(rng)`` as (class, before, after) tokens."""
    def save(name: str, df: pd.DataFrame) -> None:
        zip_csv(raw / f"{lang}_{name}.csv.zip", f"{lang}_{name}.csv", df,
                quoting=csv.QUOTE_NONNUMERIC)

    save("train", _rows(sentence, rng, n_rows))
    test = _rows(sentence, rng, max(round(n_rows * TEST_SHARE), 2))
    test = test[["sentence_id", "token_id", "before"]]
    save("test_2", test)
    save("sample_submission_2", pd.DataFrame({
        "id": test["sentence_id"].astype(str) + "_" + test["token_id"].astype(str),
        "after": test["before"]}))
