"""Q/DQ insertion shared by quantize and autotune.

A ``QDQPlan`` says what to quantize: activation tensors (for all or some of their consumers),
weights (per output channel) and, where a runtime needs them, int32 biases. ORT's CPU EP fuses a
Gemm (or MatMul + bias Add) with DQ inputs and no Q on its output into a float-output QGemm only
when the bias also comes from an int32 DequantizeLinear; with a Q on the output it quantizes a
float bias itself. TensorRT rejects int32 DQ, so its backends fold them back to float biases
(``pipeline.backends.trt_common``). ``apply_plan`` writes QuantizeLinear /
DequantizeLinear nodes into a copy of a float model with scales from a ``Calibration``:

- zero-point dtype always equals the quantized dtype (int8, uint8, float8e4m3fn, float8e5m2);
- scales and zero points of activations are true scalars (shape []), which ORT needs to fuse
  QLinearAdd/QLinearMul groups; weights get 1-D per-channel scales with the right ``axis``;
- weights are stored quantized (int8 or fp8) followed by a DequantizeLinear;
- the scale's dtype is the consumer's float type, so DQ outputs match what the consumer expects;
- the opset is raised where needed (per-axis Q/DQ >= 13, FP8 >= 19); the result is topologically
  sorted and passes onnx.checker;
- a Loop/Scan body gets the plan ``QDQPlan.bodies`` holds for its node, applied to the body seen as a
  graph of its own (``pipeline.bodies``); a plan without bodies (autotune's: it tunes the main graph)
  takes the ones the quantize stage recorded in calibration.json (``Calibration.bodies``).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.errors import StageError, StateError
from pipeline.graph import graph_reads, iter_nodes, opset_version, tensor_elem_types, topological_sort

log = logging.getLogger("tune.qdq")

# storage dtype -> (TensorProto type, numpy dtype or None for fp8, qmin, qmax)
QTYPES: dict[str, tuple[int, Any, float, float]] = {
    "int8": (TensorProto.INT8, np.int8, -128, 127),
    "uint8": (TensorProto.UINT8, np.uint8, 0, 255),
    "fp8_e4m3fn": (TensorProto.FLOAT8E4M3FN, None, -448.0, 448.0),
    "fp8_e5m2": (TensorProto.FLOAT8E5M2, None, -57344.0, 57344.0),
}
FP8 = ("fp8_e4m3fn", "fp8_e5m2")
PREQUANT_SUFFIX = "_prequant"  # a quantized graph output's float tensor, renamed so the DQ keeps its name


def is_fp8(dtype: str) -> bool:
    return dtype in FP8


def _fp8_bytes(values: np.ndarray, dtype: str) -> bytes:
    import ml_dtypes

    np_t = ml_dtypes.float8_e4m3fn if dtype == "fp8_e4m3fn" else ml_dtypes.float8_e5m2
    return np.asarray(values, dtype=np.float32).astype(np_t).tobytes()


def make_quantized_tensor(name: str, values: np.ndarray, dtype: str) -> onnx.TensorProto:
    """A tensor of already-quantized values (integers or fp8-representable floats)."""
    tp, np_t, lo, hi = QTYPES[dtype]
    values = np.asarray(values)
    if np_t is None:
        return helper.make_tensor(name, tp, list(values.shape), _fp8_bytes(values, dtype), raw=True)
    return numpy_helper.from_array(np.clip(np.rint(values), lo, hi).astype(np_t), name)


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


def activation_params(stats: dict[str, float], dtype: str) -> QuantParams:
    """Scale/zero point of an activation from calibrated statistics.

    ``stats`` holds min, max and threshold (the algorithm's clipping magnitude), and with the mse and
    auto algorithms ``thresholds`` per dtype, which wins over ``threshold`` (the best clip differs
    between symmetric int8 and asymmetric uint8). int8 and fp8 are symmetric; uint8 is asymmetric
    over [min, max] clipped to +-threshold and widened to include 0, so a tensor that is never
    negative (a ReLU output) gets zero point 0: ORT then folds the ReLU.
    """
    per_dtype = stats.get("thresholds") or {}
    t = float(per_dtype.get(dtype, stats["threshold"]))
    if dtype == "uint8" and stats.get("algorithm") == "max":
        lo, hi = (-t if float(stats["min"]) < 0 else 0.0), t
        scale = (hi - lo) / 255.0 if hi > lo else 1.0
        return QuantParams.scalar(dtype, scale, float(np.clip(np.rint(-lo / scale), 0, 255)))
    if dtype == "uint8":
        lo = min(max(float(stats["min"]), -t), 0.0)
        hi = max(min(float(stats["max"]), t), 0.0)
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
    a = np.abs(w.astype(np.float32))
    if axis is None:
        amax = np.asarray(a.max() if a.size else 0.0)
    else:
        amax = np.moveaxis(a, axis, 0).reshape(a.shape[axis], -1).max(axis=1)
    if search == "mse" and not is_fp8(dtype) and not reduced and a.size:
        w32 = w.astype(np.float32)
        rows = w32.reshape(1, -1) if axis is None else np.moveaxis(w32, axis, 0).reshape(a.shape[axis], -1)
        ratio = _best_clip_ratio(rows, amax.reshape(-1), qmax, -128.0 if dtype == "uint8" else -127.0)
        amax = (amax * ratio.reshape(amax.shape)).astype(np.float32)  # the clip _clip_error scored
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    zero = np.full_like(scale, 128.0 if dtype == "uint8" else 0.0)
    return QuantParams(dtype, scale, zero, axis)


def _best_clip_ratio(rows: np.ndarray, amax: np.ndarray, qmax: float, qmin: float) -> np.ndarray:
    """Per row, the clip ratio (of ``amax``) whose scale ratio * amax / qmax reconstructs the row with the
    lowest squared error, rounded and clamped to [qmin, qmax] as quantize_values does. Ratio 1.0 is a
    candidate and a ratio only replaces a strictly better one, so no row ends worse than with absmax."""
    best = np.ones(rows.shape[0], np.float32)
    best_err = _clip_error(rows, amax, best, qmax, qmin)

    def keep_better(ratio: np.ndarray) -> None:
        nonlocal best, best_err
        err = _clip_error(rows, amax, ratio, qmax, qmin)
        better = err < best_err
        best, best_err = np.where(better, ratio, best), np.where(better, err, best_err)

    for r in WEIGHT_CLIP_RATIOS[WEIGHT_CLIP_RATIOS < 1.0][::-1]:
        keep_better(np.full_like(best, r))
    center = best.copy()
    for d in WEIGHT_CLIP_REFINE:
        keep_better(np.clip(center + np.float32(d), 0.0, 1.0).astype(np.float32))
    return best


def _clip_error(rows: np.ndarray, amax: np.ndarray, ratio: np.ndarray, qmax: float, qmin: float
                ) -> np.ndarray:
    clip = (amax * ratio).astype(np.float32)
    scale = np.where(clip > 0, clip / qmax, 1.0).astype(np.float32)[:, None]
    deq = np.clip(np.rint(rows / scale), qmin, qmax) * scale
    return np.square(rows - deq, dtype=np.float64).sum(axis=1)


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


# --------------------------------------------------------------------------- plans


Consumer = tuple[str, int]  # (node name, input index)


@dataclass(frozen=True)
class ActivationQ:
    """Quantize activation ``tensor`` as ``dtype`` for ``consumers`` (None: every consumer)."""

    tensor: str
    dtype: str
    consumers: tuple[Consumer, ...] | None = None


@dataclass(frozen=True)
class WeightQ:
    """Weight input ``input_index`` of ``node`` stored as ``dtype`` (per-channel along ``axis``);
    ``reduced``: 7-bit int8 (see REDUCED_QMAX)."""

    node: str
    input_index: int
    dtype: str
    axis: int | None
    reduced: bool = False


@dataclass(frozen=True)
class BiasQ:
    """int32 bias at ``node``'s input ``input_index`` (a Gemm's C or a bias Add's constant), with
    scale = scale of ``activation`` x per-channel scales of weight input ``weight_index`` of
    ``weight_node``."""

    node: str
    input_index: int
    activation: str
    activation_dtype: str
    weight_node: str
    weight_index: int


@dataclass
class QDQPlan:
    activations: list[ActivationQ] = field(default_factory=list)
    weights: list[WeightQ] = field(default_factory=list)
    biases: list[BiasQ] = field(default_factory=list)
    # node name -> rule description, for logs and tests
    node_rules: dict[str, str] = field(default_factory=dict)
    # node name -> why a node its rule would quantize was left float
    skipped: dict[str, str] = field(default_factory=dict)
    # tensor -> tensor whose scale it must share (outputs of quantized data-movement ops)
    aliases: dict[str, str] = field(default_factory=dict)
    # Loop/Scan node -> the plan of its body, which sees the body as a graph of its own (pipeline.bodies)
    bodies: dict[str, QDQPlan] = field(default_factory=dict)

    def walk(self) -> Iterator[QDQPlan]:
        """This plan and the plans of its bodies, nested ones included."""
        yield self
        for p in self.bodies.values():
            yield from p.walk()

    def quantized_nodes(self) -> dict[str, str]:
        """node_rules of this plan and of every body plan."""
        return {k: v for p in self.walk() for k, v in p.node_rules.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"activations": [[a.tensor, a.dtype, None if a.consumers is None else [list(c) for c in a.consumers]]
                                for a in self.activations],
                "weights": [[w.node, w.input_index, w.dtype, w.axis, w.reduced] for w in self.weights],
                "biases": [[b.node, b.input_index, b.activation, b.activation_dtype, b.weight_node, b.weight_index]
                           for b in self.biases],
                "node_rules": dict(self.node_rules), "aliases": dict(self.aliases),
                "bodies": {k: p.to_dict() for k, p in self.bodies.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> QDQPlan:
        return cls([ActivationQ(t, dt, None if c is None else tuple((n, int(i)) for n, i in c))
                    for t, dt, c in d.get("activations", [])],
                   [WeightQ(n, int(i), dt, axis, bool(r)) for n, i, dt, axis, r in d.get("weights", [])],
                   [BiasQ(*b) for b in d.get("biases", [])], dict(d.get("node_rules", {})), {},
                   dict(d.get("aliases", {})), {k: cls.from_dict(v) for k, v in d.get("bodies", {}).items()})



class MissingCalibration(StageError):
    """A tensor to quantize has no statistics and the Calibration has no fallback scale."""

    def __init__(self, tensor: str):
        super().__init__(f"no calibration statistics for tensor '{tensor}'; re-run the quantize stage "
                         f"(stages=[quantize,...]) so calibration.json covers it")
        self.tensor = tensor


class Calibration:
    """Per-tensor statistics from calibration.json (or a default scale where there are none), and how
    weight scales are searched (``weight_clip``: "max" or "mse").

    Without an explicit ``weight_clip`` it follows the statistics' algorithm (see ``weight_clip_for``),
    so statistics straight from calibration get the weights that calibration.json records.
    ``bodies`` are the plans of Loop/Scan bodies the quantize stage chose; apply_plan places them with
    a plan that has none of its own (autotune's, which tunes the main graph).
    """

    def __init__(self, tensors: dict[str, dict[str, Any]] | None = None, default_scale: float | None = None,
                 default_zero_point: float = 0.0, weight_clip: str | None = None,
                 bias_corrections: dict[str, list[float]] | None = None, bodies: dict[str, QDQPlan] | None = None):
        self.tensors = tensors or {}
        self.bodies = dict(bodies or {})
        # bias initializer -> mean output shift per channel that quantizing its node adds (measured by
        # the quantize stage's bias correction); apply_plan subtracts it where the plan quantizes the node
        self.bias_corrections = dict(bias_corrections or {})
        self.default_scale = default_scale
        self.default_zero_point = default_zero_point
        self.defaulted: set[str] = set()
        if weight_clip is None:
            algorithms = {s.get("algorithm") for s in self.tensors.values() if isinstance(s, dict)}
            weight_clip = "mse" if any(self.weight_clip_for(a) == "mse" for a in algorithms) else "max"
        if weight_clip not in WEIGHT_SEARCHES:
            raise ValueError(f"weight_clip={weight_clip!r}: expected one of {', '.join(WEIGHT_SEARCHES)}")
        self.weight_clip = weight_clip
        # (weight name, digest, axis, dtype, reduced) -> scales: the mse search is far costlier than the
        # hash, and autotune applies a plan to the same weights for every candidate
        self._weights: dict[tuple, QuantParams] = {}

    @staticmethod
    def weight_clip_for(algorithm: str | None) -> str:
        """The weight scale search that goes with an activation calibration algorithm."""
        return "mse" if algorithm in ("mse", "auto") else "max"

    def weight_params(self, name: str, values: np.ndarray, axis: int | None, dtype: str,
                      reduced: bool = False) -> QuantParams:
        """``weight_params`` with this calibration's weight search (memoized for the mse search)."""
        if self.weight_clip == "max":
            return weight_params(values, axis, dtype, reduced)
        import hashlib

        digest = hashlib.blake2b(np.ascontiguousarray(values, np.float32).data, digest_size=16).hexdigest()
        key = (name, digest, values.shape, axis, dtype, bool(reduced))
        if key not in self._weights:
            self._weights[key] = weight_params(values, axis, dtype, reduced, self.weight_clip)
        return self._weights[key]

    def with_aliases(self, aliases: dict[str, str]) -> Calibration:
        """A copy where each ``tensor`` takes the statistics of its ``source``."""
        c = Calibration(dict(self.tensors), self.default_scale, self.default_zero_point, self.weight_clip,
                        self.bias_corrections, self.bodies)
        c.defaulted = self.defaulted
        c._weights = self._weights
        for t, src in aliases.items():
            c.alias(t, src)
        return c

    def alias(self, tensor: str, source: str) -> None:
        """Give ``tensor`` the statistics of ``source`` (data-movement ops must keep their input's scale)."""
        if source in self.tensors:
            self.tensors[tensor] = self.tensors[source]

    def params(self, tensor: str, dtype: str) -> QuantParams:
        stats = self.tensors.get(tensor)
        if stats is None:
            if self.default_scale is None:
                raise MissingCalibration(tensor)
            self.defaulted.add(tensor)
            zp = self.default_zero_point if dtype in ("int8", "uint8") else 0.0
            return QuantParams.scalar(dtype, self.default_scale, zp)
        return activation_params(stats, dtype)


def load_calibration(path: str | Path, default_scale: float | None = None,
                     default_zero_point: float = 0.0) -> Calibration:
    """The Calibration of a quantize/calibration.json (StateError if the file is not one); its
    ``weight_clip`` (absent before mse weights existed: "max") decides how weight scales are searched."""
    from pipeline.artifacts import read_json

    doc = read_json(path, "calibration file")
    if not isinstance(doc, dict) or not isinstance(doc.get("tensors"), dict):
        raise StateError(f"calibration file {path} has no 'tensors' table; re-run the quantize stage")
    clip = doc.get("weight_clip", "max")
    if clip not in WEIGHT_SEARCHES:
        raise StateError(f"calibration file {path}: weight_clip={clip!r}, expected one of "
                         f"{', '.join(WEIGHT_SEARCHES)}; re-run the quantize stage")
    corrections = doc.get("bias_corrections") or {}
    if not isinstance(corrections, dict):
        raise StateError(f"calibration file {path}: bias_corrections is not a table; re-run the quantize stage")
    try:
        bodies = {k: QDQPlan.from_dict(v) for k, v in (doc.get("bodies") or {}).items()}
    except (AttributeError, TypeError, ValueError) as exc:
        raise StateError(f"calibration file {path}: bodies is not a table of plans ({exc}); re-run the quantize "
                         f"stage") from None
    return Calibration(doc["tensors"], default_scale, default_zero_point, clip, corrections, bodies)


def quantize_decisions(path: str | Path | None) -> dict[str, Any]:
    """The quantize stage's decisions in calibration.json (weight storage, nodes left float, CPU and
    accuracy facts); defaults for a file written before they existed or when there is none."""
    from pipeline.artifacts import read_json

    doc = read_json(path, "calibration file") if path is not None else {}
    d = doc.get("decisions") if isinstance(doc, dict) else None
    d = dict(d) if isinstance(d, dict) else {}
    d.setdefault("weight_range", "full")
    d.setdefault("float_nodes", [])
    d.setdefault("all_float", False)  # recovery left every quantizable node float
    return d


def _scalar_or_vector(name: str, values: np.ndarray, elem_type: int) -> onnx.TensorProto:
    arr = np.asarray(values, dtype=helper.tensor_dtype_to_np_dtype(elem_type))
    return numpy_helper.from_array(arr, name)


def _zero_point(name: str, zp: np.ndarray, dtype: str) -> onnx.TensorProto:
    tp, np_t, _, _ = QTYPES[dtype]
    zp = np.asarray(zp)
    if np_t is None:
        return helper.make_tensor(name, tp, list(zp.shape), _fp8_bytes(np.zeros(zp.shape), dtype), raw=True)
    return numpy_helper.from_array(zp.astype(np_t), name)


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
        onnx.checker.check_model(converted)
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


def _correct_biases(model: onnx.ModelProto, quantized: set[str], corrections: dict[str, list[float]]) -> None:
    """Subtract the measured mean shift from the biases of the quantized weighted nodes (in place)."""
    from pipeline.graph_index import GraphIndex, bias_tensor

    g = GraphIndex(model)
    targets = {b[0] for n in sorted(quantized) if n in g.nodes and (b := bias_tensor(g, g.nodes[n])) is not None}
    for i, init in enumerate(model.graph.initializer):
        if init.name in targets and init.name in corrections:
            b = numpy_helper.to_array(init)
            delta = np.asarray(corrections[init.name], np.float64)
            if delta.size != b.size:
                raise StateError(f"bias correction of '{init.name}' has {delta.size} values, the bias {b.size}; "
                                 f"re-run the quantize stage")
            model.graph.initializer[i].CopyFrom(
                numpy_helper.from_array((b - delta.reshape(b.shape)).astype(b.dtype), init.name))


def apply_plan(model: onnx.ModelProto, plan: QDQPlan, calibration: Calibration,
               default_float_type: int = TensorProto.FLOAT, check: bool = True) -> onnx.ModelProto:
    """A copy of ``model`` with the plan's Q/DQ nodes inserted (see module docstring), in Loop/Scan
    bodies by ``plan.bodies``, or by ``calibration.bodies`` when the plan places the main graph only."""
    from pipeline.bodies import all_names

    bodies = plan.bodies or calibration.bodies
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out = raise_opset(out, max([required_opset(plan), *(required_opset(p) for p in bodies.values())]))
    if calibration.bias_corrections:
        _correct_biases(out, {w.node for w in plan.weights}, calibration.bias_corrections)
    _insert(out, plan, bodies, calibration, default_float_type, all_names(out.graph))
    if check:  # the autotuner skips it per candidate: a broken candidate fails its measurement anyway
        onnx.checker.check_model(out)
    return out


def _insert(model: onnx.ModelProto, plan: QDQPlan, bodies: dict[str, QDQPlan], calibration: Calibration,
            default_float_type: int, taken: set[str]) -> None:
    """Insert ``plan`` into ``model``'s graph and ``bodies`` into its Loop/Scan bodies (in place); new
    names avoid ``taken`` (every name of the whole model) and are added to it."""
    from pipeline.bodies import body_views, fresh_name, put_back

    if plan.aliases:
        calibration = calibration.with_aliases(plan.aliases)
    graph = model.graph
    nodes = {n.name: n for n in graph.node}
    types = tensor_elem_types(model)
    inits = {i.name: i for i in graph.initializer}
    consumers: dict[str, list[Consumer]] = defaultdict(list)
    for n in graph.node:
        for idx, name in enumerate(n.input):
            if name:
                consumers[name].append((n.name, idx))
    graph_outputs = {o.name for o in graph.output}
    new_nodes: list[onnx.NodeProto] = []
    new_inits: list[onnx.TensorProto] = []

    def unique(name: str) -> str:
        return fresh_name(taken, name)

    def float_type(tensor: str) -> int:
        t = types.get(tensor, default_float_type)
        return t if t in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16) else default_float_type

    # -- activations: one Q/DQ pair per (tensor, dtype), shared by the consumers that asked for it
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
        targets = consumers.get(tensor, []) if who is None else sorted(who)
        targets = [c for c in targets if c not in rewired]
        if not targets and tensor not in graph_outputs:
            continue
        p = calibration.params(tensor, dtype)
        ft = float_type(tensor)
        suffix = "" if dtypes_per_tensor[tensor] == 1 else f"_{dtype}"
        base = f"{tensor}{suffix}"
        s_name, z_name = unique(f"{base}_scale"), unique(f"{base}_zero_point")
        q_out, dq_out = unique(f"{base}_quantized"), unique(f"{base}_dequantized")
        new_inits += [_scalar_or_vector(s_name, p.scale, ft), _zero_point(z_name, p.zero_point, dtype)]
        q_in = tensor
        if tensor in graph_outputs and who is None:
            # a quantized graph output keeps its name on the DQ side, so the producer + Q can fuse
            q_in = unique(f"{tensor}{PREQUANT_SUFFIX}")
            for n in graph.node:
                for k, o in enumerate(n.output):
                    if o == tensor:
                        n.output[k] = q_in
            dq_out = tensor
        new_nodes += [
            helper.make_node("QuantizeLinear", [q_in, s_name, z_name], [q_out], name=unique(f"{base}_QuantizeLinear")),
            helper.make_node("DequantizeLinear", [q_out, s_name, z_name], [dq_out], name=unique(f"{base}_DequantizeLinear")),
        ]
        for node_name, idx in targets:
            nodes[node_name].input[idx] = dq_out
            rewired[(node_name, idx)] = dq_out

    # -- weights: stored quantized, followed by a DequantizeLinear
    weight_scales: dict[tuple[str, int], QuantParams] = {}
    for w in plan.weights:
        node = nodes[w.node]
        name = node.input[w.input_index]
        init = inits.get(name)
        if init is None:
            raise ValueError(f"weight input {w.input_index} of node {w.node} ({name}) is not an initializer")
        values = numpy_helper.to_array(init).astype(np.float32)
        p = calibration.weight_params(name, values, w.axis, w.dtype, w.reduced)
        weight_scales[(w.node, w.input_index)] = p
        ft = init.data_type if init.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16) \
            else default_float_type
        base = unique(f"{name}_{w.node}" if len(consumers.get(name, [])) > 1 else name)
        q_name, s_name, z_name, dq_out = (unique(f"{base}_quantized"), unique(f"{base}_scale"),
                                          unique(f"{base}_zero_point"), unique(f"{base}_dequantized"))
        new_inits += [make_quantized_tensor(q_name, quantize_values(values, p), w.dtype),
                      _scalar_or_vector(s_name, p.scale, ft), _zero_point(z_name, p.zero_point, w.dtype)]
        attrs = {"axis": w.axis} if w.axis is not None else {}
        new_nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                                          name=unique(f"{base}_DequantizeLinear"), **attrs))
        node.input[w.input_index] = dq_out

    # -- int32 biases (scale = activation scale x per-channel weight scale, zero point 0)
    for b in plan.biases:
        node = nodes[b.node]
        name = node.input[b.input_index]
        init = inits.get(name)
        wp = weight_scales.get((b.weight_node, b.weight_index))
        if init is None or wp is None or wp.dtype not in ("int8", "uint8"):
            continue
        shape = tuple(init.dims)
        # per-axis DQ needs one scale per element along one axis: a bias [N] runs along axis 0, a
        # tf2onnx-style [1, N] along its last axis; any other layout stays a float bias
        if not shape or any(d != 1 for d in shape[:-1]):
            continue
        ap = calibration.params(b.activation, b.activation_dtype)
        scale = (np.float32(ap.scale) * np.asarray(wp.scale, np.float32)).astype(np.float32).reshape(-1)
        values = numpy_helper.to_array(init).astype(np.float64).reshape(-1)
        if scale.size not in (1, values.size):
            continue
        q = np.clip(np.rint(values / scale), -(2**31), 2**31 - 1).astype(np.int32)
        base = unique(f"{name}_{b.node}")
        q_name, s_name, z_name, dq_out = (unique(f"{base}_quantized"), unique(f"{base}_scale"),
                                          unique(f"{base}_zero_point"), unique(f"{base}_dequantized"))
        scale = np.broadcast_to(scale, values.shape).astype(np.float32)
        new_inits += [numpy_helper.from_array(q.reshape(shape), q_name),
                      _scalar_or_vector(s_name, scale, init.data_type),
                      numpy_helper.from_array(np.zeros(scale.shape, np.int32), z_name)]
        new_nodes.append(helper.make_node("DequantizeLinear", [q_name, s_name, z_name], [dq_out],
                                          name=unique(f"{base}_DequantizeLinear"), axis=len(shape) - 1))
        node.input[b.input_index] = dq_out

    graph.initializer.extend(new_inits)
    graph.node.extend(new_nodes)
    for view in body_views(model):
        inner = bodies.get(view.node.name)
        if inner is not None:
            _insert(view.model, inner, inner.bodies, calibration, default_float_type, taken)
            put_back(view, view.model)
    # drop float weights no node reads any more (in this graph or, by outer-scope reference, in a body)
    used = graph_reads(graph)
    keep = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    topological_sort(model)


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
