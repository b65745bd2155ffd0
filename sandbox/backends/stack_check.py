"""The Kaggle-stack check: imports lightgbm, xgboost, catboost, torch and sklearn, fits a tiny model
with each, and prints their versions.

Two ways to run it:

  * directly, with the sandbox's interpreter: ``DEST/bin/python sandbox/backends/stack_check.py``
    (``scripts/build_sandbox_env.sh`` ends with it: a broken wheel fails the build). The check
    itself uses only the standard library at module level and imports nothing of this project;
  * inside a sandbox, from the trainer's environment: ``python -m sandbox.backends.stack_check
    --backend=bwrap --python=.sandbox-venv/bin/python`` builds a pool like the trainer's
    (``sandbox.backend``, ``sandbox.python``) and runs this file's source as the agent's code of
    a tiny task (``StackTask``), to show the stack also runs inside the namespaces (libgomp,
    torch's shared libraries, catboost's temp files find what they need there). It prints the
    sandbox's ``KAGGLE_STACK`` line and the status, and exits 0 when the status is ok.

Output: one line ``KAGGLE_STACK {"python": ..., "lightgbm": ..., ...}`` (JSON: each package's
version, and the training accuracy of its model under ``<name>_acc``), exit status 0. Any
failure raises, so the exit status is 1 and the traceback names the package.

Run as the agent's code of a task whose ./input has train.csv and test.csv with columns
(id, x[, y]) (the sandbox tests' fake task), it also writes ./submission/submission.csv from a
lightgbm regressor (``write_submission``) and adds ``"submission": true`` to the line.
"""
from __future__ import annotations

import json
import os
import pathlib
import sys
import tempfile

SCRIPT_PATH = pathlib.Path(__file__).resolve()
PACKAGES = ("numpy", "pandas", "sklearn", "scipy", "lightgbm", "xgboost", "catboost", "torch")
MARKER = "KAGGLE_STACK "


def tiny_dataset(n: int = 200, d: int = 5, seed: int = 0):
    """(X, y): ``n`` rows of ``d`` standard-normal features; y = 1 where a fixed linear score of
    them is > 0."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype("float32")
    y = (x @ np.linspace(1.0, -1.0, d) > 0).astype("int64")
    return x, y


def fit_all(x, y) -> dict:
    """Fits one small classifier per library on (x, y); returns {name_acc: training accuracy}."""
    import catboost
    import lightgbm
    import torch
    import xgboost
    from sklearn.linear_model import LogisticRegression

    out = {}
    models = {
        "sklearn": LogisticRegression(max_iter=200),
        "lightgbm": lightgbm.LGBMClassifier(n_estimators=20, num_leaves=7, verbose=-1,
                                            n_jobs=1),
        "xgboost": xgboost.XGBClassifier(n_estimators=20, max_depth=3, n_jobs=1),
        "catboost": catboost.CatBoostClassifier(iterations=20, depth=3, verbose=False,
                                                thread_count=1,
                                                train_dir=tempfile.mkdtemp(prefix="catboost-")),
    }
    for name, model in models.items():
        model.fit(x, y)
        out[f"{name}_acc"] = float((model.predict(x).reshape(-1).astype("int64") == y).mean())
    out["torch_acc"] = _fit_torch(torch, x, y)
    return out


def _fit_torch(torch, x, y, steps: int = 50) -> float:
    """A logistic regression in torch, ``steps`` of Adam on the full batch; training accuracy."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).float()
    model = torch.nn.Linear(x.shape[1], 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(xt).squeeze(1), yt)
        loss.backward()
        opt.step()
    with torch.no_grad():
        return float(((model(xt).squeeze(1) > 0).long() == torch.from_numpy(y)).float().mean())


def versions() -> dict:
    """{"python": "3.11.7", package: version} for ``PACKAGES`` (imports each)."""
    import importlib

    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        out[name] = importlib.import_module(name).__version__
    return out


def write_submission(path: pathlib.Path, test_csv: pathlib.Path, train_csv: pathlib.Path) -> None:
    """For a regression task with columns (id, x[, y]) such as the tests' fake task: fits a
    lightgbm regressor on train.csv and writes ``id,y`` predictions of test.csv to ``path``."""
    import lightgbm
    import pandas as pd

    train, test = pd.read_csv(train_csv), pd.read_csv(test_csv, dtype={"id": str})
    model = lightgbm.LGBMRegressor(n_estimators=50, min_child_samples=2, verbose=-1, n_jobs=1)
    model.fit(train[["x"]], train["y"])
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"id": test["id"], "y": model.predict(test[["x"]])}).to_csv(path, index=False)


