"""Metric writers (JSON lines, TensorBoard, a terminal progress bar) and learning-curve plots.

One RL step ``s`` (``s`` = number of completed optimizer steps, as in `ace_jax.runtime.checkpoint`) writes
one record::

    {"step": s, "time": <unix seconds>, "reward/mean": 0.31, "task/spaceship/dev_score": 0.78, ...}

to ``<workdir>/metrics.jsonl`` (one JSON object per line, flushed after every write) and the same
scalars to a TensorBoard event file in ``<workdir>/tensorboard/``. Names use ``/`` as a group
separator; per-task scalars are ``task/<task id>/<name>`` (see `task_scalar`). Non-finite values
are written as JSON ``NaN`` / ``Infinity`` (Python's `json` reads them back).

Resume: after restoring the checkpoint of step ``s``, call ``writer.resume(s)``. Lines with a step
greater than ``s`` (written after that checkpoint, before a crash) are dropped from the JSONL file,
as is a torn last line left by ``kill -9``, and the TensorBoard writer is opened with
``purge_step = s + 1`` so TensorBoard hides the orphaned events of the earlier run. A step lower
than the last one written raises, so a forgotten ``resume`` cannot silently duplicate steps.

On a multi-host pod only process 0 should create a writer (the metrics are already all-reduced).

Remote workdirs (``gs://bucket/run``, any fsspec URL): the files are written to a local staging
directory (``local_dir``, default a fresh temporary directory) and uploaded with fsspec (the
whole JSONL file, config files and TensorBoard event files) at most every ``sync_interval_s``
seconds, on `flush`, on `resume` and on `close`. An existing remote ``metrics.jsonl`` is
downloaded first, so `resume` works across machines. A failed upload is logged and retried at the
next sync; it never stops training.

Terminal: a tqdm progress bar (on a TTY only) and one line per step with the numbers a researcher
watches (`STEP_LINE`), e.g.::

    step 3/20  reward 0.312  valid 0.5  score 0.781  learn 2.1s  gen 5.3s  sandbox 1.2s

printed above the bar, or alone when there is no bar (a log file). Everything else goes to the
files; `ace_jax.train.logs.configure_logging` keeps library INFO logs off the terminal.

The plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch).
"""
from __future__ import annotations

import json
import logging
import math
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

import numpy as np

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
_RESERVED = ("step", "time")

# The scalar names the trainer writes for the headline numbers. The progress bar shows these
# (label -> metric name) and `plot_curves` plots `DEFAULT_CURVES` by default.
HEADLINE: dict[str, str] = {
    "reward": "reward/mean",
    "valid": "rollout/valid_rate",
    "score": "score/dev_norm_mean",
    "tok/s": "perf/gen_tokens_per_s",
}
# The one line per step (`format_step_line`): label -> (scalar name, unit). A unit "s" prints the
# value as seconds with one decimal, the others 3 significant digits. Absent names are left out.
STEP_LINE: dict[str, tuple[str, str]] = {
    "reward": ("reward/mean", ""),                  # mean reward over the B x G rollouts
    "valid": ("rollout/valid_rate", ""),            # fraction of rollouts with a valid submission
    "score": ("score/dev_norm_mean", ""),           # mean normalised dev score of valid ones
    "learn": ("perf/learn_seconds", "s"),           # learner step
    "gen": ("perf/gen_seconds", "s"),               # generation
    "scripts": ("perf/sandbox_scripts", ""),        # scripts the sandbox ran for the step
    "ran": ("perf/sandbox_run_seconds", "s"),       # their wall seconds, added up
    "waited": ("perf/sandbox_wait_seconds", "s"),   # what of it the step waited for
}
DEFAULT_CURVES: tuple[str, ...] = (
    "rollout/valid_rate",          # fraction of completions that produced a valid submission
    "score/dev_norm_mean",         # mean task-normalised dev score of valid submissions
    "reward/mean",                 # mean reward over the B x G rollouts of the step
    "grpo/zero_var_frac",          # fraction of groups with zero reward variance (no gradient)
)


