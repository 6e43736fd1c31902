"""backend=auto's pieces that need no run: the list shorthand, the choice record and its headline."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pipeline.app.cli import open_dict_overrides
from pipeline.errors import StateError
from pipeline.quant.calibration import TensorStats
from pipeline.runtime_choice import RuntimeChoice, RuntimeRow, headline
from tests.helpers import compose


def test_a_list_of_runtimes_is_auto_over_them():
    argv = open_dict_overrides(["backend=[openvino,onnxruntime]", "seed=1"])
    assert argv == ["backend=auto", "backend.runtimes=[openvino,onnxruntime]", "seed=1"]
    cfg = compose(argv)
    assert list(cfg.backend.runtimes) == ["openvino", "onnxruntime"]
    assert cfg.backend.openvino.device == "CPU"  # each runtime keeps its own section


def _choice() -> RuntimeChoice:
    rows = [RuntimeRow("onnxruntime", "ptq", "FP32", "SNR 40 dB", p10_ms=1.5, float_p10_ms=2.0),
            RuntimeRow("openvino", "tuned", "BF16", "SNR 38 dB", p10_ms=1.0, float_p10_ms=1.2),
            RuntimeRow("tensorrt_rtx", "float", "FP16", "", error="no GPU")]
    contenders = [c for r, same in zip(rows, (True, False, False), strict=True) for c in r.contenders(False, same)]
    contenders.sort(key=lambda c: c.p10_ms)
    choice = RuntimeChoice("k", "onnxruntime FP32 float", 2.0, "openvino", rows, {"trtexec": "not on PATH"},
                           contenders=contenders)
    choice.headline = headline(choice)
    return choice


def test_the_headline_names_the_winner_its_margin_and_every_other_deployment():
    # ONNX Runtime's float is the reference float: not a contender of its own
    assert _choice().headline == (
        "ships openvino (tuned): 2.00x the onnxruntime FP32 float, 1.20x the next; openvino (BF16 float) 1.67x; "
        "onnxruntime (ptq) 1.33x; tensorrt_rtx not timed (no GPU); trtexec left out (not on PATH)")


def _timing(ms: float | None):
    from pipeline.backends.base import Timing

    return Timing(median_ms=ms, p10_ms=ms, n=8) if ms is not None else Timing.failed("auto", "crashed")


def decided(tmp_path, *timed):
    """decide over fake timings of two runtimes (float ms, shipped ms, float is shipped, float is reference[,
    the float's 95% interval over the shipped model])."""
    from pipeline.app.choice import TimedRuntime, decide
    from pipeline.backends import create_backend
    from pipeline.records.autotune import AutotuneMetrics

    ort = create_backend(compose(["backend=onnxruntime"]).backend)
    metrics = AutotuneMetrics.from_dict({"shipped": "tuned", "accuracy": {"final": {"what": "SNR 40 dB"}},
                                         "float_baseline": {"precision": "FP32", "default": "BF16"}})
    shipped = {"onnxruntime": (ort, tmp_path / "a.onnx", metrics), "openvino": (ort, tmp_path / "b.onnx", metrics)}
    runs = [TimedRuntime(_timing(f), _timing(s), *rest) for f, s, *rest in timed]
    return decide("k", tmp_path / "choice.json", ort, _timing(2.0), runs, shipped, {})


def test_a_runtime_float_faster_than_every_shipped_model_ships(tmp_path):
    choice = decided(tmp_path, (2.0, 1.5, False, True), (0.9, 1.0, False, False, (0.86, 0.94)))
    assert (choice.winner, choice.ships) == ("openvino", "float")
    assert choice.row("openvino").float_precision == "FP32"  # its autotune's float baseline, not its default
    assert choice.headline.startswith("ships openvino (FP32 float): 2.22x the onnxruntime FP32 float, 1.11x the next")
    assert RuntimeChoice.from_dict(choice.to_dict()) == choice


def test_a_tie_ships_the_tuned_model_and_one_deployment_is_one_contender(tmp_path):
    choice = decided(tmp_path, (2.0, 1.5, False, True), (1.0, 1.0, False, False))
    assert (choice.winner, choice.ships) == ("openvino", "shipped")
    same = decided(tmp_path, (2.0, 1.5, False, True), (1.0, 1.0, True, False))
    assert [c.describe() for c in same.contenders] == ["openvino (tuned)", "onnxruntime (tuned)"]
    failed = decided(tmp_path, (2.0, None, False, True), (1.2, 1.0, False, False))
    assert [c.describe() for c in failed.contenders] == ["openvino (tuned)", "openvino (FP32 float)"]
    assert "onnxruntime left out" not in failed.headline and failed.row("onnxruntime").error == "crashed"
    # a runtime that ships its float with tuned settings: two floats of one runtime, told apart
    row = RuntimeRow("openvino", "float", "BF16", "SNR 40 dB", p10_ms=1.0, float_p10_ms=1.1)
    assert [c.describe() for c in row.contenders(False, False)] == ["openvino (float, tuned settings)",
                                                                    "openvino (BF16 float)"]
    assert [c.describe() for c in row.contenders(True, False)] == ["openvino (float)"]


def test_a_float_not_clearly_faster_than_its_runtimes_shipped_model_does_not_displace_it(tmp_path):
    # faster by p10 in this comparison, but its per-round ratios reach 1: the runtime's autotune measured
    # the two itself and chose the shipped model, so a tie is the shipped model's
    choice = decided(tmp_path, (2.0, 1.5, False, True), (0.9, 1.0, False, False, (0.8, 1.04)))
    assert (choice.winner, choice.ships) == ("openvino", "shipped")
    assert [c.describe() for c in choice.contenders] == ["openvino (tuned)", "openvino (FP32 float)",
                                                         "onnxruntime (tuned)"]
    assert choice.headline == (
        "ships openvino (tuned): 2.00x the onnxruntime FP32 float, 1.50x the next; openvino (FP32 float) 2.22x (not "
        "clearly faster "
        "than openvino's shipped model: 0.80-1.04x its latency, 95%; a tie goes to the model its autotune chose); "
        "onnxruntime (tuned) 1.33x")
    assert RuntimeChoice.from_dict(json.loads(json.dumps(choice.to_dict()))) == choice  # as the file holds it
    # held back, it ranks right behind its runtime's shipped model, behind a faster model of another runtime
    other = decided(tmp_path, (2.0, 0.8, False, True), (0.9, 1.0, False, False, (0.8, 1.04)))
    assert [c.describe() for c in other.contenders] == ["onnxruntime (tuned)", "openvino (tuned)",
                                                        "openvino (FP32 float)"]


def test_the_choice_round_trips_and_a_foreign_file_is_one_line(tmp_path):
    choice = _choice()
    assert RuntimeChoice.from_dict(choice.to_dict()) == choice
    with pytest.raises(StateError, match="runtime_choice.json has an unknown layout"):
        RuntimeChoice.from_dict({"key": "k"})


def test_statistics_are_collected_once_per_sharing_scope_and_each_caller_gets_its_own_table():
    from pipeline.quant.shared_stats import collect_once, sharing

    calls = []

    def collect():
        calls.append(1)
        return {"t": TensorStats(min=0.0, max=1.0, absmax=1.0, threshold=1.0, algorithm="minmax")}

    assert collect_once({"k": 1}, collect) is not collect_once({"k": 1}, collect)
    assert len(calls) == 2  # outside a scope: always collected
    with sharing():
        a = collect_once({"k": 1}, collect)
        with pytest.raises(dataclasses.FrozenInstanceError):  # a range choice replaces a record
            a["t"].threshold = 0.5
        a["t"] = dataclasses.replace(a["t"], threshold=0.5)
        b = collect_once({"k": 1}, collect)
        collect_once({"k": 2}, collect)
    assert len(calls) == 4 and b["t"].threshold == 1.0 and b is not a
    collect_once({"k": 1}, collect)
    assert len(calls) == 5  # the scope ended with its statistics


def test_the_final_comparison_times_each_deployment_once(tmp_path):
    """ONNX Runtime's own float is the reference float: one slot, so one speed (and one session in memory)."""
    from pipeline.app.choice import reference_float
    from pipeline.app.comparison import Comparison
    from pipeline.backends import create_backend
    from tests import models

    path = models.save(models.conv_chain(), tmp_path, "m")
    cfg = compose(["backend=onnxruntime"])
    ort_backend = create_backend(cfg.backend)
    run = type("Run", (), {"name": "onnxruntime", "cfg": cfg})()
    compare = Comparison()
    ref = compare.slot(reference_float([run]), path)
    assert compare.slot(ort_backend.as_deployed(), path) == ref
    fp32 = create_backend(compose(["backend=openvino", "backend.inference_precision=f32"]).backend)
    assert compare.slot(fp32, path) != ref and len(compare.pairs) == 2
    other = models.save(models.conv_chain(seed=3), tmp_path, "other")
    assert compare.slot(ort_backend.as_deployed(), other) == 2
