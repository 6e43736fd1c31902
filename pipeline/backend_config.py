"""Schemas of the `backend` group: how latency is measured and engines are built, one dataclass per
runtime (conf/backend/*.yaml extend them)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig

from pipeline.values import enum_value

# --------------------------------------------------------------------------- TensorRT build options


class DataType(str, Enum):
    """Builder precision of float layers (Q/DQ models are strongly typed: their precision is the model's)."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"


@dataclass
class EngineBuildConfig:
    """What one engine build asks for: the `gen_trt_engine.tensorrt` schema (TAO-style keys, YAML keys equal
    field names, validated by tasks/gen_trt_engine/config.py) and what the tensorrt, tensorrt_rtx and
    trtexec builders take. Measurement builds fill it from the backend section (``from_backend_cfg``)."""

    data_type: DataType = DataType.FP32  # builder precision for float layers (Q/DQ models are strongly typed)
    # MB; None: the runtime's default (measurement builds on a backend without backend.workspace_size;
    # gen_trt_engine asks for a size)
    workspace_size: Optional[int] = 1024
    # batch shortcut for inputs whose first dim is the only dynamic one; explicit shapes below win
    min_batch_size: int = 1
    opt_batch_size: int = 1
    max_batch_size: int = 1
    # input name -> shape, per optimization profile point; an input named here gets exactly these shapes
    min_shapes: dict[str, list[int]] = field(default_factory=dict)
    opt_shapes: dict[str, list[int]] = field(default_factory=dict)
    max_shapes: dict[str, list[int]] = field(default_factory=dict)
    # persistent timing cache file shared across builds (relative to where tune started until a stage or
    # backend resolves it with user_path)
    timing_cache: Optional[str] = None
    # plugin libraries (.so/.dll) loaded before parsing, in addition to backend.plugin_libraries
    plugin_libraries: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # OmegaConf's enum members, a backend's float_precision ("bf16") and any case become one member
        self.data_type = DataType(enum_value(self.data_type).upper())

    @property
    def timing_cache_path(self) -> Path | None:
        """``timing_cache`` as the path the builders open (None: no persistent cache)."""
        return Path(self.timing_cache) if self.timing_cache else None

    @classmethod
    def from_backend_cfg(cls, cfg: DictConfig) -> EngineBuildConfig:
        """Build options for measurement builds, from the backend section alone (tensorrt*, trtexec)."""
        from pipeline.artifacts import user_path

        tc = cfg.get("timing_cache")
        ws = cfg.get("workspace_size")
        return cls(data_type=cfg.get("float_precision") or "FP32",
                   workspace_size=int(ws) if ws is not None else None,
                   timing_cache=str(user_path(tc)) if tc else None,
                   plugin_libraries=list(cfg.get("plugin_libraries") or []))


def shape_problems(min_shapes: Any, opt_shapes: Any, max_shapes: Any,
                   key: str = "gen_trt_engine.tensorrt") -> list[str]:
    """min/opt/max shapes name the same inputs, with equal ranks, dims >= 1 and min <= opt <= max per dim.

    The one check of explicit profile shapes: config validation and every build call it.
    """
    keys = ("min_shapes", "opt_shapes", "max_shapes")
    tables = [min_shapes or {}, opt_shapes or {}, max_shapes or {}]
    problems = []
    for name in sorted({str(n) for t in tables for n in t}):
        missing = [k for k, t in zip(keys, tables, strict=True) if name not in t]
        if missing:
            problems.append(f"{key}: input '{name}' needs all of min_shapes, opt_shapes and max_shapes "
                            f"(missing from {', '.join(missing)})")
            continue
        lo, opt, hi = trio = [[int(v) for v in t[name]] for t in tables]
        bad = [f"{key}.{k}.{name}={s}" for k, s in zip(keys, trio, strict=True) if any(d < 1 for d in s)]
        if bad:
            problems.append(f"{', '.join(bad)}: every dim must be >= 1 (a concrete size, not -1 or 0)")
        elif not len(lo) == len(opt) == len(hi):
            problems.append(f"{key}: shapes of '{name}' differ in rank: {lo}, {opt}, {hi}")
        elif not all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True)):
            problems.append(f"{key}: shapes of '{name}' need min <= opt <= max in every dim, got {lo}, {opt}, {hi}")
    return problems


class BackendName(str, Enum):
    onnxruntime = "onnxruntime"
    tensorrt = "tensorrt"
    tensorrt_rtx = "tensorrt_rtx"
    trtexec = "trtexec"
    openvino = "openvino"
    custom = "custom"  # a runtime of your own: backend._target_ names its Backend class
    auto = "auto"  # every runtime in backend.runtimes tuned, the fastest accurate one shipped


@dataclass
class BackendConfig:
    name: BackendName = MISSING
    warmup_runs: int = 10
    timing_runs: int = 50
    # every timed block of an interleaved timing lasts at least this long (ms) of its fastest model's warm-up
    # run, more runs than timing_runs asks where that is short: blocks of a few runs of a 0.1 ms model time
    # the switch between models. Run-wide: under backend=auto, auto's value holds for every runtime.
    min_block_ms: float = 10.0


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


@dataclass
class CustomBackendConfig(BackendConfig):
    """A runtime defined outside qdq-tune (`backend=custom`): ``_target_`` is the dotted path of its
    ``pipeline.backends.base.Backend`` subclass, built with this section as its config; ``options`` are
    its own settings, read by it as ``cfg.options``. Under backend=auto it is the section
    ``backend.custom`` (``backend.runtimes=[onnxruntime, custom] backend.custom._target_=...``)."""

    name: BackendName = BackendName.custom
    _target_: str = ""  # required for backend=custom: the dotted path of your Backend subclass
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class AutoBackendConfig(BackendConfig):
    """`backend=auto`: quantize and autotune run once per runtime in ``runtimes`` that can run here (one
    that cannot is reported in one line and left out), each in results_dir/runtimes/<name>/ with its
    own section below (e.g. ``backend.openvino.inference_precision=f32``); then every runtime's shipped
    model and float are timed side by side in one interleaved run (``warmup_runs``, ``timing_runs``), and
    the fastest that met the accuracy budget ships: gen_trt_engine and evaluate run on it."""

    name: BackendName = BackendName.auto
    runtimes: list[str] = field(default_factory=lambda: ["onnxruntime", "openvino"])
    # tune every runtime to the end: no runtime is dropped when it falls out of the leader's reach after PTQ
    # (pipeline.app.race)
    tune_all: bool = False
    # compare only the runtimes tuned before, tuning nothing (tune-rechoose sets it)
    tuned_only: bool = False
    onnxruntime: OnnxRuntimeBackendConfig = field(default_factory=OnnxRuntimeBackendConfig)
    openvino: OpenVinoBackendConfig = field(default_factory=OpenVinoBackendConfig)
    tensorrt: TensorRTBackendConfig = field(default_factory=TensorRTBackendConfig)
    tensorrt_rtx: TensorRTBackendConfig = field(
        default_factory=lambda: TensorRTBackendConfig(name=BackendName.tensorrt_rtx))
    trtexec: TrtexecBackendConfig = field(default_factory=TrtexecBackendConfig)
    # a runtime of your own joins as `custom` in runtimes, with its _target_ here
    custom: CustomBackendConfig = field(default_factory=CustomBackendConfig)
