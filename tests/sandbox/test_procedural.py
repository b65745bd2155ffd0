"""The procedural task family (sandbox/tasks/procedural.py): registry, splits, determinism,
the prepared layout and grading, the prepared descriptions, and the committed leaderboards."""
import math

import pandas as pd
import pytest

from sandbox import grading
from sandbox.prepare import file_checksums
from sandbox.tasks import base, procedural, procedural_description, registry
from sandbox.tasks.procedural_data import generate_table
from sandbox.tasks.procedural_schema import KINDS, make_spec, parse_task_id
from sandbox.tasks.targets import task_targets

OFFLINE_IDS = ["breast-cancer-diagnosis", "coastal-topobathy", "diabetes-progression", "digits-8x8",
               "goog-volume", "iris-species", "linnerud-physiology", "photo-patches",
               "sensor-forecast", "support-tickets", "terrain-elevation", "wine-alcohol",
               "wine-cultivar"]
SPECS = {t: make_spec(*parse_task_id(t)) for t in procedural.all_ids()}


def _sample_ids():
    """One instance per (kind, target type, metric kind): a small, varied sample to prepare."""
    seen, out = set(), []
    for t, s in SPECS.items():
        key = (s.kind, s.target_type, s.metric_info.kind)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


SAMPLE = _sample_ids()


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    root = tmp_path_factory.mktemp("proc")
    return {t: registry.load_task(t, root, seed=0) for t in SAMPLE}


def test_registry_lists_200_plus_and_keeps_the_offline_suite():
    ids = registry.list_tasks()
    assert len(ids) >= 200
    assert registry.list_tasks(family="offline") == OFFLINE_IDS
    assert registry.list_tasks(family="procedural") == procedural.all_ids()
    assert len(procedural.all_ids()) == len(KINDS) * procedural.INSTANCES_PER_KIND
    assert set(ids) == set(OFFLINE_IDS) | set(procedural.all_ids())
    assert registry.families() == ["offline", "procedural"]
    assert registry.family_of("iris-species") == "offline"
    assert registry.family_of("proc-linear-000") == "procedural"
    with pytest.raises(ValueError, match="unknown task family"):
        registry.list_tasks(family="nope")
    assert parse_task_id("proc-rules-017") == ("rules", 17)
    for bad in ("proc-foo-001", "iris-species", "proc-linear-x"):
        assert not procedural.is_procedural(bad)


def test_splits_by_instance_and_by_family():
    train, held, fam = (procedural.split_ids(s) for s in procedural.SPLITS)
    assert sorted(train + held + fam) == procedural.all_ids()
    assert not (set(train) & set(held)) and not (set(train) & set(fam))
    assert fam == sorted(t for t in procedural.all_ids()
                         if parse_task_id(t)[0] in procedural.HELDOUT_KINDS)
    assert procedural.HELDOUT_KINDS and set(procedural.HELDOUT_KINDS) < set(KINDS)
    n_train_kinds = len(procedural.TRAIN_KINDS) * procedural.INSTANCES_PER_KIND
    assert 0.1 < len(held) / n_train_kinds < 0.3
    for kind in procedural.TRAIN_KINDS:   # every training kind has both splits
        assert any(t.startswith(f"proc-{kind}-") for t in train)
        assert any(t.startswith(f"proc-{kind}-") for t in held)
    # the rule depends on the id alone: an instance beyond the registered count keeps its split
    assert procedural.instance_split("proc-linear-999") in ("train", "heldout")
    assert procedural.instance_split("proc-tokens-999") == "heldout_family"
    with pytest.raises(ValueError, match="split must be one of"):
        procedural.split_ids("test")


def test_spec_and_data_are_pure_functions_of_kind_and_index(tmp_path):
    make_spec.cache_clear()
    t = "proc-counts-003"
    again = make_spec("counts", 3)
    assert again == SPECS[t]
    a, b = generate_table(again), generate_table(again)
    pd.testing.assert_frame_equal(a[0], b[0])
    pd.testing.assert_frame_equal(a[1], b[1])
    builder = registry.get_builder(t)
    builder.prepare(tmp_path / "a", seed=0)
    builder.prepare(tmp_path / "b", seed=0)
    builder.prepare(tmp_path / "c", seed=5)
    sa, sc = file_checksums(tmp_path / "a"), file_checksums(tmp_path / "c")
    assert sa == file_checksums(tmp_path / "b")
    assert sa["public/train.csv"] != sc["public/train.csv"]   # another seed: another split, ids
    cols_a = pd.read_csv(tmp_path / "a" / "public" / "train.csv", nrows=1).columns
    cols_c = pd.read_csv(tmp_path / "c" / "public" / "train.csv", nrows=1).columns
    assert list(cols_a) == list(cols_c)                       # ... but the same schema


