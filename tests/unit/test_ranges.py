"""Error-minimizing ranges: the mse and auto calibration algorithms and the mse weight clip search."""

from __future__ import annotations

import dataclasses
import json
import logging

import ml_dtypes
import numpy as np
import onnx
import pytest
from omegaconf import OmegaConf
from onnx import TensorProto, helper, numpy_helper

from pipeline.calibrate.collect import CalibrationMethod, collect, signed_histogram
from pipeline.calibrate.search import AUTO_CANDIDATES, range_mse
from pipeline.data.adapters import Batch
from pipeline.quant.calibration import Calibration, TensorStats, load_calibration
from pipeline.quant.placement import resolve_rules, tensorrt_plan
from pipeline.quant.qdq import apply_plan
from pipeline.quant.qmath import QTYPES, QuantParams, quantize_values, weight_params
from tasks.quantize.stage import calibration_document
from tests import models

SHAPE = (64, 4096)  # 262144 values per batch


def _identity_model() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, list(SHAPE))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(SHAPE))
    g = helper.make_graph([helper.make_node("Identity", ["input"], ["y"], name="id")], "ranges", [x], [y])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _outlier_batches(n: int = 4, outliers: int = 1, factor: float = 30.0, relu: bool = False):
    """Gaussian values with ``outliers`` values per batch at ``factor`` sigma (1 in 262144 by default),
    positive in even batches, negative in odd ones."""

    def batches():
        rng = np.random.default_rng(0)
        for k in range(n):
            a = rng.standard_normal(SHAPE).astype(np.float32)
            idx = rng.choice(a.size, outliers, replace=False)
            a.ravel()[idx] = factor * (-1.0) ** k
            yield Batch({"input": np.maximum(a, 0) if relu else a}, None, SHAPE[0])

    return batches


def _values(batches) -> np.ndarray:
    return np.concatenate([b.feeds["input"].ravel() for b in batches()])


def _fake_quant(x: np.ndarray, stats: TensorStats, dtype: str) -> np.ndarray:
    """What a Q/DQ pair with stats.params(dtype) does to x (ONNX QuantizeLinear semantics)."""
    p = stats.params(dtype)
    s, z = np.float64(p.scale), float(p.zero_point)
    x = x.astype(np.float64)
    if dtype in ("int8", "uint8"):
        _, _, lo, hi = QTYPES[dtype]
        return (np.clip(np.rint(x / s) + z, lo, hi) - z) * s
    lim = QTYPES[dtype][3]
    t = ml_dtypes.float8_e4m3fn if dtype == "fp8_e4m3fn" else ml_dtypes.float8_e5m2
    return np.clip(x / s, -lim, lim).astype(t).astype(np.float64) * s


def _mse(x: np.ndarray, stats: dict, dtype: str) -> float:
    return float(np.mean((_fake_quant(x, stats, dtype) - x) ** 2))


def _collect(batches, algorithm: str, percentile: float = 99.99) -> TensorStats:
    return collect(_identity_model(), batches,
                   CalibrationMethod(algorithm, percentile, 2048), 1, lambda it, d: it)["y"]


# --------------------------------------------------------------------------- the histogram measure


@pytest.mark.parametrize("dtype", list(QTYPES))
@pytest.mark.parametrize("relu", [False, True])
def test_histogram_mse_matches_the_quantization_error(dtype, relu):
    x = _values(_outlier_batches(n=1, outliers=20, relu=relu))
    lo, hi = float(x.min()), float(x.max())
    hist, zeros = signed_histogram(x, lo, hi, 2048)
    absmax = max(-lo, hi)
    for t in (absmax, 0.5 * absmax, 0.2 * absmax, 0.1 * absmax):
        stats = TensorStats(min=lo, max=hi, absmax=absmax, threshold=t, algorithm="mse")
        est, true = range_mse(hist, lo, hi, dtype, t, zeros)[0], _mse(x, stats, dtype)
        assert est == pytest.approx(true, rel=0.03), (t, est, true)


# --------------------------------------------------------------------------- activations


def test_mse_thresholds_beat_minmax_on_rare_outliers():
    batches = _outlier_batches()  # 4 values at 30 sigma among 1M
    x = _values(batches)
    mm, mse = _collect(batches, "minmax"), _collect(batches, "mse")
    assert set(mse.thresholds) == set(QTYPES) and mse.threshold == mse.thresholds["int8"]
    assert mse.algorithm == "mse" and mse.samples == mm.samples
    for dt in ("int8", "uint8"):
        assert mse.thresholds[dt] < 0.5 * mm.threshold, mse.thresholds
        assert _mse(x, mse, dt) < 0.7 * _mse(x, mm, dt), dt
    for dt in QTYPES:
        assert _mse(x, mse, dt) <= _mse(x, mm, dt) * 1.01, dt


