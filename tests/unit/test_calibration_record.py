"""calibration.json's records: per-tensor statistics and the quantize stage's decisions survive a
to_dict/from_dict round trip, and a file with unknown or missing keys is refused in one line."""

from __future__ import annotations

import json

import pytest

from pipeline.accuracy.budget import AccuracyVerdict
from pipeline.accuracy.fidelity import FidelityResult
from pipeline.errors import StateError
from pipeline.quant.calibration import TensorStats, load_calibration
from pipeline.quant.cpu import CpuFacts
from pipeline.quant.plan import WeightVariant
from pipeline.quant.qmath import QTYPES
from pipeline.records.quantize import QuantizeDecisions, quantize_decisions

STATS = {"min": -1.0, "max": 3.0, "absmax": 3.0, "channel_ratio": 4.0, "thresholds": {"int8": 2.0, "uint8": 2.5},
         "threshold": 2.0, "chosen": {"int8": "mse", "uint8": "entropy"}, "algorithm": "auto", "samples": 16}

VERDICT = AccuracyVerdict(True, "snr", "SNR 31.0 dB", snr_db=31.0).to_dict()
DECISIONS = {
    "weight_range": "reduced", "weight_range_reason": "weights use 7-bit range",
    "cpu": CpuFacts("x86_64", brand="x", flags=("avx2",), u8s8_saturates=True, source="cpuid").to_dict(),
    "unsupported_nodes": ["a"], "fidelity_culprits": [], "kernel_fidelity": None,
    "bias_correction": {"applied": True, "nodes": 2, "records": [{"node": "conv1"}], "before": "SNR 20 dB",
                        "after": "SNR 25 dB"},
    "variants": [{"name": "weights_full", "error": None, "latency_p10_ms": 1.5,
                  "fidelity": FidelityResult(True, False, 6.2, reason="saturates").to_dict(), "accuracy": VERDICT}],
    "budget": "top-1 drop <= 1 point", "holdout": "calibration batches 4..5",
    "holdout_samples": 8, "accuracy": VERDICT, "float_nodes": ["a", "b"], "transforms": [],
    "body_nodes": [], "all_float": False,
}


def _write(tmp_path, doc) -> str:
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_tensor_stats_round_trip_with_the_scales_calibration_json_records():
    s = TensorStats.from_dict(STATS)
    assert s.algorithm == "auto" and s.samples == 16 and s.thresholds["uint8"] == 2.5 and s.candidates is None
    assert s.to_dict() == STATS and list(s.to_dict()) == list(STATS)
    written = s.with_scales().to_dict()
    # scales for the dtypes calibration searched a range for, only: an fp8 scale from the int8 clip
    # would be a range nobody searched
    assert set(written) == set(STATS) | {"int8", "uint8"}
    for dt in ("int8", "uint8"):  # the scales are those the statistics give
        assert written[dt]["scale"] == pytest.approx(float(s.params(dt).scale))
    with pytest.raises(ValueError, match="no fp8_e4m3fn range was calibrated .*re-run the quantize stage"):
        s.params("fp8_e4m3fn")
    assert TensorStats.from_dict(written, written=True).to_dict() == written
    # one threshold for every dtype (minmax, max, entropy, percentile): every dtype's scale
    minmax = {k: v for k, v in STATS.items() if k not in ("thresholds", "chosen")} | {"algorithm": "minmax"}
    assert set(TensorStats.from_dict(minmax).with_scales().to_dict()) == set(minmax) | set(QTYPES)
    # a record read by attribute only: no mapping face
    assert not hasattr(s, "__getitem__") and not hasattr(s, "get")


