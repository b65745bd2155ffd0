"""random-acts-of-pizza: Kaggle's download, extracted, is ``train.json`` (a json list of 4,040
requests, each an object of 32 fields: ``request_id`` such as ``t3_w5491``, ``request_title``,
``request_text``, ``request_text_edit_aware``, the requester's activity ``*_at_request`` and
``*_at_retrieval``, ``requester_user_flair``, ``giver_username_if_known``, the label
``requester_received_pizza`` (true for 24.6%), ...), ``test.json`` (1,631 requests with only the 17
fields known when posting), their zips ``train.zip`` / ``test.zip`` and ``sampleSubmission.csv``;
MLE-bench's preparer reads only ``train.json`` and ``test.json`` (the latter for its fields and its
size: it holds out that share of ``train.json`` as the test set), so only those two are written,
with Kaggle's fields and types (ints, floats, booleans, null, lists of subreddits). Made up here:
short requests telling one of a few stories (lost job, hungry kids, student, birthday, craving),
and requester histories; the chance of a pizza rises with the story, a picture as proof (imgur),
an older account and earlier posts on the subreddit, and, as on Kaggle, the retrieval-time fields
(flair, giver, comments) leak it. The rows are drawn again (from ``rng``) until the rows that
MLE-bench's preparer holds out have both outcomes in each half of them (every other
``request_id`` in sorted order), so the AUC of the test set and of its halves is defined.
"""
from __future__ import annotations

import json
import pathlib

import numpy as np

#: Kaggle's test.json holds 1,631 requests against train.json's 4,040.
TEST_SHARE = 1631 / 4040
#: Fields of Kaggle's test.json (those known when the request is posted).
TEST_FIELDS = (
    "giver_username_if_known", "request_id", "request_text_edit_aware", "request_title",
    "requester_account_age_in_days_at_request",
    "requester_days_since_first_post_on_raop_at_request",
    "requester_number_of_comments_at_request", "requester_number_of_comments_in_raop_at_request",
    "requester_number_of_posts_at_request", "requester_number_of_posts_on_raop_at_request",
    "requester_number_of_subreddits_at_request", "requester_subreddits_at_request",
    "requester_upvotes_minus_downvotes_at_request", "requester_upvotes_plus_downvotes_at_request",
    "requester_username", "unix_timestamp_of_request", "unix_timestamp_of_request_utc")
_FIRST, _LAST = 1291766400, 1380412800  # 2010-12-08 .. 2013-09-29 (UTC)
_RETRIEVED = 1380542400  # 2013-09-30

#: story -> (effect on the log-odds of a pizza, titles, sentences)
_STORIES = {
    "job": (0.9, ["Lost my job, could use a pizza", "Waiting on my first paycheck",
                  "Between jobs and out of food"],
            ["I lost my job two weeks ago and rent took everything.",
             "My paycheck comes on Friday but the fridge is empty.",
             "Been applying everywhere, still no job, and we are down to rice."]),
    "family": (1.1, ["Hungry kids tonight", "Single dad, payday is far away",
                     "Would love to feed my family tonight"],
               ["My two kids have been eating noodles all week.",
                "My wife is sick and the kids would love a pizza night.",
                "Money is tight until payday and the kids are hungry."]),
    "student": (0.0, ["Broke college student", "Finals week and no money",
                      "Student loan has not come through"],
                ["I am a student and my loan is late this semester.",
                 "Studying for finals and I have five dollars left.",
                 "Dorm food ran out and my account is empty."]),
    "birthday": (-0.6, ["It's my birthday!", "Birthday pizza?", "Turning 21 today"],
                 ["It is my birthday today and I would love a pizza.",
                  "Nobody remembered my birthday, a pizza would cheer me up.",
                  "Celebrating my birthday alone tonight."]),
    "craving": (-1.2, ["Craving pizza", "Just really want a pizza", "Pizza would be awesome"],
                ["I just really want a pizza tonight.", "Been craving pepperoni all day.",
                 "Bored and hungry, pizza would make my night."]),
}
_CLOSERS = ["I would pay it forward when I can.", "Thanks for reading.", "Anything helps.",
            "Here is a picture of my empty fridge: http://imgur.com/{}",
            "I can verify, proof: http://i.imgur.com/{}.jpg", "Cheers.", ""]
_USERNAME_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_-0123456789"
_SUBREDDITS = ("AskReddit pics funny gaming IAmA WTF todayilearned videos trees food Minecraft "
               "movies Music aww politics worldnews atheism fffffffuuuuuuuuuuuu").split()


def _name(rng: np.random.Generator, k: int, alphabet: str) -> str:
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), k))


