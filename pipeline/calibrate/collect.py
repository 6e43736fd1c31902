"""Streaming calibration: statistics of every tensor that could carry a Q/DQ pair.

The float model is run with ONNX Runtime on the calibration batches, one batch at a time, with every
candidate tensor exposed as an extra output; only running statistics are kept, so memory does not
grow with the number of batches. min/max/absmax come from one pass; entropy and percentile take a
second pass that fills a fixed-range histogram of |x| per tensor (2048 bins over [0, absmax]); mse
fills a signed histogram over [min, max] instead (ORT's uint8 activations are asymmetric, so the
error of a clip depends on both tails), and auto fills both.

mse picks, per tensor and per storage dtype, the clip threshold with the lowest expected
quantization error on that histogram (``range_mse``: clipped values cost their squared distance to
the clip edge, in-range values their squared distance to the nearest level, exact zeros nothing);
auto computes the minmax, percentile, entropy and mse thresholds and keeps the one with the lowest
such error. Both record ``thresholds`` per dtype, which ``TensorStats.params`` prefers
to ``threshold``: symmetric int8 and asymmetric uint8 are best clipped at different places.

onnxruntime.quantization's calibrators were the first choice, but they keep intermediate outputs of
many batches in memory (MinMax with CalibMaxIntermediateOutputs) or re-bin signed histograms with
Python loops and print on every batch (HistogramCollector); the KL search below follows the same
TensorRT algorithm (reference distribution with clipped outliers folded into the last bin vs its
128-level quantized expansion), vectorised.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from pipeline.calibrate.workers import map_in_workers
from pipeline.data.adapters import Batch
from pipeline.graph import weights
from pipeline.graph.bodies import body_views, thread_out
from pipeline.graph.index import GraphIndex
from pipeline.quant.calibration import TensorStats
from pipeline.quant.qmath import QTYPES

log = logging.getLogger("tune.quantize")


def candidate_tensors(model: onnx.ModelProto) -> list[str]:
    """Float activations: graph inputs and outputs of non-constant nodes, of the main graph and of every
    Loop/Scan body (a body's outer-scope activations are the enclosing graph's)."""
    g = GraphIndex(model)
    seen: dict[str, None] = {}  # ordered set
    for name in sorted(g.graph_inputs):
        if name in g.float_tensors:
            seen[name] = None
    for node in model.graph.node:
        for o in node.output:
            if o and g.is_activation(o):
                seen[o] = None
    for view in body_views(model):
        seen.update(dict.fromkeys(candidate_tensors(view.model)))
    return list(seen)


class ActivationRunner:
    """Values of ``tensors`` per batch; those inside Loop/Scan bodies come out of a copy of the model
    that stacks them over the iterations (``pipeline.graph.bodies.thread_out``), each iteration a sample.

    With ``max_bytes`` (the working-set bound), the tensors are observed in groups that fit it beside
    the weights (``pipeline.graph.memory.observation_groups``): the model runs once per group and batch, and
    only one group's values are alive at a time."""

    def __init__(self, model: onnx.ModelProto, tensors: list[str], threads: int, max_bytes: float | None = None):
        from pipeline.backends.onnxruntime.session import inference_session, ort_session_options

        self.groups = _groups(model, tensors, max_bytes)
        model, self.stacked = thread_out(model, tensors)
        self.outputs = [self.stacked[t][0] if t in self.stacked else t for t in tensors]
        self._output = dict(zip(tensors, self.outputs, strict=True))
        # keep every intermediate tensor observable: no fusions that would remove them
        self.session = inference_session(model, ort_session_options("basic", threads=threads), extra_outputs=self.outputs)
        self.tensors = tensors
        self.note: Callable[[str], None] | None = None

    def __call__(self, batch: Batch) -> Iterator[tuple[str, np.ndarray]]:
        """(tensor, its values on ``batch``), one group of tensors at a time."""
        rows = len(next(iter(batch.feeds.values())))
        for i, group in enumerate(self.groups):
            if self.note is not None:  # the progress bar says which tensors the pass is on
                where = f"tensors {group[0]}..{group[-1]}" if len(group) > 1 else f"tensor {group[0]}"
                self.note(where + (f" (group {i + 1} of {len(self.groups)})" if len(self.groups) > 1 else ""))
            outs = self.session.run([self._output[t] for t in group], batch.feeds)
            for t, o in zip(group, outs, strict=True):
                yield t, self._samples(t, o, batch, rows)
            del outs

    def _samples(self, t: str, o: np.ndarray, batch: Batch, rows: int) -> np.ndarray:
        if t in self.stacked and o.size:
            # the iteration axes join the body tensor's first axis (its batch, for an RNN cell): a
            # conv tensor keeps its channels on axis 1. Which axis holds the batch inside a body is
            # unknown, so padding samples stay in (repeats of a real sample: the range is the same)
            axes = self.stacked[t][1]
            return o.reshape(-1, *o.shape[axes + 1:]) if o.ndim - axes >= 2 else o.reshape(-1, *o.shape[axes:])
        # padding samples (repeats of the last one) must not weigh in the statistics
        return o[: batch.valid] if o.ndim and o.shape[0] == rows else o