def test_int8_and_uint8_get_their_own_clip():
    # outliers on the positive side only: asymmetric uint8 spends its levels on [min, max] already, so
    # it gains less from a clip than symmetric int8, which wastes half its levels on the empty side
    def batches():
        for b in _outlier_batches()():
            a = b.feeds["input"]
            yield Batch({"input": np.where(a < -20, -a, a)}, None, b.valid)

    x = _values(batches)
    mm, mse = _collect(batches, "minmax"), _collect(batches, "mse")
    t = mse.thresholds
    assert 0 < t["int8"] < t["uint8"] < mm.threshold, t
    for dt in ("int8", "uint8"):
        assert _mse(x, mse, dt) < 0.8 * _mse(x, mm, dt), dt
    # each dtype's own clip is the better one for it
    swapped = dataclasses.replace(mse, thresholds={"int8": t["uint8"], "uint8": t["int8"]})
    assert _mse(x, mse, "int8") < _mse(x, swapped, "int8")
    assert _mse(x, mse, "uint8") < _mse(x, swapped, "uint8")


def test_mse_keeps_frequent_outliers():
    # 0.1% of the values at 30 sigma: clipping them costs far more than the finer grid saves
    batches = _outlier_batches(n=2, outliers=262)
    x = _values(batches)
    mm, mse = _collect(batches, "minmax"), _collect(batches, "mse")
    for dt in QTYPES:
        assert _mse(x, mse, dt) <= _mse(x, mm, dt) * 1.01, dt
    assert mse.thresholds["int8"] > 0.9 * mm.threshold


def test_uint8_mse_on_a_relu_output_keeps_zero_point_zero():
    batches = _outlier_batches(relu=True)
    x = _values(batches)
    mm, mse = _collect(batches, "minmax"), _collect(batches, "mse")
    p = mse.params("uint8")
    assert float(p.zero_point) == 0.0 and mse.thresholds["uint8"] < 0.8 * mm.threshold
    assert _mse(x, mse, "uint8") < 0.85 * _mse(x, mm, "uint8")


def test_activation_params_prefer_the_dtype_threshold():
    stats = TensorStats(min=-4.0, max=8.0, absmax=8.0, threshold=8.0, thresholds={"int8": 2.0, "uint8": 3.0},
                        algorithm="mse")
    assert float(stats.params("int8").scale) == pytest.approx(2.0 / 127)
    assert float(stats.params("uint8").scale) == pytest.approx(6.0 / 255)
    with pytest.raises(ValueError, match="no fp8_e4m3fn range was calibrated"):  # not the int8 clip, silently
        stats.params("fp8_e4m3fn")
    old = dataclasses.replace(stats, thresholds=None)
    assert float(old.params("int8").scale) == pytest.approx(8.0 / 127)


def test_auto_never_picks_a_worse_threshold(caplog):
    batches = _outlier_batches(n=2, outliers=3)
    x = _values(batches)
    with caplog.at_level(logging.INFO, logger="tune.quantize"):
        auto = _collect(batches, "auto", percentile=99.9)
    alone = {alg: _collect(batches, alg, percentile=99.9) for alg in AUTO_CANDIDATES}
    hist, zeros = signed_histogram(x, auto.min, auto.max, 2048)
    assert auto.algorithm == "auto" and set(auto.chosen) == set(QTYPES)
    for dt in QTYPES:
        cands = {alg: (s.thresholds or {}).get(dt, s.threshold) for alg, s in alone.items()}
        chosen = auto.chosen[dt]
        # auto's candidates are the standalone algorithms' thresholds, and it keeps the best of them
        assert auto.thresholds[dt] == cands[chosen]
        scores = {alg: range_mse(hist, auto.min, auto.max, dt, t, zeros)[0] for alg, t in cands.items()}
        assert scores[chosen] <= min(scores.values()), (dt, scores)
        best_alone = min(_mse(x, dataclasses.replace(s, algorithm="auto"), dt) for s in alone.values())
        assert _mse(x, auto, dt) <= best_alone * 1.01
    assert auto.threshold == auto.thresholds["int8"]
    summary = [r.getMessage() for r in caplog.records if r.getMessage().startswith("auto ranges")]
    assert len(summary) == 1 and "int8:" in summary[0] and "uint8:" in summary[0], summary


