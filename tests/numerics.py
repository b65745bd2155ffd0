"""Tolerances for comparing floating-point results that were computed in a different order.

Two correct implementations of the same math (dense vs blocked MoE dispatch, a sharded vs an
unsharded matmul, a jitted vs an eager path, the same kernel on AVX2 vs AVX-512) sum the same
terms in a different order. Each addition rounds to a relative ``eps`` of the running sum, so the
difference between the two results is not a fraction of the result but of the *terms summed*,
and it grows with the length of the reduction. A result that is small because its terms cancel
(a gradient entry of 0.01 made of a thousand terms of size 1) can differ by far more than
``rtol * |result|``, and a fixed ``atol`` tuned on values of size ~1 fails on values of size 100.

The model used here: for outputs whose every element is a reduction of ``reduction_len`` terms of
size at most ~``scale`` (default: the largest ``|expected|``, a proxy for the term size), the
rounding errors of the two orders are independent and add up like a random walk, so

    |actual - expected| <= atol = ulps * eps(dtype) * sqrt(reduction_len) * scale

elementwise. ``ulps`` absorbs the few roundings per term (a product, an exp, the steps of a
chained computation) and the tail of the random walk; the linear worst case ``reduction_len *
eps`` is not needed in practice and would hide real bugs on long reductions. A real mistake (a
wrong index, a missing term, a wrong scale) changes results by O(scale), orders of magnitude
above this bound, so the check still fails on it. The tolerance depends only on the data and on
the shape of the computation, never on the CPU model.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["tolerance", "assert_close"]


def _eps(dtype: Any) -> float:
    import ml_dtypes  # bf16 / fp8 are not numpy dtypes; ml_dtypes.finfo knows them and numpy's

    return float(ml_dtypes.finfo(ml_dtypes.bfloat16 if dtype in ("bfloat16", "bf16") else dtype).eps)


def _scale(expected: Any, scale: float | None) -> float:
    if scale is not None:
        return float(scale)
    values = np.abs(np.asarray(expected, dtype=np.float64))
    return float(np.nanmax(values)) if values.size else 0.0


def tolerance(expected: Any, *, reduction_len: int = 1, dtype: Any = np.float32, ulps: float = 8.0,
              scale: float | None = None) -> float:
    """The absolute tolerance ``ulps * eps(dtype) * sqrt(reduction_len) * scale``.

    Args:
      expected: the reference values (any array-like); their largest magnitude is the default scale.
      reduction_len: the number of terms summed into one output element (the contracted dimension
        of a matmul, the tokens a gradient sums over, ...); for a chain of reductions, the longest.
      dtype: the dtype the computation accumulates in (its eps is the unit of rounding).
      ulps: roundings per term times a safety margin (8 by default).
      scale: the size of the terms summed, when ``max|expected|`` understates it (a result made of
        large terms that cancel).

    Raises:
      ValueError: a reduction_len below 1, a negative ulps or scale.
    """
    if reduction_len < 1:
        raise ValueError(f"reduction_len must be >= 1, got {reduction_len}")
    if ulps < 0 or (scale is not None and scale < 0):
        raise ValueError(f"ulps and scale must be >= 0, got ulps={ulps}, scale={scale}")
    return ulps * _eps(dtype) * math.sqrt(reduction_len) * _scale(expected, scale)


def assert_close(actual: Any, expected: Any, *, reduction_len: int = 1, dtype: Any = np.float32,
                 ulps: float = 8.0, scale: float | None = None, err_msg: str = "") -> None:
    """Assert ``|actual - expected| <= tolerance(expected, ...)`` elementwise (see the module docstring).

    Shapes must match exactly; NaNs must sit at the same places. The failure message states the
    tolerance and its factors, so that a failure can be judged: a bug is off by a factor of
    thousands, a too-tight model by a factor near 1.
    """
    a = np.asarray(actual, dtype=np.float64)
    e = np.asarray(expected, dtype=np.float64)
    atol = tolerance(e, reduction_len=reduction_len, dtype=dtype, ulps=ulps, scale=scale)
    why = (f"atol {atol:.3g} = {ulps} ulps x eps {_eps(dtype):.3g} x sqrt({reduction_len}) "
           f"x scale {_scale(e, scale):.4g}")
    np.testing.assert_allclose(a, e, rtol=0, atol=atol, equal_nan=True, err_msg=f"{err_msg} ({why})".lstrip())
