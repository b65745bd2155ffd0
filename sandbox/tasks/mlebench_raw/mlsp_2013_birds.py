"""mlsp-2013-birds: Kaggle's download holds ``mlsp_contest_dataset.zip`` (and the documentation
pdf), whose folder ``mlsp_contest_dataset/`` has ``essential_data/`` with ``rec_id2filename.txt``
(``rec_id,filename``, the wav's name without ``.wav``), ``CVfolds_2.txt`` (``rec_id,fold``: 322
recordings in fold 0, the training set, 323 in fold 1), ``rec_labels_test_hidden.txt``
(``rec_id,[labels]``: a recording's species ids after its rec_id, nothing after one with none,
``?`` for fold 1), ``species_list.txt`` (``class_id,code,species``, 19 species) and
``src_wavs/*.wav`` (10 s, 16 kHz, 16-bit mono), and ``supplemental_data/`` with one BMP per
recording in ``spectrograms/``, ``filtered_spectrograms/`` and ``supervised_segmentation/`` (and
20 in ``segmentation_examples/``), ``segment_clusters.bmp``, ``segment_mosaic.bmp`` and the text
files ``histogram_of_segments.txt`` (rec_id + 100 bins), ``segment_features.txt`` (rec_id,
segment_id, 38 features) and ``segment_rectangles.txt`` (rec_id, segment_id, min/max x/y).
MLE-bench's preparer keeps fold 0 only and asserts that its random 20% is exactly 64 test
recordings, so fold 0 here always has Kaggle's 322 recordings (258 prepared training recordings
whatever ``n_rows`` is) and fold 1 only 10. Made up here: each recording holds 0-3 of the 19
species (Kaggle's codes and names, some much commoner than others), each sung as a short tone at
a species-specific frequency (600 Hz + 370 Hz per class id, jittered, often faint) over noise and
wind, in 0.064 s wavs; the spectrogram BMPs (4-bit greyscale) are computed from the wavs, and the
segments are the species' calls (and some noise blobs), with features from their time-frequency
boxes.
"""
from __future__ import annotations

import io
import pathlib
import struct
import zipfile

import numpy as np
from scipy.io import wavfile

SPECIES = (
    ("BRCR", "Brown Creeper"), ("PAWR", "Pacific Wren"), ("PSFL", "Pacific-slope Flycatcher"),
    ("RBNU", "Red-breasted Nuthatch"), ("DEJU", "Dark-eyed Junco"),
    ("OSFL", "Olive-sided Flycatcher"), ("HETH", "Hermit Thrush"),
    ("CBCH", "Chestnut-backed Chickadee"), ("VATH", "Varied Thrush"), ("HEWA", "Hermit Warbler"),
    ("SWTH", "Swainson's Thrush"), ("HAFL", "Hammond's Flycatcher"), ("WETA", "Western Tanager"),
    ("BHGB", "Black-headed Grosbeak"), ("GCKI", "Golden Crowned Kinglet"),
    ("WAVI", "Warbling Vireo"), ("MGWA", "MacGillivray's Warbler"), ("STJA", "Stellar's Jay"),
    ("CONI", "Common Nighthawk"),
)
#: Kaggle's fold-0 size; MLE-bench's prepare.py asserts round(0.2 * it) == 64.
N_FOLD0 = 322
N_FOLD1 = 10
RATE = 16_000
SECONDS = 0.064
FRAME, HOP, ROWS = 128, 64, 32          # spectrogram: 64-sample hop, 32 rows of 250 Hz
N_CLUSTERS, N_FEATURES = 100, 38
TOP = "mlsp_contest_dataset"


def _freq(species: int) -> float:
    return 600.0 + 370.0 * species