# --------------------------------------------------------------------------- weights


def _outlier_weights(channels: int = 32, k: int = 2304, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((channels, k)) * 0.1).astype(np.float32)
    w[np.arange(channels), rng.integers(0, k, channels)] = 0.5  # one 5-sigma outlier per channel
    return w


def _weight_error(w: np.ndarray, p) -> np.ndarray:
    """Squared reconstruction error per output channel (axis 0)."""
    z = p.zero_point.reshape(-1, 1) if p.dtype == "uint8" else 0.0
    deq = (quantize_values(w, p) - z) * p.scale.reshape(-1, 1)
    return ((deq - w) ** 2).sum(axis=1)


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_mse_weight_scales_beat_max(dtype):
    w = _outlier_weights()
    mx, mse = weight_params(w, 0, dtype), weight_params(w, 0, dtype, search="mse")
    assert mse.scale.shape == mx.scale.shape and mse.scale.dtype == np.float32
    assert np.all(mse.scale <= mx.scale) and np.all(mse.scale >= 0.48 * mx.scale)
    e_max, e_mse = _weight_error(w, mx), _weight_error(w, mse)
    assert np.all(e_mse <= e_max)  # clip ratio 1.0 is a candidate: never worse per channel
    assert np.mean(e_mse < e_max) > 0.75
    # at 8 bits clipping pays little (a clipped value costs its whole distance squared, the finer
    # step saves step^2 / 12 per value): a few percent here
    assert e_mse.sum() < 0.985 * e_max.sum()
    # the search scores exactly what quantize_values stores
    for c in range(4):
        ratios = np.linspace(0.9, 1.0, 201)
        errs = [_weight_error(w[c:c + 1], QuantParams(dtype, np.atleast_1d(np.float32(mx.scale[c] * r)),
                                                     mx.zero_point[c:c + 1], 0)).sum() for r in ratios]
        assert e_mse[c] <= min(errs) * 1.002
    # per-tensor (axis None) searches one clip
    pt = weight_params(w, None, dtype, search="mse")
    assert pt.scale.shape == () and float(pt.scale) <= float(weight_params(w, None, dtype).scale)


def test_mse_weight_search_leaves_fp8_and_reduced_weights_at_absmax():
    w = _outlier_weights()
    for dt, reduced in (("fp8_e4m3fn", False), ("fp8_e5m2", False), ("int8", True)):
        assert np.array_equal(weight_params(w, 0, dt, reduced, search="mse").scale,
                              weight_params(w, 0, dt, reduced).scale)
    # reduced weights must stay within 7 bits: quantize_values clamps to +-127 only
    q = quantize_values(w, weight_params(w, 0, "int8", True, search="mse"))
    assert np.abs(q).max() <= 64
    with pytest.raises(ValueError, match="weight search"):
        weight_params(w, 0, "int8", search="minmax")


def _cfg(algorithm: str):
    return OmegaConf.create({"quantize": {"algorithm": algorithm, "percentile": 99.99,
                                          "calibration": {"batches": 2}}})


def test_calibration_json_carries_the_mse_weight_clip_into_apply_plan(tmp_path):
    model = models.conv_chain(channels=64)  # w2: 64 channels of 576 weights
    w2 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w2"))
    from pipeline.graph.model import input_specs

    spec = input_specs(model)[0]

    def batches():
        rng = np.random.default_rng(0)
        for _ in range(2):
            yield Batch({spec.name: rng.standard_normal(spec.shape).astype(np.float32)}, None, spec.shape[0])

    cfg = _cfg("mse")
    stats = collect(model, batches, CalibrationMethod("mse", 99.99, 2048), 1, lambda it, d: it)
    doc = calibration_document(stats, model, cfg)
    assert doc["weight_clip"] == "mse"
    want = weight_params(w2, 0, "int8", search="mse").scale
    assert not np.allclose(want, weight_params(w2, 0, "int8").scale)
    assert np.allclose(doc["weights"]["w2"]["int8"]["scale"], want)
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(doc))

    calib = load_calibration(path)
    assert calib.weight_clip == "mse"
    rules = resolve_rules(model, [{"module_name": "*", "weights": {"dtype": "int8"},
                                   "activations": {"dtype": "int8"}}])
    q = apply_plan(model, tensorrt_plan(model, rules), calib)
    inits = {i.name: numpy_helper.to_array(i) for i in q.graph.initializer}
    dq = next(n for n in q.graph.node if n.op_type == "DequantizeLinear" and n.input[0].startswith("w2"))
    assert np.array_equal(inits[dq.input[1]], want)
    # the activation scales are the int8 ones the document records
    act = next(n for n in q.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "r1")
    assert float(inits[act.input[1]]) == pytest.approx(doc["tensors"]["r1"]["int8"]["scale"])

    # statistics used directly (the quantize stage's own Calibration) follow the algorithm too
    assert Calibration(doc["tensors"]).weight_clip == "mse"
    assert Calibration(doc["tensors"]).with_aliases({}).weight_clip == "mse"
    # a document written before weight_clip existed keeps absmax weights
    old = {k: v for k, v in doc.items() if k != "weight_clip"}
    path.write_text(json.dumps(old))
    q_old = apply_plan(model, tensorrt_plan(model, rules), load_calibration(path))
    inits_old = {i.name: numpy_helper.to_array(i) for i in q_old.graph.initializer}
    assert np.array_equal(inits_old[dq.input[1]], weight_params(w2, 0, "int8").scale)


