"""percentile: the one definition the report, the server's timings, the lab and the load statistics share."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated q-th percentile (numpy's default method); 0.0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)
