"""MLE-bench's own competitions across their breadth, with MLE-bench's own files.

* Every one of MLE-bench's competition configs: a prepared folder built from the file names its
  ``config.yaml`` declares loads, and its grader imports (``check_declared``).
* MLE-bench Lite end to end (``check_end_to_end``): synthetic raw files in Kaggle's layout,
  MLE-bench's preparer, staged to the GCS emulator, fetched and loaded as a host does, the
  competition's baseline script run in the bwrap sandbox with the rehearsal's pool settings and
  graded by MLE-bench's grader, the sample submission graded too. CI runs a subset that rotates
  with the commit (``ACE_MLEBENCH_LITE=all`` or ``=a,b`` picks others);
  ``python launch/check_mlebench.py --split=lite`` runs all 22.

No config.yaml here is written by hand. Under ``CI=true`` a missing MLE-bench fails the module.
"""
import hashlib
import importlib
import importlib.util
import os
import pathlib
import subprocess

import pytest

from ace_jax.env import mlebench_check
from sandbox.tasks import mlebench as mlebench_task
from sandbox.tasks import mlebench_raw

REPO = pathlib.Path(__file__).resolve().parents[3]
PREPARE_PYTHON = REPO / ".mlebench-prepare-venv" / "bin" / "python"
LOW_TXT = REPO.parent / "shared" / "third_party" / "mle-bench" / "experiments" / "splits" / "low.txt"

try:
    from mlebench.registry import registry
except ImportError as e:
    if os.environ.get("CI") == "true":
        raise RuntimeError(f"CI=true and MLE-bench is not importable ({e}): .ci/run installs it "
                           "with scripts/install_mlebench.sh") from e
    pytest.skip("MLE-bench is not installed (bash scripts/install_mlebench.sh PATH)",
                allow_module_level=True)


def _rotation() -> list[str]:
    """Lite competitions for this run: random-acts-of-pizza (the runbook's example) and 4 more,
    a window of LITE that moves with the checked-out commit (every competition comes round in
    6 commits); ``ACE_MLEBENCH_LITE`` = ``all`` or a comma-separated list overrides it."""
    chosen = os.environ.get("ACE_MLEBENCH_LITE", "")
    if chosen == "all":
        return list(mlebench_raw.LITE)
    if chosen:
        return chosen.split(",")
    try:
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except OSError:
        head = ""
    start = int(hashlib.sha256(head.encode()).hexdigest()[:8], 16) % len(mlebench_raw.LITE)
    window = [mlebench_raw.LITE[(start + k) % len(mlebench_raw.LITE)] for k in range(4)]
    return list(dict.fromkeys(["random-acts-of-pizza", *window]))


def test_lite_is_mlebench_s_own_split():
    if LOW_TXT.is_file():
        assert list(mlebench_raw.LITE) == LOW_TXT.read_text().split()
    else:
        assert list(mlebench_raw.LITE) == registry.get_lite_competition_ids()


def test_every_lite_competition_has_raw_files_and_a_baseline():
    for cid in mlebench_raw.LITE:
        assert callable(importlib.import_module(mlebench_raw.module_name(cid)).write_raw), cid
        assert mlebench_raw.baseline_scripts(cid), cid
    with pytest.raises(ValueError, match="only MLE-bench Lite's 22"):
        mlebench_raw.write_synthetic_raw("spaceship-titanic", "/nonexistent")


def test_every_config_loads_from_its_declared_file_names():
    ids = registry.list_competition_ids()
    rows = mlebench_check.check_declared(ids)
    out = mlebench_check.summary(rows)
    assert out["competitions"] == len(ids) == 82
    assert out["failed"] == {}
    assert out["loaded"] == 82
    # every grader of MLE-bench imports on this host (none fell back to ours)
    assert {r.grader for r in rows} == {"mlebench"}
    for r in rows:   # the direction of every grader is known without its leaderboard
        cfg = mlebench_task.read_config(registry.get_competitions_dir() / r.competition / "config.yaml")
        assert cfg["grader"]["name"] in mlebench_task.GRADER_LOWER_IS_BETTER, r.competition


