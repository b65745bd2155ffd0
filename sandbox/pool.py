"""``SandboxPool``: run agent code for tasks on N concurrent workers and grade it.

Each job is (task, code[, split]). A worker thread compiles the code in the host (a syntax error
never reaches a sandbox), hands it to the isolation backend (``sandbox.backends``), then turns
the backend's ``RawExecution`` into an ``ExecutionResult``: the status, the bounded output, the
reported metric (``sandbox.metric_parse``) and the grade of ./submission/submission.csv on the
hidden dev split (and the final-test split when ``split="test"``, evaluation only); those
steps are ``sandbox.execution.execute_and_grade``.

The pool never dies of one execution: any exception (a backend failure, a broken task object)
becomes status ``sandbox_error`` with the reason. ``close()`` kills running executions and
cancels queued ones. Example::

    with SandboxPool.from_config(default_config(), tasks=tasks) as pool:
        results = pool.map([(task, code_a), (task, code_b)])

What the pool refuses, with a typed error (``SandboxConfigError``), before anything runs:

  * ``sandbox.python`` that does not exist or is not a Python >= 3.11 (at construction);
  * more sandbox memory than the host can spare (``sandbox.memory_budget.SandboxBudgetError``,
    ``check_budget``): ``num_workers`` x the RAM one execution may hold (its memory budget, plus its RAM-backed
    dirs: bwrap's /tmp tmpfs and a working dir on /dev/shm, ``disk_mb`` each) + the idle warm
    interpreters must stay within the host's RAM less ``reserve_gb`` for the trainer. Checked at
    construction with ``max_memory_mb`` (the most any execution gets), else for the tasks given
    to ``from_config(tasks=)`` / ``check_tasks``, and at the first submission of a task with a
    larger budget than any checked before;
  * a task that requires isolation (``task.requires_isolation``: MLE-bench's, whose private
    answers lie on the host) on the process backend, unless ``allow_unisolated``
    (``IsolationRequiredError``, at ``check_tasks`` and at ``submit``).
"""
from __future__ import annotations

import concurrent.futures
import math
import threading
import time
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import ml_collections

from sandbox.backends import Backend, SandboxConfigError, make_backend
from sandbox.backends import base as backend_base
from sandbox.backends.warm import DEFAULT_PRELOAD
from sandbox.execution import SPLITS, execute_and_grade
from sandbox.memory_budget import MemoryBudget, host_memory_mb
from sandbox.result import ExecutionResult, Status


def default_config() -> ml_collections.ConfigDict:
    """Defaults of ``SandboxPool.from_config``; every knob of the pool and its backend.

    backend: "bwrap" (namespaces; the default isolation), "process" (no isolation beyond
    rlimits), "docker" (an engine is required). Limits time/memory come from each task;
    max_time_limit_s caps the time (seconds; 0 = each task's own budget), max_memory_mb the
    memory (MiB; 0 = each task's own budget).

    python: the interpreter of the executions ("" = the trainer's ``sys.executable``); for the
    Kaggle stack, ``DEST/bin/python`` of ``scripts/build_sandbox_env.sh DEST`` (a relative path is
    taken from the current directory). process and bwrap backends only.

    reserve_gb: GiB of the host's RAM kept for the trainer: the sandbox's worst case (see the
    module docstring) must fit in the rest. allow_unisolated: let the process backend run tasks
    that require isolation (MLE-bench's: generated code could read their private answers).

    preload: the modules a warm interpreter imports once per task, every execution of the task
    then forked from it (``sandbox.backends.warm``; bwrap only): "auto" = numpy, pandas and the
    common sklearn modules with bwrap and nothing with other backends; "" = every execution
    starts its own interpreter; or a comma-separated list. max_idle_warm: the most idle warm
    interpreters kept (~200 MB each).
    """
    cfg = ml_collections.ConfigDict()
    cfg.backend = "bwrap"
    cfg.num_workers = 2
    cfg.preload = "auto"
    cfg.max_idle_warm = 8
    cfg.max_code_bytes = 1 << 20
    cfg.max_time_limit_s = 0.0         # per execution: min(task's time_limit_s, this); 0 = off
    cfg.max_memory_mb = 0              # per execution: min(task's memory_limit_mb, this); 0 = off
    cfg.python = ""                    # the executions' interpreter; "" = the trainer's
    # host RAM (GiB) the sandbox's worst case leaves the trainer: a local run's trainer (small
    # models on CPU) holds a few GB; a pod config sets what its trainer needs (ace30b: 64)
    cfg.reserve_gb = 4.0
    cfg.allow_unisolated = False       # process backend: run tasks that require isolation anyway
    cfg.backend_options = ml_collections.ConfigDict({
        "root_dir": None,            # working dirs; None = $TMPDIR/ace_sandbox
        "keep": False,               # keep working dirs after each run
        "threads": 1,                # OMP/OPENBLAS/MKL thread count in the sandbox
        "use_cgroup": "auto",        # per-execution pids (+ memory) cgroup where the host allows it
        "output_head_bytes": 4096,
        "output_tail_bytes": 4096,
        "submission_max_mb": 256,
        "cpu_factor": 2.0,           # RLIMIT_CPU = ceil(time * cpu_factor) + 1
        "pids_max": 64,
        "file_size_mb": 256,
        "disk_mb": 1024,
        "open_files": 256,
        "grace_s": 1.0,
    })
    return cfg


