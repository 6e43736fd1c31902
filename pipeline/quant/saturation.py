"""What the u8 x s8 kernels of x86 CPUs without VNNI compute: a Q/DQ model's saturating twin.

Without VNNI, ONNX Runtime's MLAS and OpenVINO's oneDNN multiply uint8 activations by int8 weights with
VPMADDUBSW, which adds the products of neighbouring elements along the reduction axis in int16 with
saturation, then widens the pair sums to int32 (VPMADDWD by ones) and corrects the zero points exactly.
Pairs are (2p, 2p+1) along K of a MatMul or Gemm. A Conv's pairs depend on the library
(``PAIRINGS``): MLAS (ONNX Runtime) takes the reduction in the channels-last im2col order (kernel
position, then channel), so pairs are neighbouring channels at one kernel position where the channel
count is even and cross kernel positions where it is odd (a one-channel first layer); oneDNN (OpenVINO)
pads the channels to an even count, so pairs never cross a position. Both were read off the real
kernels under `qemu-x86_64 -cpu Haswell` (tests/unit/test_saturation.py checks ONNX Runtime's). So a layer's output differs from its
Q/DQ math by ``sa * sw * sum_p (clip16(s_p) - s_p)``, with ``s_p`` the pair sums of the raw uint8 and
int8 values.

``saturating_twin`` adds exactly that correction after every such layer of a Q/DQ model, as ONNX ops
in float32 (products of at most 255 x 128 and their pair sums are exact there), so running the twin as
plain Q/DQ math (ONNX Runtime with no graph optimizations) computes what a CPU without VNNI computes,
with errors that flow into later layers as they do on that CPU. Layers whose weights are 7-bit (reduced
range) or uint8 cannot saturate and get no correction; grouped convolutions run on kernels that widen
to int16 first and are left as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.graph import weights
from pipeline.graph.model import opset_version
from pipeline.graph.shapes import infer_shapes

INT16_MIN, INT16_MAX = -32768.0, 32767.0
# the most one pair sum's saturation error can be: 255 x 256 (two weights of -128) less int16's 32768
PAIR_ERROR_MAX = 255 * 256 - 32768
# how a runtime's kernels pair a convolution's reduction: across kernel positions where channels are odd
# (im2col), or within each position over channels padded to an even count (channels)
PAIRINGS = ("im2col", "channels")
# the most a pair of products can reach with |weight| <= this: 2 x 255 x 63 = 32130 fits in int16
EXACT_WEIGHT_MAX = 63


@dataclass(frozen=True)
class TwinReport:
    """What ``saturating_twin`` did: the layers that got a correction, the layers left as they are
    because they cannot saturate (``exact``, with why), and the layers that could but are not modelled
    (``skipped``, with why: the twin then computes less than the kernels do there)."""

    corrected: tuple[str, ...]
    exact: tuple[tuple[str, str], ...]
    skipped: tuple[tuple[str, str], ...] = ()

    @property
    def can_saturate(self) -> bool:
        return bool(self.corrected)


def saturating_twin(model: onnx.ModelProto, pairing: str = "im2col") -> tuple[onnx.ModelProto, TwinReport]:
    """A copy of ``model`` (a Q/DQ model) whose u8 x s8 MatMul, Gemm and Conv layers compute what the
    saturating kernels of a CPU without VNNI compute, pairing a Conv's reduction as ``pairing`` says (see
    the module docstring), and what was done. Only the main graph is changed (Loop and Scan bodies keep
    their Q/DQ math)."""
    if pairing not in PAIRINGS:
        raise ValueError(f"pairing={pairing!r}: expected one of {', '.join(PAIRINGS)}")
    twin = onnx.ModelProto()
    twin.CopyFrom(model)
    probe = onnx.ModelProto()
    probe.CopyFrom(model)  # shape inference writes into large models (weights on disk stay references)
    ranks = _ranks(infer_shapes(probe))
    inits = {t.name: t for t in twin.graph.initializer}
    producer = {o: n for n in twin.graph.node for o in n.output}
    opset = opset_version(twin)
    corrected: list[str] = []
    exact: list[tuple[str, str]] = []
    skipped: list[tuple[str, str]] = []
    new_nodes: list[onnx.NodeProto] = []
    for node in list(twin.graph.node):
        new_nodes.append(node)
        if node.op_type not in ("MatMul", "Gemm", "Conv"):
            continue
        layer = _layer(node, producer, inits)
        if layer is None:
            continue
        name = node.name or node.output[0]
        if isinstance(layer, str):
            skipped.append((name, layer))
            continue
        why = _why_exact(node, layer, pairing)
        if why:
            exact.append((name, why))
            continue
        unmodelled = _why_skipped(node, layer, ranks, opset)
        if unmodelled:
            skipped.append((name, unmodelled))
            continue
        new_nodes.extend(_correction(node, layer, ranks[layer.act_q], twin.graph, len(corrected), opset, pairing))
        corrected.append(name)
    del twin.graph.node[:]
    twin.graph.node.extend(new_nodes)
    return twin, TwinReport(tuple(corrected), tuple(exact), tuple(skipped))


@dataclass(frozen=True)
class _Layer:
    act_q: str  # the raw activation (DequantizeLinear's input)
    act_scale: float
    act_zero: int
    act_offset: int  # what the kernels add to a raw value to multiply it as uint8: 128 for int8, else 0
    weight: np.ndarray  # raw int8 values, as stored
    weight_scale: np.ndarray  # per output channel (or one)


def _layer(node: onnx.NodeProto, producer: dict[str, onnx.NodeProto], inits: dict[str, TensorProto]
           ) -> _Layer | str | None:
    """The quantized operands of a DQ(8-bit act) x DQ(int8 weight) layer; why it is not modelled (a str)
    where it is such a layer in a form the twin does not read; None for any other node. Int8 activations
    are multiplied as uint8 after adding 128 (MLAS and oneDNN both shift them so, then correct the sums)."""
    if len(node.input) < 2:
        return None
    act, wgt = producer.get(node.input[0]), producer.get(node.input[1])
    if act is None or wgt is None or act.op_type != "DequantizeLinear" or wgt.op_type != "DequantizeLinear":
        return None
    stored = inits.get(wgt.input[0])
    if stored is None or stored.data_type != TensorProto.INT8:
        return None  # uint8 or float weights: no u8 x s8 kernel
    values = [inits.get(n) if n else None for n in (*act.input[1:3], *wgt.input[1:3])]
    if len(act.input) < 3 or len(wgt.input) < 3 or any(v is None for v in values):
        return "a DequantizeLinear without a constant scale and zero point"
    a_scale, a_zero, w_scale, w_zero = (weights.array(v) for v in values)
    if a_zero.dtype not in (np.uint8, np.int8) or a_scale.size != 1 or a_zero.size != 1:
        return "per-channel or non-8-bit activations"
    if np.any(w_zero != 0):
        return "weights with a zero point"
    w_q = weights.array(stored)  # weights on disk are read there
    attrs = {a.name: helper.get_attribute_value(a) for a in wgt.attribute}
    if w_scale.size > 1 and (w_q.ndim != (2 if node.op_type != "Conv" else w_q.ndim) or "block_size" in attrs
                             or int(attrs.get("axis", 1)) != _output_axis(node, w_q)):
        return "weight scales along another axis than the output channels"
    return _Layer(act.input[0], float(a_scale.reshape(())), int(a_zero.reshape(())),
                  128 if a_zero.dtype == np.int8 else 0, w_q, np.asarray(w_scale, dtype=np.float32).reshape(-1))


def _output_axis(node: onnx.NodeProto, w: np.ndarray) -> int:
    """The axis of ``node``'s weight that holds its output channels."""
    if node.op_type == "Conv":
        return 0
    trans = node.op_type == "Gemm" and any(a.name == "transB" and a.i for a in node.attribute)
    return 0 if trans else w.ndim - 1


