"""Cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization"; AIMET's CLE).

For Conv -> [Relu | LeakyRelu] -> Conv, output channel i of the first conv is divided by s_i and input
channel i of the second multiplied by s_i, with s_i = sqrt(r1_i / r2_i) so both per-channel weight
ranges become sqrt(r1_i * r2_i). Exact because Relu and LeakyRelu are positively homogeneous
(f(x / s) = f(x) / s for s > 0). Clip (Relu6) is not: ONNX Clip takes scalar bounds, so the
per-channel bound 6 / s_i cannot be expressed, and such pairs are left alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import onnx

from tasks.quantize.passes.graph_edit import Editor, attr

log = logging.getLogger("tune.quantize")

# ops through which per-channel positive scaling commutes exactly: f(x / s) = f(x) / s for s > 0
HOMOGENEOUS_ACTIVATIONS = ("Relu", "LeakyRelu")


def _spread(r: np.ndarray) -> float:
    """max / min of the positive entries (1.0 when there are none)."""
    pos = r[r > 0]
    return float(pos.max() / pos.min()) if pos.size else 1.0


@dataclass(frozen=True)
class _ConvPair:
    first: int
    activation: int | None
    second: int


def _conv_pairs(ed: Editor) -> list[_ConvPair]:
    pairs: list[_ConvPair] = []
    for i, conv1 in enumerate(ed.graph.node):
        if conv1.op_type != "Conv" or len(conv1.input) < 2 or not ed.is_float_const(conv1.input[1]):
            continue
        if len(conv1.input) > 2 and conv1.input[2] and not ed.is_float_const(conv1.input[2]):
            continue
        out = conv1.output[0]
        uses = ed.uses(out)
        if out in ed.outputs or len(uses) != 1:
            continue
        nxt, idx = uses[0]
        act = None
        if ed.node(nxt).op_type in HOMOGENEOUS_ACTIVATIONS:
            act = nxt
            out = ed.node(act).output[0]
            uses = ed.uses(out)
            if out in ed.outputs or len(uses) != 1:
                continue
            nxt, idx = uses[0]
        elif ed.node(nxt).op_type == "Clip":
            log.debug("CLE: %s -> Clip left alone: Clip's scalar bounds cannot follow per-channel scales",
                      conv1.name)
            continue
        conv2 = ed.node(nxt)
        if conv2.op_type != "Conv" or idx != 0 or len(conv2.input) < 2 or not ed.is_float_const(conv2.input[1]):
            continue
        w1, w2 = ed.shape(conv1.input[1]), ed.shape(conv2.input[1])
        group2 = int(attr(conv2, "group", 1))
        if len(w1) < 3 or len(w2) < 3 or w2[0] % group2 or w2[1] * group2 != w1[0]:
            continue
        pairs.append(_ConvPair(i, act, nxt))
    return pairs


def _pair_ranges(ed: Editor, p: _ConvPair) -> tuple[np.ndarray, np.ndarray]:
    """Per channel i of the tensor between the convs: max |w| of the first conv's output channel i
    and of the second conv's input channel i (over all output channels of its group)."""
    w1 = ed.array(ed.node(p.first).input[1])
    conv2 = ed.node(p.second)
    w2 = ed.array(conv2.input[1])
    g = int(attr(conv2, "group", 1))
    r1 = np.abs(w1).reshape(w1.shape[0], -1).max(axis=1)
    r2 = np.abs(w2).reshape(g, w2.shape[0] // g, w2.shape[1], -1).max(axis=(1, 3)).reshape(-1)
    return r1, r2


def _equalize_pair(ed: Editor, p: _ConvPair) -> float:
    """Equalize one pair in place; returns max |log s_i| (how far it was from equalized)."""
    r1, r2 = _pair_ranges(ed, p)
    ok = (r1 > 0) & (r2 > 0)
    s = np.where(ok, np.sqrt(r1 / np.where(ok, r2, 1.0)), 1.0)
    conv1, conv2 = ed.node(p.first), ed.node(p.second)
    w1 = ed.array(conv1.input[1])
    ed.set_const(conv1.input[1], w1 / s.reshape(-1, *([1] * (w1.ndim - 1))), [(p.first, 1)])
    if len(conv1.input) > 2 and conv1.input[2]:
        ed.set_const(conv1.input[2], ed.array(conv1.input[2]) / s, [(p.first, 2)])
    w2 = ed.array(conv2.input[1])
    g = int(attr(conv2, "group", 1))
    shaped = w2.reshape(g, w2.shape[0] // g, w2.shape[1], -1) * s.reshape(g, 1, w2.shape[1], 1)
    ed.set_const(conv2.input[1], shaped.reshape(w2.shape), [(p.second, 1)])
    return float(np.abs(np.log(s)).max()) if s.size else 0.0


def equalize_cross_layer(model: onnx.ModelProto, max_iterations: int = 50, tolerance: float = 1e-4
                         ) -> tuple[onnx.ModelProto, list[dict]]:
    """Cross-layer equalization of every Conv -> [Relu | LeakyRelu] -> Conv pair.

    A pair qualifies when the first conv's output feeds only the activation (or directly the second
    conv), the activation feeds only the second conv's data input, neither is a graph output, and
    the weights (and the first conv's bias) are float initializers; grouped and depthwise convs on
    either side are handled (input channel i of a grouped conv is column i % (C / group) of the
    output channels of group i // (C / group)). Chains (conv1 -> conv2 -> conv3) are swept until no
    scale moves by more than ``tolerance`` (in log) or ``max_iterations`` sweeps, as AIMET does.
    Records, one per equalized pair: first, second, activation, channels, and range_ratio_before /
    range_ratio_after: the larger of the max/min spreads of the two per-channel weight ranges.
    """
    ed = Editor(model)
    pairs = _conv_pairs(ed)
    if not pairs:
        return ed.finish(), []
    names = [(ed.node(p.first).name, ed.node(p.second).name) for p in pairs]
    before = [_pair_ranges(ed, p) for p in pairs]
    sweeps = 0
    while sweeps < max_iterations:
        sweeps += 1
        if max(_equalize_pair(ed, p) for p in pairs) < tolerance:
            break
    records = []
    for p, (first, second), (r1, r2) in zip(pairs, names, before, strict=True):
        a1, a2 = _pair_ranges(ed, p)
        records.append({"first": first, "second": second,
                        "activation": ed.node(p.activation).op_type if p.activation is not None else None,
                        "channels": int(r1.size), "sweeps": sweeps,
                        "range_ratio_before": max(_spread(r1), _spread(r2)),
                        "range_ratio_after": max(_spread(a1), _spread(a2))})
    log.info("cross-layer equalization: %d conv pair(s) in %d sweep(s)", len(records), sweeps)
    return ed.finish(), records


__all__ = ["HOMOGENEOUS_ACTIVATIONS", "equalize_cross_layer"]
