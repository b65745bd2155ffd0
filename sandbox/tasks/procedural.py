"""A procedural MLE task family: hundreds of tiny, deterministic tabular tasks with varied schemas.

An instance is a (generator kind, index) pair, registered as ``proc-<kind>-<index:03d>`` (e.g.
``proc-linear-007``). Everything about it is a pure function of that pair (numpy ``Generator``s
seeded with ``[kind code, index, stream]``): the schema (theme, column names and their case
style, column types, id column name and id style, target name and type, labels, metric, row
count, missing values, noise; ``procedural_schema``), the data (``procedural_data``), and the
description's wording (``procedural_description``). ``prepare(out_dir, seed)`` writes MLE-bench's
layout exactly as the offline suite does (same ``Task`` record, same grader, same metric
registry, the same trivial sample submission); the prepare ``seed`` (the run's ``tasks.seed``, 0
for the committed leaderboards) only moves the train / test / dev split and the id values, as it
does for the offline suite.

Generator kinds (``procedural_schema.KINDS``; their rows: ``procedural_data``), each drawing
binary, multiclass or regression targets:

  * ``linear``:   a linear / logistic model with pairwise interactions and categorical effects;
  * ``rules``:    tree-like threshold rules (a random full binary tree of depth 2-4), label noise;
  * ``clusters``: Gaussian clusters per class (multiclass, sometimes binary), label noise;
  * ``counts``:   overdispersed counts (Poisson-Gamma) with heavy noise, regression metrics;
  * ``tokens``:   a text-like column of synthetic tokens with class-dependent frequencies
    (classification), plus a few numeric columns. **Held out as a family** (``HELDOUT_KINDS``).

Splits (``instance_split``, ``split_ids``):

  * ``heldout_family``: every instance of a kind in ``HELDOUT_KINDS``;
  * ``heldout``: an instance of a training kind whose id hashes (sha256 of the id, first 8 hex
    digits / 2**32) below ``HELDOUT_FRACTION``. The rule depends on the id alone, so adding
    instances never moves an existing one between splits;
  * ``train``: the rest. Only these have seed scripts (``sandbox.seed_corpus.list_scripts``), so
    the SFT corpus is built from training instances only.

Every instance has baseline scripts (``sandbox.seed_corpus.procedural.baseline_scripts``) that
``python -m sandbox.procedural_sweep`` runs through the sandbox pool; its one compact output,
``sandbox/seed_corpus/results/seed0/procedural.csv``, holds every instance's reference
leaderboard (``reference_leaderboard``) and a digest of the prepared files
(``prepared_digest``) the scores were measured on.

Rows: 60 to 3000 (at least 120 for binary and 200 for multiclass targets, so that both test
halves hold every class); an execution of a baseline takes well under a second once the
libraries are imported.

This module is the family itself: ids and splits, the builder and the writer of an instance's
files (``prepare_instance``), the reference leaderboards, and the registration.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import pathlib
from typing import Optional

import numpy as np
import pandas as pd

from sandbox.tasks import (
    base,
    procedural_data,
    procedural_description,
    procedural_schema,
    registry,
)
from sandbox.tasks.offline_suite import (
    _split,
    _submission_layout,
    _to_csv,
    _trivial_prediction,
)
from sandbox.tasks.procedural_data import generate_table
from sandbox.tasks.procedural_description import describe
from sandbox.tasks.procedural_schema import (
    KIND_CODE,
    KINDS,
    InstanceSpec,
    make_spec,
    make_task_id,
    parse_task_id,
)

FAMILY = "procedural"
HELDOUT_KINDS = ("tokens",)
TRAIN_KINDS = tuple(k for k in KINDS if k not in HELDOUT_KINDS)
INSTANCES_PER_KIND = 48
HELDOUT_FRACTION = 0.2
SPLITS = ("train", "heldout", "heldout_family")

RESULTS_FILE = registry.RESULTS_DIR / "seed{seed}" / "procedural.csv"
TIME_LIMIT_S = 30.0
MEMORY_LIMIT_MB = 1024

# Every module of the generator: any of them could regenerate the answers.
GENERATOR_SOURCES = tuple(
    str(pathlib.Path(f).resolve())
    for f in (__file__, procedural_schema.__file__, procedural_data.__file__,
              procedural_description.__file__))


# ------------------------------------------------------------------------------------------------
# Ids and splits
# ------------------------------------------------------------------------------------------------

def is_procedural(task_id: str) -> bool:
    """Whether ``task_id`` names a procedural instance (registered or not)."""
    try:
        parse_task_id(task_id)
        return True
    except ValueError:
        return False


def all_ids() -> list[str]:
    """Every registered instance id, sorted."""
    return sorted(make_task_id(k, i) for k in KINDS for i in range(INSTANCES_PER_KIND))


def instance_split(task_id: str) -> str:
    """"train", "heldout" (an instance of a training kind held out by its id's hash) or
    "heldout_family" (an instance of a held-out kind)."""
    kind, _ = parse_task_id(task_id)
    if kind in HELDOUT_KINDS:
        return "heldout_family"
    h = int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16) / 2**32
    return "heldout" if h < HELDOUT_FRACTION else "train"


def split_ids(split: str) -> list[str]:
    """The sorted registered ids of ``split`` (one of ``SPLITS``, or "all")."""
    if split == "all":
        return all_ids()
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS} or 'all', got {split!r}")
    return [t for t in all_ids() if instance_split(t) == split]


def is_training_instance(task_id: str) -> bool:
    """True for a procedural id of the "train" split."""
    return is_procedural(task_id) and instance_split(task_id) == "train"


# ------------------------------------------------------------------------------------------------
# The builder and the writer of an instance's files
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProceduralTaskBuilder:
    """The registry's builder of one instance (``task_id``, ``prepare``, ``hidden_paths``,
    ``reference_leaderboard``, ``family``)."""

    kind: str
    index: int
    family: str = FAMILY

    @property
    def task_id(self) -> str:
        return make_task_id(self.kind, self.index)

    @property
    def spec(self) -> InstanceSpec:
        return make_spec(self.kind, self.index)

    @property
    def metric(self) -> str:
        return self.spec.metric

    @property
    def split(self) -> str:
        return instance_split(self.task_id)

    def hidden_paths(self) -> tuple[str, ...]:
        """The generator's source, every module of it (it could regenerate the answers)."""
        return GENERATOR_SOURCES

    def reference_leaderboard(self, seed: int = 0) -> tuple[list[float], str]:
        return reference_leaderboard(self.task_id, seed)

    def prepare(self, out_dir: "os.PathLike | str", seed: int = 0) -> base.Task:
        return prepare_instance(self.spec, pathlib.Path(out_dir), seed)


