"""Q/DQ insertion shared by quantize and autotune.

A ``QDQPlan`` (``pipeline.quant.plan``) says what to quantize: activation tensors (for all or some of their
consumers), weights (per output channel) and, where a runtime needs them, int32 biases. ORT's CPU EP fuses a
Gemm (or MatMul + bias Add) with DQ inputs and no Q on its output into a float-output QGemm only
when the bias also comes from an int32 DequantizeLinear; with a Q on the output it quantizes a
float bias itself. TensorRT rejects int32 DQ, so its backends fold them back to float biases
(``pipeline.backends.tensorrt.common``). ``apply_plan`` writes QuantizeLinear /
DequantizeLinear nodes into a copy of a float model with scales from a ``Calibration``
(``pipeline.quant.calibration``; the math is ``pipeline.quant.qmath``'s), one emitter each for activations,
weights, int32 biases and Loop/Scan bodies over one ``GraphIndex`` of the graph:

- zero-point dtype always equals the quantized dtype (int8, uint8, float8e4m3fn, float8e5m2);
- scales and zero points of activations are true scalars (shape []), which ORT needs to fuse
  QLinearAdd/QLinearMul groups; weights get 1-D per-channel scales with the right ``axis``;
- weights are stored quantized (int8 or fp8) followed by a DequantizeLinear;
- the scale's dtype is the consumer's float type, so DQ outputs match what the consumer expects;
- the opset is raised where needed (per-axis Q/DQ >= 13, FP8 >= 19); the result is topologically
  sorted and passes onnx.checker;
- a Loop/Scan body gets the plan ``QDQPlan.bodies`` holds for its node, applied to the body seen as a
  graph of its own (``pipeline.graph.bodies``); a plan without bodies (autotune's: it tunes the main graph)
  takes the ones the quantize stage recorded in calibration.json (``Calibration.bodies``).
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import StageError, StateError
from pipeline.graph import weights
from pipeline.graph.bodies import all_names, body_views, fresh_name, put_back
from pipeline.graph.index import GraphIndex, bias_tensor, computes_on
from pipeline.graph.model import (
    graph_reads,
    iter_nodes,
    opset_version,
    subgraphs,
    tensor_elem_types,
    topological_sort,
)
from pipeline.graph.weights import without_initializers
from pipeline.progress import work_bar
from pipeline.quant.calibration import Calibration
from pipeline.quant.plan import Consumer, QDQPlan, WeightQ
from pipeline.quant.qmath import FP8, QuantParams, make_quantized_tensor, make_zero_point

log = logging.getLogger("tune.qdq")

PREQUANT_SUFFIX = "_prequant"  # a quantized graph output's float tensor, renamed so the DQ keeps its name


def _scalar_or_vector(name: str, values: np.ndarray, elem_type: int) -> onnx.TensorProto:
    arr = np.asarray(values, dtype=helper.tensor_dtype_to_np_dtype(elem_type))
    return numpy_helper.from_array(arr, name)


def required_opset(plan: QDQPlan) -> int:
    dtypes = {a.dtype for p in plan.walk() for a in p.activations} | {w.dtype for p in plan.walk() for w in p.weights}
    if dtypes & set(FP8):
        return 19
    return 13


def raise_opset(model: onnx.ModelProto, target: int) -> onnx.ModelProto:
    """The model at opset >= ``target`` (per-axis Q/DQ needs 13, FP8 19)."""
    current = opset_version(model)
    if current >= target:
        return model
    # opset 19 needs IR version 9; stay at the lowest IR that allows it so older runtimes load the model
    model.ir_version = max(model.ir_version, 9 if target >= 19 else 7)
    try:
        from onnx import version_converter

        converted = version_converter.convert_version(model, target)
        weights.check_model(converted)
        return converted
    except Exception:  # noqa: BLE001 - the converter lacks adapters for some ops
        if current < 13:
            # below 13, ops such as Squeeze/Unsqueeze/Split/Reduce* changed signature: a bump is unsafe
            raise StageError(f"cannot convert the model from opset {current} to {target} for Q/DQ; re-export it "
                             f"with model.opset=17 (or any opset >= 13)") from None
        # from 13 on, the ops that changed keep their old forms valid; Q/DQ semantics are unchanged
        log.debug("version converter failed; raising opset_import to %d directly", target)
        for imp in model.opset_import:
            if imp.domain in ("", "ai.onnx"):
                imp.version = target
        return model


def corrected_bias(bias: np.ndarray, delta: Any) -> np.ndarray:
    """``bias`` with bias correction's ``delta`` (its values, any shape of the same size) subtracted, in its dtype."""
    return (bias - np.asarray(delta, np.float64).reshape(bias.shape)).astype(bias.dtype)


