"""The TensorRT builder settings a tuned model ships with (autotune/trt_build.json), for the tensorrt
and trtexec backends: ``TrtBuildSettings``. Like ONNX Runtime's session settings
(pipeline.backends.onnxruntime.session) they are not stored in the model, and the engine's speed depends
on them.

Each setting is one documented knob with two spellings (``KNOBS``): the trtexec flag the trtexec
backend adds to its build command (``trtexec_flags``) and the ``IBuilderConfig`` attribute the tensorrt
backend sets (``apply``). A field left None changes nothing: the backend's own configuration
(backend.builder_optimization_level, backend.trtexec_args) and TensorRT's defaults stand.

Nothing here imports TensorRT: ``apply`` is handed the module the backend imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.backends.settings import RuntimeSettings, check_integer
from pipeline.errors import StageError


@dataclass(frozen=True)
class BuildKnob:
    """One builder setting: its TrtBuildSettings field (also the IBuilderConfig attribute of TensorRT's
    Python API), its trtexec flag, the values TensorRT accepts and the first version that has it."""

    field: str
    flag: str
    low: int
    high: int | None  # None: no documented upper bound
    since: tuple[int, int]
    enum: str | None = None  # the tensorrt enum the Python attribute takes (members in value order)
    names: tuple[str, ...] = ()  # the enum's member names by value, for messages


# Sources: trtexec --help (samples/common/sampleOptions.cpp of TensorRT 10.8 to 11.1) and the Python API's
# IBuilderConfig reference (python/docstrings/infer/pyCoreDoc.h, the same releases).
KNOBS: tuple[BuildKnob, ...] = (
    # "--builderOptimizationLevel  Set the builder optimization level. (default is 3) ... Valid values include
    # integers from 0 to the maximum optimization level, which is currently 5"; IBuilderConfig.builder_optimization_level
    BuildKnob("builder_optimization_level", "--builderOptimizationLevel", 0, 5, (8, 6)),
    # "--tilingOptimizationLevel  Set the tiling optimization level. (default is 0) ... from 0 to the maximum tiling
    # optimization level(3)"; IBuilderConfig.tiling_optimization_level takes trt.TilingOptimizationLevel
    # (NONE, FAST, MODERATE, FULL); both appear in TensorRT 10.8
    BuildKnob("tiling_optimization_level", "--tilingOptimizationLevel", 0, 3, (10, 8), "TilingOptimizationLevel",
              ("NONE", "FAST", "MODERATE", "FULL")),
    # "--maxAuxStreams=N  Set maximum number of auxiliary streams per inference stream ... Set this to 0 for
    # optimal memory usage. (default = using heuristics)"; IBuilderConfig.max_aux_streams
    BuildKnob("max_aux_streams", "--maxAuxStreams", 0, None, (8, 6)),
)
KNOB = {k.field: k for k in KNOBS}


@dataclass(frozen=True)
class TrtBuildSettings(RuntimeSettings):
    """The builder settings a model ships with (autotune/trt_build.json); None: left as configured."""

    what = "TensorRT build settings"

    builder_optimization_level: int | None = None
    tiling_optimization_level: int | None = None
    max_aux_streams: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for k in KNOBS:
            check_integer(k.field, getattr(self, k.field), k.low, k.high, nullable=True)

    def knobs(self) -> list[tuple[BuildKnob, int]]:
        """The knobs these settings change, with their values, in ``KNOBS`` order."""
        return [(k, v) for k in KNOBS if (v := getattr(self, k.field)) is not None]

    def trtexec_flags(self) -> list[str]:
        """The trtexec build flags, e.g. ``["--builderOptimizationLevel=5", "--maxAuxStreams=0"]``."""
        return [f"{k.flag}={v}" for k, v in self.knobs()]

    def apply(self, trt: Any, config: Any) -> None:
        """Set these settings on an IBuilderConfig of ``trt`` (tensorrt or TensorRT-RTX's bindings). A
        setting this TensorRT lacks is a StageError: the engine would not be the one that was measured."""
        for k, v in self.knobs():
            if not hasattr(config, k.field) or (k.enum and not hasattr(trt, k.enum)):
                version = getattr(trt, "__version__", "?")
                raise StageError(f"TensorRT build setting {k.field}={v}: {trt.__name__} {version} has no "
                                 f"IBuilderConfig.{k.field} (TensorRT {k.since[0]}.{k.since[1]} or later); "
                                 f"re-run autotune with this TensorRT")
            if k.enum:
                members = getattr(trt, k.enum).__members__.values()
                setattr(config, k.field, next(m for m in members if int(m) == v))
            else:
                setattr(config, k.field, int(v))

    def describe(self) -> str:
        parts = []
        for k, v in self.knobs():
            shown = f"{v} ({k.names[v]})" if k.names else str(v)
            parts.append(f"{k.field.replace('_', ' ')} {shown}")
        return "; ".join(parts) or "the backend's own build settings"


__all__ = ["KNOB", "KNOBS", "BuildKnob", "TrtBuildSettings"]
