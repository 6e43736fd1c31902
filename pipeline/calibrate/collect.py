"""Streaming calibration: statistics of every tensor that could carry a Q/DQ pair.

The float model is run with ONNX Runtime on the calibration batches, one batch at a time, with every
candidate tensor exposed as an extra output; only running statistics are kept, so memory does not
grow with the number of batches. min/max/absmax come from one pass; entropy and percentile take a
second pass that fills a fixed-range histogram of |x| per tensor (2048 bins over [0, absmax]); mse
fills a signed histogram over [min, max] instead (ORT's uint8 activations are asymmetric, so the
error of a clip depends on both tails), and auto fills both.

The thresholds are searched on those histograms (``pipeline.calibrate.search``): mse and auto record
``thresholds`` per storage dtype.

onnxruntime.quantization's calibrators were the first choice, but they keep intermediate outputs of
many batches in memory (MinMax with CalibMaxIntermediateOutputs) or re-bin signed histograms with
Python loops and print on every batch (HistogramCollector).
"""

from __future__ import annotations

import contextvars
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from pipeline.calibrate.search import AUTO_CANDIDATES, kl_threshold, percentile_threshold, searched_thresholds
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
    only one group's values are alive at a time. ``each`` runs the next batch while the caller reads one
    where two batches' values fit."""

    def __init__(self, model: onnx.ModelProto, tensors: list[str], threads: int, max_bytes: float | None = None):
        from pipeline.backends.onnxruntime.session import inference_session, ort_session_options

        self.groups, fits = _groups(model, tensors, max_bytes)
        self.ahead = fits and threads != 1  # one thread asked for: nothing beside ONNX Runtime's run
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

    def each(self, batches: Iterable[Batch]) -> Iterator[tuple[Batch, Iterator[tuple[str, np.ndarray]]]]:
        """Each batch with its tensors' values (``__call__``). Where one group holds every tensor and two
        batches' values fit the working set, the next batch runs in a worker thread while the caller reads
        this one's: ONNX Runtime's run releases the GIL, so it overlaps the caller's statistics."""
        if not self.ahead:
            for batch in batches:
                yield batch, self(batch)
            return
        it = iter(batches)
        with ThreadPoolExecutor(1, thread_name_prefix="qdq-tune-calibration") as pool:
            def ahead(batch: Batch | None) -> Future | None:  # in this run's context (its threads, weights)
                return None if batch is None else pool.submit(contextvars.copy_context().run, list, self(batch))

            batch = next(it, None)
            pending = ahead(batch)
            while batch is not None and pending is not None:
                values = pending.result()
                following = next(it, None)
                pending = ahead(following)
                yield batch, iter(values)
                batch = following

    def _samples(self, t: str, o: np.ndarray, batch: Batch, rows: int) -> np.ndarray:
        if t in self.stacked and o.size:
            # the iteration axes join the body tensor's first axis (its batch, for an RNN cell): a
            # conv tensor keeps its channels on axis 1. Which axis holds the batch inside a body is
            # unknown, so padding samples stay in (repeats of a real sample: the range is the same)
            axes = self.stacked[t][1]
            return o.reshape(-1, *o.shape[axes + 1:]) if o.ndim - axes >= 2 else o.reshape(-1, *o.shape[axes:])
        # padding samples (repeats of the last one) must not weigh in the statistics
        return o[: batch.valid] if o.ndim and o.shape[0] == rows else o


def _groups(model: onnx.ModelProto, tensors: list[str], max_bytes: float | None) -> tuple[list[list[str]], bool]:
    """(``tensors`` in groups whose values fit ``max_bytes`` beside the weights (ONNX Runtime's copy, and
    this process's where they are not on disk: pipeline.graph.weights); whether two batches' values of
    one group holding them all fit)."""
    from pipeline.graph.memory import GB, observation_groups, tensor_nbytes, weights_nbytes, weights_nbytes_of

    if max_bytes is None or max_bytes == float("inf"):
        return observation_groups(tensors, {}, None), True
    sizes = tensor_nbytes(model)
    held = sum(weights_nbytes_of(t) for t in model.graph.initializer if not weights.is_lazy(t))
    budget = max(max_bytes - weights_nbytes(model) - held, 0.0)
    groups = observation_groups(tensors, sizes, budget)
    if len(groups) == 1:
        return groups, 2 * sum(sizes.get(t, 0) for t in tensors) <= budget
    if len(groups) > 1:
        need = sum(sizes.get(t, 0) for t in tensors)
        log.info("calibration: the %d observed tensors take ~%.2f GB per batch, over the %.2f GB left beside the "
                 "weights (quantize.calibration.max_memory_gb): the model runs %d times per batch", len(tensors),
                 need / GB, budget / GB, len(groups))
    return groups, False


# one tensor's statistics while collect's passes fill them in (a TensorStats once they are complete)
Partial = dict[str, Any]


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
        for _, values in runner.each(passing("calibrating (pass 2: histograms)")):
            for t, arr in values:
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
    for batch, values in runner.each(batches):
        count += batch.valid
        for t, arr in values:
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
    ``thresholds`` for ``method.dtypes`` (``searched_thresholds``), in ``threads`` worker processes where
    the tensors are many (``map_in_workers``)."""
    algorithm, num_bins = method.algorithm, method.num_bins
    signed = {t: np.zeros(num_bins, np.int64) for t in stats}
    zeros = dict.fromkeys(stats, 0)
    absolute = {t: np.zeros(num_bins, np.int64) for t in stats} if algorithm == "auto" else {}
    for _, values in runner.each(batches):
        for t, arr in values:
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
    found = map_in_workers(searched_thresholds, items, algorithm, method.percentile, tuple(method.dtypes),
                           workers=threads)
    for s, thresholds in zip(stats.values(), found, strict=True):
        s.update(thresholds)
    if algorithm == "auto" and stats:
        wins = {dt: Counter(s["chosen"][dt] for s in stats.values() if "chosen" in s) for dt in method.dtypes}
        log.info("auto ranges (lowest histogram MSE of %s per tensor, %d tensors): %s",
                 "/".join(AUTO_CANDIDATES), len(stats),
                 "; ".join(f"{dt}: " + ", ".join(f"{k} {c[k]}" for k in AUTO_CANDIDATES if c[k])
                           for dt, c in wins.items()))
