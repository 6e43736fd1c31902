"""The `backend` sections of TensorRT, TensorRT-RTX (the same schema) and trtexec: their schemas, which
conf/backend/tensorrt.yaml, tensorrt_rtx.yaml and trtexec.yaml extend."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from pipeline.backend_config import BackendConfig


@dataclass
class TensorRTBackendConfig(BackendConfig):
    name: str = "tensorrt"
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
    name: str = "trtexec"
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
