"""Adapter: a prepared MLE-bench competition directory as a ``Task``.

MLE-bench keeps two trees per competition ``<id>``:

  * the data dir (``mlebench prepare``): ``<data_dir>/<id>/prepared/public/`` (what the agent sees)
    and ``<data_dir>/<id>/prepared/private/`` (the answers). Which files hold the answers and the
    sample submission is the competition's own ``config.yaml`` (``dataset.answers``,
    ``dataset.sample_submission``, paths relative to the data dir: ``test.csv``, ``answers.csv``,
    ``sampleSubmission.csv``, ``test.jsonl``, a sample submission under ``private/``...); nothing
    here assumes a file name (``declared_files``);
  * the competition dir (the repo's ``mlebench/competitions/<id>/``): ``config.yaml`` (``grader.name``,
    ``grader.grade_fn`` = ``"module.path:function"``), ``description.md``, ``leaderboard.csv``
    (Kaggle's final private leaderboard, a ``score`` column, best first; stored with Git LFS).

``find_competition_dir`` says which competition dir is used: ``<data_dir>/<id>/`` when it holds
``config.yaml`` (the files ``launch/stage_mlebench.py`` stages beside the data, copied from
MLE-bench: they belong to the mlebench version that prepared the data), else the installed
``mlebench`` package's copy when importable, else ``<data_dir>/<id>/``; the loaded task records it
as ``MLEBenchTask.competition_dir``. So a host loads staged competitions with or without
``mlebench``.

Grading: the answers' rows are split (seeded) into a dev half and a final half, like the offline
suite. A submission must cover every answer id, and it is validated whole (columns, ids,
duplicates, values; then MLE-bench's grader on every row, as MLE-bench's ``/validate`` does)
before either half is scored, so a problem in the half not being graded still makes it invalid.
Whatever MLE-bench scores as None (its ``InvalidSubmissionError`` or any other exception of its
grader on the whole file) is our ``InvalidSubmissionError``. The score comes from MLE-bench's own
grade function (``grader.grade_fn``): the staged copy of the grader beside the data when there is
one (the grader of the MLE-bench that prepared the data), else the installed package's; both need
``mlebench`` importable. Otherwise, and only as a named, loud fallback (a warning at every load),
from our metric of the same name when we have one (``GRADER_ALIASES``); otherwise loading fails
with ``UnsupportedGraderError``. The task records which (``MLEBenchTask.grader_source``:
``"mlebench"``, ``"mlebench:staged"`` or ``"ours:<metric>"``). Answers that are no CSV (e.g.
``test.jsonl``) are not split: dev and final are both the whole answers (``split_by`` says so).

Isolation: an MLE-bench task's private answers sit on the host (``prepared/private``), so it needs
a sandbox backend that hides them and the network (``Task.requires_isolation`` is True).

Leaderboard: a missing ``leaderboard.csv`` gives a task without a reference leaderboard (it trains
and evaluates; medals, HumanRank and the reward's headroom term are not available). A Git LFS
pointer in its place (what a pip install of MLE-bench without ``git lfs pull`` holds) does the same,
loudly: a warning at load, ``MLEBenchTask.leaderboard_error`` says what to run, and the run's
closing summary repeats it. A file without a numeric ``score`` column is a ``LeaderboardError``.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
from typing import Any, Callable, ClassVar, Optional, Sequence

import numpy as np
import pandas as pd

from sandbox import grading
from sandbox.tasks import base

from sandbox.tasks.mlebench_files import (  # noqa: F401 - re-exported: the adapter's API
    GIT_LFS_POINTER_HEADER, GRADER_ALIASES, GRADER_LOWER_IS_BETTER, DeclaredFileError,
    LeaderboardError, UnsupportedGraderError, declared_files, find_competition_dir,
    import_grade_fn, is_git_lfs_pointer, lfs_pull_hint, read_answers, read_config,
    read_leaderboard)

log = logging.getLogger("sandbox.tasks.mlebench")


def _is_mlebench_invalid(e: BaseException) -> bool:
    """MLE-bench's own ``InvalidSubmissionError`` (matched by name: mlebench may be absent)."""
    return type(e).__name__ == "InvalidSubmissionError"


