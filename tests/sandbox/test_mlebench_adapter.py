"""The MLE-bench adapter's mechanics on small competition folders the test writes itself (the
one test file that hand-writes config.yaml: tests/sandbox/mlebench_competition.py): our fallback
metrics, graders MLE-bench does not have, leaderboard files. Its graders are not MLE-bench's (the
module ``mlebench.competitions.x`` does not exist), so they behave the same with or without
MLE-bench installed; ``tests/sandbox/fake_mlebench_spooky.py`` behaves like MLE-bench's
``spooky-author-identification`` grader: its own ``InvalidSubmissionError`` for a wrong shape,
rows not summing to one or probabilities outside [0, 1], then sklearn's log loss. MLE-bench's own
competitions: tests/ace_jax/env/test_mlebench_check.py and test_mlebench_data.py.
"""
import dataclasses
import importlib
import math
import re
import textwrap

import numpy as np
import pandas as pd
import pytest

from sandbox.grading import InvalidSubmissionError
from sandbox.result import Status
from sandbox.tasks import mlebench
from sandbox.tasks.base import NoLeaderboardError
from tests.sandbox.mlebench_competition import AGENT_CODE, CLASSES
from tests.sandbox.mlebench_competition import write_competition as _write_competition




@pytest.fixture(scope="module")
def spooky_grader():
    """The module name of the stand-in grader (tests/sandbox/fake_mlebench_spooky.py)."""
    return "tests.sandbox.fake_mlebench_spooky"


def test_loads_and_grades_with_our_metric(tmp_path):
    answers = _write_competition(tmp_path, "toy-spooky", "multi-class-log-loss")
    task = mlebench.load_mlebench_task("toy-spooky", tmp_path)
    assert task.grade_fn is None  # mlebench is not installed here
    assert (task.metric, task.lower_is_better, task.target_columns) == ("log_loss", True, tuple(CLASSES))
    assert task.description.startswith("# Toy authors")
    assert str(task.private_dir) in task.hidden_paths
    assert len(task.leaderboard) == 10 and task.gold == 0.2
    dev, final = task._split_answers("dev"), task._split_answers("test")
    assert len(dev) == 20 and len(final) == 20 and set(dev["id"]).isdisjoint(final["id"])
    assert task.baseline_score == pytest.approx(math.log(3))

    answers.sample(frac=1, random_state=1).to_csv(tmp_path / "gold.csv", index=False)
    assert task.grade(tmp_path / "gold.csv", "dev") < 1e-12
    assert task.grade(tmp_path / "gold.csv", "test") < 1e-12
    assert task.position_score(0.0) == 1.0 and task.medal(0.0).gold
    answers.iloc[:-1].to_csv(tmp_path / "short.csv", index=False)
    with pytest.raises(InvalidSubmissionError, match="wrong row count"):
        task.grade(tmp_path / "short.csv", "dev")
    answers.drop(columns=["MWS"]).to_csv(tmp_path / "cols.csv", index=False)
    with pytest.raises(InvalidSubmissionError, match=r"missing \['MWS'\]"):
        task.grade(tmp_path / "cols.csv", "dev")
    d = task.to_dict()
    assert d["grade_fn"] is None and len(d["dev_ids"]) == 20


def test_split_depends_on_seed(tmp_path):
    _write_competition(tmp_path, "toy", "multi-class-log-loss")
    a = mlebench.load_mlebench_task("toy", tmp_path, seed=0).dev_ids
    assert a == mlebench.load_mlebench_task("toy", tmp_path, seed=0).dev_ids
    assert a != mlebench.load_mlebench_task("toy", tmp_path, seed=1).dev_ids


