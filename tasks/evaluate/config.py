"""Schema of the `evaluate` group."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from omegaconf import DictConfig


@dataclass
class EvaluateConfig:
    max_batches: Optional[int] = None  # evaluation batches (None: the whole evaluation split)
    top_k: int = 5
    latency: bool = True
    latency_repeats: int = 5  # interleaved rounds over all models
    plot: bool = True


SCHEMA = EvaluateConfig


def validate(cfg: DictConfig) -> list[str]:
    e = cfg.evaluate
    problems = []
    if e.max_batches is not None and e.max_batches < 1:
        problems.append(f"evaluate.max_batches={e.max_batches}: must be >= 1 or null")
    if e.latency_repeats < 1:
        problems.append(f"evaluate.latency_repeats={e.latency_repeats}: must be >= 1")
    return problems
