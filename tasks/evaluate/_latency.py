"""evaluate's latency records: one interleaved timing run over every model, and each model's times as
metrics.json holds them (``latency`` and each model's ``latency_ms``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipeline.backends.base import Backend, Timing
from pipeline.records.evaluate import LatencySummary, ModelLatency, ModelMetrics, SessionComparison

# p90/p10 above this means the machine was busy while timing: the medians are not to be trusted
_NOISY_SPREAD = 1.5


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

    def summary(self) -> LatencySummary:
        """``latency`` in metrics.json: how the run went (each model's times are under the model)."""
        # the FP32 float and the runtime's own float, whichever of them is the baseline
        fp32, own = self.timings.get("float_fp32"), self.timings.get("float")
        if "float_default" in self.timings:
            fp32, own = own, self.timings["float_default"]
        other = fp32 is not None and fp32.ok and own is not None and own.p10_ms > 0
        return LatencySummary(self.rounds, self.runs_per_round, self.warmup_runs, self.spread, self.warning,
                              ModelLatency.from_timing(fp32) if other else None, fp32.p10_ms / own.p10_ms if other else None)


def same_session(m: ModelMetrics, latency: LatencyRun, settings: Any, backend: Backend) -> None:
    """The autotuned model's speedup against float run with the same shipped settings, so a runtime
    win is not read as a quantization win; and which settings those were."""
    same = latency.extra.get("float_same_session")
    if same is None or not same.ok or m.latency_ms is None:
        return
    at = latency.timings["autotuned"]
    kind = backend.shipped_settings
    m.same_session = SessionComparison(same.median_ms / at.median_ms, same.p10_ms / at.p10_ms, settings.describe(),
                                       kind.artifact, kind.what, kind.defaults)
