"""Tiny ONNX graphs built in code for tests: one builder per topology, seeded, written to a folder.

conv_chain: Conv-Relu-Conv-Relu-GlobalAveragePool-Flatten-Gemm
residual_block: stem Conv, two residual blocks (Conv-Relu-Conv + Add + Relu), head
attention_block: MatMul projections, Softmax attention, LayerNormalization-free FFN with Gelu-like Erf
scan_rnn, loop_rnn: recurrent cells inside a Scan / Loop body, as keras2onnx and scripted torch export them
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17


def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float = 0.2) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def _head(rng: np.random.Generator, features: str, channels: int, classes: int
          ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """GlobalAveragePool -> Flatten -> Gemm from ``features`` to the "logits" output."""
    inits = [_init(rng, "fc_w", (classes, channels)), _init(rng, "fc_b", (classes,), 0.05)]
    nodes = [helper.make_node("GlobalAveragePool", [features], ["gap"], name="gap"),
             helper.make_node("Flatten", ["gap"], ["flat"], name="flatten"),
             helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["logits"], name="fc", transB=1)]
    return nodes, inits


def _model(nodes, inputs, outputs, inits, name: str) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, name, inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="qdq-tune-tests")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return onnx.shape_inference.infer_shapes(model)


def conv_chain(batch: int = 2, channels: int = 8, size: int = 16, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, size, size])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])
    inits = [_init(rng, "w1", (channels, 3, 3, 3)), _init(rng, "b1", (channels,), 0.05),
             _init(rng, "w2", (channels, channels, 3, 3), 0.1), _init(rng, "b2", (channels,), 0.05)]
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
    ]
    head, head_inits = _head(rng, "r2", channels, classes)
    return _model(nodes + head, [x], [y], inits + head_inits, "conv_chain")


def residual_block(batch: int = 2, channels: int = 8, size: int = 16, blocks: int = 2, classes: int = 10,
                   seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, size, size])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])
    inits = [_init(rng, "stem_w", (channels, 3, 3, 3)), _init(rng, "stem_b", (channels,), 0.05)]
    nodes = [helper.make_node("Conv", ["input", "stem_w", "stem_b"], ["s"], name="stem", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["s"], ["h0"], name="stem_relu")]
    for b in range(blocks):
        p, h_in = f"block{b}", f"h{b}"
        inits += [_init(rng, f"{p}_w1", (channels, channels, 3, 3), 0.1), _init(rng, f"{p}_b1", (channels,), 0.05),
                  _init(rng, f"{p}_w2", (channels, channels, 3, 3), 0.1), _init(rng, f"{p}_b2", (channels,), 0.05)]
        nodes += [
            helper.make_node("Conv", [h_in, f"{p}_w1", f"{p}_b1"], [f"{p}_c1"], name=f"{p}/conv1", pads=[1, 1, 1, 1]),
            helper.make_node("Relu", [f"{p}_c1"], [f"{p}_r1"], name=f"{p}/relu1"),
            helper.make_node("Conv", [f"{p}_r1", f"{p}_w2", f"{p}_b2"], [f"{p}_c2"], name=f"{p}/conv2", pads=[1, 1, 1, 1]),
            helper.make_node("Add", [f"{p}_c2", h_in], [f"{p}_sum"], name=f"{p}/add"),
            helper.make_node("Relu", [f"{p}_sum"], [f"h{b + 1}"], name=f"{p}/relu2"),
        ]
    head, head_inits = _head(rng, f"h{blocks}", channels, classes)
    return _model(nodes + head, [x], [y], inits + head_inits, "residual_block")


def attention_block(batch: int = 2, seq: int = 16, hidden: int = 32, seed: int = 0) -> onnx.ModelProto:
    """Single-head self-attention + FFN (MatMul/Add/Softmax/Erf-GELU), input [batch, seq, hidden]."""
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, seq, hidden])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, seq, hidden])
    inits = [_init(rng, n, (hidden, hidden), 0.15) for n in ("wq", "wk", "wv", "wo")]
    inits += [_init(rng, "w_ff1", (hidden, 2 * hidden), 0.15), _init(rng, "b_ff1", (2 * hidden,), 0.02),
              _init(rng, "w_ff2", (2 * hidden, hidden), 0.15), _init(rng, "b_ff2", (hidden,), 0.02),
              numpy_helper.from_array(np.array(1.0 / np.sqrt(hidden), np.float32), "scale"),
              numpy_helper.from_array(np.array(1.0 / np.sqrt(2.0), np.float32), "inv_sqrt2"),
              numpy_helper.from_array(np.array(1.0, np.float32), "one"),
              numpy_helper.from_array(np.array(0.5, np.float32), "half")]
    nodes = [
        helper.make_node("MatMul", ["input", "wq"], ["q"], name="attn/q"),
        helper.make_node("MatMul", ["input", "wk"], ["k"], name="attn/k"),
        helper.make_node("MatMul", ["input", "wv"], ["v"], name="attn/v"),
        helper.make_node("Transpose", ["k"], ["kt"], name="attn/kt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["scores_raw"], name="attn/scores"),
        helper.make_node("Mul", ["scores_raw", "scale"], ["scores"], name="attn/scale"),
        helper.make_node("Softmax", ["scores"], ["probs"], name="attn/softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["ctx"], name="attn/ctx"),
        helper.make_node("MatMul", ["ctx", "wo"], ["attn_out"], name="attn/out"),
        helper.make_node("Add", ["attn_out", "input"], ["res1"], name="attn/residual"),
        helper.make_node("MatMul", ["res1", "w_ff1"], ["ff1_mm"], name="ffn/fc1"),
        helper.make_node("Add", ["ff1_mm", "b_ff1"], ["ff1"], name="ffn/fc1_bias"),
        helper.make_node("Mul", ["ff1", "inv_sqrt2"], ["g0"], name="ffn/gelu_div"),
        helper.make_node("Erf", ["g0"], ["g1"], name="ffn/gelu_erf"),
        helper.make_node("Add", ["g1", "one"], ["g2"], name="ffn/gelu_add"),
        helper.make_node("Mul", ["ff1", "g2"], ["g3"], name="ffn/gelu_mul"),
        helper.make_node("Mul", ["g3", "half"], ["gelu"], name="ffn/gelu_half"),
        helper.make_node("MatMul", ["gelu", "w_ff2"], ["ff2_mm"], name="ffn/fc2"),
        helper.make_node("Add", ["ff2_mm", "b_ff2"], ["ff2"], name="ffn/fc2_bias"),
        helper.make_node("Add", ["ff2", "res1"], ["output"], name="ffn/residual"),
    ]
    return _model(nodes, [x], [y], inits, "attention_block")


def single_matmul(batch: int = 8, features: int = 16, hidden: int = 64, seed: int = 0) -> onnx.ModelProto:
    """MatMul -> Relu, one weighted op: input [batch, features], output "features" [batch, hidden]."""
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, features])
    y = helper.make_tensor_value_info("features", TensorProto.FLOAT, [batch, hidden])
    nodes = [helper.make_node("MatMul", ["input", "w"], ["mm"], name="fc"),
             helper.make_node("Relu", ["mm"], ["features"], name="relu")]
    return _model(nodes, [x], [y], [_init(rng, "w", (features, hidden))], "single_matmul")


def save(model: onnx.ModelProto, folder: Path, name: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def with_dynamic_batch(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for vi in [*m.graph.input, *m.graph.output]:
        d = vi.type.tensor_type.shape.dim[0]
        d.Clear()
        d.dim_param = "batch"
    del m.graph.value_info[:]
    return m


def outlier_branch(batch: int = 1, size: int = 16, classes: int = 10, seed: int = 0) -> onnx.ModelProto:
    """conv_a -> relu -> conv_b -> relu -> pool -> fc, where conv_a's channel 0 is 1000x larger and
    conv_b reads it 1000x smaller: the same float function, but one activation tensor whose range is
    all outlier. Quantized per tensor, its other channels round to zero: one extremely sensitive spot."""
    rng = np.random.default_rng(seed)
    c = 8
    wa = (rng.standard_normal((c, 3, 3, 3)) * 0.3).astype(np.float32)
    wb = (rng.standard_normal((c, c, 3, 3)) * 0.2).astype(np.float32)
    wa[0] *= 1000.0
    wb[:, 0] /= 1000.0
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, size, size])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])
    inits = [numpy_helper.from_array(wa, "wa"), _init(rng, "ba", (c,), 0.05),
             numpy_helper.from_array(wb, "wb"), _init(rng, "bb", (c,), 0.05),
             _init(rng, "wc", (c, c, 3, 3), 0.2), _init(rng, "bc", (c,), 0.05)]
    nodes = [
        helper.make_node("Conv", ["input", "wa", "ba"], ["a"], name="conv_a", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["a"], ["ra"], name="relu_a"),
        helper.make_node("Conv", ["ra", "wb", "bb"], ["b"], name="conv_b", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["b"], ["rb"], name="relu_b"),
        helper.make_node("Conv", ["rb", "wc", "bc"], ["cc"], name="conv_c", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["cc"], ["rc"], name="relu_c"),
    ]
    head, head_inits = _head(rng, "rc", c, classes)
    return _model(nodes + head, [x], [y], inits + head_inits, "outlier_branch")


def stateful_rnn(batch: int = 2, steps: int = 5, features: int = 16, hidden: int = 32, layers: int = 1,
                 seed: int = 0) -> onnx.ModelProto:
    """An LSTM with state inputs h0/c0 of shape [layers, batch, hidden] (no leading batch axis) and a
    Gemm head on the last hidden state: the input layout of exported recurrent models."""
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [steps, batch, features])
    h0 = helper.make_tensor_value_info("h0", TensorProto.FLOAT, [layers, batch, hidden])
    c0 = helper.make_tensor_value_info("c0", TensorProto.FLOAT, [layers, batch, hidden])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 8])
    inits = [_init(rng, "W", (1, 4 * hidden, features), 0.2), _init(rng, "R", (1, 4 * hidden, hidden), 0.2),
             _init(rng, "B", (1, 8 * hidden), 0.05), _init(rng, "proj_w", (features, features), 0.3),
             _init(rng, "head_w", (hidden, 8), 0.3), _init(rng, "head_b", (8,), 0.05)]
    nodes = [
        helper.make_node("MatMul", ["x", "proj_w"], ["xp"], name="proj"),
        helper.make_node("LSTM", ["xp", "W", "R", "B", "", "h0", "c0"], ["Y", "Y_h", "Y_c"], name="lstm",
                         hidden_size=hidden),
        helper.make_node("ReduceMean", ["Y_h"], ["h_last"], name="layer_mean", axes=[0], keepdims=0),
        helper.make_node("MatMul", ["h_last", "head_w"], ["hw"], name="head"),
        helper.make_node("Add", ["hw", "head_b"], ["logits"], name="head_bias"),
    ]
    return _model(nodes, [x, h0, c0], [y], inits, "stateful_rnn")


def _cell(x_t: str, h_prev: str, w: str, r: str, b: str, h_new: str, p: str) -> list[onnx.NodeProto]:
    """h_new = tanh(x_t W + h_prev R + b), as exporters write a simple RNN cell."""
    return [helper.make_node("MatMul", [x_t, w], [f"{p}xw"], name=f"{p}MatMul"),
            helper.make_node("MatMul", [h_prev, r], [f"{p}hr"], name=f"{p}MatMul_1"),
            helper.make_node("Add", [f"{p}xw", f"{p}hr"], [f"{p}sum"], name=f"{p}Add"),
            helper.make_node("Add", [f"{p}sum", b], [f"{p}pre"], name=f"{p}BiasAdd"),
            helper.make_node("Tanh", [f"{p}pre"], [h_new], name=f"{p}Tanh")]


def _rnn_head(rng: np.random.Generator, h: str, hidden: int, classes: int
              ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    inits = [_init(rng, "head_w", (hidden, classes), 0.3), _init(rng, "head_b", (classes,), 0.05)]
    nodes = [helper.make_node("MatMul", [h, "head_w"], ["head_mm"], name="head/MatMul"),
             helper.make_node("Add", ["head_mm", "head_b"], ["logits"], name="head/BiasAdd")]
    return nodes, inits


def scan_rnn(batch: int = 2, steps: int = 6, features: int = 16, hidden: int = 32, classes: int = 8,
             inner_steps: int = 0, seed: int = 0) -> onnx.ModelProto:
    """A keras2onnx/tf2onnx-style SimpleRNN: input [batch, steps, features] transposed to time-major, a
    Scan whose body computes h = tanh(x_t W + h R + b) (W an outer-scope initializer, R and b the body's
    own) and emits every h as a scan output, and a MatMul + Add head on the last state. With
    ``inner_steps`` the body runs the h R + x_t W step that many times in a Loop of its own (a body
    nested in a body)."""
    rng = np.random.default_rng(seed)
    f32 = TensorProto.FLOAT
    h_in = helper.make_tensor_value_info("rnn/h_prev", f32, [batch, hidden])
    x_in = helper.make_tensor_value_info("rnn/x_t", f32, [batch, features])
    body_inits = [_init(rng, "rnn/R", (hidden, hidden), 0.15), _init(rng, "rnn/b", (hidden,), 0.05)]
    if inner_steps:
        inner = helper.make_graph(
            [*_cell("rnn/x_t", "rnn/inner/h", "W", "rnn/R", "rnn/b", "rnn/inner/h_next", "rnn/inner/"),
             helper.make_node("Identity", ["rnn/inner/cond"], ["rnn/inner/cond_out"], name="rnn/inner/Identity")],
            "refine", [helper.make_tensor_value_info("rnn/inner/i", TensorProto.INT64, []),
                       helper.make_tensor_value_info("rnn/inner/cond", TensorProto.BOOL, []),
                       helper.make_tensor_value_info("rnn/inner/h", f32, [batch, hidden])],
            [helper.make_tensor_value_info("rnn/inner/cond_out", TensorProto.BOOL, []),
             helper.make_tensor_value_info("rnn/inner/h_next", f32, [batch, hidden])])
        body_inits += [numpy_helper.from_array(np.array(inner_steps, np.int64), "rnn/inner_steps"),
                       numpy_helper.from_array(np.array(True), "rnn/true")]
        cell = [helper.make_node("Loop", ["rnn/inner_steps", "rnn/true", "rnn/h_prev"], ["rnn/h_new"],
                                 name="rnn/refine", body=inner)]
    else:
        cell = _cell("rnn/x_t", "rnn/h_prev", "W", "rnn/R", "rnn/b", "rnn/h_new", "rnn/")
    body = helper.make_graph(
        [*cell, helper.make_node("Identity", ["rnn/h_new"], ["rnn/y_t"], name="rnn/Identity")], "rnn_cell",
        [h_in, x_in], [helper.make_tensor_value_info("rnn/h_new", f32, [batch, hidden]),
                       helper.make_tensor_value_info("rnn/y_t", f32, [batch, hidden])], body_inits)
    x = helper.make_tensor_value_info("input", f32, [batch, steps, features])
    y = helper.make_tensor_value_info("logits", f32, [batch, classes])
    inits = [_init(rng, "W", (features, hidden), 0.3), numpy_helper.from_array(np.zeros((batch, hidden), np.float32),
                                                                               "h_init")]
    nodes = [helper.make_node("Transpose", ["input"], ["x_time_major"], name="to_time_major", perm=[1, 0, 2]),
             helper.make_node("Scan", ["h_init", "x_time_major"], ["h_last", "hs"], name="rnn/Scan",
                              num_scan_inputs=1, body=body)]
    head, head_inits = _rnn_head(rng, "h_last", hidden, classes)
    return _model(nodes + head, [x], [y], inits + head_inits, "scan_rnn")


def loop_rnn(batch: int = 2, steps: int = 6, features: int = 16, hidden: int = 32, classes: int = 8, seed: int = 0
             ) -> onnx.ModelProto:
    """What torch.jit.script + torch.onnx.export make of an input projection followed by ``for t in
    range(x.size(0))``: a Loop whose trip count comes from the input's shape and whose body gathers x[t]
    of the projection from the outer scope (not a Loop input: the projection must run first) and computes
    h = tanh(x_t W + h R + b) with W, R, b outer-scope initializers; the hidden state's shape is left
    unknown in the body, as torch writes it. Input [steps, batch, features]; MatMul + Add head."""
    rng = np.random.default_rng(seed)
    f32 = TensorProto.FLOAT
    body = helper.make_graph(
        [helper.make_node("Gather", ["x_proj", "loop/i"], ["loop/x_t"], name="loop/Gather", axis=0),
         *_cell("loop/x_t", "loop/h", "W", "R", "b", "loop/h_next", "loop/"),
         helper.make_node("Identity", ["loop/cond"], ["loop/cond_out"], name="loop/Identity")],
        "loop_body", [helper.make_tensor_value_info("loop/i", TensorProto.INT64, []),
                      helper.make_tensor_value_info("loop/cond", TensorProto.BOOL, []),
                      helper.make_tensor_value_info("loop/h", f32, None)],
        [helper.make_tensor_value_info("loop/cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("loop/h_next", f32, None)])
    x = helper.make_tensor_value_info("input", f32, [steps, batch, features])
    y = helper.make_tensor_value_info("logits", f32, [batch, classes])
    inits = [_init(rng, "proj_w", (features, features), 0.3), _init(rng, "proj_b", (features,), 0.05),
             _init(rng, "W", (features, hidden), 0.3), _init(rng, "R", (hidden, hidden), 0.15),
             _init(rng, "b", (hidden,), 0.05), numpy_helper.from_array(np.zeros((batch, hidden), np.float32), "h0"),
             numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(True), "true")]
    nodes = [helper.make_node("MatMul", ["input", "proj_w"], ["proj_mm"], name="proj/MatMul"),
             helper.make_node("Add", ["proj_mm", "proj_b"], ["x_proj"], name="proj/BiasAdd"),
             helper.make_node("Shape", ["input"], ["input_shape"], name="Shape"),
             helper.make_node("Gather", ["input_shape", "zero"], ["trip_count"], name="Gather", axis=0),
             helper.make_node("Loop", ["trip_count", "true", "h0"], ["h_last"], name="loop/Loop", body=body)]
    head, head_inits = _rnn_head(rng, "h_last", hidden, classes)
    return _model(nodes + head, [x], [y], inits + head_inits, "loop_rnn")


def if_on_data(batch: int = 2, features: int = 32, hidden: int = 32, seed: int = 0) -> onnx.ModelProto:
    """Every MatMul inside the branches of an If whose condition is computed from the data (mean of
    the input > 0): nothing a fixed input could specialize, and no Loop/Scan body to quantize."""
    rng = np.random.default_rng(seed)
    f32 = TensorProto.FLOAT
    out = helper.make_tensor_value_info("output", f32, [batch, hidden])
    branches = []
    for k in ("then", "else"):
        branches.append(helper.make_graph(
            [helper.make_node("MatMul", ["input", f"{k}/w"], [f"{k}/mm"], name=f"{k}/MatMul"),
             helper.make_node("Relu", [f"{k}/mm"], [f"{k}/out"], name=f"{k}/Relu")],
            k, [], [helper.make_tensor_value_info(f"{k}/out", f32, [batch, hidden])],
            [_init(rng, f"{k}/w", (features, hidden))]))
    nodes = [helper.make_node("ReduceMean", ["input"], ["mean"], name="mean", keepdims=0),
             helper.make_node("Greater", ["mean", "zero"], ["positive"], name="positive"),
             helper.make_node("If", ["positive"], ["output"], name="branch", then_branch=branches[0],
                              else_branch=branches[1])]
    x = helper.make_tensor_value_info("input", f32, [batch, features])
    return _model(nodes, [x], [out], [numpy_helper.from_array(np.array(0.0, np.float32), "zero")], "if_on_data")


def dense_2d_bias(batch: int = 2, features: int = 32, hidden: int = 32, classes: int = 16, seed: int = 0
                  ) -> onnx.ModelProto:
    """tf2onnx-style dense layers: MatMul + Add of a bias stored as [1, N], not [N]."""
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, features])
    y = helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, classes])
    inits = [_init(rng, "w1", (features, hidden), 0.3), _init(rng, "b1", (1, hidden), 0.1),
             _init(rng, "w2", (hidden, classes), 0.3), _init(rng, "b2", (1, classes), 0.1)]
    nodes = [
        helper.make_node("MatMul", ["input", "w1"], ["m1"], name="dense1/MatMul"),
        helper.make_node("Add", ["m1", "b1"], ["a1"], name="dense1/BiasAdd"),
        helper.make_node("Relu", ["a1"], ["r1"], name="dense1/Relu"),
        helper.make_node("MatMul", ["r1", "w2"], ["m2"], name="dense2/MatMul"),
        helper.make_node("Add", ["m2", "b2"], ["logits"], name="dense2/BiasAdd"),
    ]
    return _model(nodes, [x], [y], inits, "dense_2d_bias")


def transformer_layer(batch: int = 1, seq: int = 16, hidden: int = 32, ff: int = 64, seed: int = 0
                      ) -> onnx.ModelProto:
    """Post-norm encoder layer as torch exports it: attention (MatMul + bias Add projections), residual
    Add + LayerNormalization, FFN with the erf GELU (x * 0.5 * (1 + erf(x / sqrt 2))), residual + LN."""
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, seq, hidden])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, seq, hidden])
    inits = [_init(rng, n, (hidden, hidden)) for n in ("wq", "wk", "wv", "wo")]
    inits += [_init(rng, n, (hidden,), 0.05) for n in ("bq", "bk", "bv", "bo")]
    inits += [_init(rng, "w1", (hidden, ff)), _init(rng, "b1", (ff,), 0.05), _init(rng, "w2", (ff, hidden)),
              _init(rng, "b2", (hidden,), 0.05)]
    inits += [numpy_helper.from_array(np.ones(hidden, np.float32), f"ln{i}_g") for i in (1, 2)]
    inits += [numpy_helper.from_array(np.zeros(hidden, np.float32), f"ln{i}_b") for i in (1, 2)]
    inits += [numpy_helper.from_array(np.array(v, np.float32), n) for n, v in
              (("scale", 1 / np.sqrt(hidden)), ("sqrt2", np.sqrt(2.0)), ("one", 1.0), ("half", 0.5))]
    nodes = []
    for p in ("q", "k", "v"):
        nodes += [helper.make_node("MatMul", ["input", f"w{p}"], [f"{p}_mm"], name=f"attn/{p}/MatMul"),
                  helper.make_node("Add", [f"{p}_mm", f"b{p}"], [p], name=f"attn/{p}/Add")]
    nodes += [
        helper.make_node("Transpose", ["k"], ["kt"], name="attn/k_t", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s0"], name="attn/scores"),
        helper.make_node("Mul", ["s0", "scale"], ["s1"], name="attn/scale"),
        helper.make_node("Softmax", ["s1"], ["probs"], name="attn/softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["ctx"], name="attn/ctx"),
        helper.make_node("MatMul", ["ctx", "wo"], ["o_mm"], name="attn/out/MatMul"),
        helper.make_node("Add", ["o_mm", "bo"], ["o"], name="attn/out/Add"),
        helper.make_node("Add", ["o", "input"], ["res1"], name="attn/residual"),
        helper.make_node("LayerNormalization", ["res1", "ln1_g", "ln1_b"], ["h1"], name="ln1", axis=-1),
        helper.make_node("MatMul", ["h1", "w1"], ["f_mm"], name="ffn/fc1/MatMul"),
        helper.make_node("Add", ["f_mm", "b1"], ["f1"], name="ffn/fc1/Add"),
        helper.make_node("Div", ["f1", "sqrt2"], ["g0"], name="ffn/gelu/Div"),
        helper.make_node("Erf", ["g0"], ["g1"], name="ffn/gelu/Erf"),
        helper.make_node("Add", ["g1", "one"], ["g2"], name="ffn/gelu/Add"),
        helper.make_node("Mul", ["f1", "g2"], ["g3"], name="ffn/gelu/Mul"),
        helper.make_node("Mul", ["g3", "half"], ["gelu"], name="ffn/gelu/Mul_1"),
        helper.make_node("MatMul", ["gelu", "w2"], ["f2_mm"], name="ffn/fc2/MatMul"),
        helper.make_node("Add", ["f2_mm", "b2"], ["f2"], name="ffn/fc2/Add"),
        helper.make_node("Add", ["f2", "h1"], ["res2"], name="ffn/residual"),
        helper.make_node("LayerNormalization", ["res2", "ln2_g", "ln2_b"], ["output"], name="ln2", axis=-1),
    ]
    return _model(nodes, [x], [y], inits, "transformer_layer")


def cle_chain(activation: str = "Relu", groups: int = 1, batch: int = 1, size: int = 12, seed: int = 0
              ) -> onnx.ModelProto:
    """conv1 -> act -> conv2 (``groups``) -> act -> conv3 with badly scaled channels: conv1's output
    channels and conv2's output channels are multiplied by factors from 1e-2 to 1e2 and the next conv
    reads them divided by the same factors, so the float function is that of well-scaled weights.
    ``activation``: Relu, LeakyRelu or Clip (Relu6, bounds as inputs)."""
    rng = np.random.default_rng(seed)
    c = 8
    w1 = rng.standard_normal((c, 3, 3, 3)) * 0.3
    b1 = rng.standard_normal(c) * 0.05
    w2 = rng.standard_normal((c, c // groups, 3, 3)) * 0.2
    b2 = rng.standard_normal(c) * 0.05
    w3 = rng.standard_normal((4, c, 1, 1)) * 0.3
    f1 = np.array([100.0, 0.01, 1, 3, 0.3, 30, 1, 0.1])
    f2 = np.array([0.02, 1, 50, 1, 0.5, 2, 10, 0.05])
    if activation == "Clip":  # Relu6 is only the same function when its bound moves with the factors
        f1 = f2 = np.ones(c)
    w1, b1 = w1 * f1[:, None, None, None], b1 * f1
    cin = c // groups
    w2 = w2 / f1.reshape(groups, cin)[np.arange(c) // (c // groups)][:, :, None, None]
    w2, b2 = w2 * f2[:, None, None, None], b2 * f2
    w3 = w3 / f2[None, :, None, None]
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, 3, size, size])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, 4, size, size])
    arrays = {"w1": w1, "b1": b1, "w2": w2, "b2": b2, "w3": w3, "b3": rng.standard_normal(4) * 0.05}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()]
    inits += [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in (("lo", 0.0), ("hi", 6.0))]

    def act(src: str, dst: str, name: str) -> onnx.NodeProto:
        if activation == "Clip":
            return helper.make_node("Clip", [src, "lo", "hi"], [dst], name=name)
        extra = {"alpha": 0.1} if activation == "LeakyRelu" else {}
        return helper.make_node(activation, [src], [dst], name=name, **extra)

    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        act("c1", "a1", "act1"),
        helper.make_node("Conv", ["a1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1], group=groups),
        act("c2", "a2", "act2"),
        helper.make_node("Conv", ["a2", "w3", "b3"], ["output"], name="conv3"),
    ]
    return _model(nodes, [x], [y], inits, "cle_chain")


def mobilenet_block(batch: int = 1, channels: int = 8, expand: int = 16, size: int = 12, seed: int = 0
                    ) -> onnx.ModelProto:
    """MobileNetV2-style block with badly scaled channels: conv1x1 expand -> Relu -> depthwise 3x3 ->
    Relu -> conv1x1 project; the expand conv's channel i is scaled by a_i and the depthwise conv reads
    it divided by a_i; the depthwise conv's channel i is scaled by c_i and the projection undoes it."""
    rng = np.random.default_rng(seed)
    a = np.exp(rng.uniform(-4, 4, expand))
    c = np.exp(rng.uniform(-4, 4, expand))
    we = rng.standard_normal((expand, channels, 1, 1)) * 0.3 * a[:, None, None, None]
    be = rng.standard_normal(expand) * 0.05 * a
    wd = rng.standard_normal((expand, 1, 3, 3)) * 0.3 / a[:, None, None, None] * c[:, None, None, None]
    bd = rng.standard_normal(expand) * 0.05 * c
    wp = rng.standard_normal((channels, expand, 1, 1)) * 0.3 / c[None, :, None, None]
    bp = rng.standard_normal(channels) * 0.05
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, channels, size, size])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, channels, size, size])
    arrays = {"we": we, "be": be, "wd": wd, "bd": bd, "wp": wp, "bp": bp}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in arrays.items()]
    nodes = [
        helper.make_node("Conv", ["input", "we", "be"], ["e"], name="expand"),
        helper.make_node("Relu", ["e"], ["er"], name="expand_relu"),
        helper.make_node("Conv", ["er", "wd", "bd"], ["d"], name="depthwise", pads=[1, 1, 1, 1], group=expand),
        helper.make_node("Relu", ["d"], ["dr"], name="depthwise_relu"),
        helper.make_node("Conv", ["dr", "wp", "bp"], ["output"], name="project"),
    ]
    return _model(nodes, [x], [y], inits, "mobilenet_block")


