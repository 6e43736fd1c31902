"""Where Q/DQ goes: per-node dtype rules and the default placements for each runtime's fusions.

``resolve_rules`` maps every node to the dtypes its first matching `quantize.layers` rule gives
(op type, node-name wildcard, or "*"; first match wins; `skip_names` and `native` leave it float).

Two placements build a ``QDQPlan`` from those assignments:

- ``tensorrt_plan`` follows TensorRT's Q/DQ placement recommendations: quantize every input of
  weighted ops (Conv, ConvTranspose, Gemm, MatMul; per-channel symmetric weights), leave their
  outputs float, and quantize the residual input of an Add fed by a Conv so Conv+Add can fuse.
  MatMul/Gemm with K or N < 16 stay float (too small to gain).
- ``onnxruntime_plan`` builds the node groups ORT's CPU execution provider fuses into integer
  kernels: DQ -> Conv/Gemm/MatMul -> Q (QLinearConv, QGemm, QLinearMatMul; MatMul without a Q on
  its output becomes MatMulIntegerToFloat), QLinearAdd/Mul for residual adds whose
  output feeds quantized ops, QLinear(Global)AveragePool/Concat, and data-movement ops (MaxPool,
  Reshape, Transpose, Flatten, ...) run on int8 when they sit between quantized ops (their Q/DQ
  pair keeps the input's scale so ORT can drop it). A Relu/Clip right after an op is skipped over:
  the Q goes after it, and with uint8 (zero point at the bottom of the range) ORT folds the Relu.
  Softmax, LayerNormalization and GELU-like tails stay float: quantizing them costs conversions
  without a fast kernel.

- ``openvino_plan`` builds what OpenVINO's low-precision transformations turn into int8 kernels
  (its CPU plugin: oneDNN, AMX or VNNI). Convolution chains follow the ONNX Runtime groups: with the
  Q after each Conv (past its Relu) and on both inputs and the output of a residual Add, OpenVINO runs
  Conv, the Add fused into it as a sum, and pooling in u8 end to end. MatMul and Gemm follow
  TensorRT's rule: only their inputs are quantized, their outputs stay float, so the FullyConnected
  or MatMul layer runs int8 and hands bf16/f32 to LayerNorm, Softmax and residual adds, which have no
  int8 kernels there and would only gain requantization. Convolution activations are uint8 with a
  zero point (asymmetric, as for ORT): OpenVINO's int8 convolutions take u8 sources with zero points,
  and a post-Relu range keeps all 256 levels. MatMul/Gemm activations are int8 and symmetric: an s8
  source needs no zero-point compensation in the FullyConnected kernel
  (docs/measurements/README-benchmarks-until-2026-11-28.md: "Why the code does what it does"), except where the input is pooled (a classifier head's GlobalAveragePool, through
  Flatten): there the pooling's input and output get u8 Qs, as NNCF places them, so the pooling runs
  on u8 and the FullyConnected reads its u8 output without a requantizing layer between them. A tensor both read
  is quantized once, as the first rule placed it.

Every placement places Loop/Scan bodies by the same rules, each body seen as a graph of its own
(``pipeline.graph.bodies``); the plan of a body is in ``QDQPlan.bodies``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import onnx

from pipeline.graph.bodies import QUANTIZED_BODIES, body_views
from pipeline.graph.index import ACTIVATION_TAILS, GraphIndex, bias_slot, through_shape_ops, weight_inputs
from pipeline.graph.model import WEIGHTED_OPS, iter_nodes
from pipeline.quant.plan import ActivationQ, BiasQ, QDQPlan, WeightQ, WeightVariant
from pipeline.values import enum_value

# ops whose Q/DQ ORT drops, running them directly on 8-bit data
PASS_THROUGH_OPS = ("MaxPool", "Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Slice", "Split",
                    "Resize", "Gather", "Identity")
# ops with QLinear* kernels in ORT's CPU EP besides the weighted ones
ORT_QLINEAR_OPS = ("Add", "Mul", "AveragePool", "GlobalAveragePool", "Concat")
QUANTIZABLE_OPS = (*WEIGHTED_OPS, *ORT_QLINEAR_OPS, *PASS_THROUGH_OPS, "Softmax", "Sigmoid", "LeakyRelu",
                   "Where", "Relu", "Clip")


def weight_q(node: onnx.NodeProto, index: int, shape: tuple[int, ...], dtype: str, per_channel: bool = True,
             weight_range: str = "full") -> WeightQ:
    """How one weight is stored: int8 rules follow ``weight_range`` (full: int8 +-127; reduced: int8
    +-64; uint8: uint8 with zero point 128); fp8 rules are unaffected."""
    weight_range = WeightVariant.of(weight_range)
    axis = weight_axis(node, index, shape, per_channel)
    if dtype != "int8":
        return WeightQ(node.name, index, dtype, axis)
    return WeightQ(node.name, index, "uint8" if weight_range == "uint8" else "int8", axis, weight_range == "reduced")


@dataclass(frozen=True)
class NodeDtypes:
    """dtypes the matching rule gives one node ("native" = leave float)."""

    weights: str
    activations: str
    rule: str


def resolve_rules(model: onnx.ModelProto, layers: Iterable, skip_names: Iterable[str] = (),
                  op_types: Iterable[str] = ()) -> dict[str, NodeDtypes]:
    """Node name -> dtypes of the first rule that matches it (op type, name wildcard or "*"), for the
    nodes of the main graph and of Loop/Scan bodies."""
    rules = list(layers)
    skips = list(skip_names)
    allowed = set(op_types)
    out: dict[str, NodeDtypes] = {}
    for node in iter_nodes(model.graph, QUANTIZED_BODIES):
        if any(fnmatch.fnmatchcase(node.name, s) for s in skips):
            continue
        if allowed and node.op_type not in allowed:
            continue
        for i, rule in enumerate(rules):
            pat = str(rule["module_name"] if isinstance(rule, dict) else rule.module_name)
            if pat == "*" or pat == node.op_type or fnmatch.fnmatchcase(node.name, pat):
                w = enum_value(rule["weights"]["dtype"] if isinstance(rule, dict) else rule.weights.dtype)
                a = enum_value(rule["activations"]["dtype"] if isinstance(rule, dict) else rule.activations.dtype)
                if a != "native" or w != "native":
                    out[node.name] = NodeDtypes(w, a, f"layers[{i}] ({pat})")
                break
    return out


def _trans_b(node: onnx.NodeProto) -> bool:
    return any(a.name == "transB" and a.i for a in node.attribute)


def weight_axis(node: onnx.NodeProto, index: int, shape: tuple[int, ...], per_channel: bool = True) -> int | None:
    """Output-channel axis of a weight input of shape ``shape``, or None for per-tensor scales."""
    if not per_channel or len(shape) < 2:
        return None
    if node.op_type == "Conv":
        return 0
    if node.op_type == "ConvTranspose":
        return 1
    if node.op_type == "Gemm" and index == 1:
        return 0 if _trans_b(node) else 1
    if node.op_type == "MatMul" and index == 1:
        return len(shape) - 1
    return None


def _gemm_dims(node: onnx.NodeProto, shape: tuple[int, ...]) -> tuple[int, int]:
    """(K, N) of a Gemm/MatMul weight of shape ``shape``."""
    if node.op_type == "Gemm":
        n, k = (shape[0], shape[1]) if _trans_b(node) else (shape[1], shape[0])
        return k, n
    return shape[-2], shape[-1]


MIN_DOT = 16  # K or N below this: too little work to gain, and FP8's 3-bit mantissa error dominates


def too_small(g: GraphIndex, node: onnx.NodeProto, dtype: str) -> bool:
    """Whether a weighted op is too small to quantize.

    MatMul/Gemm with K or N < 16 stay float for every dtype (the reference tool's rule). Convs with
    a reduction K = C_in/group * kh * kw < 16 or fewer than 16 output channels stay float for FP8
    only: TensorRT has no FP8 kernels for such channel counts, and a 3-bit mantissa on a handful of
    taps (a first conv on a 1-channel image) costs accuracy; int8 handles them fine.
    """
    widx = weight_inputs(g, node)
    if not widx:
        return False
    shape = g.weight_shape(node.input[widx[0]])
    if node.op_type in ("Gemm", "MatMul"):
        k, n = _gemm_dims(node, shape)
        return k < MIN_DOT or n < MIN_DOT
    if node.op_type == "Conv" and dtype.startswith("fp8"):
        return int(np.prod(shape[1:])) < MIN_DOT or shape[0] < MIN_DOT
    return False


def act_dtype(rule: NodeDtypes, activation_type: str) -> str:
    """Storage dtype of a node's activations: int8 becomes uint8 under ORT's asymmetric convention."""
    return "uint8" if rule.activations == "int8" and activation_type == "uint8" else rule.activations


# OpenVINO's MatMul/Gemm read symmetric int8 activations (see openvino_plan)
OPENVINO_SYMMETRIC_OPS = ("MatMul", "Gemm")


def input_dtype(kind: PlacementKind, consumer: onnx.NodeProto, rule: NodeDtypes, activation_type: str) -> str:
    """Storage dtype of an activation quantized for ``consumer`` under placement ``kind``."""
    if consumer.op_type in kind.symmetric_inputs:
        return rule.activations
    return act_dtype(rule, activation_type)


def tensorrt_plan(model: onnx.ModelProto, rules: dict[str, NodeDtypes], activation_type: str = "int8",
                  per_channel: bool = True, weight_range: str = "full") -> QDQPlan:
    g = GraphIndex(model)
    plan = QDQPlan()
    for node in model.graph.node:
        rule = rules.get(node.name)
        if rule is None or node.op_type not in WEIGHTED_OPS or rule.activations == "native":
            continue
        widx = weight_inputs(g, node)
        if too_small(g, node, rule.activations):
            plan.skipped[node.name] = "too small to gain (K or N < 16)"
            continue
        acts = [i for i, t in enumerate(node.input[:2]) if g.is_activation(t)]
        if not acts:
            continue
        plan.node_rules[node.name] = rule.rule
        for i in acts:
            plan.activations.append(ActivationQ(node.input[i], act_dtype(rule, activation_type), ((node.name, i),)))
        if rule.weights != "native":
            for i in widx:
                plan.weights.append(weight_q(node, i, g.weight_shape(node.input[i]), rule.weights, per_channel,
                                             weight_range))
    # residual Add: quantize the input that does NOT come from a quantized Conv, so Conv+Add fuses
    quantized_convs = {n for n in plan.node_rules if g.nodes[n].op_type == "Conv"}
    for node in model.graph.node:
        if (node.op_type != "Add" or len(node.input) != 2 or rules.get(node.name) is None
                or not all(g.is_activation(t) for t in node.input)):
            continue  # (an Add in skip_names or without a rule stays float)
        from_conv = [i for i, t in enumerate(node.input)
                     if t in g.producer and g.producer[t].name in quantized_convs]
        if len(from_conv) == 1:
            other = 1 - from_conv[0]
            conv_rule = rules[g.producer[node.input[from_conv[0]]].name]
            plan.activations.append(ActivationQ(node.input[other], act_dtype(conv_rule, activation_type),
                                                ((node.name, other),)))
            plan.node_rules[node.name] = conv_rule.rule
    return _place_bodies(model, plan, lambda view: tensorrt_plan(view, rules, activation_type, per_channel,
                                                                 weight_range))


def openvino_plan(model: onnx.ModelProto, rules: dict[str, NodeDtypes], activation_type: str = "uint8",
                  per_channel: bool = True, weight_range: str = "full") -> QDQPlan:
    """OpenVINO's placement (see the module docstring): ONNX Runtime's groups for everything but
    MatMul/Gemm, which get TensorRT's rule (their activation inputs alone, int8, for them only)."""
    dot_nodes = {n.name for n in model.graph.node if n.op_type in OPENVINO_SYMMETRIC_OPS}
    dots = {n: r for n, r in rules.items() if n in dot_nodes}
    plan = onnxruntime_plan(model, {n: r for n, r in rules.items() if n not in dots}, activation_type,
                            per_channel, weight_range)
    plan.biases = []  # OpenVINO folds a DQ'd float bias itself; ORT's int32 QGemm bias is ORT's need
    plan.bodies = {}  # ORT's placement of the bodies: each body is placed by these rules below
    dot_plan = tensorrt_plan(model, dots, "int8", per_channel, weight_range)
    by_tensor = {a.tensor: k for k, a in enumerate(plan.activations)}
    g = GraphIndex(model)
    for a in dot_plan.activations:
        pooled = _pooled_source(g, a.tensor, rules) if a.dtype == "int8" else None
        for consumer in a.consumers or ():
            if pooled is None:
                _quantize_for(plan, by_tensor, a.tensor, a.dtype, consumer)
                continue
            pool, out, reader = pooled
            _quantize_for(plan, by_tensor, pool.input[0], activation_type, (pool.name, 0))
            _quantize_for(plan, by_tensor, out, activation_type, reader or consumer)
    plan.weights += dot_plan.weights
    plan.node_rules.update(dot_plan.node_rules)
    plan.skipped.update(dot_plan.skipped)
    return _place_bodies(model, plan, lambda view: openvino_plan(view, rules, activation_type, per_channel,
                                                                  weight_range))


# pooling OpenVINO runs on u8 with both sides quantized
U8_POOLING = ("GlobalAveragePool", "AveragePool", "MaxPool", "GlobalMaxPool")


def _pooled_source(g: GraphIndex, tensor: str, rules: dict[str, NodeDtypes]
                   ) -> tuple[onnx.NodeProto, str, tuple[str, int] | None] | None:
    """(pooling node, its output, that output's reader on the way to ``tensor``) where ``tensor`` is a
    pooling output through shape-only ops (``through_shape_ops``) and the pooling's rule quantizes it.
    None otherwise (a pooling left float keeps the Q on the dot's own input)."""
    t, reader = through_shape_ops(g, tensor)
    p = g.producer.get(t)
    if p is None or p.op_type not in U8_POOLING or not g.is_activation(p.input[0]):
        return None
    rule = rules.get(p.name)
    return (p, t, reader) if rule is not None and rule.activations != "native" else None


def _quantize_for(plan: QDQPlan, by_tensor: dict[str, int], tensor: str, dtype: str, consumer: tuple[str, int]
                  ) -> None:
    """Quantize ``tensor`` for ``consumer`` too: a tensor already quantized for some consumers gains
    this one (one Q/DQ pair per tensor, so every reader sees one scale)."""
    k = by_tensor.get(tensor)
    if k is None:
        by_tensor[tensor] = len(plan.activations)
        plan.activations.append(ActivationQ(tensor, dtype, (consumer,)))
        return
    old = plan.activations[k]
    if old.consumers is not None and consumer not in old.consumers:
        plan.activations[k] = ActivationQ(tensor, old.dtype, (*old.consumers, consumer))


def _place_bodies(model: onnx.ModelProto, plan: QDQPlan, place) -> QDQPlan:
    """``plan`` with the plan of each Loop/Scan body that quantizes anything, placed by ``place`` (the
    builder of the main graph) on the body's view (``pipeline.graph.bodies``): the same rules inside."""
    for view in body_views(model):
        inner = place(view.model)
        if any(p.activations or p.weights for p in inner.walk()):
            plan.bodies[view.node.name] = inner
    return plan


def int32_bias(g: GraphIndex, node: onnx.NodeProto, act_dtype_: str) -> BiasQ | None:
    """The int32 bias ORT needs to run a Gemm / MatMul+bias with DQ inputs and a float output as QGemm."""
    slot = bias_slot(g, node)
    widx = weight_inputs(g, node)
    if slot is None or not widx or act_dtype_ not in ("int8", "uint8"):
        return None
    return BiasQ(slot[0], slot[1], node.input[0], act_dtype_, node.name, widx[0])


def onnxruntime_plan(model: onnx.ModelProto, rules: dict[str, NodeDtypes], activation_type: str = "uint8",
                     per_channel: bool = True, weight_range: str = "full") -> QDQPlan:
    g = GraphIndex(model)
    plan = QDQPlan()
    qnodes = _ort_compute_nodes(g, rules, plan.skipped)
    _ort_add_optional_groups(g, rules, qnodes)
    requested, outputs_q = _ort_node_quantization(g, qnodes, plan, activation_type, per_channel, weight_range)
    for tensor, dtype in requested.items():
        if tensor in outputs_q or _quantized_source(g, qnodes, tensor):
            plan.activations.append(ActivationQ(tensor, dtype, None))
        else:
            # produced in float by a float op: only the quantized consumers read the DQ copy,
            # float consumers keep the original tensor (no stray DequantizeLinear, no rounding)
            cons = tuple((c.name, i) for c, i in g.consumers.get(tensor, []) if c.name in qnodes)
            plan.activations.append(ActivationQ(tensor, dtype, cons))
    plan.aliases.update(pass_through_aliases(g, plan))
    return _place_bodies(model, plan, lambda view: onnxruntime_plan(view, rules, activation_type, per_channel,
                                                                     weight_range))


def _quantizable_rule(rules: dict[str, NodeDtypes], node: onnx.NodeProto) -> NodeDtypes | None:
    """The node's rule, unless it has none or leaves the activations float."""
    r = rules.get(node.name)
    return r if r is not None and r.activations != "native" else None


def _ort_compute_nodes(g: GraphIndex, rules: dict[str, NodeDtypes], skipped: dict[str, str]) -> dict[str, NodeDtypes]:
    """Phase 1, the compute ops with integer kernels: Conv/Gemm/MatMul reading an activation (and
    otherwise activations or initializers). FP8 ones too small to gain go to ``skipped``."""
    qnodes: dict[str, NodeDtypes] = {}
    for node in g.model.graph.node:
        r = _quantizable_rule(rules, node)
        if r is None or node.op_type not in ("Conv", "Gemm", "MatMul"):
            continue
        if not all(g.is_activation(t) or t in g.inits for t in node.input[:2] if t):
            continue
        if not g.is_activation(node.input[0]):
            continue
        if r.activations.startswith("fp8") and too_small(g, node, r.activations):
            skipped[node.name] = "too small for FP8 (K or N < 16)"
            continue
        qnodes[node.name] = r
    return qnodes


def _quantized_source(g: GraphIndex, qnodes: dict[str, NodeDtypes], tensor: str) -> bool:
    """Whether ``tensor`` is a quantized node's tail (its output past a bias Add / Relu / Clip),
    or a graph input."""
    p = g.producer.get(tensor)
    if p is None:
        return tensor in g.graph_inputs
    src = p
    while src.name not in qnodes and src.input:
        prev = g.producer.get(src.input[0]) if src.op_type in ACTIVATION_TAILS else None
        if src.op_type == "Add":  # a MatMul's bias Add: walk back to the MatMul
            prev = next((g.producer[t] for t in src.input if t in g.producer
                         and g.bias_add(g.producer[t]) is not None and g.bias_add(g.producer[t])[0] is src), None)
        if prev is None:
            break
        src = prev
    return src.name in qnodes and g.tail(src) == tensor


def _feeds_quantized(g: GraphIndex, qnodes: dict[str, NodeDtypes], tensor: str) -> bool:
    """Whether every reader of ``tensor`` is quantized (and it is not a graph output)."""
    cons = g.consumers.get(tensor, [])
    return bool(cons) and tensor not in g.graph_outputs and all(c.name in qnodes for c, _ in cons)


def _before_layernorm(g: GraphIndex, node: onnx.NodeProto) -> bool:
    # A residual Add feeding LayerNormalization stays float: ORT then fuses the two into
    # SkipLayerNormalization, which is faster on the CPU EP than QLinearAdd + DQ + LayerNormalization
    # (docs/measurements/README-benchmarks-until-2026-11-28.md: "Why the code does what it does").
    # The autotuner can still toggle it back.
    return node.op_type == "Add" and any(c.op_type == "LayerNormalization"
                                         for c, _ in g.consumers.get(node.output[0], []))


def _ort_add_optional_groups(g: GraphIndex, rules: dict[str, NodeDtypes], qnodes: dict[str, NodeDtypes]) -> None:
    """Phase 2, added to ``qnodes``: the optional groups (QLinearAdd/Mul/Concat, pooling, data
    movement), decided as a greatest fixpoint: start from every candidate and drop those whose
    input is not quantized or whose output feeds no quantized op, until nothing changes (a
    residual Add and the pooling after it depend on each other)."""
    fixed = set(qnodes)
    for node in g.model.graph.node:
        r = _quantizable_rule(rules, node)
        if r is None or node.name in qnodes:
            continue
        acts = [t for t in node.input if g.is_activation(t)]
        if not acts:
            continue
        op = node.op_type
        if op in PASS_THROUGH_OPS or op in ("AveragePool", "GlobalAveragePool"):
            qnodes[node.name] = r
        elif op in ("Add", "Mul", "Concat") and len(acts) == len([t for t in node.input if t]):
            qnodes[node.name] = r
    changed = True
    while changed:
        changed = False
        for name in [n for n in qnodes if n not in fixed]:
            node = g.nodes[name]
            acts = [t for t in node.input if g.is_activation(t)]
            out = g.tail(node)
            if node.op_type in ("Add", "Mul", "Concat"):
                keep = any(_quantized_source(g, qnodes, t) for t in acts) and \
                    (_feeds_quantized(g, qnodes, out) or _before_layernorm(g, node))
            else:
                keep = _quantized_source(g, qnodes, node.input[0]) and _feeds_quantized(g, qnodes, out)
            if not keep:
                del qnodes[name]
                changed = True


def _ort_node_quantization(g: GraphIndex, qnodes: dict[str, NodeDtypes], plan: QDQPlan, activation_type: str,
                           per_channel: bool, weight_range: str) -> tuple[dict[str, str], set[str]]:
    """Phase 3, per quantized node in graph order: its rule, weights and int32 biases go into
    ``plan``; returns the activations it wants quantized (tensor -> dtype, first request wins) and
    which of them are quantized nodes' tails (the float tensor disappears in the fusion)."""
    requested: dict[str, str] = {}
    outputs_q: set[str] = set()

    def want(tensor: str, dtype: str, output: bool = False) -> None:
        requested.setdefault(tensor, dtype)
        if output:
            outputs_q.add(tensor)

    for node in g.model.graph.node:
        r = qnodes.get(node.name)
        if r is None:
            continue
        plan.node_rules[node.name] = r.rule
        dt = act_dtype(r, activation_type)
        op = node.op_type
        for i, t in enumerate(node.input):
            if g.is_activation(t) and not (op in PASS_THROUGH_OPS and i > 0):
                want(t, dt)
        out = g.tail(node)
        # Conv/Gemm/QLinear ops need Q on their output to become integer kernels. A MatMul with a
        # bias Add becomes QGemm only with a Q after the Add (else ORT's MatMul+Add fusion leaves a
        # float Gemm behind DQs); a bare MatMul without quantized consumers is better off as
        # MatMulIntegerToFloat (float output, no Q/DQ pair)
        if op in ("MatMul", "Gemm"):
            float_output_ok = r.weights == "int8" and int32_bias(g, node, dt) is not None
            if _feeds_quantized(g, qnodes, out) or (op == "MatMul" and out != node.output[0] and not float_output_ok):
                want(out, dt, output=True)
            elif out != node.output[0] or op == "Gemm":
                # no quantized consumer: a float-output QGemm, which needs the bias as an int32 DQ
                b = int32_bias(g, node, dt) if r.weights == "int8" else None
                if b is not None:
                    plan.biases.append(b)
        elif op in PASS_THROUGH_OPS:
            if _feeds_quantized(g, qnodes, out):
                want(out, dt, output=True)
        else:
            want(out, dt, output=True)
        if r.weights != "native":
            for i in weight_inputs(g, node):
                plan.weights.append(weight_q(node, i, g.weight_shape(node.input[i]), r.weights, per_channel,
                                             weight_range))
    return requested, outputs_q


def pass_through_aliases(g: GraphIndex, plan: QDQPlan) -> dict[str, str]:
    """Output -> input of data-movement ops quantized on both sides: the two Q/DQ pairs must share
    scale and zero point for ORT to drop them and run the op on 8-bit data."""
    quantized = {a.tensor for a in plan.activations}
    return {n.output[0]: n.input[0] for n in g.model.graph.node
            if n.op_type in PASS_THROUGH_OPS and n.output and n.input
            and n.output[0] in quantized and n.input[0] in quantized}


@dataclass(frozen=True)
class PlacementKind:
    """A placement (`quantize.placement`): whose fusions it follows, and what that implies for the stages
    that place, search and judge Q/DQ. A runtime declares its kind (``Backend.placement``)."""

    name: str
    # builder(model, rules, activation_type, per_channel, weight_range) -> QDQPlan
    builder: Callable[..., QDQPlan]
    # fused integer kernels on a CPU runtime are what deploys: candidates are judged on the runtime itself,
    # activations are uint8 with a zero point, and u8 x s8 saturation without VNNI matters
    cpu_kernels: bool = False
    # autotune's insertion points follow QLinear node groups (inputs of weighted and QLinear ops, outputs
    # of the ops with a Q after them); else only weighted ops' inputs and residual adds
    qlinear_groups: bool = False
    # int8 MatMul/Gemm get an int32 bias where their output stays float (ORT's float-output QGemm)
    int32_bias: bool = False
    # weighted nodes reading a quantized tensor through shape-only ops get their weights quantized too
    # (OpenVINO moves the DequantizeLinear through the reshape)
    reshaped_reads: bool = False
    # op types whose activation inputs are stored as the rule says (symmetric), whatever activation_type
    symmetric_inputs: tuple[str, ...] = ()
    # how its u8 x s8 kernels pair a convolution's reduction without VNNI (pipeline.quant.saturation.PAIRINGS)
    pair_order: str = "im2col"


DEFAULT_PLACEMENT = "tensorrt"  # the placement of a runtime that declares none (Q/DQ as TensorRT recommends)
PLACEMENTS: dict[str, PlacementKind] = {
    "tensorrt": PlacementKind("tensorrt", tensorrt_plan),
    "onnxruntime": PlacementKind("onnxruntime", onnxruntime_plan, cpu_kernels=True, qlinear_groups=True,
                                 int32_bias=True),
    "openvino": PlacementKind("openvino", openvino_plan, cpu_kernels=True, qlinear_groups=True, reshaped_reads=True,
                              symmetric_inputs=OPENVINO_SYMMETRIC_OPS, pair_order="channels"),
}
