"""Aggregates over seeds, with their 95% confidence intervals: one definition for every table and figure.

The interval is Student's t interval of the mean, mean ± t(0.975, k − 1) · sd / √k over the k seeds that
count. With the 2–5 seeds a sweep here runs, a bootstrap interval is too narrow (it resamples only the values
seen, so it cannot be wider than their range); the t interval widens with few seeds as it should. It assumes the
seeds' values are roughly normal: for a handful of final losses that is an assumption, and the number of seeds
is always shown beside the interval so that a reader can weigh it. One seed has no interval.

    from analysis.stats import mean_ci
    mean_ci([0.12, 0.15, 0.11])        # Aggregate(mean=0.1267, lo=0.075..., hi=0.178..., k=3)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

LEVEL = 0.95


@dataclass(frozen=True)
class Aggregate:
    mean: float  # NaN when no value counts
    lo: float  # the interval; NaN with fewer than 2 values
    hi: float
    k: int  # how many values (seeds) it is over

    @property
    def half_width(self) -> float:
        return (self.hi - self.lo) / 2

    def text(self, fmt: str = ".3f") -> str:
        """`0.127 ± 0.051 (k=3)`: the mean, the half-width of the 95% interval and the number of seeds."""
        if self.k == 0:
            return "n/a"
        if self.k == 1:
            return f"{self.mean:{fmt}} (k=1)"
        return f"{self.mean:{fmt}} ± {self.half_width:{fmt}} (k={self.k})"


def t_quantile(k, level: float = LEVEL):
    """The two-sided Student's t quantile for k values (k − 1 degrees of freedom); k may be an array."""
    from scipy.stats import t

    return t.ppf(0.5 + level / 2, np.asarray(k) - 1)


def mean_ci(values: Iterable[float], level: float = LEVEL) -> Aggregate:
    """The mean of the finite values and its t interval. Non-finite values (NaN, a diverged run's inf) are not
    averaged: the caller decides which runs count, and says how many did not."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    v = v[np.isfinite(v)]
    k = len(v)
    if k == 0:
        return Aggregate(math.nan, math.nan, math.nan, 0)
    mean = float(v.mean())
    if k == 1:
        return Aggregate(mean, math.nan, math.nan, 1)
    half = float(t_quantile(k, level)) * float(v.std(ddof=1)) / math.sqrt(k)
    return Aggregate(mean, mean - half, mean + half, k)


def ci_frame(per_run: pd.DataFrame, level: float = LEVEL) -> pd.DataFrame:
    """Row-wise intervals of a frame whose columns are runs (the seeds of one curve, on one grid): columns
    mean, lo, hi, runs. Rows with one value have lo = hi = the value (no interval, no band drawn)."""
    k = per_run.notna().sum(axis=1)
    mean = per_run.mean(axis=1)
    sd = per_run.std(axis=1, ddof=1)
    q = pd.Series(t_quantile(k.clip(lower=2), level), index=per_run.index)
    half = (q * sd / np.sqrt(k)).where(k > 1, 0.0)
    return pd.DataFrame({"mean": mean, "lo": mean - half, "hi": mean + half, "runs": k})
