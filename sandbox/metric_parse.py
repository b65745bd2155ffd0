"""Parse the validation metric that agent code prints to stdout.

The agent is told to print one line ``VALIDATION_METRIC: <float>``. That strict form wins over
anything else. When no strict line exists, tolerant forms that LLM-written scripts commonly print
are accepted: ``Validation accuracy: 0.93``, ``val_rmse=1.2``, ``CV score = 0.81``,
``dev logloss: 0.3``. The last match in the text wins (scripts print per-epoch values and then the
final one). A winning value that is NaN or infinite is rejected (``None``): a diverged run has no
metric, and an earlier finite value would misreport it.

This is a self-report, never a reward by itself: the host scores a hidden dev split independently.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Optional

_FLOAT = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf(?:inity)?)"

# ``VALIDATION_METRIC: 0.93`` / ``VALIDATION_METRIC=0.93`` alone on its line.
_STRICT = re.compile(rf"^\s*VALIDATION_METRIC\s*[:=]\s*({_FLOAT})\s*$", re.IGNORECASE | re.MULTILINE)

# ``<val-word>[ _-<metric name>] [:=] <float>``: the metric name is at most 3 short words.
_TOLERANT = re.compile(
    r"(?<![A-Za-z0-9])(?P<key>(?:validation|valid|val|cv|dev|holdout|hold-out|oof)"
    r"(?:[ _\-/]+[A-Za-z][A-Za-z0-9@_\-]{0,24}){0,3})"
    rf"\s*[:=]\s*(?P<value>{_FLOAT})(?![A-Za-z0-9.])",
    re.IGNORECASE,
)


@dataclasses.dataclass(frozen=True)
class MetricMatch:
    """One parsed metric line.

    Attributes:
      value: the float printed (finite).
      name: the text before the separator (``VALIDATION_METRIC``, ``val_rmse``, ...).
      strict: True for the preferred ``VALIDATION_METRIC: <float>`` form.
      line: the whole line it came from (stripped).
    """

    value: float
    name: str
    strict: bool
    line: str


def find_metric(stdout: str) -> Optional[MetricMatch]:
    """Returns the winning metric line of ``stdout`` or None (absent, or the winner is NaN/inf)."""
    if not isinstance(stdout, str):
        raise TypeError(f"stdout must be str, got {type(stdout).__name__}")
    strict = list(_STRICT.finditer(stdout))
    if strict:
        m = strict[-1]
        return _finite(m.group(1), "VALIDATION_METRIC", True, _line_of(stdout, m.start()))
    last = None
    for m in _TOLERANT.finditer(stdout):
        last = m
    if last is None:
        return None
    return _finite(last.group("value"), last.group("key").strip(), False, _line_of(stdout, last.start()))


def parse_reported_metric(stdout: str) -> Optional[float]:
    """The reported validation metric as a float, or None. See the module docstring for forms."""
    match = find_metric(stdout)
    return None if match is None else match.value


def _finite(text: str, name: str, strict: bool, line: str) -> Optional[MetricMatch]:
    value = float(text)
    if not math.isfinite(value):
        return None
    return MetricMatch(value=value, name=name, strict=strict, line=line)


def _line_of(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start:end if end >= 0 else len(text)].strip()
