"""The autotune stage end to end on tiny models: outputs, resume after kill -9, multirun, exactness."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import onnx
import pytest
import yaml

from pipeline.quant.qdq import get_quantized_tensors
from tests.helpers import QUICK, assert_final_line, pin_backend, run_tune, tune_command


def _measurements(state: Path) -> int:
    doc = yaml.safe_load(state.read_text())
    return sum(len(r["measurements"]) for p in doc["patterns"].values() for r in p["records"])


@pytest.fixture
def tiny(residual_models) -> Path:
    return residual_models['tiny']


def _args(model: Path, rd: Path, extra: list[str] | None = None) -> list[str]:
    return ["stages=[export,quantize,autotune]", "model=onnx", f"model.onnx_path={model}", "data=synthetic",
            f"results_dir={rd}", *QUICK, *(extra or [])]


@pytest.mark.slow
def test_outputs_final_line_and_exact_placement(tiny, tmp_path):
    rd = tmp_path / "r"
    proc = run_tune(_args(tiny, rd, ["autotune.schemes_per_region=4"]), cwd=tmp_path, check=True)
    out = rd / "autotune"
    for name in ("baseline.onnx", "optimized_final.onnx", "autotuner_state.yaml", "autotuner_state_pattern_cache.yaml"):
        assert (out / name).exists(), name
    logs = sorted((out / "logs").glob("region_*_scheme_*.log"))
    assert len(logs) == _measurements(out / "autotuner_state.yaml")
    assert list((out / "region_models").glob("region_*_level_*.onnx"))
    metrics = json.loads((rd / "manifest.json").read_text())["stages"]["autotune"]["metrics"]
    assert_final_line(proc.stderr, metrics)
    # the session settings the model ships with: searched, in the manifest and beside the model
    assert metrics["runtime"]["searched"] and metrics["runtime"]["steps"]
    assert json.loads((out / "ort_session.json").read_text()) == metrics["runtime"]["settings"]
    final = onnx.load(str(out / "optimized_final.onnx"))
    onnx.checker.check_model(final)
    # the shipped file is exactly the measured winner: rebuild the committed placement from the state
    from pipeline.graph.model import load_model
    from pipeline.quant.calibration import load_calibration
    from pipeline.records.quantize import quantize_decisions
    from tasks.autotune.region.autotuner import Config, QDQAutotuner

    tuner = QDQAutotuner(load_model(rd / "quantize" / "float_model.onnx"))  # the graph autotune places Q/DQ in
    # the weight storage and float nodes quantize chose on this CPU, as autotune follows them
    decisions = quantize_decisions(rd / "quantize" / "calibration.json")
    tuner.initialize(Config(placement="onnxruntime", activation_type="uint8", schemes_per_region=4,
                            weight_range=decisions.weight_range, float_nodes=list(decisions.float_nodes)),
                     calibration=load_calibration(rd / "quantize" / "calibration.json"))
    tuner.load_state(out / "autotuner_state.yaml")
    expected = {"tuned": tuner.export_model(), "ptq": onnx.load(str(rd / "quantize" / "quantized_model.onnx")),
                "float": onnx.load(str(rd / "export" / "model.onnx"))}[metrics["shipped"]]
    assert get_quantized_tensors(final) == get_quantized_tensors(expected)
    assert {i.name: i.raw_data for i in final.graph.initializer if i.name.endswith("_scale")} == \
        {i.name: i.raw_data for i in expected.graph.initializer if i.name.endswith("_scale")}


@pytest.mark.slow
def test_kill_and_resume_measures_nothing_twice(tiny, tmp_path):
    extra = ["autotune.schemes_per_region=6"]
    full = tmp_path / "full"
    run_tune(_args(tiny, full, extra), cwd=tmp_path, check=True)
    want = _measurements(full / "autotune" / "autotuner_state.yaml")

    rd = tmp_path / "killed"
    state = rd / "autotune" / "autotuner_state.yaml"
    proc = subprocess.Popen([*tune_command(), *pin_backend(_args(tiny, rd, extra))], cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        if state.exists():
            try:
                if _measurements(state) >= 3:
                    break
            except Exception:  # noqa: BLE001 - read while being replaced: retry
                pass
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "run ended before it could be killed; make the test model slower"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = _measurements(state)
    assert 3 <= before < want
    again = run_tune(_args(tiny, rd, extra), cwd=tmp_path, check=True)
    assert "resuming from" in again.stderr and "stale lock" in again.stderr
    assert _measurements(state) == want


@pytest.mark.slow
def test_multirun_gives_each_job_its_own_optimized_model(tiny, tmp_path):
    rd = tmp_path / "sweep"
    run_tune(["-m", "autotune.schemes_per_region=2,4", *_args(tiny, rd)], cwd=tmp_path, check=True)
    finals = sorted(rd.rglob("optimized_final.onnx"))
    assert len(finals) == 2 and finals[0].parent.parent != finals[1].parent.parent


@pytest.mark.rtx
@pytest.mark.slow
def test_optimized_final_builds_with_tensorrt_rtx(tiny, tmp_path):
    import importlib.util

    if importlib.util.find_spec("tensorrt_rtx") is None:
        pytest.importorskip("tensorrt_rtx_bindings")
    from pipeline.backends import create_backend
    from tests.helpers import compose

    for placement in ("onnxruntime", "tensorrt"):
        rd = tmp_path / placement
        run_tune(_args(tiny, rd, ["autotune.schemes_per_region=3", f"quantize.placement={placement}"]),
                 cwd=tmp_path, check=True)
        rtx = create_backend(compose(["backend=tensorrt_rtx"]).backend)
        res = rtx.build(rd / "autotune" / "optimized_final.onnx", tmp_path / f"{placement}.engine",
                        tmp_path / f"{placement}.log")
        assert res.engine_path.stat().st_size > 0


def test_corrupt_state_is_a_clear_error(tiny, tmp_path):
    rd = tmp_path / "r"
    (rd / "autotune").mkdir(parents=True)
    (rd / "autotune" / "autotuner_state.yaml").write_text("patterns: [oops")
    proc = run_tune(_args(tiny, rd, ["autotune.schemes_per_region=2"]), cwd=tmp_path)
    assert proc.returncode != 0 and "autotuner_state.yaml is corrupt" in proc.stderr
    assert "Traceback" not in proc.stderr
