"""TransformRecord: what one float-graph transform did to a model (calibration.json's ``transforms``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class TransformRecord:
    """One transform's outcome: whether it changed the model, why not, how far the float outputs moved
    (relative L2), its changes (each transform's own entries: a conv pair, a smoothed tensor, ...) and,
    where quantize weighed the transformed graph against the original, both PTQ held-out errors."""

    transform: str
    applied: bool
    changes: list[dict[str, Any]] = field(default_factory=list)
    reason: str | None = None
    float_rel_error: float | None = None
    held_out_error: dict[str, float | None] | None = None  # {"with": ..., "without": ...}

    def not_applied(self, reason: str) -> TransformRecord:
        return replace(self, applied=False, reason=reason)

    def to_dict(self) -> dict[str, Any]:
        """The layout calibration.json and the stage metrics keep (absent keys stay absent)."""
        out: dict[str, Any] = {"transform": self.transform, "applied": self.applied}
        for key in ("reason", "float_rel_error"):
            if (value := getattr(self, key)) is not None:
                out[key] = value
        out["changes"] = list(self.changes)
        if self.held_out_error is not None:
            out["held_out_error"] = dict(self.held_out_error)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TransformRecord:
        return cls(str(d["transform"]), bool(d["applied"]), list(d.get("changes") or []), d.get("reason"),
                   d.get("float_rel_error"), d.get("held_out_error"))
