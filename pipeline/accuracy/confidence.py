"""How sure a verdict is: per-sample scores and the one confidence bound every budget check uses.

A verdict measured on a few held-out samples is a sample statistic, not a property of the model.
Every metric the budget reads (mean cosine, SNR over the outputs' energies, top-1 drop against the
labels, top-1 agreement with the float model, a custom metric) is a statistic of per-sample values,
and a model passes only when the budget holds at the bound of a one-sided percentile bootstrap over
those samples at ``accuracy.confidence``: the bound of a statistic on 8 samples lies further from
its value than on 800, so a verdict on few samples is stricter. The resamples are seeded, so the
same outputs always get the same bound. A custom metric that returns one number per call is
resampled over whole batches (its calls are few and dataset-level); one that returns a value per
sample is resampled like the built-in metrics.

A leaf: imports nothing of ours.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

RESAMPLES = 1000  # bootstrap resamples of per-sample arrays
CALL_RESAMPLES = 24  # resamples of a custom metric that is called once per resample
SEED = 20261125


def resample_indices(n: int, resamples: int = RESAMPLES) -> np.ndarray:
    """[resamples, n] indices drawn with replacement from range(n), seeded."""
    return np.random.default_rng(SEED + n).integers(0, n, size=(resamples, n))


def bound(statistic: Callable[[np.ndarray], np.ndarray], n: int, confidence: float, upper: bool = False,
          resamples: int = RESAMPLES) -> float:
    """The one-sided ``confidence`` bound (lower, or ``upper``) of a statistic of ``n`` samples.

    ``statistic`` maps an index array of shape [R, n] (R resamples) to R values; NaN resamples (a
    resample without a compared sample) are left out. With fewer than two samples there is nothing
    to resample and the bound is the statistic itself.
    """
    if n < 2:
        return float(statistic(np.arange(n)[None, :])[0]) if n else math.nan
    values = np.asarray(statistic(resample_indices(n, resamples)), dtype=np.float64)
    values = values[~np.isnan(values)]
    if values.size == 0:
        return math.nan
    # no interpolation: between two +inf resamples (identical outputs) it would be inf - inf
    return float(np.quantile(values, confidence if upper else 1.0 - confidence, method="inverted_cdf"))


def snr_db_of(signal: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """10 log10(signal / noise) elementwise; +inf without noise, -inf without signal."""
    with np.errstate(divide="ignore", invalid="ignore"):
        out = 10.0 * np.log10(signal / noise)
    out = np.where(noise == 0.0, np.inf, out)
    return np.where((signal == 0.0) & (noise > 0.0), -np.inf, out)


def _ratio(hits: np.ndarray, counts: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    def stat(idx: np.ndarray) -> np.ndarray:
        c = counts[idx].sum(axis=1)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(c > 0, hits[idx].sum(axis=1) / c, np.nan)
    return stat


@dataclass
class SampleScores:
    """Per-sample values of a model against the float model, one row per sample (in the order the
    batches came), one column per output. Energies of an output that is not batch-major are spread
    evenly over its batch's samples."""

    signal: list[np.ndarray] = field(default_factory=list)  # [k] per sample
    noise: list[np.ndarray] = field(default_factory=list)
    cosine: list[np.ndarray] = field(default_factory=list)  # NaN for outputs that are not float
    agree: list[np.ndarray] = field(default_factory=list)  # per output: agreeing, compared, decisive ...
    compared: list[np.ndarray] = field(default_factory=list)
    decisive_agree: list[np.ndarray] = field(default_factory=list)
    decisive: list[np.ndarray] = field(default_factory=list)
    drop: list[float] = field(default_factory=list)  # float hit - model hit, samples with labels only

    def add(self, columns: dict[str, np.ndarray], drop: np.ndarray | None) -> None:
        """Add one batch: ``columns`` maps each per-output attribute to a [valid, k] array."""
        for name, arr in columns.items():
            getattr(self, name).extend(np.asarray(arr, dtype=np.float64))
        if drop is not None:
            self.drop.extend(float(x) for x in drop)

    @property
    def n(self) -> int:
        return len(self.signal)

    def _col(self, name: str, output: int | None) -> np.ndarray:
        a = np.asarray(getattr(self, name), dtype=np.float64).reshape(self.n, -1)
        return a.sum(axis=1) if output is None else a[:, output]

    def snr_bound(self, output: int | None, confidence: float) -> float:
        """Lower bound of the SNR of ``output`` (None: over every output's energy)."""
        s, e = self._col("signal", output), self._col("noise", output)
        return bound(lambda idx: snr_db_of(s[idx].sum(axis=1), e[idx].sum(axis=1)), self.n, confidence)

    def cosine_bound(self, output: int, confidence: float) -> float:
        c = self._col("cosine", output)
        c = c[~np.isnan(c)]
        return bound(lambda idx: c[idx].mean(axis=1), c.size, confidence)

    def cosine_spread(self, output: int) -> tuple[float, float]:
        """(standard deviation, minimum) of the per-sample cosine of ``output``."""
        c = self._col("cosine", output)
        c = c[~np.isnan(c)]
        return (float(np.std(c)), float(np.min(c))) if c.size else (math.nan, math.nan)

    def snr_spread(self, output: int | None) -> tuple[float, float]:
        """(standard deviation, minimum) of the per-sample SNR of ``output`` in dB (finite samples)."""
        per = snr_db_of(self._col("signal", output), self._col("noise", output))
        per = per[np.isfinite(per)]
        return (float(np.std(per)), float(np.min(per))) if per.size else (0.0, math.inf)

    def agreement_bound(self, output: int, confidence: float, decisive: bool) -> float:
        hits, counts = ("decisive_agree", "decisive") if decisive else ("agree", "compared")
        h, c = self._col(hits, output), self._col(counts, output)
        keep = c > 0
        return bound(_ratio(h[keep], c[keep]), int(keep.sum()), confidence)

    def drop_bound(self, confidence: float) -> float:
        """Upper bound of the top-1 drop against the labels, in points."""
        d = np.asarray(self.drop, dtype=np.float64)
        return 100.0 * bound(lambda idx: d[idx].mean(axis=1), d.size, confidence, upper=True)
