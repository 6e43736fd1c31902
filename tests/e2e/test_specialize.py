"""Models whose compute sits inside an If on an input the deployment fixes: export specializes them on
model.fixed_inputs (the If replaced by its taken branch, checked equal to the original), the data is
held to the fixed value, and LSTMs are unrolled so their matrix products are quantized."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from tests import models
from tests.helpers import run_tune

pytestmark = pytest.mark.slow


def _feeds(folder: Path, sr: int, count: int = 12, length: int = 64) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        np.savez(folder / f"{i:03d}.npz", x=rng.standard_normal((1, 1, length)).astype(np.float32),
                 sr=np.array(sr, np.int64))
    return folder


def _tune(tmp_path: Path, path: Path, feeds: Path, stages: str = "[export,quantize]", extra=()):
    rd = tmp_path / "run"
    proc = run_tune([f"results_dir={rd}", "model=onnx", f"model.onnx_path={path}", "model.input_shapes={x: [1,1,64]}",
                     "model.fixed_inputs={sr: 16000}", "data=npz", f"data.path={feeds}", f"stages={stages}",
                     "quantize.calibration.batches=8", "accuracy.holdout_batches=4", "progress=false",
                     *extra], cwd=tmp_path)
    return proc, rd


def test_specialized_model_equals_the_original_with_the_fixed_value(tmp_path):
    path = models.save(models.if_on_rate(), tmp_path, "if_on_rate")
    feeds = _feeds(tmp_path / "feeds", 16000)
    proc, rd = _tune(tmp_path, path, feeds)
    assert proc.returncode == 0, proc.stderr[-3000:]
    export = json.loads((rd / "manifest.json").read_text())["stages"]["export"]["metrics"]
    spec = export["specialized"]
    assert spec["fixed_inputs"] == {"sr": 16000} and spec["checked_batches"] == 8, spec
    assert [i["node"] for i in spec["ifs_inlined"]] == ["if_rate", "hi/if_len"]
    assert [i["branch"] for i in spec["ifs_inlined"]] == ["then", "then"]
    assert "specialized on {'sr': 16000}" in export["headline"]

    model = onnx.load(str(rd / "export" / "model.onnx"))
    assert not [n for n in model.graph.node if n.op_type == "If"]
    assert [i.name for i in model.graph.input] == ["x"]  # the fixed input is bound, nothing can feed it
    assert {p.key: p.value for p in model.metadata_props}["qdq_tune.fixed_inputs"] == '{"sr": 16000}'
    ours = ort.InferenceSession(model.SerializeToString())
    theirs = ort.InferenceSession(str(path))
    for f in sorted(feeds.glob("*.npz")):
        d = dict(np.load(f))
        np.testing.assert_array_equal(ours.run(None, {"x": d["x"]})[0], theirs.run(None, d)[0])
    from tasks.autotune.region.inspect import inspect_model

    assert "Specialized on fixed inputs {'sr': 16000}" in inspect_model(rd / "export" / "model.onnx")
    assert "If if_rate: 9 body nodes, 3 weighted; float: If bodies stay float" in inspect_model(path)
    q = json.loads((rd / "manifest.json").read_text())["stages"]["quantize"]["metrics"]
    assert {"hi/conv1", "hi/conv2"} <= set(q["node_rules"]), q["node_rules"]  # the branch's convs, now quantized
    assert q["accuracy"]["ok"], q["headline"]


def test_feed_with_another_value_of_a_fixed_input_is_refused_with_one_line(tmp_path):
    path = models.save(models.if_on_rate(), tmp_path, "if_on_rate")
    feeds = _feeds(tmp_path / "feeds", 16000)
    np.savez(feeds / "005.npz", x=np.zeros((1, 1, 64), np.float32), sr=np.array(8000, np.int64))
    proc, rd = _tune(tmp_path, path, feeds)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tune: error: feed file ") and "005.npz: input 'sr' is 8000, but the model is " \
        "specialized for model.fixed_inputs.sr=16000" in last, last
    assert not (rd / "export" / "model.onnx").exists()


def test_fixed_input_the_model_does_not_have_is_a_one_line_error(tmp_path):
    path = models.save(models.if_on_rate(), tmp_path, "if_on_rate")
    proc, _ = _tune(tmp_path, path, _feeds(tmp_path / "feeds", 16000), extra=["model.fixed_inputs={rate: 1}"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "tune: error: model.fixed_inputs names 'rate', but"), proc.stderr[-500:]


def test_lstm_is_unrolled_exactly_and_its_matmuls_quantized(tmp_path):
    """A torch LSTM (5 steps, batch 2, h0/c0 inputs): quantize unrolls it into MatMuls (float outputs
    equal within 1e-5), quantizes them and meets the budget."""
    from pipeline.transforms.rnn import lower_lstm

    path = models.save(models.stateful_rnn(batch=2), tmp_path, "rnn")
    model = onnx.load(str(path))
    lowered, records = lower_lstm(model)
    assert records and all(r["lowered"] for r in records), records
    rng = np.random.default_rng(0)
    feeds = {i.name: (0.5 * rng.standard_normal([d.dim_value for d in i.type.tensor_type.shape.dim]))
             .astype(np.float32) for i in model.graph.input}
    a = ort.InferenceSession(model.SerializeToString()).run(None, feeds)
    b = ort.InferenceSession(lowered.SerializeToString()).run(None, feeds)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)

    rd = tmp_path / "run"
    run_tune([f"results_dir={rd}", "model=onnx", f"model.onnx_path={path}", "stages=[export,quantize]",
              "data=synthetic", "progress=false"], cwd=tmp_path, check=True)
    q = json.loads((rd / "manifest.json").read_text())["stages"]["quantize"]["metrics"]
    lowering = next(t for t in q["transforms"] if t["transform"] == "rnn_lowering")
    assert lowering["applied"] and lowering["float_rel_error"] <= 1e-5, lowering
    lstm_matmuls = [n for n in q["node_rules"] if "/lowered/MatMul" in n]
    assert len(lstm_matmuls) >= 2, q["node_rules"]  # the input projection and recurrent products
    assert q["accuracy"]["ok"] and "unrolled 1 LSTM(s)" in q["headline"], q["headline"]
