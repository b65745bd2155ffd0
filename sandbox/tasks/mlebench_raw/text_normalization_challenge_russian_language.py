"""text-normalization-challenge-russian-language: Kaggle's download, extracted, is five zips, each
holding the UTF-8 csv of its name: ``ru_train.csv.zip`` ("sentence_id","token_id","class",
"before","after": 10,574,516 tokens of 761,000 sentences, one row a token, token_id from 0 in each
sentence, strings quoted), ``ru_test.csv.zip`` and ``ru_test_2.csv.zip`` ("sentence_id",
"token_id","before") and ``ru_sample_submission.csv.zip`` / ``ru_sample_submission_2.csv.zip``
("id","after", id = ``<sentence_id>_<token_id>``); MLE-bench's preparer extracts ``ru_train``,
``ru_test_2`` and ``ru_sample_submission_2`` and splits the sentences of ``ru_train`` into its own
train and test, so only those three are written (the stage-2 test about a tenth of the sentences,
its sample ``after`` the ``before``). Made up here: sentences of Cyrillic words and punctuation
(``after`` = ``before``, as on Kaggle) with a fifth of the tokens in Kaggle's semiotic classes,
spelled out in Russian as Kaggle's normalizer does (CARDINAL ``12`` -> ``двенадцать``, DATE
``1991 года`` -> ``тысяча девятьсот девяносто первого года``, LETTERS ``СССР`` -> ``с с с р``,
MEASURE ``5 км`` -> ``пять километров``, MONEY, Roman ORDINAL centuries, and Latin words
transliterated letter by letter with Kaggle's ``_trans`` suffix: ``Google`` -> ``г_trans у_trans
г_trans л_trans``), drawn from small pools so that most recur; some tokens are ambiguous (a
number in the genitive, ``пяти`` for ``5``, or a year read as a cardinal), so memorising the
commonest ``after`` of each ``before`` gets most but not all.
"""
from __future__ import annotations

import pathlib

import numpy as np

from sandbox.tasks.mlebench_raw import _text_normalization

#: ru_test_2 is about a tenth of ru_train's sentences (as is MLE-bench's split of ru_train).

_ONES = ("ноль один два три четыре пять шесть семь восемь девять десять одиннадцать двенадцать "
         "тринадцать четырнадцать пятнадцать шестнадцать семнадцать восемнадцать "
         "девятнадцать").split()
_TENS = "_ _ двадцать тридцать сорок пятьдесят шестьдесят семьдесят восемьдесят девяносто".split()
_HUNDREDS = "_ сто двести триста четыреста пятьсот шестьсот семьсот восемьсот девятьсот".split()
#: Genitive (masculine) ordinals: 1-19, then the tens, then hundreds.
_ORD_ONES = ("_ первого второго третьего четвертого пятого шестого седьмого восьмого девятого "
             "десятого одиннадцатого двенадцатого тринадцатого четырнадцатого пятнадцатого "
             "шестнадцатого семнадцатого восемнадцатого девятнадцатого").split()
_ORD_TENS = ("_ _ двадцатого тридцатого сорокового пятидесятого шестидесятого семидесятого "
             "восьмидесятого девяностого").split()
_ORD_HUNDREDS = {7: "семисотого", 8: "восьмисотого", 9: "девятисотого"}
#: Genitive cardinals, the oblique case that makes a number ambiguous ("от 5" -> "от пяти").
_GEN = {1: "одного", 2: "двух", 3: "трех", 4: "четырех", 5: "пяти", 6: "шести", 7: "семи",
        8: "восьми", 9: "девяти", 10: "десяти", 20: "двадцати", 100: "ста"}
_MONTHS_GEN = ("января февраля марта апреля мая июня июля августа сентября октября ноября "
               "декабря").split()
_ROMAN = {"XV": 15, "XVI": 16, "XVII": 17, "XVIII": 18, "XIX": 19, "XX": 20, "XXI": 21}

_PLAIN = ("в на и с по из к о что как был была были было является также который которая "
          "после время однако его её их это город река район страна школа церковь деревня "
          "станция команда фильм альбом песня игрок сезон война армия компания университет "
          "президент правительство партия население семья вид родился умер получил стал "
          "находится назван известен первый новый старый большой север юг восток запад Москва "
          "России Петербурга Иван Пётр советский русский национальный местный несколько").split()
_PUNCT = [",", ",", ".", "—", "«", "»", ":", "(", ")"]
_LETTERS = ["СССР", "США", "ООН", "ВВС", "РФ", "МГУ", "ФСБ", "КГБ", "НАТО"]
_TRANS = {"Google": "гугл", "London": "лондон", "Windows": "виндоус", "Julius": "джулиус",
          "Apple": "эппл", "Facebook": "фейсбук", "Street": "стрит", "Park": "парк"}
#: unit -> (forms for 1, 2-4, 5+)
_UNITS = {"км": ("километр", "километра", "километров"),
          "кг": ("килограмм", "килограмма", "килограммов"),
          "м": ("метр", "метра", "метров"), "%": ("процент", "процента", "процентов")}
_RUB = ("рубль", "рубля", "рублей")
_USD = ("доллар", "доллара", "долларов")
_YEARS = (1812, 1861, 1905, 1914, 1917, 1941, 1945, 1961, 1980, 1991, 1999, 2000, 2004, 2008,
          2010, 2012, 2014, 2016)


