"""Tensors with outlier channels: calibration measures them (max / median channel absmax) and recovery
leaves their element-wise readers and writers float before ranking any node."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.calibrate.collect import CalibrationMethod, collect, outlier_ratio
from pipeline.data.adapters import Batch
from tasks.quantize.recovery import outlier_units


def residual_ffn(outlier: float = 200.0) -> onnx.ModelProto:
    """x -> MatMul(W1) + b -> Add(x) -> LayerNorm -> MatMul(W2): BERT's FFN output and residual add,
    with output channel 3 of W1 ``outlier`` times larger (the FFN output's outlier channel)."""
    rng = np.random.default_rng(0)
    d = 64
    w1 = (rng.standard_normal((d, d)) * 0.1).astype(np.float32)
    w1[:, 3] *= outlier
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(np.zeros(d, np.float32), "b1"),
             numpy_helper.from_array(np.ones(d, np.float32), "g"), numpy_helper.from_array(np.zeros(d, np.float32), "be"),
             numpy_helper.from_array((rng.standard_normal((d, 16)) * 0.1).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m1"], name="ffn_out"),
             helper.make_node("Add", ["m1", "b1"], ["h"], name="ffn_bias"),
             helper.make_node("Add", ["h", "x"], ["r"], name="residual"),
             helper.make_node("LayerNormalization", ["r", "g", "be"], ["n"], name="ln", axis=-1),
             helper.make_node("MatMul", ["n", "w2"], ["y"], name="head")]
    g = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, d])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 16])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return onnx.shape_inference.infer_shapes(m)


def _stats(model):
    rng = np.random.default_rng(1)
    feeds = [{"x": rng.standard_normal((1, 8, 64)).astype(np.float32)} for _ in range(4)]
    return collect(model, lambda: iter([Batch(f, None, 1) for f in feeds]),
                   CalibrationMethod("minmax", 99.99, 2048), 1, lambda it, desc: it)


def test_calibration_measures_outlier_channels():
    stats = _stats(residual_ffn())
    assert stats["h"].channel_ratio > 32 and stats["r"].channel_ratio > 32
    assert stats["x"].channel_ratio < 10 and stats["n"].channel_ratio < 32


def test_outlier_ratio_of_a_mask_at_the_float32_limit_is_finite_and_silent():
    # BERT's additive attention mask holds finfo(float32).min: the median of two such channels overflowed
    big = np.finfo(np.float32).max
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert outlier_ratio(np.array([big, big, big, 1.0], np.float32)) == 1.0
        assert outlier_ratio(np.array([big, 1.0, 1.0], np.float32)) == float(big)


def test_outlier_recovery_picks_the_residual_add_not_the_matmuls():
    model = residual_ffn()
    stats = _stats(model)
    units = ["ffn_out", "residual", "head"]
    found = outlier_units(model, stats, units, 32.0)
    assert list(found) == ["residual"] and "outlier channels on" in found["residual"]
    assert outlier_units(model, stats, units, 0.0) == {}  # 0 turns it off
    assert outlier_units(residual_ffn(outlier=1.0), _stats(residual_ffn(outlier=1.0)), units, 32.0) == {}


def test_block_recovery_finds_the_stretch_of_the_graph_that_makes_the_error():
    """No single node matters, but quantizing the first quarter of the graph does (a detector's early
    backbone): the smallest stretch that meets the budget is left float, and the profile says so."""
    from pathlib import Path

    from pipeline.accuracy.budget import AccuracyVerdict
    from tasks.quantize.checker import Candidate
    from tasks.quantize.recovery import block_recovery

    order = [f"n{i}" for i in range(40)]
    early = set(order[:10])

    class Stub:
        def check(self, float_nodes, name):
            missing = len(early - float_nodes)  # each early node still quantized costs 1 dB
            snr = 25.0 - missing
            return Candidate(name, Path(name), AccuracyVerdict(snr >= 20, "snr", f"SNR {snr} dB", snr))

    nodes, cand, profile = block_recovery(order, lambda s: frozenset(s), Stub(), max_nodes=20)
    assert nodes == order[:10] and cand.verdict.ok
    assert [p["float"] for p in profile] == ["first 4 of 40", "last 4 of 40", "first 10 of 40"]
    assert not profile[0]["ok"] and profile[-1]["ok"]
    none, missing, _ = block_recovery(order, lambda s: frozenset(s), Stub(), max_nodes=5)
    assert none == [] and missing is None
