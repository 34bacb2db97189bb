"""The rounding model: unit round-off, ``gamma_n`` and the constants every bound is built from
(the one place where a format's arithmetic is modelled). NumPy only.

* ``u = eps / 2``: ``fl(a op b) = (a op b)(1 + d)``, ``|d| <= u`` (Higham 2002, eq. 2.4).
* ``gamma_n = n u / (1 - n u)``: ``n`` such factors compound to at most ``1 + gamma_n`` (Higham
  2002, Lemma 3.1); ``inf`` once ``n u >= 1``.
* ``C_EXP``, ``C_TRIG``: the assumed accuracy of ``exp`` and ``cos``/``sin``, in units of ``u``.
* ``K_S``, ``K_Y``: stored 16-bit intermediates on the logit and output chains (16-bit formats
  accumulate in float32 and round each stored result once).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

C_EXP = 4  # assumed accuracy of exp, in units of u (XLA's and NumPy's exp are within 1-2 ulp)
C_TRIG = 4  # assumed accuracy of cos/sin in units of u (absolute: |cos|, |sin| <= 1)
K_S = 8  # stored 16-bit intermediates on the logit chain (max over formulations)
K_Y = 8  # stored 16-bit intermediates on the output chain (max over formulations)


def finfo_of(dtype: Any) -> Any:
    """``finfo`` of a floating dtype, NumPy's or ml_dtypes' (bfloat16); ``ValueError`` otherwise."""
    try:
        return np.finfo(dtype)
    except (TypeError, ValueError):
        try:
            import ml_dtypes

            return ml_dtypes.finfo(dtype)
        except (ImportError, TypeError, ValueError):
            raise ValueError(f"expected a floating-point dtype, got {dtype!r}") from None


def unit_roundoff(dtype: Any) -> float:
    """The unit round-off ``u = eps / 2 = 2^-p`` of a floating dtype (``p``: significand bits).

    Args:
        dtype: a floating dtype: NumPy's (``float16``, ``float32``, ``float64``) or ml_dtypes'
            (``bfloat16``), as a type, a ``np.dtype`` or a name.

    Returns:
        ``u`` as a Python float (``2**-53`` for float64, ``2**-24`` float32, ``2**-11`` float16,
        ``2**-8`` bfloat16).

    Raises:
        ValueError: ``dtype`` is not a floating-point dtype (e.g. an integer or bool dtype).
    """
    return float(finfo_of(dtype).eps) / 2.0


def gamma(n: int, u: float) -> float:
    """``gamma_n = n u / (1 - n u)``: ``|prod_i (1 + d_i)^(+-1) - 1| <= gamma_n`` (n roundings).

    Args:
        n: the number of roundings (``>= 0``).
        u: the unit round-off (:func:`unit_roundoff`).

    Returns:
        ``gamma_n`` as a float; ``inf`` once ``n u >= 1``, where the first-order model gives no
        bound (every bound built from it is then ``inf``, never a wrong finite number).
    """
    nu = n * u
    return math.inf if nu >= 1.0 else nu / (1.0 - nu)


def is_16bit(dtype: Any) -> bool:
    """Whether ``dtype`` is a 16-bit format (float16, bfloat16): float32 accumulation model."""
    return np.dtype(dtype).itemsize == 2


def work_units(dtype: Any) -> tuple[np.dtype[Any], tuple[float, float]]:
    """The format a kernel computes in (float32 for 16-bit inputs) and ``(u, u_64)``: its unit
    round-off and float64's (the format's share of a bound, the oracle's)."""
    work = np.dtype(np.float32) if is_16bit(dtype) else np.dtype(dtype)
    return work, (unit_roundoff(work), unit_roundoff(np.float64))


def max_float(dtype: Any) -> float:
    """The largest finite value of a floating dtype (ml_dtypes' bfloat16 too)."""
    return float(finfo_of(dtype).max)
