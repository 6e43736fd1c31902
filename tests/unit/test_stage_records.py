"""Every stage's manifest metrics as its record (ExportMetrics, QuantizeMetrics, DeploymentMetrics; autotune's
and evaluate's have their own tests): read back exactly as the runs wrote them (the fixtures are manifest
entries written before the records existed), a corrupt entry one line naming where, and the stage registry's
reader of each."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.accuracy.kinds import CheckedOn
from pipeline.backends.base import DeploymentMetrics
from pipeline.errors import StateError
from pipeline.records.export import ExportMetrics, Specialization, Training
from pipeline.records.quantize import QuantizeMetrics
from pipeline.records.stages import STAGE_RECORDS, stage_metrics
from pipeline.registry import STAGES

FIXTURES = Path(__file__).parents[1] / "fixtures" / "stage_metrics"
RECORDS = {"export": ExportMetrics, "quantize": QuantizeMetrics, "gen_trt_engine": DeploymentMetrics}


def _recorded(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("*.json")))
def test_the_record_reads_back_exactly_what_a_run_wrote(name):
    recorded = _recorded(name)
    stage = next(s for s in RECORDS if name.startswith(s))
    metrics = stage_metrics(stage, recorded, name)
    assert isinstance(metrics, RECORDS[stage]) and metrics.headline == recorded["headline"]
    assert json.dumps(metrics.to_dict()) == json.dumps(recorded)  # the same keys, values and order
    assert RECORDS[stage].from_dict(metrics.to_dict()) == metrics


def test_export_readers_get_typed_fields_and_the_headline_is_built_from_them():
    onnx_file = ExportMetrics.from_dict(_recorded("export_onnx.json"))
    assert onnx_file.folded is not None and onnx_file.control_flow is not None and onnx_file.training is None
    assert onnx_file.headline_for("onnx") == onnx_file.headline
    digits = ExportMetrics.from_dict(_recorded("export_digits.json"))
    assert digits.training is not None and digits.verification is not None and digits.source is None
    assert digits.headline_for("digits_cnn") == digits.headline
    cached = replace(digits, training=replace(digits.training, weights_cached=True))
    assert cached.to_dict()["weights_cached"] is True and "weights_cached" not in digits.to_dict()
    spec = replace(onnx_file, specialized=Specialization({"sr": [16000]}, [{"node": "If_0", "branch": "then"}], 4, 0.0))
    assert ExportMetrics.from_dict(spec.to_dict()) == spec
    assert "specialized on {'sr': [16000]} (1 If nodes inlined, outputs equal on 4 batches)" in spec.headline_for("onnx")
    assert isinstance(digits.training, Training)


def test_quantize_readers_get_typed_fields():
    q = QuantizeMetrics.from_dict(_recorded("quantize.json"))
    assert q.placement == "onnxruntime" and q.weight_range == "full" and q.quantized_nodes == len(q.node_rules)
    assert q.accuracy is not None and q.accuracy.ok and q.cpu is not None and q.ranges is not None
    assert isinstance(q.checked, CheckedOn)
    passed = QuantizeMetrics.from_dict(_recorded("quantize_pass_through.json"))
    assert passed.placement is None and passed.quantized_nodes == 0 and passed.checked is None


def test_deployment_readers_get_typed_fields():
    trt = DeploymentMetrics.from_dict(_recorded("gen_trt_engine_tensorrt.json"))
    assert trt.strongly_typed and trt.layers == 7 and trt.runtime is not None and trt.optimized_op_counts is None
    ov = DeploymentMetrics.from_dict(_recorded("gen_trt_engine_openvino.json"))
    assert ov.layer_precisions and ov.strongly_typed is None and "strongly_typed" not in ov.to_dict()
    plugin = DeploymentMetrics(source="export/model.onnx", headline="a runtime's own words")
    assert plugin.to_dict() == {"source": "export/model.onnx", "headline": "a runtime's own words"}


@pytest.mark.parametrize("kind", list(RECORDS.values()))
def test_a_key_another_writer_added_is_left_out(kind):
    recorded = _recorded({ExportMetrics: "export_onnx.json", QuantizeMetrics: "quantize.json",
                          DeploymentMetrics: "gen_trt_engine_onnxruntime.json"}[kind])
    assert kind.from_dict({**recorded, "a_later_key": [1, 2]}).to_dict() == recorded


@pytest.mark.parametrize("kind", list(RECORDS.values()))
def test_a_corrupt_entry_is_one_line_naming_where(kind):
    where = "/r/manifest.json's entry"
    wrong_types = {ExportMetrics: {"opset": "x", "nodes": 1, "inputs": {}, "headline": "h"},
                   QuantizeMetrics: {"quantized_nodes": "many", "headline": "h"},
                   DeploymentMetrics: {"source": "export/model.onnx", "headline": "h", "engine_bytes": True}}
    for bad in ({"surprise": 1}, ["not", "an", "object"], wrong_types[kind]):
        with pytest.raises(StateError, match="manifest.json's entry has an unknown layout") as exc:
            kind.from_dict(bad, where)
        assert "\n" not in str(exc.value)


def test_every_registered_stage_has_its_record_and_no_entry_reads_as_none():
    assert set(STAGE_RECORDS) == set(STAGES)
    assert all(stage_metrics(stage, {}, "nowhere") is None for stage in STAGES)


def test_an_entry_of_a_shape_no_writer_made_is_one_line_for_every_stage():
    """A list where an object belongs, an Infinity where a count belongs: the stage's one-line StateError
    naming the entry and the fix, whatever the record's parser raised."""
    from pipeline.errors import StateError
    from pipeline.records.stages import stage_metrics

    data = {"source": "s", "samples": 1, "batches": 1, "batch_size": 1, "labelled": False}
    for stage, d in [("evaluate", {"models": {"a": []}, "baseline": "float", "data": data}),
                     ("evaluate", {"models": {}, "baseline": "float", "data": data, "latency": [1]}),
                     ("export", {"opset": float("inf"), "nodes": 1, "inputs": {}}), ("gen_trt_engine", [1]),
                     ("autotune", [1]), ("quantize", [1])]:
        with pytest.raises(StateError) as err:
            stage_metrics(stage, d, f"m.json's {stage} entry")
        assert str(err.value).startswith(f"m.json's {stage} entry has an unknown layout")
        assert str(err.value).endswith(f"re-run stages=[{stage}] force=true") and "\n" not in str(err.value)
