"""Clip thresholds from one tensor's calibration histograms: entropy (TensorRT's KL search), percentile,
and mse (the clip with the lowest expected quantization error), and auto's choice among them per storage
dtype (``searched_thresholds``).

mse picks, per tensor and per storage dtype, the clip threshold with the lowest expected
quantization error on that histogram (``range_mse``: clipped values cost their squared distance to
the clip edge, in-range values their squared distance to the nearest level, exact zeros nothing);
auto computes the minmax, percentile, entropy and mse thresholds and keeps the one with the lowest
such error. Both record ``thresholds`` per dtype, which ``TensorStats.params`` prefers
to ``threshold``: symmetric int8 and asymmetric uint8 are best clipped at different places. The KL
search follows TensorRT's algorithm (reference distribution with clipped outliers folded into the last
bin vs its 128-level quantized expansion), vectorised.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.quant.qmath import QTYPES


def kl_threshold(hist: np.ndarray, absmax: float, num_quantized_bins: int = 128, eps: float = 1e-4) -> float:
    """TensorRT's entropy calibration on a histogram of |x| over [0, absmax]: the clipping threshold
    minimising KL(reference || quantized).

    For each candidate length i (every ``nb // 512``-th bin from ``num_quantized_bins``) the reference
    is the first i bins with the clipped tail added to the last; the quantized distribution merges
    them into ``num_quantized_bins`` groups and spreads each group's count evenly over its non-empty
    bins. Both move ``eps`` counts into each of their empty bins, taken evenly from the others (as
    TensorRT's and ORT's calibrators smooth), so KL stays finite. Smoothing keeps each total, so the
    bins empty in both contribute one closed-form term and only the non-empty bins are visited; the
    group sums come from prefix sums (the counts are integers, so they are exact)."""
    nb = hist.size
    if hist.sum() == 0 or absmax <= 0:
        return float(absmax)
    h = hist.astype(np.float64)
    total = h.sum()
    cs = np.concatenate([[0.0], np.cumsum(h)])
    filled = h > 0
    n_filled = np.concatenate([[0], np.cumsum(filled)])
    positions = np.flatnonzero(filled)
    edges = np.arange(num_quantized_bins + 1)
    best_i, best_kl = nb, np.inf
    for i in range(num_quantized_bins, nb + 1, max(1, nb // 512)):
        nnz = int(n_filled[i])
        if nnz == 0:  # nothing below the threshold: no quantized distribution
            continue
        starts = -((-edges * i) // num_quantized_bins)  # each group's first bin, then i
        group_sum = cs[starts[1:]] - cs[starts[:-1]]
        group_filled = n_filled[starts[1:]] - n_filled[starts[:-1]]
        tail = total - cs[i]
        tail_bin = bool(tail > 0 and not filled[i - 1])  # the clipped tail lands in an empty last bin
        zeros_q = i - nnz
        zeros_p = zeros_q - tail_bin
        p_take, q_take = eps * zeros_p / (i - zeros_p), eps * zeros_q / nnz
        pos = positions[:nnz]
        ref = h[pos]
        if not tail_bin:
            ref = ref.copy()
            ref[-1] += tail
        g = (pos * num_quantized_bins) // i
        p = (ref - p_take) / total
        q = (group_sum[g] / group_filled[g] - q_take) / cs[i]
        kl = float(np.sum(p * np.log(p / q)))
        if zeros_p:  # bins empty in both: eps / total against eps / (total below the threshold)
            kl += zeros_p * (eps / total) * np.log(cs[i] / total)
        if tail_bin:
            last = (tail - p_take) / total
            kl += last * np.log(last / (eps / cs[i]))
        if kl < best_kl:
            best_kl, best_i = kl, i
    return float(min((best_i + 0.5) * (absmax / nb), absmax))


def percentile_threshold(hist: np.ndarray, absmax: float, percentile: float) -> float:
    total = hist.sum()
    if total == 0 or absmax <= 0:
        return float(absmax)
    cdf = np.cumsum(hist) / total
    i = int(np.searchsorted(cdf, percentile / 100.0))
    return float(min((i + 1) * absmax / hist.size, absmax))


# candidate clip thresholds of the mse search, as fractions of absmax (geometric: ~2.3% apart)
MSE_GRID = np.geomspace(0.01, 1.0, 200)
# exponent bits' floor (smallest normal exponent) and mantissa bits of the fp8 formats
_FP8_FORMAT = {"fp8_e4m3fn": (-6, 3), "fp8_e5m2": (-14, 2)}
# the order auto prefers on an exact tie: the simplest range first
AUTO_CANDIDATES = ("minmax", "percentile", "entropy", "mse")


def range_mse(hist: np.ndarray, lo: float, hi: float, dtype: str, thresholds: np.ndarray | float,
              zeros: int = 0) -> np.ndarray:
    """Expected squared quantization error per sample for each clip threshold in ``thresholds``.

    ``hist`` counts the non-zero values over [lo, hi] (the tensor's min and max); ``zeros`` the exact
    zeros, which every range represents exactly. The scale and zero point of a threshold are those of
    ``pipeline.quant.qmath.range_params``. Values are taken as uniform within their bin, and the error is
    integrated exactly over each bin: squared distance to the clip edge outside the representable
    range, to the nearest grid point inside it (fp8: the grid step of the bin's binade). This is
    step^2 / 12 where bins are wider than a step, and stays right for a spike on a grid point, such
    as the extreme values that minmax maps onto the last level exactly.
    """
    t = np.atleast_1d(np.asarray(thresholds, np.float64))[:, None]
    hist = np.asarray(hist, np.float64)
    total = hist.sum() + zeros
    if total == 0 or hi <= lo:
        return np.zeros(t.shape[0])
    width = (hi - lo) / hist.size
    used = np.flatnonzero(hist)  # empty bins add nothing: skip them (outlier tails are mostly empty)
    hist = hist[used]
    left = (lo + used * width)[None, :]
    right = left + width
    if dtype == "uint8":
        a = np.minimum(np.maximum(lo, -t), 0.0)
        b = np.maximum(np.minimum(hi, t), 0.0)
        exact = np.where(b > a, (b - a) / 255.0, 1.0)
        zp = np.clip(np.rint(-a / exact), 0, 255)  # as range_params: from the unrounded scale
        step = exact.astype(np.float32).astype(np.float64)  # the float32 scale the graph stores
        qlo, qhi = -zp * step, (255.0 - zp) * step
    elif dtype == "int8":
        step = np.where(t > 0, t / 127.0, 1.0).astype(np.float32).astype(np.float64)
        qlo, qhi = -128.0 * step, 127.0 * step
    else:
        qmax = QTYPES[dtype][3]
        emin, mant = _FP8_FORMAT[dtype]
        scale = np.where(t > 0, t / qmax, 1.0).astype(np.float32).astype(np.float64)
        qlo, qhi = -qmax * scale, qmax * scale
        center = np.abs(left + width / 2)
        step = np.exp2(np.floor(np.log2(np.maximum(center / scale, 2.0**emin))) - mant) * scale
    inside = (_rounding_integral(np.clip(right, qlo, qhi), step)
              - _rounding_integral(np.clip(left, qlo, qhi), step))
    below = (np.maximum(qlo - left, 0.0) ** 3 - np.maximum(qlo - right, 0.0) ** 3) / 3.0
    above = (np.maximum(right - qhi, 0.0) ** 3 - np.maximum(left - qhi, 0.0) ** 3) / 3.0
    return ((below + inside + above) @ hist) / (width * total)


def _rounding_integral(x: np.ndarray, step: np.ndarray) -> np.ndarray:
    """Integral from 0 to ``x`` of the squared distance to the nearest multiple of ``step``."""
    # in units of step: u = k + f, the integral is step^3 (k / 12 + g(f)); products instead of ** 3
    # (numpy's pow) halve the time of the mse search, which this dominates
    u = x / step
    k = np.floor(u)
    f = u - k
    g = 1.0 - f
    part = np.where(f <= 0.5, f * f * f, 0.25 - g * g * g) * (1.0 / 3.0)
    s3 = step * step * step
    return (k * (1.0 / 12.0) + part) * s3


# the mse search scans every _COARSE-th grid point, then every point of the one basin it finds
_COARSE = 8


def mse_threshold(hist: np.ndarray, lo: float, hi: float, dtype: str, zeros: int = 0) -> float:
    """The clip threshold in ``MSE_GRID`` x absmax with the lowest ``range_mse`` (the largest on a tie).

    For most tensors the error is smooth in the threshold (clipping error falls, rounding error
    grows): a coarse scan finds its one basin and only that is searched point by point, a fifth of
    the evaluations of a full scan, which dominated calibration time on models with hundreds of
    tensors. A coarse curve with several minima (values on a grid of their own) is scanned in full."""
    absmax = max(abs(lo), abs(hi))
    if absmax <= 0 or hi <= lo or hist.sum() == 0:
        return float(absmax)
    candidates = absmax * MSE_GRID
    n = len(candidates)
    coarse = np.unique(np.append(np.arange(0, n, _COARSE), n - 1))
    mse_c = range_mse(hist, lo, hi, dtype, candidates[coarse], zeros)
    padded = np.concatenate([[np.inf], mse_c, [np.inf]])
    minima = [j for j in range(len(coarse)) if padded[j + 1] <= padded[j] and padded[j + 1] <= padded[j + 2]]
    idx = np.arange(n)
    if len(minima) == 1:
        j = minima[0]
        basin = np.arange(coarse[max(j - 1, 0)], coarse[min(j + 1, len(coarse) - 1)] + 1)
        mse = range_mse(hist, lo, hi, dtype, candidates[basin], zeros)
        if _local_minima(mse) == 1:
            idx = basin
    if len(idx) == n:  # a jagged curve (values on a lattice of their own, e.g. 8-bit pixels): scan it all
        mse = range_mse(hist, lo, hi, dtype, candidates, zeros)
    return float(candidates[idx[len(mse) - 1 - int(np.argmin(mse[::-1]))]])


def _local_minima(values: np.ndarray) -> int:
    padded = np.concatenate([[np.inf], values, [np.inf]])
    return int(np.sum((padded[1:-1] <= padded[:-2]) & (padded[1:-1] <= padded[2:])))


def searched_thresholds(item: tuple[dict[str, Any], np.ndarray, int, np.ndarray | None], algorithm: str,
                        percentile: float, dtypes: tuple[str, ...]) -> dict[str, Any]:
    """One tensor's ``thresholds`` (one per storage dtype in ``dtypes``) and ``threshold`` (int8's) for
    mse or auto, and for auto ``chosen`` (the algorithm that won, per dtype) and ``candidates``; ``item``:
    its statistics so far (min, max, absmax), its signed histogram over [min, max], its exact zeros and
    (auto) its histogram of |x| with the zeros in. Module-level: calibration's worker processes run it."""
    s, signed, zeros, absolute = item
    lo, hi = s["min"], s["max"]
    thresholds, chosen, candidates = {}, {}, {}
    if algorithm == "auto":  # the dtype-independent candidates, once per tensor (the KL search is costly)
        nonzero = absolute.copy()
        nonzero[0] -= zeros  # the entropy pass leaves exact zeros out (see collect)
        shared = {"minmax": s["absmax"], "percentile": percentile_threshold(absolute, s["absmax"], percentile),
                  "entropy": kl_threshold(nonzero, s["absmax"])}
    for dt in dtypes:
        best = mse_threshold(signed, lo, hi, dt, zeros)
        if algorithm == "auto":
            cands = {**shared, "mse": best}
            mse = range_mse(signed, lo, hi, dt, np.array([cands[k] for k in AUTO_CANDIDATES]), zeros)
            chosen[dt] = AUTO_CANDIDATES[int(np.argmin(mse))]
            best = cands[chosen[dt]]
            for k, v in cands.items():
                candidates.setdefault(k, {})[dt] = float(v)
        thresholds[dt] = float(best)
    found: dict[str, Any] = {"thresholds": thresholds, "threshold": thresholds["int8"]}  # int8's for one-threshold readers
    if chosen:
        found.update(chosen=chosen, candidates=candidates)
    return found