def int32_bias(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """A float bias stored as int32 for a DequantizeLinear of ``scale`` (one per value, or one), zero point 0."""
    return np.clip(np.rint(np.asarray(values, np.float64).reshape(-1) / scale), -(2**31), 2**31 - 1).astype(np.int32)


def _correct_biases(model: onnx.ModelProto, quantized: set[str], corrections: dict[str, list[float]]) -> None:
    """Subtract the measured mean shift from the biases of the quantized weighted nodes (in place)."""
    g = GraphIndex(model)
    targets = {b[0] for n in sorted(quantized) if n in g.nodes and (b := bias_tensor(g, g.nodes[n])) is not None}
    for i, init in enumerate(model.graph.initializer):
        if init.name in targets and init.name in corrections:
            b = weights.array(init)
            delta = np.asarray(corrections[init.name], np.float64)
            if delta.size != b.size:
                raise StateError(f"bias correction of '{init.name}' has {delta.size} values, the bias {b.size}; "
                                 f"re-run the quantize stage")
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(corrected_bias(b, delta), init.name))


def apply_plan(model: onnx.ModelProto, plan: QDQPlan, calibration: Calibration,
               default_float_type: int = TensorProto.FLOAT, check: bool = True) -> onnx.ModelProto:
    """A copy of ``model`` with the plan's Q/DQ nodes inserted (see module docstring), in Loop/Scan
    bodies by ``plan.bodies``, or by ``calibration.bodies`` when the plan places the main graph only."""
    bodies = plan.bodies or calibration.bodies
    target = max([required_opset(plan), *(required_opset(p) for p in bodies.values())])
    # the version converter needs the weights' values: a model it converts is copied whole
    out, sources = _copy_sparing_weights(model, plan if opset_version(model) >= target else QDQPlan())
    out = raise_opset(out, target)
    if calibration.bias_corrections:
        _correct_biases(out, {w.node for w in plan.weights}, calibration.bias_corrections)
    _insert(out, replace(plan, bodies=bodies), calibration, default_float_type, all_names(out.graph), sources)
    left = {i.name for i in out.graph.initializer} & set(sources)
    if left:  # a spared weight is still read in float: never ship its placeholder
        raise StageError(f"internal error: weight(s) {sorted(left)} spared from the copy are still read")
    if check:  # the autotuner skips it per candidate: a broken candidate fails its measurement anyway
        weights.check_model(out)
    return out


_FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16)


def _copy_sparing_weights(model: onnx.ModelProto, plan: QDQPlan) -> tuple[onnx.ModelProto, dict[str, TensorProto]]:
    """A copy of ``model`` in which the float weights the plan stores quantized (read by no other node,
    outside any Loop/Scan/If body) are placeholders with dims only, and those weights by name: they
    are quantized from ``model``'s own tensors, so no second full-precision copy of the weights is made
    (a 2.4 GB model costs its int8 weights, not another 2.4 GB)."""
    g = GraphIndex(model)
    spared: dict[str, TensorProto] = {}
    if not any(subgraphs(n) for n in model.graph.node):
        stored = {(w.node, w.input_index) for w in plan.weights}
        for node, idx in stored:
            name = g.nodes[node].input[idx] if node in g.nodes else ""
            if (name in g.inits and name not in g.graph_outputs
                    and all((c.name, i) in stored for c, i in g.consumers.get(name, []))):
                spared[name] = g.inits[name]
    out = without_initializers(model)
    for t in model.graph.initializer:
        if t.name in spared:
            out.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        else:
            out.graph.initializer.append(t)
    return out, spared


