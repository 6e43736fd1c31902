"""Float-exact transforms: cross-layer equalization and SmoothQuant-style outlier smoothing keep the float
function and make int8 Q/DQ math (computed here with numpy, independently of pipeline.quant.qdq) more accurate."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from pipeline.data.adapters import Batch
from tasks.quantize.passes.activations import RowSample, channel_absmax
from tasks.quantize.passes.equalization import equalize_cross_layer
from tasks.quantize.passes.postcondition import float_rel_error
from tasks.quantize.passes.smoothing import smooth_outliers, smoothing_candidates
from tests import models

EXACT = 1e-5


def _feeds(model: onnx.ModelProto, n: int, seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    return [{model.graph.input[0].name: rng.standard_normal(shape).astype(np.float32)} for _ in range(n)]


def _run(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], names: list[str]) -> dict[str, np.ndarray]:
    """Tensors ``names`` (exposed as extra outputs) over all feeds, concatenated along axis 0."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    outs = {o.name for o in m.graph.output}
    m.graph.output.extend(helper.make_empty_tensor_value_info(t) for t in names if t not in outs)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
    got = [sess.run(names, f) for f in feeds]
    return {t: np.concatenate([g[i] for g in got]) for i, t in enumerate(names)}


def _node(model: onnx.ModelProto, name: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if n.name == name)


def _init(model: onnx.ModelProto, name: str) -> np.ndarray:
    return numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == name)).astype(np.float64)


def _unchanged(model: onnx.ModelProto) -> bytes:
    return model.SerializeToString(deterministic=True)


# ------------------------------------------------------------------ numpy Q/DQ
def _qdq_uint8(x: np.ndarray, lo: float, hi: float) -> np.ndarray:
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = (hi - lo) / 255.0
    zp = np.clip(np.rint(-lo / scale), 0, 255)
    return (np.clip(np.rint(x / scale) + zp, 0, 255) - zp) * scale


def _qdq_int8(w: np.ndarray, axis: int | None) -> np.ndarray:
    """Symmetric int8 per tensor (axis None) or per channel along ``axis``."""
    if axis is None:
        scale = np.abs(w).max() / 127.0
    else:
        scale = np.abs(np.moveaxis(w, axis, 0)).reshape(w.shape[axis], -1).max(axis=1) / 127.0
        shape = [1] * w.ndim
        shape[axis] = -1
        scale = scale.reshape(shape)
    return np.clip(np.rint(w / scale), -127, 127) * scale


def _per_tensor_conv_weight_error(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]]) -> float:
    """Relative output error when every Conv weight is quantized per tensor to int8 (activations float)."""
    fq = onnx.ModelProto()
    fq.CopyFrom(model)
    conv_weights = {n.input[1] for n in fq.graph.node if n.op_type == "Conv"}
    for init in fq.graph.initializer:
        if init.name in conv_weights:
            w = numpy_helper.to_array(init).astype(np.float64)
            init.CopyFrom(numpy_helper.from_array(_qdq_int8(w, None).astype(np.float32), init.name))
    return float_rel_error(model, fq, feeds)


def _proj_int8_error(model: onnx.ModelProto, calib: list[dict], held: list[dict], node: str = "proj") -> float:
    """Relative error of MatMul ``node``'s output with its input as per-tensor uint8 and its weight as
    per-channel int8, on ``held`` data; the reference is the float MatMul. The uint8 range covers calib
    and held data: with a few hundred Gaussian rows, held-out tails beyond a calib-only range would add
    clipping noise that says nothing about the transform."""
    mm = _node(model, node)
    x_cal = _run(model, calib + held, [mm.input[0]])[mm.input[0]]
    x = _run(model, held, [mm.input[0]])[mm.input[0]].astype(np.float64)
    w = _init(model, mm.input[1])
    if mm.op_type == "Gemm":  # the test models' Gemms store W as [N, K] (transB=1)
        w = w.T
    y = x @ w
    xq = _qdq_uint8(x, float(x_cal.min()), float(x_cal.max()))
    return float(np.linalg.norm(xq @ _qdq_int8(w, 1) - y) / np.linalg.norm(y))


