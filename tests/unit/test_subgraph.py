"""Subgraph-mode parts on real ORT sessions: extraction, heuristic schemes, reuse keys, per-node
profiles and their edge overhead, the interleaved profiled comparison, trtexec shape flags."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from pipeline.backends import create_backend
from pipeline.backends.onnxruntime.backend import edge_nodes, parse_ort_profile
from pipeline.backends.onnxruntime.backend import optimized_graph as ort_optimized_graph
from pipeline.backends.tensorrt.trtexec import TrtexecBackend, parse_shape_spec
from pipeline.data.adapters import fixed_feeds
from pipeline.errors import InputError, StateError
from pipeline.graph.model import input_specs
from pipeline.quant.calibration import Calibration
from tasks.autotune.benchmark import compare_profiled
from tasks.autotune.region.autotuner import Config, QDQAutotunerBase
from tasks.autotune.region.region import Region, RegionType
from tasks.autotune.subgraph.extractor import extract_subgraph, reuse_key, tensor_infos
from tasks.autotune.subgraph.profiling import heuristic_schemes, ranked_schemes
from tasks.autotune.subgraph.records import SubgraphCache
from tests import models
from tests.helpers import compose, ort_fusion_groups


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
    assert len(t.regions) >= 2, "the residual block must give groups to extract"
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
    assert ranked_schemes(rec) == ["preferred", "activations_only", "full"]  # weights_only: not 3% better than none
    rec["metric"] = "total"  # no per-layer times: total latency decides
    for t in rec["schemes"].values():
        t["total_ratio"] = t["compute_ratio"]
    assert ranked_schemes(rec)[0] == "preferred"


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
    backend = create_backend(compose(["backend=onnxruntime", "backend.intra_op_threads=1"]).backend)
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
    backend = create_backend(compose(["backend=onnxruntime"]).backend)
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


# --------------------------------------------------------------------------- phase 3: sequential steps, group testing


def test_sequential_stop_rule_ends_only_when_the_interval_clears_the_threshold():
    from pipeline.backends.ratios import chain_interval, ratio_interval, sequential_verdict

    assert sequential_verdict([0.80, 0.81], 0.99) is None  # fewer than MIN_ROUNDS rounds: never decided
    assert sequential_verdict([0.80, 0.81, 0.79], 0.99) == "below"  # clearly faster
    assert sequential_verdict([1.20, 1.22, 1.19], 0.99) == "above"  # clearly not
    assert sequential_verdict([0.95, 1.04, 0.99, 1.01], 0.99) is None  # straddles: measure on
    low, high = ratio_interval([0.95, 1.04, 0.99, 1.01])
    assert low < 0.99 < high and ratio_interval([0.9]) == (0.0, float("inf"))
    # a chain of paired steps: the ratios multiply, the interval widens
    a, b = [0.80, 0.82, 0.81], [0.90, 0.91, 0.89]
    lo, hi = chain_interval([a, b])
    assert lo < 0.81 * 0.90 < hi and hi - lo > ratio_interval(a)[1] - ratio_interval(a)[0]
    assert chain_interval([]) == (1.0, 1.0)


class _FakePrepared:
    """Times ``ms`` x the next factor of ``pattern`` per call (one call: one block of runs)."""

    def __init__(self, ms: float, pattern: tuple[float, ...]):
        self.ms, self.pattern, self.calls = ms, pattern, 0

    def time_runs(self, n: int) -> list[float]:
        self.calls += 1
        return [self.ms * self.pattern[self.calls % len(self.pattern)]] * n

    def close(self) -> None:
        pass


class _FakeBackend:
    """Model files hold their latency in ms as text; candidates (not ``ref.onnx``) swing by ``pattern``."""

    name = "fake"

    def __init__(self, pattern: tuple[float, ...] = (1.0, 1.01, 0.99)):
        self.pattern = pattern

    def prepare(self, path, profile=False):
        return _FakePrepared(float(open(path).read()), (1.0,) if str(path).endswith("ref.onnx") else self.pattern)


def test_paired_measurement_with_a_threshold_stops_early_when_clear(tmp_path):
    from pipeline.backends.ratios import MIN_ROUNDS
    from tasks.autotune.benchmark import PairedBenchmark

    ref = tmp_path / "ref.onnx"
    ref.write_text("10.0")
    bench = PairedBenchmark(_FakeBackend(), ref, warmup_runs=1, timing_runs=40, rounds=4)
    fast = bench.measure(b"7.0", use_cache=False, stop_at=0.99)
    assert fast.decided == "below" and len(fast.round_ratios) == MIN_ROUNDS and fast.ratio < 0.75
    slow = bench.measure(b"13.0", use_cache=False, stop_at=0.99)
    assert slow.decided == "above" and len(slow.round_ratios) == MIN_ROUNDS
    # a candidate right at the threshold: no clear answer, the measurement runs to its cap
    noisy = PairedBenchmark(_FakeBackend((0.95, 0.95, 1.04, 1.04)), ref, warmup_runs=1, timing_runs=40, rounds=4)
    close = noisy.measure(b"9.9", use_cache=False, stop_at=0.99)
    assert close.decided is None and len(close.round_ratios) == 8
    fixed = bench.measure(b"7.0", use_cache=False)  # no threshold: the fixed number of rounds
    assert fixed.decided is None and len(fixed.round_ratios) == 4


def _fake_step(bad: set[str], over: set[tuple[str, str]] = frozenset(), calls: list | None = None):
    """A full-model step: faster unless it holds a bad group (then slower), over the budget if it
    holds an (key, scheme) pair in ``over``."""
    from tasks.autotune.region.scheme import Measurement

    def measure(before: dict, after: dict) -> Measurement:
        changes = {k: v for k, v in after.items() if before.get(k) != v}
        if calls is not None:
            calls.append(changes)
        if any((k, v) in over for k, v in changes.items()):
            m = Measurement.failed("over the accuracy budget: SNR 12 dB")
            m.accuracy = {"ok": False, "what": "SNR 12 dB"}
            return m
        r = 1.2 if set(changes) & bad else 0.9
        return Measurement(9.0, r, 10.0, round_ratios=(r, r, r), decided="above" if r > 1 else "below")

    return measure


def _phase3(tmp_path, measure, name="cache.json"):
    from tasks.autotune.subgraph.records import SubgraphCache
    from tasks.autotune.subgraph.validation import Phase3

    cache = SubgraphCache(tmp_path / name, "sha", "ctx")
    cache.load()
    return Phase3(cache, measure, lambda state: repr(sorted(state.items()))), cache


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_bisection_finds_k_bad_groups_among_n_in_k_log_n_steps(tmp_path, k):
    import math

    n = 32
    keys = [f"g{i:02d}" for i in range(n)]
    bad = set(keys[3:3 + 7 * k:7])
    calls: list = []
    phase, cache = _phase3(tmp_path, _fake_step(bad, calls=calls))
    kept = phase.test([(key, "preferred") for key in keys], 1)
    assert set(kept) == set(keys) - bad and {key for key, v in phase.chosen.items()} == set(keys) - bad
    measured = sum(1 for st in cache.steps if st["measured"])
    # a bad group costs at most two steps per level of halving (the half holding it, and the other
    # half, measured to be kept): O(k log n), against n = 32 steps one group at a time
    assert measured == len(calls) and measured <= 1 + 2 * k * math.ceil(math.log2(n)) and measured < n
    # every split step lists its children; a second half whose first half was kept whole is its
    # parent's model again: known, not measured
    for st in cache.steps:
        assert all(cache.steps[c]["parent"] == st["index"] for c in st["children"])
        if st["children"]:
            assert len(st["children"]) == 2 and st["outcome"] == "slower"
    assert k == 0 or any(not st["measured"] and st["known_from"] is not None for st in cache.steps)
    assert all(st["outcome"] == "slower" for st in cache.steps if not st["kept"])


def test_bisection_falls_back_to_the_next_scheme_of_a_group_over_the_budget(tmp_path):
    phase, cache = _phase3(tmp_path, _fake_step(set(), over={("g1", "preferred"), ("g2", "preferred"),
                                                            ("g2", "full")}))
    nxt = {"preferred": "full", "full": None}
    phase.fallback = lambda key, scheme: nxt[scheme]
    kept = phase.test([("g0", "preferred"), ("g1", "preferred"), ("g2", "preferred"), ("g3", "preferred")], 1)
    assert kept == {"g0": "preferred", "g1": "full", "g3": "preferred"}
    assert phase.over_budget == {"g2"}
    # g1 alone is the parent's model again once g0 is kept: known over the budget, then its fallback
    singles = [(st["changes"], st["measured"]) for st in cache.steps if len(st["changes"]) == 1
               and st["outcome"] == "over_budget"]
    assert singles == [({"g1": "preferred"}, False), ({"g2": "preferred"}, True), ({"g2": "full"}, True)]


def test_bisection_resumes_after_an_interruption_without_measuring_twice(tmp_path):
    keys = [f"g{i}" for i in range(12)]
    bad = {"g2", "g9"}
    items = [(key, "preferred") for key in keys]
    full_calls: list = []
    phase, cache = _phase3(tmp_path, _fake_step(bad, calls=full_calls), "full.json")
    phase.test(items, 1)
    uninterrupted = (dict(phase.chosen), [(st["changes"], st["outcome"], st["measured"]) for st in cache.steps])

    class Killed(Exception):
        pass

    first: list = []
    inner = _fake_step(bad, calls=first)

    def dies(before, after):
        if len(first) == 4:
            raise Killed
        return inner(before, after)

    phase, cache = _phase3(tmp_path, dies)
    with pytest.raises(Killed):
        phase.test(items, 1)
    saved = json.loads((tmp_path / "cache.json").read_text())["phase3"]["steps"]
    assert len(saved) >= 4 and any(st["children"] for st in saved)  # killed in the middle of a bisection
    second: list = []
    phase, cache = _phase3(tmp_path, _fake_step(bad, calls=second))
    phase.test(items, 1)
    assert (dict(phase.chosen), [(st["changes"], st["outcome"], st["measured"]) for st in cache.steps]) == \
        uninterrupted
    assert len(first) + len(second) == len(full_calls)  # nothing measured twice
    # the steps recorded before the interruption are kept as they were (a parent gains children)
    assert [{**st, "children": []} for st in cache.steps[:len(saved)]] == [{**st, "children": []} for st in saved]
    # a cache whose steps this run would not take is refused, not silently followed
    phase, _ = _phase3(tmp_path, _fake_step(bad))
    with pytest.raises(StateError, match="not the step this run takes next"):
        phase.test(items[:5], 1)