def test_imported_grade_fn_gets_only_the_split_rows(tmp_path, monkeypatch):
    mod = tmp_path / "mods" / "fake_mlebench_grader.py"
    mod.parent.mkdir()
    mod.write_text(textwrap.dedent("""\
        class InvalidSubmissionError(Exception):
            pass

        def grade(submission, answers):
            if "EAP" not in submission.columns:
                raise InvalidSubmissionError("Submission is missing column EAP")
            return float(len(answers)) + 0.5 * float(set(submission["id"]) == set(answers["id"]))
        """))
    monkeypatch.syspath_prepend(str(mod.parent))
    answers = _write_competition(tmp_path, "custom", "some-metric-we-lack",
                                 grade_fn="fake_mlebench_grader:grade", n=31)
    task = mlebench.load_mlebench_task("custom", tmp_path)
    assert task.grade_fn is not None and task.metric == "some-metric-we-lack"
    assert task.lower_is_better  # inferred from the leaderboard order, as MLE-bench does
    answers.to_csv(tmp_path / "sub.csv", index=False)
    assert task.grade(tmp_path / "sub.csv", "dev") == 15.5   # 15 dev rows, ids restricted
    assert task.grade(tmp_path / "sub.csv", "test") == 16.5
    answers.drop(columns=["EAP"]).to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(InvalidSubmissionError, match=r"wrong columns: missing \['EAP'\]"):
        task.grade(tmp_path / "bad.csv", "dev")
    answers.iloc[:5].to_csv(tmp_path / "few.csv", index=False)
    with pytest.raises(InvalidSubmissionError,
                       match=r"wrong row count: 5 rows, expected 31 \(missing ids: .*26 in all"):
        task.grade(tmp_path / "few.csv", "dev")
    assert task.to_dict()["grade_fn"] == "fake_mlebench_grader:grade"


def test_unknown_grader_without_mlebench_is_a_clear_error(tmp_path):
    _write_competition(tmp_path, "odd", "quadratic-weighted-kappa-v9")
    with pytest.raises(mlebench.UnsupportedGraderError, match="quadratic-weighted-kappa-v9"):
        mlebench.load_mlebench_task("odd", tmp_path)


def test_missing_files_are_named(tmp_path):
    _write_competition(tmp_path, "toy", "accuracy")
    (tmp_path / "toy" / "prepared" / "private" / "test.csv").unlink()
    with pytest.raises(FileNotFoundError, match="private/test.csv"):
        mlebench.load_mlebench_task("toy", tmp_path)


def test_label_competition_with_accuracy(tmp_path):
    root = tmp_path
    pub, priv = root / "cls" / "prepared" / "public", root / "cls" / "prepared" / "private"
    pub.mkdir(parents=True)
    priv.mkdir(parents=True)
    ids = [str(i) for i in range(20)]
    pd.DataFrame({"PassengerId": ids, "Transported": [True] * 20}).to_csv(
        pub / "sample_submission.csv", index=False)
    truth = pd.DataFrame({"PassengerId": ids, "Transported": [i % 2 == 0 for i in range(20)]})
    truth.to_csv(priv / "test.csv", index=False)
    (root / "cls" / "config.yaml").write_text(
        "dataset:\n  answers: cls/prepared/private/test.csv\n"
        "  sample_submission: cls/prepared/public/sample_submission.csv\ngrader:\n  name: accuracy\n")
    task = mlebench.load_mlebench_task("cls", root)
    assert task.labels == ("False", "True") and task.leaderboard == []
    truth.to_csv(tmp_path / "gold.csv", index=False)
    assert task.grade(tmp_path / "gold.csv", "dev") == 1.0
    assert task.baseline_score == pytest.approx(
        np.mean([int(i) % 2 == 0 for i in sorted(task.dev_ids)]))
    with pytest.raises(NoLeaderboardError, match="no reference leaderboard"):
        task.medal_thresholds()


# ------------------------------------------------------------------------------ whole-file checks

def _final_ids(task):
    """Answer ids of the final half (not graded with split="dev"), sorted."""
    return sorted(set(task.test_ids) - task.dev_ids)


def _predictions(answers, seed=0):
    """A plausible submission: random probabilities (rows sum to one), answer row order."""
    p = np.random.default_rng(seed).dirichlet(np.ones(3), len(answers))
    return pd.DataFrame({"id": answers["id"], **{c: p[:, k] for k, c in enumerate(CLASSES)}})


def _load(tmp_path, grader, spec, cid="spooky", **kw):
    """(task, answers): ours (grader "ours", our log loss) or the fake MLE-bench grader ``spec``."""
    if grader == "ours":
        answers = _write_competition(tmp_path, cid, "multi-class-log-loss", **kw)
    else:
        answers = _write_competition(tmp_path, cid, "multi-class-log-loss", grade_fn=spec, **kw)
    task = mlebench.load_mlebench_task(cid, tmp_path, memory_limit_mb=1024, time_limit_s=30)
    assert (task.grade_fn is None) == (grader == "ours")
    return task, answers


