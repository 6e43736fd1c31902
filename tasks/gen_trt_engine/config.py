"""Schema of the `gen_trt_engine` group (TAO-style keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import DictConfig


class DataType(str, Enum):
    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"


@dataclass
class TensorRTSettings:
    data_type: DataType = DataType.FP32  # builder precision for float layers (Q/DQ models are strongly typed)
    workspace_size: int = 1024  # MB
    # batch shortcut for inputs whose first dim is dynamic; explicit shapes below win
    min_batch_size: int = 1
    opt_batch_size: int = 1
    max_batch_size: int = 1
    # input name -> shape, per optimization profile point
    min_shapes: dict[str, list[int]] = field(default_factory=dict)
    opt_shapes: dict[str, list[int]] = field(default_factory=dict)
    max_shapes: dict[str, list[int]] = field(default_factory=dict)
    timing_cache: Optional[str] = None  # persistent timing cache file shared across builds
    # plugin libraries (.so/.dll) loaded before parsing, in addition to backend.plugin_libraries
    plugin_libraries: list[str] = field(default_factory=list)


@dataclass
class GenTrtEngineConfig:
    onnx_file: Optional[str] = None  # default: newest model in results_dir
    tensorrt: TensorRTSettings = field(default_factory=TensorRTSettings)


SCHEMA = GenTrtEngineConfig


def validate(cfg: DictConfig) -> list[str]:
    t = cfg.gen_trt_engine.tensorrt
    problems = []
    if not 1 <= t.min_batch_size <= t.opt_batch_size <= t.max_batch_size:
        problems.append(
            "gen_trt_engine.tensorrt: need 1 <= min_batch_size <= opt_batch_size <= max_batch_size, got "
            f"{t.min_batch_size}, {t.opt_batch_size}, {t.max_batch_size}"
        )
    if t.workspace_size < 1:
        problems.append(f"gen_trt_engine.tensorrt.workspace_size={t.workspace_size}: must be >= 1 (MB)")
    problems += _shape_problems(t)
    return problems


def _shape_problems(t: DictConfig) -> list[str]:
    """min/opt/max shapes name the same inputs, with equal ranks, dims >= 1 and min <= opt <= max per dim
    (the same check every TensorRT build runs)."""
    from pipeline.backends.trt_common import shape_problems

    return shape_problems(t.min_shapes, t.opt_shapes, t.max_shapes, "gen_trt_engine.tensorrt")
