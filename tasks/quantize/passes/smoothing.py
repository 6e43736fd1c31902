"""SmoothQuant-style outlier smoothing (Xiao et al. 2023), with the statistics and check it needs.

An activation read by MatMul/Gemm with constant weights is divided per channel by s and the weights'
input rows multiplied by s; 1/s is folded into the tensor's producer when it is a linear op with
constants (LayerNormalization, Mul by a constant, MatMul/Gemm, followed by any chain of constant bias
Adds), else a ``Mul(t, 1/s)`` is inserted before the smoothed consumers. alpha is chosen per tensor by
the output error of int8 Q/DQ math on sampled activation rows.

Also here: ``smoothing_candidates`` (which tensors qualify). The per-channel ranges and sampled rows it
reads are ``activations.channel_absmax``'s.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from pipeline.calibrate.collect import outlier_ratio
from pipeline.quant.qmath import quantize_values, range_params, weight_params
from tasks.quantize.passes.graph_edit import ConstEdit, Editor, Use, absorber, attr, divide_along

log = logging.getLogger("tune.quantize")

SMOOTHING_MIN_K = 16  # same threshold as placement.MIN_DOT: smaller MatMuls stay float anyway
SCALE_LIMITS = (1e-5, 1e5)
MIN_GAIN = 0.02  # smoothing must cut the measured output error by more than this fraction
# a Mul inserted where no producer can absorb 1/s costs run time on every inference: only for tensors
# with real outlier channels (max / median channel absmax); BERT's FFN inputs measure 10-20
MUL_MIN_OUTLIER_RATIO = 6.0


def _smoothable(node: onnx.NodeProto, index: int, is_const: Callable[[str], bool],
                shape: Callable[[str], tuple[int, ...]]) -> tuple[str, int] | None:
    """(weight name, axis of K in the weight) when ``node`` reads an activation at ``index`` as the
    A of A @ W with a constant 2-D W."""
    if index != 0 or len(node.input) < 2 or not is_const(node.input[1]) or is_const(node.input[0]):
        return None
    w = node.input[1]
    if len(shape(w)) != 2:
        return None
    if node.op_type == "MatMul":
        return w, 0
    if node.op_type == "Gemm" and not attr(node, "transA", 0):
        return w, 1 if attr(node, "transB", 0) else 0
    return None


def smoothing_candidates(model: onnx.ModelProto) -> list[str]:
    """Activation tensors read by MatMul/Gemm with an initializer weight and K >= 16, producers first."""
    ed = Editor(model, copy=False)
    order = [i.name for i in model.graph.input if i.name not in ed.inits]
    order += [o for n in model.graph.node for o in n.output if o]
    out: list[str] = []
    for t in dict.fromkeys(order):
        for i, j in ed.uses(t):
            hit = _smoothable(ed.node(i), j, ed.is_float_const, ed.shape)
            if hit is not None and ed.shape(hit[0])[hit[1]] >= SMOOTHING_MIN_K:
                out.append(t)
                break
    return out


def smoothing_scales(act_absmax: np.ndarray, weight_absmax: np.ndarray, alpha: float) -> np.ndarray:
    """s = absmax_x^alpha / absmax_w^(1 - alpha), clipped to [1e-5, 1e5]; 1 where either is 0."""
    ok = (act_absmax > 0) & (weight_absmax > 0)
    ax, aw = np.where(ok, act_absmax, 1.0), np.where(ok, weight_absmax, 1.0)
    s = np.clip(ax ** alpha / aw ** (1.0 - alpha), *SCALE_LIMITS)
    return np.where(ok, s, 1.0)


def _fake_quant_activation(x: np.ndarray, act_dtype: str) -> np.ndarray:
    # per-tensor range from the rows themselves: what minmax calibration on them would give
    p = range_params(act_dtype, float(x.min()), float(x.max()), float(np.abs(x).max()))
    return (quantize_values(x, p) - float(p.zero_point)) * float(p.scale)


def _fake_quant_weight(w_kn: np.ndarray) -> np.ndarray:
    p = weight_params(w_kn, 1, "int8")
    return quantize_values(w_kn, p) * p.scale.reshape(1, -1)


def smoothing_error(x: np.ndarray, weights_kn: Sequence[np.ndarray], s: np.ndarray, act_dtype: str) -> float:
    """sum over weights W of || Q(x / s) @ Qw(W * s) - x @ W ||^2: x per tensor (uint8 asymmetric or int8
    symmetric), W per output channel symmetric int8."""
    xq = _fake_quant_activation(x / s, act_dtype)
    total = 0.0
    for w in weights_kn:
        y = x @ w
        total += float(np.sum((xq @ _fake_quant_weight(w * s[:, None]) - y) ** 2))
    return total


@dataclass
class _Consumers:
    uses: list[Use]
    weights: dict[str, tuple[list[Use], int]]  # weight name -> (readers among the consumers, K axis)

    def names(self, ed: Editor) -> list[str]:
        return [ed.node(i).name for i, _ in self.uses]


def _consumers(ed: Editor, tensor: str, k: int) -> _Consumers:
    c = _Consumers([], {})
    for i, j in ed.uses(tensor):
        hit = _smoothable(ed.node(i), j, ed.is_float_const, ed.shape)
        if hit is None or ed.shape(hit[0])[hit[1]] != k:
            continue
        c.uses.append((i, j))
        readers, _ = c.weights.setdefault(hit[0], ([], hit[1]))
        readers.append((i, 1))
    return c


def _weights_kn(ed: Editor, c: _Consumers) -> list[np.ndarray]:
    return [ed.array(w) if axis == 0 else ed.array(w).T for w, (_, axis) in c.weights.items()]


def _absorbing(ed: Editor, tensor: str, c: _Consumers, k: int) -> tuple[str, list[ConstEdit]] | None:
    """The producer edits that absorb 1/s, when ``tensor`` feeds only the smoothed consumers."""
    exclusive = tensor not in ed.outputs and set(ed.uses(tensor)) == set(c.uses)
    return absorber(ed, tensor, k) if exclusive else None


def _apply_smoothing(ed: Editor, tensor: str, c: _Consumers, s: np.ndarray) -> tuple[str, bool]:
    """Scale the consumers' weights by s and make them read tensor / s; returns (absorbed_by, inserted)."""
    dtype = ed.dtype(next(iter(c.weights)))
    found = _absorbing(ed, tensor, c, s.size)
    for w, (readers, axis) in c.weights.items():
        shape = [1, 1]
        shape[axis] = -1
        ed.set_const(w, ed.array(w) * s.reshape(shape), readers)
    if found is not None:
        label, edits = found
        for e in edits:
            name = ed.node(e.node).input[e.index]
            ed.set_const(name, divide_along(ed.array(name), s, e.axis), [(e.node, e.index)])
        return label, False
    inv = ed.unique(f"{tensor}_smooth_inv_scale")
    out = ed.unique(f"{tensor}_smoothed")
    ed.add_node(helper.make_node("Mul", [tensor, inv], [out], name=ed.unique(f"{tensor}_smooth")),
                {inv: 1.0 / s}, dtype)
    typed = [v for v in (*ed.graph.value_info, *ed.graph.input, *ed.graph.output) if v.name == tensor]
    if typed:
        vi = onnx.ValueInfoProto()
        vi.CopyFrom(typed[0])
        vi.name = out
        ed.graph.value_info.append(vi)
    ed.rewire(c.uses, out)
    return "Mul", True