def test_a_missing_declared_file_names_the_declared_path(tmp_path):
    """random-acts-of-pizza declares ``sampleSubmission.csv`` (the file the loader used to
    guess as sample_submission.csv)."""
    cid = "random-acts-of-pizza"
    comp = registry.get_competitions_dir() / cid
    cfg = mlebench_task.read_config(comp / "config.yaml")
    files = mlebench_task.declared_files(cid, cfg, tmp_path)
    assert files["sample_submission"].name == "sampleSubmission.csv"
    files["answers"].parent.mkdir(parents=True)
    files["answers"].write_text("request_id,requester_received_pizza\nt3_a,1\n")
    with pytest.raises(mlebench_task.DeclaredFileError,
                       match=r"missing .*/prepared/public/sampleSubmission.csv \(config.yaml's "
                             r"dataset.sample_submission"):
        mlebench_task.load_mlebench_task(cid, tmp_path, comp)


def test_a_declared_path_outside_the_competition_is_refused(tmp_path):
    cfg = {"dataset": {"answers": "other/prepared/private/test.csv",
                       "sample_submission": "x/prepared/public/s.csv"}}
    with pytest.raises(ValueError, match="outside the competition's folder x/"):
        mlebench_task.declared_files("x", cfg, tmp_path)


@pytest.fixture(scope="module")
def gs_dest(gcs_emulator):
    import fsspec

    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    mp.setitem(fsspec.config.conf, "gs", {"token": "anon", "skip_instance_cache": True})
    yield "gs://" + gcs_emulator.prefix() + "/lite"
    mp.undo()


@pytest.fixture(scope="module")
def rehearsal_sandbox():
    """The rehearsal's pool settings (bwrap, the Kaggle stack's interpreter, its limits)."""
    spec = importlib.util.spec_from_file_location("ace30b", REPO / "configs" / "ace30b.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sandbox = module.get_config("rehearsal").sandbox
    sandbox.python = str(REPO / ".sandbox-venv" / "bin" / "python")
    if not os.path.exists(sandbox.python):
        pytest.fail(f"no sandbox interpreter at {sandbox.python}: "
                    "bash scripts/build_sandbox_env.sh .sandbox-venv")
    return sandbox


@pytest.mark.slow
@pytest.mark.parametrize("cid", _rotation())
def test_a_lite_competition_end_to_end(cid, tmp_path, gs_dest, rehearsal_sandbox):
    """MLE-bench's preparers run in the preparers' venv (with tensorflow, which siim's needs and
    the trainer's venv leaves out), as launch/check_mlebench.py runs them."""
    if not PREPARE_PYTHON.exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and no {PREPARE_PYTHON}: the README's test command builds it "
                        "(scripts/install_mlebench.sh --prepare-venv .mlebench-prepare-venv)")
        pytest.skip(f"no preparers' venv {PREPARE_PYTHON}")
    [row] = mlebench_check.check_end_to_end([cid], workdir=tmp_path, dest=gs_dest,
                                            sandbox=rehearsal_sandbox, n_rows=200, seed=0,
                                            prepare_python=str(PREPARE_PYTHON))
    assert row.failed == "", row.failed
    assert row.prepared and row.staged and row.loaded and row.executed and row.valid
    assert row.graded_by_mlebench and row.grader == "mlebench:staged"
    assert row.status == "ok"
    assert row.sample_score is not None and row.baseline_score is not None


def test_the_lite_baselines_are_seed_scripts():
    from sandbox import seed_corpus

    for cid in mlebench_raw.LITE:
        scripts = seed_corpus.list_scripts(cid)
        assert [s.name for s in scripts] == [p.name for p in mlebench_raw.baseline_scripts(cid)]
        assert all("./submission/submission.csv" in s.code for s in scripts), cid
    assert "random-acts-of-pizza" not in seed_corpus.task_ids()   # not the offline suite
