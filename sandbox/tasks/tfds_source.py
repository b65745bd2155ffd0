"""Image-classification tasks from TensorFlow Datasets, read with ``tfds.data_source`` (no TensorFlow).

``tfds.data_source(name, split=..., data_dir=...)`` gives random access to a prepared
array_record dataset; it needs the dataset already on disk (prepared once with ``tfds build`` or
copied from a bucket), never a download at run time (``download=False``).

Format choice: each image becomes one CSV row of integer pixel columns ``p_<row>_<col>_<channel>``
(row-major (height, width, channel) order, so the names carry the image shape), plus the label. CSV keeps
the task in exactly the offline suite's layout (the same prepare, grader and seed-script shape), and
is fine for the small images this is meant for (28x28x1 = 784 columns; 32x32x3 = 3072 columns).
The image shape is stated in the description so agents can reshape. Larger images would want .npy
files instead; this source refuses more than ``max_pixels`` values per image rather than writing
huge CSVs.

Usage::

    spec = tfds_image_task("mnist-tfds", "mnist", split="train", num_examples=2000)
    task = spec.prepare("cache/tasks/seed0/mnist-tfds", seed=0)
    registry.register(spec)   # optional: make it loadable by id

Tested offline with ``tfds.testing.mock_data(policy=MockPolicy.USE_CODE)``, which works without
TensorFlow installed (it fakes examples from the builder's feature spec).
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import pandas as pd

from sandbox.tasks.offline_data import DATA_SEED, RawTable
from sandbox.tasks.offline_suite import OfflineTaskSpec


def _label_names(ds, label_key: str) -> Optional[list[str]]:
    info = getattr(ds, "dataset_info", None)
    try:
        names = info.features[label_key].names
    except (AttributeError, KeyError, TypeError):
        return None
    return [str(n) for n in names] if names else None


def load_tfds_images(name: str, split: str = "train", num_examples: int = 2000, *,
                     data_dir: Optional[str] = None, image_key: str = "image",
                     label_key: str = "label", max_pixels: int = 4096,
                     sample_seed: int = DATA_SEED) -> RawTable:
    """Reads ``num_examples`` examples (a seeded sample) as a RawTable of pixel columns.

    Returns:
      RawTable with features [N, H*W*C] integer pixels and a one-column ``label`` target (class
      names when the dataset has them, else the integer label as a string).
    Raises:
      ValueError: an image is larger than ``max_pixels`` values, or shapes differ between images.
      KeyError: ``image_key``/``label_key`` is not a feature of the dataset.
    """
    import tensorflow_datasets as tfds

    if num_examples <= 0:
        raise ValueError(f"num_examples must be positive, got {num_examples}")
    ds = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    n = len(ds)
    take = np.sort(np.random.default_rng(sample_seed).choice(n, size=min(num_examples, n),
                                                               replace=False))
    names = _label_names(ds, label_key)
    rows, labels, shape = [], [], None
    for i in take:
        ex = ds[int(i)]
        for key in (image_key, label_key):
            if key not in ex:
                raise KeyError(f"tfds {name!r} has no feature {key!r}; features: {sorted(ex)}")
        img = np.asarray(ex[image_key])
        if shape is None:
            shape = img.shape
            if img.size > max_pixels:
                raise ValueError(f"tfds {name!r}: images of shape {shape} have {img.size} values "
                                 f"(> max_pixels={max_pixels}); CSV pixels are for small images")
        elif img.shape != shape:
            raise ValueError(f"tfds {name!r}: image shapes differ ({shape} vs {img.shape})")
        rows.append(img.reshape(-1).astype(np.int64))
        lab = int(np.asarray(ex[label_key]))
        labels.append(names[lab] if names else str(lab))
    X = pd.DataFrame(np.stack(rows), columns=pixel_columns(shape))
    return RawTable(X, pd.DataFrame({"label": labels}))


def pixel_columns(shape: tuple[int, ...]) -> list[str]:
    """Self-describing pixel column names ``p_<row>_<col>_<channel>``, row-major (H, W, C) order."""
    h, w, c = (tuple(shape) + (1,))[:3] if len(shape) == 2 else tuple(shape)
    return [f"p_{i}_{j}_{k}" for i in range(h) for j in range(w) for k in range(c)]


def tfds_image_task(task_id: str, name: str, split: str = "train", num_examples: int = 2000, *,
                    data_dir: Optional[str] = None, metric: str = "accuracy",
                    image_key: str = "image", label_key: str = "label",
                    time_limit_s: float = 180.0, memory_limit_mb: int = 4096) -> OfflineTaskSpec:
    """An OfflineTaskSpec over a tfds image dataset (prepare it with ``spec.prepare(dir, seed)``).

    ``metric``: "accuracy" or "macro_f1" (label submissions) or "log_loss" (class probabilities).
    The tfds data dir is added to the task's hidden paths.
    """
    if metric not in ("accuracy", "macro_f1", "log_loss"):
        raise ValueError(f"tfds image tasks support accuracy, macro_f1 or log_loss, got {metric!r}")

    def load() -> RawTable:
        return load_tfds_images(name, split, num_examples, data_dir=data_dir,
                                image_key=image_key, label_key=label_key)

    hidden = []
    root = data_dir or os.environ.get("TFDS_DATA_DIR") or os.path.expanduser("~/tensorflow_datasets")
    if root and not str(root).startswith("gs://"):
        hidden.append(os.path.abspath(root))
    return OfflineTaskSpec(
        task_id=task_id, title=f"Image classification ({name})",
        overview=f"Classify small images into their classes ({num_examples} examples of the "
                 f"`{name}` dataset, split `{split}`).",
        columns_note="Features: `p_<row>_<col>_<channel>`, the integer pixel values of one image "
                     "in row-major (height, width, channel) order, so `values.reshape(H, W, C)` "
                     "restores it (H, W, C = 1 + the largest row, col, channel index). "
                     "Target: `label`.",
        metric=metric, load=load, source=f"tfds.data_source({name!r}, split={split!r})",
        time_limit_s=time_limit_s, memory_limit_mb=memory_limit_mb,
        extra_hidden_paths=tuple(hidden))
