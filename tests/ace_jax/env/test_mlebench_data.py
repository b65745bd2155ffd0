"""MLE-bench data as its users have it: MLE-bench's own prepare code on raw files in Kaggle's
layout, staged to a bucket (the GCS emulator), fetched by a host per named competition, loaded
with MLE-bench installed and without it.

No config.yaml here is written by hand: it, description.md, the grader and the preparer are
MLE-bench's own (the installed ``mlebench`` package); only the raw rows are synthetic
(``mlebench_data.write_synthetic_raw``). The tests that need MLE-bench's code skip without it
(``mlebench_data.MLEBENCH_INSTALL`` says how to install it).
"""
import hashlib
import importlib.util
import inspect
import json
import logging
import os
import pathlib
import subprocess
import sys
import zipfile

import numpy as np
import pandas as pd
import pytest

from ace_jax.env import mlebench_data
from ace_jax.env import tasks as tasks_lib
from ace_jax.runtime import storage
from sandbox.tasks import mlebench as mlebench_task

REPO = pathlib.Path(__file__).resolve().parents[3]
SPOOKY = "spooky-author-identification"
COVER = "tabular-playground-series-dec-2021"
IDS = [SPOOKY, COVER]

def _mlebench_importable() -> bool:
    """True when MLE-bench's registry imports (an editable install whose checkout is gone still
    has a spec, so importing is the test)."""
    try:
        import mlebench.registry  # noqa: F401
    except ImportError:
        return False
    return True


if os.environ.get("CI") == "true" and not _mlebench_importable():
    raise RuntimeError("CI=true and MLE-bench is not importable: .ci/run installs it with "
                       "scripts/install_mlebench.sh")
needs_mlebench = pytest.mark.skipif(
    not _mlebench_importable(),
    reason="mlebench is not installed (MLE-bench's own prepare code and graders are needed); "
           f"install: {mlebench_data.MLEBENCH_INSTALL}")


def _mlebench_competition_dir(cid: str) -> pathlib.Path:
    """The installed mlebench package's folder of ``cid`` (its config.yaml, grader, ...)."""
    spec = importlib.util.find_spec("mlebench")
    return pathlib.Path(list(spec.submodule_search_locations)[0]) / "competitions" / cid


def _lfs_pointer(cid: str) -> bool:
    """True when the installed mlebench holds a Git LFS pointer as ``cid``'s leaderboard."""
    return mlebench_task.is_git_lfs_pointer(_mlebench_competition_dir(cid) / "leaderboard.csv")


def _sha256(path) -> str:
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


# ------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """MLE-bench's data folder: synthetic raw files -> MLE-bench's own preparers."""
    if not _mlebench_importable():
        pytest.skip(f"mlebench is not installed; install: {mlebench_data.MLEBENCH_INSTALL}")
    root = tmp_path_factory.mktemp("mlebench")
    for cid in IDS:
        mlebench_data.write_synthetic_raw(cid, root / "raw" / cid, n_rows=300, seed=1)
    summary = mlebench_data.prepare_from_raw(IDS, root / "raw", root / "data")
    assert set(summary["competitions"]) == set(IDS)
    return root / "data"


@pytest.fixture(scope="module")
def bucket(prepared, gcs_emulator):
    """The prepared competitions staged to ``gs://.../mlebench`` in the GCS emulator, plus a
    decoy ``raw/`` folder (as ``gcloud storage cp -r`` of MLE-bench's data folder leaves) that
    no host may fetch. Yields (url, stage summary)."""
    import fsspec

    mp = pytest.MonkeyPatch()
    mp.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    mp.setitem(fsspec.config.conf, "gs", {"token": "anon", "skip_instance_cache": True})
    url = "gs://" + gcs_emulator.prefix() + "/mlebench"
    summary = mlebench_data.stage(prepared, IDS, url)
    storage.write_text(storage.join(url, SPOOKY, "raw", "train.csv"), "id,text,author\n")
    yield url, summary
    mp.undo()


def _perfect(task) -> pd.DataFrame:
    """A submission equal to the private answers (in the sample submission's columns)."""
    answers = pd.read_csv(task.answers_file, dtype={task.id_column: str})
    return answers[[task.id_column, *task.target_columns]]


