"""MLE-bench competitions as the tests use them: synthetic raw files in Kaggle's layout
(``sandbox.tasks.mlebench_raw``), prepared by MLE-bench's own preparer; config.yaml, the grader
and description.md are the installed MLE-bench's. Under ``CI=true`` a missing MLE-bench is an
error, elsewhere the test is skipped."""
import os
import pathlib

import pytest


def require_mlebench() -> None:
    """Skips (fails under CI=true) when MLE-bench's registry does not import."""
    try:
        import mlebench.registry
        del mlebench
    except ImportError as e:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and MLE-bench is not importable ({e}): .ci/run installs it "
                        "with scripts/install_mlebench.sh")
        pytest.skip("MLE-bench is not installed (bash scripts/install_mlebench.sh PATH)")


def prepare(root: "os.PathLike | str", ids, *, n_rows: int = 200, seed: int = 0) -> pathlib.Path:
    """MLE-bench's data folder ``root/data`` with ``ids`` prepared by MLE-bench's preparers."""
    from ace_jax.env import mlebench_data

    require_mlebench()
    root = pathlib.Path(root)
    for cid in ids:
        mlebench_data.write_synthetic_raw(cid, root / "raw" / cid, n_rows=n_rows, seed=seed)
    mlebench_data.prepare_from_raw(list(ids), root / "raw", root / "data")
    return root / "data"
