"""A runtime is a plugin: one defined only in this file (ONNX's own reference evaluator, plain numpy)
goes through every stage by `backend=custom backend._target_=...`, with nothing in tasks/ knowing it."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest

from pipeline.backend_config import BackendConfig
from pipeline.backends.base import (
    Backend,
    BuildResult,
    Deployment,
    DeploymentMetrics,
    FusionSource,
    PreparedModel,
)
from pipeline.data.adapters import fixed_feeds
from pipeline.graph.model import input_specs, load_model
from tests.helpers import QUICK, run_tune

TARGET = "tests.e2e.test_runtime_plugin.ReferenceRuntime"
ROOT = Path(__file__).resolve().parents[2]


class ReferencePrepared(PreparedModel):
    def __init__(self, model: onnx.ModelProto):
        from onnx.reference import ReferenceEvaluator
        from onnx.version_converter import convert_version

        self.specs = input_specs(model)
        # the evaluator implements QuantizeLinear/DequantizeLinear from opset 19 on
        self.evaluator = ReferenceEvaluator(convert_version(model, 21))
        self._feeds = fixed_feeds(self.specs)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return list(self.evaluator.run(None, feeds))

    def set_timing_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        self._feeds = {k: feeds[k] for k in self._feeds}

    def time_runs(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            self.evaluator.run(None, self._feeds)
            out.append((time.perf_counter() - t0) * 1e3)
        return out


class ReferenceRuntime(Backend):
    """ONNX's reference evaluator as a runtime: Q/DQ run as plain math (TensorRT's placement, judged as
    Q/DQ math), every node its own fusion group, and a deployable artifact of its own."""

    name = "onnx_reference"
    placement = "tensorrt"

    def check_available(self) -> None:
        from onnx.reference import ReferenceEvaluator  # noqa: F401 - part of onnx: always here

    def prepare(self, model_path, profile: bool = False) -> PreparedModel:
        return ReferencePrepared(load_model(model_path, check=False))

    def build(self, model_path, out_path=None, log_path=None) -> BuildResult:
        return BuildResult(None, None, {"nodes": len(load_model(model_path, check=False).graph.node)})

    def fusion_source(self, model_path: Path, out_dir: Path, stem: str) -> FusionSource:
        return FusionSource("the reference evaluator runs every node alone", optimized=load_model(model_path))

    def deploy(self, model_path: Path, out_dir: Path, source: str, cfg) -> Deployment:
        model = load_model(model_path)
        out, facts = out_dir / "model.reference.onnx", out_dir / "build.json"
        onnx.save(model, str(out))
        facts.write_text(json.dumps({"nodes": len(model.graph.node), "source": source}))
        return Deployment({"model.reference.onnx": out, "build.json": facts},
                          DeploymentMetrics(source=source, headline=f"{self.name}: {out.name} from {source}"))


def test_a_runtime_defined_in_a_test_file_goes_through_every_stage(residual_models, tmp_path):
    rd = tmp_path / "r"
    args = ["model=onnx", f"model.onnx_path={residual_models['tiny']}", "data=synthetic", "backend=custom",
            f"backend._target_={TARGET}", "backend.timing_runs=4", *QUICK, "autotune.schemes_per_region=2",
            "evaluate.plot=false", f"results_dir={rd}"]
    env = {"PYTHONPATH": str(ROOT)}  # the runtime lives in this file
    run_tune(args, cwd=tmp_path, check=True, env=env)
    stages = json.loads((rd / "manifest.json").read_text())["stages"]
    assert set(stages) == {"export", "quantize", "autotune", "gen_trt_engine", "evaluate"}
    assert stages["quantize"]["metrics"]["placement"] == "tensorrt"
    assert stages["autotune"]["metrics"]["runtime"]["searched"] is False  # it has no settings to search
    assert "onnx_reference" in stages["autotune"]["metrics"]["final_line"]
    assert (rd / "gen_trt_engine" / "model.reference.onnx").exists()
    assert stages["gen_trt_engine"]["metrics"]["headline"].startswith("onnx_reference: model.reference.onnx")
    assert stages["evaluate"]["metrics"]["headline"]
    # a target that is no Backend is one line and exit 2
    bad = run_tune([*args[:4], "backend._target_=tests.helpers.QUICK", *args[5:]], cwd=tmp_path, env=env)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        "tune: error: invalid config: backend._target_=tests.helpers.QUICK: not a runtime")


def test_a_runtime_of_your_own_joins_backend_auto(residual_models, tmp_path):
    """`backend.runtimes=[onnxruntime, custom] backend.custom._target_=...`: the plugin races with the
    built-in runtimes (its float timed beside theirs before anything is quantized) and quantizes in its own
    results_dir where it stays in reach; nothing names it but the config."""
    rd = tmp_path / "r"
    args = ["model=onnx", f"model.onnx_path={residual_models['tiny']}", "data=synthetic", "backend=auto",
            "backend.runtimes=[onnxruntime,custom]", f"backend.custom._target_={TARGET}", "backend.timing_runs=4",
            "stages=[export,quantize]", f"results_dir={rd}"]
    env = {"PYTHONPATH": str(ROOT)}
    run_tune(args, cwd=tmp_path, check=True, env=env)
    race = json.loads((rd / "autotune" / "float_race.json").read_text())
    entries = {e["runtime"]: e for e in race["entries"]}
    assert set(entries) == {"onnxruntime", "custom"} and entries["custom"]["float_ms"] > 0
    assert (rd / "runtimes" / "onnxruntime" / "quantize" / "quantized_model.onnx").exists()
    assert (rd / "runtimes" / "custom" / "quantize").exists() != entries["custom"]["dropped"]
    # a custom runtime without its class is one line, before any stage runs
    bad = run_tune([a for a in args if not a.startswith("backend.custom")], cwd=tmp_path, env=env)
    assert bad.returncode == 2 and "backend._target_: required for a custom runtime" in bad.stderr


@dataclass
class ReferenceRuntimeConfig(BackendConfig):
    """The registered runtime's own `backend` section (what a built-in runtime keeps in its config.py)."""

    name: str = "reference"
    rounds: int = 1  # a setting of its own, reachable as backend.reference.rounds under auto


