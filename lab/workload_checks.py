"""What every workload builder of the lab shares (:mod:`~schedspec.lab.trace_formats`,
:mod:`~schedspec.lab.windows`, :mod:`~schedspec.lab.synthetic`): the error it raises and the checks of
its numbers.

Every bad input raises :class:`WorkloadError` (a ``ValueError``) with a one-line message naming the
file, the line and the field (or the parameter).
"""

from __future__ import annotations

import math
import re


class WorkloadError(ValueError):
    """A workload that cannot be built; the message names the file, line and field (or parameter)."""


DIGITS = re.compile(r"[0-9]+")
"""A non-negative decimal integer, ASCII digits only (token counts, ``n=``, ``seed=``)."""

MAX_TOKEN_COUNT = 2**31 - 1
"""Largest token count a trace row may carry (int32, the widest any engine's token counters use).
A larger count is not a request the spec could reject but a corrupt field: the file is refused at
that line. A count of 0 is kept (the spec rejects the request at arrival, with the reason)."""


def check_number(name: str, value: object, minimum: float | None = None, strict: bool = False) -> float:
    """``value`` as a float: finite, and ``> minimum`` (``strict``) or ``>= minimum``.

    Raises:
        WorkloadError: not a finite number (a bool is not a number), or below ``minimum``; the message
            names ``name``.
    """
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise WorkloadError(f"{name}={value!r}: must be a finite number")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise WorkloadError(f"{name}={value!r}: must be {'>' if strict else '>='} {minimum:g}")
    return float(value)