def smooth_outliers(model: onnx.ModelProto, act_absmax: Mapping[str, np.ndarray],
                    samples: Mapping[str, np.ndarray] | None = None,
                    alphas: Sequence[float] = (0.0, 0.25, 0.4, 0.5, 0.6, 0.75),
                    act_dtype: str = "uint8") -> tuple[onnx.ModelProto, list[dict]]:
    """Migrate per-channel activation outliers into the weights of the MatMul/Gemm reading them.

    For every tensor of ``smoothing_candidates`` with an ``act_absmax`` entry (per-channel absmax
    along the last axis), all its MatMul/Gemm consumers with constant weights share one s, computed
    from absmax_w over all their weights. alpha is the one of ``alphas`` with the least
    ``smoothing_error`` on ``samples[t]``; the tensor is left alone unless it beats alpha 0 (no
    smoothing) by more than 2%. Without samples for a tensor, alpha 0.5 (SmoothQuant's default) is
    used and no errors are reported. 1/s is folded into the producer when the tensor feeds only
    those consumers and is not a graph output (see ``absorber``), else a Mul is inserted, and only
    for a tensor whose channels differ by MUL_MIN_OUTLIER_RATIO or more.

    Records, one per smoothed tensor: tensor, consumers, alpha, absorbed_by (producer op chain, or
    "Mul" for an inserted Mul), inserted_mul, outlier_ratio_before / after (max / median of absmax),
    error_before / error_after (None without samples).
    """
    if act_dtype not in ("uint8", "int8"):
        raise ValueError(f"act_dtype {act_dtype!r}: choose uint8 or int8")
    ed = Editor(model)
    records: list[dict] = []
    for t in smoothing_candidates(model):
        if t not in act_absmax:
            continue
        ax = np.asarray(act_absmax[t], np.float64).reshape(-1)
        c = _consumers(ed, t, ax.size)
        if not c.uses:
            log.debug("smoothing: %s has %d channels, its MatMul/Gemm weights disagree", t, ax.size)
            continue
        if outlier_ratio(ax) < MUL_MIN_OUTLIER_RATIO and _absorbing(ed, t, c, ax.size) is None:
            log.debug("smoothing: %s left alone (outlier ratio %.1f too small for an inserted Mul)", t,
                      outlier_ratio(ax))
            continue
        weights = _weights_kn(ed, c)
        aw = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
        x = samples.get(t) if samples is not None else None
        err_before = err_after = None
        if x is not None and np.size(x):
            alpha, err_before, err_after = _best_alpha(x, weights, ax, aw, alphas, act_dtype)
            if alpha == 0.0 or err_after >= (1.0 - MIN_GAIN) * err_before:
                log.debug("smoothing: %s left alone (no alpha cuts the output error by > 2%%)", t)
                continue
        else:
            alpha = 0.5
        s = smoothing_scales(ax, aw, alpha)
        consumer_names = c.names(ed)
        absorbed_by, inserted = _apply_smoothing(ed, t, c, s)
        records.append({"tensor": t, "consumers": consumer_names, "alpha": alpha, "absorbed_by": absorbed_by,
                        "inserted_mul": inserted, "outlier_ratio_before": outlier_ratio(ax),
                        "outlier_ratio_after": outlier_ratio(ax / s), "error_before": err_before,
                        "error_after": err_after})
    log.info("outlier smoothing: %d tensor(s) smoothed (%d with an inserted Mul)", len(records),
             sum(r["inserted_mul"] for r in records))
    return ed.finish(), records


def _best_alpha(x: np.ndarray, weights: list[np.ndarray], ax: np.ndarray, aw: np.ndarray,
                alphas: Sequence[float], act_dtype: str) -> tuple[float, float, float]:
    """(alpha, output error without smoothing, output error with it) on the sampled rows ``x``: the
    alpha of ``alphas`` with the least ``smoothing_error``, 0.0 when none beats no smoothing."""
    x = np.asarray(x, np.float64).reshape(-1, ax.size)
    err_before = smoothing_error(x, weights, np.ones_like(ax), act_dtype)
    alpha, err_after = 0.0, err_before
    for a in alphas:
        if a <= 0:
            continue
        e = smoothing_error(x, weights, smoothing_scales(ax, aw, a), act_dtype)
        if e < err_after:
            alpha, err_after = float(a), e
    return alpha, err_before, err_after


__all__ = ["MIN_GAIN", "MUL_MIN_OUTLIER_RATIO", "SCALE_LIMITS", "SMOOTHING_MIN_K", "smooth_outliers",
           "smoothing_candidates", "smoothing_error", "smoothing_scales"]