def _defect(kind, sub, bad_id):
    """``sub`` with one defect on the row ``bad_id`` (an id of the half NOT being graded)."""
    row = sub.index[sub["id"] == bad_id][0]
    if kind == "non_numeric":
        text = sub.astype({"EAP": object})
        return text.assign(EAP=text["EAP"].where(text.index != row, "abc"))
    if kind == "nan":
        return sub.assign(HPL=sub["HPL"].where(sub.index != row, np.nan))
    if kind == "duplicate":
        return pd.concat([sub, sub.loc[[row]]])
    if kind == "duplicate_replacing":
        other = sub.index[sub["id"] != bad_id][0]
        return pd.concat([sub.drop(index=other), sub.loc[[row]]])
    if kind == "missing":
        return sub.drop(index=row)
    raise AssertionError(kind)


DEFECTS = {
    "non_numeric": r"non-numeric values in column 'EAP', e.g. 'abc' \(1 rows; ids '{id}'\)",
    "nan": r"NaN in column 'HPL' \(1 rows; ids '{id}'\)",
    "duplicate": r"wrong row count: 41 rows, expected 40 \(duplicate ids: '{id}'\)",
    "duplicate_replacing": r"duplicate ids: '{id}'; missing ids: ",
    "missing": r"wrong row count: 39 rows, expected 40 \(missing ids: '{id}'\)",
}


@pytest.mark.parametrize("grader", ["ours", "mlebench"])
@pytest.mark.parametrize("kind", sorted(DEFECTS))
def test_a_defect_in_the_other_half_makes_the_whole_submission_invalid(
        tmp_path, spooky_grader, grader, kind):
    task, answers = _load(tmp_path, grader, f"{spooky_grader}:grade")
    bad_id = _final_ids(task)[0]
    assert bad_id not in task.dev_ids
    sub = _defect(kind, _predictions(answers), bad_id)
    sub.to_csv(tmp_path / "sub.csv", index=False)
    for split in ("dev", "test"):
        with pytest.raises(InvalidSubmissionError, match=DEFECTS[kind].format(id=bad_id)):
            task.grade(tmp_path / "sub.csv", split)
    with pytest.raises(InvalidSubmissionError, match=DEFECTS[kind].format(id=bad_id)):
        task.validate(tmp_path / "sub.csv")


def test_mlebench_rules_apply_to_the_whole_file(tmp_path, spooky_grader):
    """A rule only MLE-bench's grader knows (rows sum to one) is checked on every row: a bad row
    in the final half makes the dev grade invalid too."""
    task, answers = _load(tmp_path, "mlebench", f"{spooky_grader}:grade")
    sub = _predictions(answers)
    sub.loc[sub["id"] == _final_ids(task)[0], "EAP"] += 0.5
    sub.to_csv(tmp_path / "sub.csv", index=False)
    with pytest.raises(InvalidSubmissionError, match="should sum to one"):
        task.grade(tmp_path / "sub.csv", "dev")


def test_mlebench_grader_and_ours_agree(tmp_path, spooky_grader):
    """The same file scored by the (fake) MLE-bench grader and by our log loss: equal on both
    halves; the sample submission scores log 3 either way."""
    ours, answers = _load(tmp_path / "a", "ours", None)
    theirs, _ = _load(tmp_path / "b", "mlebench", f"{spooky_grader}:grade")
    assert ours.dev_ids == theirs.dev_ids
    assert ours.baseline_score == pytest.approx(math.log(3), rel=1e-12)
    assert theirs.baseline_score == pytest.approx(math.log(3), rel=1e-12)
    _predictions(answers, seed=3).to_csv(tmp_path / "sub.csv", index=False)
    for split in ("dev", "test"):
        a, b = ours.grade(tmp_path / "sub.csv", split), theirs.grade(tmp_path / "sub.csv", split)
        assert a > 0.1 and b == pytest.approx(a, rel=1e-12)