def test_decisions_round_trip_and_defaults_without_a_table(tmp_path):
    d = QuantizeDecisions.from_dict(DECISIONS)
    assert d.weight_range is WeightVariant.reduced and d.float_nodes == ["a", "b"] and d.ranges is None
    assert f"{d.weight_range} weights" == "reduced weights" and d.weight_range.candidate == "weights_reduced"
    with pytest.raises(TypeError, match="QuantizeDecisions.accuracy takes AccuracyVerdict records, not dict"):
        QuantizeDecisions(accuracy=VERDICT)  # a record built with a plain dict is our bug, caught where built
    # every decision is a record, read by attribute
    assert d.cpu.u8s8_saturates and d.accuracy.ok and d.accuracy.snr_db == 31.0
    assert d.variants[0].fidelity.reason == "saturates" and d.variants[0].accuracy == d.accuracy
    assert d.to_dict() == DECISIONS  # ranges is written only with auto ranges
    ranged = {**DECISIONS, "ranges": {"chosen": "mse", "weight_clip": "mse",
                                      "held_out_error": {"per_tensor": 0.002, "mse": 0.001}}}
    assert QuantizeDecisions.from_dict(ranged).to_dict() == ranged
    assert QuantizeDecisions.from_dict(ranged).ranges.chosen == "mse" and d.bias_correction.after == "SNR 25 dB"
    assert quantize_decisions(_write(tmp_path, {"tensors": {}, "decisions": DECISIONS})) == d
    none = quantize_decisions(None)
    assert (none.weight_range, none.float_nodes, none.all_float) == ("full", [], False)
    assert quantize_decisions(_write(tmp_path, {"tensors": {}})) == none  # the float model passed through


@pytest.mark.parametrize("decisions,problem", [
    ({**DECISIONS, "weight_storage": "full"}, "unknown key(s) weight_storage"),
    ({k: v for k, v in DECISIONS.items() if k != "all_float"}, "missing key(s) all_float"),
    ([], "is a list, expected a table"),
    ({**DECISIONS, "weight_range": "int4"}, "weight_range 'int4': choose one of full, reduced, uint8"),
    ({**DECISIONS, "variants": [{"error": None}]}, "a decision record has the wrong shape (KeyError: 'name')"),
    ({**DECISIONS, "accuracy": 3}, "a decision record has the wrong shape"),
])
def test_decisions_with_unknown_or_missing_keys_are_refused_naming_the_file(tmp_path, decisions, problem):
    path = _write(tmp_path, {"tensors": {}, "decisions": decisions})
    with pytest.raises(StateError) as e:
        quantize_decisions(path)
    msg = str(e.value)
    assert "\n" not in msg and path in msg and problem in msg and e.value.exit_code == 2


@pytest.mark.parametrize("stats,problem", [
    ({**STATS, "mean": 0.5}, "unknown key(s) mean"),
    ({k: v for k, v in STATS.items() if k != "threshold"}, "missing key(s) threshold"),
    ({k: v for k, v in STATS.items() if k != "samples"}, "missing key(s) samples"),
])
def test_statistics_with_unknown_or_missing_keys_are_refused_naming_the_file(tmp_path, stats, problem):
    path = _write(tmp_path, {"tensors": {"x": stats}})
    with pytest.raises(StateError) as e:
        load_calibration(path)
    msg = str(e.value)
    assert "\n" not in msg and path in msg and "tensors['x']" in msg and problem in msg and e.value.exit_code == 2
    assert load_calibration(_write(tmp_path, {"tensors": {"x": STATS}})).tensors["x"] == TensorStats.from_dict(STATS)


def test_a_calibration_names_the_dtypes_it_has_no_range_for():
    from pipeline.quant.calibration import Calibration

    searched = Calibration({"x": TensorStats.from_dict(STATS)})
    assert searched.missing_dtypes(["int8", "uint8"]) == []
    assert searched.missing_dtypes(["int8", "fp8_e4m3fn"]) == ["fp8_e4m3fn"]
    minmax = {k: v for k, v in STATS.items() if k not in ("thresholds", "chosen")} | {"algorithm": "minmax"}
    assert Calibration({"x": minmax}).missing_dtypes(["fp8_e4m3fn"]) == []  # one threshold serves every dtype