@dataclasses.dataclass
class MLEBenchTask(base.Task):
    """A Task backed by one MLE-bench answers file and (optionally) MLE-bench's grade function.

    Extra attributes:
      answers_file: ``prepared/private/test.csv``.
      grader_name: ``config.yaml``'s ``grader.name``.
      grade_fn: MLE-bench's ``grade(submission_df, answers_df) -> float`` or None (ours is used).
      dev_ids: the answer ids of the dev half (the rest form the final half).
      competition_dir: the folder config.yaml / description.md / leaderboard.csv were read from
        (``find_competition_dir``).
      baseline_error: why the sample submission did not grade ("" when it did; then
        ``baseline_score`` is None).
      grader_source: which grader scores it: ``"mlebench"`` (the installed package's ``grade_fn``),
        ``"mlebench:staged"`` (the grader staged beside the data) or ``"ours:<metric>"`` (the
        fallback).
      sample_submission_file: the declared sample submission (may lie under ``private/``).
      split_by: how the answers split into dev and final halves: ``"id"`` (by the id column) or
        ``"none"`` (answers that are no CSV: both splits grade on all of them).
      leaderboard_error: why the reference leaderboard is missing although a file is there (a Git
        LFS pointer: what to run); "" otherwise.
      requires_isolation: True (class attribute): the private answers are on the host.
    """

    requires_isolation: ClassVar[bool] = True

    answers_file: Optional[pathlib.Path] = None
    grader_name: str = ""
    grade_fn: Optional[Callable[[pd.DataFrame, pd.DataFrame], Any]] = None
    dev_ids: frozenset = frozenset()
    competition_dir: Optional[pathlib.Path] = None
    baseline_error: str = ""
    grader_source: str = ""
    sample_submission_file: Optional[pathlib.Path] = None
    split_by: str = "id"
    leaderboard_error: str = ""

    def __post_init__(self):
        if self.competition_dir is not None:
            self.competition_dir = pathlib.Path(self.competition_dir)
        if self.grade_fn is None:
            super().__post_init__()
        else:  # MLE-bench's metric may have no registered twin; trust the declared direction
            self.public_dir = pathlib.Path(self.public_dir)
            self.private_dir = pathlib.Path(self.private_dir)
            self.target_columns = tuple(self.target_columns)
            self.hidden_paths = tuple(dict.fromkeys((str(self.private_dir), *self.hidden_paths)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record; the grade function is recorded by name only."""
        d = super().to_dict()
        d["answers_file"] = str(self.answers_file)
        d["sample_submission_file"] = (None if self.sample_submission_file is None
                                       else str(self.sample_submission_file))
        d["competition_dir"] = None if self.competition_dir is None else str(self.competition_dir)
        d["dev_ids"] = sorted(self.dev_ids)
        d["grade_fn"] = None if self.grade_fn is None else (
            f"{self.grade_fn.__module__}:{self.grade_fn.__qualname__}")
        return d

    def leaderboard_hint(self) -> str:
        if self.leaderboard_error:
            return self.leaderboard_error
        where = self.competition_dir or "?"
        return (f"the MLE-bench competition folder {where} has no leaderboard.csv (the task still "
                "trains and evaluates; medals and HumanRank are reported as n/a)")

    def _all_answers(self) -> pd.DataFrame:
        if "_answers_df" not in self.__dict__:
            df = read_answers(self.answers_file, self.id_column)
            if self.split_by == "none":
                self.__dict__["_answers_df"] = df
                return df
            if self.id_column not in df.columns:
                raise ValueError(f"{self.answers_file}: no id column {self.id_column!r}")
            df[self.id_column] = df[self.id_column].str.strip()
            self.__dict__["_answers_df"] = df
        return self.__dict__["_answers_df"]

    @property
    def test_ids(self) -> list[str]:
        return list(dict.fromkeys(self._all_answers()[self.id_column].astype(str)))

    def _split_answers(self, split: str) -> pd.DataFrame:
        df = self._all_answers()
        if self.split_by == "none":
            return df
        in_dev = df[self.id_column].astype(str).isin(self.dev_ids)
        return df[in_dev if split == "dev" else ~in_dev].reset_index(drop=True)

    def validate(self, submission_csv) -> pd.DataFrame:
        """Checks the whole submission (every row, both halves), as MLE-bench would.

        With our metric: ``grading.validate_submission`` (returns the frame indexed by id). With
        MLE-bench's grade function: ``grading.validate_against_answers`` (columns, ids, duplicates,
        values), then the grade function on every row against every answer (MLE-bench's
        ``/validate``); returns the checked frame in file order.

        Raises:
          InvalidSubmissionError: naming the problem (and the first few offending ids).
        """
        sub = grading.read_submission(submission_csv, self.id_column)
        if self.split_by == "none":       # MLE-bench's grader is the only judge of such answers
            self._run_grade_fn(sub, self._all_answers(), whole=True)
            return sub
        if self.grade_fn is None:
            return grading.validate_submission(
                sub, id_column=self.id_column, target_columns=self.target_columns,
                expected_ids=self.test_ids, metric=self.metric, labels=self.labels)
        answers = self._all_answers()
        checked = grading.validate_against_answers(
            sub, answers, id_column=self.id_column, target_columns=self.target_columns)
        self._run_grade_fn(checked, answers, whole=True)
        return checked

    def _run_grade_fn(self, submission: pd.DataFrame, answers: pd.DataFrame, *,
                      whole: bool) -> float:
        """MLE-bench's grade function on ``submission`` rows vs ``answers`` rows.

        MLE-bench's ``InvalidSubmissionError`` is ours. On the whole file (``whole``) any other
        exception is ours too: MLE-bench scores it None, an invalid submission. On one half of a
        file that passed whole, another exception propagates (a grader bug: ``grader_error``).
        """
        try:
            score = self.grade_fn(*(x.reset_index(drop=True) if isinstance(x, pd.DataFrame) else x
                                    for x in (submission, answers)))
        except Exception as e:  # noqa: BLE001 - sorted into invalid submission / grader bug
            if _is_mlebench_invalid(e):
                raise grading.InvalidSubmissionError(str(e)) from e
            if whole:
                raise grading.InvalidSubmissionError(
                    f"MLE-bench's grader {self.grader_name!r} could not score this submission "
                    f"({type(e).__name__}: {e}); MLE-bench counts it as an invalid submission "
                    "(score None)") from e
            raise
        if score is None:
            raise grading.InvalidSubmissionError("MLE-bench's grader returned no score")
        return float(score)

    def grade(self, submission_csv, split: str = "dev") -> float:
        """Scores the ``split`` half after validating the whole submission (``validate``).

        Raises InvalidSubmissionError for any format problem anywhere in the file, ValueError for an
        unknown split.
        """
        if split not in base.SPLITS:
            raise ValueError(f"split must be one of {base.SPLITS}, got {split!r}")
        validated = self.validate(submission_csv)
        answers = self._split_answers(split)
        if self.grade_fn is None:
            a = answers.set_index(self.id_column)[list(self.target_columns)]
            return grading.score_submission(validated, a, self.metric)
        if self.split_by == "none":
            return self._run_grade_fn(validated, answers, whole=False)
        rows = validated[validated[self.id_column].isin(set(answers[self.id_column]))]
        return self._run_grade_fn(rows, answers, whole=False)


def _known_labels(answers: pd.DataFrame, train_csv: pathlib.Path,
                  target_columns: tuple[str, ...]) -> tuple[str, ...]:
    """The labels a submission may hold when our metric grades: those of the answers and of the
    training file's column(s) of the same name (``public/train.csv``, when it has them), so a
    class the test rows happen to lack is a wrong prediction, not an invalid submission (as
    MLE-bench's graders score it). Canonical strings, sorted."""
    seen = {grading.canonical_label(v) for c in target_columns for v in answers[c].dropna()}
    if train_csv.exists():
        try:
            cols = [c for c in target_columns if c in pd.read_csv(train_csv, nrows=0).columns]
            if cols:
                train = pd.read_csv(train_csv, usecols=cols)
                seen |= {grading.canonical_label(v) for c in cols for v in train[c].dropna()}
        except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError):
            pass   # not a plain CSV: the answers' labels alone
    return tuple(sorted(seen))


def _dev_half(answers: pd.DataFrame, id_column: str, target_columns: Sequence[str],
              seed: int) -> frozenset:
    """Half of the answer ids (seeded), stratified by the first target column the answers hold
    when it has at most 50 values (a class label, a 0/1 flag): so both halves of a small test set
    hold every class that has two rows, and a ranking metric (AUC) is defined on each."""
    rng = np.random.default_rng([seed, 11])
    first = next((c for c in target_columns if c in answers.columns), None)
    rows = answers.drop_duplicates(id_column)
    if first is None or rows[first].nunique(dropna=False) > 50:
        strata = [sorted(rows[id_column].astype(str))]
    else:
        keys = rows[first].astype(str)
        strata = [sorted(rows.loc[keys == k, id_column].astype(str)) for k in sorted(set(keys))]
    dev, carry = [], 0
    for ids in strata:           # odd strata alternate which half gets the extra row
        take = (len(ids) + carry) // 2
        carry = (len(ids) + carry) % 2
        dev += list(np.asarray(ids, dtype=object)[rng.permutation(len(ids))[:take]])
    return frozenset(dev)


def _id_column(sample: pd.DataFrame, answers: pd.DataFrame) -> Optional[str]:
    """The column of the sample submission that names its rows: the first one, in the file's
    order, that the answers hold with distinct, non-empty values and that the sample does not fill
    with one constant (a target). Usually the first column; ``Comment`` in
    detecting-insults-in-social-commentary, whose sample submission starts with its target."""
    for c in sample.columns:
        if c not in answers.columns or sample[c].nunique(dropna=False) <= 1 < len(sample):
            continue
        values = answers[c]
        if values.notna().all() and values.str.strip().is_unique:
            return str(c)
    return None


def load_mlebench_task(
    competition_id: str,
    data_dir: "os.PathLike | str",
    competition_dir: "os.PathLike | str | None" = None,
    *,
    seed: int = 0,
    time_limit_s: float = 3600.0,
    memory_limit_mb: int = 16384,
    use_mlebench_grader: bool = True,
) -> MLEBenchTask:
    """Reads a prepared MLE-bench competition into a Task.

    Every file read is the one the competition's ``config.yaml`` declares (``declared_files``):
    its answers (``.csv``, or ``.jsonl`` graded whole) and its sample submission (one column names
    the rows, ``_id_column``; the others are the targets), wherever MLE-bench's preparer put them.

    Args:
      competition_id: e.g. ``"spooky-author-identification"``.
      data_dir: the MLE-bench data root holding ``<id>/prepared/{public,private}``.
      competition_dir: folder with config.yaml / description.md / leaderboard.csv; None:
        ``find_competition_dir`` (recorded as ``task.competition_dir`` either way).
      seed: seed of the dev/final split of the answer rows.
      time_limit_s, memory_limit_mb: per-execution budget.
      use_mlebench_grader: use ``grader.grade_fn`` when importable (False: force our metric).

    Returns:
      the task; ``leaderboard`` is empty when the competition has no usable ``leaderboard.csv``
      (``leaderboard_error`` says why when a Git LFS pointer stands in its place), and
      ``baseline_score`` is None (``baseline_error`` says why) when the sample submission does not
      grade. ``grader_source`` names the grader; a fallback to ours is logged as a warning.

    Raises:
      DeclaredFileError: config.yaml or a file it declares is missing (named in the message).
      UnsupportedGraderError: no importable grade function and no matching metric of ours.
      LeaderboardError: leaderboard.csv has no numeric ``score`` column.
    """
    data_dir = pathlib.Path(data_dir)
    prepared = data_dir / competition_id / "prepared"
    public, private = prepared / "public", prepared / "private"
    comp = pathlib.Path(competition_dir) if competition_dir else find_competition_dir(
        competition_id, data_dir)
    if not (comp / "config.yaml").is_file():
        raise DeclaredFileError(
            f"MLE-bench competition {competition_id!r}: missing {comp / 'config.yaml'}; stage the "
            "competition with `python launch/stage_mlebench.py` (it puts MLE-bench's config.yaml "
            "beside the data) or install mlebench")
    cfg = read_config(comp / "config.yaml")
    files = declared_files(competition_id, cfg, data_dir)
    for key in ("answers", "sample_submission"):
        if not files[key].exists():
            raise DeclaredFileError(
                f"MLE-bench competition {competition_id!r}: missing {files[key]} (config.yaml's "
                f"dataset.{key}: {cfg['dataset'][key]!r}); prepare the competition with "
                f"MLE-bench's preparer (`python launch/stage_mlebench.py --prepare ...` or "
                f"`mlebench prepare -c {competition_id}`)")
    answers_file, sample_file = files["answers"], files["sample_submission"]
    grader = cfg.get("grader") or {}
    grader_name = str(grader.get("name", ""))
    grade_fn, source = (import_grade_fn(str(grader.get("grade_fn", "")), comp)
                        if use_mlebench_grader else (None, "use_mlebench_grader=False"))
    metric = GRADER_ALIASES.get(grader_name.lower())
    if grade_fn is None and metric is None:
        raise UnsupportedGraderError(
            f"competition {competition_id!r} uses grader {grader_name!r} and {source}: install "
            "MLE-bench and what its graders import (scripts/install_mlebench.sh), or add the "
            f"metric to sandbox.grading (our fallback metrics: {sorted(GRADER_ALIASES)})")
    if grade_fn is None:
        why = source
        log.warning("%s: NOT graded by MLE-bench (%s): falling back to our metric %r, which may "
                    "differ from MLE-bench's grader %r; install MLE-bench on every host "
                    "(scripts/install_mlebench.sh)", competition_id, why, metric, grader_name)

    split_by = "id" if answers_file.suffix == ".csv" else "none"
    if split_by == "id":
        sample = pd.read_csv(sample_file, dtype=str)
        answers = pd.read_csv(answers_file, dtype=str)
        id_column = _id_column(sample, answers)
        if id_column is None:
            raise ValueError(f"{answers_file}: no column of {sample_file.name} "
                             f"({list(sample.columns)[:8]}) identifies its rows")
        answers = read_answers(answers_file, id_column)
    else:
        sample = pd.read_csv(sample_file, nrows=5)
        id_column = str(sample.columns[0])
    target_columns = tuple(str(c) for c in sample.columns if str(c) != id_column)
    if split_by == "none" and grade_fn is None:
        raise UnsupportedGraderError(
            f"competition {competition_id!r}: answers {answers_file.name} are no CSV, which only "
            "MLE-bench's own grader reads; install mlebench (scripts/install_mlebench.sh)")
    if split_by == "none":
        log.warning("%s: answers %s are no CSV: dev and final both grade on all of them",
                    competition_id, answers_file.name)

    lb_path = comp / "leaderboard.csv"
    leaderboard, leaderboard_error = [], ""
    if lb_path.exists() and is_git_lfs_pointer(lb_path):
        leaderboard_error = (
            f"{lb_path} is a Git LFS pointer, not the leaderboard: medals, HumanRank and the "
            f"reward's headroom term are unavailable for {competition_id}; {lfs_pull_hint(lb_path)}")
        log.warning("%s", leaderboard_error)
    elif lb_path.exists():
        leaderboard = read_leaderboard(lb_path)
    if metric is not None:
        lower = grading.get_metric(metric).lower_is_better
    elif "lower_is_better" in cfg or "is_lower_better" in grader:
        lower = bool(cfg.get("lower_is_better", grader.get("is_lower_better")))
    elif len(leaderboard) >= 2:
        lower = leaderboard[0] < leaderboard[-1]  # MLE-bench's own inference
    elif grader_name in GRADER_LOWER_IS_BETTER:
        lower = GRADER_LOWER_IS_BETTER[grader_name]
    else:
        why = leaderboard_error or f"no {lb_path}"
        raise ValueError(f"competition {competition_id!r}: cannot tell the metric direction of "
                         f"grader {grader_name!r} without its leaderboard ({why})")

    dev_ids: frozenset = frozenset()
    if split_by == "id":
        dev_ids = _dev_half(answers, id_column, target_columns, seed)

    desc_path = comp / "description.md"
    if not desc_path.exists():
        desc_path = public / "description.md"
    description = desc_path.read_text() if desc_path.exists() else f"# {competition_id}\n"

    labels = None
    if grade_fn is None and grading.get_metric(metric).kind == "label":
        labels = _known_labels(answers, public / "train.csv", target_columns)
    task = MLEBenchTask(
        task_id=competition_id, description=description, public_dir=public.resolve(),
        private_dir=private.resolve(), metric=metric or grader_name, lower_is_better=lower,
        id_column=id_column, target_columns=target_columns, labels=labels,
        time_limit_s=time_limit_s, memory_limit_mb=memory_limit_mb,
        leaderboard=leaderboard,
        leaderboard_source=f"MLE-bench leaderboard.csv ({len(leaderboard)} Kaggle teams)" if leaderboard else "",
        seed=seed,
        source=f"MLE-bench prepared competition at {prepared}; competition folder {comp}",
        answers_file=answers_file, grader_name=grader_name, grade_fn=grade_fn,
        dev_ids=dev_ids, competition_dir=comp,
        grader_source=source if grade_fn is not None else f"ours:{metric}",
        sample_submission_file=sample_file, split_by=split_by,
        leaderboard_error=leaderboard_error)
    try:
        task.baseline_score = task.grade(sample_file, "dev")
    except grading.InvalidSubmissionError as e:
        task.baseline_score, task.baseline_error = None, f"{sample_file.name} is invalid: {e}"
    return task