def test_a_crash_of_mlebench_grader_on_the_whole_file_is_an_invalid_submission(
        tmp_path, spooky_grader):
    """MLE-bench scores None (an invalid submission) whatever its grader raises."""
    task, answers = _load(tmp_path, "mlebench", f"{spooky_grader}:grade_crashes_on_value")
    sub = _predictions(answers)
    sub.loc[0, ["EAP", "HPL", "MWS"]] = [0.125, 0.375, 0.5]
    sub.to_csv(tmp_path / "sub.csv", index=False)
    with pytest.raises(InvalidSubmissionError,
                       match=r"could not score this submission \(ZeroDivisionError: division by "
                             r"zero\); MLE-bench counts it as an invalid submission") as info:
        task.grade(tmp_path / "sub.csv", "dev")
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def _with_buggy_grader(task, spooky_grader):
    """``task`` whose MLE-bench grader crashes on anything but every answer row."""
    bug = importlib.import_module(spooky_grader).grade_crashes_on_halves
    return dataclasses.replace(task, task_id="buggy", grade_fn=bug)


def test_a_crash_on_one_half_of_a_valid_file_is_a_grader_bug(tmp_path, spooky_grader):
    with pytest.raises(KeyError, match="grader bug"):  # found at load: the sample's dev half
        _load(tmp_path / "a", "mlebench", f"{spooky_grader}:grade_crashes_on_halves")
    good, answers = _load(tmp_path / "b", "mlebench", f"{spooky_grader}:grade")
    task = _with_buggy_grader(good, spooky_grader)
    _predictions(answers).to_csv(tmp_path / "sub.csv", index=False)
    task.validate(tmp_path / "sub.csv")  # the whole file is fine
    with pytest.raises(KeyError, match="grader bug"):
        task.grade(tmp_path / "sub.csv", "dev")


def test_an_invalid_sample_submission_leaves_no_baseline_and_says_why(tmp_path):
    _write_competition(tmp_path, "toy", "multi-class-log-loss")
    sample_path = tmp_path / "toy" / "prepared" / "public" / "sample_submission.csv"
    sample = pd.read_csv(sample_path)
    sample.assign(EAP=-1.0).to_csv(sample_path, index=False)
    task = mlebench.load_mlebench_task("toy", tmp_path)
    assert task.baseline_score is None
    assert task.baseline_error.startswith(
        "sample_submission.csv is invalid: probabilities must lie")


# ------------------------------------------------------------------------------ the pool carries on



def test_the_pool_reports_invalid_submissions_and_carries_on(tmp_path, spooky_grader):
    from sandbox.pool import SandboxPool

    task, _ = _load(tmp_path, "mlebench", f"{spooky_grader}:grade")
    buggy = _with_buggy_grader(task, spooky_grader)
    final = _final_ids(task)
    good = AGENT_CODE.format(overrides={final[0]: {"EAP": "0.5", "HPL": "0.25", "MWS": "0.25"}})
    jobs = [
        (task, AGENT_CODE.format(overrides={final[0]: {"EAP": "abc"}}), "dev"),   # non-numeric
        (task, AGENT_CODE.format(overrides={final[1]: {"MWS": ""}}), "dev"),      # NaN
        (task, AGENT_CODE.format(overrides={final[2]: {"EAP": "0.9"}}), "test"),  # sum != 1
        (buggy, good, "dev"),                                                     # grader bug
        (task, good, "test"),                                                     # valid
    ]
    # an MLE-bench task requires isolation (its answers are on the host); this test is about
    # grading, not isolation, so it accepts the process backend explicitly
    assert task.requires_isolation
    with SandboxPool("process", num_workers=1, root_dir=tmp_path / "runs", grace_s=0.3,
                     allow_unisolated=True) as pool:
        non_numeric, nan, not_one, bug, ok = pool.map(jobs)
        again = pool.run(task, good, split="dev")
    for r, match in ((non_numeric, f"non-numeric values in column 'EAP', e.g. 'abc' .*{final[0]}"),
                     (nan, f"NaN in column 'MWS' .*'{final[1]}'"),
                     (not_one, "should sum to one")):
        assert r.status is Status.INVALID_SUBMISSION, (r.status, r.error, r.stderr[-500:])
        assert re.search(match, r.error), r.error
        assert r.dev_score is None and r.test_score is None and not r.valid_submission
    assert bug.status is Status.GRADER_ERROR and "KeyError" in bug.error
    assert ok.status is Status.OK and ok.valid_submission, (ok.error, ok.stderr[-500:])
    assert ok.dev_score == pytest.approx(math.log(3), rel=1e-9)  # the changed row is final-half
    assert ok.test_score > ok.dev_score
    assert again.status is Status.OK and again.dev_score == ok.dev_score