def cardinal(n: int) -> str:
    """Nominative Russian words of 0 <= n < 10,000."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    if n < 1000:
        return _HUNDREDS[n // 100] + ("" if n % 100 == 0 else " " + cardinal(n % 100))
    k = n // 1000
    head = {1: "тысяча", 2: "две тысячи", 3: "три тысячи", 4: "четыре тысячи"}.get(
        k, cardinal(k) + " тысяч")
    return head + ("" if n % 1000 == 0 else " " + cardinal(n % 1000))


def ordinal_gen(n: int) -> str:
    """Genitive masculine ordinal of 1 <= n < 100 ("двадцать первого")."""
    if n < 20 or n % 10 == 0:
        return _ORD_ONES[n] if n < 20 else _ORD_TENS[n // 10]
    return _TENS[n // 10] + " " + _ORD_ONES[n % 10]


def year_gen(y: int) -> str:
    """Genitive ordinal of a year 1000-2999 ("тысяча девятьсот сорок пятого")."""
    if y == 2000:
        return "двухтысячного"
    head = "тысяча" if y < 2000 else "две тысячи"
    h, rest = (y % 1000) // 100, y % 100
    if rest == 0:
        return f"{head} {_ORD_HUNDREDS[h]}"
    return " ".join(w for w in (head, _HUNDREDS[h] if h else "", ordinal_gen(rest)) if w)


def to_prepositional(words: str) -> str:
    """Genitive -> prepositional ordinal (last word): "первого" -> "первом"."""
    head, _, last = words.rpartition(" ")
    last = "третьем" if last == "третьего" else last[:-3] + "ом"
    return (head + " " + last).strip()


def plural(n: int, forms: tuple[str, str, str]) -> str:
    if n % 10 == 1 and n % 100 != 11:
        return forms[0]
    if 2 <= n % 10 <= 4 and not 12 <= n % 100 <= 14:
        return forms[1]
    return forms[2]


def _semiotic(rng: np.random.Generator) -> list[tuple[str, str, str]]:
    """One semiotic token (two for a century: the Roman ordinal and "века")."""
    kind = rng.choice(["CARDINAL", "DATE", "LETTERS", "MEASURE", "MONEY", "ORDINAL", "TRANS"],
                      p=[0.28, 0.26, 0.13, 0.1, 0.06, 0.07, 0.1])
    if kind == "CARDINAL":
        n = int(rng.choice([int(rng.integers(0, 13)), int(rng.integers(13, 100)),
                            int(rng.integers(100, 5000))], p=[0.7, 0.22, 0.08]))
        if n in _GEN and rng.random() < 0.2:
            return [("CARDINAL", str(n), _GEN[n])]
        return [("CARDINAL", str(n), cardinal(n))]
    if kind == "DATE":
        y = int(rng.choice(_YEARS)) if rng.random() < 0.85 else int(rng.integers(1700, 2017))
        r = rng.random()
        if r < 0.15:  # a bare year, read as a number
            return [("CARDINAL", str(y), cardinal(y))]
        if r < 0.35:
            d, m = int(rng.integers(1, 32)), int(rng.integers(0, 12))
            return [("DATE", f"{d} {_MONTHS_GEN[m]} {y} года",
                     f"{ordinal_gen(d)} {_MONTHS_GEN[m]} {year_gen(y)} года")]
        if r < 0.7:
            return [("DATE", f"{y} года", f"{year_gen(y)} года")]
        return [("DATE", f"{y} году", f"{to_prepositional(year_gen(y))} году")]
    if kind == "LETTERS":
        w = str(rng.choice(_LETTERS))
        if w == "НАТО":  # an acronym read as a word
            return [("PLAIN", w, "нато")]
        return [("LETTERS", w, " ".join(c.lower() for c in w))]
    if kind == "MEASURE":
        n, unit = int(rng.choice([1, 2, 3, 5, 10, 20, 50, 100])), str(rng.choice(list(_UNITS)))
        return [("MEASURE", f"{n} {unit}", f"{cardinal(n)} {plural(n, _UNITS[unit])}")]
    if kind == "MONEY":
        n = int(rng.choice([1, 2, 5, 10, 20, 50, 100, 500, int(rng.integers(1, 1000))]))
        if rng.random() < 0.5:
            return [("MONEY", f"${n}", f"{cardinal(n)} {plural(n, _USD)}")]
        return [("MONEY", f"{n} руб.", f"{cardinal(n)} {plural(n, _RUB)}")]
    if kind == "ORDINAL":
        roman = str(rng.choice(list(_ROMAN)))
        return [("ORDINAL", roman, ordinal_gen(_ROMAN[roman])), ("PLAIN", "века", "века")]
    word = str(rng.choice(list(_TRANS)))
    return [("PLAIN", word, " ".join(c + "_trans" for c in _TRANS[word]))]


def _sentence(rng: np.random.Generator) -> list[tuple[str, str, str]]:
    tokens: list[tuple[str, str, str]] = []
    for _ in range(int(rng.integers(5, 16))):
        r = rng.random()
        if r < 0.2:
            tokens.extend(_semiotic(rng))
        elif r < 0.3:
            p = str(rng.choice(_PUNCT))
            tokens.append(("PUNCT", p, p))
        else:
            w = str(rng.choice(_PLAIN))
            tokens.append(("PLAIN", w, w))
    if tokens[0][0] == "PLAIN" and tokens[0][1] == tokens[0][2]:
        w = tokens[0][1][0].upper() + tokens[0][1][1:]
        tokens[0] = ("PLAIN", w, w)
    tokens.append(("PUNCT", ".", "."))
    return tokens


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    _text_normalization.write_raw(raw, "ru", _sentence, n_rows, rng)
