"""OpenVINO's `backend` section (``backend=openvino``, and ``backend.openvino`` under auto): its schema,
which conf/backend/openvino.yaml extends."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Optional

from pipeline.backend_config import BackendConfig


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
    name: str = "openvino"
    device: str = "CPU"
    inference_precision: OpenVinoPrecision = OpenVinoPrecision.default
    performance_hint: OpenVinoHint = OpenVinoHint.LATENCY
    threads: int = 0  # INFERENCE_NUM_THREADS; 0: OpenVINO's choice for the hint
    streams: int = 0  # NUM_STREAMS; 0: OpenVINO's choice for the hint
    cache_dir: Optional[str] = None  # CACHE_DIR: compiled models kept here, so a second compile is fast
