"""Where each MLE-bench competition stands on this host: prepared, staged, loaded, executed, graded.

Two checks, one row per competition (``launch/check_mlebench.py`` prints them):

  check_end_to_end(ids, ...)   MLE-bench Lite's competitions as a user has them, on synthetic raw
                               files in Kaggle's layout (``sandbox.tasks.mlebench_raw``):
                               MLE-bench's own preparer, staged to a bucket (or folder), fetched
                               and loaded as a run's host does (``ace_jax.env.tasks``), the
                               competition's baseline script run in the sandbox pool with the
                               run's settings and graded, the sample submission graded too.
  check_declared(ids)          every competition's declared files (``config.yaml``'s ``dataset``)
                               without raw data: a prepared folder is built from the declared
                               names alone and loaded; its grader imported.

A failure in one competition is recorded in its row (``failed``: the step and the error) and never
stops the others. ``summary(rows)`` is the closing JSON line.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import shutil
import tempfile
import time
import traceback
from typing import Any, Callable, Optional, Sequence

import pandas as pd

log = logging.getLogger("ace_jax.env.mlebench_check")

#: The steps of the end-to-end check, in order; a row's columns.
STEPS = ("prepared", "staged", "loaded", "executed", "valid")


@dataclasses.dataclass
class Row:
    """One competition's result. Steps not reached stay False; ``failed`` names the first that
    failed and why (empty when every step passed).

    Attributes:
      competition: the MLE-bench id.
      prepared, staged, loaded, executed, valid: the steps (see ``STEPS``).
      grader: ``MLEBenchTask.grader_source`` ("mlebench", "mlebench:staged", "ours:<metric>").
      sample_score: the sample submission's dev score (None: it did not grade).
      baseline_score: the baseline script's dev score (None: no valid submission).
      status: the execution's ``Status`` value ("" when it did not run).
      seconds: wall seconds of the whole row.
      failed: "" or "<step>: <error>".
      leaderboard: "" or why the reference leaderboard is unavailable.
    """

    competition: str
    prepared: bool = False
    staged: bool = False
    loaded: bool = False
    executed: bool = False
    valid: bool = False
    grader: str = ""
    sample_score: Optional[float] = None
    baseline_score: Optional[float] = None
    status: str = ""
    seconds: float = 0.0
    failed: str = ""
    leaderboard: str = ""

    @property
    def graded_by_mlebench(self) -> bool:
        return self.valid and self.grader.startswith("mlebench")


def _step(row: Row, name: str, fn: Callable[[], Any]) -> tuple[bool, Any]:
    """Runs one step: ``(True, its value)``, and the row's column ``name`` set when it is one of
    ``STEPS``; on an exception ``(False, None)`` with ``row.failed`` saying which and why."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - a competition's failure is its row, not the run's
        row.failed = f"{name}: {type(e).__name__}: {e}"
        log.warning("%s: %s failed\n%s", row.competition, name, traceback.format_exc())
        return False, None
    if name in STEPS:
        setattr(row, name, True)
    return True, out


def check_end_to_end(ids: Sequence[str], *, workdir: "str | pathlib.Path", dest: str = "",
                     sandbox: Any = None, n_rows: int = 200, seed: int = 0,
                     prepare_python: Optional[str] = None,
                     progress: Optional[Callable[[Row], None]] = None) -> list[Row]:
    """Runs each competition through the whole path a user's run takes (see the module doc).

    Args:
      ids: MLE-bench Lite competition ids (``sandbox.tasks.mlebench_raw.LITE``).
      workdir: scratch folder: ``raw/``, ``data/`` (prepared), ``cache/`` (what a host fetched).
      dest: where to stage: ``gs://bucket/prefix`` or a folder; "" = ``workdir/bucket``.
      sandbox: the pool's settings (a run config's ``sandbox`` section; None: the defaults).
      n_rows: the synthetic training set's size per competition.
      seed: seed of the synthetic data and of the dev split.
      prepare_python: the interpreter MLE-bench's preparers run in (``prepare_from_raw``'s
        ``python``); None: this process.
      progress: called with each finished row.

    Returns:
      one ``Row`` per competition, in the order of ``ids``.
    """
    from sandbox.pool import SandboxPool

    workdir = pathlib.Path(workdir)
    dest = dest or str(workdir / "bucket")
    pools: list = []    # one pool for every competition, made when the first one needs it

    def pool():
        if not pools:
            pools.append(SandboxPool.from_config(sandbox or {}))
        return pools[0]

    rows = []
    try:
        for cid in ids:
            t0 = time.monotonic()
            rows.append(_end_to_end_one(cid, workdir, dest, pool, n_rows=n_rows, seed=seed,
                                        prepare_python=prepare_python))
            rows[-1].seconds = round(time.monotonic() - t0, 1)
            if progress:
                progress(rows[-1])
    finally:
        for p in pools:
            p.close()
    return rows