def _why_skipped(node: onnx.NodeProto, layer: _Layer, ranks: dict[str, int], opset: int) -> str:
    """Why a layer that can saturate is not modelled ("" where it is)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if opset < 11:
        return f"opset {opset}: the twin's Pad and Clip need opset 11"
    if layer.act_q not in ranks:
        return "the rank of its activation is unknown"
    if node.op_type != "Conv" and layer.weight.ndim != 2:
        return f"weights of rank {layer.weight.ndim}"
    if node.op_type == "Conv" and int(attrs.get("group", 1)) != 1:
        return "a grouped convolution"
    if node.op_type == "Conv" and attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
        return "auto_pad SAME"
    if node.op_type == "Gemm" and int(attrs.get("transA", 0)):
        return "a Gemm with transA"
    return ""


def _why_exact(node: onnx.NodeProto, layer: _Layer, pairing: str) -> str:
    """Why the layer's kernel cannot saturate ("" where it can)."""
    if int(np.abs(layer.weight.astype(np.int32)).max(initial=0)) <= EXACT_WEIGHT_MAX:
        return f"weights within +-{EXACT_WEIGHT_MAX}: pair sums fit in int16"
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    w = layer.weight.astype(np.float32)
    if node.op_type == "Conv":  # pairs along (position, channel), channels fastest
        w = _conv_weights(w, pairing)
        w = w.reshape(w.shape[0], w.shape[1], -1).transpose(2, 1, 0).reshape(-1, w.shape[0])
    elif w.ndim != 2:
        return ""  # weights of another rank: skipped, not judged exact
    elif node.op_type == "Gemm" and int(attrs.get("transB", 0)):
        w = w.T
    if len(w) % 2:
        w = np.concatenate([w, np.zeros((1, w.shape[1]), np.float32)])
    if not _saturable(w[0::2], w[1::2]).any():
        return "no pair of its weights can leave int16"
    return ""


