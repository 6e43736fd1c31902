"""The autotuner's ask/tell loop, schemes, state, pattern cache and the exactness of its export."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from pipeline.calibrate.collect import CalibrationMethod, collect
from pipeline.data.adapters import Batch
from pipeline.errors import StateError
from pipeline.quant.calibration import Calibration
from pipeline.quant.placement import onnxruntime_plan, openvino_plan, resolve_rules, tensorrt_plan
from pipeline.quant.qdq import apply_plan, get_quantized_tensors
from tasks.autotune.region.autotuner import Config, QDQAutotuner
from tasks.autotune.region.insertion_points import InsertionPoint
from tasks.autotune.region.pattern import RegionPattern
from tasks.autotune.region.pattern_cache import PatternCache
from tasks.autotune.region.scheme import InsertionScheme, Measurement
from tests import models

INT8 = [{"module_name": "*", "weights": {"dtype": "int8"}, "activations": {"dtype": "int8"}}]


def _calibration(model):
    rng = np.random.default_rng(0)
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]

    def batches():
        for _ in range(3):
            yield Batch({"input": rng.standard_normal(shape).astype(np.float32)}, None, shape[0])

    return Calibration(collect(model, batches, CalibrationMethod("minmax", 99.9, 2048), 1, lambda it, d: it))


def _tuner(model, placement="onnxruntime", **kw) -> QDQAutotuner:
    t = QDQAutotuner(model)
    cfg = Config(placement=placement, activation_type="int8" if placement == "tensorrt" else "uint8", **kw)
    t.initialize(cfg, calibration=_calibration(model))
    return t


def _drive(t: QDQAutotuner, latency) -> int:
    """Run the loop with a fake latency function of the exported model; returns measurements."""
    n = 0
    for region in t.regions:
        t.set_profile_region(region, commit=True)
        if t.current_profile_pattern_schemes is None:
            continue
        while t.generate() != -1:
            data = t.export_onnx(None)
            assert isinstance(data, bytes)
            t.submit(Measurement(latency(onnx.load_from_string(data)), latency(onnx.load_from_string(data)) / 10, 10))
            n += 1
    t.set_profile_region(None, commit=True)
    return n


def _num_q(model: onnx.ModelProto) -> float:
    return float(sum(n.op_type == "QuantizeLinear" for n in model.graph.node))


def test_patterns_are_shared_by_identical_blocks():
    model = models.residual_block(blocks=3)
    t = _tuner(model)
    sigs = [t.patterns[r.id].signature for r in t.regions]
    assert len(set(sigs)) < len(sigs)
    assert t.num_patterns == len(set(sigs) & set(t.pattern_schemes))
    again = _tuner(model)
    assert [again.patterns[r.id].signature for r in again.regions] == sigs  # deterministic


def test_generate_is_unique_bounded_and_exhausts():
    model = models.residual_block(blocks=2)
    t = _tuner(model, schemes_per_region=5)
    region = t.regions[0]
    t.set_profile_region(region, commit=False)
    ps = t.current_profile_pattern_schemes
    seen = set()
    while t.generate() != -1:
        seen.add(t.pending_scheme.scheme)
        t.submit(Measurement(1.0, 1.0, 1.0))
    assert len(seen) == len(ps.records) <= 5
    assert ps.records[0].origin.startswith("seed:")


def test_search_minimises_and_final_export_is_exactly_the_best_placement():
    model = models.residual_block(blocks=2)
    t = _tuner(model, schemes_per_region=8)
    _drive(t, _num_q)  # fake cost: fewer Q nodes is faster
    final = t.export_model()
    # every committed pattern is the best-measured scheme
    for ps in t.pattern_schemes.values():
        best = min((r for r in ps.records if r.ok), key=lambda r: r.ratio)
        assert ps.best == best.scheme
    # the exported placement is exactly what the committed schemes resolve to (nothing lost or added)
    expected = t.build_plan(t.assignment())
    assert get_quantized_tensors(final) == {a.tensor for a in expected.activations}
    # and the scales are the calibrated ones
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in final.graph.initializer}
    for q in (n for n in final.graph.node if n.op_type == "QuantizeLinear"):
        tensor = q.input[0][: -len("_prequant")] if q.input[0].endswith("_prequant") else q.input[0]
        dtype = "uint8" if inits[q.input[2]].dtype == np.uint8 else "int8"
        want = t.calibration.tensors[tensor].params(dtype)
        assert float(inits[q.input[1]]) == pytest.approx(float(want.scale))
        assert float(inits[q.input[2]]) == float(want.zero_point)


@pytest.mark.parametrize("placement", ["onnxruntime", "tensorrt", "openvino"])
def test_qdq_baseline_import_reproduces_the_ptq_placement(placement):
    # openvino: the classifier head's Gemm reads the pooled u8 through Flatten, its weights quantized
    model = {"onnxruntime": models.attention_block, "tensorrt": lambda: models.residual_block(channels=16),
             "openvino": lambda: models.conv_chain(channels=16, classes=16)}[placement]()
    rules = resolve_rules(model, INT8)
    t = _tuner(model, placement)
    plan = {"onnxruntime": lambda: onnxruntime_plan(model, rules, "uint8"), "tensorrt": lambda: tensorrt_plan(model, rules),
            "openvino": lambda: openvino_plan(model, rules, "uint8")}[placement]()
    ptq = apply_plan(model, plan, t.calibration)
    t.import_qdq_baseline(ptq)
    asg = {r.id: t.pattern_schemes[t.patterns[r.id].signature].baseline_scheme for r in t.regions
           if t.patterns[r.id].signature in t.pattern_schemes}
    mine = t.export_model(assignment=asg)

    def readers(m):
        inits = {i.name for i in m.graph.initializer}
        dq = {n.output[0] for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] not in inits}
        return {(n.name, k) for n in m.graph.node for k, x in enumerate(n.input) if x in dq}

    def weights(m):
        inits = {i.name for i in m.graph.initializer}
        return {n.input[0] for n in m.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits}

    assert get_quantized_tensors(mine) == get_quantized_tensors(ptq)
    assert readers(mine) == readers(ptq)
    assert weights(mine) == weights(ptq)


def test_state_roundtrip_and_errors(tmp_path):
    model = models.residual_block(blocks=2)
    t = _tuner(model, schemes_per_region=4)
    _drive(t, _num_q)
    path = tmp_path / "autotuner_state.yaml"
    t.save_state(path)
    assert (tmp_path / "autotuner_state_pattern_cache.yaml").exists()
    u = _tuner(model, schemes_per_region=4)
    u.load_state(path)
    assert u.num_measurements == t.num_measurements
    assert all(ps.done for ps in u.pattern_schemes.values())
    for region in u.regions:  # nothing left to generate
        u.set_profile_region(region, commit=False)
        assert u.current_profile_pattern_schemes is None
    other = _tuner(models.residual_block(blocks=2, seed=5))
    with pytest.raises(StateError, match="different model"):
        other.load_state(path)
    path.write_text("patterns: [unclosed")
    with pytest.raises(StateError, match="corrupt"):
        u.load_state(path)


def test_pattern_cache_distance_cap_and_roundtrip(tmp_path):
    cache = PatternCache(minimum_distance=2, max_entries_per_pattern=2)
    a = InsertionScheme(frozenset({InsertionPoint("node_input", 0, 0), InsertionPoint("node_output", 0)}))
    b = InsertionScheme(frozenset({InsertionPoint("node_input", 0, 0)}))  # distance 1 from a
    c = InsertionScheme(frozenset(InsertionPoint("node_input", k, 0) for k in (1, 2, 3)))  # distance 4 from b
    assert cache.add("p", a, 0.9)
    assert not cache.add("p", b, 0.95)  # near-duplicate, slower: dropped
    assert cache.add("p", b, 0.8)  # near-duplicate, faster: replaces a
    assert cache.add("p", c, 0.7) and [e.scheme for e in cache.entries["p"]] == [c, b]
    cache.save(tmp_path / "c.yaml")
    loaded = PatternCache.load(tmp_path / "c.yaml")
    assert loaded.num_patterns == 1 and loaded.schemes_for("p") == [c, b]
    for bad in ("patterns: {p: [{schemex: 1}]}", "- not a table", "patterns: [unclosed"):
        (tmp_path / "bad.yaml").write_text(bad)
        with pytest.raises(StateError, match=r"pattern cache .*bad.yaml is corrupt \(.*\); delete it or point"):
            PatternCache.load(tmp_path / "bad.yaml")
    (tmp_path / "v9.yaml").write_text("version: 9\npatterns: {}\n")
    with pytest.raises(StateError, match=r"v9.yaml has format version 9, this qdq-tune reads version 1; delete it"):
        PatternCache.load(tmp_path / "v9.yaml")


def test_pattern_cache_warm_start_seeds_first():
    model = models.residual_block(blocks=2)
    t = _tuner(model, schemes_per_region=6)
    _drive(t, _num_q)
    u = QDQAutotuner(model)
    u.initialize(Config(placement="onnxruntime", activation_type="uint8", schemes_per_region=6), t.pattern_cache,
                 t.calibration)
    region = next(r for r in u.regions if u.patterns[r.id].signature in u.pattern_schemes)
    u.set_profile_region(region, commit=False)
    u.generate()
    assert u.pending_scheme.origin == "seed:cache"


def test_pattern_signature_ignores_names_but_not_structure():
    a, b = models.conv_chain(seed=0), models.conv_chain(seed=1)
    for n in b.graph.node:
        n.name = "renamed_" + n.name
    ta, tb = _tuner(a), _tuner(b)
    sig = [ta.patterns[r.id].signature for r in ta.regions]
    assert sig == [tb.patterns[r.id].signature for r in tb.regions]
    assert isinstance(RegionPattern.from_region(ta.regions[0], a).signature, str)


def test_node_filter_list_skips_regions_without_matching_nodes():
    model = models.residual_block(blocks=2)
    t = _tuner(model, node_filter_list=["block1/*"])
    profiled = []
    for region in t.regions:
        t.set_profile_region(region, commit=False)
        names = {model.graph.node[i].name for i in region.all_nodes()}
        if t.current_profile_pattern_schemes is not None:
            profiled.append(region)
            assert any(n.startswith("block1/") for n in names) or t.patterns[region.id].signature in {
                t.patterns[r.id].signature for r in t.regions if r.id not in t.skipped_regions}
        else:
            assert not any(n.startswith("block1/") for n in names)
    assert profiled and len(t.skipped_regions) >= 1


def test_state_from_another_context_is_refused_and_resume_keeps_the_cache(tmp_path):
    model = models.residual_block(blocks=2)
    t = _tuner(model, schemes_per_region=3)
    t.context = "calibration-a"
    _drive(t, _num_q)
    path = tmp_path / "autotuner_state.yaml"
    t.save_state(path)
    u = _tuner(model, schemes_per_region=3)
    u.context = "calibration-b"
    with pytest.raises(StateError, match="other inputs or settings"):
        u.load_state(path)
    v = _tuner(model, schemes_per_region=3)
    v.context = "calibration-a"
    v.load_state(path)
    assert v.pattern_cache.num_patterns == t.pattern_cache.num_patterns > 0


@pytest.mark.parametrize("weight_range,dtype,limit", [("reduced", onnx.TensorProto.INT8, 64),
                                                     ("uint8", onnx.TensorProto.UINT8, 255)])
def test_candidates_follow_quantize_weight_storage_and_float_nodes(weight_range, dtype, limit):
    from onnx import numpy_helper

    model = models.conv_chain()
    t = _tuner(model, weight_range=weight_range, float_nodes=["conv2"])
    all_points = {sig: InsertionScheme(frozenset(ps.candidates)) for sig, ps in t.pattern_schemes.items()}
    exported = t.export_model(assignment={r.id: all_points[t.patterns[r.id].signature] for r in t.regions})
    weights = [i for i in exported.graph.initializer if i.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
               and len(i.dims) > 1]
    assert weights and all(w.data_type == dtype for w in weights)
    assert max(int(np.abs(numpy_helper.to_array(w).astype(int)).max()) for w in weights) <= limit
    conv2 = next(n for n in exported.graph.node if n.name == "conv2")
    dq = {n.output[0] for n in exported.graph.node if n.op_type == "DequantizeLinear"}
    assert conv2.input[1] not in dq  # a float node keeps its float weight even when every point is on
    import onnxruntime as ort

    ort.InferenceSession(exported.SerializeToString(), providers=["CPUExecutionProvider"])  # it loads


@pytest.mark.parametrize("placement", ["onnxruntime", "openvino"])
def test_no_candidate_point_on_data_that_only_reaches_graph_outputs(placement):
    # silero-vad's LSTM state: Unsqueeze -> Concat -> Identity -> graph output. Q/DQ there cannot feed
    # an int8 kernel, and two such pairs on the Identity chain crashed OpenVINO's compiler
    from onnx import TensorProto, helper

    from pipeline.graph.index import GraphIndex
    from tasks.autotune.region.insertion_points import candidate_points

    rng = np.random.default_rng(0)
    w = [onnx.numpy_helper.from_array(rng.standard_normal((16, 16)).astype(np.float32), n) for n in ("w1", "w2")]
    axes = onnx.numpy_helper.from_array(np.array([0], np.int64), "axes")
    shape = onnx.numpy_helper.from_array(np.array([2, 16], np.int64), "shape")
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
             helper.make_node("Relu", ["h"], ["a"], name="relu"),
             helper.make_node("Unsqueeze", ["a", "axes"], ["u1"], name="unsq1"),
             helper.make_node("Unsqueeze", ["h", "axes"], ["u2"], name="unsq2"),
             helper.make_node("Concat", ["u1", "u2"], ["c"], name="concat", axis=0),
             helper.make_node("Identity", ["c"], ["state"], name="id"),
             helper.make_node("Reshape", ["a", "shape"], ["r"], name="reshape"),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [2, 16])],
                              [helper.make_tensor_value_info("y", f, [2, 16]),
                               helper.make_tensor_value_info("state", f, [2, 2, 16])], [*w, axes, shape])
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    g = GraphIndex(model)
    order = list(range(len(model.graph.node)))
    points = candidate_points(order, model, g, placement, {n.name for n in model.graph.node}, "int8")
    on = {model.graph.node[p.index].name for p in points}
    assert not on & {"unsq1", "unsq2", "concat", "id"}
    assert {"mm1", "mm2", "reshape"} <= on  # the reshape feeds a MatMul: its int8 copy is read by mm2


def test_a_tuned_model_without_qdq_is_the_float_model_and_claims_no_speedup(tmp_path):
    """AVX2 without VNNI, the default digits model: every pattern measured fastest without Q/DQ, so the
    "tuned" model is the float graph (timed 1.04x against itself: noise) and the PTQ model is slower:
    the float model ships, named as such. A PTQ model that beats float still ships over such a copy."""
    from types import SimpleNamespace

    from pipeline.accuracy.budget import AccuracyBudget, AccuracyVerdict
    from pipeline.backends import Timing
    from tasks.autotune.guard import choose_shipped
    from tests.helpers import qdq_conv_chain

    flt, copy, ptq = (tmp_path / f"{n}.onnx" for n in ("float", "tuned", "ptq"))
    for p in (flt, copy):
        onnx.save(models.conv_chain(), str(p))
    onnx.save(qdq_conv_chain(), str(ptq))
    backend = SimpleNamespace(name="onnxruntime", float_precision=lambda: "FP32")
    setup = SimpleNamespace(budget=AccuracyBudget(), performance_threshold=1.02, backend=backend)
    ok = AccuracyVerdict(True, "snr", "SNR 40 dB")

    def ms(*p10):
        return [Timing(median_ms=t, p10_ms=t, n=8) for t in p10]

    choice, why = choose_shipped(setup, [flt, copy, ptq], ms(5.0, 4.8, 5.55), [ok, ok, ok])
    assert choice == flt and why.startswith("no int8 placement beat the FP32 float on onnxruntime")
    choice, why = choose_shipped(setup, [flt, copy, ptq], ms(5.0, 4.8, 4.0), [ok, ok, ok])
    assert choice == ptq and "no int8 placement beat" in why
