"""Schema of the `autotune` group. Keys mirror the reference autotuner's CLI and Config class."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from omegaconf import DictConfig

from pipeline.config import AccuracyMetric, note_once
from pipeline.values import enum_value


class Mode(str, Enum):
    region = "region"
    subgraph = "subgraph"


class Preset(str, Enum):
    quick = "quick"
    default = "default"
    extensive = "extensive"


class QuantType(str, Enum):
    int8 = "int8"
    fp8 = "fp8"


class DqDtype(str, Enum):
    float32 = "float32"
    float16 = "float16"
    bfloat16 = "bfloat16"


@dataclass
class AccuracyAlias:
    """``autotune.accuracy.*``: the old place of the accuracy budget, kept as an alias of the top-level
    ``accuracy`` group (a value set here moves there, with a one-line deprecation note)."""

    enabled: Optional[bool] = None
    metric: Optional[AccuracyMetric] = None
    max_drop: Optional[float] = None
    min_snr_db: Optional[float] = None
    min_cosine: Optional[float] = None
    holdout_batches: Optional[int] = None
    recovery: Optional[bool] = None
    max_float_fraction: Optional[float] = None


# preset -> (schemes_per_region, warmup_runs, timing_runs); explicit keys override the preset
PRESETS: dict[str, tuple[int, int, int]] = {
    "quick": (12, 3, 24),
    "default": (30, 5, 40),
    "extensive": (80, 10, 100),
}


@dataclass
class RuntimeSearchConfig:
    """After placement, the runtime settings the shipped model runs fastest with, each kept only if it
    is faster beyond the noise and the model still meets the accuracy budget. ONNX Runtime: session
    settings (graph fusions to disable, gelu approximation, intra-op threads, optimization level),
    written to autotune/ort_session.json; tensorrt and trtexec: builder settings (optimization level,
    tiling optimization level, auxiliary streams), written to autotune/trt_build.json."""

    enabled: bool = True
    max_seconds: float = 300.0  # the search stops after this long (what is measured so far is kept)
    max_rounds: int = 12  # paired rounds per candidate at most (a clear verdict ends it sooner)
    keep_below: float = 0.98  # a setting is kept when its latency ratio's 95% interval lies below this


def _only(mode: str, default: Any = None) -> Any:
    """A key only one mode reads (``ignored_keys`` warns when the other mode is chosen)."""
    return field(default=default, metadata={"mode": mode})


@dataclass
class AutotuneConfig:
    # ---- both modes
    # region: pattern search over regions of the full model; subgraph: the runtime's fusion groups,
    # profiled as extracted subgraphs, then validated on the full model (faster on large models)
    mode: Mode = Mode.region
    preset: Preset = Preset.default
    warmup_runs: Optional[int] = None
    timing_runs: Optional[int] = None
    node_filter_list: list[str] = field(default_factory=list)  # node-name wildcards, or a file of them
    quant_type: Optional[QuantType] = None  # default: from the quantize stage's rules
    default_dq_dtype: DqDtype = DqDtype.float32
    default_q_scale: float = 0.1  # used only where calibration.json has no range (with a warning)
    default_q_zero_point: int = 0
    # the final Q/DQ model must beat the precision-matched float model by this factor, else float ships
    performance_threshold: float = 1.02
    verbose: bool = False
    accuracy: AccuracyAlias = field(default_factory=AccuracyAlias)  # deprecated: use the `accuracy` group
    runtime: RuntimeSearchConfig = field(default_factory=RuntimeSearchConfig)

    # ---- region mode
    schemes_per_region: Optional[int] = _only("region")
    pattern_cache: Optional[str] = _only("region")  # another run's autotuner_state_pattern_cache.yaml (warm start)
    qdq_baseline: Optional[str] = _only("region")  # default: quantize/quantized_model.onnx
    # seed the search with the QDQ baseline's placement (and use it for patterns not yet profiled);
    # false: start from no Q/DQ, as the reference tool does
    import_qdq_baseline: bool = _only("region", True)
    state_file: Optional[str] = _only("region")  # default: autotune/autotuner_state.yaml
    top_percent_to_mutate: float = _only("region", 0.1)
    minimum_schemes_to_mutate: int = _only("region", 10)
    maximum_mutations: int = _only("region", 3)
    maximum_generation_attempts: int = _only("region", 100)
    pattern_cache_minimum_distance: int = _only("region", 4)
    pattern_cache_max_entries_per_pattern: int = _only("region", 32)
    maximum_sequence_region_size: int = _only("region", 10)
    minimum_topdown_search_size: int = _only("region", 10)
    # patterns with pattern-cache entries get this share of schemes_per_region (their seeds are
    # another run's winners: the rest of the budget verifies and refines them)
    warm_start_budget: float = _only("region", 0.5)

    # ---- subgraph mode
    # TensorRT layer information (trtexec --exportLayerInfo=graph.json --profilingVerbosity=detailed)
    # giving the fusion groups; default: the backend's own (ONNX Runtime's optimized graph, or one
    # float TensorRT build written as <model>.<precision>.graph.json)
    graph_json: Optional[str] = _only("subgraph")
    # validate the groups' local winners on the full model (from the PTQ placement when it pays; in
    # grouped steps, bisected when rejected), keeping only what makes it faster (optimized_final.onnx);
    # false: every local winner at once (= optimized_raw.onnx)
    incremental_validation: bool = _only("subgraph", True)


def ignored_keys(a: DictConfig) -> list[str]:
    """``autotune.<key>=<value>`` for every key set away from its default that the chosen mode ignores."""

    mode = enum_value(a.mode)
    out = []
    for f in dataclasses.fields(AutotuneConfig):
        only = f.metadata.get("mode")
        if only is None or only == mode:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        value = a.get(f.name)
        if value != default and not (isinstance(value, Enum) and value.value == default):
            out.append(f"autotune.{f.name}={value}")
    return out


SCHEMA = AutotuneConfig


def validate(cfg: DictConfig) -> list[str]:
    a = cfg.autotune
    problems = []
    ignored = ignored_keys(a)
    if ignored:
        note_once(f"warning: {', '.join(ignored)}: ignored in autotune.mode={enum_value(a.mode)} (only the other "
                  f"mode reads {'it' if len(ignored) == 1 else 'them'})")
    if a.schemes_per_region is not None and a.schemes_per_region < 1:
        problems.append(f"autotune.schemes_per_region={a.schemes_per_region}: must be >= 1")
    if not 0.0 < a.top_percent_to_mutate <= 1.0:
        problems.append(f"autotune.top_percent_to_mutate={a.top_percent_to_mutate}: must be in (0, 1]")
    if not 0.0 < a.warm_start_budget <= 1.0:
        problems.append(f"autotune.warm_start_budget={a.warm_start_budget}: must be in (0, 1]")
    if a.performance_threshold < 1.0:
        problems.append(f"autotune.performance_threshold={a.performance_threshold}: must be >= 1.0")
    for key in ("maximum_mutations", "maximum_generation_attempts", "maximum_sequence_region_size",
                "minimum_topdown_search_size", "pattern_cache_max_entries_per_pattern"):
        if a[key] < 1:
            problems.append(f"autotune.{key}={a[key]}: must be >= 1")
    r = a.runtime
    if r.max_rounds < 2:
        problems.append(f"autotune.runtime.max_rounds={r.max_rounds}: must be >= 2 (a ratio needs two rounds)")
    if not 0.0 < r.keep_below <= 1.0:
        problems.append(f"autotune.runtime.keep_below={r.keep_below}: must be in (0, 1]")
    if r.max_seconds < 0:
        problems.append(f"autotune.runtime.max_seconds={r.max_seconds}: must be >= 0")
    return problems
