"""text-normalization-challenge-english-language: Kaggle's download, extracted, is five zips, each
holding the csv of its name: ``en_train.csv.zip`` ("sentence_id","token_id","class","before",
"after": 9,918,441 tokens of 748,000 sentences, one row a token, token_id from 0 in each sentence,
strings quoted), ``en_test.csv.zip`` and ``en_test_2.csv.zip`` ("sentence_id","token_id","before")
and ``en_sample_submission.csv.zip`` / ``en_sample_submission_2.csv.zip`` ("id","after", id =
``<sentence_id>_<token_id>``); MLE-bench's preparer extracts ``en_train``, ``en_test_2`` and
``en_sample_submission_2`` and splits the sentences of ``en_train`` into its own train and test,
so only those three are written (the stage-2 test about a tenth of the sentences, its sample
``after`` the ``before``). Made up here: sentences of plain words and punctuation (``after`` =
``before``, as on Kaggle) with a fifth of the tokens in Kaggle's semiotic classes, spelled out as
Kaggle's normalizer does (CARDINAL ``12`` -> ``twelve``, DATE ``1995`` -> ``nineteen ninety five``,
LETTERS ``BBC`` -> ``b b c``, MEASURE, MONEY, ORDINAL, DECIMAL, TIME, ELECTRONIC), drawn from small
pools so that most recur; some tokens are ambiguous (a year read as a CARDINAL, ``-`` read as
``to``), so memorising the commonest ``after`` of each ``before`` gets most but not all.
"""
from __future__ import annotations

import pathlib

import numpy as np

from sandbox.tasks.mlebench_raw import _text_normalization

#: en_test_2 has 12,000 sentences, about a tenth of en_train's (after MLE-bench's split, its test).

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
         "fifteen sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()
_ORD = {"one": "first", "two": "second", "three": "third", "five": "fifth", "eight": "eighth",
        "nine": "ninth", "twelve": "twelfth"}

_PLAIN = ("the a of and in to was is it his her their for on with by at from as that this which "
          "after before during city river team film album song school church village station "
          "player season game war army company university president government party population "
          "family species town district built released born died played won became located "
          "named known first new old small large north south east west Smith John London Paris "
          "county district English American British French national public local early later "
          "also however most many other several two three one").split()
_PUNCT = [".", ",", ",", ".", "(", ")", ":", ";", "\"", "'"]
_LETTERS = ["BBC", "FBI", "USA", "UK", "DNA", "CEO", "NBA", "MTV", "PhD", "TV", "EU", "GDP"]
_UNITS = {"km": ("kilometer", "kilometers"), "kg": ("kilogram", "kilograms"),
          "ft": ("foot", "feet"), "mi": ("mile", "miles"), "%": ("percent", "percent"),
          "cm": ("centimeter", "centimeters")}
_MONTHS = ("January February March April May June July August September October November "
           "December").split()
#: The years most sentences name (others are drawn from 1700-2016).
_YEARS = (1900, 1914, 1939, 1945, 1969, 1980, 1990, 1995, 1999, 2000, 2004, 2008, 2010, 2012,
          2014, 2016)
_SITES = ["google.com", "bbc.co.uk", "www.imdb.com", "wikipedia.org", "nasa.gov"]


