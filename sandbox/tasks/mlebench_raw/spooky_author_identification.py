"""spooky-author-identification: Kaggle's download, extracted, is ``train.zip`` (``train.csv``:
id,text,author, every field quoted), ``test.zip`` (``test.csv``: id,text) and
``sample_submission.zip`` (id,EAP,HPL,MWS). Made up: the sentences, each mixing common words with
words typical of its author (about 30% of them), so a bag-of-words model learns it; the author
shares and the sample submission's priors are Kaggle's."""
from __future__ import annotations

import csv
import pathlib

import numpy as np
import pandas as pd

from sandbox.tasks.mlebench_raw._zip import zip_csv

_SPOOKY_AUTHORS = {  # author -> (share of Kaggle's train.csv, words typical of the author)
    "EAP": (0.40, "raven chamber midnight pendulum heart tomb cask lady mystery ratiocination "
                  "burial masque lattice phantasm ebony".split()),
    "HPL": (0.29, "eldritch cyclopean nameless abyss tentacled antediluvian blasphemous gibbous "
                  "shoggoth cult madness arkham whippoorwill fungous squamous".split()),
    "MWS": (0.31, "creature wretched misery geneva affection countenance despair father "
                  "elizabeth sorrow beloved tears mountains ardour benevolence".split()),
}
_SPOOKY_COMMON = ("the of and a to in was that it his my i with as had which upon by from this "
                  "but not be".split())
#: Kaggle's ``sample_submission.csv`` values, which MLE-bench's prepare.py also uses.
_SPOOKY_PRIOR = {"EAP": 0.403493538995863, "HPL": 0.287808366106543, "MWS": 0.308698094897594}


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    """Kaggle's spooky-author-identification download, extracted: ``train.zip`` (``train.csv``:
    id,text,author, every field quoted), ``test.zip`` (``test.csv``: id,text) and
    ``sample_submission.zip`` (id,EAP,HPL,MWS). Each sentence mixes common words with words
    typical of its author (about 30% of them): a bag-of-words model learns it."""
    authors = list(_SPOOKY_AUTHORS)
    n_test = max(n_rows // 3, 1)
    ids = [f"id{i:05d}" for i in rng.choice(100_000, n_rows + n_test, replace=False)]

    def sentences(n: int) -> tuple[list[str], list[str]]:
        who = rng.choice(authors, size=n, p=[_SPOOKY_AUTHORS[a][0] for a in authors])
        texts = []
        for a in who:
            words = [str(rng.choice(_SPOOKY_AUTHORS[a][1])) if rng.random() < 0.3
                     else str(rng.choice(_SPOOKY_COMMON)) for _ in range(int(rng.integers(8, 20)))]
            texts.append(" ".join(words).capitalize() + rng.choice([".", ",", ";", "?"]))
        return texts, [str(a) for a in who]

    text, author = sentences(n_rows)
    zip_csv(raw / "train.zip", "train.csv",
             pd.DataFrame({"id": ids[:n_rows], "text": text, "author": author}),
             quoting=csv.QUOTE_ALL)
    test_text, _ = sentences(n_test)
    zip_csv(raw / "test.zip", "test.csv", pd.DataFrame({"id": ids[n_rows:], "text": test_text}),
             quoting=csv.QUOTE_ALL)
    zip_csv(raw / "sample_submission.zip", "sample_submission.csv",
             pd.DataFrame({"id": ids[n_rows:], **_SPOOKY_PRIOR}))