OUTLIER_CHANNELS = (3, 11, 20)


def smoothing_block(producer: str = "layernorm", batch: int = 2, seq: int = 16, hidden: int = 32, out: int = 32,
                    factor: float = 50.0, consumer: str = "matmul", seed: int = 0) -> onnx.ModelProto:
    """``producer`` -> "act" -> MatMul "proj" (+ bias) -> "output", where "act" carries outlier channels
    (OUTLIER_CHANNELS, ``factor`` times larger) as LLM activations do. ``producer``:

    - "layernorm": LayerNormalization whose scale is ``factor`` larger on the outlier channels;
    - "decomposed": the same normalization written out (ReduceMean, Sub, Mul, ReduceMean, Add, Sqrt,
      Div) ending in Mul(gamma) -> Add(beta);
    - "matmul": MatMul + bias Add whose weight columns (and bias) carry the outliers;
    - "gelu": MatMul + bias with outlier columns, then x * sigmoid(1.702 x): no constant to fold into;
    - "erf_gelu": the same with torch's erf GELU, x * (erf(x / sqrt 2) + 1) * 0.5, whose constants
      runtimes match to fuse it;
    - "gemm": Gemm (transB=1) whose weight rows and bias carry the outliers.

    ``consumer`` "gemm" makes "proj" a Gemm with transB=1 (weight stored [out, hidden]). With a Gemm on
    either side the input is 2-D, [batch * seq, hidden].
    """
    rng = np.random.default_rng(seed)
    boost = np.ones(hidden)
    boost[list(OUTLIER_CHANNELS)] = factor
    lead = [batch * seq] if "gemm" in (producer, consumer) else [batch, seq]
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [*lead, hidden])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [*lead, out])

    def f32(name: str, v: np.ndarray | float) -> onnx.TensorProto:
        return numpy_helper.from_array(np.asarray(v, np.float32), name)

    gamma = (1.0 + 0.1 * rng.standard_normal(hidden)) * boost
    beta = 0.1 * rng.standard_normal(hidden)
    w = rng.standard_normal((hidden, out)) * 0.2
    inits = [f32("w", w.T if consumer == "gemm" else w), f32("b", rng.standard_normal(out) * 0.05)]
    if producer == "layernorm":
        inits += [f32("gamma", gamma), f32("beta", beta)]
        nodes = [helper.make_node("LayerNormalization", ["input", "gamma", "beta"], ["act"], name="ln", axis=-1)]
    elif producer == "decomposed":
        inits += [f32("gamma", gamma), f32("beta", beta), f32("eps", 1e-5)]
        nodes = [
            helper.make_node("ReduceMean", ["input"], ["mean"], name="ln/mean", axes=[-1]),
            helper.make_node("Sub", ["input", "mean"], ["d"], name="ln/sub"),
            helper.make_node("Mul", ["d", "d"], ["sq"], name="ln/sq"),
            helper.make_node("ReduceMean", ["sq"], ["var"], name="ln/var", axes=[-1]),
            helper.make_node("Add", ["var", "eps"], ["var_eps"], name="ln/add_eps"),
            helper.make_node("Sqrt", ["var_eps"], ["std"], name="ln/sqrt"),
            helper.make_node("Div", ["d", "std"], ["normed"], name="ln/div"),
            helper.make_node("Mul", ["normed", "gamma"], ["scaled"], name="ln/gamma"),
            helper.make_node("Add", ["scaled", "beta"], ["act"], name="ln/beta"),
        ]
    elif producer in ("matmul", "gelu", "erf_gelu"):
        inits += [f32("w0", rng.standard_normal((hidden, hidden)) * 0.2 * boost[None, :]),
                  f32("b0", rng.standard_normal(hidden) * 0.05 * boost)]
        h = "act" if producer == "matmul" else "h"
        nodes = [helper.make_node("MatMul", ["input", "w0"], ["h_mm"], name="fc0"),
                 helper.make_node("Add", ["h_mm", "b0"], [h], name="fc0_bias")]
        if producer == "erf_gelu":
            inits += [f32("sqrt2", np.sqrt(2.0)), f32("one", 1.0), f32("half", 0.5)]
            nodes += [helper.make_node("Div", ["h", "sqrt2"], ["hd"], name="gelu/div"),
                      helper.make_node("Erf", ["hd"], ["e"], name="gelu/erf"),
                      helper.make_node("Add", ["e", "one"], ["e1"], name="gelu/add"),
                      helper.make_node("Mul", ["h", "e1"], ["he"], name="gelu/mul"),
                      helper.make_node("Mul", ["he", "half"], ["act"], name="gelu/half")]
        if producer == "gelu":
            inits.append(f32("k", 1.702))
            nodes += [helper.make_node("Mul", ["h", "k"], ["hk"], name="gelu/scale"),
                      helper.make_node("Sigmoid", ["hk"], ["sig"], name="gelu/sigmoid"),
                      helper.make_node("Mul", ["h", "sig"], ["act"], name="gelu/mul")]
    elif producer == "gemm":
        inits += [f32("w0", rng.standard_normal((hidden, hidden)) * 0.2 * boost[:, None]),
                  f32("b0", rng.standard_normal(hidden) * 0.05 * boost)]
        nodes = [helper.make_node("Gemm", ["input", "w0", "b0"], ["act"], name="fc0", transB=1)]
    else:
        raise ValueError(f"producer {producer!r}: choose layernorm, decomposed, matmul, gelu, erf_gelu or gemm")
    if consumer == "gemm":
        nodes.append(helper.make_node("Gemm", ["act", "w", "b"], ["output"], name="proj", transB=1))
    else:
        nodes += [helper.make_node("MatMul", ["act", "w"], ["proj_mm"], name="proj"),
                  helper.make_node("Add", ["proj_mm", "b"], ["output"], name="proj_bias")]
    return _model(nodes, [x], [y], inits, f"smoothing_{producer}")


