"""Subgraph-mode parts on real ORT sessions: extraction, heuristic schemes, reuse keys, per-node
profiles and their edge overhead, the interleaved profiled comparison, trtexec shape flags."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pipeline.backends import create_backend
from pipeline.backends.base import fixed_feeds
from pipeline.backends.onnxruntime import edge_nodes, parse_ort_profile
from pipeline.backends.trtexec import TrtexecBackend, parse_shape_spec
from pipeline.errors import InputError, StateError
from pipeline.graph import input_specs
from pipeline.qdq import Calibration
from tasks.autotune.autotuner import Config, QDQAutotunerBase
from tasks.autotune.benchmark import compare_profiled
from tasks.autotune.fusion_grouping import ort_fusion_groups, ort_optimized_graph
from tasks.autotune.region import Region, RegionType
from tasks.autotune.subgraph_extractor import extract_subgraph, reuse_key, tensor_infos
from tasks.autotune.subgraph_workflow import SubgraphCache, _ranked, heuristic_schemes
from tests import models
from tests.conftest import compose


def _tuner(model: onnx.ModelProto) -> QDQAutotunerBase:
    t = QDQAutotunerBase(model)
    t.regions = []
    for g in ort_fusion_groups(model):
        ins, outs = t.index.boundaries(g.region.nodes)
        t.regions.append(Region(len(t.regions), RegionType.LEAF, 1, nodes=list(g.region.nodes), inputs=ins,
                                outputs=outs))
    t.initialize(Config(placement="onnxruntime", activation_type="uint8"), None, Calibration(default_scale=0.05))
    return t


def _all_tensors(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for n in probe.graph.node:
        for o in n.output:
            probe.graph.output.append(onnx.ValueInfoProto(name=o))
    sess = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def test_extracted_subgraphs_compute_what_the_full_model_computes():
    model = models.residual_block(blocks=2)
    feeds = fixed_feeds(input_specs(model))
    values = {**_all_tensors(model, feeds), **feeds}
    t = _tuner(model)
    infos = tensor_infos(model, sorted({x for r in t.regions for x in (*r.inputs, *r.outputs)}))
    for r in t.regions:
        sub, region = extract_subgraph(t.index, r.nodes, infos, "g")
        onnx.checker.check_model(sub)
        sess = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
        outs = sess.run(region.outputs, {i.name: values[i.name] for i in sub.graph.input})
        for name, got in zip(region.outputs, outs, strict=True):
            np.testing.assert_allclose(got, values[name], rtol=1e-5, atol=1e-5)
        # same structure, same canonical order: the group's points mean the same on its subgraph
        sub_t = QDQAutotunerBase(sub)
        sub_t.regions = [region]
        sub_t.initialize(t.config, None, t.calibration)
        assert sub_t.patterns[0].signature == t.patterns[r.id].signature


def test_reuse_key_shares_identical_blocks_and_splits_other_shapes():
    model = models.residual_block(blocks=3)
    t = _tuner(model)
    infos = tensor_infos(model, sorted({x for r in t.regions for x in (*r.inputs, *r.outputs)}))
    keys = {}
    for r in t.regions:
        keys.setdefault(reuse_key(t.patterns[r.id].signature, model, t.orders[r.id], infos, r.inputs), []).append(r.id)
    names = [n.name for n in model.graph.node]
    conv1 = [k for k, ids in keys.items() if any(names[t.orders[i][0]] == "block0/conv1" for i in ids)]
    assert len(conv1) == 1 and len(keys[conv1[0]]) == 3  # block0..2 conv1 groups: one key
    # a different width is a different key even though the structure is the same
    wide = models.residual_block(blocks=1, channels=16)
    tw = _tuner(wide)
    iw = tensor_infos(wide, sorted({x for r in tw.regions for x in (*r.inputs, *r.outputs)}))
    wide_keys = {reuse_key(tw.patterns[r.id].signature, wide, tw.orders[r.id], iw, r.inputs) for r in tw.regions}
    assert not wide_keys & set(keys)


def test_heuristic_schemes_of_a_conv_relu_group():
    model = models.conv_chain()
    t = _tuner(model)
    names = [n.name for n in model.graph.node]
    conv2 = next(r for r in t.regions if names[t.orders[r.id][0]] == "conv2")
    s = {k: v.key for k, v in heuristic_schemes(t, conv2).items()}
    assert s["none"] == "none"
    assert s["preferred"] == "ni:0:0;no:0:0"  # DQ -> Conv(+Relu) -> Q
    assert s["weights_only"] == "w:0:0"
    assert "ai:0:0" in s["activations_only"] and "ni:0:0" in s["full"]
    plans = {k: t.build_plan({conv2.id: v}) for k, v in heuristic_schemes(t, conv2).items()}
    assert [w.node for w in plans["weights_only"].weights] == ["conv2"] and not plans["weights_only"].activations
    assert not plans["activations_only"].weights and plans["activations_only"].activations
    assert plans["preferred"].weights and plans["preferred"].activations


def test_ranking_prefers_the_runtimes_form_within_noise():
    rec = {"metric": "compute", "schemes": {
        "none": {"ok": True, "compute_ratio": 1.0}, "preferred": {"ok": True, "compute_ratio": 0.305},
        "activations_only": {"ok": True, "compute_ratio": 0.300}, "full": {"ok": True, "compute_ratio": 0.5},
        "weights_only": {"ok": True, "compute_ratio": 0.99}}}
    assert _ranked(rec) == ["preferred", "activations_only", "full"]  # weights_only: not 3% better than none
    rec["metric"] = "total"  # no per-layer times: total latency decides
    for t in rec["schemes"].values():
        t["total_ratio"] = t["compute_ratio"]
    assert _ranked(rec)[0] == "preferred"


def test_parse_ort_profile_splits_runs_and_node_times():
    events = [
        {"cat": "Session", "name": "session_initialization", "ts": 0, "dur": 100},
        {"cat": "Node", "name": "conv_kernel_time", "ts": 120, "dur": 30, "args": {"op_name": "Conv"}},
        {"cat": "Node", "name": "relu_kernel_time", "ts": 151, "dur": 5},
        {"cat": "Node", "name": "relu_fence_before", "ts": 150, "dur": 0},
        {"cat": "Session", "name": "model_run", "ts": 110, "dur": 60},
        {"cat": "Node", "name": "conv_kernel_time", "ts": 210, "dur": 20},
        {"cat": "Session", "name": "model_run", "ts": 200, "dur": 40},
    ]
    assert parse_ort_profile(events) == [{"conv": 0.03, "relu": 0.005}, {"conv": 0.02}]


def test_edge_overhead_is_the_input_q_and_output_dq_and_layout_ops():
    """On ORT's optimized graph of a QDQ conv: the input's Q, NHWC transposes and the output's DQ are
    edge overhead; the QLinearConv is compute."""
    model = models.conv_chain()
    t = _tuner(model)
    names = [n.name for n in model.graph.node]
    conv2 = next(r for r in t.regions if names[t.orders[r.id][0]] == "conv2")
    infos = tensor_infos(model, [*conv2.inputs, *conv2.outputs])
    sub, region = extract_subgraph(t.index, conv2.nodes, infos, "g")
    st = QDQAutotunerBase(sub)
    st.regions = [region]
    st.initialize(t.config, None, t.calibration)
    q = st.export_model(assignment={0: heuristic_schemes(st, region)["preferred"]})
    opt = ort_optimized_graph(q, "all")
    edge = edge_nodes(opt.graph)
    ops = {n.name: n.op_type for n in opt.graph.node}
    assert "QLinearConv" in ops.values()
    assert {ops[n] for n in edge} <= {"QuantizeLinear", "DequantizeLinear", "Transpose", "ReorderInput",
                                     "ReorderOutput"}
    assert all(op != "QLinearConv" for n, op in ops.items() if n in edge)
    assert any(ops[n] == "QuantizeLinear" for n in edge) and any(ops[n] == "DequantizeLinear" for n in edge)
    # a float consumer's DQ right after the input's Q is real work, not edge overhead
    fq = st.export_model(assignment={0: heuristic_schemes(st, region)["weights_only"]})
    fopt = ort_optimized_graph(fq, "all")
    assert not any(n.op_type == "DequantizeLinear" and n.name in edge_nodes(fopt.graph) and
                   n.input[0] not in {i.name for i in fopt.graph.initializer} for n in fopt.graph.node
                   if n.output[0] not in {o.name for o in fopt.graph.output})


def test_compare_profiled_gives_compute_and_total_ratios(tmp_path):
    a = models.save(models.conv_chain(channels=16), tmp_path, "a")
    b = models.save(models.conv_chain(channels=32), tmp_path, "b")
    backend = create_backend(compose(["backend.intra_op_threads=1"]).backend)
    ta, tb, tm = compare_profiled(backend, [a, b, tmp_path / "missing.onnx"], rounds=3, runs_per_round=3,
                                  warmup_runs=1)
    assert not tm.ok and tm.error
    assert ta.ok and ta.total_ratio == 1.0 and ta.compute_ratio == 1.0 and ta.compute_ms > 0
    assert tb.ok and tb.compute_ms is not None and tb.compute_ratio > 1.0  # twice the channels: more compute
    assert ta.compute_ms <= ta.total_ms


def test_compare_profiled_reports_a_model_the_runtime_rejects(tmp_path):
    a = models.save(models.conv_chain(), tmp_path, "a")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not onnx")
    backend = create_backend(compose([]).backend)
    ta, tb = compare_profiled(backend, [a, bad], rounds=2, runs_per_round=2, warmup_runs=1)
    assert ta.ok and not tb.ok and tb.error


def test_cache_refuses_other_models_settings_and_garbage(tmp_path):
    path = tmp_path / "autotune_cache.json"
    c = SubgraphCache(path, "abc", "ctx")
    c.groups["k"] = {"winner": "none"}
    c.save()
    again = SubgraphCache(path, "abc", "ctx")
    assert again.load() and again.groups == {"k": {"winner": "none"}} and again.doc["measurements"] == 1
    with pytest.raises(StateError, match="different model"):
        SubgraphCache(path, "xyz", "ctx").load()
    with pytest.raises(StateError, match="other inputs or settings"):
        SubgraphCache(path, "abc", "other").load()
    path.write_text(json.dumps({"groups": []}))
    with pytest.raises(StateError, match="corrupt"):
        SubgraphCache(path, "abc", "ctx").load()
    assert not SubgraphCache(tmp_path / "none.json", "abc", "ctx").load()


def test_trtexec_shape_flags_give_opt_shapes_and_are_dropped_for_subgraphs():
    assert parse_shape_spec("input:8x3x224x224,'mask':8x128") == {"input": [8, 3, 224, 224], "mask": [8, 128]}
    with pytest.raises(InputError, match="not NAME"):
        parse_shape_spec("8x3")
    cfg = compose(["backend=trtexec", "backend.trtexec_args=['--optShapes=input:8x3x32x32',"
                   "'--minShapes=input:1x3x32x32','--noDataTransfers']"])
    b = TrtexecBackend(cfg.backend)  # no trtexec needed to read its settings
    assert b.opt_shapes() == {"input": [8, 3, 32, 32]}
    sub = b.for_subgraphs()
    assert sub is not b and sub.run_args() == ["--noDataTransfers"]
    plain = TrtexecBackend(compose(["backend=trtexec"]).backend)
    assert plain.for_subgraphs() is plain