def _groups(model: onnx.ModelProto, tensors: list[str], max_bytes: float | None) -> list[list[str]]:
    """``tensors`` in groups whose values fit ``max_bytes`` beside the weights (ONNX Runtime's copy, and
    this process's where they are not on disk: pipeline.graph.weights)."""
    from pipeline.graph.memory import GB, observation_groups, tensor_nbytes, weights_nbytes, weights_nbytes_of

    if max_bytes is None or max_bytes == float("inf"):
        return observation_groups(tensors, {}, None)
    sizes = tensor_nbytes(model)
    held = sum(weights_nbytes_of(t) for t in model.graph.initializer if not weights.is_lazy(t))
    budget = max(max_bytes - weights_nbytes(model) - held, 0.0)
    groups = observation_groups(tensors, sizes, budget)
    if len(groups) > 1:
        need = sum(sizes.get(t, 0) for t in tensors)
        log.info("calibration: the %d observed tensors take ~%.2f GB per batch, over the %.2f GB left beside the "
                 "weights (quantize.calibration.max_memory_gb): the model runs %d times per batch", len(tensors),
                 need / GB, budget / GB, len(groups))
    return groups


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


# one tensor's statistics while collect's passes fill them in (a TensorStats once they are complete)
Partial = dict[str, Any]
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


def signed_histogram(arr: np.ndarray, lo: float, hi: float, num_bins: int) -> tuple[np.ndarray, int]:
    """Counts of the non-zero values over [lo, hi], and the number of exact zeros."""
    a = arr.astype(np.float32, copy=False).ravel()
    scale = num_bins / (hi - lo)
    idx = ((a - lo) * scale).astype(np.int64)
    np.clip(idx, 0, num_bins - 1, out=idx)
    counts = np.bincount(idx, minlength=num_bins)
    zeros = int(a.size - np.count_nonzero(a))
    if zeros:  # every zero went to the bin of 0, by the same arithmetic: taken out there (no masked copy)
        counts[np.clip(((np.zeros(1, a.dtype) - lo) * scale).astype(np.int64), 0, num_bins - 1)[0]] -= zeros
    return counts, zeros


def _error_minimizing(s: Partial, signed: np.ndarray, zeros: int, absolute: np.ndarray | None,
                      method: CalibrationMethod) -> None:
    """Fill ``thresholds`` (and for auto ``chosen``) of one tensor's statistics, one per ``method.dtypes``."""
    algorithm, percentile = method.algorithm, method.percentile
    lo, hi = s["min"], s["max"]
    thresholds, chosen, candidates = {}, {}, {}
    if algorithm == "auto":  # the dtype-independent candidates, once per tensor (the KL search is costly)
        nonzero = absolute.copy()
        nonzero[0] -= zeros  # the entropy pass leaves exact zeros out (see collect)
        shared = {"minmax": s["absmax"], "percentile": percentile_threshold(absolute, s["absmax"], percentile),
                  "entropy": kl_threshold(nonzero, s["absmax"])}
    for dt in method.dtypes:
        best = mse_threshold(signed, lo, hi, dt, zeros)
        if algorithm == "auto":
            cands = {**shared, "mse": best}
            mse = range_mse(signed, lo, hi, dt, np.array([cands[k] for k in AUTO_CANDIDATES]), zeros)
            chosen[dt] = AUTO_CANDIDATES[int(np.argmin(mse))]
            best = cands[chosen[dt]]
            for k, v in cands.items():
                candidates.setdefault(k, {})[dt] = float(v)
        thresholds[dt] = float(best)
    s["thresholds"] = thresholds
    s["threshold"] = thresholds["int8"]  # for readers that know one threshold only
    if chosen:
        s["chosen"] = chosen
        s["candidates"] = candidates


