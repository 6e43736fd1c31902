"""Streaming calibration: statistics of every tensor that could carry a Q/DQ pair.

The float model is run with ONNX Runtime on the calibration batches, one batch at a time, with every
candidate tensor exposed as an extra output; only running statistics are kept, so memory does not
grow with the number of batches. min/max/absmax come from one pass; entropy and percentile take a
second pass that fills a fixed-range histogram of |x| per tensor (2048 bins over [0, absmax]).

onnxruntime.quantization's calibrators were the first choice, but they keep intermediate outputs of
many batches in memory (MinMax with CalibMaxIntermediateOutputs) or re-bin signed histograms with
Python loops and print on every batch (HistogramCollector); the KL search below follows the same
TensorRT algorithm (reference distribution with clipped outliers folded into the last bin vs its
128-level quantized expansion), vectorised.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

import numpy as np
import onnx

from pipeline.data import Batch
from pipeline.placement import GraphIndex

log = logging.getLogger("tune.quantize")


def candidate_tensors(model: onnx.ModelProto) -> list[str]:
    """Float activations: graph inputs and outputs of non-constant nodes."""
    g = GraphIndex(model)
    seen: dict[str, None] = {}  # ordered set
    for name in sorted(g.graph_inputs):
        if name in g.float_tensors:
            seen[name] = None
    for node in model.graph.node:
        for o in node.output:
            if o and g.is_activation(o):
                seen[o] = None
    return list(seen)


def _augmented(model: onnx.ModelProto, tensors: list[str]) -> bytes:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    existing = {o.name for o in m.graph.output}
    for t in tensors:
        if t not in existing:
            m.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
    return m.SerializeToString()


class _Runner:
    def __init__(self, model: onnx.ModelProto, tensors: list[str], threads: int):
        import onnxruntime as ort

        so = ort.SessionOptions()
        # keep every intermediate tensor observable: no fusions that would remove them
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
        so.intra_op_num_threads = threads
        so.log_severity_level = 3
        self.session = ort.InferenceSession(_augmented(model, tensors), so, providers=["CPUExecutionProvider"])
        self.tensors = tensors

    def __call__(self, batch: Batch) -> dict[str, np.ndarray]:
        outs = self.session.run(self.tensors, batch.feeds)
        # padding samples (repeats of the last one) must not weigh in the statistics
        return {t: (o[: batch.valid] if o.ndim and o.shape[0] == len(next(iter(batch.feeds.values()))) else o)
                for t, o in zip(self.tensors, outs, strict=True)}


def kl_threshold(hist: np.ndarray, absmax: float, num_quantized_bins: int = 128) -> float:
    """TensorRT's entropy calibration on a histogram of |x| over [0, absmax]: the clipping threshold
    minimising KL(reference || quantized)."""
    nb = hist.size
    if hist.sum() == 0 or absmax <= 0:
        return float(absmax)
    hist = hist.astype(np.float64)
    width = absmax / nb
    step = max(1, nb // 512)
    best_i, best_kl = nb, np.inf
    suffix = np.concatenate([np.cumsum(hist[::-1])[::-1], [0.0]])
    for i in range(num_quantized_bins, nb + 1, step):
        ref = hist[:i]
        p = ref.copy()
        p[-1] += suffix[i]
        idx = (np.arange(i) * num_quantized_bins) // i
        nz = ref > 0
        qsum = np.bincount(idx, weights=ref, minlength=num_quantized_bins)
        qcnt = np.bincount(idx, weights=nz.astype(np.float64), minlength=num_quantized_bins)
        q = np.where(nz, qsum[idx] / np.maximum(qcnt[idx], 1.0), 0.0)
        p, q = _smooth(p), _smooth(q)
        if p is None or q is None:
            continue
        p /= p.sum()
        q /= q.sum()
        kl = float(np.sum(p * np.log(p / q)))
        if kl < best_kl:
            best_kl, best_i = kl, i
    return float(min((best_i + 0.5) * width, absmax))


def _smooth(counts: np.ndarray, eps: float = 1e-4) -> np.ndarray | None:
    """Move ``eps`` counts into every empty bin (taken evenly from the others) so KL stays finite
    when the quantized distribution misses a bin the reference has (as TensorRT/ORT calibrators do)."""
    zeros = counts == 0
    n_nonzero = counts.size - int(zeros.sum())
    if n_nonzero == 0:
        return None
    out = counts.astype(np.float64)
    out[zeros] += eps
    out[~zeros] -= eps * zeros.sum() / n_nonzero
    return out


def percentile_threshold(hist: np.ndarray, absmax: float, percentile: float) -> float:
    total = hist.sum()
    if total == 0 or absmax <= 0:
        return float(absmax)
    cdf = np.cumsum(hist) / total
    i = int(np.searchsorted(cdf, percentile / 100.0))
    return float(min((i + 1) * absmax / hist.size, absmax))


def collect(model: onnx.ModelProto, batches: Callable[[], Iterable[Batch]], algorithm: str, percentile: float,
            num_bins: int, threads: int, progress: Callable[[Iterable[Batch], str], Iterable[Batch]]) -> dict[str, dict]:
    """Statistics per candidate tensor: min, max, absmax, threshold, algorithm, samples."""
    tensors = candidate_tensors(model)
    runner = _Runner(model, tensors, threads)
    mins = {t: np.inf for t in tensors}
    maxs = {t: -np.inf for t in tensors}
    count = 0
    for batch in progress(batches(), "calibrating (pass 1: ranges)"):
        count += batch.valid
        for t, arr in runner(batch).items():
            if arr.size:
                mins[t] = min(mins[t], float(np.min(arr)))
                maxs[t] = max(maxs[t], float(np.max(arr)))
    if count == 0:
        from pipeline.errors import InputError

        raise InputError("calibration data yielded no samples; check the data config")
    stats: dict[str, dict] = {}
    for t in tensors:
        if not np.isfinite(mins[t]):
            continue
        absmax = max(abs(mins[t]), abs(maxs[t]))
        stats[t] = {"min": mins[t], "max": maxs[t], "absmax": absmax}
    if algorithm in ("entropy", "percentile"):
        hists = {t: np.zeros(num_bins, np.int64) for t in stats}
        for batch in progress(batches(), "calibrating (pass 2: histograms)"):
            for t, arr in runner(batch).items():
                s = stats.get(t)
                if s is None or s["absmax"] <= 0:
                    continue
                a = np.abs(arr.astype(np.float32, copy=False)).ravel()
                if algorithm == "entropy":
                    # exact zeros (ReLU outputs are often half zeros) are exact at any threshold; left
                    # in, their spike dominates the KL search and drags the threshold far too low
                    a = a[a != 0]
                idx = np.minimum((a * (num_bins / s["absmax"])).astype(np.int64), num_bins - 1)
                hists[t] += np.bincount(idx, minlength=num_bins)
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
    return stats
