"""The float model's activations a pass reads: per-channel absmax of chosen tensors over the calibration
batches and rows sampled uniformly from them (smoothing's input), collected with the calibrator's
``ActivationRunner``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

log = logging.getLogger("tune.quantize")

SAMPLE_ROWS = 512


@dataclass(frozen=True)
class RowSample:
    """How many rows of each tensor ``channel_absmax`` keeps (drawn uniformly over all batches), and
    the seed of the draw."""

    max_rows: int = SAMPLE_ROWS
    seed: int = 0


def channel_absmax(model: onnx.ModelProto, batches_fn: Callable[[], Iterable[Any]], tensors: Sequence[str],
                   threads: int = 1, sample: RowSample = RowSample(), max_bytes: float | None = None
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-channel (last axis) absmax of ``tensors`` over the float model's run on ``batches_fn()``
    (``pipeline.data.adapters.Batch`` objects or plain feed dicts), and up to ``sample.max_rows`` rows of
    each tensor reshaped to [-1, K], drawn uniformly over all batches (smallest random keys kept);
    ``max_bytes`` bounds the working set (``ActivationRunner``)."""
    from pipeline.calibrate.collect import ActivationRunner
    from pipeline.data.adapters import Batch

    runner = ActivationRunner(model, list(tensors), threads, max_bytes)
    max_rows = sample.max_rows
    rng = np.random.default_rng(sample.seed)
    absmax: dict[str, np.ndarray] = {}
    keys: dict[str, np.ndarray] = {}
    rows: dict[str, np.ndarray] = {}
    for batch in batches_fn():
        if not isinstance(batch, Batch):
            feeds = {k: np.asarray(v) for k, v in dict(batch).items()}
            first = next(iter(feeds.values()))
            batch = Batch(feeds, None, int(first.shape[0]) if first.ndim else 1)
        for t, arr in runner(batch):
            if arr.ndim == 0 or arr.size == 0:
                continue
            a = np.asarray(arr, np.float32).reshape(-1, arr.shape[-1])
            m = np.abs(a).max(axis=0)
            if t in absmax and absmax[t].shape != m.shape:
                log.warning("channel_absmax: %s changes its last dimension between batches; skipped", t)
                continue
            absmax[t] = np.maximum(absmax[t], m) if t in absmax else m
            u = rng.random(a.shape[0])
            if t in keys:
                u, a = np.concatenate([keys[t], u]), np.concatenate([rows[t], a])
            if u.size > max_rows:
                keep = np.argpartition(u, max_rows)[:max_rows]
                u, a = u[keep], a[keep]
            keys[t], rows[t] = u, a
    return absmax, {t: rows[t] for t in absmax}


__all__ = ["SAMPLE_ROWS", "RowSample", "channel_absmax"]
