"""Quantization math: storage types, scales and zero points, and quantized values.

``QTYPES`` maps each storage dtype (int8, uint8, float8e4m3fn, float8e5m2) to its ONNX type and range.
``range_params`` turns an activation's calibrated range and clip into its scale and zero point (int8
and fp8 symmetric, uint8 asymmetric); ``weight_params`` gives per-channel (or per-tensor) symmetric weight
scales, at the channel's absmax or at the clip with the lowest reconstruction error (the mse search);
``quantize_values`` rounds and clamps values to a grid, and ``make_quantized_tensor`` /
``make_zero_point`` store them as ONNX tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

# storage dtype -> (TensorProto type, numpy dtype or None for fp8, qmin, qmax)
QTYPES: dict[str, tuple[int, Any, float, float]] = {
    "int8": (TensorProto.INT8, np.int8, -128, 127),
    "uint8": (TensorProto.UINT8, np.uint8, 0, 255),
    "fp8_e4m3fn": (TensorProto.FLOAT8E4M3FN, None, -448.0, 448.0),
    "fp8_e5m2": (TensorProto.FLOAT8E5M2, None, -57344.0, 57344.0),
}
FP8 = ("fp8_e4m3fn", "fp8_e5m2")


def is_fp8(dtype: str) -> bool:
    return dtype in FP8


def _fp8_bytes(values: np.ndarray, dtype: str) -> bytes:
    import ml_dtypes

    np_t = ml_dtypes.float8_e4m3fn if dtype == "fp8_e4m3fn" else ml_dtypes.float8_e5m2
    return np.asarray(values, dtype=np.float32).astype(np_t).tobytes()


def make_quantized_tensor(name: str, values: np.ndarray, dtype: str) -> onnx.TensorProto:
    """A tensor of already-quantized values (integers or fp8-representable floats; integers already in
    their storage type, as ``quantized_values`` gives them, are stored as they are)."""
    tp, np_t, lo, hi = QTYPES[dtype]
    values = np.asarray(values)
    if np_t is None:
        return helper.make_tensor(name, tp, list(values.shape), _fp8_bytes(values, dtype), raw=True)
    if values.dtype != np_t:
        values = np.clip(np.rint(values), lo, hi).astype(np_t)
    return numpy_helper.from_array(values, name)


@dataclass(frozen=True)
class QuantParams:
    """Scale and zero point of one quantized tensor; ``axis`` set for per-channel weights."""

    dtype: str
    scale: np.ndarray
    zero_point: np.ndarray
    axis: int | None = None

    @classmethod
    def scalar(cls, dtype: str, scale: float, zero_point: float = 0.0) -> QuantParams:
        return cls(dtype, np.asarray(scale, np.float32), np.asarray(zero_point, np.float32))


def range_params(dtype: str, lo: float, hi: float, threshold: float, *, max_algorithm: bool = False) -> QuantParams:
    """Scale/zero point of an activation whose calibrated values span [``lo``, ``hi``], clipped at
    +-``threshold`` (the calibration algorithm's clipping magnitude for ``dtype``).

    int8 and fp8 are symmetric; uint8 is asymmetric over [lo, hi] clipped to +-threshold and widened to
    include 0, so a tensor that is never negative (a ReLU output) gets zero point 0: ORT then folds the
    ReLU. ``max_algorithm`` (TensorRT's max calibration): uint8 spans [-t, t], or [0, t] for a tensor
    that is never negative.
    """
    t = float(threshold)
    if dtype == "uint8" and max_algorithm:
        lo, hi = (-t if float(lo) < 0 else 0.0), t
        scale = (hi - lo) / 255.0 if hi > lo else 1.0
        return QuantParams.scalar(dtype, scale, float(np.clip(np.rint(-lo / scale), 0, 255)))
    if dtype == "uint8":
        lo = min(max(float(lo), -t), 0.0)
        hi = max(min(float(hi), t), 0.0)
        scale = (hi - lo) / 255.0 if hi > lo else 1.0
        zp = float(np.clip(np.rint(-lo / scale), 0, 255))
        return QuantParams.scalar(dtype, scale, zp)
    qmax = QTYPES[dtype][3] if is_fp8(dtype) else 127.0
    return QuantParams.scalar(dtype, t / qmax if t > 0 else 1.0, 0.0)


# int8 weights in 7 bits (ONNX Runtime's reduce_range): 2 x 255 x 64 = 32640 fits the int16 pair sums
# of u8 x s8 kernels on x86 without VNNI, so they cannot saturate there
REDUCED_QMAX = 64.0


# clip ratios (of each channel's absmax) the mse weight search tries: a coarse grid, then a fine one
# around each channel's best (at 8 bits the best clip is rarely below 0.9: a clipped value costs its
# whole distance squared, a finer step saves step^2 / 12 per value)
WEIGHT_CLIP_RATIOS = np.linspace(0.5, 1.0, 26)
WEIGHT_CLIP_REFINE = np.linspace(-0.02, 0.02, 21)
# the coarse scan runs down from 1.0 and ends once this many ratios in a row bettered no row: below its
# best, a row's error only grows as more of its values are clipped
WEIGHT_CLIP_PATIENCE = 3
WEIGHT_SEARCHES = ("max", "mse")


def weight_params(w: np.ndarray, axis: int | None, dtype: str, reduced: bool = False,
                  search: str = "max") -> QuantParams:
    """Symmetric per-channel (``axis``) or per-tensor scales for a weight.

    ``reduced`` limits int8 weights to +-64 (7 bits). uint8 weights are the same symmetric grid shifted
    by a zero point of 128 (ORT's U8U8 kernels, exact on every CPU). ``search="max"`` scales each
    channel's absmax to the grid's end; ``"mse"`` picks per channel the clip (a ratio of its absmax in
    0.48..1.0, see WEIGHT_CLIP_RATIOS) with the lowest ||w - dq(q(w))||^2. fp8 keeps absmax (its
    relative rounding gains little from a clip), and so do reduced int8 weights: ``quantize_values``
    clamps them to +-127, so a clipped outlier would leave 7 bits and break what reduced guarantees.
    """
    if search not in WEIGHT_SEARCHES:
        raise ValueError(f"weight search {search!r}: expected one of {', '.join(WEIGHT_SEARCHES)}")
    qmax = QTYPES[dtype][3] if is_fp8(dtype) else (REDUCED_QMAX if reduced else 127.0)
    w32 = np.asarray(w, np.float32)
    a = np.abs(w32)
    if axis is None:
        amax = np.asarray(a.max() if a.size else 0.0)
    else:
        amax = np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1).max(axis=1)
    del a
    if search == "mse" and not is_fp8(dtype) and not reduced and w32.size:
        rows = w32.reshape(1, -1) if axis is None else np.moveaxis(w32, axis, 0).reshape(w32.shape[axis], -1)
        ratio = _best_clip_ratio(rows, amax.reshape(-1), qmax, -128.0 if dtype == "uint8" else -127.0)
        amax = (amax * ratio.reshape(amax.shape)).astype(np.float32)  # the clip _clip_error scored
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    zero = np.full_like(scale, 128.0 if dtype == "uint8" else 0.0)
    return QuantParams(dtype, scale, zero, axis)


_CLIP_BLOCK = 1 << 22  # values per block of rows searched at once: bounds the temporaries (~100 MB)


def _best_clip_ratio(rows: np.ndarray, amax: np.ndarray, qmax: float, qmin: float) -> np.ndarray:
    """Per row, the clip ratio (of ``amax``) whose scale ratio * amax / qmax reconstructs the row with the
    lowest squared error, rounded and clamped to [qmin, qmax] as quantize_values does. Ratio 1.0 is a
    candidate and a ratio only replaces a strictly better one, so no row ends worse than with absmax.
    Rows are searched in blocks, so a 8192 x 8192 weight costs no more memory than a small one."""
    step = max(1, _CLIP_BLOCK // max(1, rows.shape[1]))
    if rows.shape[0] > step:
        return np.concatenate([_best_clip_ratio(rows[i:i + step], amax[i:i + step], qmax, qmin)
                               for i in range(0, rows.shape[0], step)])
    best = np.ones(rows.shape[0], np.float32)
    best_err = _clip_error(rows, amax, best, qmax, qmin)

    def keep_better(ratio: np.ndarray) -> bool:
        nonlocal best, best_err
        err = _clip_error(rows, amax, ratio, qmax, qmin)
        better = err < best_err
        best, best_err = np.where(better, ratio, best), np.where(better, err, best_err)
        return bool(better.any())

    since = 0  # coarse ratios in a row that bettered no row
    for r in WEIGHT_CLIP_RATIOS[WEIGHT_CLIP_RATIOS < 1.0][::-1]:
        since = 0 if keep_better(np.full_like(best, r)) else since + 1
        if since == WEIGHT_CLIP_PATIENCE:
            break
    center = best.copy()
    for d in WEIGHT_CLIP_REFINE:
        keep_better(np.clip(center + np.float32(d), 0.0, 1.0).astype(np.float32))
    return best


def _clip_error(rows: np.ndarray, amax: np.ndarray, ratio: np.ndarray, qmax: float, qmin: float
                ) -> np.ndarray:
    clip = (amax * ratio).astype(np.float32)
    scale = np.where(clip > 0, clip / qmax, 1.0).astype(np.float32)[:, None]
    d = rows / scale  # one temporary, rewritten in place: 4x faster than a chain of new arrays
    np.rint(d, out=d)
    np.clip(d, qmin, qmax, out=d)
    d *= scale
    d -= rows
    return np.einsum("ij,ij->i", d, d, dtype=np.float64)  # squares summed in float64


def quantize_values(w: np.ndarray, p: QuantParams) -> np.ndarray:
    scale, zp = np.asarray(p.scale), np.asarray(p.zero_point)
    if p.axis is not None:
        shape = [1] * w.ndim
        shape[p.axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    q = w / scale
    if is_fp8(p.dtype):
        lim = QTYPES[p.dtype][3]
        return np.clip(q, -lim, lim)
    lo = -127 if p.dtype == "int8" else 0  # symmetric weights use the restricted range
    return np.clip(np.rint(q) + (0 if p.dtype == "int8" else zp), lo, QTYPES[p.dtype][3])


def quantized_values(w: np.ndarray, p: QuantParams) -> np.ndarray:
    """``w`` quantized with ``p`` in the storage type a tensor of ``p.dtype`` holds (float32 for fp8,
    whose storage make_quantized_tensor converts)."""
    q = quantize_values(w, p)
    np_t = QTYPES[p.dtype][1]
    return q.astype(np.float32, copy=False) if np_t is None else q.astype(np_t)


def make_zero_point(name: str, zp: np.ndarray, dtype: str) -> onnx.TensorProto:
    """A zero-point tensor of storage dtype ``dtype`` (fp8 zero points are 0)."""
    tp, np_t, _, _ = QTYPES[dtype]
    zp = np.asarray(zp)
    if np_t is None:
        return helper.make_tensor(name, tp, list(zp.shape), _fp8_bytes(np.zeros(zp.shape), dtype), raw=True)
    return numpy_helper.from_array(zp.astype(np_t), name)
