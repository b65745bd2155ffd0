"""detecting-insults-in-social-commentary: Kaggle's download, extracted, is ``train.csv``
(Insult,Date,Comment: 3,947 rows, 26% insults), ``test_with_solutions.csv`` (the same columns plus
Usage = PublicTest/PrivateTest: 2,647 rows), the unlabelled ``test.csv``,
``sample_submission_null.csv`` and the later ``impermium_verification_set.csv`` /
``impermium_verification_labels.csv``; MLE-bench's preparer reads only ``train.csv`` and
``test_with_solutions.csv`` (its public test and sample submission are made from the latter), so
only those two are written. As on Kaggle, Date is ``YYYYMMDDhhmmssZ`` or blank, and Comment is
the unicode-escaped text (literal ``\\xa0``, ``\\n``) wrapped in double quotes that are part of
the value (``\"\"\"You idiot.\"\"\"`` in the csv). Made up here: short forum comments; most
insults call "you" an insulting word, some only sneer, while a quarter of the neutral comments use
such a word about something else and a fifth address "you" kindly (4% of labels flipped), so word
pairs learn most of it. The test rows are drawn again until both classes are in each half of them
(every other Comment in sorted order), so the AUC of a half is defined.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pandas as pd

#: Kaggle's train.csv: 1,049 insults of 3,947 comments.
P_INSULT = 0.266
#: Kaggle's test_with_solutions.csv holds 2,647 comments against train.csv's 3,947.
TEST_SHARE = 2647 / 3947
#: Share of comments without a timestamp (a blank Date).
P_NO_DATE = 0.2

_INSULTS = ("idiot moron stupid loser dumb pathetic ignorant clown fool troll coward liar "
            "imbecile hypocrite clueless").split()
_NEUTRAL = ("the game last night was great I think the article makes a good point about taxes "
            "and the economy but we need more data on this issue the team played well in the "
            "second half really agree with that policy people should vote in november "
            "thanks for sharing the link interesting story about the city council budget "
            "weather has been nice this week prices keep going up everywhere").split()
_OPENERS = [
    "you are a", "you're such a", "shut up you", "go away you", "nobody cares what you say you",
    "you sound like a", "listen to yourself, you", "only a", "you really are a"]
_NEUTRAL_OPENERS = ["I think", "honestly", "well", "agreed,", "no,", "yes", "lol", "good point,",
                    "in my opinion", "@jim"]
_KIND = ["good", "smart", "funny", "fair", "kind", "decent"]
_ENDS = [".", "!", "?", "...", ".\\xa0", "!!", ". \\n"]


def _comment(rng: np.random.Generator, insult: bool) -> str:
    """One comment, as its Comment value: text in double quotes, unicode-escaped."""
    filler = " ".join(rng.choice(_NEUTRAL, int(rng.integers(3, 12))))
    if insult:
        bad = " ".join(rng.choice(_INSULTS, int(rng.integers(1, 3)), replace=False))
        if rng.random() < 0.7:
            text = f"{rng.choice(_OPENERS)} {bad}{rng.choice(_ENDS)} {filler}"
        elif rng.random() < 0.5:  # an insult without an insulting word
            text = f"you clearly never read anything about {filler}, do you{rng.choice(_ENDS)}"
        else:
            text = f"{rng.choice(_NEUTRAL_OPENERS)} {filler}, {bad}{rng.choice(_ENDS)}"
    else:
        text = f"{rng.choice(_NEUTRAL_OPENERS)} {filler}"
        if rng.random() < 0.25:  # a rude word, not aimed at a participant
            text += f", that call by the referee was {rng.choice(_INSULTS)}"
        if rng.random() < 0.2:
            who = rng.choice(["person", "writer", "guy"])
            text = f"you are a {rng.choice(_KIND)} {who}, {text}"
        text += str(rng.choice(_ENDS))
    if rng.random() < 0.3:
        text = text[0].upper() + text[1:]
    if rng.random() < 0.05:
        text += " caf\\xe9"
    return '"' + text.strip() + '"'


def _dates(rng: np.random.Generator, n: int, start: str, days: int) -> list[str]:
    t0 = pd.Timestamp(start)
    secs = rng.integers(0, days * 86400, n)
    return ["" if rng.random() < P_NO_DATE else (t0 + pd.Timedelta(seconds=int(s))).strftime(
        "%Y%m%d%H%M%SZ") for s in secs]


def _rows(rng: np.random.Generator, n: int, seen: set[str], start: str) -> pd.DataFrame:
    insult = (rng.random(n) < P_INSULT).astype(int)
    comments = []
    for y in insult:
        c = _comment(rng, bool(y))
        while c in seen:
            c = _comment(rng, bool(y))
        seen.add(c)
        comments.append(c)
    flipped = rng.random(n) < 0.04
    return pd.DataFrame({"Insult": insult ^ flipped.astype(int), "Date": _dates(rng, n, start, 60),
                         "Comment": comments})


def _halves_ok(test: pd.DataFrame) -> bool:
    """Both classes in the test set and in each half of it taken every other Comment in sorted
    order (so the AUC of a half is defined too)."""
    y = test.sort_values("Comment")["Insult"].to_numpy()
    return all(len(set(y[k::2])) == 2 for k in (0, 1))


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    seen: set[str] = set()
    train = _rows(rng, n_rows, seen, "2012-03-20")
    n_test = max(round(n_rows * TEST_SHARE), 10)
    for _ in range(1000):
        test = _rows(rng, n_test, set(seen), "2012-05-20")
        if _halves_ok(test):
            break
    test["Usage"] = np.where(np.arange(n_test) < n_test * 0.3, "PublicTest", "PrivateTest")
    train.to_csv(raw / "train.csv", index=False)
    test.to_csv(raw / "test_with_solutions.csv", index=False)