def _searched(item: tuple[Partial, np.ndarray, int, np.ndarray | None], method: CalibrationMethod) -> Partial:
    """What ``_error_minimizing`` adds to one tensor's statistics (item: them, its signed histogram, its
    exact zeros and its |x| histogram), on a copy: a worker process's result."""
    s, signed, zeros, absolute = item
    found = dict(s)
    _error_minimizing(found, signed, zeros, absolute, method)
    return {k: found[k] for k in ("thresholds", "threshold", "chosen", "candidates") if k in found}


def with_ranges(stats: dict[str, TensorStats], method: str) -> dict[str, TensorStats]:
    """Statistics from an ``auto`` calibration with every tensor clipped by ``method`` (one of
    AUTO_CANDIDATES), or by its per-tensor choice (``PER_TENSOR``); the candidates are dropped."""
    return {t: s.clipped_by(method) for t, s in stats.items()}


def channel_extremes(arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(min, max) per channel of an activation: channels on axis 1 of [N, C, ...] conv tensors (rank 4
    and 5), on the last axis otherwise ([N, C], [N, S, H] transformer tensors); a scalar or vector is
    one channel. The tensor's own min and max are the extremes of these."""
    if arr.ndim < 2:
        return np.atleast_1d(np.min(arr)), np.atleast_1d(np.max(arr))
    axis = 1 if arr.ndim >= 4 else arr.ndim - 1
    others = tuple(i for i in range(arr.ndim) if i != axis)
    return np.min(arr, axis=others), np.max(arr, axis=others)


def outlier_ratio(channel_max: np.ndarray) -> float:
    """Largest channel's absmax over the median of the non-zero ones: how much of a per-tensor scale's
    range a few outlier channels take from the others (BERT's FFN outputs: 40-230)."""
    pos = channel_max[channel_max > 0].astype(np.float64)  # float32 overflows on finfo.max masks
    return float(pos.max() / np.median(pos)) if pos.size else 1.0


@dataclass(frozen=True)
class CalibrationMethod:
    """How ranges are computed from the statistics: the algorithm (quantize.algorithm), the percentile
    of |x| that percentile (and auto) keep, and the histogram bins (quantize.calibration.num_bins)."""

    algorithm: str
    percentile: float
    num_bins: int = 2048
    # the activation storage dtypes the run can quantize to: mse and auto search a range for these
    # only (fp8 e4m3's lattice takes the full search, most of auto's time); int8 always (``threshold``)
    dtypes: tuple[str, ...] = tuple(QTYPES)

    def __post_init__(self):
        unknown = set(self.dtypes) - set(QTYPES)
        if unknown or "int8" not in self.dtypes:
            raise ValueError(f"calibration dtypes {sorted(self.dtypes)}: each one of {sorted(QTYPES)}, int8 among them")


def collect(model: onnx.ModelProto, batches: Callable[[], Iterable[Batch]], method: CalibrationMethod, threads: int,
            progress: Callable[[Iterable[Batch], str], Iterable[Batch]], max_bytes: float | None = None
            ) -> dict[str, TensorStats]:
    """Statistics per candidate tensor: min, max, absmax, threshold, algorithm, samples; with mse and auto
    also ``thresholds`` per storage dtype, and with auto ``chosen`` (the algorithm that won, per dtype).
    ``max_bytes`` bounds the working set (see ActivationRunner)."""
    algorithm, percentile, num_bins = method.algorithm, method.percentile, method.num_bins
    tensors = candidate_tensors(model)
    runner = ActivationRunner(model, tensors, threads, max_bytes)

    def passing(desc: str) -> Iterable[Batch]:
        bar = progress(batches(), desc)
        runner.note = getattr(bar, "set_postfix_str", None)  # a tqdm bar shows the tensors the pass is on
        return bar

    stats, count = _ranges(runner, passing("calibrating (pass 1: ranges)"))
    if algorithm in ("mse", "auto"):
        _error_minimizing_pass(stats, runner, passing("calibrating (pass 2: histograms)"), method, threads)
    if algorithm in ("entropy", "percentile"):
        hists = {t: np.zeros(num_bins, np.int64) for t in stats}
        for batch in passing("calibrating (pass 2: histograms)"):
            for t, arr in runner(batch):
                s = stats.get(t)
                if s is None or s["absmax"] <= 0:
                    continue
                # exact zeros (ReLU outputs are often half zeros) are exact at any threshold; left
                # in, their spike dominates the KL search and drags the threshold far too low
                hists[t] += _absolute_histogram(arr, s["absmax"], num_bins, drop_zeros=algorithm == "entropy")
        for t, s in stats.items():
            if algorithm == "entropy":
                s["threshold"] = kl_threshold(hists[t], s["absmax"])
            else:
                s["threshold"] = percentile_threshold(hists[t], s["absmax"], percentile)
    for s in stats.values():
        if algorithm == "minmax":
            s.setdefault("threshold", max(abs(s["min"]), abs(s["max"])))
        elif algorithm == "max":
            s.setdefault("threshold", s["absmax"])
        s["algorithm"] = algorithm
        s["samples"] = count
    return {t: TensorStats.from_dict(s) for t, s in stats.items()}


def _ranges(runner: ActivationRunner, batches: Iterable[Batch]) -> tuple[dict[str, Partial], int]:
    """(min, max, absmax and, for tensors with channels, ``channel_ratio`` per tensor that had values;
    the number of samples): the first pass."""
    tensors = runner.tensors
    mins = {t: np.inf for t in tensors}
    maxs = {t: -np.inf for t in tensors}
    channels: dict[str, np.ndarray] = {}
    count = 0
    for batch in batches:
        count += batch.valid
        for t, arr in runner(batch):
            if arr.size:
                lo, hi = channel_extremes(arr)
                mins[t] = min(mins[t], float(lo.min()))
                maxs[t] = max(maxs[t], float(hi.max()))
                if arr.ndim >= 2:
                    c = np.maximum(np.abs(lo), np.abs(hi))
                    channels[t] = c if t not in channels or channels[t].shape != c.shape else \
                        np.maximum(channels[t], c)
    if count == 0:
        from pipeline.errors import InputError

        raise InputError("calibration data yielded no samples; check the data config")
    stats: dict[str, Partial] = {}
    for t in tensors:
        if not np.isfinite(mins[t]):
            continue
        absmax = max(abs(mins[t]), abs(maxs[t]))
        stats[t] = {"min": mins[t], "max": maxs[t], "absmax": absmax}
        if t in channels:
            stats[t]["channel_ratio"] = outlier_ratio(channels[t])
    return stats, count


def _absolute_histogram(arr: np.ndarray, absmax: float, num_bins: int, drop_zeros: bool = False) -> np.ndarray:
    """Counts of |x| over [0, absmax] (``drop_zeros``: of the non-zero values)."""
    a = np.abs(arr.astype(np.float32, copy=False)).ravel()
    if drop_zeros:
        a = a[a != 0]
    idx = (a * (num_bins / absmax)).astype(np.int64)
    return np.bincount(np.minimum(idx, num_bins - 1, out=idx), minlength=num_bins)


def _error_minimizing_pass(stats: dict[str, Partial], runner: ActivationRunner, batches: Iterable[Batch],
                           method: CalibrationMethod, threads: int) -> None:
    """mse and auto: the second pass (signed histograms, and for auto those of |x|), then each tensor's
    ``thresholds`` for ``method.dtypes`` (``_error_minimizing``), in ``threads`` worker processes where the
    tensors are many (``map_in_workers``)."""
    algorithm, num_bins = method.algorithm, method.num_bins
    signed = {t: np.zeros(num_bins, np.int64) for t in stats}
    zeros = dict.fromkeys(stats, 0)
    absolute = {t: np.zeros(num_bins, np.int64) for t in stats} if algorithm == "auto" else {}
    for batch in batches:
        for t, arr in runner(batch):
            s = stats.get(t)
            if s is None or s["absmax"] <= 0:
                continue
            if s["max"] > s["min"]:
                h, z = signed_histogram(arr, s["min"], s["max"], num_bins)
                signed[t] += h
                zeros[t] += z
            if algorithm == "auto":  # with zeros: percentile counts them, entropy takes them out
                absolute[t] += _absolute_histogram(arr, s["absmax"], num_bins)
    items = [(s, signed[t], zeros[t], absolute.get(t)) for t, s in stats.items()]
    for s, found in zip(stats.values(), map_in_workers(_searched, items, method, workers=threads), strict=True):
        s.update(found)
    if algorithm == "auto" and stats:
        wins = {dt: Counter(s["chosen"][dt] for s in stats.values() if "chosen" in s) for dt in method.dtypes}
        log.info("auto ranges (lowest histogram MSE of %s per tensor, %d tensors): %s",
                 "/".join(AUTO_CANDIDATES), len(stats),
                 "; ".join(f"{dt}: " + ", ".join(f"{k} {c[k]}" for k in AUTO_CANDIDATES if c[k])
                           for dt, c in wins.items()))
