"""dog-breed-identification: Kaggle's download holds ``labels.csv`` (id,breed for the
10,222 training photos, ids 32 hex digits, sorted by id), ``train/<id>.jpg``, ``test/<id>.jpg``
(10,357 unlabelled photos) and ``sample_submission.csv`` (id + one probability column per breed,
120 of them); MLE-bench's preparer reads only ``labels.csv`` and ``train/``, splitting 10% of it off
as its test set, so only those are written. Everything is made up: each breed has its own coat and
ear colours, drawn once per call, and each 24x24 "photo" is a noisy blob of its breed's coat (ears
on top) on a random grass, floor or wall background; breed frequencies vary over the 120 breeds
about as much as Kaggle's (66 to 126 photos a breed), so at tens of photos most breeds are absent
from the training set or seen once.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pandas as pd
from PIL import Image

#: The 120 breeds of Kaggle's labels.csv (and of MLE-bench's dogs.py), alphabetical.
BREEDS = """
    affenpinscher afghan_hound african_hunting_dog airedale american_staffordshire_terrier
    appenzeller australian_terrier basenji basset beagle bedlington_terrier
    bernese_mountain_dog black-and-tan_coonhound blenheim_spaniel bloodhound bluetick
    border_collie border_terrier borzoi boston_bull bouvier_des_flandres boxer
    brabancon_griffon briard brittany_spaniel bull_mastiff cairn cardigan
    chesapeake_bay_retriever chihuahua chow clumber cocker_spaniel collie
    curly-coated_retriever dandie_dinmont dhole dingo doberman english_foxhound
    english_setter english_springer entlebucher eskimo_dog flat-coated_retriever
    french_bulldog german_shepherd german_short-haired_pointer giant_schnauzer
    golden_retriever gordon_setter great_dane great_pyrenees greater_swiss_mountain_dog
    groenendael ibizan_hound irish_setter irish_terrier irish_water_spaniel irish_wolfhound
    italian_greyhound japanese_spaniel keeshond kelpie kerry_blue_terrier komondor kuvasz
    labrador_retriever lakeland_terrier leonberg lhasa malamute malinois maltese_dog
    mexican_hairless miniature_pinscher miniature_poodle miniature_schnauzer newfoundland
    norfolk_terrier norwegian_elkhound norwich_terrier old_english_sheepdog otterhound
    papillon pekinese pembroke pomeranian pug redbone rhodesian_ridgeback rottweiler
    saint_bernard saluki samoyed schipperke scotch_terrier scottish_deerhound
    sealyham_terrier shetland_sheepdog shih-tzu siberian_husky silky_terrier
    soft-coated_wheaten_terrier staffordshire_bullterrier standard_poodle standard_schnauzer
    sussex_spaniel tibetan_mastiff tibetan_terrier toy_poodle toy_terrier vizsla
    walker_hound weimaraner welsh_springer_spaniel west_highland_white_terrier whippet
    wire-haired_fox_terrier yorkshire_terrier
""".split()

SIZE = 24


def _photo(coat: np.ndarray, ears: np.ndarray, rng: np.random.Generator) -> Image.Image:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(float)
    background = rng.choice([[80.0, 130.0, 60.0], [150.0, 130.0, 110.0], [200.0, 200.0, 200.0]])
    img = background + rng.normal(0, 25, (SIZE, SIZE, 3))
    cy, cx = rng.uniform(10, 14, 2)
    ry, rx = rng.uniform(6, 9, 2)
    body = ((yy - cy) / ry) ** 2 + ((xx - cx) / rx) ** 2 <= 1
    img[body] = coat + rng.normal(0, 18, (int(body.sum()), 3))
    ear = body & (yy < cy - ry * 0.4)
    img[ear] = ears + rng.normal(0, 18, (int(ear.sum()), 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    coats = rng.uniform(20, 235, (len(BREEDS), 3))
    ears = rng.uniform(20, 235, (len(BREEDS), 3))
    share = rng.uniform(66, 126, len(BREEDS))
    breed = rng.choice(len(BREEDS), size=n_rows, p=share / share.sum())
    ids = set()
    while len(ids) < n_rows:
        ids.add(rng.bytes(16).hex())
    ids = sorted(ids)
    (raw / "train").mkdir(parents=True, exist_ok=True)
    for file_id, b in zip(ids, breed):
        _photo(coats[b], ears[b], rng).save(raw / "train" / f"{file_id}.jpg", quality=90)
    pd.DataFrame({"id": ids, "breed": [BREEDS[b] for b in breed]}).to_csv(raw / "labels.csv",
                                                                          index=False)