def _bmp(pixels: np.ndarray) -> bytes:
    """A BMP of ``pixels``: (h, w) uint8 in 0..15 as 4-bit grayscale, or (h, w, 3) uint8 RGB as
    24-bit. Row 0 is the top of the image (BMP stores rows bottom-up)."""
    h, w = pixels.shape[:2]
    if pixels.ndim == 2:
        bits, palette = 4, b"".join(bytes((17 * i, 17 * i, 17 * i, 0)) for i in range(16))
        packed = np.zeros((h, (w + 1) // 2), np.uint8)
        p = np.pad(pixels.astype(np.uint8) & 15, ((0, 0), (0, w % 2)))
        packed[:] = (p[:, 0::2] << 4) | p[:, 1::2]
        rows = packed
    else:
        bits, palette = 24, b""
        rows = pixels[:, :, ::-1].reshape(h, 3 * w).astype(np.uint8)     # BGR
    stride = (rows.shape[1] + 3) // 4 * 4
    rows = np.pad(rows, ((0, 0), (0, stride - rows.shape[1])))[::-1]
    data = rows.tobytes()
    offset = 14 + 40 + len(palette)
    header = struct.pack("<2sIHHI", b"BM", offset + len(data), 0, 0, offset)
    info = struct.pack("<IiiHHIIiiII", 40, w, h, 1, bits, 0, len(data), 2835, 2835,
                       16 if bits == 4 else 0, 0)
    return header + info + palette + data


def _spectrogram(x: np.ndarray) -> np.ndarray:
    """(ROWS, frames) sqrt of the max-normalised STFT magnitude (Hamming), high frequencies on
    top, as Kaggle's spectrograms are made."""
    n = 1 + (len(x) - FRAME) // HOP
    frames = np.stack([x[i * HOP:i * HOP + FRAME] for i in range(n)]) * np.hamming(FRAME)
    mag = np.abs(np.fft.rfft(frames, axis=1))[:, 1:]            # (frames, 64): 125 Hz bins
    mag = mag.reshape(n, ROWS, -1).mean(axis=2).T[::-1]
    return np.sqrt(mag / max(mag.max(), 1e-9))


def write_raw(raw: pathlib.Path, n_rows: int, rng: np.random.Generator) -> None:
    del n_rows   # MLE-bench's preparer fixes the training set at 258 of Kaggle's 322 (above)
    n = N_FOLD0 + N_FOLD1
    fold = np.zeros(n, int)
    fold[rng.choice(n, N_FOLD1, replace=False)] = 1
    prevalence = np.exp(-0.12 * rng.permutation(len(SPECIES)))
    prevalence /= prevalence.sum()
    n_samples = int(RATE * SECONDS)
    t = np.arange(n_samples) / RATE
    files: dict[str, bytes] = {}
    names, labels, lines_hist, lines_feat, lines_rect = [], [], [], [], []
    examples = set(rng.choice(np.flatnonzero(fold == 0), 20, replace=False).tolist())
    for rec_id in range(n):
        name = ""                        # PC<site>_<date>_<time>_<index>, as Kaggle's wavs
        while not name or name in names:
            day = np.datetime64("2009-05-01") + int(rng.integers(0, 420))
            name = (f"PC{int(rng.integers(1, 14))}_{str(day).replace('-', '')}_"
                    f"{int(rng.integers(4, 8)):02d}{int(rng.integers(0, 60)):02d}"
                    f"{int(rng.integers(0, 60)):02d}_{10 * int(rng.integers(0, 60)):04d}")
        names.append(name)
        k = int(rng.choice(4, p=[0.15, 0.5, 0.25, 0.1]))
        species = sorted(rng.choice(len(SPECIES), k, replace=False, p=prevalence).tolist())
        labels.append(species)
        # audio: noise (wind: low-passed, stronger at times) + one short tone per species
        x = rng.normal(0.0, 40.0, n_samples)
        x += np.convolve(rng.normal(0.0, 200.0 * rng.random(), n_samples), np.ones(16) / 4,
                         "same")
        calls = []
        for s in species:
            f = _freq(s) + rng.normal(0.0, 160.0)
            start = rng.uniform(0.0, 0.03)
            dur = rng.uniform(0.02, 0.034)
            env = np.clip(np.minimum(t - start, start + dur - t) / 0.005, 0.0, 1.0)
            amp = np.exp(rng.uniform(np.log(15.0), np.log(600.0)))
            x += amp * env * np.sin(2 * np.pi * f * t + rng.uniform(0, 6))
            calls.append((f, start, dur))
        if rng.random() < 0.3:           # a noise blob the segmenter also picks up
            calls.append((rng.uniform(200.0, 7800.0), rng.uniform(0.0, 0.04), 0.016))
        audio = np.clip(x, -32768, 32767).astype(np.int16)
        buf = io.BytesIO()
        wavfile.write(buf, RATE, audio)
        files[f"essential_data/src_wavs/{name}.wav"] = buf.getvalue()
        # spectrogram images (16 gray levels), the segments drawn as outlines
        spec = _spectrogram(audio.astype(float))
        noise_floor = np.median(spec, axis=1, keepdims=True)
        filtered = np.clip(spec - noise_floor, 0.0, None)
        filtered /= max(filtered.max(), 1e-9)
        gray = np.round(15 * spec).astype(np.uint8)
        files[f"supplemental_data/spectrograms/{name}.bmp"] = _bmp(gray)
        files[f"supplemental_data/filtered_spectrograms/{name}.bmp"] = _bmp(
            np.round(15 * filtered).astype(np.uint8))
        outlined = gray.copy()
        rgb = np.repeat((gray * 17)[:, :, None], 3, axis=2)
        hist = np.zeros(N_CLUSTERS)
        for seg_id, (f, start, dur) in enumerate(calls):
            row = ROWS - 1 - min(int(f // 250), ROWS - 1)
            y0, y1 = max(row - 1, 0), min(row + 1, ROWS - 1)
            x0 = min(int(start * RATE) // HOP, spec.shape[1] - 1)
            x1 = min(int((start + dur) * RATE) // HOP, spec.shape[1] - 1)
            outlined[y0, x0:x1 + 1] = outlined[y1, x0:x1 + 1] = 15
            outlined[y0:y1 + 1, x0] = outlined[y0:y1 + 1, x1] = 15
            rgb[y0:y1 + 1, x0:x1 + 1] = (255, 0, 0)
            lines_rect.append(f"{rec_id},{seg_id},{x0},{x1},{y0},{y1}")
            feats = np.concatenate([[f / 8000.0, dur * 10, start * 10,
                                     float(spec[y0:y1 + 1, x0:x1 + 1].mean())],
                                    rng.normal(0.0, 0.3, N_FEATURES - 4)])
            lines_feat.append(f"{rec_id},{seg_id}," + ",".join(f"{v:.3g}" for v in feats))
            hist[min(int(f / 8000.0 * N_CLUSTERS), N_CLUSTERS - 1)] += 1
        files[f"supplemental_data/supervised_segmentation/{name}.bmp"] = _bmp(outlined)
        if rec_id in examples:
            files[f"supplemental_data/segmentation_examples/{name}.bmp"] = _bmp(rgb)
        hist /= max(hist.sum(), 1.0)
        lines_hist.append(f"{rec_id}," + ",".join(f"{v:.6g}" for v in hist))

    files["essential_data/rec_id2filename.txt"] = (
        "rec_id,filename\n" + "".join(f"{i},{nm}\n" for i, nm in enumerate(names))).encode()
    files["essential_data/CVfolds_2.txt"] = (
        "rec_id,fold\n" + "".join(f"{i},{f}\n" for i, f in enumerate(fold))).encode()
    files["essential_data/rec_labels_test_hidden.txt"] = (
        "rec_id,[labels]\n" + "".join(
            f"{i},?\n" if fold[i] else f"{i}\n" if not lab else
            f"{i}," + ",".join(map(str, lab)) + "\n" for i, lab in enumerate(labels))).encode()
    files["essential_data/species_list.txt"] = (
        "class_id,code,species\n" + "".join(f"{i},{c},{s}\n" for i, (c, s) in
                                            enumerate(SPECIES))).encode()
    files["supplemental_data/histogram_of_segments.txt"] = (
        "rec_id,[histogram of segment features]\n" + "\n".join(lines_hist) + "\n").encode()
    files["supplemental_data/segment_features.txt"] = (
        "rec_id,segment_id,[feature vector]\n" + "\n".join(lines_feat) + "\n").encode()
    files["supplemental_data/segment_rectangles.txt"] = (
        "rec_id,segment_id,min_x,max_x,min_y,max_y,\n" + "\n".join(lines_rect) + "\n").encode()
    files["supplemental_data/segment_clusters.bmp"] = _bmp(
        rng.integers(0, 16, (ROWS, N_CLUSTERS)).astype(np.uint8))
    files["supplemental_data/segment_mosaic.bmp"] = _bmp(
        rng.integers(0, 16, (ROWS, 64)).astype(np.uint8))
    files["README.txt"] = (
        b"MLSP 2013 bird classification challenge (made-up stand-in): essential_data/ holds the "
        b"recordings, folds and labels; supplemental_data/ the spectrograms and segments.\n")
    with zipfile.ZipFile(raw / f"{TOP}.zip", "w", compression=zipfile.ZIP_DEFLATED) as z:
        for path in sorted(files):
            info = zipfile.ZipInfo(f"{TOP}/{path}", date_time=(2013, 6, 1, 0, 0, 0))
            info.external_attr = 0o644 << 16
            z.writestr(info, files[path], compress_type=zipfile.ZIP_DEFLATED)
