"""evaluate's latency records: one interleaved timing run over every model, and each model's times as
metrics.json holds them (``latency`` and each model's ``latency_ms``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.backends.base import Backend, Timing

# p90/p10 above this means the machine was busy while timing: the medians are not to be trusted
_NOISY_SPREAD = 1.5


@dataclass(frozen=True)
class ModelLatency:
    """One model's times over the interleaved run, in ms (``latency_ms`` in metrics.json)."""

    median: float
    p10: float
    p90: float
    minimum: float
    samples: int

    @classmethod
    def from_timing(cls, t: Timing) -> ModelLatency:
        return cls(t.median_ms, t.p10_ms, t.p90_ms, t.min_ms, t.n)

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "p10": self.p10, "p90": self.p90, "min": self.minimum, "samples": self.samples}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelLatency:
        return cls(d["median"], d["p10"], d["p90"], d["min"], d["samples"])


@dataclass(frozen=True)
class LatencyRun:
    """One interleaved timing of the prepared models: how it ran and each model's Timing."""

    rounds: int
    runs_per_round: int
    warmup_runs: int
    timings: dict[str, Timing]  # the evaluated models, by metrics key
    extra: dict[str, Timing]  # models timed only to compare with (float_same_session)

    @property
    def spread(self) -> float | None:
        """The largest p90/p10 among the evaluated models (None when none could say)."""
        ratios = (t.p90_ms / t.p10_ms for t in self.timings.values() if t.p10_ms > 0)
        return max((r for r in ratios if not math.isnan(r)), default=None)

    @property
    def warning(self) -> str | None:
        """What to say when the timings were too noisy for their medians to be trusted."""
        spread = self.spread
        if spread is None or spread <= _NOISY_SPREAD:
            return None
        return (f"timings were noisy (p90/p10 up to {spread:.1f}x): other processes were busy; "
                f"trust the p10 ratio or re-run with more evaluate.latency_repeats")

    def to_dict(self) -> dict[str, Any]:
        """``latency`` in metrics.json: how the run went (each model's times are under the model)."""
        out: dict[str, Any] = {"rounds": self.rounds, "runs_per_round": self.runs_per_round,
                               "warmup_runs": self.warmup_runs, "max_p90_over_p10": self.spread}
        if self.warning is not None:
            out["warning"] = self.warning
        # the FP32 float and the runtime's own float, whichever of them is the baseline
        fp32, own = self.timings.get("float_fp32"), self.timings.get("float")
        if "float_default" in self.timings:
            fp32, own = own, self.timings["float_default"]
        if fp32 is not None and fp32.ok and own is not None and own.p10_ms > 0:
            out["float_fp32_ms"] = ModelLatency.from_timing(fp32).to_dict()
            out["float_speedup_over_fp32_p10"] = fp32.p10_ms / own.p10_ms
        return out


def same_session(models: dict[str, dict[str, Any]], latency: LatencyRun, settings: Any, backend: Backend) -> None:
    """The autotuned model's speedup against float run with the same shipped settings, so a runtime
    win is not read as a quantization win; and which settings those were."""
    same = latency.extra.get("float_same_session")
    if same is None or not same.ok or "autotuned" not in models or not models["autotuned"].get("latency_ms"):
        return
    at = latency.timings["autotuned"]
    models["autotuned"]["speedup_same_session"] = same.median_ms / at.median_ms
    models["autotuned"]["speedup_same_session_p10"] = same.p10_ms / at.p10_ms
    models["autotuned"]["session"] = settings.describe()
    kind = backend.shipped_settings
    models["autotuned"].update(settings_file=kind.artifact, settings_what=kind.what,
                               settings_defaults=kind.defaults)