class _Insertion:
    """What the emitters of one graph share: its index (taken before any edit), the calibration, the
    names in use across the model, and the initializers and nodes they add."""

    def __init__(self, model: onnx.ModelProto, calibration: Calibration, default_float_type: int, taken: set[str],
                 sources: dict[str, TensorProto] | None = None):
        self.g = GraphIndex(model)
        self.sources = sources or {}  # weights whose values live in the source model (placeholders here)
        self.calibration = calibration
        self.default_float_type = default_float_type
        self.taken = taken
        self.types = tensor_elem_types(model)
        self.new_nodes: list[onnx.NodeProto] = []
        self.new_inits: list[onnx.TensorProto] = []

    def unique(self, name: str) -> str:
        return fresh_name(self.taken, name)

    def float_type(self, tensor: str) -> int:
        t = self.types.get(tensor, self.default_float_type)
        return t if t in _FLOAT_TYPES else self.default_float_type

    def dq_names(self, base: str) -> tuple[str, str, str, str]:
        """Fresh names of a stored tensor's quantized values, scale, zero point and DQ output."""
        return (self.unique(f"{base}_quantized"), self.unique(f"{base}_scale"), self.unique(f"{base}_zero_point"),
                self.unique(f"{base}_dequantized"))


def _insert(model: onnx.ModelProto, plan: QDQPlan, calibration: Calibration, default_float_type: int,
            taken: set[str], sources: dict[str, TensorProto] | None = None) -> None:
    """Insert ``plan`` into ``model``'s graph and ``plan.bodies`` into its Loop/Scan bodies (in place); new
    names avoid ``taken`` (every name of the whole model) and are added to it."""
    if plan.aliases:
        calibration = calibration.with_aliases(plan.aliases)
    ins = _Insertion(model, calibration, default_float_type, taken, sources)
    _emit_activations(ins, plan)
    weight_scales = _emit_weights(ins, plan)
    _emit_biases(ins, plan, weight_scales)
    graph = model.graph
    graph.initializer.extend(ins.new_inits)
    graph.node.extend(ins.new_nodes)
    _emit_bodies(model, plan.bodies, calibration, default_float_type, taken)
    # drop float weights no node reads any more (in this graph or, by outer-scope reference, in a body)
    used = graph_reads(graph)
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    topological_sort(model)


def _emit_activations(ins: _Insertion, plan: QDQPlan) -> None:
    """One Q/DQ pair per (tensor, dtype), shared by the consumers that asked for it."""
    g = ins.g
    wanted: dict[tuple[str, str], set[Consumer] | None] = {}
    for a in plan.activations:
        key = (a.tensor, a.dtype)
        if a.consumers is None or wanted.get(key, set()) is None:
            wanted[key] = None
        else:
            wanted.setdefault(key, set()).update(a.consumers)  # type: ignore[union-attr]
    dtypes_per_tensor = Counter(t for t, _ in wanted)
    rewired: dict[Consumer, str] = {}
    for (tensor, dtype), who in sorted(wanted.items(), key=lambda kv: kv[0]):
        readers = [(c.name, i) for c, i in g.consumers.get(tensor, [])]
        # every reader, but not one that only carries the tensor to graph outputs (a recurrent state passed
        # back in, an output the user reads): a Q/DQ gains it nothing and costs it precision
        targets = [r for r in readers if computes_on(g, g.nodes[r[0]])] if who is None else sorted(who)
        targets = [c for c in targets if c not in rewired]
        if not targets and tensor not in g.graph_outputs:
            continue
        p = ins.calibration.params(tensor, dtype)
        ft = ins.float_type(tensor)
        suffix = "" if dtypes_per_tensor[tensor] == 1 else f"_{dtype}"
        base = f"{tensor}{suffix}"
        s_name, z_name = ins.unique(f"{base}_scale"), ins.unique(f"{base}_zero_point")
        q_out, dq_out = ins.unique(f"{base}_quantized"), ins.unique(f"{base}_dequantized")
        ins.new_inits += [_scalar_or_vector(s_name, p.scale, ft), make_zero_point(z_name, p.zero_point, dtype)]
        q_in = tensor
        if tensor in g.graph_outputs and who is None:
            # a quantized graph output keeps its name on the DQ side, so the producer + Q can fuse
            q_in = ins.unique(f"{tensor}{PREQUANT_SUFFIX}")
            for n in g.model.graph.node:
                for k, o in enumerate(n.output):
                    if o == tensor:
                        n.output[k] = q_in
            dq_out = tensor
        ins.new_nodes += [
            helper.make_node("QuantizeLinear", [q_in, s_name, z_name], [q_out],
                             name=ins.unique(f"{base}_QuantizeLinear")),
            helper.make_node("DequantizeLinear", [q_out, s_name, z_name], [dq_out],
                             name=ins.unique(f"{base}_DequantizeLinear")),
        ]
        for node_name, idx in targets:
            g.nodes[node_name].input[idx] = dq_out
            rewired[(node_name, idx)] = dq_out


