"""Empirical bias correction: remove the mean output shift quantization adds to each weighted op.

Rounding weights and clipping activations shifts the mean of a Conv's (or Gemm's, MatMul's) output
channels, and a shift is not noise: it adds up through the layers below. The shift of every quantized
node with a bias is measured on calibration batches as E[y_q - y_f] per output channel, with the
quantized model run as plain Q/DQ math (every node's output tensor is still there to read, and exact
integer kernels compute the same) against the float model; the bias then absorbs it (Nagel et al.,
"Data-Free Quantization", section 4.2, empirical variant). Nodes are corrected level by level from
the inputs down, each measured with the nodes above it corrected: correcting all at once from one
measurement overshoots in deep models, where a node's shift is mostly its inputs'. Only the first
MAX_SWEEPS levels are corrected. A node the float graph gives no bias initializer is left as it is
and reported.

The corrections are kept by bias tensor in calibration.json (``bias_corrections``) and applied by
``apply_plan`` only to the nodes a plan quantizes, so autotune's placements get them too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import onnx

from pipeline.graph import weights
from pipeline.graph.index import GraphIndex, bias_slot, bias_tensor
from pipeline.graph.model import WEIGHTED_OPS
from pipeline.quant.qdq import corrected_bias, int32_bias

# levels corrected (one quantized-model run over the calibration feeds each), from the inputs down
MAX_SWEEPS = 12
BIAS_BATCHES = 8  # calibration batches the mean output shifts are measured on


@dataclass(frozen=True)
class BiasSlot:
    node: str
    bias: str  # initializer holding the bias
    output: str  # the tensor the bias is added into (the node's output, or its bias Add's)
    axis: int  # channel axis of ``output``


def bias_slots(model: onnx.ModelProto, nodes: Iterable[str]) -> tuple[list[BiasSlot], list[str], list[BiasSlot]]:
    """(slots of the weighted ``nodes`` whose bias is an initializer of their own, names of those
    without one, slots whose bias other nodes read too). Exporters merge equal initializers (torch
    gives equal zero biases and a LayerNorm's beta one tensor): a bias other nodes read is never
    corrected, since correcting one node into it would move all of them."""
    g = GraphIndex(model)
    slots, missing, shared = [], [], []
    for name in nodes:
        node = g.nodes.get(name)
        if node is None or node.op_type not in WEIGHTED_OPS:
            continue
        b = bias_tensor(g, node)
        if b is None:
            missing.append(name)
        elif len(g.consumers.get(b[0], [])) > 1:
            shared.append(BiasSlot(name, *b))
        else:
            slots.append(BiasSlot(name, *b))
    return slots, missing, shared


def _session(model: onnx.ModelProto, outputs: list[str], threads: int):
    from pipeline.backends.onnxruntime.session import inference_session, ort_session_options

    # plain Q/DQ math and no fusions: every node's output stays observable
    return inference_session(model, ort_session_options("disable", threads=threads), extra_outputs=outputs)


def _channel_sums(a: np.ndarray, axis: int) -> tuple[np.ndarray, int]:
    a = np.moveaxis(np.asarray(a, np.float64), axis, -1)
    flat = a.reshape(-1, a.shape[-1])
    return flat.sum(axis=0), flat.shape[0]


def channel_means(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], slots: list[BiasSlot],
                  threads: int = 1) -> dict[str, dict[str, Any]]:
    """Per slot: the mean of its output per channel over ``feeds``, and the output's RMS."""
    axes = {s.output: s.axis for s in slots}
    outputs = list(axes)
    session = _session(model, outputs, threads)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    energy: dict[str, float] = {}
    for feed in feeds:
        for name, arr in zip(outputs, session.run(outputs, feed), strict=True):
            total, n = _channel_sums(arr, axes[name])
            sums[name] = sums.get(name, 0.0) + total
            counts[name] = counts.get(name, 0) + n
            energy[name] = energy.get(name, 0.0) + float(np.sum(np.asarray(arr, np.float64) ** 2))
    out = {}
    for s in slots:
        n = max(counts.get(s.output, 0), 1)
        mean = sums[s.output] / n
        out[s.node] = {"mean": mean, "rms": float(np.sqrt(energy[s.output] / (n * max(mean.size, 1))))}
    return out


def mean_shifts(float_model: onnx.ModelProto, qmodel: onnx.ModelProto, feeds: list[dict[str, np.ndarray]],
                slots: list[BiasSlot], threads: int = 1) -> dict[str, dict[str, Any]]:
    """Per slot: the mean shift per output channel (quantized - float) and the float output's RMS."""
    f, q = channel_means(float_model, feeds, slots, threads), channel_means(qmodel, feeds, slots, threads)
    return {n: {"shift": q[n]["mean"] - f[n]["mean"], "rms": f[n]["rms"]} for n in f}


def _levels(model: onnx.ModelProto, slots: list[BiasSlot]) -> list[list[BiasSlot]]:
    """Slots grouped by how many corrected nodes lie above them (0: none), in topological order: a
    node's shift depends on the corrections above it only, so one sweep in this order settles all."""
    g = GraphIndex(model)
    owner = {s.node: s for s in slots}
    depth: dict[str, int] = {}
    for node in model.graph.node:  # graph.node is topologically sorted (onnx checker guarantees it)
        above = [depth[p.name] + (1 if p.name in owner else 0) for t in node.input
                 if (p := g.producer.get(t)) is not None and p.name in depth]
        depth[node.name] = max(above, default=0)
    levels: dict[int, list[BiasSlot]] = {}
    for s in slots:
        levels.setdefault(depth.get(s.node, 0), []).append(s)
    return [levels[k] for k in sorted(levels)]


def corrections(float_model: onnx.ModelProto, build: Callable[[dict[str, list[float]]], onnx.ModelProto],
                feeds: list[dict[str, np.ndarray]], quantized: Iterable[str], threads: int = 1
                ) -> tuple[dict[str, list[float]], list[dict[str, Any]]]:
    """(bias tensor -> value to subtract, per-node records) for the quantized weighted nodes.

    ``build(corrections)`` places the quantized model with those corrections applied. Nodes are
    corrected level by level from the inputs down (see ``_levels``), each measured on the model whose
    nodes above it are corrected already. The model is placed once, its corrected biases fed in as
    inputs and each level measured on the part of the graph above it (``_FedBiases``), which computes
    what placing it again with the corrections would. A record has the node, its bias tensor and the
    mean |shift| relative to the output's RMS before and after.
    """
    slots, missing, shared = bias_slots(float_model, quantized)
    sizes = {i.name: int(np.prod(i.dims)) for i in float_model.graph.initializer}
    mismatched = [s for s in slots if s.bias not in sizes]
    slots = [s for s in slots if s.bias in sizes]
    reference = channel_means(float_model, feeds, slots, threads) if slots else {}
    fed = _FedBiases.of(float_model, build({}), slots, threads) if slots else None

    def measure(level: list[BiasSlot], total: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
        if fed is not None:
            return fed.channel_means(feeds, level, total)
        return channel_means(build({b: v.tolist() for b, v in total.items()}), feeds, level, threads)

    total: dict[str, np.ndarray] = {}
    first: dict[str, np.ndarray] = {}
    # one level per sweep: correcting adjacent levels from one measurement overshoots (a transformer's
    # cosine fell from 0.86 to 0.19 that way); past MAX_SWEEPS levels a node's shift is mostly the
    # noise of the nodes above it, not a bias of its own, so deeper nodes are left as they are
    for level in _levels(float_model, slots)[:MAX_SWEEPS]:
        measured = measure(level, total)
        for s in level:
            shift = measured[s.node]["mean"] - reference[s.node]["mean"]
            if shift.size != sizes[s.bias]:  # a bias broadcast over channels in another way: leave it
                mismatched.append(s)
                continue
            first[s.node] = shift
            total[s.bias] = total.get(s.bias, 0.0) + shift
    after = measure(slots, total) if total else {}

    def rel(shift: np.ndarray, node: str) -> float:
        rms = reference[node]["rms"]
        return float(np.mean(np.abs(shift)) / rms) if rms else 0.0

    records = [{"node": s.node, "bias": s.bias, "mean_abs_shift_rel": rel(first[s.node], s.node),
                "mean_abs_shift_rel_after": rel(after[s.node]["mean"] - reference[s.node]["mean"], s.node)}
               for s in slots if s.node in first]
    records += [{"node": s.node, "bias": s.bias, "skipped": f"deeper than {MAX_SWEEPS} levels"}
                for s in slots if s.node not in first and s not in mismatched]
    records += [{"node": n, "bias": None, "skipped": "no bias initializer"} for n in missing]
    records += [{"node": s.node, "bias": s.bias, "skipped": "bias does not match the output channels"}
                for s in mismatched]
    records += [{"node": s.node, "bias": s.bias, "skipped": "bias shared with other nodes"} for s in shared]
    return {b: [float(x) for x in v] for b, v in total.items()}, records


@dataclass(frozen=True)
class _FedBias:
    """How one corrected bias reaches the placed model: the input it is fed as, the float bias, and the
    int32 DequantizeLinear scale where the placement stores it quantized (None: a float bias)."""

    input: str
    values: np.ndarray
    scale: np.ndarray | None

    def value(self, delta: np.ndarray | None) -> np.ndarray:
        """The input's value with ``delta`` subtracted, rounded as ``apply_plan`` stores it."""
        b = self.values if delta is None else corrected_bias(self.values, delta)
        return b if self.scale is None else int32_bias(b, self.scale).reshape(b.shape)


def _fed_bias(s: BiasSlot, fg: GraphIndex, qg: GraphIndex) -> _FedBias | None:
    """How slot ``s``'s bias reaches the placed model (``qg``): its float initializer, or the int32 values of
    the zero-point-free DequantizeLinear that ``apply_plan`` made of it; None for anything else."""
    node = fg.nodes[s.node]
    owner, idx = (node.name, 2) if node.op_type in ("Conv", "ConvTranspose") else bias_slot(fg, node) or ("", 0)
    q = qg.nodes.get(owner)
    values = weights.array(fg.inits[s.bias])
    # apply_plan rounds another type's int32 bias by a float32 scale
    if q is None or len(q.input) <= idx or values.dtype != np.float32:
        return None
    reader = q.input[idx]
    if reader == s.bias and reader in qg.inits:
        return _FedBias(reader, values, None)
    dq = qg.producer.get(reader)
    if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 2 \
            or not all(t in qg.inits for t in dq.input[:3] if t):
        return None
    if qg.inits[dq.input[0]].data_type != onnx.TensorProto.INT32 or \
            (len(dq.input) > 2 and dq.input[2] and np.any(weights.array(qg.inits[dq.input[2]]))):
        return None
    scale = weights.array(qg.inits[dq.input[1]]).astype(np.float32).reshape(-1)
    return _FedBias(dq.input[0], values, np.broadcast_to(scale, (values.size,)))


class _FedBiases:
    """The quantized model placed once with its slots' biases as graph inputs: a level is measured on
    the nodes its outputs depend on, with the corrections so far fed in (ORT runs every node of a
    graph whatever outputs are asked for)."""

    def __init__(self, model: onnx.ModelProto, fed: dict[str, _FedBias], threads: int):
        self.model, self.fed, self.threads = model, fed, threads
        self.producer = {t: i for i, n in enumerate(model.graph.node) for t in n.output}
        self.truncate = not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                for n in model.graph.node for a in n.attribute)

    @classmethod
    def of(cls, float_model: onnx.ModelProto, qmodel: onnx.ModelProto, slots: list[BiasSlot], threads: int
           ) -> _FedBiases | None:
        """The fed model of ``qmodel`` (placed without corrections), or None where a slot's bias does not
        reach it as a float initializer or an int32 DequantizeLinear of one (then each level is placed)."""
        fg, qg = GraphIndex(float_model), GraphIndex(qmodel)
        fed = {s.bias: _fed_bias(s, fg, qg) for s in slots}
        inputs = {f.input for f in fed.values() if f is not None}
        if len(inputs) != len(fed) or any(len(qg.consumers.get(t, [])) != 1 for t in inputs):
            return None
        listed = {i.name for i in qmodel.graph.input}  # an initializer that is an input already (IR >= 4)
        inits = qmodel.graph.initializer
        qmodel.graph.input.extend(onnx.helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                                  for i in inits if i.name in inputs and i.name not in listed)
        for k in reversed([k for k, i in enumerate(inits) if i.name in inputs]):
            del inits[k]
        return cls(qmodel, fed, threads)  # type: ignore[arg-type]  # None ruled out above

    def channel_means(self, feeds: list[dict[str, np.ndarray]], level: list[BiasSlot],
                      total: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
        """``channel_means`` of ``level`` on the model with ``total`` subtracted from the biases."""
        model = self._above([s.output for s in level]) if self.truncate else self.model
        needed = {i.name for i in model.graph.input}
        biases = {f.input: f.value(total.get(b)) for b, f in self.fed.items() if f.input in needed}
        fed = [{**{k: v for k, v in feed.items() if k in needed}, **biases} for feed in feeds]
        return channel_means(model, fed, level, self.threads)

    def _above(self, outputs: list[str]) -> onnx.ModelProto:
        """The nodes ``outputs`` depend on, as a model of their own (same names, inputs and initializers)."""
        graph_nodes = self.model.graph.node
        wanted: set[int] = set()
        stack = list(outputs)
        while stack:
            i = self.producer.get(stack.pop())
            if i is not None and i not in wanted:
                wanted.add(i)
                stack.extend(t for t in graph_nodes[i].input if t)
        nodes = [graph_nodes[i] for i in sorted(wanted)]
        used = {t for n in nodes for t in n.input}
        graph = onnx.helper.make_graph(nodes, self.model.graph.name, [i for i in self.model.graph.input if i.name in used],
                                       [onnx.helper.make_empty_tensor_value_info(t) for t in outputs],
                                       [i for i in self.model.graph.initializer if i.name in used])
        out = onnx.helper.make_model(graph, opset_imports=list(self.model.opset_import))
        out.ir_version = self.model.ir_version
        out.functions.extend(self.model.functions)
        return out


def correct_bias(model: onnx.ModelProto, build: Callable[[dict[str, list[float]]], onnx.ModelProto],
                 quantized: Iterable[str], batches: Callable[[], Iterable[Any]], threads: int
                 ) -> tuple[dict[str, list[float]], list[dict]]:
    """``corrections`` of ``quantized`` measured on the first BIAS_BATCHES calibration batches."""
    feeds = [b.feeds for b in islice(batches(), BIAS_BATCHES)]
    return corrections(model, build, feeds, quantized, threads)
