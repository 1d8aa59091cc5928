"""Aggregates over seeds, with their 95% confidence intervals: one definition for every table and figure.

The interval is Student's t interval, m ± t(0.975, k − 1) · sd / √k over the k seeds that count, computed on a
scale where the quantity has no bounds and mapped back, so that it never leaves the quantity's range:
- a quantity that is positive (a loss, a time, τ) on the log scale: the interval is multiplicative, m·e^(±h),
  always above 0, wider above than below. With 2 seeds a loss's plain t interval (t = 12.7) reached below 0;
- a fraction (an accuracy) on the logit scale: the interval stays inside (0, 1);
- anything else (π, which may be 0) on its own scale.
The point is always the arithmetic mean, which a transformed interval (centred on the geometric mean) covers
unless the seeds differ by orders of magnitude; the number of seeds stands beside every interval.

With the 2–5 seeds a sweep here runs, a bootstrap interval is too narrow (it resamples only the values seen, so it
cannot be wider than their range); the t interval widens with few seeds as it should. It assumes the seeds' values
(on its scale) are roughly normal: for a handful of final losses that is an assumption. One seed has no interval.

Whether two settings' seeds tell them apart (`welch_p`: the tuning protocol's choice against its runner-up) is
Welch's t-test on the same scale.

    from analysis.stats import mean_ci, welch_p
    mean_ci([0.12, 0.15, 0.11])        # Aggregate(mean=0.1267, lo=0.08..., hi=0.19..., k=3): log scale
    mean_ci([0.97, 0.98], scale="logit")
    welch_p([0.12, 0.15, 0.11], [0.30, 0.33, 0.28])  # 0.0035: told apart at 95%
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import pandas as pd

LEVEL = 0.95
SCALES = ("auto", "linear", "log", "logit")


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
        """`0.127 [0.080, 0.190] (k=3)`: the mean, its 95% interval and the number of seeds."""
        if self.k == 0:
            return "n/a"
        if self.k == 1 or not np.isfinite(self.lo):
            return f"{self.mean:{fmt}} (k={self.k})"
        return f"{self.mean:{fmt}} [{self.lo:{fmt}}, {self.hi:{fmt}}] (k={self.k})"


def t_quantile(k, level: float = LEVEL):
    """The two-sided Student's t quantile for k values (k − 1 degrees of freedom); k may be an array."""
    from scipy.stats import t

    return t.ppf(0.5 + level / 2, np.asarray(k) - 1)


EPS = 1e-9  # a fraction of exactly 0 or 1 is taken as this far inside, where its logit is finite


def _scale(v: np.ndarray, scale: str) -> str:
    """`auto`: log where every value is positive, else linear."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale} is not one of {', '.join(SCALES)}")
    if scale == "auto":
        return "log" if len(v) and (v > 0).all() else "linear"
    return scale


def _forward(v, scale: str):
    if scale == "log":
        return np.log(v)
    if scale == "logit":
        p = np.clip(v, EPS, 1 - EPS)
        return np.log(p / (1 - p))
    return v


def _back(z, scale: str):
    if scale == "log":
        return np.exp(z)
    if scale == "logit":
        return 1 / (1 + np.exp(-z))
    return z


def mean_ci(values: Iterable[float], level: float = LEVEL, scale: str = "auto") -> Aggregate:
    """The mean of the finite values and its t interval, computed on `scale` (the module's docstring: `auto` is
    log for positive values, linear otherwise; `logit` for fractions). Non-finite values (NaN, a diverged run's
    inf) are not averaged: the caller decides which runs count, and says how many did not."""
    v = np.asarray([x for x in values if x is not None], dtype=float)
    v = v[np.isfinite(v)]
    k = len(v)
    if k == 0:
        return Aggregate(math.nan, math.nan, math.nan, 0)
    mean = float(v.mean())
    if k == 1:
        return Aggregate(mean, math.nan, math.nan, 1)
    s = _scale(v, scale)
    if s == "log" and not (v > 0).all():
        s = "linear"  # a zero among the values: no log scale for them
    z = _forward(v, s)
    half = float(t_quantile(k, level)) * float(z.std(ddof=1)) / math.sqrt(k)
    centre = float(z.mean())
    return Aggregate(mean, float(_back(centre - half, s)), float(_back(centre + half, s)), k)


def welch_p(a: Iterable[float], b: Iterable[float], scale: str = "auto") -> float:
    """The two-sided p-value of Welch's t-test that `a` and `b` (the finite values of two settings' seeds) have the
    same mean, on `scale` as `mean_ci` takes it (`auto`: log where every value of both is positive). Welch's, not
    Student's: two settings' seeds need not spread alike (a large η spreads more). NaN with fewer than 2 values on
    either side, where no test can be made; 0 when both are constant and differ."""
    from scipy.stats import ttest_ind

    x = np.asarray([v for v in a if v is not None], dtype=float)
    y = np.asarray([v for v in b if v is not None], dtype=float)
    x, y = x[np.isfinite(x)], y[np.isfinite(y)]
    if len(x) < 2 or len(y) < 2:
        return math.nan
    s = _scale(np.concatenate([x, y]), scale)
    if s == "log" and not ((x > 0).all() and (y > 0).all()):
        s = "linear"
    zx, zy = _forward(x, s), _forward(y, s)
    if zx.std() == 0 and zy.std() == 0:  # scipy answers NaN there: no spread, so any difference is told apart
        return 1.0 if zx.mean() == zy.mean() else 0.0
    return float(ttest_ind(zx, zy, equal_var=False).pvalue)


def ci_frame(per_run: pd.DataFrame, level: float = LEVEL, scale: str = "auto") -> pd.DataFrame:
    """Row-wise intervals of a frame whose columns are runs (the seeds of one curve, on one grid): columns
    mean, lo, hi, runs; on `scale` (`auto`: log where every value of the frame is positive). Rows with one value
    have lo = hi = the value (no interval, no band drawn)."""
    values = per_run.to_numpy(dtype=float)
    s = _scale(values[np.isfinite(values)], scale)
    k = per_run.notna().sum(axis=1)
    mean = per_run.mean(axis=1)
    z = pd.DataFrame(_forward(values, s), index=per_run.index, columns=per_run.columns)
    centre = z.mean(axis=1)
    sd = z.std(axis=1, ddof=1)
    q = pd.Series(t_quantile(k.clip(lower=2), level), index=per_run.index)
    half = (q * sd / np.sqrt(k)).where(k > 1, 0.0)
    lo = pd.Series(_back(centre - half, s), index=per_run.index).where(k > 1, mean)
    hi = pd.Series(_back(centre + half, s), index=per_run.index).where(k > 1, mean)
    return pd.DataFrame({"mean": mean, "lo": lo, "hi": hi, "runs": k})
