"""Schema of the `evaluate` group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig


@dataclass
class EvaluateConfig:
    max_batches: Optional[int] = None  # evaluation batches (None: the whole evaluation split)
    top_k: int = 5  # top-k accuracy reported besides top-1 (when labelled and the output has >= k classes)
    latency: bool = True  # measure latency and speedup vs the float model
    # interleaved rounds over all models; each round times every model backend.timing_runs // rounds times
    latency_repeats: int = 5
    plot: bool = True  # write evaluate/summary.png (latency and accuracy per model)


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
    return problems