def _ranks(model: onnx.ModelProto) -> dict[str, int]:
    """The rank of every tensor shape inference knows (dims may be symbolic: only the rank is read)."""
    out = {}
    for vi in (*model.graph.value_info, *model.graph.input, *model.graph.output):
        t = vi.type.tensor_type
        if t.HasField("shape"):
            out[vi.name] = len(t.shape.dim)
    return out


class _Builder:
    """Nodes and constants of one layer's correction, named apart from every other layer's."""

    def __init__(self, graph: onnx.GraphProto, index: int, opset: int):
        self.graph, self.prefix, self.nodes, self.opset = graph, f"qdq_tune_saturation_{index}", [], opset

    def const(self, name: str, value: np.ndarray) -> str:
        full = f"{self.prefix}/{name}"
        self.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(value), full))
        return full

    def reduce_sum(self, data: str, axis: int, name: str) -> str:
        """ReduceSum over one axis, dropped (its axes an input from opset 13, an attribute before)."""
        if self.opset >= 13:
            return self.op("ReduceSum", [data, self.const(f"{name}_axes", np.asarray([axis], np.int64))], name,
                           keepdims=0)
        return self.op("ReduceSum", [data], name, axes=[axis], keepdims=0)

    def op(self, op_type: str, inputs: list[str], name: str, **attrs) -> str:
        out = f"{self.prefix}/{name}"
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=out, **attrs))
        return out


def _conv_weights(w: np.ndarray, pairing: str) -> np.ndarray:
    """Conv weights [O, C, *k] as ``pairing`` pairs them: with a zero channel added to an odd count where
    the kernels pad channels to an even count."""
    if pairing == "channels" and w.shape[1] % 2:
        return np.concatenate([w, np.zeros((w.shape[0], 1, *w.shape[2:]), w.dtype)], axis=1)
    return w


def _correction(node: onnx.NodeProto, layer: _Layer, rank: int, graph: onnx.GraphProto, index: int, opset: int,
                pairing: str) -> list[onnx.NodeProto]:
    """Nodes that add the saturation error to ``node``'s output (renamed); ``rank``: its activation's."""
    b = _Builder(graph, index, opset)
    exact_out = f"{b.prefix}/qdq_output"  # the layer's own output, renamed: the corrected one takes its name
    raw = b.op("Cast", [layer.act_q], "act", to=TensorProto.FLOAT)
    if layer.act_offset:  # int8 activations, multiplied as uint8
        raw = b.op("Add", [raw, b.const("act_offset", np.asarray(float(layer.act_offset), np.float32))], "act_u8")
    scale = (layer.act_scale * layer.weight_scale).astype(np.float32)
    if node.op_type == "Conv":
        error = _conv_error(b, node, layer, raw, rank, pairing, exact_out)
        scale = scale.reshape(1, -1, *([1] * (rank - 2))) if scale.size > 1 else scale.reshape(())
    else:
        weight = layer.weight.astype(np.float32)
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Gemm" and int(attrs.get("transB", 0)):
            weight = weight.T
        error = _matmul_error(b, raw, weight, rank)
        scale = scale.reshape(()) if scale.size == 1 else scale
        if node.op_type == "Gemm":
            scale = scale * np.float32(attrs.get("alpha", 1.0))
    delta = b.op("Mul", [error, b.const("scale", np.asarray(scale, np.float32))], "delta")
    final = node.output[0]
    node.output[0] = exact_out
    b.nodes.append(helper.make_node("Add", [exact_out, delta], [final], name=f"{b.prefix}/saturated"))
    return b.nodes


