"""siim-isic-melanoma-classification: Kaggle's download holds ``train.csv`` (image_name
``ISIC_<7 digits>``, patient_id ``IP_<7 digits>``, sex, age_approx, anatom_site_general_challenge,
diagnosis, benign_malignant, target; blanks where unknown), ``test.csv``,
``sample_submission.csv``, the images as DICOM (``train/<image_name>.dcm``, ``test/``), as JPEG
(``jpeg/train/``, ``jpeg/test/``) and as TFRecords (``tfrecords/train00-2071.tfrec`` ..
``train14-2071.tfrec``, ``train15-2061.tfrec`` and ``test*.tfrec``: tf.train.Example with image
(JPEG bytes), image_name, and integer codes of patient_id, sex, age_approx,
anatom_site_general_challenge, diagnosis and target). MLE-bench's preparer reads ``train.csv``,
``train/*.dcm``, ``jpeg/train/*.jpg`` and the ``train*.tfrec`` files, taking the studies in
``train00-2071.tfrec`` and ``train06-2071.tfrec`` as its test set, so only those are written, under
Kaggle's file names (the count in a name is Kaggle's; each file holds a sixteenth of the made-up
studies). Everything else is made up: 24x24 JPEG photos of a brown lesion on skin, a malignant one
on average larger, darker, more irregular and more often with blue-black patches; each DICOM is a
small explicit-VR file (VL Photographic Image, modality XC) holding the patient tags and that JPEG
as encapsulated pixel data; the TFRecord examples leave out target and diagnosis, which Kaggle's
have, because MLE-bench copies two of these files into its public test folder unchanged. The
malignant share is about 15% (Kaggle: 1.8%) and rises with age; in the held-out files, and in each
half of them by sorted image_name (when a half has 2 or more rows), targets are flipped where needed
so that both classes occur (ROC AUC needs both), and the training files get at least 3 of each.
"""
from __future__ import annotations

import io
import pathlib
import struct

import numpy as np
import pandas as pd
from PIL import Image

SIZE = 24
#: Kaggle's TFRecord file names: 16 of 2071 studies, the last of 2061.
TFRECORDS = [f"train{k:02d}-2071.tfrec" for k in range(15)] + ["train15-2061.tfrec"]
TEST_FILES = (0, 6)  # train00-2071.tfrec and train06-2071.tfrec: MLE-bench's test set
SITES = (("torso", 0.51), ("lower extremity", 0.26), ("upper extremity", 0.15),
         ("head/neck", 0.055), ("palms/soles", 0.01), ("oral/genital", 0.005), (None, 0.01))
BENIGN = (("unknown", 0.82), ("nevus", 0.15), ("seborrheic keratosis", 0.01),
          ("lentigo NOS", 0.01), ("lichenoid keratosis", 0.005), ("solar lentigo", 0.005))
DIAGNOSES = ("atypical melanocytic proliferation", "cafe-au-lait macule", "lentigo NOS",
             "lichenoid keratosis", "melanoma", "nevus", "seborrheic keratosis", "solar lentigo",
             "unknown")