def prepare_instance(spec: InstanceSpec, out_dir: pathlib.Path, seed: int) -> base.Task:
    """Writes one instance in MLE-bench's layout (as ``offline_suite.prepare_table``); returns
    the Task. Same (instance, seed) -> byte-identical files."""
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    feats, target = generate_table(spec)
    n = len(feats)
    target_cols, labels, to_answers = _submission_layout(spec, target)
    kind = spec.metric_info.kind
    strata = target.iloc[:, 0].astype(str).to_numpy() if spec.target_type != "regression" else None
    rng = np.random.default_rng([KIND_CODE[spec.kind], spec.index, 3, int(seed)])
    idx = np.arange(n)
    train_idx, test_idx = _split(rng, idx, spec.train_fraction, strata)
    dev_idx, _ = _split(rng, test_idx, 0.5, strata)
    ids = _make_ids(spec, rng, n)
    train_idx, test_idx = rng.permutation(train_idx), rng.permutation(test_idx)

    out_dir = pathlib.Path(out_dir)
    pub, priv = out_dir / "public", out_dir / "private"
    pub.mkdir(parents=True, exist_ok=True)
    priv.mkdir(parents=True, exist_ok=True)
    idc = spec.id_column
    train = pd.concat([pd.DataFrame({idc: ids[train_idx]}),
                       feats.iloc[train_idx].reset_index(drop=True),
                       target.iloc[train_idx].reset_index(drop=True)], axis=1)
    test = pd.concat([pd.DataFrame({idc: ids[test_idx]}),
                      feats.iloc[test_idx].reset_index(drop=True)], axis=1)
    _to_csv(train, pub / "train.csv")
    _to_csv(test, pub / "test.csv")
    answers_all = to_answers(target)
    answers_all.insert(0, idc, ids)
    dev_set = set(dev_idx.tolist())
    for name, part in (("dev", [i for i in test_idx if i in dev_set]),
                       ("test", [i for i in test_idx if i not in dev_set])):
        _to_csv(answers_all.iloc[part].reset_index(drop=True), priv / base.ANSWER_FILES[name])
    sample = _trivial_prediction(spec, to_answers(target.iloc[train_idx]), len(test_idx),
                                 target_cols)
    sample.insert(0, idc, ids[test_idx])
    _to_csv(sample, pub / "sample_submission.csv")
    description = describe(spec, len(train_idx), len(test_idx), target_cols)
    (pub / "description.md").write_text(description)

    task = base.Task(
        task_id=spec.task_id, description=description, public_dir=pub.resolve(),
        private_dir=priv.resolve(), metric=spec.metric,
        lower_is_better=spec.metric_info.lower_is_better, id_column=idc,
        target_columns=target_cols, labels=labels if kind == "label" else None,
        time_limit_s=TIME_LIMIT_S, memory_limit_mb=MEMORY_LIMIT_MB,
        hidden_paths=ProceduralTaskBuilder(spec.kind, spec.index).hidden_paths(), seed=int(seed),
        source=f"SYNTHETIC: procedural generator {spec.kind!r}, instance {spec.index} "
               f"(sandbox/tasks/procedural.py), split {instance_split(spec.task_id)}")
    task.baseline_score = task.grade(pub / "sample_submission.csv", "dev")
    base.write_task_json(task, out_dir)
    return task