def test_existing_algorithms_record_max_weight_clip():
    model = models.conv_chain()
    for alg in ("minmax", "max", "entropy", "percentile"):
        cfg = _cfg(alg)
        stats = {"input": TensorStats(min=-1.0, max=1.0, absmax=1.0, threshold=1.0, algorithm=alg)}
        doc = calibration_document(stats, model, cfg)
        assert doc["weight_clip"] == "max" and Calibration(doc["tensors"]).weight_clip == "max"
        w1 = numpy_helper.to_array(next(i for i in model.graph.initializer if i.name == "w1"))
        assert doc["weights"]["w1"]["int8"]["scale"] == weight_params(w1, 0, "int8").scale.tolist()


def test_auto_statistics_carry_every_whole_model_candidate():
    """One auto calibration yields what each single algorithm would: with_ranges(stats, method) gives
    the minmax / entropy / mse thresholds those algorithms calibrate on their own."""
    from pipeline.calibrate.collect import with_ranges
    from pipeline.quant.calibration import PER_TENSOR

    batches = _outlier_batches()
    auto = collect(_identity_model(), batches, CalibrationMethod("auto", 99.99, 2048), 1, lambda it, d: it)
    s = auto["y"]
    assert set(s.candidates) == {"minmax", "percentile", "entropy", "mse"}
    assert with_ranges(auto, PER_TENSOR)["y"].thresholds == s.thresholds
    mm, mse, ent = (with_ranges(auto, m)["y"] for m in ("minmax", "mse", "entropy"))
    assert all(mm.thresholds[dt] == pytest.approx(s.absmax) for dt in QTYPES)
    assert mse.thresholds == pytest.approx(_collect(batches, "mse").thresholds)
    assert ent.threshold == pytest.approx(_collect(batches, "entropy").threshold, rel=1e-6)
    assert mm.candidates is None and mm.chosen is None and with_ranges(auto, PER_TENSOR)["y"].chosen is not None


