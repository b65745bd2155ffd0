"""Where each MLE-bench competition stands on this host, one row per competition.

  # MLE-bench Lite's 22 competitions end to end, on synthetic raw files in Kaggle's layout:
  # MLE-bench's preparer, staged, fetched and loaded as a run's host does, the competition's
  # baseline script run in the sandbox with the run's pool settings, graded by MLE-bench's grader
  python launch/check_mlebench.py --split=lite
  python launch/check_mlebench.py --competitions=random-acts-of-pizza,leaf-classification
  # stage to a bucket, with the pod's pool settings
  python launch/check_mlebench.py --split=lite --dest=gs://$BUCKET/check \\
      --config=configs/ace30b.py
  # every one of MLE-bench's competition configs: its declared files, without raw data
  python launch/check_mlebench.py --split=all

Needs MLE-bench installed (``scripts/install_mlebench.sh``). Prints a table (columns: prepared,
staged, loaded, executed, valid, grader) and ends with one JSON line: ``competitions``,
``prepared``, ``staged``, ``loaded``, ``executed``, ``valid``, ``graded_by_mlebench`` and ``failed``
(id -> the step that failed and why). A failure in one competition never stops the others. Exits
1 when any competition failed.
"""
import json
import logging
import os
import sys
import tempfile

from absl import app, flags
from ml_collections import config_flags

_SPLIT = flags.DEFINE_enum("split", "lite", ["lite", "all"],
                           "lite: MLE-bench Lite end to end; all: every config's declared files.")
_COMPETITIONS = flags.DEFINE_list("competitions", None, "Only these competitions (comma-separated).")
_WORKDIR = flags.DEFINE_string("workdir", "", "Scratch folder (raw/, data/, cache/); empty: a "
                               "temporary folder, removed at the end.")
_DEST = flags.DEFINE_string("dest", "", "Where to stage: gs://bucket/prefix or a folder; empty: "
                            "<workdir>/bucket.")
_N_ROWS = flags.DEFINE_integer("n_rows", 200, "Training-set size of each synthetic competition.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the synthetic data and the dev split.")
_PREPARE_PYTHON = flags.DEFINE_string(
    "prepare_python", "auto", "The interpreter MLE-bench's preparers run in: one with MLE-bench "
    "and tensorflow (siim-isic-melanoma-classification reads TFRecords), built by `bash "
    "scripts/install_mlebench.sh --prepare-venv .mlebench-prepare-venv`; auto: that venv's python "
    "when it exists, else this process; empty: this process.")
_CONFIG = config_flags.DEFINE_config_file(
    "config", "configs/ace30b.py:rehearsal", "The run config whose sandbox section (backend, "
    "interpreter, workers, limits) executes the baselines.")


def prepare_python():
    """--prepare_python resolved: "auto" is .mlebench-prepare-venv/bin/python when there."""
    if _PREPARE_PYTHON.value != "auto":
        return _PREPARE_PYTHON.value or None
    auto = os.path.join(".mlebench-prepare-venv", "bin", "python")
    return auto if os.path.exists(auto) else None


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ace_jax.env import mlebench_check
    from sandbox.tasks import mlebench_raw

    try:
        from mlebench.registry import registry
    except ImportError as e:
        raise SystemExit(f"check_mlebench: MLE-bench is not importable ({e}); install it: "
                         "bash scripts/install_mlebench.sh [PATH to a copy of its repository]")
    known = registry.list_competition_ids()
    pool = mlebench_raw.LITE if _SPLIT.value == "lite" else tuple(sorted(known))
    ids = list(_COMPETITIONS.value or pool)
    unknown = [c for c in ids if c not in pool]
    if unknown:
        raise app.UsageError(f"not in --split={_SPLIT.value}: {unknown}")

    def progress(row):
        status = "ok" if not row.failed else row.failed[:160]
        print(f"[{len(done) + 1}/{len(ids)}] {row.competition}: {status} ({row.seconds:.1f} s)",
              file=sys.stderr, flush=True)
        done.append(row)

    done: list = []
    if _SPLIT.value == "all":
        rows = mlebench_check.check_declared(ids, progress=progress)
    else:
        with tempfile.TemporaryDirectory(prefix="check-mlebench-") as tmp:
            rows = mlebench_check.check_end_to_end(
                ids, workdir=_WORKDIR.value or tmp, dest=_DEST.value,
                sandbox=_CONFIG.value.sandbox, n_rows=_N_ROWS.value, seed=_SEED.value,
                prepare_python=prepare_python(), progress=progress)
    print(mlebench_check.table(rows), flush=True)
    out = mlebench_check.summary(rows)
    print(json.dumps(out, sort_keys=True), flush=True)
    sys.exit(1 if out["failed"] else 0)


if __name__ == "__main__":
    app.run(main)