def _pair_error(b: _Builder, sums: str) -> str:
    low = b.const("int16_min", np.asarray(INT16_MIN, np.float32))
    high = b.const("int16_max", np.asarray(INT16_MAX, np.float32))
    return b.op("Sub", [b.op("Clip", [sums, low, high], "clipped"), sums], "pair_error")


def _saturable(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Where a pair of weights can push a sum of uint8 x weight products out of int16 (both of one sign,
    255 x their sum past it)."""
    pos = np.maximum(first, 0) + np.maximum(second, 0)
    neg = np.minimum(first, 0) + np.minimum(second, 0)
    return (255 * pos > INT16_MAX) | (255 * neg < INT16_MIN)


# a selected pair sum costs about this many of the every-pair path's elements (two gathers, a product each,
# their sum, the clip and its scatter, against the batched product's elementwise passes over [M, P, N])
GATHER_COST = 8
# the 0/1 matrix that adds selected sums into their columns stays a MatMul up to this many elements; past
# it (opset 11 and later) the differences of their running sum do it (``_column_sums``)
SCATTER_MATMUL_MAX = 1 << 22


def _matmul_error(b: _Builder, raw: str, weight: np.ndarray, rank: int) -> str:
    """sum_p (clip16(s_p) - s_p) of act [..., M, K] (of ``rank``) x weight [K, N], pairs (2p, 2p+1) along K.
    Only the (pair, column) sums that can leave int16 are computed where they are few against every pair
    (``_selected_error``); else every pair at once as a [..., M, P, 1, 2] x [P, 2, N] batched product (two
    products per sum, exact in float32). Reshapes copy the leading dims (0), so symbolic dims are fine."""
    k, n = weight.shape
    if k % 2:
        weight = np.concatenate([weight, np.zeros((1, n), np.float32)])
    pairs = weight.shape[0] // 2
    rows, cols = np.nonzero(_saturable(weight[0::2], weight[1::2]))
    if len(rows) * GATHER_COST < pairs * n:  # few sums can saturate: those alone
        return _selected_error(b, raw, weight, rows, cols, k, n, rank)
    if k % 2:
        zeros = [0] * rank
        raw = b.op("Pad", [raw, b.const("pads", np.asarray(zeros[:-1] + [0] + zeros[:-1] + [1], np.int64))],
                   "act_even")
    lead = [0] * (rank - 1)
    act = b.op("Reshape", [raw, b.const("act_pairs_shape", np.asarray([*lead, pairs, 1, 2], np.int64))], "act_pairs")
    sums = b.op("MatMul", [act, b.const("weight_pairs", weight.reshape(pairs, 2, n))], "pair_sums")
    error = b.reduce_sum(_pair_error(b, sums), -3, "error")  # [..., M, 1, N]
    return b.op("Reshape", [error, b.const("out_shape", np.asarray([*lead, n], np.int64))], "error_out")


def _selected_error(b: _Builder, raw: str, weight: np.ndarray, rows: np.ndarray, cols: np.ndarray, k: int,
                    n: int, rank: int) -> str:
    """The pair-sum error of the selected (pair ``rows``, column ``cols``) sums only, in column order: both
    activations of each pair gathered from act [..., M, K] (of ``rank``) with K first ([S, ..., M] each:
    whole rows of M copied, where gathering along the last axis copies one element at a time), weighted,
    summed and clipped; then each column's errors added up (``_column_sums``). The padded element of an odd
    K has weight 0: any activation serves."""
    order = np.argsort(cols, kind="stable")
    rows, cols = rows[order], cols[order]
    first, second = 2 * rows, np.minimum(2 * rows + 1, k - 1)  # ``weight`` has the zero row of an odd K
    act = b.op("Transpose", [raw], "act_k_first", perm=[rank - 1, *range(rank - 1)])  # [K, ..., M]
    terms = []
    for name, idx, w in (("first", first, weight[2 * rows, cols]), ("second", second, weight[2 * rows + 1, cols])):
        picked = b.op("Gather", [act, b.const(f"pair_{name}", idx.astype(np.int64))], f"act_{name}", axis=0)
        w = w.astype(np.float32).reshape(-1, *([1] * (rank - 1)))
        terms.append(b.op("Mul", [picked, b.const(f"weight_{name}", w)], f"product_{name}"))
    return _column_sums(b, _pair_error(b, b.op("Add", terms, "pair_sums")), cols, n, rank)


def _column_sums(b: _Builder, error: str, cols: np.ndarray, n: int, rank: int) -> str:
    """[..., M, N]: the errors [S, ..., M] (sorted by their column ``cols``) added into their columns: a 0/1
    MatMul where small (or before opset 11), else the differences of their running sum at each column's
    last sum and the one before its first, in integers (exact: every error is a whole number, where
    float32 would round past 2^24): int32 where the S sums cannot reach 2^31, else int64."""
    last = [*range(1, rank), 0]
    if len(cols) * n <= SCATTER_MATMUL_MAX or b.opset < 11:
        scatter = np.zeros((len(cols), n), np.float32)
        scatter[np.arange(len(cols)), cols] = 1.0
        error = b.op("Transpose", [error], "pair_error_last", perm=last)  # [..., M, S]
        return b.op("MatMul", [error, b.const("pair_scatter", scatter)], "error_out")
    wide_type = TensorProto.INT32 if len(cols) * PAIR_ERROR_MAX < 2**31 else TensorProto.INT64
    wide = b.op("Cast", [error], "error_int", to=wide_type)
    running = b.op("CumSum", [wide, b.const("running_axis", np.asarray(0, np.int64))], "running_sum")
    counts = np.bincount(cols, minlength=n)
    ends = np.cumsum(counts)
    starts = ends - counts
    shape = (n, *([1] * (rank - 1)))

    def at(index: np.ndarray, name: str) -> str:  # running[index - 1] per column, 0 where index is 0
        picked = b.op("Gather", [running, b.const(f"{name}_index", np.maximum(index - 1, 0).astype(np.int64))],
                      f"at_{name}", axis=0)
        mask = b.const(f"{name}_nonzero", (index > 0).astype(np.int64 if wide_type == TensorProto.INT64
                                                            else np.int32).reshape(shape))
        return b.op("Mul", [picked, mask], f"sum_to_{name}")

    sums = b.op("Cast", [b.op("Sub", [at(ends, "ends"), at(starts, "starts")], "column_sums_int")], "column_sums",
                to=TensorProto.FLOAT)
    return b.op("Transpose", [sums], "error_out", perm=last)  # [N, ..., M] -> [..., M, N]


def _conv_error(b: _Builder, node: onnx.NodeProto, layer: _Layer, raw: str, rank: int, pairing: str,
                exact_out: str) -> str:
    """sum over pairs of (clip16(s) - s) for a group-1 Conv, on the activation padded with its zero point
    as the kernel pads it. The reduction runs over (kernel position, channel) with channels fastest (the
    channels-last im2col order), in pairs: a convolution whose kernels each hold one pair's two weights
    gives the pair sums that can leave int16, and a 1x1 convolution of 0/1 weights adds each one's error
    to its output channel."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    weight = _conv_weights(layer.weight.astype(np.float32), pairing)
    kernels, group, owner = _pair_kernels(weight)
    pads = list(attrs.get("pads", [0] * (2 * (rank - 2))))
    extra = weight.shape[1] - layer.weight.shape[1]  # a channel the kernels add (its weights are zero)
    if any(pads) or extra:
        begin, end = [0, 0, *pads[:rank - 2]], [0, extra, *pads[rank - 2:]]
        raw = b.op("Pad", [raw, b.const("pads", np.asarray(begin + end, np.int64)),
                           b.const("pad_value", np.asarray(float(layer.act_zero + layer.act_offset), np.float32))],
                   "act_padded")
    conv_attrs = {k: v for k, v in attrs.items() if k in ("strides", "dilations")}
    sums = b.op("Conv", [raw, b.const("pair_kernels", kernels)], "pair_sums", group=group, **conv_attrs)
    return _channel_sums(b, _pair_error(b, sums), owner, layer.weight.shape[0], exact_out, rank)


def _channel_sums(b: _Builder, error: str, owner: np.ndarray, n_out: int, like: str, rank: int) -> str:
    """[N, O, ...] (shaped as ``like``, the layer's output): the pair errors [N, S, ...] added into their
    output channels ``owner`` (-1: none, an error of 0). Each channel's errors are gathered into a row of
    as many as the busiest channel has (filled with a zero error) and summed: exact in float32, as each
    error is a whole number and a row's sum stays below 2^24 (a 0/1 convolution does it past that: it
    costs channels x errors per position, and its constant grew to 245 MB on a ResNet-50 layer)."""
    live = np.flatnonzero(owner >= 0)
    counts = np.bincount(owner[live], minlength=n_out)
    width = max(1, int(counts.max(initial=0)))
    if width * PAIR_ERROR_MAX >= 2**24:
        scatter = np.zeros((n_out, len(owner), *([1] * (rank - 2))), np.float32)
        scatter[owner[live], live] = 1.0
        return b.op("Conv", [error, b.const("pair_scatter", scatter)], "error")
    dead = np.flatnonzero(owner < 0)
    if dead.size:  # an unused kernel's error is 0
        zero = int(dead[0])
    else:
        zero = len(owner)
        pads = np.zeros(2 * rank, np.int64)
        pads[rank + 1] = 1  # one channel more at the end
        error = b.op("Pad", [error, b.const("zero_pad", pads)], "error_with_zero")
    order = live[np.argsort(owner[live], kind="stable")]
    slot = np.arange(len(order)) - np.repeat(np.cumsum(counts) - counts, counts)
    index = np.full((n_out, width), zero, np.int64)
    index[owner[order], slot] = order
    rows = b.op("Gather", [error, b.const("by_channel", index.reshape(-1))], "error_by_channel", axis=1)
    rows = b.op("Reshape", [rows, b.const("rows_shape", np.asarray([0, n_out, width, -1], np.int64))], "error_rows")
    summed = b.reduce_sum(rows, 2, "error_flat")  # [N, O, positions]
    return b.op("Reshape", [summed, b.op("Shape", [like], "out_shape")], "error")


def _pair_kernels(w: np.ndarray) -> tuple[np.ndarray, int, np.ndarray]:
    """(kernels, group, the output channel of each kernel or -1) of the pair sums of weights ``w`` [O, C,
    *k] that can leave int16. With C even every pair is two neighbouring channels at one kernel position:
    the convolution is grouped by channel pair, each group holding the same number of kernels (unused
    ones zero); with C odd, pairs cross kernel positions and each kernel spans every channel."""
    o, c, spatial = w.shape[0], w.shape[1], w.shape[2:]
    positions = int(np.prod(spatial))
    flat = w.reshape(o, c, positions).transpose(0, 2, 1).reshape(o, positions * c)  # channels fastest
    if flat.shape[1] % 2:
        flat = np.concatenate([flat, np.zeros((o, 1), np.float32)], axis=1)
    outs, pairs = np.nonzero(_saturable(flat[:, 0::2], flat[:, 1::2]))  # (output channel, pair q)
    if c % 2 == 0:
        per_pair = c // 2  # pair q = position q // (C/2), channels 2 * (q % (C/2)) + (0, 1)
        groups = [np.nonzero(pairs % per_pair == j)[0] for j in range(per_pair)]
        width = max(1, max(len(g) for g in groups))
        kernels = np.zeros((per_pair, width, 2, positions), np.float32)
        owner = np.full((per_pair, width), -1, np.int64)
        for j, entries in enumerate(groups):
            for slot, e in enumerate(entries):
                q, out = pairs[e], outs[e]
                kernels[j, slot, :, q // per_pair] = flat[out, 2 * q:2 * q + 2]
                owner[j, slot] = out
        return kernels.reshape(per_pair * width, 2, *spatial), per_pair, owner.reshape(-1)
    kernels = np.zeros((max(1, len(pairs)), c, positions), np.float32)
    owner = np.full(max(1, len(pairs)), -1, np.int64)
    for slot, (q, out) in enumerate(zip(pairs, outs, strict=True)):
        for k in (2 * q, 2 * q + 1):
            if k < positions * c:
                p, ch = divmod(k, c)
                kernels[slot, ch, p] = flat[out, k]
        owner[slot] = out
    return kernels.reshape(len(owner), c, *spatial), 1, owner


__all__ = ["TwinReport", "saturating_twin"]
