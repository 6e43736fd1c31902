"""The ONNX Runtime session settings search: its candidates come from the graph ORT runs, its settings
file round-trips and opens sessions, quantized MatMuls that ORT runs in float are named."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from pipeline.backends.onnxruntime.search import FUSIONS, apply_change, candidates, float_matmuls
from pipeline.backends.onnxruntime.session import SessionSettings, inference_session, ort_session_options
from pipeline.errors import StateError
from tests import models
from tests.helpers import record_runtime_search


def _optimized(model: onnx.ModelProto, tmp_path, settings: SessionSettings = SessionSettings()) -> onnx.ModelProto:
    so = settings.apply(ort_session_options("all", optimized_path=tmp_path / "opt.onnx"))
    inference_session(model, so, disabled_optimizers=settings.disabled_optimizers)
    return onnx.load(str(tmp_path / "opt.onnx"))


def test_the_only_thread_count_tried_is_one_whatever_the_hosts_cores(tmp_path):
    """A shipped thread count is a rule (ORT's own, one per physical core, or one thread), never a count
    derived from this host's cores."""
    model = models.transformer_layer()
    opt = _optimized(model, tmp_path)
    for cores in (2, 8, 64):
        threads = [c["threads"] for _, c in candidates(opt, model, cores=cores) if "threads" in c]
        assert threads == [1], (cores, threads)
    assert not [c for _, c in candidates(opt, model, cores=1) if "threads" in c]


def test_candidates_name_the_transformers_that_made_the_fused_ops(tmp_path):
    model = models.transformer_layer()  # ORT fuses its erf GELU (Gelu) and residual + LN (SkipLayerNormalization)
    opt = _optimized(model, tmp_path)
    fused = {(n.domain, n.op_type) for n in opt.graph.node}
    names = [name for name, _ in candidates(opt, model, cores=2)]
    for key, transformer in FUSIONS.items():
        assert (f"disable {transformer}" in names) == (key in fused)
    assert "gelu approximation" in names and names[-1] == "1 intra-op thread"
    # disabling the transformer a candidate names removes its fused op from the graph ORT runs
    name, change = next((n, c) for n, c in candidates(opt, model, 2) if n.startswith("disable"))
    again = _optimized(model, tmp_path, apply_change(SessionSettings(), change))
    op = next(k for k, v in FUSIONS.items() if f"disable {v}" == name)
    assert op in fused and op not in {(n.domain, n.op_type) for n in again.graph.node}


def test_changes_accumulate_and_the_settings_file_round_trips(tmp_path):
    s = apply_change(SessionSettings(), {"disable": "SkipLayerNormFusion"})
    s = apply_change(s, {"entry": ("optimization.enable_gelu_approximation", "1")})
    s = apply_change(apply_change(s, {"threads": 1}), {"disable": "BiasGeluFusion"})
    assert s.disabled_optimizers == ("BiasGeluFusion", "SkipLayerNormFusion") and s.intra_op_num_threads == 1
    path = s.save(tmp_path / "ort_session.json")
    assert SessionSettings.load(path) == s
    doc = path.read_text()
    assert '"disabled_optimizers"' in doc and '"config_entries"' in doc and '"intra_op_num_threads": 1' in doc
    sess = SessionSettings.load(path).session(models.save(models.attention_block(), tmp_path, "a"))
    assert sess.get_session_options().intra_op_num_threads == 1
    assert "disabled BiasGeluFusion, SkipLayerNormFusion" in s.describe()
    (tmp_path / "bad.json").write_text('{"graph_optimization_level": "fastest"}')
    with pytest.raises(StateError, match="bad.json are corrupt .*graph_optimization_level='fastest'"):
        SessionSettings.load(tmp_path / "bad.json")


def _qdq_matmul(act_dtype: int) -> onnx.ModelProto:
    """x -> Q/DQ (``act_dtype``) -> MatMul with an int8 weight through DQ."""
    rng = np.random.default_rng(0)
    w = (rng.integers(-100, 100, (16, 8))).astype(np.int8)
    zp = np.zeros((), np.int8 if act_dtype == TensorProto.INT8 else np.uint8)
    inits = [onnx.numpy_helper.from_array(w, "w_q"), onnx.numpy_helper.from_array(np.float32(0.01), "w_s"),
             onnx.numpy_helper.from_array(np.int8(0), "w_z"), onnx.numpy_helper.from_array(np.float32(0.02), "x_s"),
             onnx.numpy_helper.from_array(zp, "x_z")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["x_q"], name="q"),
             helper.make_node("DequantizeLinear", ["x_q", "x_s", "x_z"], ["x_dq"], name="dq"),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["w_dq"], name="wdq"),
             helper.make_node("MatMul", ["x_dq", "w_dq"], ["y"], name="mm")]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_quantized_matmul_that_ort_runs_in_float_is_named(tmp_path):
    fused = _qdq_matmul(TensorProto.UINT8)
    assert float_matmuls(fused, _optimized(fused, tmp_path)) == []
    plain = SessionSettings(graph_optimization_level="basic")  # no QDQ fusion: the MatMul stays float
    assert float_matmuls(fused, _optimized(fused, tmp_path, plain)) == ["mm"]