# weights quantized at once by _emit_weights: numpy releases the GIL on a weight's arrays, so the mse search
# of one runs beside another's (two at most in memory)
WEIGHTS_AT_ONCE = 2


def _emit_weights(ins: _Insertion, plan: QDQPlan) -> dict[tuple[str, int], QuantParams]:
    """Weights stored quantized, each followed by a DequantizeLinear; returns the scales by (node, input)."""
    g = ins.g
    weight_scales: dict[tuple[str, int], QuantParams] = {}
    with work_bar(len(plan.weights), "quantizing weights", unit="weight") as bar:
        for w, init, p, q in _quantized_weights(ins, plan):
            bar.set_postfix_str(w.node, refresh=False)  # the weight it is on; tqdm gives the ETA
            node = g.nodes[w.node]
            name = node.input[w.input_index]
            weight_scales[(w.node, w.input_index)] = p
            ft = init.data_type if init.data_type in _FLOAT_TYPES else ins.default_float_type
            base = ins.unique(f"{name}_{w.node}" if len(g.consumers.get(name, [])) > 1 else name)
            q_name, s_name, z_name, dq_out = ins.dq_names(base)
            ins.new_inits += [make_quantized_tensor(q_name, q, w.dtype),
                              _scalar_or_vector(s_name, p.scale, ft), make_zero_point(z_name, p.zero_point, w.dtype)]
            attrs = {"axis": w.axis} if w.axis is not None else {}
            ins.new_nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                                                  name=ins.unique(f"{base}_DequantizeLinear"), **attrs))
            node.input[w.input_index] = dq_out
            bar.update(1)
    return weight_scales


def _quantized_weights(ins: _Insertion, plan: QDQPlan
                       ) -> Iterator[tuple[WeightQ, onnx.TensorProto, QuantParams, np.ndarray]]:
    """(weight, its initializer, scales, quantized values) of each of ``plan.weights`` in order, up to
    WEIGHTS_AT_ONCE quantized at a time in worker threads (in this run's context: its weights folder)."""
    g = ins.g

    def quantized(w: WeightQ, name: str, init: onnx.TensorProto, source: onnx.TensorProto
                  ) -> tuple[WeightQ, onnx.TensorProto, QuantParams, np.ndarray]:
        values = weights.array(source).astype(np.float32, copy=False)
        p, q = ins.calibration.quantized_weight(name, values, w.axis, w.dtype, w.reduced)
        return w, init, p, q

    with ThreadPoolExecutor(WEIGHTS_AT_ONCE, thread_name_prefix="qdq-tune-weights") as pool:
        pending: deque[Future] = deque()
        try:
            for w in plan.weights:  # the graph is read here, in the caller's thread; the workers take arrays
                name = g.nodes[w.node].input[w.input_index]
                init = g.inits.get(name)
                if init is None:
                    raise ValueError(f"weight input {w.input_index} of node {w.node} ({name}) is not an initializer")
                pending.append(pool.submit(contextvars.copy_context().run, quantized, w, name, init,
                                           ins.sources.get(name, init)))
                if len(pending) == WEIGHTS_AT_ONCE:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


