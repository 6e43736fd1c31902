"""ONNX Runtime's `backend` section (``backend=onnxruntime``, and ``backend.onnxruntime`` under auto): its
schema, which conf/backend/onnxruntime.yaml extends."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pipeline.backend_config import BackendConfig


class GraphOptimizationLevel(str, Enum):
    disable = "disable"
    basic = "basic"
    extended = "extended"
    layout = "layout"
    all = "all"


@dataclass
class OnnxRuntimeBackendConfig(BackendConfig):
    name: str = "onnxruntime"
    providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    # 0 = one thread per physical core; the pipeline's own sessions (calibration, checks) and calibration's
    # worker processes use it too
    intra_op_threads: int = 0
    graph_optimization_level: GraphOptimizationLevel = GraphOptimizationLevel.all
    # ORT worker threads spin after each run by default; when models are measured in alternation,
    # one session's spinning threads slow the next session's runs, so placement's measurement sessions
    # do not spin unless asked to. A model measured with session settings (the runtime search, the
    # shipped model, the float baselines it is compared with) runs as deployed: spinning, ORT's default
    allow_spinning: bool = False