class StackTask:
    """A tiny regression task in the sandbox's task contract (y = 2x; RMSE on the dev half)
    whose ``./input`` suits ``write_submission``. ``make`` writes its files under ``root``.

    Attributes: as ``sandbox.backends.base`` describes the task contract; ``memory_limit_mb``
    is 4096 (importing torch maps ~2.6 GB of address space, and RLIMIT_AS counts it).
    """

    task_id = "kaggle-stack-check"
    time_limit_s = 300.0
    memory_limit_mb = 4096
    hidden_paths: tuple = ()

    def __init__(self, root: pathlib.Path, n_train: int = 40, n_test: int = 10):
        self.public_dir = pathlib.Path(root) / "public"
        self.public_dir.mkdir(parents=True, exist_ok=True)
        self.answers = {f"t{i}": 2.0 * (i + 0.5) for i in range(n_test)}
        rows = "".join(f"r{i},{i},{2 * i}\n" for i in range(n_train))
        (self.public_dir / "train.csv").write_text("id,x,y\n" + rows)
        tests = "".join(f"t{i},{i + 0.5}\n" for i in range(n_test))
        (self.public_dir / "test.csv").write_text("id,x\n" + tests)

    def grade(self, submission_csv: pathlib.Path, split: str) -> float:
        """RMSE of the submission's ``y`` against 2x (every test id is graded, either split)."""
        import csv
        import math

        with open(submission_csv, newline="") as f:
            preds = {row["id"]: float(row["y"]) for row in csv.DictReader(f)}
        if set(preds) != set(self.answers):
            from sandbox.grading import InvalidSubmissionError

            raise InvalidSubmissionError("submission ids differ from test.csv's")
        return math.sqrt(sum((preds[k] - v) ** 2 for k, v in self.answers.items())
                         / len(self.answers))


def run_in_sandbox(backend: str, python: str, num_workers: int = 1, **pool_options):
    """Runs this file as the agent's code of a ``StackTask`` in a pool built like the trainer's
    (``SandboxPool.from_config``: ``sandbox.backend=backend``, ``sandbox.python=python``, then
    ``pool_options``); returns the ``ExecutionResult``."""
    from sandbox.pool import SandboxPool

    cfg = {"backend": backend, "python": python, "num_workers": num_workers, **pool_options}
    with tempfile.TemporaryDirectory(prefix="kaggle-stack-") as root:
        task = StackTask(pathlib.Path(root))
        with SandboxPool.from_config(cfg, tasks=[task]) as pool:
            return pool.run(task, SCRIPT_PATH.read_text())


def _sandbox_main(args) -> int:
    result = run_in_sandbox(args.backend, args.python)
    line = [l for l in result.stdout.splitlines() if l.startswith(MARKER)]
    if line:
        print(line[-1], flush=True)
    print(f"status={result.status.value} dev_rmse={result.dev_score} wall_s={result.wall_s:.1f} "
          f"backend={args.backend} python={args.python or sys.executable}", flush=True)
    if result.status.value != "ok":
        print(f"the Kaggle stack failed in the sandbox: {result.error}\n{result.stderr[-3000:]}",
              file=sys.stderr)
        return 1
    return 0


def main(argv: list) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="", help="run inside a sandbox of this backend "
                        "(bwrap, process) from the trainer's environment; empty: run here")
    parser.add_argument("--python", default="", help="the sandbox's interpreter (sandbox.python)")
    args = parser.parse_args(argv[1:])
    if args.backend:
        return _sandbox_main(args)
    report = versions()
    report.update(fit_all(*tiny_dataset()))
    low = {k: v for k, v in report.items() if k.endswith("_acc") and v < 0.8}
    if low:
        raise RuntimeError(f"a tiny model did not learn a linear rule: {low}")
    if os.path.isfile("input/test.csv") and os.path.isdir("submission"):
        write_submission(pathlib.Path("submission/submission.csv"),
                         pathlib.Path("input/test.csv"), pathlib.Path("input/train.csv"))
        report["submission"] = True
    print(MARKER + json.dumps(report, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
