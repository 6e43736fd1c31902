"""backend=auto's pieces that need no run: the list shorthand, the choice record and its headline."""

from __future__ import annotations

import dataclasses

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
    return RuntimeChoice("k", "onnxruntime FP32 float", 2.0, "openvino", rows, {"trtexec": "not on PATH"})


def test_the_headline_names_the_winner_its_margin_and_every_other_runtime():
    choice = _choice()
    ranked = sorted((r for r in choice.rows if r.p10_ms is not None), key=lambda r: r.p10_ms)
    assert headline(choice, ranked) == (
        "ships openvino (tuned): 2.00x the onnxruntime FP32 float, 1.50x the next; onnxruntime (ptq) 1.33x; "
        "tensorrt_rtx not timed (no GPU); trtexec left out (not on PATH)")


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
    from pipeline.app.auto import Comparison, reference_float
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