def _backend_from(name_or_backend: Union[str, Backend], options: Mapping[str, Any],
                  max_time_limit_s: float, max_memory_mb: int = 0) -> Backend:
    if isinstance(name_or_backend, Backend):
        if options or max_time_limit_s or max_memory_mb:
            raise ValueError("backend options, python, allow_unisolated, max_time_limit_s and "
                             "max_memory_mb are only used when the backend is given by name (a "
                             "built backend has its own: Limits.max_time_s, ...)")
        return name_or_backend
    if max_time_limit_s:
        options = {**options, "max_time_s": max_time_limit_s}
    if max_memory_mb:
        options = {**options, "max_memory_mb": max_memory_mb}
    return make_backend(name_or_backend, **dict(options))


def _interpreter_options(backend: Union[str, Backend], python: str,
                         allow_unisolated: bool) -> dict[str, Any]:
    """The backend options of ``python`` and ``allow_unisolated`` (only those set)."""
    if not isinstance(python, str):
        raise TypeError(f"python must be a path string ('' = the trainer's), got {python!r}")
    if python and backend == "docker":
        raise SandboxConfigError(
            "sandbox.python names a host interpreter; the docker backend runs the image's own "
            "(backend_options.image, backend_options.python): leave sandbox.python empty")
    options: dict[str, Any] = {"python": python} if python else {}
    if allow_unisolated:
        options["allow_unisolated"] = True
    return options


def _check_memory_cap(value: Any) -> int:
    """``max_memory_mb`` as an int; TypeError / ValueError unless a whole number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
        raise TypeError(f"max_memory_mb must be a whole number of MiB, got {value!r}")
    if value < 0:
        raise ValueError(f"max_memory_mb must be >= 0 (0 = no cap), got {value!r}")
    return int(value)


def resolve_preload(preload: str, backend: Any) -> tuple[str, ...]:
    """The module names of ``default_config().preload`` ("auto", "" or "a,b,c") for ``backend``."""
    if not isinstance(preload, str):
        raise TypeError(f"preload must be a string ('auto', '' or 'numpy,pandas,...'), "
                        f"got {preload!r}")
    if preload.strip() == "auto":
        return DEFAULT_PRELOAD if backend == "bwrap" else ()
    return tuple(m.strip() for m in preload.split(",") if m.strip())


def _check_reserve(value: Any) -> float:
    """``reserve_gb`` as a float; TypeError / ValueError unless a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"reserve_gb must be a number of GiB, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"reserve_gb must be finite and >= 0, got {value!r}")
    return float(value)


