"""backend=openvino end to end on a tiny residual model: both autotune modes measure on OpenVINO,
subgraph mode takes its fusion groups from OpenVINO's runtime graph, every speedup names the float
precision OpenVINO runs (FP32 where OpenVINO's default float misses the accuracy budget), evaluate
takes autotune's float baseline and scores and times the float model in the other precision too, and
gen_trt_engine writes what an OpenVINO deployment loads."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
from omegaconf import OmegaConf

from pipeline.backends.openvino.config import OpenVinoBackendConfig
from tests.helpers import QUICK, run_tune

pytest.importorskip("openvino", reason="backend=openvino needs OpenVINO: pip install openvino")
pytestmark = pytest.mark.slow

from pipeline.backends.openvino import OpenVinoBackend  # noqa: E402 - needs OpenVINO, checked above


def _stages(rd) -> dict:
    return json.loads((rd / "manifest.json").read_text())["stages"]


def _int8_layers(layer_precisions: dict[str, int]) -> int:
    return sum(n for kind, n in layer_precisions.items() if kind.endswith((" i8", " u8")))


def test_both_modes_tune_on_openvino_and_gen_trt_engine_writes_ir_and_blob(residual_models, tmp_path):
    rd = tmp_path / "region"
    args = ["model=onnx", f"model.onnx_path={residual_models['tiny']}", "data=synthetic", "backend=openvino", *QUICK]
    run_tune([*args, f"results_dir={rd}", "stages=[export,quantize,autotune,gen_trt_engine,evaluate]",
              "evaluate.plot=false", "evaluate.max_batches=2"], cwd=tmp_path, check=True)
    stages = _stages(rd)
    assert stages["quantize"]["metrics"]["placement"] == "openvino"
    final = stages["autotune"]["metrics"]["final_line"]
    assert "float model on openvino" in final and stages["autotune"]["metrics"]["baseline_precision"] in final
    evaluate = stages["evaluate"]["metrics"]
    precision = stages["autotune"]["metrics"]["baseline_precision"]
    assert evaluate["baseline"].startswith(f"{precision} float model on openvino")
    chosen = stages["autotune"]["metrics"]["float_baseline"] or {}
    if chosen.get("note"):  # the runtime's float meets the budget but ran clearly slower than FP32 here
        assert chosen["reason"] == "is slower here" and chosen["fp32_ratio"] < 0.97 and precision == "FP32"
        assert evaluate["float_baseline"] == chosen and "float_default" in evaluate["models"]
        assert evaluate["headline"].endswith(f"; baseline: FP32 float ({chosen['default']} float is slower here)")
    else:  # autotune kept the runtime's own float (it meets the default budget): so does evaluate, unchanged
        assert "float_baseline" not in evaluate and "float_default" not in evaluate["models"]
        assert "baseline:" not in evaluate["headline"]
    # below FP32, the float model is scored and timed in FP32 too, and the report says how much the
    # runtime's float gains and what it costs in accuracy
    assert ("float_fp32_ms" in evaluate["latency"]) == (precision != "FP32")
    assert ("float_fp32" in evaluate["models"]) == (precision != "FP32")
    if precision != "FP32":
        fp32 = evaluate["models"]["float_fp32"]
        assert fp32["label"] == "float (FP32)" and fp32["snr_db"] > 0 and fp32["speedup_p10"] > 0
        assert "budget" not in fp32 and "float (FP32)" not in " ".join(evaluate["over_budget"])
        line = next(ln for ln in (rd / "evaluate" / "report.md").read_text().splitlines()
                    if ln.startswith("The float model run in FP32 on the same runtime: "))
        assert "against the baseline's outputs" in line and "faster (p10)" in line
    engine = stages["gen_trt_engine"]["metrics"]
    assert {p.name for p in (rd / "gen_trt_engine").iterdir()} >= {"model.xml", "model.bin", "model.blob", "build.json"}
    # int8 layers exactly where the shipped model has Q/DQ (on a CPU whose float beats int8 on this tiny
    # model, autotune ships the float one); the quantized model compiles to int8 layers either way
    shipped_qdq = any(n.op_type == "QuantizeLinear" for n in onnx.load(engine["model"]).graph.node)
    assert engine["precision"] and bool(_int8_layers(engine["layer_precisions"])) == shipped_qdq
    assert _int8_layers(OpenVinoBackend(OmegaConf.structured(OpenVinoBackendConfig()))
                        .build(rd / "quantize" / "quantized_model.onnx").info["layer_precisions"])

    sub = tmp_path / "subgraph"
    shutil.copytree(rd, sub)  # export and quantize are reused: only autotune runs again
    proc = run_tune([*args, f"results_dir={sub}", "stages=[export,quantize,autotune]", "autotune.mode=subgraph"],
                    cwd=tmp_path, check=True)
    assert "OpenVINO's runtime graph" in proc.stdout + proc.stderr
    assert list((sub / "autotune").glob("*.openvino_layers.json"))
    assert _stages(sub)["autotune"]["metrics"]["shipped"] in ("tuned", "ptq", "float")


def test_autotune_compares_against_fp32_float_where_openvinos_default_misses_the_budget(residual_models, tmp_path):
    from pipeline.backends.openvino.settings import core, property_text

    if property_text(core().get_property("CPU", "INFERENCE_PRECISION_HINT")) == "f32":
        pytest.skip("OpenVINO runs float in FP32 on this CPU: there is no lower default precision to judge")
    rd = tmp_path / "strict"
    # no float below FP32 comes within 200 dB of FP32; the quantize stage is left out (it would leave
    # every node float), autotune places Q/DQ with default scales
    run_tune(["model=onnx", f"model.onnx_path={residual_models['tiny']}", "data=synthetic", "backend=openvino",
              *QUICK, "accuracy.metric=snr", "accuracy.min_snr_db=200", "autotune.runtime.enabled=false",
              "evaluate.plot=false", "evaluate.max_batches=2", f"results_dir={rd}",
              "stages=[export,autotune,evaluate]"], cwd=tmp_path, check=True)
    m = _stages(rd)["autotune"]["metrics"]
    chosen = m["float_baseline"]
    assert m["baseline_precision"] == chosen["precision"] == "FP32" and chosen["default"] != "FP32"
    assert not chosen["verdict"]["ok"] and f"{chosen['default']} float misses the budget" in chosen["note"]
    if m["shipped"] == "float":  # no quantized model meets a 200 dB budget either: no speedup is claimed
        assert m["headline"].startswith(f"ships float: the FP32 float model on openvino ({chosen['note']}); ")
    else:
        assert m["headline"].startswith(f"{m['speedup']:.2f}x vs FP32 float ({chosen['note']})")
    # what ships compiles float layers in FP32, as measured
    shipped = json.loads((rd / "autotune" / "openvino_compile.json").read_text())
    assert shipped["INFERENCE_PRECISION_HINT"] == "f32"

    # evaluate follows: its baseline is the FP32 float, the shipped model (FP32 float again) is within
    # the budget against it, and the default-precision float is the extra row, faster and not judged
    evaluate = _stages(rd)["evaluate"]["metrics"]
    default = chosen["default"]
    assert evaluate["baseline"].startswith("FP32 float model on openvino") and evaluate["float_baseline"] == chosen
    assert evaluate["over_budget"] == [] and evaluate["models"]["autotuned"]["budget"]["ok"]
    own = evaluate["models"]["float_default"]
    assert own["label"] == f"float ({default})" and "budget" not in own and own["snr_db"] < 200
    assert "float_fp32" not in evaluate["models"] and own["speedup_p10"] > 0
    assert evaluate["latency"]["float_speedup_over_fp32_p10"] == pytest.approx(own["speedup_p10"])
    assert evaluate["headline"].endswith(f"; baseline: FP32 float ({default} float misses the budget)")
    report = (rd / "evaluate" / "report.md").read_text()
    assert f"as autotune chose it: the runtime's own {default} float misses the accuracy budget" in report
    assert f"The float model run in the runtime's own precision ({default}), not the baseline" in report
