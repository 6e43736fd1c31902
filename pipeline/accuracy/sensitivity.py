"""Where a quantized model's error comes from, node by node, and the charts that show it.

``only_node_quantized`` puts into the float graph just the Q/DQ chains that feed one node of a Q/DQ
model (its activations' Q -> DQ and its weights' and bias's DQ, with their scales), so running it
measures that node's own contribution to the output error, with the shipped model's own scales.
``plot_node_sensitivity`` draws one bar per node, largest contribution first, with the nodes
recovery left float marked; ``plot_ranges`` draws the calibration histogram of a tensor with the
clip its Q node uses. evaluate (every run) and quantize (when the budget is missed) write them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from pipeline.artifacts import atomic_output
from pipeline.graph import weights
from pipeline.quant.qmath import QTYPES

_QDQ = ("QuantizeLinear", "DequantizeLinear")


@dataclass(frozen=True)
class QuantizedInput:
    """One input of a node that a DequantizeLinear feeds in a Q/DQ model."""

    node: str
    slot: int
    dq: onnx.NodeProto
    q: onnx.NodeProto | None  # the activation's QuantizeLinear (None: a quantized initializer)


def quantized_inputs(qmodel: onnx.ModelProto) -> dict[str, list[QuantizedInput]]:
    """Node name -> its inputs fed by DequantizeLinear (main graph, compute nodes only), in graph order."""
    producer = {o: n for n in qmodel.graph.node for o in n.output}
    out: dict[str, list[QuantizedInput]] = {}
    for n in qmodel.graph.node:
        if n.op_type in _QDQ:
            continue
        for slot, name in enumerate(n.input):
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            q = producer.get(dq.input[0])
            out.setdefault(n.name, []).append(
                QuantizedInput(n.name, slot, dq, q if q is not None and q.op_type == "QuantizeLinear" else None))
    return out


def float_tensor(float_model: onnx.ModelProto, qmodel: onnx.ModelProto, name: str) -> str | None:
    """The float graph's name of a tensor of the Q/DQ model: the same name, or, where Q/DQ insertion
    renamed a graph output's producer output (``gap`` -> ``gap_prequant``), the output of the same
    node in the float graph; None when there is none."""
    produced = {o for n in float_model.graph.node for o in n.output} | {i.name for i in float_model.graph.input}
    if name in produced:
        return name
    q_node = next((n for n in qmodel.graph.node if name in n.output), None)
    f_node = next((n for n in float_model.graph.node if q_node is not None and n.name == q_node.name), None)
    if f_node is None:
        return None
    k = list(q_node.output).index(name)
    return f_node.output[k] if k < len(f_node.output) else None


def only_node_quantized(float_model: onnx.ModelProto, qmodel: onnx.ModelProto, node: str,
                        inputs: Sequence[QuantizedInput]) -> onnx.ModelProto:
    """``float_model`` (the graph ``qmodel``'s Q/DQ were placed into) with only ``node``'s quantized
    ``inputs`` quantized as in ``qmodel``; the chains go right before the node (topological order)."""
    m = onnx.ModelProto()
    m.CopyFrom(float_model)
    inits = {i.name: i for i in qmodel.graph.initializer}
    have = {i.name for i in m.graph.initializer}
    position = next(k for k, n in enumerate(m.graph.node) if n.name == node)
    target = m.graph.node[position]
    chain: list[onnx.NodeProto] = []
    added: set[str] = set()
    for qi in inputs:
        for n in (qi.q, qi.dq):
            if n is None or n.output[0] in added:  # one chain read in two slots (Mul(x, x)) goes in once
                continue
            added.add(n.output[0])
            if n.op_type == "QuantizeLinear" and (src := float_tensor(float_model, qmodel, n.input[0])) != n.input[0]:
                if src is None:
                    raise ValueError(f"{n.name} quantizes {n.input[0]}, which the float graph does not have")
                n = onnx.NodeProto.FromString(n.SerializeToString())
                n.input[0] = src
            chain.append(n)
            for name in n.input:
                if name in inits and name not in have:
                    m.graph.initializer.append(inits[name])
                    have.add(name)
        if qi.slot < len(target.input):
            target.input[qi.slot] = qi.dq.output[0]
    for k, n in enumerate(chain):
        m.graph.node.insert(position + k, n)
    # the float weights the node no longer reads stay: If/Loop bodies may read them too, and ORT
    # drops initializers nothing reads
    return m


def clip_range(qmodel: onnx.ModelProto, q: onnx.NodeProto) -> tuple[float, float, str] | None:
    """(lowest, highest value the Q node represents, its dtype) for a per-tensor QuantizeLinear."""
    inits = {i.name: i for i in qmodel.graph.initializer}
    if len(q.input) < 2 or q.input[1] not in inits:
        return None
    scale = weights.array(inits[q.input[1]]).astype(np.float64)
    if scale.size != 1:
        return None
    zp_init = inits.get(q.input[2]) if len(q.input) > 2 else None
    elem = zp_init.data_type if zp_init is not None else onnx.TensorProto.UINT8
    dtype = next((k for k, v in QTYPES.items() if v[0] == elem), "uint8")
    zp = 0.0 if zp_init is None or dtype.startswith("fp8") else float(weights.array(zp_init).reshape(-1)[0])
    s = float(scale.reshape(-1)[0])
    if dtype == "int8":
        return s * (-128 - zp), s * (127 - zp), dtype
    if dtype == "uint8":
        return s * (0 - zp), s * (255 - zp), dtype
    qmax = QTYPES[dtype][3]
    return -s * qmax, s * qmax, dtype


def _figure(height: float):
    # the object-oriented API with the Agg canvas draws without pyplot's global state or a display
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def plot_node_sensitivity(rows: Sequence[dict], path: str | Path, title: str, xlabel: str,
                          left_float: Sequence[str] = (), limit: int = 30) -> Path:
    """Horizontal bars, largest ``rows[i]["value"]`` on top (each row: node, op_type, value, label);
    the nodes in ``left_float`` are grey and named "left float" (listed at the bottom when they have no row)."""
    shown = sorted(rows, key=lambda r: -r["value"])[:limit]
    floated = set(left_float)
    marked = [n for n in left_float if n not in {r["node"] for r in shown}][:limit]
    n = len(shown) + len(marked)
    fig = _figure(max(2.5, 0.28 * n + 1.4))
    ax = fig.subplots()
    names = [f"{r['node']} ({r.get('op_type') or '?'})" + (" - left float" if r["node"] in floated else "")
             for r in shown] + [f"{m} (left float)" for m in marked]
    values = [max(r["value"], 0.0) for r in shown] + [0.0] * len(marked)
    colors = ["#999999" if r["node"] in floated else "#d62728" if k < 3 else "#1f77b4"
              for k, r in enumerate(shown)] + ["#999999"] * len(marked)
    y = list(range(n))[::-1]
    ax.barh(y, values, color=colors)
    top = max(values, default=0.0) or 1.0
    for yi, r in zip(y, shown, strict=False):
        ax.annotate(r.get("label", f"{r['value']:.3g}"), (max(r["value"], 0.0), yi), xytext=(3, 0),
                    textcoords="offset points", va="center", fontsize=8)
    for yi in y[len(shown):]:
        ax.annotate("left float by recovery", (0, yi), xytext=(3, 0), textcoords="offset points", va="center",
                    fontsize=8, color="#555555")
    ax.set_yticks(y, names, fontsize=8)
    ax.set_xlim(0, top * 1.25)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return Path(path)


def _short(name: str, keep: int = 48) -> str:
    return name if len(name) <= keep else "..." + name[-(keep - 3):]


def plot_ranges(items: Sequence[dict], path: str | Path) -> Path:
    """One panel per tensor: the histogram of its values on the evaluation data (log counts) and the
    range its Q node represents (each item: tensor, node, values, lo, hi, dtype)."""
    k = max(1, len(items))
    fig = _figure(2.6 * ((k + 1) // 2))
    axes = np.atleast_1d(fig.subplots((k + 1) // 2, 2 if k > 1 else 1)).ravel()
    for ax, it in zip(axes, items, strict=False):
        v = np.asarray(it["values"], dtype=np.float64).ravel()
        lo, hi = float(min(v.min(), it["lo"])), float(max(v.max(), it["hi"]))
        ax.hist(v, bins=200, range=(lo, hi) if hi > lo else None, color="#1f77b4", log=True)
        for x in (it["lo"], it["hi"]):
            ax.axvline(x, color="#d62728", linestyle="--", linewidth=1)
        clipped = float(np.mean((v < it["lo"]) | (v > it["hi"]))) if v.size else 0.0
        ax.set_title(f"{_short(it['tensor'])} -> {_short(it['node'])}\n{it['dtype']} range [{it['lo']:.3g}, "
                     f"{it['hi']:.3g}], {100 * clipped:.2f}% of the values clipped", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in axes[len(items):]:
        ax.set_visible(False)
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return Path(path)