@pytest.mark.parametrize("task_id", SAMPLE)
def test_prepared_layout_and_grading(prepared, task_id, tmp_path):
    task, spec = prepared[task_id], SPECS[task_id]
    pub = task.public_dir
    assert sorted(p.name for p in pub.iterdir()) == [
        "description.md", "sample_submission.csv", "test.csv", "train.csv"]
    idc = spec.id_column
    train = pd.read_csv(pub / "train.csv", dtype={idc: str})
    test = pd.read_csv(pub / "test.csv", dtype={idc: str})
    sample = pd.read_csv(pub / "sample_submission.csv", dtype={idc: str})
    assert list(train.columns) == [idc, *spec.feature_names, spec.target]
    assert list(test.columns) == [idc, *spec.feature_names]
    assert list(sample.columns) == [idc, *task.target_columns]
    assert len(train) + len(test) == spec.n_rows
    assert pd.concat([train[idc], test[idc]]).is_unique
    assert set(task.test_ids) == set(test[idc]) == set(sample[idc])
    if spec.has_missing:
        assert train[[c.name for c in spec.columns if c.missing]].isna().any().any()
    # pandas reads the ids back as they were written (no all-digit hex, no leading zeros)
    plain = pd.read_csv(pub / "test.csv")
    assert sorted(plain[idc].astype(str)) == sorted(test[idc])
    # grading: the sample is the baseline; the answers score perfectly
    assert task.metric == spec.metric and task.id_column == idc
    assert math.isfinite(task.baseline_score)
    assert task.baseline_score == pytest.approx(task.grade(pub / "sample_submission.csv", "dev"))
    priv = task.private_dir
    gold = pd.concat([pd.read_csv(priv / base.ANSWER_FILES[s], dtype={idc: str})
                      for s in base.SPLITS])
    gold.to_csv(tmp_path / "gold.csv", index=False)
    for split in base.SPLITS:
        score = task.grade(tmp_path / "gold.csv", split)
        assert task.better(score, task.grade(pub / "sample_submission.csv", split))
    # hidden from the sandbox: the answers and the generator itself
    assert str(priv) in task.hidden_paths
    assert any(p.endswith("sandbox/tasks/procedural.py") for p in task.hidden_paths)
    for module in ("procedural_schema", "procedural_data", "procedural_description"):
        assert any(p.endswith(f"sandbox/tasks/{module}.py") for p in task.hidden_paths)
    with pytest.raises(grading.InvalidSubmissionError):
        sample.iloc[1:].to_csv(tmp_path / "short.csv", index=False)
        task.grade(tmp_path / "short.csv", "dev")


@pytest.mark.parametrize("task_id", SAMPLE)
def test_description_names_files_target_metric_and_direction(prepared, task_id):
    task, spec = prepared[task_id], SPECS[task_id]
    d = task.description
    assert d == (task.public_dir / "description.md").read_text()
    for needle in ("train.csv", "test.csv", "sample_submission.csv", "./submission/submission.csv",
                   f"`{spec.target}`", f"`{spec.id_column}`",
                   procedural_description._METRIC_TEXT[spec.metric][0]):
        assert needle in d, (task_id, needle)
    direction = "lower is better" if task.lower_is_better else "higher is better"
    assert direction in d
    for name in spec.feature_names:
        assert f"`{name}`" in d


def test_committed_leaderboards_cover_every_instance():
    """``python -m sandbox.procedural_sweep --seed=0`` output: every instance has a leaderboard
    that is not flat (gold strictly better than the median, so TaskTargets accept it)."""
    df = procedural.sweep_results(0)
    assert df is not None, "run python -m sandbox.procedural_sweep --seed=0"
    assert list(df.columns) == list(procedural.RESULT_COLUMNS)
    assert set(df["task_id"]) == set(procedural.all_ids())
    for t, rows in df.groupby("task_id"):
        ok = rows[rows["status"] == "ok"]
        assert len(ok) >= 6, t
        assert ok["score"].map(math.isfinite).all() and ok["dev_score"].map(math.isfinite).all()
        assert rows["digest"].nunique() == 1
        lower = SPECS[t].metric_info.lower_is_better
        thr = grading.medal_thresholds(ok["score"].tolist(), lower)
        assert grading.improves(thr.gold, thr.median, lower), t
    assert df["wall_s"].median() < 1.0   # seconds per execution (2 busy cores, warm bwrap)


def test_load_task_attaches_the_leaderboard_and_matches_the_measured_files(prepared):
    df = procedural.sweep_results(0)
    for t, task in prepared.items():
        assert task.has_leaderboard and "procedural_sweep" in task.leaderboard_source
        assert sorted(task.leaderboard) == sorted(
            df[(df.task_id == t) & (df.status == "ok")]["score"].tolist())
        assert registry.reference_leaderboard(t, 0) == (task.leaderboard, task.leaderboard_source)
        targets = task_targets(task)
        assert targets.has_leaderboard and targets.spread > 0
        digest = procedural.prepared_digest(task.public_dir.parent)
        assert digest.startswith(df[df.task_id == t]["digest"].iloc[0]), t
    assert procedural.reference_leaderboard("proc-linear-000", seed=7) == ([], "")