# ------------------------------------------------------------------------------ leaderboard file

LFS_POINTER = ("version https://git-lfs.github.com/spec/v1\n"
               "oid sha256:4d7a2146b0f1c1b5a8a5e3e4b5e16c1d1f4b6f1a5f0c2e3d4c5b6a7f8e9d0c1b\n"
               "size 48213\n")


def test_a_git_lfs_pointer_leaderboard_is_said_loudly_and_the_task_still_loads(tmp_path, caplog):
    """What a pip install of MLE-bench holds without `git lfs pull`: the task trains and grades,
    the warning and ``leaderboard_error`` say what is unavailable and what to run."""
    _write_competition(tmp_path, "toy", "multi-class-log-loss")
    (tmp_path / "toy" / "leaderboard.csv").write_text(LFS_POINTER)
    with caplog.at_level("WARNING", logger="sandbox.tasks.mlebench"):
        task = mlebench.load_mlebench_task("toy", tmp_path)
    assert task.leaderboard == [] and task.baseline_score is not None
    assert re.search(r"Git LFS pointer.*medals, HumanRank and the reward's headroom term are "
                     r"unavailable.*git lfs pull", task.leaderboard_error)
    assert task.leaderboard_error in caplog.text
    with pytest.raises(NoLeaderboardError, match="Git LFS pointer"):
        task.medal_thresholds()
    # In an mle-bench checkout layout the message names the checkout to run it in.
    comp = tmp_path / "checkout" / "mlebench" / "competitions" / "toy"
    comp.mkdir(parents=True)
    for name in ("config.yaml", "description.md", "leaderboard.csv"):
        (comp / name).write_bytes((tmp_path / "toy" / name).read_bytes())
    task = mlebench.load_mlebench_task("toy", tmp_path, comp)
    assert f"in the mle-bench checkout ({(tmp_path / 'checkout').resolve()})" in task.leaderboard_error
    assert mlebench.is_git_lfs_pointer(comp / "leaderboard.csv")
    assert not mlebench.is_git_lfs_pointer(comp / "config.yaml")


@pytest.mark.parametrize("text, match", [
    ("teamName,points\na,1\n", r"no 'score' column \(columns: \['teamName', 'points'\]\)"),
    ("teamName,score\na,0.3\nb,oops\n", "non-numeric score 'oops' on row 1"),
    ("", "empty file"),
])
def test_an_unusable_leaderboard_is_a_typed_error(tmp_path, text, match):
    _write_competition(tmp_path, "toy", "multi-class-log-loss")
    (tmp_path / "toy" / "leaderboard.csv").write_text(text)
    with pytest.raises(mlebench.LeaderboardError, match=match):
        mlebench.load_mlebench_task("toy", tmp_path)


def test_the_competition_folder_is_public(tmp_path):
    _write_competition(tmp_path, "toy", "multi-class-log-loss")
    assert mlebench.find_competition_dir("toy", tmp_path) == tmp_path / "toy"  # no mlebench here
    task = mlebench.load_mlebench_task("toy", tmp_path)
    assert task.competition_dir == tmp_path / "toy"
    assert task.to_dict()["competition_dir"] == str(tmp_path / "toy")
    assert str(tmp_path / "toy") in task.source
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "config.yaml").write_bytes((tmp_path / "toy" / "config.yaml").read_bytes())
    (elsewhere / "description.md").write_text("# Elsewhere\n")
    task = mlebench.load_mlebench_task("toy", tmp_path, elsewhere)
    assert task.competition_dir == elsewhere and task.description == "# Elsewhere\n"
    assert task.leaderboard == []  # no leaderboard.csv in the chosen folder