def _make_ids(spec: InstanceSpec, rng, n: int) -> np.ndarray:
    if spec.id_style == "int":
        return np.array([str(v) for v in rng.choice(np.arange(100_000, 1_000_000), size=n,
                                                    replace=False)], dtype=object)
    if spec.id_style == "prefixed":
        pre = spec.entity[:3].upper()
        return np.array([f"{pre}-{v}" for v in rng.choice(np.arange(10_000, 100_000), size=n,
                                                           replace=False)], dtype=object)
    seen: list[str] = []
    got: set[str] = set()
    while len(seen) < n:
        for v in rng.integers(0, 2**32, size=n - len(seen), dtype=np.uint64):
            s = f"{int(v):08x}"
            if s not in got and not s.isdigit():   # all-digit hex would read back as a number
                got.add(s)
                seen.append(s)
    return np.array(seen[:n], dtype=object)


# ------------------------------------------------------------------------------------------------
# Reference leaderboards (the compact sweep file)
# ------------------------------------------------------------------------------------------------

RESULT_COLUMNS = ("task_id", "team", "status", "score", "dev_score", "wall_s", "digest")


@functools.lru_cache(maxsize=8)
def _results(seed: int) -> Optional[pd.DataFrame]:
    path = pathlib.Path(str(RESULTS_FILE).format(seed=seed))
    if not path.exists():
        return None
    return pd.read_csv(path, dtype={"task_id": str, "team": str, "status": str, "digest": str})


def sweep_results(seed: int = 0) -> Optional[pd.DataFrame]:
    """The committed sweep of ``seed`` (one row per instance and baseline script; columns
    ``RESULT_COLUMNS``), or None when there is none."""
    df = _results(seed)
    return None if df is None else df.copy()


def reference_leaderboard(task_id: str, seed: int = 0) -> tuple[list[float], str]:
    """(final-test scores of the valid baseline runs, source note) from the compact sweep file,
    or ([], "") without one."""
    df = _results(seed)
    if df is None:
        return [], ""
    rows = df[(df["task_id"] == task_id) & (df["status"] == "ok")]
    scores = [float(s) for s in rows["score"].dropna()]
    if not scores:
        return [], ""
    return scores, (f"our own baseline sweep (python -m sandbox.procedural_sweep, seed {seed}, "
                    "final-test scores); not human teams")


def prepared_digest(task_dir: "os.PathLike | str") -> str:
    """sha256 over the sorted (path, sha256) pairs of a prepared task's files (checksums.json
    excluded): one string that names the exact files a leaderboard was measured on."""
    from sandbox.prepare import file_checksums

    sums = file_checksums(pathlib.Path(task_dir))
    return hashlib.sha256("\n".join(f"{k} {v}" for k, v in sums.items()).encode()).hexdigest()


# ------------------------------------------------------------------------------------------------
# Registration
# ------------------------------------------------------------------------------------------------

BUILDERS: tuple[ProceduralTaskBuilder, ...] = tuple(
    ProceduralTaskBuilder(k, i) for k in KINDS for i in range(INSTANCES_PER_KIND))

for _b in BUILDERS:
    registry.register(_b)