def _end_to_end_one(cid: str, workdir: pathlib.Path, dest: str, pool: Callable[[], Any], *,
                    n_rows: int, seed: int, prepare_python: Optional[str]) -> Row:
    """One competition's row of ``check_end_to_end``; it stops at the first step that fails."""
    from ace_jax.env import mlebench_data, tasks as tasks_lib
    from sandbox.result import Status
    from sandbox.tasks import mlebench_raw

    row = Row(cid)
    raw = workdir / "raw" / cid
    if raw.exists():
        shutil.rmtree(raw)

    def prepare():
        mlebench_raw.write_synthetic_raw(cid, raw, n_rows=n_rows, seed=seed)
        mlebench_data.prepare_from_raw([cid], workdir / "raw", workdir / "data", overwrite=True,
                                       python=prepare_python)

    if not (_step(row, "prepared", prepare)[0] and _step(
            row, "staged", lambda: mlebench_data.stage(workdir / "data", [cid], dest))[0]):
        return row
    ok, loaded = _step(row, "loaded", lambda: tasks_lib.load_tasks(
        [cid], source="mlebench", data_dir=dest, cache_dir=str(workdir / "cache"), seed=seed))
    if not ok:
        return row
    task = loaded[0]
    row.grader, row.sample_score = task.grader_source, task.baseline_score
    row.leaderboard = task.leaderboard_error or ("" if task.leaderboard else "no leaderboard.csv")
    scripts = mlebench_raw.baseline_scripts(cid)
    if not scripts:
        row.failed = f"executed: no baseline script in {mlebench_raw.BASELINES_DIR / cid}"
        return row
    ok, result = _step(row, "executed", lambda: pool().run(task, scripts[0].read_text()))
    if not ok:
        return row
    row.status, row.baseline_score = result.status.value, result.dev_score
    if result.status is Status.SANDBOX_ERROR:
        row.executed = False
        row.failed = f"executed: sandbox_error: {result.error}"
    elif not result.valid_submission:
        row.failed = f"valid: {result.status.value}: {result.error} {result.stderr[-600:]}".strip()
    else:
        row.valid = True
        if task.baseline_score is None:
            row.failed = f"sample: {task.baseline_error}"
    return row


def _placeholder(path: pathlib.Path, id_column: str, target: str) -> None:
    """A tiny file of the declared kind at ``path`` (csv, jsonl, or a folder when it has no
    suffix)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps({id_column: str(i), target: 0}) + "\n"
                                for i in range(4)))
    elif path.suffix:
        pd.DataFrame({id_column: [str(i) for i in range(4)], target: 0}).to_csv(path, index=False)
    else:
        path.mkdir(exist_ok=True)


def check_declared(ids: Sequence[str], *, competitions_dir: Optional[pathlib.Path] = None,
                   progress: Optional[Callable[[Row], None]] = None) -> list[Row]:
    """Loads each competition from a prepared folder built from its declared file names alone.

    Per competition: the installed MLE-bench's ``config.yaml``; a placeholder file at every path
    its ``dataset`` declares (answers, sample submission, gold submission) and nothing else; then
    ``load_mlebench_task`` on that folder. ``loaded`` means every path the loader reads was the
    declared one; ``grader`` says whether MLE-bench's grader imported ("mlebench") or the loader
    fell back to ours. No raw data is needed; nothing is executed.
    """
    from sandbox.tasks import mlebench as mlebench_task

    rows = []
    with tempfile.TemporaryDirectory(prefix="check-declared-") as tmp:
        for cid in ids:
            row, t0 = Row(cid), time.monotonic()
            rows.append(row)
            comp = (competitions_dir / cid if competitions_dir is not None
                    else mlebench_task.find_competition_dir(cid, tmp))

            def build():
                cfg = mlebench_task.read_config(comp / "config.yaml")
                for path in mlebench_task.declared_files(cid, cfg, tmp).values():
                    _placeholder(path, "id", "target")

            row.prepared = _step(row, "build", build)[0]
            if row.prepared:
                ok, task = _step(row, "loaded", lambda: mlebench_task.load_mlebench_task(
                    cid, tmp, comp))
                if ok:
                    row.grader = task.grader_source
                    row.leaderboard = task.leaderboard_error
            row.seconds = round(time.monotonic() - t0, 1)
            if progress:
                progress(row)
    return rows


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    """The closing JSON: counts per step, ``graded_by_mlebench`` and ``failed`` (id -> reason)."""
    out: dict[str, Any] = {"competitions": len(rows)}
    for step in STEPS:
        out[step] = sum(bool(getattr(r, step)) for r in rows)
    out["graded_by_mlebench"] = sum(r.graded_by_mlebench for r in rows)
    out["failed"] = {r.competition: r.failed for r in rows if r.failed}
    return out


def table(rows: Sequence[Row]) -> str:
    """A fixed-width table, one row per competition."""
    def mark(v: bool) -> str:
        return "yes" if v else "-"

    def num(v: Optional[float]) -> str:
        return "-" if v is None else f"{v:.4g}"

    head = (f"{'competition':48s} {'prepared':>8s} {'staged':>6s} {'loaded':>6s} "
            f"{'executed':>8s} {'valid':>5s} {'grader':>16s} {'sample':>8s} {'baseline':>8s} "
            f"{'s':>6s}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.competition[:48]:48s} {mark(r.prepared):>8s} {mark(r.staged):>6s} "
                     f"{mark(r.loaded):>6s} {mark(r.executed):>8s} {mark(r.valid):>5s} "
                     f"{r.grader or '-':>16s} {num(r.sample_score):>8s} "
                     f"{num(r.baseline_score):>8s} {r.seconds:6.1f}")
    for r in rows:
        if r.failed:
            lines.append(f"  {r.competition}: {r.failed[:400]}")
    return "\n".join(lines)