def _calibrate(model: onnx.ModelProto, calib: list[dict]) -> tuple[dict, dict]:
    return channel_absmax(model, lambda: iter(calib), smoothing_candidates(model), threads=1)


# ------------------------------------------------------------------ cross-layer equalization
@pytest.mark.parametrize("build", [
    pytest.param(lambda: models.cle_chain(), id="relu-chain"),
    pytest.param(lambda: models.cle_chain("LeakyRelu"), id="leakyrelu-chain"),
    pytest.param(lambda: models.cle_chain(groups=2), id="grouped-chain"),
    pytest.param(lambda: models.mobilenet_block(), id="depthwise-block"),
])
def test_cle_is_float_exact_equalizes_ranges_and_helps_per_tensor_weights(build):
    model = build()
    frozen = _unchanged(model)
    feeds = _feeds(model, 3, seed=1)
    out, records = equalize_cross_layer(model)
    assert _unchanged(model) == frozen, "the input model must not be mutated"
    onnx.checker.check_model(out, full_check=True)
    assert float_rel_error(model, out, feeds) <= EXACT
    convs = [n.name for n in model.graph.node if n.op_type == "Conv"]
    assert [(r["first"], r["second"]) for r in records] == list(zip(convs, convs[1:], strict=False))
    for r in records:
        assert r["range_ratio_before"] > 100.0
        assert r["range_ratio_after"] < 3.0, r
    # what equalization is for: one scale per weight tensor now fits every channel
    before, after = _per_tensor_conv_weight_error(model, feeds), _per_tensor_conv_weight_error(out, feeds)
    assert after < 0.1 * before and after < 0.02, (before, after)


def test_cle_on_depthwise_pair_scales_each_depthwise_filter_by_its_own_channel():
    model = models.mobilenet_block()
    out, _ = equalize_cross_layer(model)
    we0, we1 = _init(model, "we"), _init(out, "we")
    wd0, wd1 = _init(model, "wd"), _init(out, "wd")
    wp0, wp1 = _init(model, "wp"), _init(out, "wp")
    s_expand = (we0.reshape(16, -1) / we1.reshape(16, -1))[:, 0]  # expand channel i divided by s_i
    s_project = (wp1.reshape(8, 16) / wp0.reshape(8, 16))[0]  # project input channel i multiplied by t_i
    # depthwise filter i: multiplied by s_i (its input channel) and divided by t_i (its output channel)
    np.testing.assert_allclose(wd1 / wd0, (s_expand / s_project)[:, None, None, None] * np.ones_like(wd0),
                               rtol=1e-5)
    np.testing.assert_allclose(_init(out, "bd") / _init(model, "bd"), 1.0 / s_project, rtol=1e-5)


def test_cle_leaves_clip_pairs_and_observed_tensors_alone():
    clip = models.cle_chain("Clip")
    out, records = equalize_cross_layer(clip)
    assert records == []
    assert all(np.array_equal(_init(clip, n), _init(out, n)) for n in ("w1", "w2", "w3"))

    # conv1's activation is also a graph output: scaling it would change what the caller sees
    model = models.cle_chain()
    model.graph.output.append(helper.make_tensor_value_info("a1", onnx.TensorProto.FLOAT, None))
    out, records = equalize_cross_layer(model)
    assert [(r["first"], r["second"]) for r in records] == [("conv2", "conv3")]
    assert np.array_equal(_init(model, "w1"), _init(out, "w1"))
    assert float_rel_error(model, out, _feeds(model, 2, seed=3)) <= EXACT


