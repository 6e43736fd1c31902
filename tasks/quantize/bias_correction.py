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
    from pipeline.backends.onnxruntime.session import qdq_math_session

    # plain Q/DQ math and no fusions: every node's output stays observable
    return qdq_math_session(model, threads, extra_outputs=outputs)


def _channel_sums(a: np.ndarray, axis: int) -> tuple[np.ndarray, int]:
    a = np.moveaxis(np.asarray(a, np.float64), axis, -1)
    flat = a.reshape(-1, a.shape[-1])
    return flat.sum(axis=0), flat.shape[0]


def channel_means(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], slots: list[BiasSlot],
                  threads: int = 1) -> dict[str, dict[str, Any]]:
    """Per slot: the mean of its output per channel over ``feeds``, and the output's RMS."""
    return _channel_means_keeping(model, feeds, slots, threads, [])[0]


def _channel_means_keeping(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], slots: list[BiasSlot],
                           threads: int, keep: list[str]) -> tuple[dict[str, dict[str, Any]], list[dict[str, np.ndarray]]]:
    """``channel_means``, and per feed the values of the tensors ``keep`` names (read in the same runs)."""
    axes = {s.output: s.axis for s in slots}
    outputs = list(axes)
    session = _session(model, outputs + keep, threads)
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, int] = {}
    energy: dict[str, float] = {}
    kept = []
    for feed in feeds:
        values = session.run(outputs + keep, feed)
        for name, arr in zip(outputs, values, strict=False):
            total, n = _channel_sums(arr, axes[name])
            sums[name] = sums.get(name, 0.0) + total
            counts[name] = counts.get(name, 0) + n
            energy[name] = energy.get(name, 0.0) + float(np.sum(np.asarray(arr, np.float64) ** 2))
        kept.append(dict(zip(keep, values[len(outputs):], strict=True)))
    out = {}
    for s in slots:
        n = max(counts.get(s.output, 0), 1)
        mean = sums[s.output] / n
        out[s.node] = {"mean": mean, "rms": float(np.sqrt(energy[s.output] / (n * max(mean.size, 1))))}
    return out, kept


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
    mean |shift| relative to the output's RMS before and after. With the biases fed, a slot's shift
    after is its level's measurement less the correction as stored (rounded to int32 where the bias is):
    the corrections below a slot never reach its output, and those above it were in its measurement.
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
    left: dict[str, np.ndarray] = {}  # the shift left after the correction (fed biases)
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
            if fed is not None:
                left[s.node] = shift.reshape(-1) - fed.fed[s.bias].applied(total[s.bias])
    if fed is None and total:
        after = measure(slots, total)
        left = {n: after[n]["mean"] - reference[n]["mean"] for n in first}

    def rel(shift: np.ndarray, node: str) -> float:
        rms = reference[node]["rms"]
        return float(np.mean(np.abs(shift)) / rms) if rms else 0.0

    records = [{"node": s.node, "bias": s.bias, "mean_abs_shift_rel": rel(first[s.node], s.node),
                "mean_abs_shift_rel_after": rel(left[s.node], s.node)}
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

    def applied(self, delta: np.ndarray) -> np.ndarray:
        """What subtracting ``delta`` takes from the bias the model adds, per value (float64): the stored
        values' difference, dequantized as the DequantizeLinear computes it (float32) where they are int32."""
        def added(v: np.ndarray) -> np.ndarray:
            v = v.reshape(-1)
            return (v.astype(np.float32) * self.scale if self.scale is not None else v).astype(np.float64)
        return added(self.value(None)) - added(self.value(delta))

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


# bytes of settled values _FedBiases keeps across levels (all feeds): past it, levels run from the inputs
KEPT_BYTES = 512 * 2**20


class _FedBiases:
    """The quantized model placed once with its slots' biases as graph inputs: a level is measured on
    the nodes its outputs depend on, with the corrections so far fed in (ORT runs every node of a
    graph whatever outputs are asked for). A node is settled once every slot at or above it is
    corrected (each slot is corrected once, so its value no longer changes); the settled values an
    unsettled node reads are kept per feed (up to KEPT_BYTES) and fed in, so each level runs the nodes
    between the settled part of the graph and its outputs instead of the whole graph above them."""

    def __init__(self, model: onnx.ModelProto, fed: dict[str, _FedBias], slots: list[BiasSlot], threads: int):
        self.model, self.fed, self.threads = model, fed, threads
        self.owners = {s.bias: s.node for s in slots}  # bias initializer -> the slot node it corrects
        self.bias_owner = {fed[s.bias].input: s.node for s in slots}  # fed input -> the slot it corrects
        self.producer = {t: i for i, n in enumerate(model.graph.node) for t in n.output}
        self.truncate = not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                                for n in model.graph.node for a in n.attribute)
        self.known: list[dict[str, np.ndarray]] = []  # per feed: settled values an unsettled node reads

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
        return cls(qmodel, fed, slots, threads)  # type: ignore[arg-type]  # None ruled out above

    def channel_means(self, feeds: list[dict[str, np.ndarray]], level: list[BiasSlot],
                      total: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
        """``channel_means`` of ``level`` on the model with ``total`` subtracted from the biases (a bias in
        ``total`` is corrected for good: every later call's ``total`` holds it, unchanged)."""
        outputs = [s.output for s in level]
        if not self.truncate:
            return self._measure(self.model, feeds, level, total, [])[0]
        known = self.known or [{} for _ in feeds]
        model = self._above(outputs, {t: v for t, v in known[0].items() if t not in outputs})
        cut = self._cut({self.owners[b] for b in total})
        computed = {t for n in model.graph.node for t in n.output}
        means, kept = self._measure(model, [{**f, **k} for f, k in zip(feeds, known, strict=True)], level, total,
                                    sorted(cut & computed))
        self.known = [{t: v for t, v in {**k, **new}.items() if t in cut} for k, new in zip(known, kept, strict=True)]
        if sum(v.nbytes for k in self.known for v in k.values()) > KEPT_BYTES:
            self.known = []
        return means

    def _measure(self, model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], level: list[BiasSlot],
                 total: dict[str, np.ndarray], keep: list[str]
                 ) -> tuple[dict[str, dict[str, Any]], list[dict[str, np.ndarray]]]:
        needed = {i.name for i in model.graph.input}
        biases = {f.input: f.value(total.get(b)) for b, f in self.fed.items() if f.input in needed}
        fed = [{**{k: v for k, v in feed.items() if k in needed}, **biases} for feed in feeds]
        return _channel_means_keeping(model, fed, level, self.threads, keep)

    def _cut(self, corrected: set[str]) -> set[str]:
        """The settled tensors an unsettled node reads, with ``corrected`` the slot nodes corrected so far
        (graph.node is topologically sorted: a node's producers come before it)."""
        settled: list[bool] = []
        slots = set(self.owners.values())
        for n in self.model.graph.node:
            settled.append((n.name not in slots or n.name in corrected)
                           and all(self.bias_owner[t] in corrected if t in self.bias_owner else
                                   settled[i] if (i := self.producer.get(t)) is not None else True
                                   for t in n.input if t))
        nodes = self.model.graph.node
        return {t for k, n in enumerate(nodes) if not settled[k] for t in n.input
                if t and (i := self.producer.get(t)) is not None and settled[i]}

    def _above(self, outputs: list[str], known: dict[str, np.ndarray]) -> onnx.ModelProto:
        """The nodes ``outputs`` depend on, back to the ``known`` tensors, as a model of their own (same
        names, inputs and initializers; the known tensors become inputs)."""
        graph_nodes = self.model.graph.node
        wanted: set[int] = set()
        stack = list(outputs)
        while stack:
            t = stack.pop()
            i = None if t in known else self.producer.get(t)
            if i is not None and i not in wanted:
                wanted.add(i)
                stack.extend(t for t in graph_nodes[i].input if t)
        nodes = [graph_nodes[i] for i in sorted(wanted)]
        used = {t for n in nodes for t in n.input}
        inputs = [i for i in self.model.graph.input if i.name in used]
        inputs += [onnx.helper.make_tensor_value_info(t, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), None)
                   for t, v in known.items() if t in used]
        graph = onnx.helper.make_graph(nodes, self.model.graph.name, inputs,
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
