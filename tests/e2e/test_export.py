"""The `tune` app end to end on the export stage: results_dir, manifest, skip/re-run, multirun."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests import models
from tests.helpers import run_tune


def test_default_export_is_verified_and_rerun_skips(digits_results, tmp_path):
    model_path = digits_results / "export" / "model.onnx"
    onnx.checker.check_model(onnx.load(str(model_path)), full_check=True)
    manifest = json.loads((digits_results / "manifest.json").read_text())
    entry = manifest["stages"]["export"]
    assert entry["status"] == "done"
    assert entry["metrics"]["max_abs_diff"] < 1e-4
    assert entry["metrics"]["torch_test_top1"] >= 0.95
    assert entry["outputs"]["export/model.onnx"]["sha256"]
    assert (digits_results / ".hydra" / "config.yaml").exists()
    again = run_tune(["stages=[export]", f"results_dir={digits_results}"], cwd=tmp_path, check=True)
    assert "export: up to date, skipped" in again.stderr


def test_changed_config_reruns(tmp_path):
    args = ["stages=[export]", "model=bert_tiny", "model.seq_len=8", "model.hidden_size=16", "model.vocab_size=50",
            f"results_dir={tmp_path / 'r'}"]
    run_tune(args, cwd=tmp_path, check=True)
    first = json.loads((tmp_path / "r" / "manifest.json").read_text())["stages"]["export"]["fingerprint"]
    proc = run_tune([*args, "model.num_layers=1"], cwd=tmp_path, check=True)
    assert "export: running" in proc.stderr
    second = json.loads((tmp_path / "r" / "manifest.json").read_text())["stages"]["export"]["fingerprint"]
    assert first != second


def test_trained_digits_weights_are_reused_by_another_results_dir(tmp_path):
    """digits_cnn trained once is kept in the user's cache: another results_dir (a sweep's next job, a new
    run) loads it and exports the same model; export.cache_trained_weights=false trains again."""
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    small = ["stages=[export]", "model.epochs=1", "model.channels=[4,8]", "progress=false"]
    run_tune([*small, f"results_dir={tmp_path / 'a'}"], cwd=tmp_path, check=True, env=env)
    again = run_tune([*small, f"results_dir={tmp_path / 'b'}"], cwd=tmp_path, check=True, env=env)
    assert f"reusing trained digits_cnn weights from {tmp_path / 'cache' / 'qdq-tune'}" in again.stderr
    assert (tmp_path / "a" / "export" / "model.onnx").read_bytes() == (tmp_path / "b" / "export" / "model.onnx").read_bytes()
    assert (tmp_path / "b" / "export" / "digits_cnn.pt").exists()  # the run keeps its own copy
    for pt in (tmp_path / "cache" / "qdq-tune").glob("digits_cnn-*.pt"):  # a broken cache copy: trained again
        pt.write_bytes(b"not a checkpoint")
    broken = run_tune([*small, f"results_dir={tmp_path / 'd'}"], cwd=tmp_path, check=True, env=env)
    assert "do not load" in broken.stderr and "trained digits_cnn in" in broken.stderr
    fresh = run_tune([*small, "export.cache_trained_weights=false", f"results_dir={tmp_path / 'c'}"], cwd=tmp_path,
                     check=True, env=env)
    assert "reusing" not in fresh.stderr and "trained digits_cnn in" in fresh.stderr


@pytest.mark.parametrize("model_args", [
    ["model=resnet18", "model.input_size=32"],
    ["model=resnet50", "model.input_size=32", "model.num_classes=10"],
    ["model=bert_tiny", "model.seq_len=16"],
])
def test_builtin_models_export_and_verify(model_args, tmp_path):
    run_tune(["stages=[export]", *model_args, f"results_dir={tmp_path / 'r'}"], cwd=tmp_path, check=True)
    entry = json.loads((tmp_path / "r" / "manifest.json").read_text())["stages"]["export"]
    assert entry["status"] == "done" and entry["metrics"]["max_abs_diff"] <= entry["metrics"]["verify_tolerance"]


def test_multirun_gives_each_job_its_own_results_dir(tmp_path):
    proc = run_tune(["-m", "seed=1,2", "stages=[export]", "model=bert_tiny", "model.seq_len=8",
                     f"results_dir={tmp_path / 'sweep'}"], cwd=tmp_path, check=True)
    manifests = sorted((tmp_path / "sweep").rglob("manifest.json"))
    assert len(manifests) == 2, proc.stderr
    assert manifests[0].parent != manifests[1].parent


def test_onnx_model_input(tmp_path):
    dyn = models.save(models.with_dynamic_batch(models.conv_chain()), tmp_path, "dyn")
    proc = run_tune(["stages=[export]", "model=onnx", f"model.onnx_path={dyn}", f"results_dir={tmp_path / 'a'}"],
                    cwd=tmp_path)
    assert proc.returncode != 0 and "model.input_shapes=" in proc.stderr and "Traceback" not in proc.stderr
    run_tune(["stages=[export]", "model=onnx", f"model.onnx_path={dyn}", "model.input_shapes={input:[4,3,16,16]}",
              f"results_dir={tmp_path / 'b'}"], cwd=tmp_path, check=True)
    fixed = onnx.load(str(tmp_path / "b" / "export" / "model.onnx"))
    assert [d.dim_value for d in fixed.graph.input[0].type.tensor_type.shape.dim] == [4, 3, 16, 16]


USER_MODEL = '''
import torch
class Net(torch.nn.Module):
    def __init__(self, width=8):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, width, 3, padding=1)
        self.fc = torch.nn.Linear(width, 4)
    def forward(self, x):
        return self.fc(torch.relu(self.conv(x)).mean((2, 3)))
'''


def test_user_model_target_with_checkpoint(tmp_path):
    import torch

    (tmp_path / "user_net.py").write_text(USER_MODEL)
    env = {"PYTHONPATH": str(tmp_path)}
    import importlib.util

    spec = importlib.util.spec_from_file_location("user_net", tmp_path / "user_net.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    torch.manual_seed(3)
    torch.save(mod.Net(width=16).state_dict(), tmp_path / "net.pt")
    base = ["stages=[export]", "model=custom", "model._target_=user_net.Net", "model.args.width=16",
            "model.input_shapes={input:[2,3,16,16]}"]
    run_tune([*base, f"model.checkpoint={tmp_path / 'net.pt'}", f"results_dir={tmp_path / 'r'}"], cwd=tmp_path,
             check=True, env=env)
    entry = json.loads((tmp_path / "r" / "manifest.json").read_text())["stages"]["export"]
    assert entry["metrics"]["inputs"] == {"input": [2, 3, 16, 16]} and entry["metrics"]["max_abs_diff"] < 1e-4
    bad = run_tune([*base[:2], "model._target_=user_net.Nope", *base[3:], f"results_dir={tmp_path / 'b'}"],
                   cwd=tmp_path, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == \
        "tune: error: model._target_=user_net.Nope: module 'user_net' has no attribute 'Nope'"
    wrong = run_tune([*base, f"model.checkpoint={tmp_path / 'missing.pt'}", f"results_dir={tmp_path / 'c'}"],
                     cwd=tmp_path, env=env)
    assert wrong.returncode != 0 and "missing.pt does not exist" in wrong.stderr


@pytest.mark.slow
def test_a_model_stored_with_external_data_runs_and_a_changed_data_file_reruns_export(tmp_path):
    """Weights in a .data file beside the .onnx: the pipeline reads them, the shipped model runs in ORT
    from its path, and new weights in the .data file alone (the .onnx unchanged) re-run export."""
    import onnxruntime as ort

    from tests.helpers import QUICK

    def write(seed: int, folder) -> None:
        folder.mkdir(exist_ok=True)
        onnx.save(models.conv_chain(seed=seed), str(folder / "m.onnx"), save_as_external_data=True,
                  all_tensors_to_one_file=True, location="m.onnx.data", size_threshold=0)

    write(0, tmp_path)
    onnx_bytes = (tmp_path / "m.onnx").read_bytes()
    rd = tmp_path / "r"
    args = ["stages=[export,quantize,autotune]", "model=onnx", f"model.onnx_path={tmp_path / 'm.onnx'}",
            "data=synthetic", f"results_dir={rd}", *QUICK]
    run_tune(args, cwd=tmp_path, check=True)
    shipped = rd / "autotune" / "optimized_final.onnx"
    sess = ort.InferenceSession(str(shipped), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"input": np.zeros((2, 3, 16, 16), np.float32)})[0].shape == (2, 10)
    write(1, tmp_path / "retrained")  # same shapes, so the same offsets: only the data file differs
    (tmp_path / "m.onnx.data").write_bytes((tmp_path / "retrained" / "m.onnx.data").read_bytes())
    assert (tmp_path / "m.onnx").read_bytes() == onnx_bytes
    again = run_tune(args, cwd=tmp_path, check=True)
    assert "export: up to date" not in again.stderr and "export: done" in again.stderr


@pytest.mark.slow
def test_weights_stored_outside_the_model_stay_there_through_every_stage(tmp_path):
    """The 2 GB case in small (bench/large_model.py has the real one): MatMul weights of 256 KB in a
    .data file go through export, quantize, autotune and evaluate kept on disk (every stage's model
    carries its own .data file); the shipped model runs in ORT from its path within 0.10 of float."""
    import sys

    import onnxruntime as ort

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from large_model import write_big_model

    src = write_big_model(tmp_path / "src" / "big.onnx", layers=3, width=256)
    rd = tmp_path / "r"
    run_tune(["stages=[export,quantize,autotune,evaluate]", "model=onnx", f"model.onnx_path={src}", "data=synthetic",
              "autotune.preset=quick", "autotune.schemes_per_region=2", "evaluate.max_batches=2", "evaluate.plot=false",
              "evaluate.latency_repeats=1", "backend.warmup_runs=1", "autotune.timing_runs=8", "progress=false",
              f"results_dir={rd}"], cwd=tmp_path, check=True)
    for f in ("export/model.onnx", "quantize/float_model.onnx", "autotune/baseline.onnx"):
        assert (rd / (f + ".data")).stat().st_size == 3 * 256 * 256 * 4, f  # float weights, one copy each
    assert not list((rd / "autotune").glob("*-big.onnx.data"))  # no working links left beside the artifacts
    x = {"input": np.random.default_rng(1).standard_normal((4, 256)).astype(np.float32)}
    ref = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"]).run(None, x)[0]
    got = ort.InferenceSession(str(rd / "autotune" / "optimized_final.onnx"),
                               providers=["CPUExecutionProvider"]).run(None, x)[0]
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) <= 0.10
    assert not json.loads((rd / "evaluate" / "metrics.json").read_text())["over_budget"]
