"""Sandbox overhead and pool throughput, each measured against a peer in the same run.

1. Overhead: a trivial script (``print('hi')``) run N times as bare ``python -I -u script.py``
   (subprocess.run), through ``SandboxPool`` with the process backend, and through the pool with
   bubblewrap (with and without the per-execution pids cgroup; moving a process into a v1
   cgroup costs ~6-15 ms here, so the host thread steps into the cgroup to start the script
   instead, ~0.4 ms, see ``sandbox/backends/cgroup.py``); medians. ``overhead_ratio`` =
   pool+bwrap median / bare median (target <= 1.5). The same ratio is also measured for a script
   that imports numpy, pandas and scikit-learn (what every agent script starts with), where the
   fixed cost of the sandbox is amortised, and for that script forked from a warm interpreter
   that preloaded those imports (``--backend bwrap``: ``sandbox.backends.warm``).
2. Throughput: J CPU-bound scripts of about ``--job-s`` seconds each (a pure-Python loop
   calibrated here) on a 1-worker and a 2-worker bwrap pool. ``pool_speedup`` = 1-worker wall /
   2-worker wall (target >= 1.7 on 2 idle cores).

The last line printed is one JSON object with the ratios and the raw figures.

    python benchmarks/bench_sandbox.py [--n 20] [--jobs 4] [--job-s 1.0] [--backend bwrap]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time


from sandbox.backends.warm import DEFAULT_PRELOAD
from sandbox.pool import SandboxPool
from sandbox.result import Status


@dataclasses.dataclass(frozen=True)
class BenchTask:
    """A minimal task (the contract of sandbox/tasks); nothing here is graded."""

    task_id: str
    public_dir: pathlib.Path
    time_limit_s: float = 60.0
    memory_limit_mb: int = 2048
    hidden_paths: tuple = ()

    def grade(self, submission_csv, split):
        return 0.0


TRIVIAL = "print('hi')\n"
REALISTIC = "import numpy, pandas\nfrom sklearn.linear_model import LogisticRegression\nprint('hi')\n"


def loop_code(iterations: int) -> str:
    return f"x = 0\nfor i in range({iterations}):\n    x += i\nprint(x)\n"


def time_bare(python: str, script: pathlib.Path, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([python, "-I", "-u", os.fspath(script)], cwd=script.parent,
                       stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                       check=True)
        times.append(time.perf_counter() - t0)
    return times


def time_pool(pool: SandboxPool, task: BenchTask, code: str, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        r = pool.run(task, code)
        times.append(time.perf_counter() - t0)
        if r.status is not Status.NO_SUBMISSION:
            raise RuntimeError(f"benchmark script failed: {r.status} {r.error} {r.stderr[-300:]}")
    return times


def calibrate(python: str, seconds: float) -> int:
    """Loop iterations that take about ``seconds`` in a bare interpreter here."""
    probe = 2_000_000
    t0 = time.perf_counter()
    subprocess.run([python, "-I", "-c", loop_code(probe)], check=True, stdout=subprocess.DEVNULL)
    per_iter = (time.perf_counter() - t0) / probe
    return max(1, int(seconds / per_iter))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="runs per overhead measurement")
    ap.add_argument("--realistic-n", type=int, default=5, help="runs of the import-heavy script")
    ap.add_argument("--jobs", type=int, default=4, help="CPU-bound jobs per throughput measurement")
    ap.add_argument("--job-s", type=float, default=1.0, help="seconds of one CPU-bound job")
    ap.add_argument("--backend", default="bwrap", help="isolating backend to measure")
    ap.add_argument("--root-dir", default=None,
                    help="parent of the pool's working dirs (default: the backend's default)")
    args = ap.parse_args()

    python = sys.executable
    root = pathlib.Path(tempfile.mkdtemp(prefix="bench_sandbox-"))
    public = root / "public"
    public.mkdir()
    (public / "train.csv").write_text("id,x,y\n1,1,2\n")
    task = BenchTask("bench", public)
    script = root / "bare" / "solution.py"
    script.parent.mkdir()
    script.write_text(TRIVIAL)

    pool_dirs = {"root_dir": args.root_dir} if args.root_dir else {}
    # Warm the page cache of every path once.
    time_bare(python, script, 2)
    with SandboxPool("process", num_workers=1, **pool_dirs) as pool_proc, \
            SandboxPool(args.backend, num_workers=1, **pool_dirs) as pool_iso, \
            SandboxPool(args.backend, num_workers=1, use_cgroup=False, **pool_dirs) as pool_nocg:
        for p in (pool_proc, pool_iso, pool_nocg):
            time_pool(p, task, TRIVIAL, 2)
        # Interleave them so machine-load drift hits them alike.
        bare, proc, iso, nocg = [], [], [], []
        for _ in range(args.n):
            bare += time_bare(python, script, 1)
            proc += time_pool(pool_proc, task, TRIVIAL, 1)
            iso += time_pool(pool_iso, task, TRIVIAL, 1)
            nocg += time_pool(pool_nocg, task, TRIVIAL, 1)
        uses_cgroup = getattr(pool_iso.backend, "cgroup_parent", None) is not None
        root_dir = os.fspath(pool_iso.backend.root_dir)
    bare_s, proc_s, iso_s, nocg_s = (statistics.median(x) for x in (bare, proc, iso, nocg))
    print(f"trivial script, median of {args.n}: bare python {bare_s * 1e3:.1f} ms, "
          f"pool+process {proc_s * 1e3:.1f} ms, pool+{args.backend} {iso_s * 1e3:.1f} ms "
          f"(pids cgroup: {uses_cgroup}), pool+{args.backend} without cgroup {nocg_s * 1e3:.1f} ms")

    # The same comparison for a typical first step of an ML script (imports take ~1 s).
    real_script = script.parent / "real.py"
    real_script.write_text(REALISTIC)
    warm = dict(preload=DEFAULT_PRELOAD) if args.backend == "bwrap" else {}
    with SandboxPool(args.backend, num_workers=1, **pool_dirs) as pool_iso, \
            SandboxPool(args.backend, num_workers=1, **warm, **pool_dirs) as pool_warm:
        time_pool(pool_iso, task, REALISTIC, 1)
        time_pool(pool_warm, task, REALISTIC, 1)  # starts the warm interpreter
        real_bare, real_iso, real_warm = [], [], []
        for _ in range(args.realistic_n):
            real_bare += time_bare(python, real_script, 1)
            real_iso += time_pool(pool_iso, task, REALISTIC, 1)
            real_warm += time_pool(pool_warm, task, REALISTIC, 1)
    real_bare_s, real_iso_s, real_warm_s = (statistics.median(x)
                                            for x in (real_bare, real_iso, real_warm))
    print(f"numpy+pandas+sklearn imports, median of {args.realistic_n}: bare python "
          f"{real_bare_s * 1e3:.0f} ms, pool+{args.backend} {real_iso_s * 1e3:.0f} ms, "
          f"pool+{args.backend} forked from a warm interpreter {real_warm_s * 1e3:.0f} ms "
          f"(preload: {bool(warm)})")

    iterations = calibrate(python, args.job_s)
    code = loop_code(iterations)
    walls = {}
    for workers in (1, 2):
        with SandboxPool(args.backend, num_workers=workers, **pool_dirs) as pool:
            t0 = time.perf_counter()
            results = pool.map([(task, code)] * args.jobs)
            walls[workers] = time.perf_counter() - t0
        bad = [r for r in results if r.status is not Status.NO_SUBMISSION]
        if bad:
            raise RuntimeError(f"throughput job failed: {bad[0].status} {bad[0].error}")
        print(f"{args.jobs} CPU-bound jobs of ~{args.job_s:.1f} s on {workers} worker(s): "
              f"{walls[workers]:.2f} s")

    print(json.dumps({
        "overhead_ratio": iso_s / bare_s,
        "pool_speedup": walls[1] / walls[2],
        "backend": args.backend,
        "bare_python_ms": bare_s * 1e3,
        "pool_process_ms": proc_s * 1e3,
        "pool_isolated_ms": iso_s * 1e3,
        "process_overhead_ratio": proc_s / bare_s,
        "overhead_ratio_without_cgroup": nocg_s / bare_s,
        "overhead_ratio_sklearn_imports": real_iso_s / real_bare_s,
        "sklearn_imports_bare_ms": real_bare_s * 1e3,
        "sklearn_imports_pool_isolated_ms": real_iso_s * 1e3,
        "sklearn_imports_pool_warm_ms": real_warm_s * 1e3,
        "overhead_ratio_sklearn_imports_warm": real_warm_s / real_bare_s,
        "pool_isolated_without_cgroup_ms": nocg_s * 1e3,
        "uses_pids_cgroup": uses_cgroup,
        "throughput_wall_1_worker_s": walls[1],
        "throughput_wall_2_workers_s": walls[2],
        "jobs": args.jobs,
        "job_s": args.job_s,
        "n": args.n,
        "cpu_count": os.cpu_count(),
        "root_dir": root_dir,
        "load_avg_1m": os.getloadavg()[0],
    }))


if __name__ == "__main__":
    main()