# ------------------------------------------------------------------ outlier smoothing
@pytest.mark.parametrize(("producer", "consumer", "absorbed_by", "inserted"), [
    ("layernorm", "matmul", "LayerNormalization", False),
    ("decomposed", "matmul", "Mul+Add", False),
    ("matmul", "matmul", "MatMul+Add", False),
    ("gelu", "matmul", "Mul", True),
    ("erf_gelu", "matmul", "Mul", True),  # its 0.5 stays: runtimes fuse the GELU by its constants
    ("gemm", "gemm", "Gemm", False),
    ("layernorm", "gemm", "LayerNormalization", False),
])
def test_smoothing_is_float_exact_and_cuts_int8_error(producer, consumer, absorbed_by, inserted):
    model = models.smoothing_block(producer, consumer=consumer)
    frozen = _unchanged(model)
    calib, held = _feeds(model, 4, seed=1), _feeds(model, 4, seed=2)
    absmax, samples = _calibrate(model, calib)
    assert absmax["act"][list(models.OUTLIER_CHANNELS)].min() > 10 * np.median(absmax["act"])

    out, records = smooth_outliers(model, absmax, samples)
    assert _unchanged(model) == frozen, "the input model must not be mutated"
    onnx.checker.check_model(out, full_check=True)
    assert float_rel_error(model, out, held) <= EXACT

    rec = next(r for r in records if r["tensor"] == "act")
    assert rec["consumers"] == ["proj"] and rec["alpha"] > 0
    assert (rec["absorbed_by"], rec["inserted_mul"]) == (absorbed_by, inserted)
    assert rec["error_after"] < 0.5 * rec["error_before"]
    assert rec["outlier_ratio_after"] < 0.25 * rec["outlier_ratio_before"]
    # a Mul node exactly where one was inserted; nothing else added
    inserted_count = sum(r["inserted_mul"] for r in records)
    assert len(out.graph.node) == len(model.graph.node) + inserted_count
    assert (_node(out, "proj").input[0] == "act") != inserted

    before, after = _proj_int8_error(model, calib, held), _proj_int8_error(out, calib, held)
    assert after < 0.5 * before, (before, after)
    if producer == "erf_gelu":
        assert all(np.array_equal(_init(model, c), _init(out, c)) for c in ("sqrt2", "one", "half"))


def test_qkv_projections_share_one_scale_folded_into_layernorm():
    model = models.qkv_block()
    calib, held = _feeds(model, 4, seed=1), _feeds(model, 4, seed=2)
    absmax, samples = _calibrate(model, calib)
    out, records = smooth_outliers(model, absmax, samples)
    assert float_rel_error(model, out, held) <= EXACT
    rec = next(r for r in records if r["tensor"] == "ln_out")
    assert rec["consumers"] == ["attn/q", "attn/k", "attn/v"]
    assert rec["absorbed_by"] == "LayerNormalization" and not rec["inserted_mul"]
    s = _init(model, "gamma") / _init(out, "gamma")
    # s from the weight absmax over all three projections, not one of them
    a = rec["alpha"]
    w_absmax = np.max([np.abs(_init(model, w)).max(axis=1) for w in ("wq", "wk", "wv")], axis=0)
    np.testing.assert_allclose(s, absmax["ln_out"].astype(np.float64) ** a / w_absmax ** (1 - a), rtol=1e-4)
    np.testing.assert_allclose(_init(model, "beta") / _init(out, "beta"), s, rtol=1e-5)
    for w in ("wq", "wk", "wv"):  # every row k of every projection times the same s_k
        ratio = _init(out, w) / _init(model, w)
        np.testing.assert_allclose(ratio, s[:, None] * np.ones_like(ratio), rtol=1e-5)
    assert s[list(models.OUTLIER_CHANNELS)].min() > 3 * np.median(s)
    for name in ("attn/q", "attn/k", "attn/v"):
        assert _proj_int8_error(out, calib, held, name) < 0.5 * _proj_int8_error(model, calib, held, name)


def test_tensor_with_an_unsmoothable_reader_gets_an_inserted_mul():
    model = models.qkv_block(residual=True)
    calib, held = _feeds(model, 4, seed=1), _feeds(model, 4, seed=2)
    out, records = smooth_outliers(model, *_calibrate(model, calib))
    assert float_rel_error(model, out, held) <= EXACT
    rec = next(r for r in records if r["tensor"] == "ln_out")
    assert rec["absorbed_by"] == "Mul" and rec["inserted_mul"]
    assert np.array_equal(_init(model, "gamma"), _init(out, "gamma"))  # LN output still read raw
    assert "ln_out" in _node(out, "residual").input
    mul = next(n for n in out.graph.node if n.op_type == "Mul" and n.input[0] == "ln_out")
    assert {_node(out, f"attn/{p}").input[0] for p in "qkv"} == {mul.output[0]}


