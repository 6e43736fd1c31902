"""Schema of the `evaluate` group."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from omegaconf import DictConfig


@dataclass
class SensitivityConfig:
    """Where the shipped model's error comes from: each quantized node's own contribution, measured on
    the first evaluation batches (evaluate/sensitivity.png, ranges.png, sensitivity.json)."""

    enabled: bool = True
    batches: int = 2
    max_nodes: int = 64  # quantized nodes measured, in graph order (each is one run of the float graph)


@dataclass
class EvaluateConfig:
    max_batches: Optional[int] = None  # evaluation batches (None: the whole evaluation split)
    top_k: int = 5  # top-k accuracy reported besides top-1 (when labelled and the output has >= k classes)
    latency: bool = True  # measure latency and speedup vs the float model
    # interleaved rounds over all models; each round times every model backend.timing_runs // rounds times
    latency_repeats: int = 5
    plot: bool = True  # write the charts: summary.png (latency and accuracy per model), sensitivity.png, ranges.png
    sensitivity: SensitivityConfig = field(default_factory=SensitivityConfig)


SCHEMA = EvaluateConfig


def validate(cfg: DictConfig) -> list[str]:
    e = cfg.evaluate
    problems = []
    if e.max_batches is not None and e.max_batches < 1:
        problems.append(f"evaluate.max_batches={e.max_batches}: must be >= 1 or null")
    if e.top_k < 1:
        problems.append(f"evaluate.top_k={e.top_k}: must be >= 1")
    if e.latency_repeats < 1:
        problems.append(f"evaluate.latency_repeats={e.latency_repeats}: must be >= 1")
    for key in ("batches", "max_nodes"):
        if e.sensitivity[key] < 1:
            problems.append(f"evaluate.sensitivity.{key}={e.sensitivity[key]}: must be >= 1")
    return problems