class CompileClock:
    """Seconds this process has spent in XLA compilation since ``start()``, from jax's own
    backend-compile events (``jax.monitoring``; a persistent-cache hit is not a compile).

    The trainer reads ``total`` around each loop iteration, so ``perf/compile_seconds`` says how
    much of ``perf/step_seconds`` was compiling (a new prompt bucket, the first step)."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.total = 0.0
        self._listening = False

    def _on_event(self, event: str, duration_secs: float, **_: Any) -> None:
        if event == self.EVENT:
            self.total += float(duration_secs)

    def start(self) -> "CompileClock":
        import jax.monitoring

        if not self._listening:
            jax.monitoring.register_event_duration_secs_listener(self._on_event)
            self._listening = True
        return self

    def stop(self) -> None:
        import jax.monitoring

        if self._listening:
            jax.monitoring.unregister_event_duration_listener(self._on_event)
            self._listening = False


def task_scalar(task_id: str, name: str) -> str:
    """The scalar name ``task/<task_id>/<name>`` for a per-task metric; both parts must be
    non-empty and free of ``/``."""
    for what, part in (("task_id", task_id), ("name", name)):
        if not isinstance(part, str) or not part or "/" in part:
            raise ValueError(f"{what} must be a non-empty string without '/', got {part!r}")
    return f"task/{task_id}/{name}"


def _to_float(key: str, value: Any) -> float:
    """A Python float from a number or a one-element array (numpy or jax); raises otherwise."""
    if isinstance(value, (str, bytes)) or value is None:
        raise TypeError(f"metric {key!r} must be a number or a one-element array, got {value!r}")
    try:
        arr = np.asarray(value)
    except Exception as e:  # pragma: no cover - exotic objects
        raise TypeError(f"metric {key!r} is not convertible to a number: {e}") from e
    if arr.size != 1 or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
        raise TypeError(f"metric {key!r} must be a number or a one-element numeric array, "
                        f"got dtype {arr.dtype} shape {arr.shape}")
    return float(arr.reshape(()))


def format_step_line(step: int, values: Mapping[str, float], total: int | None = None,
                     fields: Mapping[str, tuple[str, str]] | None = None) -> str:
    """The one terminal line of a step: ``step s[/total]`` then ``label value`` for each of
    `fields` (default `STEP_LINE`: label -> (scalar name, unit)) present in `values`, e.g.
    ``step 3/20  reward 0.312  valid 0.5  learn 2.1s``."""
    parts = [f"step {step}" if total is None else f"step {step}/{total}"]
    for label, (name, unit) in (STEP_LINE if fields is None else fields).items():
        if name not in values:
            continue
        v = float(values[name])
        parts.append(f"{label} {v:.1f}{unit}" if unit == "s" else f"{label} {v:.3g}{unit}")
    return "  ".join(parts)


def _is_tty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _read_records(path: str) -> tuple[list[dict], int]:
    """(records, number of undecodable lines) of a JSONL metrics file; a missing file is empty."""
    if not os.path.exists(path):
        return [], 0
    records, bad = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                bad += 1                          # a torn line (kill -9 mid-write)
                continue
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                bad += 1
                continue
            records.append(rec)
    return records, bad


def read_metrics(path: str) -> list[dict]:
    """The records of a ``metrics.jsonl`` file (or of ``<dir>/metrics.jsonl`` when `path` is a
    directory), in file order. Torn or malformed lines are skipped. Raises FileNotFoundError."""
    if os.path.isdir(path):
        path = os.path.join(path, METRICS_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics file at {path}")
    return _read_records(path)[0]


class MetricWriter:
    """Writes step scalars to ``<workdir>/metrics.jsonl`` and TensorBoard, and shows a tqdm bar.

    Args:
      workdir: a local directory (created if missing) or an fsspec URL such as ``gs://b/run``.
      tensorboard: also write TensorBoard event files under ``<workdir>/tensorboard``.
      jsonl: also append to ``<workdir>/metrics.jsonl``.
      progress_total: total steps for the progress bar (None: a bar without total).
      progress: show a bar at all; it is shown only when `progress_file` is a TTY.
      progress_file: the stream of the bar and of the step lines (default: sys.stderr).
      headline: bar label -> scalar name, the numbers shown with the bar (default `HEADLINE`).
      step_lines: print one `format_step_line` per `write` to `progress_file` (above the bar
        when there is one; TTY or not). `progress` does not turn them off.
      local_dir: staging directory for a remote `workdir` (default: a new temporary directory).
      sync_interval_s: minimum seconds between uploads of a remote `workdir` during `write`.
    """

    def __init__(self, workdir: str, *, tensorboard: bool = True, jsonl: bool = True,
                 progress_total: int | None = None, progress: bool = True,
                 progress_file: TextIO | None = None, headline: Mapping[str, str] | None = None,
                 local_dir: str | None = None, sync_interval_s: float = 30.0,
                 step_lines: bool = True):
        if not isinstance(workdir, (str, os.PathLike)) or not str(workdir):
            raise ValueError(f"workdir must be a non-empty path, got {workdir!r}")
        workdir = os.fspath(workdir)
        if progress_total is not None and int(progress_total) < 0:
            raise ValueError(f"progress_total must be >= 0, got {progress_total}")
        self.remote: str | None = None
        self._fs = None
        if "://" in workdir:
            import fsspec  # lazy: only remote workdirs need it

            self.remote = workdir.rstrip("/")
            self._fs, self._remote_path = fsspec.core.url_to_fs(self.remote)
            workdir = local_dir or tempfile.mkdtemp(prefix="ace_metrics_")
        self.workdir = workdir
        self.sync_interval_s = float(sync_interval_s)
        self._last_sync = 0.0
        os.makedirs(workdir, exist_ok=True)
        if self.remote is not None and jsonl:
            self._download(METRICS_FILE)
        self.jsonl_path = os.path.join(workdir, METRICS_FILE) if jsonl else None
        self.tensorboard_dir = os.path.join(workdir, TENSORBOARD_DIR) if tensorboard else None
        self.headline = dict(HEADLINE if headline is None else headline)
        self._progress_total = None if progress_total is None else int(progress_total)
        self._progress_file = sys.stderr if progress_file is None else progress_file
        self._progress = bool(progress) and _is_tty(self._progress_file)
        self._step_lines = bool(step_lines)
        self._jsonl: TextIO | None = None
        self._tb = None
        self._bar = None
        self._closed = False
        self._last_step: int | None = None
        if self.jsonl_path is not None:
            records, _ = _read_records(self.jsonl_path)
            if records:
                self._last_step = max(r["step"] for r in records)

    # -- remote workdir ----------------------------------------------------------------------

    def _remote(self, rel: str) -> str:
        return f"{self._remote_path.rstrip('/')}/{rel}"

    def _download(self, rel: str) -> None:
        src = self._remote(rel)
        try:
            if self._fs.exists(src):
                self._fs.get_file(src, os.path.join(self.workdir, rel))
        except Exception as e:  # noqa: BLE001 - reported; a fresh file is the safe fallback
            raise OSError(f"could not read {self.remote}/{rel}: {e}") from e

    def sync(self) -> bool:
        """Upload the local files to a remote workdir now; returns whether every upload worked
        (always True for a local workdir). Failures are logged, not raised."""
        if self.remote is None:
            return True
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()
        ok = True
        for root, _, files in os.walk(self.workdir):
            for f in files:
                if f.endswith(".tmp"):
                    continue
                local = os.path.join(root, f)
                rel = os.path.relpath(local, self.workdir).replace(os.sep, "/")
                try:
                    self._fs.makedirs(os.path.dirname(self._remote(rel)), exist_ok=True)
                    self._fs.put_file(local, self._remote(rel))
                except Exception as e:  # noqa: BLE001 - a transient storage error must not kill a run
                    ok = False
                    log.warning("metrics upload of %s to %s failed (retried at the next sync): %s",
                                rel, self.remote, e)
        self._last_sync = time.monotonic()
        return ok

    # -- lifecycle ---------------------------------------------------------------------------

    def resume(self, step: int) -> None:
        """Continue a run from the checkpoint of `step` (the last RL step whose metrics were
        written; -1 when none was): drop JSONL lines with step > `step` (and torn lines), purge
        later TensorBoard events, and start the bar at `step`. Must be called before the first
        `write` of this writer."""
        step = int(step)
        if step < -1:
            raise ValueError(f"resume step must be >= -1, got {step}")
        if self._jsonl is not None or self._tb is not None:
            raise RuntimeError("resume() must be called before the first write()")
        self._check_open()
        if self.jsonl_path is not None and os.path.exists(self.jsonl_path):
            records, bad = _read_records(self.jsonl_path)
            kept = [r for r in records if r["step"] <= step]
            if len(kept) != len(records) or bad:
                tmp = self.jsonl_path + ".tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    for r in kept:
                        f.write(json.dumps(r) + "\n")
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.jsonl_path)
            self._last_step = max((r["step"] for r in kept), default=None)
        else:
            self._last_step = None
        self._open(purge_step=step + 1, initial=max(step, 0))
        self.sync()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("MetricWriter is closed")

    def _open(self, purge_step: int | None, initial: int) -> None:
        if self.jsonl_path is not None and self._jsonl is None:
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if self.tensorboard_dir is not None and self._tb is None:
            from tensorboardX import SummaryWriter   # lazy: keeps import of this module light
            # A unique suffix: two writers opened within the same second (resume right after
            # a crash) would otherwise share, and overwrite, one event file name.
            self._tb = SummaryWriter(self.tensorboard_dir, purge_step=purge_step, flush_secs=30,
                                     filename_suffix=f".{os.getpid()}.{uuid.uuid4().hex[:8]}")
        if self._progress and self._bar is None:
            from tqdm.auto import tqdm
            self._bar = tqdm(total=self._progress_total, initial=initial, unit="step",
                             file=self._progress_file, dynamic_ncols=True)
            self._bar_step = initial

    def close(self) -> None:
        """Flush and close every sink; idempotent."""
        if self._closed:
            return
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        self.sync()
        self._closed = True
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._bar is not None:
            self._bar.close()

    def __enter__(self) -> "MetricWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writing -----------------------------------------------------------------------------

    def write(self, step: int, scalars: Mapping[str, Any]) -> dict:
        """Record `scalars` (name -> number or one-element array) for `step`; returns the record.

        Raises TypeError for a non-numeric value, ValueError for a reserved or empty name or for
        a step below the last one written (call `resume` first when restarting)."""
        self._check_open()
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = int(step)
        if not isinstance(scalars, Mapping):
            raise TypeError(f"scalars must be a mapping name -> value, got {type(scalars).__name__}")
        if self._last_step is not None and step < self._last_step:
            raise ValueError(f"step {step} is below the last step written ({self._last_step}) to "
                             f"{self.jsonl_path}; call resume(step) when restarting a run")
        values: dict[str, float] = {}
        for key, value in scalars.items():
            if not isinstance(key, str) or not key:
                raise ValueError(f"metric names must be non-empty strings, got {key!r}")
            if key in _RESERVED:
                raise ValueError(f"metric name {key!r} is reserved")
            values[key] = _to_float(key, value)
        if self._jsonl is None and self._tb is None and self._bar is None:
            self._open(purge_step=None, initial=self._last_step or 0)
        record = {"step": step, "time": round(time.time(), 3), **values}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in values.items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._bar is not None:
            shown = {label: values[name] for label, name in self.headline.items() if name in values}
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
            self._bar.update(max(0, step - self._bar_step))
            self._bar_step = max(self._bar_step, step)
            self._bar.refresh()
        if self._step_lines:
            self._print_step_line(step, values)
        self._last_step = step
        if self.remote is not None and time.monotonic() - self._last_sync >= self.sync_interval_s:
            self.sync()
        return record

    def _print_step_line(self, step: int, values: Mapping[str, float]) -> None:
        line = format_step_line(step, values, self._progress_total)
        if self._bar is not None:
            self._bar.write(line, file=self._progress_file)   # above the bar, which is redrawn
        else:
            self._progress_file.write(line + "\n")
            self._progress_file.flush()

    def flush(self) -> None:
        """Flush every sink (and upload, for a remote workdir)."""
        if self._jsonl is not None:
            self._jsonl.flush()
        if self._tb is not None:
            self._tb.flush()
        self.sync()

    def write_config(self, cfg: Any) -> tuple[str, str]:
        """Dump `cfg` (an `ml_collections.ConfigDict` or a mapping) to ``<workdir>/config.txt``
        (readable) and ``<workdir>/config.json``; also as TensorBoard text. Returns both paths."""
        self._check_open()
        if hasattr(cfg, "to_dict"):
            as_dict = cfg.to_dict()
        elif isinstance(cfg, Mapping):
            as_dict = dict(cfg)
        else:
            raise TypeError(f"cfg must be a ConfigDict or a mapping, got {type(cfg).__name__}")
        text = str(cfg)
        txt_path = os.path.join(self.workdir, "config.txt")
        json_path = os.path.join(self.workdir, "config.json")
        with open(txt_path, "w", encoding="utf-8") as f:
            f.write(text if text.endswith("\n") else text + "\n")
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(as_dict, f, indent=2, sort_keys=True, default=repr)
            f.write("\n")
        if self.tensorboard_dir is not None:
            if self._tb is None:
                self._open(purge_step=None, initial=self._last_step or 0)
            self._tb.add_text("config", "```\n" + text + "\n```", global_step=0)
        self.sync()
        return txt_path, json_path


# -- TensorBoard event reading (no tensorflow / tensorboard needed) ------------------------------

def _read_events(path: str) -> list:
    """The `Event` protos of one TFRecord event file; a truncated tail record is ignored."""
    import struct

    from tensorboardX.proto import event_pb2

    with open(path, "rb") as fh:
        data = fh.read()
    events, pos = [], 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack("<Q", data[pos:pos + 8])
        start = pos + 12
        if start + length + 4 > len(data):
            break
        events.append(event_pb2.Event.FromString(data[start:start + length]))
        pos = start + length + 4
    return events


def read_tensorboard_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value), ...] from the event files under `logdir` (no tensorflow or
    tensorboard needed), files in order of their first event's wall time.

    Like TensorBoard, a session restart (``SessionLog.START`` at step p, written by a resumed
    writer) purges the earlier events with step >= p. CRCs are not checked."""
    files = [os.path.join(d, f) for d, _, fs in os.walk(logdir) for f in fs if "tfevents" in f]
    if not files:
        raise FileNotFoundError(f"no TensorBoard event files under {logdir}")
    per_file = [_read_events(p) for p in files]
    per_file.sort(key=lambda evs: evs[0].wall_time if evs else 0.0)
    out: dict[str, list[tuple[int, float]]] = {}
    for events in per_file:
        for event in events:
            if event.HasField("session_log") and event.session_log.status == event.session_log.START:
                out = {tag: [(s, v) for s, v in pts if s < event.step] for tag, pts in out.items()}
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((int(event.step), float(v.simple_value)))
    return out