def test_weight_shared_with_another_tensor_is_copied_not_rescaled_for_both():
    model = models.smoothing_block("layernorm")
    # "w" is also read by a MatMul on the raw input: rescaling it in place would change that output
    model.graph.node.append(helper.make_node("MatMul", ["input", "w"], ["side"], name="side"))
    model.graph.output.append(helper.make_tensor_value_info("side", onnx.TensorProto.FLOAT, None))
    calib, held = _feeds(model, 4, seed=1), _feeds(model, 4, seed=2)
    out, records = smooth_outliers(model, *_calibrate(model, calib))
    assert any(r["tensor"] == "act" for r in records)
    assert _node(out, "proj").input[1] != _node(out, "side").input[1]
    assert float_rel_error(model, out, held) <= EXACT


def test_smoothing_without_gain_or_samples():
    model = models.smoothing_block("layernorm")
    calib = _feeds(model, 2, seed=1)
    absmax, samples = _calibrate(model, calib)
    out, records = smooth_outliers(model, absmax, samples, alphas=(0.0,))
    assert records == [] and _unchanged(out) == _unchanged(model)
    # no samples: SmoothQuant's alpha 0.5, no errors to report, still exact
    out, records = smooth_outliers(model, absmax, None, act_dtype="int8")
    assert [(r["tensor"], r["alpha"], r["error_before"]) for r in records] == [("act", 0.5, None)]
    assert float_rel_error(model, out, calib) <= EXACT
    with pytest.raises(ValueError, match="act_dtype"):
        smooth_outliers(model, absmax, samples, act_dtype="fp8")


# ------------------------------------------------------------------ helpers
def test_smoothing_candidates_need_constant_weights_and_k_of_16():
    assert smoothing_candidates(models.smoothing_block("gelu")) == ["input", "act"]
    assert smoothing_candidates(models.dense_2d_bias(features=8, hidden=32)) == ["r1"]  # input has K = 8
    # activation x activation MatMuls (scores, context) are not candidates
    assert smoothing_candidates(models.qkv_block()) == ["ln_out", "ctx"]


def test_channel_absmax_matches_numpy_and_samples_real_rows():
    model = models.smoothing_block("matmul")
    feeds = _feeds(model, 5, seed=4)
    x = _run(model, feeds, ["act"])["act"].reshape(-1, 32)
    batches = [Batch(f, None, 2) for f in feeds[:3]] + feeds[3:]  # Batch objects and plain feed dicts
    absmax, samples = channel_absmax(model, lambda: iter(batches), ["act", "input"], threads=1,
                                     sample=RowSample(max_rows=100))
    np.testing.assert_allclose(absmax["act"], np.abs(x).max(axis=0), rtol=1e-6)
    assert samples["act"].shape == (100, 32) and samples["input"].shape == (100, 32)
    rows = {r.tobytes() for r in x.astype(np.float32)}
    assert all(r.tobytes() in rows for r in samples["act"])
    assert len({r.tobytes() for r in samples["act"]}) == 100


def test_float_rel_error_sees_a_one_percent_change():
    model = models.smoothing_block("layernorm")
    feeds = _feeds(model, 2, seed=5)
    assert float_rel_error(model, model, feeds) == 0.0
    bumped = onnx.ModelProto()
    bumped.CopyFrom(model)
    w = next(i for i in bumped.graph.initializer if i.name == "w")
    w.CopyFrom(numpy_helper.from_array((numpy_helper.to_array(w) * 1.01).astype(np.float32), "w"))
    assert 0.005 < float_rel_error(model, bumped, feeds) < 0.02


