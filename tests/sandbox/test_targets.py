"""A task's score targets: validation, headroom, and the targets of a real task."""
import pytest

from sandbox.tasks import registry
from sandbox.tasks.targets import TaskTargets, task_targets


def test_task_targets_validation_and_headroom():
    with pytest.raises(ValueError, match="strictly above"):
        TaskTargets("t", gold=0.5, median=0.5, baseline=0.0)
    with pytest.raises(ValueError, match="strictly below"):
        TaskTargets("t", gold=2.0, median=1.0, baseline=3.0, lower_is_better=True)
    with pytest.raises(ValueError, match="finite"):
        TaskTargets("t", gold=float("nan"), median=0.5, baseline=0.0)
    hi = TaskTargets("hi", gold=0.9, median=0.7, baseline=0.5)
    lo = TaskTargets("lo", gold=1.0, median=2.0, baseline=4.0, lower_is_better=True)
    assert hi.headroom(0.8) == pytest.approx(0.5)     # (0.9 - 0.8) / 0.2
    assert hi.headroom(0.95) == 0.0 and hi.headroom(None) == 1.0  # baseline 0.5 -> clipped to 1
    assert lo.headroom(1.5) == pytest.approx(0.5)     # (1.5 - 1.0) / 1.0, lower is better
    assert lo.headroom(0.5) == 0.0
    assert lo.better(1.5, 1.2) == 1.2 and hi.better(None, 0.3) == 0.3


def test_task_targets_from_a_real_task(tmp_path):
    task = registry.load_task("iris-species", tmp_path, prepare_if_missing=True)
    t = task_targets(task)
    assert t.lower_is_better and t.baseline == pytest.approx(task.baseline_score)
    assert t.gold == task.gold and t.median == task.median and t.spread > 0
