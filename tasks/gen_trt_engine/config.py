"""Schema of the `gen_trt_engine` group (TAO-style keys)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig

from pipeline.backend_config import EngineBuildConfig, shape_problems


@dataclass
class GenTrtEngineConfig:
    onnx_file: Optional[str] = None  # default: newest model in results_dir
    # the build options, declared once beside the builders that take them (pipeline.backends.tensorrt.common)
    tensorrt: EngineBuildConfig = field(default_factory=EngineBuildConfig)


SCHEMA = GenTrtEngineConfig


def validate(cfg: DictConfig) -> list[str]:
    t = cfg.gen_trt_engine.tensorrt
    problems = []
    if not 1 <= t.min_batch_size <= t.opt_batch_size <= t.max_batch_size:
        problems.append(
            "gen_trt_engine.tensorrt: need 1 <= min_batch_size <= opt_batch_size <= max_batch_size, got "
            f"{t.min_batch_size}, {t.opt_batch_size}, {t.max_batch_size}"
        )
    if t.workspace_size is None or t.workspace_size < 1:  # null is for measurement builds (the backend's)
        problems.append(f"gen_trt_engine.tensorrt.workspace_size={t.workspace_size}: must be >= 1 (MB)")
    # min/opt/max shapes name the same inputs, with equal ranks, dims >= 1 and min <= opt <= max per dim
    # (the same check every TensorRT build runs)
    problems += shape_problems(t.min_shapes, t.opt_shapes, t.max_shapes, "gen_trt_engine.tensorrt")
    return problems
