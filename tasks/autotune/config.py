"""Schema of the `autotune` group. Keys mirror the reference autotuner's CLI and Config class."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Optional

from omegaconf import DictConfig


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


class AccuracyMetric(str, Enum):
    auto = "auto"  # top1 with labels; class scores: agreement or SNR; other outputs: SNR
    top1 = "top1"
    agreement = "agreement"
    snr = "snr"
    cosine = "cosine"


@dataclass
class AccuracyConfig:
    """The accuracy budget every quantized model is held to (quantize's PTQ model, every autotune
    candidate, the shipped model), checked against the float model on calibration batches the
    calibrator did not see."""

    enabled: bool = True
    metric: AccuracyMetric = AccuracyMetric.auto
    max_drop: float = 1.0  # points of top-1 (with labels) or of top-1 agreement with the float model
    min_snr_db: float = 20.0  # output SNR vs float (20 dB = 10% relative L2 error)
    min_cosine: float = 0.99
    holdout_batches: int = 8  # calibration batches after quantize.calibration.batches
    # when the PTQ model misses the budget, leave its most error-sensitive nodes float (at most this
    # share of the quantized nodes) until it meets it
    recovery: bool = True
    max_float_fraction: float = 0.5


# preset -> (schemes_per_region, warmup_runs, timing_runs); explicit keys override the preset
PRESETS: dict[str, tuple[int, int, int]] = {
    "quick": (12, 3, 24),
    "default": (30, 5, 40),
    "extensive": (80, 10, 100),
}


@dataclass
class AutotuneConfig:
    # region: pattern search over regions of the full model; subgraph: the runtime's fusion groups,
    # profiled as extracted subgraphs, then validated on the full model (faster on large models)
    mode: Mode = Mode.region
    # subgraph mode: TensorRT layer information (trtexec --exportLayerInfo=graph.json
    # --profilingVerbosity=detailed) giving the fusion groups; default: the backend's own (ONNX Runtime's
    # optimized graph, or one float TensorRT build written as <model>.<precision>.graph.json)
    graph_json: Optional[str] = None
    # subgraph mode: apply group winners to the full model one at a time, keeping only those that make
    # it faster (optimized_final.onnx); false: every local winner at once (= optimized_raw.onnx)
    incremental_validation: bool = True
    preset: Preset = Preset.default
    schemes_per_region: Optional[int] = None
    warmup_runs: Optional[int] = None
    timing_runs: Optional[int] = None
    pattern_cache: Optional[str] = None  # another run's autotuner_state_pattern_cache.yaml (warm start)
    qdq_baseline: Optional[str] = None  # default: quantize/quantized_model.onnx
    # seed the search with the QDQ baseline's placement (and use it for patterns not yet profiled);
    # false: start from no Q/DQ, as the reference tool does
    import_qdq_baseline: bool = True
    state_file: Optional[str] = None  # default: autotune/autotuner_state.yaml
    node_filter_list: list[str] = field(default_factory=list)  # node-name wildcards, or a file of them
    quant_type: Optional[QuantType] = None  # default: from the quantize stage's rules
    default_dq_dtype: DqDtype = DqDtype.float32
    default_q_scale: float = 0.1  # used only where calibration.json has no range (with a warning)
    default_q_zero_point: int = 0
    top_percent_to_mutate: float = 0.1
    minimum_schemes_to_mutate: int = 10
    maximum_mutations: int = 3
    maximum_generation_attempts: int = 100
    pattern_cache_minimum_distance: int = 4
    pattern_cache_max_entries_per_pattern: int = 32
    maximum_sequence_region_size: int = 10
    minimum_topdown_search_size: int = 10
    # the final Q/DQ model must beat the precision-matched float model by this factor, else float ships
    performance_threshold: float = 1.02
    # patterns with pattern-cache entries get this share of schemes_per_region (their seeds are
    # another run's winners: the rest of the budget verifies and refines them)
    warm_start_budget: float = 0.5
    accuracy: AccuracyConfig = field(default_factory=AccuracyConfig)
    verbose: bool = False


SCHEMA = AutotuneConfig


def validate(cfg: DictConfig) -> list[str]:
    a = cfg.autotune
    problems = []
    if a.schemes_per_region is not None and a.schemes_per_region < 1:
        problems.append(f"autotune.schemes_per_region={a.schemes_per_region}: must be >= 1")
    if not 0.0 < a.top_percent_to_mutate <= 1.0:
        problems.append(f"autotune.top_percent_to_mutate={a.top_percent_to_mutate}: must be in (0, 1]")
    if not 0.0 < a.warm_start_budget <= 1.0:
        problems.append(f"autotune.warm_start_budget={a.warm_start_budget}: must be in (0, 1]")
    acc = a.accuracy
    if acc.max_drop < 0:
        problems.append(f"autotune.accuracy.max_drop={acc.max_drop}: must be >= 0 (points)")
    if not -1.0 <= acc.min_cosine <= 1.0:
        problems.append(f"autotune.accuracy.min_cosine={acc.min_cosine}: must be in [-1, 1]")
    if acc.holdout_batches < 1:
        problems.append(f"autotune.accuracy.holdout_batches={acc.holdout_batches}: must be >= 1")
    if not 0.0 < acc.max_float_fraction <= 1.0:
        problems.append(f"autotune.accuracy.max_float_fraction={acc.max_float_fraction}: must be in (0, 1]")
    if a.performance_threshold < 1.0:
        problems.append(f"autotune.performance_threshold={a.performance_threshold}: must be >= 1.0")
    for key in ("maximum_mutations", "maximum_generation_attempts", "maximum_sequence_region_size",
                "minimum_topdown_search_size", "pattern_cache_max_entries_per_pattern"):
        if a[key] < 1:
            problems.append(f"autotune.{key}={a[key]}: must be >= 1")
    return problems
