"""Fixtures for the sandbox tests: a tiny task that follows the task contract, and pools.

The fake task: predict y = 2x. The public dir has train.csv (id, x, y), test.csv (id, x) and
sample_submission.csv; the private dir (a hidden path) holds the answers of the dev and test
splits of test.csv. ``grade`` returns the RMSE on the split and raises InvalidSubmissionError on
a wrong header, wrong ids or non-numeric predictions.
"""
from __future__ import annotations

import csv
import dataclasses
import math
import os
import pathlib
import uuid

import pytest

from sandbox.grading import InvalidSubmissionError

N_TRAIN, N_TEST = 20, 10


@dataclasses.dataclass(frozen=True)
class FakeTask:
    task_id: str
    public_dir: pathlib.Path
    private_dir: pathlib.Path
    time_limit_s: float = 3.0
    memory_limit_mb: int = 1024
    hidden_paths: tuple = ()
    grader_bug: bool = False

    def answers(self, split: str) -> dict[str, float]:
        with open(self.private_dir / f"{split}_answers.csv") as f:
            return {row["id"]: float(row["y"]) for row in csv.DictReader(f)}

    def grade(self, submission_csv: pathlib.Path, split: str) -> float:
        if self.grader_bug:
            raise RuntimeError("grader bug: answers file is corrupt")
        if split not in ("dev", "test"):
            raise ValueError(f"unknown split {split!r}")
        answers = self.answers(split)
        with open(submission_csv, newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames != ["id", "y"]:
                raise InvalidSubmissionError(f"columns must be ['id', 'y'], got {reader.fieldnames}")
            preds = {}
            for row in reader:
                try:
                    preds[row["id"]] = float(row["y"])
                except (TypeError, ValueError):
                    raise InvalidSubmissionError(f"non-numeric prediction for id {row['id']!r}")
        all_ids = set(self.answers("dev")) | set(self.answers("test"))
        if set(preds) != all_ids:
            raise InvalidSubmissionError(
                f"submission ids do not match test.csv ({len(set(preds) ^ all_ids)} differ)")
        return math.sqrt(sum((preds[i] - y) ** 2 for i, y in answers.items()) / len(answers))


def make_fake_task(root: pathlib.Path, **overrides) -> FakeTask:
    public, private = root / "public", root / "private"
    public.mkdir(parents=True)
    private.mkdir(parents=True)
    with open(public / "train.csv", "w") as f:
        f.write("id,x,y\n")
        for i in range(N_TRAIN):
            f.write(f"tr{i},{i},{2 * i}\n")
    ids = [f"{(i + 1) * 2654435761 % 2**32:08x}" for i in range(N_TEST)]
    xs = [float(3 * i + 1) for i in range(N_TEST)]
    with open(public / "test.csv", "w") as f:
        f.write("id,x\n")
        f.writelines(f"{i},{x}\n" for i, x in zip(ids, xs))
    with open(public / "sample_submission.csv", "w") as f:
        f.write("id,y\n")
        f.writelines(f"{i},0\n" for i in ids)
    (public / "description.md").write_text("Predict y from x. Metric: RMSE (lower is better).\n")
    for split, sl in (("dev", slice(0, N_TEST // 2)), ("test", slice(N_TEST // 2, None))):
        with open(private / f"{split}_answers.csv", "w") as f:
            f.write("id,y\n")
            f.writelines(f"{i},{2 * x}\n" for i, x in zip(ids[sl], xs[sl]))
    hidden = (os.fspath(private),) + sklearn_data_paths()
    kwargs = dict(task_id="fake-double", public_dir=public, private_dir=private, hidden_paths=hidden)
    kwargs.update(overrides)
    return FakeTask(**kwargs)


def sklearn_data_paths() -> tuple:
    """The sklearn bundled dataset dir: the kind of source file a real task must hide."""
    import importlib.util

    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        return ()
    data = pathlib.Path(spec.origin).parent / "datasets" / "data"
    return (os.fspath(data),) if data.is_dir() else ()


# A correct solution: reads ./input, writes ./submission/submission.csv, prints the metric.
GOOD_CODE = """
import csv
rows = list(csv.DictReader(open("input/test.csv")))
with open("submission/submission.csv", "w") as f:
    f.write("id,y\\n")
    for r in rows:
        f.write(f"{r['id']},{2 * float(r['x'])}\\n")
print("VALIDATION_METRIC: 0.0")
"""


@pytest.fixture(scope="session")
def fake_task(tmp_path_factory) -> FakeTask:
    return make_fake_task(tmp_path_factory.mktemp("fake_task"))


@pytest.fixture(scope="session")
def good_code() -> str:
    return GOOD_CODE


def bwrap_skip_reason() -> str:
    """"" if the bwrap backend can run here, else why not (printed in the skip)."""
    from sandbox.backends.bwrap import bwrap_available

    ok, detail = bwrap_available()
    return "" if ok else f"bubblewrap unusable here: {detail}"


TEST_LIMITS = dict(grace_s=0.3, file_size_mb=8, disk_mb=32, pids_max=32)


@pytest.fixture(scope="module", params=["process", "bwrap", "bwrap-warm"])
def pool(request, tmp_path_factory):
    """A 2-worker pool per backend, with small limits and a marker env var to find its processes.

    "bwrap-warm" forks every script from a warm interpreter that preloaded numpy
    (``sandbox.backends.warm``)."""
    from sandbox.pool import SandboxPool

    if request.param.startswith("bwrap"):
        reason = bwrap_skip_reason()
        if reason:
            pytest.skip(reason)
    token = uuid.uuid4().hex
    warm = dict(preload=("numpy",)) if request.param == "bwrap-warm" else {}
    p = SandboxPool(request.param.split("-")[0], num_workers=2,
                    root_dir=tmp_path_factory.mktemp("runs"),
                    extra_env={"ACE_TEST_POOL": token}, **warm, **TEST_LIMITS)
    p.test_token = token
    yield p
    p.close()


def leftover_processes(pool) -> list[int]:
    """Live processes of ``pool``'s executions: those carrying its token, but the warm
    interpreters it keeps between executions (their environment holds the token too)."""
    warm = getattr(pool.backend, "warm", None)
    resident = warm.resident_pids() if warm is not None else set()
    return [p for p in processes_with(pool.test_token) if p not in resident]


def processes_with(needle: str) -> list[int]:
    """Live (non-zombie) pids whose environment or command line contains ``needle``."""
    found = []
    raw = needle.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            blob = b""
            for name in ("environ", "cmdline"):
                with open(f"/proc/{entry}/{name}", "rb") as f:
                    blob += f.read()
        except (OSError, IndexError):
            continue
        if raw in blob:
            found.append(int(entry))
    return found
