"""backend=openvino end to end on a tiny residual model: both autotune modes measure on OpenVINO,
subgraph mode takes its fusion groups from OpenVINO's runtime graph, every speedup names the float
precision OpenVINO runs, and gen_trt_engine writes what an OpenVINO deployment loads."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers import QUICK, run_tune

pytest.importorskip("openvino", reason="backend=openvino needs OpenVINO: pip install openvino")
pytestmark = pytest.mark.slow


def _stages(rd) -> dict:
    return json.loads((rd / "manifest.json").read_text())["stages"]


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
    # below FP32, the float model is timed in FP32 too and the report says how much the runtime's float gains
    assert ("float_fp32_ms" in evaluate["latency"]) == (precision != "FP32")
    engine = stages["gen_trt_engine"]["metrics"]
    assert {p.name for p in (rd / "gen_trt_engine").iterdir()} >= {"model.xml", "model.bin", "model.blob", "build.json"}
    assert engine["precision"] and any(k.endswith((" i8", " u8")) for k in engine["layer_precisions"])

    sub = tmp_path / "subgraph"
    shutil.copytree(rd, sub)  # export and quantize are reused: only autotune runs again
    proc = run_tune([*args, f"results_dir={sub}", "stages=[export,quantize,autotune]", "autotune.mode=subgraph"],
                    cwd=tmp_path, check=True)
    assert "OpenVINO's runtime graph" in proc.stdout + proc.stderr
    assert list((sub / "autotune").glob("*.openvino_layers.json"))
    assert _stages(sub)["autotune"]["metrics"]["shipped"] in ("tuned", "ptq", "float")