def _photo(malignant: bool, rng: np.random.Generator) -> bytes:
    yy, xx = np.mgrid[0:SIZE, 0:SIZE].astype(float)
    skin = np.array([225.0, 170.0, 140.0]) * rng.uniform(0.6, 1.05)
    img = skin + rng.normal(0, 8, (SIZE, SIZE, 3))
    cy, cx = rng.uniform(9, 15, 2)
    radius = rng.uniform(3.5, 7.5) if malignant else rng.uniform(2.5, 6.5)
    angle = np.arctan2(yy - cy, xx - cx)
    wobble = 1 + (rng.uniform(0.05, 0.3) if malignant else rng.uniform(0.0, 0.15)) * np.sin(
        rng.integers(3, 7) * angle + rng.uniform(0, 6.3))
    lesion = np.hypot(yy - cy, xx - cx) <= radius * wobble
    brown = np.array([120.0, 75.0, 50.0]) * (rng.uniform(0.5, 0.95) if malignant
                                              else rng.uniform(0.6, 1.1))
    img[lesion] = brown + rng.normal(0, 10, (int(lesion.sum()), 3))
    if rng.random() < (0.6 if malignant else 0.15):
        for _ in range(int(rng.integers(1, 4))):
            sy, sx = rng.normal([cy, cx], radius / 2.5)
            patch = lesion & ((yy - sy) ** 2 + (xx - sx) ** 2 <= rng.uniform(1, 5))
            img[patch] = np.array([40.0, 45.0, 70.0]) + rng.normal(0, 8, (int(patch.sum()), 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


# ------------------------------------------------------------------ DICOM (explicit VR LE)

def _element(group: int, elem: int, vr: str, value: bytes) -> bytes:
    if len(value) % 2:
        value += b"\0" if vr in ("UI", "OB") else b" "
    head = struct.pack("<HH", group, elem) + vr.encode()
    if vr in ("OB", "OW", "SQ", "UN", "UT"):
        return head + b"\0\0" + struct.pack("<I", len(value)) + value
    return head + struct.pack("<H", len(value)) + value


def _uid(rng: np.random.Generator) -> bytes:
    return f"2.25.{int.from_bytes(rng.bytes(16), 'big')}".encode()


def _dicom(jpeg: bytes, row: pd.Series, rng: np.random.Generator) -> bytes:
    sop_class, sop_instance = b"1.2.840.10008.5.1.4.1.1.77.1.4", _uid(rng)  # VL Photographic
    jpeg_baseline = b"1.2.840.10008.1.2.4.50"
    meta = (_element(0x0002, 0x0001, "OB", b"\0\1") + _element(0x0002, 0x0002, "UI", sop_class)
            + _element(0x0002, 0x0003, "UI", sop_instance)
            + _element(0x0002, 0x0010, "UI", jpeg_baseline)
            + _element(0x0002, 0x0012, "UI", b"1.2.826.0.1.3680043.9.7433.1.1"))
    meta = _element(0x0002, 0x0000, "UL", struct.pack("<I", len(meta))) + meta
    sex = {"male": b"M", "female": b"F"}.get(row["sex"], b"")
    age = b"" if pd.isna(row["age_approx"]) else f"{int(row['age_approx']):03d}Y".encode()
    site = row["anatom_site_general_challenge"]
    site = b"" if pd.isna(site) else site.upper().replace("/", " ").encode()
    us = lambda v: struct.pack("<H", v)  # noqa: E731
    data = (_element(0x0008, 0x0016, "UI", sop_class) + _element(0x0008, 0x0018, "UI", sop_instance)
            + _element(0x0008, 0x0060, "CS", b"XC")
            + _element(0x0010, 0x0010, "PN", row["patient_id"].encode())
            + _element(0x0010, 0x0020, "LO", row["patient_id"].encode())
            + _element(0x0010, 0x0040, "CS", sex) + _element(0x0010, 0x1010, "AS", age)
            + _element(0x0018, 0x0015, "CS", site[:16])
            + _element(0x0020, 0x000D, "UI", _uid(rng)) + _element(0x0020, 0x000E, "UI", _uid(rng))
            + _element(0x0028, 0x0002, "US", us(3))
            + _element(0x0028, 0x0004, "CS", b"YBR_FULL_422")
            + _element(0x0028, 0x0006, "US", us(0)) + _element(0x0028, 0x0010, "US", us(SIZE))
            + _element(0x0028, 0x0011, "US", us(SIZE)) + _element(0x0028, 0x0100, "US", us(8))
            + _element(0x0028, 0x0101, "US", us(8)) + _element(0x0028, 0x0102, "US", us(7))
            + _element(0x0028, 0x0103, "US", us(0)))
    fragment = jpeg + b"\0" * (len(jpeg) % 2)
    pixels = (struct.pack("<HH", 0x7FE0, 0x0010) + b"OB\0\0" + b"\xff\xff\xff\xff"
              + struct.pack("<HHI", 0xFFFE, 0xE000, 0)  # empty basic offset table
              + struct.pack("<HHI", 0xFFFE, 0xE000, len(fragment)) + fragment
              + struct.pack("<HHI", 0xFFFE, 0xE0DD, 0))
    return b"\0" * 128 + b"DICM" + meta + data + pixels


# ---------------------------------------------------------------------------------- TFRecords

def _varint(v: int) -> bytes:
    v &= (1 << 64) - 1                 # int64 on the wire: two's complement, 10 bytes if negative
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _example(features: dict[str, "bytes | int"]) -> bytes:
    """A ``tf.train.Example`` serialised as TensorFlow's deterministic serialisation does (map
    keys sorted): bytes -> a BytesList feature, int -> an Int64List (packed)."""
    entries = b""
    for key in sorted(features):
        v = features[key]
        feature = (_field(1, _field(1, v)) if isinstance(v, bytes)       # bytes_list
                   else _field(3, _field(1, _varint(int(v)))))         # int64_list, packed
        entries += _field(1, _field(1, key.encode()) + _field(2, feature))
    return _field(1, entries)


_CRC32C = [0] * 256
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC32C[_i] = _c


def _masked_crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC32C[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _write_tfrecord(path: pathlib.Path, rows: pd.DataFrame, jpegs: dict[str, bytes]) -> None:
    """Kaggle's TFRecords: one ``tf.train.Example`` per image, in TFRecord framing (length,
    masked CRC32C of it, the record, its masked CRC32C), written without TensorFlow."""
    sites = [s for s, _ in SITES if s is not None]
    with open(path, "wb") as f:
        for _, r in rows.iterrows():
            site = r["anatom_site_general_challenge"]
            record = _example({
                "image": jpegs[r["image_name"]],
                "image_name": r["image_name"].encode(),
                "patient_id": int(r["patient_id"][3:]),
                "sex": {"male": 1, "female": 0}.get(r["sex"], -1),
                "age_approx": -1 if pd.isna(r["age_approx"]) else int(r["age_approx"]),
                "anatom_site_general_challenge": -1 if pd.isna(site) else sites.index(site),
            })
            length = struct.pack("<Q", len(record))
            f.write(length + struct.pack("<I", _masked_crc32c(length)) + record
                    + struct.pack("<I", _masked_crc32c(record)))


def _both_classes(target: np.ndarray, rows: np.ndarray, need: int,
                  rng: np.random.Generator) -> None:
    if len(rows) < 2 * need:
        return
    for value in (1, 0):
        while (target[rows] == value).sum() < need:
            target[rng.choice(rows[target[rows] != value])] = value


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    names = [f"ISIC_{i:07d}" for i in np.sort(rng.choice(10_000_000, n_rows, replace=False))]
    n_patients = max(n_rows // 6, 3)
    patient_ids = [f"IP_{i:07d}" for i in rng.choice(10_000_000, n_patients, replace=False)]
    patient_sex = rng.choice(np.array(["male", "female", None], dtype=object), n_patients,
                             p=[0.515, 0.475, 0.01])
    patient_age = rng.choice(np.arange(20, 90, 5), n_patients).astype(float)
    patient_age[rng.random(n_patients) < 0.01] = np.nan
    patient = rng.integers(0, n_patients, n_rows)
    age = patient_age[patient] + 5 * rng.integers(0, 2, n_rows)
    site_names, site_p = zip(*SITES)
    site = rng.choice(np.array(site_names, dtype=object), n_rows, p=site_p)
    risk = 1 / (1 + np.exp(-(-1.9 + 0.05 * (np.nan_to_num(age, nan=50.0) - 50))))
    target = (rng.random(n_rows) < risk).astype(int)

    # rows -> TFRecord files: a sixteenth each; files 00 and 06 become MLE-bench's test set
    order = rng.permutation(n_rows)
    in_file = {k: np.sort(order[k::len(TFRECORDS)]) for k in range(len(TFRECORDS))}
    test_rows = np.sort(np.concatenate([in_file[k] for k in TEST_FILES]))
    train_rows = np.setdiff1d(np.arange(n_rows), test_rows)
    for half in (test_rows[::2], test_rows[1::2]):  # names are sorted: halves by image_name
        _both_classes(target, half, 1, rng)
    _both_classes(target, test_rows, 1, rng)
    _both_classes(target, train_rows, 3, rng)

    benign, benign_p = zip(*BENIGN)
    diagnosis = np.where(target == 1, "melanoma", rng.choice(benign, n_rows, p=benign_p))
    table = pd.DataFrame({
        "image_name": names, "patient_id": [patient_ids[p] for p in patient],
        "sex": patient_sex[patient], "age_approx": age, "anatom_site_general_challenge": site,
        "diagnosis": diagnosis, "benign_malignant": np.where(target == 1, "malignant", "benign"),
        "target": target})
    table.to_csv(raw / "train.csv", index=False)

    (raw / "train").mkdir(parents=True, exist_ok=True)
    (raw / "jpeg" / "train").mkdir(parents=True, exist_ok=True)
    (raw / "tfrecords").mkdir(parents=True, exist_ok=True)
    jpegs = {}
    for _, row in table.iterrows():
        jpegs[row["image_name"]] = jpeg = _photo(bool(row["target"]), rng)
        (raw / "jpeg" / "train" / f"{row['image_name']}.jpg").write_bytes(jpeg)
        (raw / "train" / f"{row['image_name']}.dcm").write_bytes(_dicom(jpeg, row, rng))
    for k, file_name in enumerate(TFRECORDS):
        _write_tfrecord(raw / "tfrecords" / file_name, table.iloc[in_file[k]], jpegs)