def _check_time_cap(value: Any) -> float:
    """``max_time_limit_s`` as a float; TypeError / ValueError unless a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"max_time_limit_s must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"max_time_limit_s must be finite and >= 0 (0 = no cap), got {value!r}")
    return float(value)


class SandboxPool:
    """Runs executions on ``num_workers`` threads, each driving one sandboxed process tree.

    Args:
      backend: a ``Backend`` instance, or a registered name ("process", "bwrap", "docker").
      num_workers: concurrent executions.
      max_code_bytes: longer code is refused (runtime_error) without running.
      max_time_limit_s: the most wall-clock seconds any execution gets: each one runs for
        min(its task's ``time_limit_s``, this); 0 = no cap. The backend applies it and shows it
        as ``backend.limits.max_time_s``.
      max_memory_mb: the most memory (MiB) any execution gets: min(its task's
        ``memory_limit_mb``, this); 0 = no cap. With a cap, the memory budget is checked here.
      python: the interpreter of the executions ("" = the trainer's), see ``default_config``.
      reserve_gb: GiB of host RAM kept for the trainer (``check_budget``).
      allow_unisolated: let the process backend run tasks that require isolation.
      preload, max_idle_warm: warm interpreters (backend "bwrap" by name only), see
        ``default_config``; empty: every execution starts its own interpreter.
      **backend_options: passed to ``make_backend`` when ``backend`` is a name.

    Raises:
      ValueError / TypeError: a bad ``num_workers``, ``max_time_limit_s`` or ``max_memory_mb``,
        or options with a built backend. KeyError: an unknown backend name.
        SandboxUnavailableError: the backend cannot run here. SandboxConfigError: ``python`` is
        not a Python >= 3.11. SandboxBudgetError: with ``max_memory_mb``, the workers' worst case
        does not fit in the host's RAM less ``reserve_gb``.
    """

    def __init__(self, backend: Union[str, Backend] = "bwrap", num_workers: int = 2, *,
                 max_code_bytes: int = 1 << 20, max_time_limit_s: float = 0.0,
                 max_memory_mb: int = 0, python: str = "", reserve_gb: float = 4.0,
                 allow_unisolated: bool = False, preload: Sequence[str] = (),
                 max_idle_warm: int = 8, **backend_options: Any):
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        self.reserve_gb = _check_reserve(reserve_gb)
        if preload:
            if backend != "bwrap":
                raise ValueError(f"preload (warm interpreters) needs the bwrap backend, whose "
                                 f"PID namespace the zygote runs as init of; got {backend!r}")
            backend_options = {**backend_options, "preload": tuple(preload),
                               "max_idle_warm": int(max_idle_warm)}
        backend_options = {**backend_options,
                           **_interpreter_options(backend, python, allow_unisolated)}
        self.backend = _backend_from(backend, backend_options, _check_time_cap(max_time_limit_s),
                                     _check_memory_cap(max_memory_mb))
        self.num_workers = num_workers
        self._budget_lock = threading.Lock()
        self._budget_checked_mb = 0  # the largest per-execution memory budget checked (MiB)
        try:
            limits = self.backend.limits
            most = limits.memory_mb if limits.memory_mb is not None else limits.max_memory_mb
            if most:  # the most any execution gets is known now
                self.check_budget(memory_mb=most)
        except BaseException:
            self.backend.close()
            raise
        self.max_code_bytes = int(max_code_bytes)
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=num_workers, thread_name_prefix=f"sandbox-{self.backend.name}")
        self._lock = threading.Lock()
        self._cancel = threading.Event()
        self._closed = False
        self._running: dict[int, float] = {}
        self._next_id = 0
        self._busy_s = 0.0
        self._since = time.monotonic()

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any],
                    tasks: Optional[Iterable[Any]] = None) -> "SandboxPool":
        """Builds a pool from a config shaped like ``default_config()`` (missing keys: defaults).

        ``tasks``: the tasks it will run; when given, ``check_tasks(tasks)`` runs here (the pool
        is closed again if they are refused).
        """
        merged = default_config()
        merged.update(dict(cfg) if not isinstance(cfg, ml_collections.ConfigDict) else cfg.to_dict())
        options = merged.backend_options
        options = options.to_dict() if isinstance(options, ml_collections.ConfigDict) else dict(options)
        options = {k: v for k, v in options.items() if not (k == "root_dir" and v is None)}
        pool = cls(merged.backend, int(merged.num_workers),
                   max_code_bytes=int(merged.max_code_bytes),
                   max_time_limit_s=merged.max_time_limit_s,
                   max_memory_mb=merged.max_memory_mb, python=merged.python,
                   reserve_gb=merged.reserve_gb, allow_unisolated=bool(merged.allow_unisolated),
                   preload=resolve_preload(merged.preload, merged.backend),
                   max_idle_warm=int(merged.max_idle_warm), **options)
        if tasks is not None:
            try:
                pool.check_tasks(tasks)
            except BaseException:
                pool.close()
                raise
        return pool

    # ------------------------------------------------------------------------------------

    def memory_budget(self, memory_mb: int) -> MemoryBudget:
        """The worst case of ``num_workers`` executions with a memory budget of ``memory_mb`` MiB
        each, against this host (see ``MemoryBudget``)."""
        return MemoryBudget(
            num_workers=self.num_workers,
            per_execution=self.backend.ram_per_execution_mb(int(memory_mb)),
            resident=self.backend.resident_ram_mb(), host_mb=host_memory_mb(),
            reserve_mb=int(round(self.reserve_gb * 1024)))

    def check_budget(self, tasks: Iterable[Any] = (), *, memory_mb: Optional[int] = None) -> None:
        """Raises SandboxBudgetError unless ``num_workers`` executions of the largest memory budget
        among ``tasks`` (each task's, capped by ``max_memory_mb``) and ``memory_mb`` fit in the
        host's RAM less ``reserve_gb``. Budgets no larger than one checked before pass at once."""
        budgets = [b for b in map(self._memory_mb_of, tasks) if b is not None]
        largest = max(budgets + ([int(memory_mb)] if memory_mb is not None else []), default=0)
        with self._budget_lock:
            if largest <= self._budget_checked_mb:
                return
            self.memory_budget(largest).check()
            self._budget_checked_mb = largest

    def _memory_mb_of(self, task: Any) -> Optional[int]:
        """The memory budget (MiB) an execution of ``task`` gets; None for a task without a valid
        budget (its execution then fails with status sandbox_error, saying why)."""
        try:
            return backend_base.task_limits(task, self.backend.limits).memory_mb
        except (TypeError, ValueError):
            return None

    def check_tasks(self, tasks: Iterable[Any]) -> None:
        """Everything the pool refuses about ``tasks`` before running any: a task that requires
        isolation on a backend without it (IsolationRequiredError) and a memory budget the host
        cannot hold ``num_workers`` times (SandboxBudgetError). Call it once with the run's
        tasks; ``submit`` checks each task again (cheaply) in any case."""
        tasks = list(tasks)
        for task in tasks:
            self.backend.check_task(task)
        self.check_budget(tasks)

    # ------------------------------------------------------------------------------------

    def submit(self, task: Any, code: str, *, split: str = "dev"
               ) -> concurrent.futures.Future:
        """Queues one execution; the future's result is an ``ExecutionResult`` (never raises).

        Raises (at once, not in the future): TypeError for non-str code, ValueError for an
        unknown split, RuntimeError if the pool is closed, IsolationRequiredError for a task that
        requires isolation on a backend without it, SandboxBudgetError for a task whose memory
        budget the host cannot hold ``num_workers`` times (``check_tasks``).
        """
        if not isinstance(code, str):
            raise TypeError(f"code must be str, got {type(code).__name__}")
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        self.backend.check_task(task)
        self.check_budget((task,))
        with self._lock:
            if self._closed:
                raise RuntimeError("SandboxPool is closed")
            return self._executor.submit(self._work, task, code, split)

    def run(self, task: Any, code: str, *, split: str = "dev") -> ExecutionResult:
        """Runs one execution and waits for its result."""
        return self.submit(task, code, split=split).result()

    def map(self, jobs: Iterable[Union[Sequence[Any], Mapping[str, Any]]]) -> list[ExecutionResult]:
        """Runs many jobs concurrently; results come back in the order of ``jobs``.

        A job is ``(task, code)``, ``(task, code, split)`` or ``{"task":, "code":, "split":}``.
        """
        futures = []
        for job in jobs:
            if isinstance(job, Mapping):
                task, code, split = job["task"], job["code"], job.get("split", "dev")
            elif len(job) in (2, 3):
                task, code, split = (tuple(job) + ("dev",))[:3]
            else:
                raise ValueError(f"a job is (task, code[, split]) or a dict, got {job!r}")
            futures.append(self.submit(task, code, split=split))
        return [f.result() for f in futures]

    def utilization(self) -> float:
        """Busy worker-seconds / (num_workers x wall seconds) since start or ``reset_utilization``."""
        now = time.monotonic()
        with self._lock:
            busy = self._busy_s + sum(now - max(s, self._since) for s in self._running.values())
            wall = now - self._since
        return busy / (self.num_workers * wall) if wall > 0 else 0.0

    def reset_utilization(self) -> None:
        with self._lock:
            self._since = time.monotonic()
            self._busy_s = 0.0

    def close(self) -> None:
        """Cancels queued jobs, kills running executions, waits for the workers. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._cancel.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self.backend.close()

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------

    def _work(self, task: Any, code: str, split: str) -> ExecutionResult:
        with self._lock:
            job_id = self._next_id
            self._next_id += 1
            started = self._running[job_id] = time.monotonic()
        try:
            return execute_and_grade(self.backend, task, code, split=split, cancel=self._cancel,
                                     max_code_bytes=self.max_code_bytes)
        except Exception as e:  # the pool never dies of one execution
            return ExecutionResult(status=Status.SANDBOX_ERROR, error=f"{type(e).__name__}: {e}")
        finally:
            with self._lock:
                del self._running[job_id]
                self._busy_s += time.monotonic() - max(started, self._since)