class _Verdict:
    ok, what = True, "within budget"

    def to_dict(self) -> dict:
        return {"ok": True, "what": self.what}


def test_a_change_kept_sends_each_candidate_that_was_not_clearly_faster_round_once_more(tmp_path, monkeypatch):
    """Where a runtime's settings interact (its search space says so: OpenVINO's), after a kept change each
    candidate that ran within the budget but was not clearly faster is timed once more on the settings found
    (once: a second kept change does not start a third pass); failed candidates are not tried again."""
    from omegaconf import OmegaConf

    from tasks.autotune.config import RuntimeSearchConfig
    from tasks.autotune.runtime import search as rs

    verdicts = {"a": "kept", "b": "slower", "c": "failed", "b" + rs.AGAIN: "kept"}

    def step(self, cand, current):
        what = verdicts[cand.name]
        return rs.RuntimeStep(cand.name, {"n": cand.name}, kept=what == "kept",
                              rounds=None if what == "failed" else 3, why=what)

    monkeypatch.setattr(rs.RuntimeSearch, "_step", step)

    class Space:
        retry_after_kept = True  # as OpenVINO's

        def base(self, backend):
            return _Settings({})

        def apply(self, settings, change):
            return _Settings(change)

    class Kind:
        type, artifact = _Settings, "autotune/x.json"

    class Backend:
        shipped_settings = Kind()

        def search_space(self):
            return Space()

    path = models.save(models.transformer_layer(), tmp_path, "t")
    rcfg = OmegaConf.structured(RuntimeSearchConfig())
    search = rs.RuntimeSearch(Backend(), path, None, rcfg, tmp_path / "state.json", "ctx")
    search.run([("a", {}), ("b", {}), ("c", {})])
    assert [s.name for s in search.steps] == ["a", "b", "c", "b" + rs.AGAIN] and search.doc["done"]


class _Settings:
    def __init__(self, d):
        self.d = dict(d)

    @classmethod
    def from_dict(cls, d):
        return cls(d)

    def to_dict(self):
        return dict(self.d)


def test_an_interrupted_search_resumes_at_the_next_candidate(tmp_path, monkeypatch):
    """Each step is saved before the next begins: after an interruption the same search measures only
    the candidates it had not, and ends where an uninterrupted one does; another model's state is
    set aside."""
    from omegaconf import OmegaConf

    from pipeline.backends.onnxruntime import OnnxRuntimeBackend
    from pipeline.backends.onnxruntime.config import OnnxRuntimeBackendConfig
    from tasks.autotune.config import RuntimeSearchConfig
    from tasks.autotune.runtime import search as rs

    model = models.transformer_layer()
    path = models.save(model, tmp_path, "t")
    opt = _optimized(model, tmp_path)
    backend = OnnxRuntimeBackend(OmegaConf.structured(OnnxRuntimeBackendConfig(warmup_runs=1, timing_runs=8)))
    rcfg = OmegaConf.structured(RuntimeSearchConfig(max_rounds=3))
    state = tmp_path / "runtime_search.json"
    names = [n for n, _ in candidates(opt, model, 2)]
    assert len(names) >= 3

    record_runtime_search(monkeypatch, kill_at=3)  # killed while the third candidate is measured
    with pytest.raises(KeyboardInterrupt):
        rs.RuntimeSearch(backend, path, lambda pm: _Verdict(), rcfg, state, "ctx").run(candidates(opt, model, 2))
    import json

    assert [s["name"] for s in json.loads(state.read_text())["steps"]] == names[:2]
    measured = record_runtime_search(monkeypatch)
    search = rs.RuntimeSearch(backend, path, lambda pm: _Verdict(), rcfg, state, "ctx")
    search.run(candidates(opt, model, 2))
    assert measured == names[2:] and [s["name"] for s in search.doc["steps"]] == names and search.doc["done"]
    # the search of another model starts afresh and keeps the old state aside
    other = models.save(models.transformer_layer(seed=1), tmp_path, "t2")
    fresh = rs.RuntimeSearch(backend, other, lambda pm: _Verdict(), rcfg, state, "ctx")
    measured.clear()
    fresh.run(candidates(opt, model, 2))
    assert measured == names and list((tmp_path / "stale").glob("*/runtime_search.json"))


def test_models_with_settings_run_as_deployed_and_placement_measurements_do_not_spin(tmp_path):
    """ORT's worker threads spin between runs unless told not to. Placement's measurement sessions do
    not (backend.allow_spinning); a model measured with session settings, and the float baseline it
    is compared with (as_deployed: ORT's defaults), runs as a deployment does, spinning; so do the
    sessions ``SessionSettings.session`` gives a deployment."""
    from pipeline.backends import create_backend
    from tests.helpers import compose

    backend = create_backend(compose(["backend=onnxruntime"]).backend)
    key = "session.intra_op.allow_spinning"
    assert backend.session_options().get_session_config_entry(key) == "0"
    for b in (backend.as_deployed(), backend.with_settings(SessionSettings(disabled_optimizers=("GeluFusion",)))):
        assert b.session_options().get_session_config_entry(key) == "1"
    path = models.save(models.single_matmul(), tmp_path, "m")
    assert SessionSettings().session(path).get_session_options().get_session_config_entry(key) == "1"

