"""Schemas of the `backend` group: how latency is measured and engines are built, one dataclass per
runtime (conf/backend/*.yaml extend them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import MISSING


class BackendName(str, Enum):
    onnxruntime = "onnxruntime"
    tensorrt = "tensorrt"
    tensorrt_rtx = "tensorrt_rtx"
    trtexec = "trtexec"
    openvino = "openvino"


@dataclass
class BackendConfig:
    name: BackendName = MISSING
    warmup_runs: int = 10
    timing_runs: int = 50


class GraphOptimizationLevel(str, Enum):
    disable = "disable"
    basic = "basic"
    extended = "extended"
    layout = "layout"
    all = "all"


@dataclass
class OnnxRuntimeBackendConfig(BackendConfig):
    name: BackendName = BackendName.onnxruntime
    providers: list[str] = field(default_factory=lambda: ["CPUExecutionProvider"])
    # 0 = one thread per physical core; the pipeline's own sessions (calibration, checks) use it too
    intra_op_threads: int = 0
    graph_optimization_level: GraphOptimizationLevel = GraphOptimizationLevel.all
    # ORT worker threads spin after each run by default; when models are measured in alternation,
    # one session's spinning threads slow the next session's runs, so placement's measurement sessions
    # do not spin unless asked to. A model measured with session settings (the runtime search, the
    # shipped model, the float baselines it is compared with) runs as deployed: spinning, ORT's default
    allow_spinning: bool = False


@dataclass
class TensorRTBackendConfig(BackendConfig):
    name: BackendName = BackendName.tensorrt
    # builder precision of float (no Q/DQ) models in measurement builds: the precision-matched
    # baseline every speedup is reported against (Q/DQ models are strongly typed)
    float_precision: str = "FP16"
    device: int = 0
    workspace_size: int = 1024  # MB
    builder_optimization_level: int = 3
    timing_cache: Optional[str] = None
    plugin_libraries: list[str] = field(default_factory=list)


@dataclass
class TrtexecBackendConfig(BackendConfig):
    name: BackendName = BackendName.trtexec
    float_precision: str = "FP16"  # as for backend=tensorrt; FP32 for TensorRT 11 (strongly typed only)
    trtexec_path: str = "trtexec"
    # measure for a fixed time instead of timing_runs iterations (seconds; 0 = use iterations)
    duration: float = 0.0
    warmup_ms: int = 200  # trtexec --warmUp is in milliseconds
    timing_cache: Optional[str] = None
    plugin_libraries: list[str] = field(default_factory=list)
    trtexec_args: list[str] = field(default_factory=list)
    export_profile: bool = False
    export_layer_info: bool = False
    timeout: float = 0.0  # seconds per trtexec run before it is killed; 0 = no limit


class OpenVinoPrecision(str, Enum):
    """OpenVINO's INFERENCE_PRECISION_HINT for what runs in float: ``default`` is what OpenVINO picks
    on this CPU (bf16 where it has AMX or AVX-512 BF16, f32 elsewhere)."""

    default = "default"
    bf16 = "bf16"
    f16 = "f16"
    f32 = "f32"


class OpenVinoHint(str, Enum):
    LATENCY = "LATENCY"
    THROUGHPUT = "THROUGHPUT"
    CUMULATIVE_THROUGHPUT = "CUMULATIVE_THROUGHPUT"


@dataclass
class OpenVinoBackendConfig(BackendConfig):
    name: BackendName = BackendName.openvino
    device: str = "CPU"
    inference_precision: OpenVinoPrecision = OpenVinoPrecision.default
    performance_hint: OpenVinoHint = OpenVinoHint.LATENCY
    threads: int = 0  # INFERENCE_NUM_THREADS; 0: OpenVINO's choice for the hint
    streams: int = 0  # NUM_STREAMS; 0: OpenVINO's choice for the hint
    cache_dir: Optional[str] = None  # CACHE_DIR: compiled models kept here, so a second compile is fast