# -- plots ---------------------------------------------------------------------------------------

def _series(records: Iterable[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of `key`, one value per step (the last record wins), sorted by step."""
    by_step: dict[int, float] = {}
    for r in records:
        if key in r and r[key] is not None:
            by_step[int(r["step"])] = float(r[key])
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def smooth_ema(values: np.ndarray, weight: float) -> np.ndarray:
    """TensorBoard-style debiased exponential moving average; `weight` in [0, 1), 0 = none.
    Non-finite values are passed through and do not enter the average."""
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smooth weight must be in [0, 1), got {weight}")
    values = np.asarray(values, dtype=np.float64)
    if weight == 0.0:
        return values.copy()
    out = np.empty_like(values)
    acc, norm = 0.0, 0.0
    for i, v in enumerate(values):
        if not math.isfinite(v):
            out[i] = v
            continue
        acc = weight * acc + (1 - weight) * v
        norm = weight * norm + (1 - weight)
        out[i] = acc / norm
    return out


def _figure(n_panels: int, ncols: int):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = max(1, min(ncols, n_panels))
    nrows = math.ceil(n_panels / ncols)
    fig = Figure(figsize=(4.2 * ncols, 3.0 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(n_panels)]
    return fig, axes


def plot_curves(jsonl_path: str, out_png: str, keys: Sequence[str] = DEFAULT_CURVES, *,
                smooth: float = 0.0, ncols: int = 2, title: str | None = None) -> list[str]:
    """Plot the learning curves `keys` vs step from a metrics file into `out_png` (one panel per
    key; raw values faint, EMA-smoothed with weight `smooth` on top). Keys absent from the file
    are skipped; returns the keys plotted. Raises ValueError when none is present."""
    records = read_metrics(jsonl_path)
    present = [k for k in keys if _series(records, k)[0].size]
    if not present:
        available = sorted({k for r in records for k in r} - set(_RESERVED))
        raise ValueError(f"none of {list(keys)} is in {jsonl_path}; available: {available}")
    fig, axes = _figure(len(present), ncols)
    for ax, key in zip(axes, present):
        steps, vals = _series(records, key)
        if smooth > 0:
            ax.plot(steps, vals, color="C0", alpha=0.25, linewidth=1)
        ax.plot(steps, smooth_ema(vals, smooth), color="C0", linewidth=1.8)
        ax.set_title(key, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    fig.savefig(out_png, dpi=110)
    return present
