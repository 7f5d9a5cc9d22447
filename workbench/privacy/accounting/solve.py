"""The one root solver of the accounting: where epsilon crosses its target.

Both searches a privacy number is chosen by run here: the smallest sigma that meets a target epsilon
(calibration.py, real) and the most steps that do (accountant.py, integers). The caller hands a bracket whose ends lie
on opposite sides of the target, ``epsilon(x) <= target`` at one (it meets) and ``>`` at the other (it misses); the
solver narrows it by regula falsi (Illinois) on log(epsilon / target) against log(x) and returns the end that meets.
Which side a point is on is decided by that exact comparison, never by the log gap (which only guesses the next
point), and the answer is always a point evaluated to meet: whatever the curve's shape, it meets the target, next to
one that misses (integers: one apart; real: within a factor ``1 + rtol``).
"""

from __future__ import annotations

import math
from typing import Callable


def meeting_end(epsilon: Callable[[float], float], target: float, lo: float, hi: float,
                rtol: float | None = None) -> float:
    """Of the bracket ``0 < lo < hi``, narrowed until its ends are integers one apart (``rtol`` None: ``lo``, ``hi``
    and every point evaluated are integers) or within a factor ``1 + rtol`` of each other, the end with
    ``epsilon(end) <= target``. Raises ``ValueError`` unless exactly one end of the given bracket meets the target
    (NaN misses)."""
    integer = rtol is None
    if not (0 < lo < hi) or (integer and not (lo == int(lo) and hi == int(hi))):
        raise ValueError(f"not a bracket: lo={lo!r}, hi={hi!r}" + (" (integers)" if integer else ""))
    e_lo, e_hi = epsilon(lo), epsilon(hi)
    lo_meets = e_lo <= target  # each end keeps its side: a point replaces the end on its own side
    if lo_meets == (e_hi <= target):
        raise ValueError(f"the bracket does not straddle target={target!r}: epsilon({lo!r}) = {e_lo}, "
                         f"epsilon({hi!r}) = {e_hi}")

    def gap(e: float) -> float:  # log(epsilon / target), the secant's ordinate
        return math.log(max(e, 1e-300)) - math.log(target)

    g_lo, g_hi = gap(e_lo), gap(e_hi)
    margin = None if integer else 0.25 * math.log1p(rtol)
    side = 0  # which end moved last: -1 lo, 1 hi
    while (hi - lo > 1) if integer else (hi / lo > 1 + rtol):
        a, b = math.log(lo), math.log(hi)
        x = b - g_hi * (b - a) / (g_hi - g_lo) if g_hi != g_lo else (a + b) / 2
        if x != x:  # a NaN epsilon at an end: bisect (the side it is on is still the exact comparison's)
            x = (a + b) / 2
        if integer:  # strictly inside: the bracket always shrinks (x kept in [a, b] first: exp cannot overflow)
            mid = min(max(round(math.exp(min(max(x, a), b))), lo + 1), hi - 1)
        else:
            mid = math.exp(min(max(x, a + margin), b - margin))
        e = epsilon(mid)
        if (e <= target) == lo_meets:
            lo, g_lo = mid, gap(e)
            if side == -1:  # Illinois: the same end moved twice in a row, halve the other end's weight
                g_hi /= 2
            side = -1
        else:
            hi, g_hi = mid, gap(e)
            if side == 1:
                g_lo /= 2
            side = 1
    return lo if lo_meets else hi