def _request(rng: np.random.Generator, request_id: str) -> dict:
    """One request with all of train.json's 32 fields."""
    story = str(rng.choice(list(_STORIES)))
    effect, titles, sentences = _STORIES[story]
    closer = str(rng.choice(_CLOSERS)).format(_name(rng, 7, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJ"))
    text = " ".join(rng.choice(sentences, int(rng.integers(1, 3)), replace=False)) + " " + closer
    age = float(rng.exponential(250)) if rng.random() < 0.8 else 0.0
    posts, comments = int(rng.poisson(age / 15)), int(rng.poisson(age / 3))
    raop_posts = int(rng.random() < 0.12) * int(rng.integers(1, 4))
    raop_comments = int(rng.poisson(2)) if rng.random() < 0.2 else 0
    subs = sorted(set(rng.choice(_SUBREDDITS, min(int(rng.poisson(age / 100)), 8))))
    if raop_posts or raop_comments:
        subs = sorted(set(subs) | {"Random_Acts_Of_Pizza"})
    plus = int(rng.poisson(20 * comments ** 0.8 + 1)) if comments else 0
    minus = int(plus * rng.uniform(0.5, 1.0))
    logit = (-1.7 + effect + 0.9 * ("imgur" in text) + 0.25 * np.log1p(age) - 0.9
             + 0.6 * (raop_posts > 0) + rng.normal(0, 0.8))
    got = bool(rng.random() < 1 / (1 + np.exp(-logit)))

    t = float(rng.integers(_FIRST, _LAST))
    waited = (_RETRIEVED - t) / 86400
    edited = rng.random() < (0.25 if got else 0.08)
    giver = _name(rng, int(rng.integers(5, 12)), "abcdefghijklmnopqrstuvwxyz_0123456789") \
        if got and rng.random() < 0.35 else "N/A"
    full_text = text + (f"\n\nEDIT: Thanks /u/{giver if giver != 'N/A' else 'someone'}, "
                        "the pizza was great!" if got and edited else "")
    first_raop = float(rng.uniform(1, 300)) if raop_posts or raop_comments else 0.0
    more_posts, more_comments = int(rng.poisson(waited / 20)), int(rng.poisson(waited / 4))
    up = int(rng.poisson(3 + 3 * got))
    return {
        "giver_username_if_known": giver,
        "number_of_downvotes_of_request_at_retrieval": int(rng.poisson(1.5)),
        "number_of_upvotes_of_request_at_retrieval": up,
        "post_was_edited": (True if rng.random() < 0.6 else t + float(rng.integers(60, 86400)))
        if edited else False,
        "request_id": request_id,
        "request_number_of_comments_at_retrieval": int(rng.poisson(1 + 3 * got)),
        "request_text": full_text.strip(),
        "request_text_edit_aware": text.strip(),
        "request_title": "[Request] " + str(rng.choice(titles)),
        "requester_account_age_in_days_at_request": age,
        "requester_account_age_in_days_at_retrieval": age + waited,
        "requester_days_since_first_post_on_raop_at_request": first_raop,
        "requester_days_since_first_post_on_raop_at_retrieval": first_raop + waited,
        "requester_number_of_comments_at_request": comments,
        "requester_number_of_comments_at_retrieval": comments + more_comments,
        "requester_number_of_comments_in_raop_at_request": raop_comments,
        "requester_number_of_comments_in_raop_at_retrieval": raop_comments + int(rng.poisson(
            1 + 2 * got)),
        "requester_number_of_posts_at_request": posts,
        "requester_number_of_posts_at_retrieval": posts + more_posts + 1,
        "requester_number_of_posts_on_raop_at_request": raop_posts,
        "requester_number_of_posts_on_raop_at_retrieval": raop_posts + 1 + int(got and rng.random()
                                                                             < 0.2),
        "requester_number_of_subreddits_at_request": len(subs),
        "requester_received_pizza": got,
        "requester_subreddits_at_request": subs,
        "requester_upvotes_minus_downvotes_at_request": plus - minus,
        "requester_upvotes_minus_downvotes_at_retrieval": plus - minus + int(rng.poisson(
            waited / 2)),
        "requester_upvotes_plus_downvotes_at_request": plus,
        "requester_upvotes_plus_downvotes_at_retrieval": plus + int(rng.poisson(waited)),
        "requester_user_flair": (("PIF" if rng.random() < 0.06 else "shroom") if got else None),
        "requester_username": _name(rng, int(rng.integers(5, 14)), _USERNAME_CHARS),
        "unix_timestamp_of_request": t + 3600 * float(rng.choice([0, 0, 0, -5, -8, 1])),
        "unix_timestamp_of_request_utc": t,
    }


def _request_ids(rng: np.random.Generator, n: int) -> list[str]:
    ids: set[str] = set()
    while len(ids) < n:
        ids.add("t3_" + _name(rng, int(rng.integers(4, 6)), "0123456789abcdefghijklmnopqrstuvwxyz"))
    return list(rng.permutation(sorted(ids)))


def _held_out_ok(train: list[dict], test_ratio: float) -> bool:
    """Both outcomes in each half (every other request_id, sorted) of the requests that
    MLE-bench's preparer holds out (its ``train_test_split(..., random_state=0)``)."""
    from sklearn.model_selection import train_test_split

    _, held_out = train_test_split(train, test_size=test_ratio, random_state=0)
    got = [r["requester_received_pizza"] for r in sorted(held_out, key=lambda r: r["request_id"])]
    return all(len(set(got[k::2])) == 2 for k in (0, 1))


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    n_test = max(round(n_rows * TEST_SHARE), 4)
    for _ in range(1000):
        ids = _request_ids(rng, n_rows + n_test)
        train = [_request(rng, i) for i in ids[:n_rows]]
        if _held_out_ok(train, n_test / (n_rows + n_test)):
            break
    test = [{k: v for k, v in _request(rng, i).items() if k in TEST_FIELDS} for i in ids[n_rows:]]
    for name, rows in (("train.json", train), ("test.json", test)):
        with open(raw / name, "w") as f:
            json.dump(rows, f, indent=4)