def cardinal(n: int) -> str:
    """English words of 0 <= n < 1,000,000 as Kaggle's data spells them (no "and")."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        return _ONES[n // 100] + " hundred" + ("" if n % 100 == 0 else " " + cardinal(n % 100))
    return cardinal(n // 1000) + " thousand" + ("" if n % 1000 == 0 else " " + cardinal(n % 1000))


def ordinal(n: int) -> str:
    words = cardinal(n).split()
    last = words[-1]
    if last in _ORD:
        words[-1] = _ORD[last]
    elif last.endswith("y"):
        words[-1] = last[:-1] + "ieth"
    else:
        words[-1] = last + "th"
    return " ".join(words)


def year(y: int) -> str:
    """How Kaggle's data reads a year: 1995 -> nineteen ninety five, 1905 -> nineteen o five,
    1900 -> nineteen hundred, 2008 -> two thousand eight, 2012 -> twenty twelve."""
    if 2000 <= y < 2010:
        return cardinal(y)
    hi, lo = divmod(y, 100)
    if lo == 0:
        return cardinal(hi) + " hundred"
    return cardinal(hi) + (" o " + _ONES[lo] if lo < 10 else " " + cardinal(lo))


def _suffix(n: int) -> str:
    if n % 100 in (11, 12, 13):
        return "th"
    return {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def _semiotic(rng: np.random.Generator) -> tuple[str, str, str]:
    """One (class, before, after) token of a semiotic class."""
    kind = rng.choice(["CARDINAL", "DATE", "LETTERS", "MEASURE", "MONEY", "ORDINAL", "DECIMAL",
                       "TIME", "ELECTRONIC", "DASH"],
                      p=[0.24, 0.24, 0.14, 0.07, 0.06, 0.07, 0.04, 0.04, 0.03, 0.07])
    if kind == "CARDINAL":
        n = int(rng.choice([int(rng.integers(0, 13)), int(rng.integers(13, 100)),
                            int(rng.integers(100, 5000))], p=[0.7, 0.22, 0.08]))
        return "CARDINAL", str(n), cardinal(n)
    if kind == "DATE":
        y = int(rng.choice(_YEARS)) if rng.random() < 0.85 else int(rng.integers(1700, 2017))
        if rng.random() < 0.12:  # a year-like number read as a cardinal
            return "CARDINAL", str(y), cardinal(y)
        if rng.random() < 0.25:
            m, d = int(rng.integers(0, 12)), int(rng.integers(1, 32))
            return ("DATE", f"{_MONTHS[m]} {d}, {y}",
                    f"{_MONTHS[m].lower()} {ordinal(d)} {year(y)}")
        return "DATE", str(y), year(y)
    if kind == "LETTERS":
        w = str(rng.choice(_LETTERS))
        return "LETTERS", w, " ".join(c.lower() for c in w)
    if kind == "MEASURE":
        n, unit = int(rng.choice([1, 2, 3, 5, 10, 20, 50, 100])), str(rng.choice(list(_UNITS)))
        spoken = _UNITS[unit][0 if n == 1 else 1]
        return "MEASURE", (f"{n}%" if unit == "%" else f"{n} {unit}"), f"{cardinal(n)} {spoken}"
    if kind == "MONEY":
        n = int(rng.choice([1, 2, 5, 10, 20, 50, 100, 500, int(rng.integers(1, 1000))]))
        cur, one, many = [("$", "dollar", "dollars"), ("£", "pound", "pounds")][
            int(rng.random() < 0.3)]
        return "MONEY", f"{cur}{n}", f"{cardinal(n)} {one if n == 1 else many}"
    if kind == "ORDINAL":
        n = int(rng.integers(1, 13)) if rng.random() < 0.8 else int(rng.integers(13, 40))
        return "ORDINAL", f"{n}{_suffix(n)}", ordinal(n)
    if kind == "DECIMAL":
        a, b = int(rng.integers(0, 5)), int(rng.integers(1, 10))
        return "DECIMAL", f"{a}.{b}", f"{cardinal(a)} point {_ONES[b]}"
    if kind == "TIME":
        h, m = int(rng.integers(1, 13)), int(rng.choice([0, 15, 30, 45]))
        return "TIME", f"{h}:{m:02d}", cardinal(h) + (" o'clock" if m == 0 else f" {cardinal(m)}")
    if kind == "ELECTRONIC":
        site = str(rng.choice(_SITES))
        return "ELECTRONIC", site, " ".join("dot" if c == "." else c for c in site)
    # a dash: read "to" (as in a range) or left as punctuation, half and half
    return ("PUNCT", "-", "-") if rng.random() < 0.5 else ("PUNCT", "-", "to")


def _sentence(rng: np.random.Generator) -> list[tuple[str, str, str]]:
    tokens = []
    for _ in range(int(rng.integers(5, 16))):
        r = rng.random()
        if r < 0.2:
            tokens.append(_semiotic(rng))
        elif r < 0.3:
            p = str(rng.choice(_PUNCT))
            tokens.append(("PUNCT", p, p))
        else:
            w = str(rng.choice(_PLAIN))
            tokens.append(("PLAIN", w, w))
    if tokens[0][0] == "PLAIN":
        w = tokens[0][1][0].upper() + tokens[0][1][1:]
        tokens[0] = ("PLAIN", w, w)
    tokens.append(("PUNCT", ".", "."))
    return tokens


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    _text_normalization.write_raw(raw, "en", _sentence, n_rows, rng)
