"""Schema of the `export` group. What to export is the `model` group; this is how."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import DictConfig


@dataclass
class ExportConfig:
    # run ORT on the exported file and compare with torch on the same input
    verify: bool = True
    # reuse trained digits_cnn weights kept in results_dir/export/, else in the user's cache (another
    # results_dir trained them), when the model config, seed and torch version are unchanged
    cache_trained_weights: bool = True


SCHEMA = ExportConfig


def validate(cfg: DictConfig) -> list[str]:
    return []