@pytest.fixture()
def registered(monkeypatch):
    """``ReferenceRuntime`` registered as a built-in runtime by one line of RUNTIMES; the registry and the
    config groups as they were afterwards."""
    from pipeline import backend_config, config

    line = backend_config.Runtime("reference", TARGET, "tests.e2e.test_runtime_plugin.ReferenceRuntimeConfig")
    monkeypatch.setattr(backend_config, "RUNTIMES", (*backend_config.RUNTIMES, line))
    monkeypatch.setattr(config, "_registered", False)
    config.register_configs()
    yield line
    monkeypatch.undo()
    config._registered = False
    config.register_configs()


def test_a_runtime_added_by_one_registry_line_joins_backend_auto(registered, residual_models, tmp_path):
    """One line of RUNTIMES (plus the runtime's own class, schema and conf file) makes a built-in runtime:
    `backend.name`, `backend.runtimes`, auto's `backend.reference` section and the config group follow;
    under backend=auto it races the others before quantize and quantizes where it stays in reach."""
    from pipeline.api import tune
    from pipeline.app.cli import checked_config
    from pipeline.backends import builtin_runtimes, times_on_host_cpu

    assert builtin_runtimes()["reference"] == TARGET and times_on_host_cpu("reference") is False
    specs = tmp_path / "specs"
    (specs / "backend").mkdir(parents=True)
    (specs / "backend" / "reference.yaml").write_text("defaults:\n  - base_reference\n  - _self_\nrounds: 2\n")
    (specs / "run.yaml").write_text("defaults:\n  - tune\n  - _self_\n")
    alone = checked_config(["backend=reference"], str(specs), "run")  # its conf file extends base_reference
    assert alone.backend.name == "reference" and alone.backend.rounds == 2
    rd = tmp_path / "r"
    args = ["model=onnx", f"model.onnx_path={residual_models['tiny']}", "data=synthetic", "backend=auto",
            "backend.runtimes=[onnxruntime,reference]", "backend.reference.rounds=3", "backend.timing_runs=4",
            "stages=[export,quantize]", f"results_dir={rd}"]
    tune(args, spec=specs / "run.yaml")
    race = json.loads((rd / "autotune" / "float_race.json").read_text())
    entries = {e["runtime"]: e for e in race["entries"]}
    assert set(entries) == {"onnxruntime", "reference"} and entries["reference"]["float_ms"] > 0
    assert (rd / "runtimes" / "onnxruntime" / "quantize" / "quantized_model.onnx").exists()
    assert (rd / "runtimes" / "reference" / "quantize").exists() != entries["reference"]["dropped"]
    auto = checked_config(args, str(specs), "run").backend  # auto's section of it, from the registry line
    assert auto.reference.name == "reference" and auto.reference.rounds == 3 and "reference" in auto.runtimes