def _imperfect(task, seed=0) -> pd.DataFrame:
    """A plausible, imperfect submission: spooky: answers mixed with random probabilities (rows
    sum to one, none extreme); cover type: a quarter of the labels changed."""
    sub = _perfect(task)
    rng = np.random.default_rng(seed)
    cols = list(task.target_columns)
    if task.task_id == SPOOKY:
        p = 0.5 * sub[cols].to_numpy(float) + 0.5 * rng.dirichlet(np.ones(len(cols)), len(sub))
        sub[cols] = p / p.sum(axis=1, keepdims=True)
    else:   # another class seen in the training file (the answers may lack one; a class in
        # neither file would be MLE-bench's "wrong" but our "unknown label")
        classes = np.array(sorted(set(pd.read_csv(task.public_dir / "train.csv")["Cover_Type"])))
        flip = np.flatnonzero(rng.random(len(sub)) < 0.25)
        for i in flip:
            others = classes[classes != sub.at[i, "Cover_Type"]]
            sub.at[i, "Cover_Type"] = int(rng.choice(others))
    return sub


# ------------------------------------------------------------------------------ raw files

def test_synthetic_raw_files_are_in_kaggles_layout(tmp_path):
    """What MLE-bench's prepare.py reads: spooky's train.zip holding train.csv (id,text,author;
    EAP/HPL/MWS); the cover-type train.csv with Kaggle's columns and Cover_Type."""
    files = mlebench_data.write_synthetic_raw(SPOOKY, tmp_path / SPOOKY, n_rows=120, seed=3)
    assert sorted(p.name for p in files) == ["sample_submission.zip", "test.zip", "train.zip"]
    with zipfile.ZipFile(tmp_path / SPOOKY / "train.zip") as z:
        assert z.namelist() == ["train.csv"]
        train = pd.read_csv(z.open("train.csv"))
    assert list(train.columns) == ["id", "text", "author"] and len(train) == 120
    assert set(train["author"]) == {"EAP", "HPL", "MWS"} and train["id"].is_unique
    mlebench_data.write_synthetic_raw(COVER, tmp_path / COVER, n_rows=90)
    cover = pd.read_csv(tmp_path / COVER / "train.csv")
    assert cover.columns[0] == "Id" and cover.columns[-1] == "Cover_Type"
    assert {"Elevation", "Wilderness_Area4", "Soil_Type40"} <= set(cover.columns)
    assert cover.shape == (90, 56) and set(cover["Cover_Type"]) <= set(range(1, 8))
    test = pd.read_csv(tmp_path / COVER / "test.csv")
    assert "Cover_Type" not in test.columns and test["Id"].min() == 4_000_000
    with pytest.raises(ValueError, match="no synthetic raw files for 'titanic'"):
        mlebench_data.write_synthetic_raw("titanic", tmp_path / "t")


def test_prepare_without_mlebench_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlebench", None)            # Python's import blocker
    monkeypatch.setitem(sys.modules, "mlebench.registry", None)
    with pytest.raises(mlebench_data.MLEBenchNotInstalledError, match="pip install --no-deps"):
        mlebench_data.prepare_from_raw([SPOOKY], tmp_path / "raw", tmp_path / "data")


def test_stage_refuses_what_is_not_prepared(tmp_path):
    with pytest.raises(mlebench_data.StageError, match="name the competitions"):
        mlebench_data.stage(tmp_path, [], str(tmp_path / "dest"))
    with pytest.raises(mlebench_data.StageError, match="prepare the competition first"):
        mlebench_data.stage(tmp_path, [SPOOKY], str(tmp_path / "dest"))


# ------------------------------------------------------------------------------ MLE-bench's own

@needs_mlebench
def test_prepare_runs_mlebench_own_preparer(prepared):
    """public/private as MLE-bench's prepare.py writes them, description.md copied in, and a
    record of who prepared it (checksums skipped, and said so)."""
    from mlebench.registry import registry

    for cid in IDS:
        comp = registry.set_data_dir(prepared).get_competition(cid)
        assert comp.answers.is_file() and comp.sample_submission.is_file()
        assert (comp.public_dir / "description.md").read_text() == comp.description
        record = json.loads((prepared / cid / mlebench_data.PREPARE_RECORD).read_text())
        assert record["mlebench_prepared"] and record["preparer"].endswith(".prepare:prepare")
        assert record["checksums"].startswith("skipped")
    answers = pd.read_csv(prepared / SPOOKY / "prepared" / "private" / "test.csv")
    assert list(answers.columns) == ["id", "EAP", "HPL", "MWS"] and len(answers) == 30  # 10%
    assert (answers[["EAP", "HPL", "MWS"]].sum(axis=1) == 1).all()


