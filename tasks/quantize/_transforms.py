"""Float-exact graph transforms that make tensors easier to quantize.

Both transforms rescale channels so that a quantization grid fits them better, without changing what
the float model computes (up to float rounding of the rescaled constants):

- ``equalize_cross_layer``: cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization";
  AIMET's CLE). For Conv -> [Relu | LeakyRelu] -> Conv, output channel i of the first conv is divided
  by s_i and input channel i of the second multiplied by s_i, with s_i = sqrt(r1_i / r2_i) so both
  per-channel weight ranges become sqrt(r1_i * r2_i). Exact because Relu and LeakyRelu are positively
  homogeneous (f(x / s) = f(x) / s for s > 0). Clip (Relu6) is not: ONNX Clip takes scalar bounds, so
  the per-channel bound 6 / s_i cannot be expressed, and such pairs are left alone.
- ``smooth_outliers``: SmoothQuant-style outlier migration (Xiao et al. 2023). An activation read by
  MatMul/Gemm with constant weights is divided per channel by s and the weights' input rows multiplied
  by s; 1/s is folded into the tensor's producer when it is a linear op with constants
  (LayerNormalization, Mul by a constant, MatMul/Gemm, followed by any chain of constant bias Adds),
  else a ``Mul(t, 1/s)`` is inserted before the smoothed consumers. alpha is chosen per tensor by the
  output error of int8 Q/DQ math on sampled activation rows.

Both are pure functions: the input model is never mutated; they return a new model and JSON-able
records of what changed.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from pipeline.graph import topological_sort
from pipeline.qdq import activation_params, quantize_values, weight_params

log = logging.getLogger("tune.quantize")

Use = tuple[int, int]  # (index in graph.node, input index)

# ops through which per-channel positive scaling commutes exactly: f(x / s) = f(x) / s for s > 0
HOMOGENEOUS_ACTIVATIONS = ("Relu", "LeakyRelu")
SMOOTHING_MIN_K = 16  # same threshold as placement.MIN_DOT: smaller MatMuls stay float anyway
SAMPLE_ROWS = 512
SCALE_LIMITS = (1e-5, 1e5)
MIN_GAIN = 0.02  # smoothing must cut the measured output error by more than this fraction
# a Mul inserted where no producer can absorb 1/s costs run time on every inference: only for tensors
# with real outlier channels (max / median channel absmax); BERT's FFN inputs measure 10-20
MUL_MIN_OUTLIER_RATIO = 6.0


# --------------------------------------------------------------------------- editing


class _Editor:
    """A private copy of a model whose constants are edited as float64 arrays and written back once.

    ``set_const`` rewrites a constant for some of its readers: in place when they are all its readers
    (and the shape is unchanged), else as a new initializer those readers are rewired to, so a weight
    shared with a node that is not being rescaled keeps its values for that node.
    """

    def __init__(self, model: onnx.ModelProto, copy: bool = True):
        if copy:
            self.model = onnx.ModelProto()
            self.model.CopyFrom(model)
        else:  # read-only lookups: no edit may be made
            self.model = model
        self.graph = self.model.graph
        self.inits = {i.name: i for i in self.graph.initializer}
        self.outputs = {o.name for o in self.graph.output}
        self._arrays: dict[str, np.ndarray] = {}
        self._dtypes: dict[str, np.dtype] = {}
        self._new: set[str] = set()
        self._dirty: set[str] = set()
        self._replaced: set[str] = set()
        self._nodes_added = False
        self._names = set(self.inits) | {n.name for n in self.graph.node}
        self._names |= {t for n in self.graph.node for t in (*n.input, *n.output)}
        self._names |= {v.name for v in (*self.graph.input, *self.graph.output, *self.graph.value_info)}
        self._index: tuple[dict[str, list[Use]], dict[str, int]] | None = None

    # ---- lookups
    def _lookups(self) -> tuple[dict[str, list[Use]], dict[str, int]]:
        if self._index is None:
            uses: dict[str, list[Use]] = defaultdict(list)
            producer: dict[str, int] = {}
            for i, n in enumerate(self.graph.node):
                for j, t in enumerate(n.input):
                    if t:
                        uses[t].append((i, j))
                for o in n.output:
                    if o:
                        producer[o] = i
            self._index = (uses, producer)
        return self._index

    def uses(self, tensor: str) -> list[Use]:
        return list(self._lookups()[0].get(tensor, ()))

    def producer(self, tensor: str) -> int | None:
        return self._lookups()[1].get(tensor)

    def node(self, i: int) -> onnx.NodeProto:
        return self.graph.node[i]

    def is_const(self, name: str) -> bool:
        return bool(name) and name in self.inits

    def array(self, name: str) -> np.ndarray:
        if name not in self._arrays:
            a = numpy_helper.to_array(self.inits[name])
            self._dtypes[name] = a.dtype
            self._arrays[name] = a.astype(np.float64)
        return self._arrays[name]

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self._arrays:
            return self._arrays[name].shape
        return tuple(int(d) for d in self.inits[name].dims)

    def is_float_const(self, name: str) -> bool:
        return self.is_const(name) and self.inits[name].data_type in (
            onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.BFLOAT16)

    def unique(self, base: str) -> str:
        name, k = base, 1
        while name in self._names:
            name, k = f"{base}_{k}", k + 1
        self._names.add(name)
        return name

    # ---- edits
    def set_const(self, name: str, values: np.ndarray, readers: Sequence[Use]) -> str:
        """Give ``readers`` (which all read ``name``) the constant ``values``; returns its name."""
        self.array(name)
        mine = set(readers)
        if (set(self.uses(name)) <= mine and values.shape == self._arrays[name].shape
                and name not in self.outputs):
            self._arrays[name] = values
            self._dirty.add(name)
            return name
        new = self.unique(f"{name}_scaled")
        self._arrays[new] = values
        self._dtypes[new] = self._dtypes[name]
        self._new.add(new)
        self._dirty.add(new)
        self._replaced.add(name)
        for i, j in readers:
            self.graph.node[i].input[j] = new
        self._index = None
        return new

    def add_node(self, node: onnx.NodeProto, consts: Mapping[str, np.ndarray], dtype: np.dtype) -> None:
        for name, values in consts.items():
            self._arrays[name] = values
            self._dtypes[name] = np.dtype(dtype)
            self._new.add(name)
            self._dirty.add(name)
        self.graph.node.append(node)
        self._nodes_added = True
        self._index = None

    def rewire(self, readers: Iterable[Use], tensor: str) -> None:
        for i, j in readers:
            self.graph.node[i].input[j] = tensor
        self._index = None

    def finish(self) -> onnx.ModelProto:
        for name in self._dirty:
            t = numpy_helper.from_array(self._arrays[name].astype(self._dtypes[name]), name)
            if name in self._new:
                self.graph.initializer.append(t)
                self.inits[name] = self.graph.initializer[-1]
            else:
                self.inits[name].CopyFrom(t)
        orphans = {n for n in self._replaced if not self.uses(n) and n not in self.outputs}
        if orphans:
            keep = [i for i in self.graph.initializer if i.name not in orphans]
            del self.graph.initializer[:]
            self.graph.initializer.extend(keep)
            # old-IR models list initializers as graph inputs too
            inputs = [v for v in self.graph.input if v.name not in orphans]
            del self.graph.input[:]
            self.graph.input.extend(inputs)
        if self._nodes_added:
            topological_sort(self.model)
        return self.model


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _spread(r: np.ndarray) -> float:
    """max / min of the positive entries (1.0 when there are none)."""
    pos = r[r > 0]
    return float(pos.max() / pos.min()) if pos.size else 1.0


# --------------------------------------------------------------------------- cross-layer equalization


@dataclass(frozen=True)
class _ConvPair:
    first: int
    activation: int | None
    second: int


def _conv_pairs(ed: _Editor) -> list[_ConvPair]:
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
        group2 = int(_attr(conv2, "group", 1))
        if len(w1) < 3 or len(w2) < 3 or w2[0] % group2 or w2[1] * group2 != w1[0]:
            continue
        pairs.append(_ConvPair(i, act, nxt))
    return pairs


def _pair_ranges(ed: _Editor, p: _ConvPair) -> tuple[np.ndarray, np.ndarray]:
    """Per channel i of the tensor between the convs: max |w| of the first conv's output channel i
    and of the second conv's input channel i (over all output channels of its group)."""
    w1 = ed.array(ed.node(p.first).input[1])
    conv2 = ed.node(p.second)
    w2 = ed.array(conv2.input[1])
    g = int(_attr(conv2, "group", 1))
    r1 = np.abs(w1).reshape(w1.shape[0], -1).max(axis=1)
    r2 = np.abs(w2).reshape(g, w2.shape[0] // g, w2.shape[1], -1).max(axis=(1, 3)).reshape(-1)
    return r1, r2


def _equalize_pair(ed: _Editor, p: _ConvPair) -> float:
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
    g = int(_attr(conv2, "group", 1))
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
    ed = _Editor(model)
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


# --------------------------------------------------------------------------- SmoothQuant


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
    if node.op_type == "Gemm" and not _attr(node, "transA", 0):
        return w, 1 if _attr(node, "transB", 0) else 0
    return None


def smoothing_candidates(model: onnx.ModelProto) -> list[str]:
    """Activation tensors read by MatMul/Gemm with an initializer weight and K >= 16, producers first."""
    ed = _Editor(model, copy=False)
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
    stats = {"min": float(x.min()), "max": float(x.max()), "threshold": float(np.abs(x).max()),
             "algorithm": "minmax"}
    p = activation_params(stats, act_dtype)
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


@dataclass(frozen=True)
class _Edit:
    """Divide constant input ``index`` of node ``node`` by s along ``axis`` (-1: the last axis,
    broadcasting a size-1 or scalar constant up to K)."""

    node: int
    index: int
    axis: int = -1


def _fits_last_axis(ed: _Editor, name: str, k: int) -> bool:
    shape = ed.shape(name)
    return len(shape) == 0 or shape[-1] in (1, k)


def _absorber(ed: _Editor, tensor: str, k: int) -> tuple[str, list[_Edit]] | None:
    """How the producer of ``tensor`` can output tensor / s exactly (op label, constant edits)."""
    i = ed.producer(tensor)
    if i is None:
        return None
    node = ed.node(i)
    if node.output[0] != tensor:
        return None
    op, ins = node.op_type, list(node.input)
    consts = [j for j, t in enumerate(ins) if ed.is_float_const(t)]
    edits: list[_Edit]
    if op == "LayerNormalization":
        edits = [_Edit(i, j) for j in (1, 2) if j < len(ins) and ins[j]]
        if any(e.index not in consts for e in edits):
            return None
    elif op == "Mul" and len(ins) == 2 and len(consts) == 1:
        edits = [_Edit(i, consts[0])]
    elif op == "MatMul" and consts == [1] and ed.shape(ins[1])[-1:] == (k,):
        edits = [_Edit(i, 1)]
    elif op == "Gemm" and 1 in consts and 0 not in consts:
        axis = 0 if _attr(node, "transB", 0) else 1
        if ed.shape(ins[1])[axis] != k or (len(ins) > 2 and ins[2] and 2 not in consts):
            return None
        edits = [_Edit(i, 1, axis)] + ([_Edit(i, 2)] if len(ins) > 2 and ins[2] else [])
    elif op == "Add" and len(ins) == 2 and len(consts) == 1:
        inner_t = ins[1 - consts[0]]
        if inner_t in ed.outputs or ed.uses(inner_t) != [(i, 1 - consts[0])]:
            return None
        inner = _absorber(ed, inner_t, k)
        if inner is None:
            return None
        return f"{inner[0]}+Add", [*inner[1], _Edit(i, consts[0])]
    else:
        return None
    if any(e.axis == -1 and not _fits_last_axis(ed, ins[e.index], k) for e in edits):
        return None
    return op, edits


def _divide(values: np.ndarray, s: np.ndarray, axis: int) -> np.ndarray:
    if axis == -1:
        return values / s
    shape = [1] * values.ndim
    shape[axis] = -1
    return values / s.reshape(shape)


@dataclass
class _Consumers:
    uses: list[Use]
    weights: dict[str, tuple[list[Use], int]]  # weight name -> (readers among the consumers, K axis)

    def names(self, ed: _Editor) -> list[str]:
        return [ed.node(i).name for i, _ in self.uses]


def _consumers(ed: _Editor, tensor: str, k: int) -> _Consumers:
    c = _Consumers([], {})
    for i, j in ed.uses(tensor):
        hit = _smoothable(ed.node(i), j, ed.is_float_const, ed.shape)
        if hit is None or ed.shape(hit[0])[hit[1]] != k:
            continue
        c.uses.append((i, j))
        readers, _ = c.weights.setdefault(hit[0], ([], hit[1]))
        readers.append((i, 1))
    return c


def _weights_kn(ed: _Editor, c: _Consumers) -> list[np.ndarray]:
    return [ed.array(w) if axis == 0 else ed.array(w).T for w, (_, axis) in c.weights.items()]


def _absorbing(ed: _Editor, tensor: str, c: _Consumers, k: int) -> tuple[str, list[_Edit]] | None:
    """The producer edits that absorb 1/s, when ``tensor`` feeds only the smoothed consumers."""
    exclusive = tensor not in ed.outputs and set(ed.uses(tensor)) == set(c.uses)
    return _absorber(ed, tensor, k) if exclusive else None


def _apply_smoothing(ed: _Editor, tensor: str, c: _Consumers, s: np.ndarray) -> tuple[str, bool]:
    """Scale the consumers' weights by s and make them read tensor / s; returns (absorbed_by, inserted)."""
    dtype = ed._dtypes.get(next(iter(c.weights)), np.dtype(np.float32))
    found = _absorbing(ed, tensor, c, s.size)
    for w, (readers, axis) in c.weights.items():
        shape = [1, 1]
        shape[axis] = -1
        ed.set_const(w, ed.array(w) * s.reshape(shape), readers)
    if found is not None:
        label, edits = found
        for e in edits:
            name = ed.node(e.node).input[e.index]
            ed.set_const(name, _divide(ed.array(name), s, e.axis), [(e.node, e.index)])
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


def _outlier_ratio(absmax: np.ndarray) -> float:
    from tasks.quantize._calibrate import outlier_ratio

    return outlier_ratio(absmax)


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
    those consumers and is not a graph output (see ``_absorber``), else a Mul is inserted, and only
    for a tensor whose channels differ by MUL_MIN_OUTLIER_RATIO or more.

    Records, one per smoothed tensor: tensor, consumers, alpha, absorbed_by (producer op chain, or
    "Mul" for an inserted Mul), inserted_mul, outlier_ratio_before / after (max / median of absmax),
    error_before / error_after (None without samples).
    """
    if act_dtype not in ("uint8", "int8"):
        raise ValueError(f"act_dtype {act_dtype!r}: choose uint8 or int8")
    ed = _Editor(model)
    records: list[dict] = []
    for t in smoothing_candidates(model):
        if t not in act_absmax:
            continue
        ax = np.asarray(act_absmax[t], np.float64).reshape(-1)
        c = _consumers(ed, t, ax.size)
        if not c.uses:
            log.debug("smoothing: %s has %d channels, its MatMul/Gemm weights disagree", t, ax.size)
            continue
        if _outlier_ratio(ax) < MUL_MIN_OUTLIER_RATIO and _absorbing(ed, t, c, ax.size) is None:
            log.debug("smoothing: %s left alone (outlier ratio %.1f too small for an inserted Mul)", t,
                      _outlier_ratio(ax))
            continue
        weights = _weights_kn(ed, c)
        aw = np.max([np.abs(w).max(axis=1) for w in weights], axis=0)
        x = samples.get(t) if samples is not None else None
        err_before = err_after = None
        if x is not None and np.size(x):
            x = np.asarray(x, np.float64).reshape(-1, ax.size)
            err_before = smoothing_error(x, weights, np.ones_like(ax), act_dtype)
            alpha, err_after = 0.0, err_before
            for a in alphas:
                if a <= 0:
                    continue
                e = smoothing_error(x, weights, smoothing_scales(ax, aw, a), act_dtype)
                if e < err_after:
                    alpha, err_after = float(a), e
            if alpha == 0.0 or err_after >= (1.0 - MIN_GAIN) * err_before:
                log.debug("smoothing: %s left alone (no alpha cuts the output error by > 2%%)", t)
                continue
        else:
            alpha = 0.5
        s = smoothing_scales(ax, aw, alpha)
        consumer_names = c.names(ed)
        absorbed_by, inserted = _apply_smoothing(ed, t, c, s)
        records.append({"tensor": t, "consumers": consumer_names, "alpha": alpha, "absorbed_by": absorbed_by,
                        "inserted_mul": inserted, "outlier_ratio_before": _outlier_ratio(ax),
                        "outlier_ratio_after": _outlier_ratio(ax / s), "error_before": err_before,
                        "error_after": err_after})
    log.info("outlier smoothing: %d tensor(s) smoothed (%d with an inserted Mul)", len(records),
             sum(r["inserted_mul"] for r in records))
    return ed.finish(), records


def channel_absmax(model: onnx.ModelProto, batches_fn: Callable[[], Iterable[Any]], tensors: Sequence[str],
                   threads: int = 1, max_rows: int = SAMPLE_ROWS, seed: int = 0
                   ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Per-channel (last axis) absmax of ``tensors`` over the float model's run on ``batches_fn()``
    (``pipeline.data.Batch`` objects or plain feed dicts), and up to ``max_rows`` rows of each tensor
    reshaped to [-1, K], drawn uniformly over all batches (smallest random keys kept)."""
    from pipeline.data import Batch
    from tasks.quantize._calibrate import _Runner

    runner = _Runner(model, list(tensors), threads)
    rng = np.random.default_rng(seed)
    absmax: dict[str, np.ndarray] = {}
    keys: dict[str, np.ndarray] = {}
    rows: dict[str, np.ndarray] = {}
    for batch in batches_fn():
        if not isinstance(batch, Batch):
            feeds = {k: np.asarray(v) for k, v in dict(batch).items()}
            first = next(iter(feeds.values()))
            batch = Batch(feeds, None, int(first.shape[0]) if first.ndim else 1)
        for t, arr in runner(batch).items():
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


# --------------------------------------------------------------------------- checking


def float_rel_error(before: onnx.ModelProto, after: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]]
                    ) -> float:
    """max over outputs of ||y_after - y_before|| / ||y_before|| (norms over all ``feeds``), both run
    on ORT CPU with graph optimizations off so fusions cannot differ between the two graphs."""
    import onnxruntime as ort

    def session(m: onnx.ModelProto) -> Any:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        so.log_severity_level = 3
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])

    names = [o.name for o in before.graph.output]
    missing = sorted(set(names) - {o.name for o in after.graph.output})
    if missing:
        raise ValueError(f"transformed model lacks output(s) {missing}; transforms must keep every output")
    sb, sa = session(before), session(after)
    num = dict.fromkeys(names, 0.0)
    den = dict.fromkeys(names, 0.0)
    for f in feeds:
        for n, yb, ya in zip(names, sb.run(names, dict(f)), sa.run(names, dict(f)), strict=True):
            yb64, ya64 = np.asarray(yb, np.float64), np.asarray(ya, np.float64)
            num[n] += float(np.sum((ya64 - yb64) ** 2))
            den[n] += float(np.sum(yb64 ** 2))
    return max((np.sqrt(num[n] / den[n]) if den[n] > 0 else np.sqrt(num[n]) for n in names), default=0.0)