# ------------------------------------------------------------------ attention scale folding
def _heads_attention(relu_on: str = "", scores_read_twice: bool = False) -> onnx.ModelProto:
    """[1, 8, 16] -> two heads of 8 as torch exports them: q/k projections (MatMul + bias Add), Reshape and
    Transpose to heads, scores = q k^T / 8, Softmax. ``relu_on`` ("q" or "k") puts a Relu after that
    projection (its path is then not linear); ``scores_read_twice`` makes q k^T a model output too."""
    rng = np.random.default_rng(3)
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 8, 16])
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32) * 0.3, n)
             for n, s in (("wq", (16, 16)), ("bq", (16,)), ("wk", (16, 16)), ("bk", (16,)))]
    inits += [numpy_helper.from_array(np.array([1, 8, 2, 8], np.int64), "heads"),
              numpy_helper.from_array(np.array(8.0, np.float32), "d")]
    nodes = []
    for p in ("q", "k"):
        nodes += [helper.make_node("MatMul", ["x", f"w{p}"], [f"{p}0"], name=f"{p}/MatMul"),
                  helper.make_node("Add", [f"{p}0", f"b{p}"], [f"{p}1"], name=f"{p}/Add")]
        if relu_on == p:
            nodes.append(helper.make_node("Relu", [f"{p}1"], [f"{p}1r"], name=f"{p}/Relu"))
        nodes += [helper.make_node("Reshape", [nodes[-1].output[0], "heads"], [f"{p}2"], name=f"{p}/Reshape"),
                  helper.make_node("Transpose", [f"{p}2"], [f"{p}3"], name=f"{p}/Transpose",
                                   perm=[0, 2, 3, 1] if p == "k" else [0, 2, 1, 3])]
    nodes += [helper.make_node("MatMul", ["q3", "k3"], ["s0"], name="scores"),
              helper.make_node("Div", ["s0", "d"], ["s1"], name="scale"),
              helper.make_node("Softmax", ["s1"], ["probs"], name="softmax", axis=-1)]
    outputs = [helper.make_tensor_value_info("probs", onnx.TensorProto.FLOAT, [1, 2, 8, 8])]
    if scores_read_twice:
        outputs.append(helper.make_tensor_value_info("s0", onnx.TensorProto.FLOAT, [1, 2, 8, 8]))
    return helper.make_model(helper.make_graph(nodes, "heads", [x], outputs, inits),
                             opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("model_fn,node,into", [(models.transformer_layer, "attn/scale", "attn/q/Add"),
                                                (models.attention_block, "attn/scale", "attn/q"),
                                                (_heads_attention, "scale", "q/Add"),
                                                (lambda: _heads_attention("q"), "scale", "k/Add")])
def test_attention_scale_moves_into_a_projection_and_its_node_goes(model_fn, node, into):
    """The query projection takes the scale; the key projection when the query path is not linear."""
    from tasks.quantize.passes.scale_folding import fold_matmul_scales

    model = model_fn()
    onnx.checker.check_model(model)
    new, changes = fold_matmul_scales(model)
    onnx.checker.check_model(new)
    assert [c["node"] for c in changes] == [node]
    assert node not in {n.name for n in new.graph.node}
    assert changes[0]["into"].split()[-1] == into
    assert float_rel_error(model, new, _feeds(model, 3, 0)) <= EXACT
    assert {i.name for i in model.graph.initializer} - {i.name for i in new.graph.initializer} <= {"scale", "d"}


def _no_linear_path() -> onnx.ModelProto:
    """Relu on the query path; the key path's bias Add reads the MatMul output twice (no constant)."""
    model = _heads_attention("q")
    for n in model.graph.node:
        if n.name == "k/Add":
            n.input[1] = "k0"
    return model


@pytest.mark.parametrize("model_fn", [lambda: _heads_attention(scores_read_twice=True), _no_linear_path])
def test_a_scale_that_cannot_move_is_left_alone(model_fn):
    from tasks.quantize.passes.scale_folding import fold_matmul_scales

    new, changes = fold_matmul_scales(model_fn())
    assert changes == [] and "scale" in {n.name for n in new.graph.node}


@pytest.mark.parametrize("model_fn", [models.transformer_layer, models.conv_chain, lambda: models.cle_chain("Relu")])
def test_transforms_leave_their_input_untouched_and_copy_only_to_change(model_fn):
    """The graph editor copies the model at its first edit: a transform with nothing to change returns
    the very model it was given, and one that changes it leaves the input byte-identical."""
    from pipeline.graph.model import model_hash
    from tasks.quantize.passes.scale_folding import fold_matmul_scales

    model = model_fn()
    before = model_hash(model)
    for new, changes in (fold_matmul_scales(model), equalize_cross_layer(model)):
        assert (new is model) == (not changes)
        assert model_hash(model) == before