def search_weights_ahead(model: onnx.ModelProto, plan: QDQPlan, calibration: Calibration,
                         stop: threading.Event) -> None:
    """Search the scales of ``plan``'s weights of ``model``'s main graph (and quantize their values) into
    ``calibration``'s weight cache, in the order apply_plan takes them, until done or ``stop`` is set: run
    in a thread beside other work, apply_plan then finds them searched (or being searched: it waits for
    those). A weight apply_plan would refuse is left for it to refuse."""
    g = GraphIndex(model)
    for w in plan.weights:
        if stop.is_set():
            return
        name = g.nodes[w.node].input[w.input_index] if w.node in g.nodes else ""
        if name in g.inits:
            calibration.quantized_weight(name, weights.array(g.inits[name]).astype(np.float32, copy=False),
                                         w.axis, w.dtype, w.reduced)


def _emit_biases(ins: _Insertion, plan: QDQPlan, weight_scales: dict[tuple[str, int], QuantParams]) -> None:
    """int32 biases: scale = activation scale x per-channel weight scale, zero point 0."""
    g = ins.g
    for b in plan.biases:
        node = g.nodes[b.node]
        name = node.input[b.input_index]
        init = g.inits.get(name)
        wp = weight_scales.get((b.weight_node, b.weight_index))
        if init is None or wp is None or wp.dtype not in ("int8", "uint8"):
            continue
        shape = tuple(init.dims)
        # per-axis DQ needs one scale per element along one axis: a bias [N] runs along axis 0, a
        # tf2onnx-style [1, N] along its last axis; any other layout stays a float bias
        if not shape or any(d != 1 for d in shape[:-1]):
            continue
        ap = ins.calibration.params(b.activation, b.activation_dtype)
        scale = (np.float32(ap.scale) * np.asarray(wp.scale, np.float32)).astype(np.float32).reshape(-1)
        values = weights.array(init).astype(np.float64).reshape(-1)
        if scale.size not in (1, values.size):
            continue
        q = int32_bias(values, scale)
        base = ins.unique(f"{name}_{b.node}")
        q_name, s_name, z_name, dq_out = ins.dq_names(base)
        scale = np.broadcast_to(scale, values.shape).astype(np.float32)
        ins.new_inits += [numpy_helper.from_array(q.reshape(shape), q_name),
                          _scalar_or_vector(s_name, scale, init.data_type),
                          numpy_helper.from_array(np.zeros(scale.shape, np.int32), z_name)]
        ins.new_nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                                              name=ins.unique(f"{base}_DequantizeLinear"), axis=len(shape) - 1))
        node.input[b.input_index] = dq_out


def _emit_bodies(model: onnx.ModelProto, bodies: dict[str, QDQPlan], calibration: Calibration,
                 default_float_type: int, taken: set[str]) -> None:
    """Each Loop/Scan body with a plan in ``bodies``, quantized as a graph of its own and put back."""
    for view in body_views(model):
        inner = bodies.get(view.node.name)
        if inner is not None:
            _insert(view.model, inner, calibration, default_float_type, taken)
            put_back(view, view.model)


def get_quantized_tensors(model: onnx.ModelProto) -> set[str]:
    """Activation tensors that feed a QuantizeLinear (the placement of a Q/DQ model), by their
    float-model names."""
    inits = {i.name for i in model.graph.initializer}
    return {n.input[0].removesuffix(PREQUANT_SUFFIX) for n in model.graph.node
            if n.op_type == "QuantizeLinear" and n.input[0] not in inits}


def qdq_summary(model: onnx.ModelProto) -> dict[str, int]:
    """Q and DQ nodes of the model, inside control-flow bodies too."""
    q = sum(n.op_type == "QuantizeLinear" for n in iter_nodes(model.graph))
    dq = sum(n.op_type == "DequantizeLinear" for n in iter_nodes(model.graph))
    return {"QuantizeLinear": q, "DequantizeLinear": dq}