def _kl_threshold_loop(hist: np.ndarray, absmax: float, nq: int = 128) -> float:
    """The entropy search as TensorRT describes it: one candidate at a time, every bin smoothed."""
    def smooth(c):
        zeros = c == 0
        if zeros.all():
            return None
        out = c.astype(np.float64)
        out[zeros] += 1e-4
        out[~zeros] -= 1e-4 * zeros.sum() / (~zeros).sum()
        return out

    nb, hist = hist.size, hist.astype(np.float64)
    best_i, best_kl = nb, np.inf
    for i in range(nq, nb + 1, max(1, nb // 512)):
        ref = hist[:i]
        p = ref.copy()
        p[-1] += hist[i:].sum()
        idx = (np.arange(i) * nq) // i
        nz = ref > 0
        qsum = np.bincount(idx, weights=ref, minlength=nq)
        qcnt = np.bincount(idx, weights=nz.astype(np.float64), minlength=nq)
        p, q = smooth(p), smooth(np.where(nz, qsum[idx] / np.maximum(qcnt[idx], 1.0), 0.0))
        if p is None or q is None:
            continue
        p, q = p / p.sum(), q / q.sum()
        kl = float(np.sum(p * np.log(p / q)))
        if kl < best_kl:
            best_kl, best_i = kl, i
    return float(min((best_i + 0.5) * (absmax / nb), absmax))


@pytest.mark.parametrize("case", ["gaussian", "heavy_tail", "pixels", "spike_with_empty_tail_bin", "few"])
@pytest.mark.parametrize("bins", [300, 2048])
def test_the_entropy_search_picks_the_threshold_of_the_smoothed_one_candidate_loop(case, bins):
    from pipeline.calibrate.search import kl_threshold

    rng = np.random.default_rng(3)
    values = {"gaussian": np.abs(rng.standard_normal(100_000)),
              "heavy_tail": np.concatenate([np.abs(rng.standard_normal(50_000)), rng.uniform(20, 40, 30)]),
              "pixels": rng.integers(0, 256, 5_000) / 255.0,  # values on a lattice: most bins empty
              "spike_with_empty_tail_bin": np.concatenate([np.zeros(10_000) + 0.5, np.abs(rng.standard_normal(200))]),
              "few": np.abs(rng.standard_normal(12))}[case]
    absmax = float(values.max())
    hist = np.bincount(np.minimum((values * bins / absmax).astype(np.int64), bins - 1), minlength=bins)
    assert kl_threshold(hist, absmax) == _kl_threshold_loop(hist, absmax)
    assert kl_threshold(np.zeros(bins, np.int64), 2.0) == 2.0


def test_calibration_searches_ranges_for_the_dtypes_the_run_can_store_only():
    from pipeline.quant.calibration import activation_dtypes
    from tests.helpers import compose

    assert activation_dtypes(compose([])) == ("int8", "uint8")
    assert activation_dtypes(compose(["quantize=fp8"])) == ("int8", "uint8", "fp8_e4m3fn")
    assert activation_dtypes(compose(["autotune.quant_type=fp8"])) == ("int8", "uint8", "fp8_e4m3fn")
    # so asking autotune for fp8 later re-runs quantize, which then searches the fp8 ranges
    from pipeline.app.runner import stage_fingerprint
    from tasks.quantize.stage import QuantizeStage

    fp = [stage_fingerprint(QuantizeStage(), compose(o), {}) for o in ([], ["autotune.quant_type=fp8"])]
    assert fp[0] != fp[1]
    rng = np.random.default_rng(0)

    def batches():
        yield Batch({"input": rng.standard_normal(SHAPE).astype(np.float32)}, None, SHAPE[0])

    stats = collect(_identity_model(), batches, CalibrationMethod("auto", 99.99, 2048, ("int8", "uint8")), 1,
                    lambda it, d: it)["y"]
    assert set(stats.thresholds) == set(stats.chosen) == {"int8", "uint8"}
    with pytest.raises(ValueError, match="int8 among them"):
        CalibrationMethod("auto", 99.99, 2048, ("uint8",))


def test_signed_histogram_leaves_exact_zeros_out_and_counts_them():
    from pipeline.calibrate.collect import signed_histogram

    rng = np.random.default_rng(3)
    x = np.maximum(rng.standard_normal((4, 64)).astype(np.float32), 0)  # a ReLU output: half exact zeros
    x[0, :3] = -0.0
    x[1, 0] = -1.5
    lo, hi = float(x.min()), float(x.max())
    counts, zeros = signed_histogram(x, lo, hi, 128)
    nz = x[x != 0]
    want = np.bincount(np.clip(((nz - lo) * (128 / (hi - lo))).astype(np.int64), 0, 127), minlength=128)
    assert zeros == x.size - nz.size and (counts == want).all() and counts.sum() == nz.size


def test_a_second_placement_stores_the_weights_the_first_quantized_and_the_cache_holds_its_bound(monkeypatch):
    import pipeline.quant.calibration as calibration_module
    from pipeline.quant.calibration import Calibration
    from pipeline.quant.qmath import quantized_values

    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 576)).astype(np.float32)
    calib = Calibration({}, weight_clip="mse")
    p, q = calib.quantized_weight("w", w, 0, "int8")
    assert q.dtype == np.int8 and np.array_equal(q, quantized_values(w, p))
    again = Calibration({}, weight_clip="mse")
    again.weight_cache = calib.weight_cache
    assert again.quantized_weight("w", w, 0, "int8")[1] is q  # the other candidate's placement reuses it
    changed = w.copy()
    changed[0, 0] += 1.0  # other values under the same name (a transform rewrote them): searched again
    assert not np.array_equal(again.quantized_weight("w", changed, 0, "int8")[1], q)
    monkeypatch.setattr(calibration_module, "QUANTIZED_CACHE_BYTES", w.size + w.size // 2)
    small = Calibration({}, weight_clip="mse")
    for k in range(3):
        small.quantized_weight(f"w{k}", w, 0, "int8")
    assert small.weight_cache.held == w.size and len(small.weight_cache.values) == 1
    assert len(small.weight_cache.params) == 3


def test_the_threshold_searches_in_worker_processes_find_what_one_process_finds(monkeypatch):
    """auto's per-tensor searches in a pool of two processes (a large model's hundreds of tensors; here every
    tensor of a small one): the same statistics as in this process."""
    from pipeline.calibrate import workers
    from pipeline.data.adapters import synthetic_batches
    from pipeline.graph.model import input_specs

    model = models.transformer_layer()
    feeds = [f for f, _ in synthetic_batches(input_specs(model), 3, 0)]

    def stats(threads):
        return collect(model, lambda: iter([Batch(f, None, 1) for f in feeds]), CalibrationMethod("auto", 99.99, 2048),
                       threads, lambda it, d: it)

    alone = stats(1)
    started = []
    popen = workers.subprocess.Popen
    monkeypatch.setattr(workers, "PARALLEL_FROM", 2)
    monkeypatch.setattr(workers.subprocess, "Popen", lambda *a, **k: started.append(a) or popen(*a, **k))
    pooled = stats(2)
    assert len(started) == 2 and len(alone) >= 2  # the searches ran in two workers
    assert pooled.keys() == alone.keys() and all(pooled[t] == alone[t] for t in alone)


def test_a_search_that_fails_in_a_worker_raises_as_it_would_here():
    from pipeline.calibrate.workers import PARALLEL_FROM, map_in_workers

    with pytest.raises(ZeroDivisionError):
        map_in_workers(divmod, list(range(PARALLEL_FROM)), 0, workers=2)
    assert map_in_workers(divmod, list(range(PARALLEL_FROM)), 7, workers=2) == [divmod(i, 7) for i in range(PARALLEL_FROM)]


def test_a_weight_another_thread_is_searching_is_waited_for_and_one_that_failed_is_searched_again():
    import threading

    from pipeline.quant.calibration import WeightCache

    cache, started, release, calls = WeightCache(), threading.Event(), threading.Event(), []
    p = QuantParams.scalar("int8", 0.5, 0.0)

    def slow():
        calls.append("slow")
        started.set()
        release.wait(5)
        return p

    t = threading.Thread(target=cache.searched, args=(("w",), slow))
    t.start()
    started.wait(5)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(cache.searched(("w",), lambda: calls.append("again"))))
    waiter.start()
    release.set()
    t.join(5)
    waiter.join(5)
    assert got == [p] and calls == ["slow"]  # searched once

    def failing():
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError):
        cache.searched(("v",), failing)
    assert cache.searched(("v",), lambda: p) is p  # nothing left claimed by the failed search