@needs_mlebench
def test_prepare_extracts_kaggles_zip_and_skips_what_is_prepared(tmp_path):
    """raw/<id>/ holding only Kaggle's <id>.zip is extracted first (as `mlebench prepare` does
    after its download); a prepared competition is not prepared again unless overwrite."""
    made = mlebench_data.write_synthetic_raw(COVER, tmp_path / "made", n_rows=50)
    (tmp_path / "raw" / COVER).mkdir(parents=True)
    with zipfile.ZipFile(tmp_path / "raw" / COVER / f"{COVER}.zip", "w") as z:
        for f in made:
            z.write(f, f.name)
    first = mlebench_data.prepare_from_raw([COVER], tmp_path / "raw", tmp_path / "data")
    assert not first["competitions"][COVER]["already_prepared"]
    assert "train.csv" in first["competitions"][COVER]["raw_files"]
    answers = tmp_path / "data" / COVER / "prepared" / "private" / "test.csv"
    assert len(pd.read_csv(answers)) == 5
    again = mlebench_data.prepare_from_raw([COVER], tmp_path / "raw", tmp_path / "data")
    assert again["competitions"][COVER]["already_prepared"]
    redo = mlebench_data.prepare_from_raw([COVER], tmp_path / "raw", tmp_path / "data",
                                          overwrite=True)
    assert not redo["competitions"][COVER]["already_prepared"]
    with pytest.raises(mlebench_data.PrepareError, match="no raw files for 'spaceship-titanic'"):
        mlebench_data.prepare_from_raw(["spaceship-titanic"], tmp_path / "raw", tmp_path / "d")


@needs_mlebench
def test_staged_bucket_loads_and_grades_with_mlebench(bucket, tmp_path):
    """(a) gs:// -> a fresh cache: only the named competitions, public/private/competition files
    fetched apart (never raw/), reused until changed; MLE-bench's grader scores the sample and
    a perfect submission built from the private answers."""
    url, summary = bucket
    assert summary["mlebench_prepared"] and set(summary["competitions"]) == set(IDS)
    cache = tmp_path / "cache"
    [spooky] = tasks_lib.load_tasks([SPOOKY], source="mlebench", data_dir=url,
                                    cache_dir=str(cache))
    assert os.listdir(cache / "mlebench") == [SPOOKY]            # the other one never fetched
    loaded = tasks_lib.load_tasks(IDS, source="mlebench", data_dir=url, cache_dir=str(cache))
    assert sorted(os.listdir(cache / "mlebench")) == sorted(IDS)
    for task in loaded:
        cid, staged = task.task_id, cache / "mlebench" / task.task_id
        assert not (staged / "raw").exists()
        # the grader staged beside the data (MLE-bench's own file, imported from there)
        assert task.grader_source == "mlebench:staged" and task.grade_fn is not None
        assert pathlib.Path(inspect.getsourcefile(task.grade_fn)) == staged / "grade.py"
        assert task.requires_isolation and str(task.private_dir) in task.hidden_paths
        assert task.competition_dir == staged and task.public_dir == staged / "prepared/public"
        mle = _mlebench_competition_dir(cid)
        assert (staged / "config.yaml").read_bytes() == (mle / "config.yaml").read_bytes()
        assert (staged / "grade.py").read_bytes() == (mle / "grade.py").read_bytes()
        assert task.description == (mle / "description.md").read_text()
        assert (task.leaderboard == []) == _lfs_pointer(cid)
        manifest = json.loads(storage.read_text(storage.join(url, cid, "STAGED.json")))
        assert manifest["mlebench_prepared"] and manifest["grader"]["files"]
        for f in manifest["files"]:                               # the cache holds what was staged
            assert _sha256(staged / f["path"]) == f["sha256"], f["path"]
        sample = task.public_dir / "sample_submission.csv"
        assert task.baseline_score is not None and task.grade(sample, "dev") == task.baseline_score
        _perfect(task).to_csv(tmp_path / f"{cid}.csv", index=False)
        for split in ("dev", "test"):
            score = task.grade(tmp_path / f"{cid}.csv", split)
            assert score == (1.0 if cid == COVER else pytest.approx(0.0, abs=1e-9)), split
            assert task.better(score, task.baseline_score)
    # per part: reused (0 bytes), then only a changed file is downloaded again
    again = tasks_lib.stage_competitions(url, [SPOOKY], str(cache))
    assert again.downloaded == {SPOOKY: 0}
    storage.write_text(storage.join(url, SPOOKY, "description.md"), "# Changed\n")
    changed = tasks_lib.stage_competitions(url, [SPOOKY], str(cache))
    assert changed.downloaded == {SPOOKY: len("# Changed\n")}
    fresh = tasks_lib.stage_competitions(url, [COVER], str(tmp_path / "fresh"))
    staged_bytes = sum(f["size"] for f in json.loads(storage.read_text(
        storage.join(url, COVER, "STAGED.json")))["files"])
    assert fresh.bytes_downloaded == staged_bytes + len(
        storage.read_text(storage.join(url, COVER, "STAGED.json")).encode())