def qkv_block(batch: int = 2, seq: int = 16, hidden: int = 32, factor: float = 50.0, residual: bool = False,
              seed: int = 0) -> onnx.ModelProto:
    """LayerNormalization (outlier channels in its scale) -> "ln_out" read by the Q, K and V projections
    (MatMul + bias), single-head attention, output projection; ``residual`` adds "ln_out" to the
    output, so "ln_out" also feeds an op that cannot be smoothed."""
    rng = np.random.default_rng(seed)
    gamma = 1.0 + 0.1 * rng.standard_normal(hidden)
    gamma[list(OUTLIER_CHANNELS)] *= factor
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, seq, hidden])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, [batch, seq, hidden])
    inits = [numpy_helper.from_array(gamma.astype(np.float32), "gamma"),
             _init(rng, "beta", (hidden,), 0.1), _init(rng, "wo", (hidden, hidden)), _init(rng, "bo", (hidden,), 0.05),
             numpy_helper.from_array(np.array(1 / np.sqrt(hidden), np.float32), "scale")]
    nodes = [helper.make_node("LayerNormalization", ["input", "gamma", "beta"], ["ln_out"], name="ln", axis=-1)]
    for p in ("q", "k", "v"):
        inits += [_init(rng, f"w{p}", (hidden, hidden)), _init(rng, f"b{p}", (hidden,), 0.05)]
        nodes += [helper.make_node("MatMul", ["ln_out", f"w{p}"], [f"{p}_mm"], name=f"attn/{p}"),
                  helper.make_node("Add", [f"{p}_mm", f"b{p}"], [p], name=f"attn/{p}_bias")]
    final = "o_res" if residual else "output"
    nodes += [
        helper.make_node("Transpose", ["k"], ["kt"], name="attn/kt", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["q", "kt"], ["s0"], name="attn/scores"),
        helper.make_node("Mul", ["s0", "scale"], ["s1"], name="attn/scale"),
        helper.make_node("Softmax", ["s1"], ["probs"], name="attn/softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "v"], ["ctx"], name="attn/ctx"),
        helper.make_node("MatMul", ["ctx", "wo"], ["o_mm"], name="attn/out"),
        helper.make_node("Add", ["o_mm", "bo"], [final], name="attn/out_bias"),
    ]
    if residual:
        nodes.append(helper.make_node("Add", ["o_res", "ln_out"], ["output"], name="residual"))
    return _model(nodes, [x], [y], inits, "qkv_block")


def if_on_rate(length: int = 64, channels: int = 8, seed: int = 0) -> onnx.ModelProto:
    """silero-vad's shape: every Conv inside an If on a scalar int64 input "sr" (16000 or not), and inside
    the taken branch a second If on the input's length (Identity or Squeeze), as exporters write it."""
    rng = np.random.default_rng(seed)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, "T"])
    sr = helper.make_tensor_value_info("sr", TensorProto.INT64, [])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, None, None])
    inits = [_init(rng, "w16", (channels, 1, 5), 0.5), _init(rng, "b16", (channels,), 0.05),
             _init(rng, "w16b", (1, channels, 3), 0.3), _init(rng, "w8", (channels, 1, 3), 0.5),
             numpy_helper.from_array(np.array(16000, np.int64), "rate16k"),
             numpy_helper.from_array(np.array(2, np.int64), "len_axis"),
             numpy_helper.from_array(np.array(length, np.int64), "expected_len")]

    def out(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, None, None])

    inner_then = helper.make_graph([helper.make_node("Relu", ["c16"], ["inner_t"], name="inner/relu")],
                                   "inner_then", [], [out("inner_t")])
    inner_else = helper.make_graph([helper.make_node("Identity", ["c16"], ["inner_e"], name="inner/identity")],
                                   "inner_else", [], [out("inner_e")])
    then = helper.make_graph([
        helper.make_node("Conv", ["x", "w16", "b16"], ["c16"], name="hi/conv1", pads=[2, 2]),
        helper.make_node("Shape", ["x"], ["x_shape"], name="hi/shape"),
        helper.make_node("Gather", ["x_shape", "len_axis"], ["x_len"], name="hi/len"),
        helper.make_node("Equal", ["x_len", "expected_len"], ["is_len"], name="hi/is_len"),
        helper.make_node("If", ["is_len"], ["act"], name="hi/if_len", then_branch=inner_then,
                         else_branch=inner_else),
        helper.make_node("Conv", ["act", "w16b"], ["hi_y"], name="hi/conv2", pads=[1, 1]),
    ], "then", [], [out("hi_y")])
    other = helper.make_graph([helper.make_node("Conv", ["x", "w8"], ["lo_y"], name="lo/conv", pads=[1, 1])],
                              "else", [], [out("lo_y")])
    nodes = [helper.make_node("Equal", ["sr", "rate16k"], ["is16k"], name="is16k"),
             helper.make_node("If", ["is16k"], ["y"], name="if_rate", then_branch=then, else_branch=other)]
    graph = helper.make_graph(nodes, "if_on_rate", [x, sr], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="qdq-tune-tests")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model