def test_the_weights_searched_ahead_are_those_the_first_placement_stores(monkeypatch):
    """search_weights_ahead fills the run's weight cache with what apply_plan then takes: the placed model
    is the same bit for bit, and apply_plan searches nothing more."""
    import threading

    from pipeline.quant import qmath
    from pipeline.quant.qdq import search_weights_ahead

    model = models.conv_chain()
    stats = collect(model, lambda: iter([Batch({"input": np.random.default_rng(0).standard_normal(
        (2, 3, 16, 16)).astype(np.float32)}, None, 2)]), CalibrationMethod("minmax", 99.99, 2048), 1,
        lambda it, desc: it)
    rules = resolve_rules(model, [{"module_name": "*", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}}])
    plan = tensorrt_plan(model, rules, "int8")
    ahead = Calibration(stats, weight_clip="mse")
    search_weights_ahead(model, plan, ahead, threading.Event())
    assert len(ahead.weight_cache.params) == len(plan.weights) > 0
    import pipeline.quant.calibration as calibration_module

    searched = []
    monkeypatch.setattr(calibration_module, "weight_params", lambda *a, **k: searched.append(a) or qmath.weight_params(*a, **k))
    placed = apply_plan(model, plan, ahead)
    assert searched == []
    fresh = apply_plan(model, plan, Calibration(stats, weight_clip="mse"))
    assert placed.SerializeToString() == fresh.SerializeToString()
    stopped = Calibration(stats, weight_clip="mse")
    stop = threading.Event()
    stop.set()
    search_weights_ahead(model, plan, stopped, stop)
    assert stopped.weight_cache.params == {}  # stopped before the first weight