_LOAD_WITHOUT_MLEBENCH = """
import importlib.util, json, sys
sys.modules["mlebench"] = None   # Python's import blocker: import fails, find_spec is None
from ace_jax.env import tasks
args = json.loads(sys.argv[1])
out = {"find_spec": importlib.util.find_spec("mlebench") is not None}
for t in tasks.load_tasks(args["ids"], source="mlebench", data_dir=args["url"],
                          cache_dir=args["cache"]):
    out[t.task_id] = {"grader_source": t.grader_source, "grade_fn": t.grade_fn is not None,
                      "metric": t.metric, "competition_dir": str(t.competition_dir),
                      "baseline": t.baseline_score, "requires_isolation": t.requires_isolation,
                      "scores": {name: [t.grade(path, s) for s in ("dev", "test")]
                                 for name, path in args["subs"][t.task_id].items()}}
print(json.dumps(out))
"""


@needs_mlebench
def test_staged_bucket_loads_without_mlebench_and_agrees(bucket, gcs_emulator, tmp_path):
    """(b) A host without mlebench: the same staged files load (config.yaml etc. beside the
    data) and grade with our metric of the same name, equal to MLE-bench's grader."""
    url, _ = bucket
    with_mle = tasks_lib.load_tasks(IDS, source="mlebench", data_dir=url,
                                    cache_dir=str(tmp_path / "with"))
    subs = {}
    for task in with_mle:
        subs[task.task_id] = {"sample": str(task.public_dir / "sample_submission.csv")}
        for seed in (0, 1):
            path = tmp_path / f"{task.task_id}-{seed}.csv"
            _imperfect(task, seed).to_csv(path, index=False)
            subs[task.task_id][f"imperfect{seed}"] = str(path)
    args = {"ids": IDS, "url": url, "cache": str(tmp_path / "without"), "subs": subs}
    env = {**os.environ, **gcs_emulator.env(), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_MLEBENCH, json.dumps(args)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["find_spec"] is False
    for task in with_mle:
        cid, ours = task.task_id, got[task.task_id]
        assert ours["grader_source"] == f"ours:{task.metric}" and not ours["grade_fn"]
        assert ours["metric"] == {SPOOKY: "log_loss", COVER: "accuracy"}[cid]
        assert ours["requires_isolation"]
        assert ours["competition_dir"] == str(tmp_path / "without" / "mlebench" / cid)
        assert ours["baseline"] == pytest.approx(task.baseline_score, rel=1e-9)
        for name, path in subs[cid].items():
            theirs = [task.grade(path, s) for s in ("dev", "test")]
            # both in float64 on the same rows; probabilities are never near 0 or 1 here, so
            # the two log losses' clipping (ours 1e-15, sklearn's machine epsilon) never acts
            assert ours["scores"][name] == pytest.approx(theirs, rel=1e-9), (cid, name)
        assert ours["scores"]["imperfect0"][0] != pytest.approx(task.baseline_score, rel=1e-3)


def test_no_competition_named_with_a_bucket_is_refused(tmp_path):
    """(c) tasks.ids=() with a gs:// data_dir: refused before anything is listed or fetched."""
    with pytest.raises(tasks_lib.TaskLoadError, match=r"tasks.ids=\(\).*name the competitions"):
        tasks_lib.load_tasks((), source="mlebench", data_dir="gs://nowhere/mlebench",
                             cache_dir=str(tmp_path / "cache"))
    assert not (tmp_path / "cache").exists()


def test_a_missing_competition_in_the_bucket_is_named(gcs_emulator, monkeypatch, tmp_path):
    """(d) a competition not in the bucket, or one without its private answers: TaskLoadError
    naming it."""
    import fsspec

    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_emulator.endpoint)
    monkeypatch.setitem(fsspec.config.conf, "gs", {"token": "anon", "skip_instance_cache": True})
    url = "gs://" + gcs_emulator.prefix() + "/mlebench"
    storage.write_text(storage.join(url, "half", "prepared", "public", "sample_submission.csv"),
                       "id,target\n1,0\n")
    with pytest.raises(tasks_lib.TaskLoadError, match="holds no competition 'absent-comp'"):
        tasks_lib.load_tasks(["absent-comp"], source="mlebench", data_dir=url,
                             cache_dir=str(tmp_path / "cache"))
    with pytest.raises(tasks_lib.TaskLoadError, match="competition 'half' .* no private answers"):
        tasks_lib.load_tasks(["half"], source="mlebench", data_dir=url,
                             cache_dir=str(tmp_path / "cache"))


