"""accuracy.custom_metric over evaluate's whole evaluation pass (the user's metric may be dataset-level)."""

from __future__ import annotations

from typing import Any

import numpy as np

from pipeline.accuracy.budget import CustomMetric
from pipeline.accuracy.holdout import by_name, labels_of


class CustomScores:
    """accuracy.custom_metric over the whole evaluation set: each model's outputs (by name, padding
    removed) are kept until the pass ends, since the metric may be dataset-level (mAP, recall@k).
    Without a custom metric nothing is kept."""

    def __init__(self, metric: Any, names: list[str], keys: list[str]):
        self.metric, self.names = metric, names
        self.outputs: dict[str, list[dict[str, np.ndarray]]] = {k: [] for k in keys}
        self.labels: list[Any] = []
        self.valid: list[int] = []

    @classmethod
    def from_config(cls, cfg: Any, names: list[str], keys: list[str]) -> CustomScores:
        return cls(CustomMetric.from_config(cfg), names, keys)

    def add(self, key: str, outputs: list[np.ndarray], labels: Any, valid: int) -> None:
        if self.metric is None:
            return
        self.outputs[key].append(by_name(outputs, self.names, valid))
        if key == "float":
            self.labels.append(labels)
            self.valid.append(valid)

    def result(self) -> dict[str, float]:
        """Each model's score (the float model's own outputs are its reference)."""
        if self.metric is None:
            return {}
        labels, ref = labels_of(self.labels, self.valid), self.outputs["float"]
        return {k: self.metric(outs, ref, labels) for k, outs in self.outputs.items()}
