"""Stage prepared MLE-bench competitions into a bucket (or a folder) for the hosts of a run.

  # Kaggle's files already prepared by `mlebench prepare --data-dir mlebench-data`:
  python launch/stage_mlebench.py --data_dir=mlebench-data \\
      --competitions=spooky-author-identification,random-acts-of-pizza \\
      --dest=gs://$BUCKET/mlebench/mlebench-data

  # MLE-bench's own preparer on raw files in --raw_dir/<id>/ (Kaggle's download), then stage:
  python launch/stage_mlebench.py --raw_dir=mlebench-raw --prepare --data_dir=mlebench-data \\
      --competitions=spooky-author-identification --dest=gs://$BUCKET/mlebench/mlebench-data

  # a rehearsal without Kaggle: synthetic raw files (in Kaggle's layout), MLE-bench's prepare, stage
  python launch/stage_mlebench.py --raw_dir=/tmp/raw --synthetic_rows=400 --prepare \\
      --data_dir=/tmp/mlebench-data \\
      --competitions=spooky-author-identification,tabular-playground-series-dec-2021 \\
      --dest=gs://$BUCKET/mlebench/mlebench-data

Per competition ``<dest>/<id>/`` gets ``prepared/public``, ``prepared/private``, MLE-bench's
``config.yaml``, ``description.md``, ``leaderboard.csv`` (unless a Git LFS pointer: a warning says
what to run) and grader ``*.py``, then ``STAGED.json`` (``ace_jax/env/mlebench_data.py``). Runs
then name the competitions: ``--config.tasks.data_dir=<dest> --config.tasks.ids=(...)``.
``--prepare`` and staging need the ``mlebench`` package (``mlebench_data.MLEBENCH_INSTALL``).
Prints one JSON line: ``{"prepared": ..., "staged": ...}`` (``staged`` is
``mlebench_data.stage``'s summary; sizes in bytes).
"""
import json
import logging

from absl import app, flags

_DATA_DIR = flags.DEFINE_string("data_dir", None, "MLE-bench's data folder: <id>/prepared/"
                                "{public,private} (written there with --prepare).")
_COMPETITIONS = flags.DEFINE_list("competitions", None, "Comma-separated MLE-bench competition "
                                  "ids to (prepare and) stage.")
_DEST = flags.DEFINE_string("dest", "", "Where to stage: gs://bucket/prefix or a local folder; "
                            "empty: prepare only (needs --prepare).")
_RAW_DIR = flags.DEFINE_string("raw_dir", "", "Raw files per competition in <raw_dir>/<id>/ "
                               "(Kaggle's download, extracted or as <id>.zip); for --prepare.")
_PREPARE = flags.DEFINE_bool("prepare", False, "Run MLE-bench's own preparer on --raw_dir first.")
_SYNTHETIC = flags.DEFINE_integer("synthetic_rows", 0, "When > 0: first write synthetic raw files "
                                  "of this many training rows into <raw_dir>/<id>/ (only for "
                                  "mlebench_data.SYNTHETIC_COMPETITIONS).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the synthetic raw rows.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Prepare again even if already prepared.")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from ace_jax.env import mlebench_data

    ids = [c.strip() for c in _COMPETITIONS.value if c.strip()]
    if not ids:
        raise app.UsageError("--competitions names no competition")
    if (_PREPARE.value or _SYNTHETIC.value > 0) and not _RAW_DIR.value:
        raise app.UsageError("--prepare and --synthetic_rows need --raw_dir")
    if not _DEST.value and not _PREPARE.value:
        raise app.UsageError("nothing to do: give --dest (stage) and/or --prepare")
    prepared = None
    try:
        if _SYNTHETIC.value > 0:
            for cid in ids:
                mlebench_data.write_synthetic_raw(cid, f"{_RAW_DIR.value}/{cid}",
                                                  n_rows=_SYNTHETIC.value, seed=_SEED.value)
        if _PREPARE.value:
            prepared = mlebench_data.prepare_from_raw(ids, _RAW_DIR.value, _DATA_DIR.value,
                                                      overwrite=_OVERWRITE.value)
            prepared = {"data_dir": prepared["data_dir"], "mlebench": prepared["mlebench"],
                        "competitions": {c: {k: r[k] for k in ("preparer", "checksums",
                                                               "already_prepared")}
                                         for c, r in prepared["competitions"].items()}}
        staged = mlebench_data.stage(_DATA_DIR.value, ids, _DEST.value) if _DEST.value else None
    except (mlebench_data.MLEBenchNotInstalledError, mlebench_data.PrepareError,
            mlebench_data.StageError, ValueError) as e:
        raise SystemExit(f"stage_mlebench: {e}") from None
    print(json.dumps({"prepared": prepared, "staged": staged}, sort_keys=True), flush=True)


if __name__ == "__main__":
    flags.mark_flags_as_required(["data_dir", "competitions"])
    app.run(main)