@needs_mlebench
def test_stage_to_a_folder_warns_on_lfs_pointers_and_replaces_stale_files(
        prepared, tmp_path, caplog):
    """A local dest: the manifest, the leaderboard's state (a Git LFS pointer is not staged and
    the warning says what to run), stale staged files removed, other files left alone."""
    dest = tmp_path / "dest"
    stale = dest / SPOOKY / "prepared" / "public" / "old.csv"
    stale.parent.mkdir(parents=True)
    stale.write_text("x\n")
    (dest / SPOOKY / "raw").mkdir()
    (dest / SPOOKY / "raw" / "train.zip").write_text("kept")
    with caplog.at_level(logging.WARNING, logger="ace_jax.env.mlebench_data"):
        summary = mlebench_data.stage(prepared, [SPOOKY], str(dest))
    info = summary["competitions"][SPOOKY]
    assert info["removed_stale"] == 1 and not stale.exists()
    assert (dest / SPOOKY / "raw" / "train.zip").read_text() == "kept"
    manifest = json.loads((dest / SPOOKY / "STAGED.json").read_text())
    names = {f["path"] for f in manifest["files"]}
    assert {"config.yaml", "description.md", "grade.py", "classes.py",
            "prepared/private/test.csv", "prepared/public/sample_submission.csv"} <= names
    assert manifest["mlebench"]["installed"] and manifest["mlebench"]["version"]
    if _lfs_pointer(SPOOKY):
        assert info["leaderboard"] == "git-lfs-pointer" and "leaderboard.csv" not in names
        assert not (dest / SPOOKY / "leaderboard.csv").exists()
        assert "medals and HumanRank are unavailable" in caplog.text
        assert "git lfs pull" in caplog.text
    else:
        assert info["leaderboard"] == "staged" and "leaderboard.csv" in names
    with pytest.raises(mlebench_data.StageError, match="data folder itself"):
        mlebench_data.stage(prepared, [SPOOKY], str(prepared))


@needs_mlebench
def test_cli_writes_raw_prepares_and_stages(tmp_path):
    """launch/stage_mlebench.py: synthetic raw -> MLE-bench's prepare -> stage; one JSON line."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "launch" / "stage_mlebench.py"), f"--raw_dir={tmp_path}/raw",
         "--synthetic_rows=60", "--prepare", f"--data_dir={tmp_path}/data",
         f"--competitions={SPOOKY},{COVER}", f"--dest={tmp_path}/dest"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = proc.stdout.strip().splitlines()
    out = json.loads(line)
    assert out["staged"]["mlebench_prepared"] and set(out["staged"]["competitions"]) == set(IDS)
    assert set(out["prepared"]["competitions"]) == set(IDS)
    assert (tmp_path / "dest" / COVER / "prepared" / "private" / "test.csv").is_file()
    bad = subprocess.run([sys.executable, str(REPO / "launch" / "stage_mlebench.py"),
                          f"--data_dir={tmp_path}/data", "--competitions=no-such-competition",
                          "--prepare", f"--raw_dir={tmp_path}/raw"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert bad.returncode != 0 and "MLE-bench has no competitions ['no-such-competition']" in (
        bad.stderr)
