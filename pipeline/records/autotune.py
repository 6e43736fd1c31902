"""autotune's manifest metrics as one record: what the final guard shipped and measured, the mode's counts,
what the shipped model was checked on, and (backend=auto's top level only) the runtime choice beside it.

The autotune stage builds one ``AutotuneMetrics`` and hands the manifest its ``to_dict``; every reader
(backend=auto's choice, race and publication, the sweep summary, the Python API, evaluate) takes it back
through ``AutotuneMetrics.from_dict``, so a renamed key fails where it is written, not in a distant reader.
The JSON layout is the one manifest.json always had (entries written before a key existed read with that
field empty). A record is never edited in place: a changed one is a new record (``dataclasses.replace``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from pipeline.accuracy.budget import AccuracyVerdict
from pipeline.accuracy.kinds import CheckedOn
from pipeline.errors import json_typed, record_layout
from pipeline.records.evaluate import FloatBaseline
from pipeline.runtime_choice import RuntimeChoice


@dataclass(frozen=True)
class TunedAccuracy:
    """The holdout verdicts of the shipped (``final``), tuned and PTQ models (None: not judged, or no PTQ)."""

    final: AccuracyVerdict | None = None
    tuned: AccuracyVerdict | None = None
    ptq: AccuracyVerdict | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.to_dict() if v is not None else None) for k, v in
                (("final", self.final), ("tuned", self.tuned), ("ptq", self.ptq))}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TunedAccuracy:
        return cls(*(_verdict(d.get(k)) for k in ("final", "tuned", "ptq")))


@dataclass(frozen=True)
class GuardSource:
    """Where the final guard's numbers come from: a fresh interleaved run (``measured``) or the mode's own
    paired steps, and why."""

    measured: bool
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {"measured": self.measured, "why": self.why}


# the keys every mode fills in (``ModeSummary``), beside its own (``ModeSummary.details``)
_MODE_COMMON = ("mode", "measurements", "full_model_measurements")
_SETUP = ("quant_type", "placement", "budget", "weight_range", "float_nodes", "defaulted_scales")
_NUMBERS = ("baseline_ms", "final_ms", "speedup", "baseline_median_ms", "final_median_ms", "tuned_ms",
            "tuned_speedup", "ptq_ms", "ptq_speedup")


@dataclass(frozen=True)
class ModeSummary:
    """What the mode reports of its search: which mode, its measurements, what it tuned with, and its own keys."""

    mode: str | None = None  # "region" or "subgraph"
    measurements: int | None = None
    full_model_measurements: int | None = None
    # the mode's own keys (region: regions, patterns, ...; subgraph: fusion groups, group_report, phases,
    # steps, raw, ...), as the mode wrote them; only the mode's own report reads them
    details: Mapping[str, Any] = field(default_factory=dict)
    quant_type: str | None = None
    placement: str | None = None
    budget: str | None = None  # the accuracy budget, described
    weight_range: str | None = None
    float_nodes: list[str] = field(default_factory=list)
    defaulted_scales: int | None = None  # tensors without calibration statistics (the default scale)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _MODE_COMMON}
        out.update(self.details)
        out.update({k: getattr(self, k) for k in _SETUP})
        out["float_nodes"] = list(self.float_nodes)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], top_level: frozenset[str]) -> ModeSummary:
        """The mode's part of ``d`` (autotune's metrics, flat; ``top_level``: the other parts' keys)."""
        known = {f.name for f in fields(cls)} | top_level
        return cls(mode=json_typed(d.get("mode"), "mode", str), measurements=json_typed(d.get("measurements"), "measurements", (int, float)),
                   full_model_measurements=json_typed(d.get("full_model_measurements"), "full_model_measurements", (int, float)),
                   details={k: v for k, v in d.items() if k not in known},
                   **{k: json_typed(d.get(k), k, str) for k in _SETUP[:4]}, float_nodes=list(d.get("float_nodes") or []),
                   defaulted_scales=json_typed(d.get("defaulted_scales"), "defaulted_scales", (int, float)))


@dataclass(frozen=True)
class AutotuneMetrics:
    """manifest.json's ``stages.autotune.metrics``: the final guard's p10 latencies (ms) and speedups over
    the float baseline, the verdicts, what ships and why; the mode and its counts; what the shipped model
    was checked on; at backend=auto's top level, the runtime choice and each host's choice."""

    baseline_ms: float | None = None  # the float baseline's p10
    final_ms: float | None = None  # the shipped model's p10
    speedup: float | None = None  # baseline_ms / final_ms
    baseline_median_ms: float | None = None
    final_median_ms: float | None = None
    tuned_ms: float | None = None
    tuned_speedup: float | None = None  # None where the tuned model is the float graph again
    tuned_is_float: bool = False
    ptq_ms: float | None = None  # None: no PTQ model, or it did not run
    ptq_speedup: float | None = None
    accuracy: TunedAccuracy = field(default_factory=TunedAccuracy)
    shipped: str | None = None  # "tuned", "ptq" or "float"
    shipped_reason: str = ""
    guard: GuardSource | None = None
    baseline_precision: str | None = None  # the precision of the float the speedups are against
    runtime: Mapping[str, Any] = field(default_factory=dict)  # the runtime settings search's report (RuntimeOutcome)
    final_line: str = ""
    float_baseline: FloatBaseline | None = None  # which float the guard compared against, and why
    headline: str = ""
    search: ModeSummary = field(default_factory=ModeSummary)  # the mode's own report of its search
    checked_on: Mapping[str, Any] | None = None  # CheckedOn.to_dict() of the shipped model (see ``checked``)
    # backend=auto's top level only: each host's choice, the choice (see ``choice``), the winner's own headline
    host_choices: Mapping[str, Any] | None = None
    runtime_choice: Mapping[str, Any] | None = None
    runtime_headline: str | None = None

    @property
    def checked(self) -> CheckedOn | None:
        """What the shipped model was checked on, as a record (None: not recorded)."""
        return CheckedOn.from_dict(self.checked_on) if self.checked_on else None

    @property
    def choice(self) -> RuntimeChoice | None:
        """backend=auto's runtime choice, published beside the winner's metrics (None: not an auto top level)."""
        if not self.runtime_choice:
            return None
        return RuntimeChoice.from_dict(self.runtime_choice, "the runtime choice in manifest.json's autotune entry",
                                       "run tune on the results_dir again to publish it afresh")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in _NUMBERS[:7]}
        out.update(tuned_is_float=self.tuned_is_float, ptq_ms=self.ptq_ms, ptq_speedup=self.ptq_speedup,
                   accuracy=self.accuracy.to_dict(), shipped=self.shipped, shipped_reason=self.shipped_reason,
                   guard=self.guard.to_dict() if self.guard is not None else None,
                   baseline_precision=self.baseline_precision, runtime=dict(self.runtime),
                   final_line=self.final_line,
                   float_baseline=self.float_baseline.to_dict() if self.float_baseline is not None else None,
                   headline=self.headline)
        out.update(self.search.to_dict())
        if self.checked_on is not None:
            out["checked_on"] = dict(self.checked_on)
        if self.host_choices is not None:
            out["host_choices"] = dict(self.host_choices)
        if self.runtime_choice is not None:  # published together with the winner's own headline
            out.update(runtime_choice=dict(self.runtime_choice), runtime_headline=self.runtime_headline)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "manifest.json's autotune entry") -> AutotuneMetrics:
        """The record of autotune's manifest metrics; a layout no writer made is a one-line StateError
        naming ``where``."""
        with record_layout(where, "autotune"):
            if not isinstance(d, Mapping):
                raise TypeError(f"not an object but {type(d).__name__}")
            return cls._read(d)

    @classmethod
    def _read(cls, d: Mapping[str, Any]) -> AutotuneMetrics:
        guard = json_typed(d.get("guard"), "guard", Mapping)
        fb = json_typed(d.get("float_baseline"), "float_baseline", Mapping)
        known = frozenset(f.name for f in fields(cls))
        return cls(
            **{k: json_typed(d.get(k), k, (int, float)) for k in _NUMBERS}, tuned_is_float=bool(d.get("tuned_is_float", False)),
            accuracy=TunedAccuracy.from_dict(json_typed(d.get("accuracy"), "accuracy", Mapping) or {}),
            shipped=json_typed(d.get("shipped"), "shipped", str), shipped_reason=str(d.get("shipped_reason") or ""),
            guard=GuardSource(bool(guard.get("measured")), str(guard.get("why", ""))) if guard else None,
            baseline_precision=json_typed(d.get("baseline_precision"), "baseline_precision", str),
            runtime=dict(json_typed(d.get("runtime"), "runtime", Mapping) or {}), final_line=str(d.get("final_line") or ""),
            float_baseline=FloatBaseline.from_dict(fb) if fb else None, headline=str(d.get("headline") or ""),
            search=ModeSummary.from_dict(d, known),
            checked_on=json_typed(d.get("checked_on"), "checked_on", Mapping),
            host_choices=json_typed(d.get("host_choices"), "host_choices", Mapping),
            runtime_choice=json_typed(d.get("runtime_choice"), "runtime_choice", Mapping),
            runtime_headline=json_typed(d.get("runtime_headline"), "runtime_headline", str))


def autotune_metrics(recorded: Mapping[str, Any] | None, where: str) -> AutotuneMetrics | None:
    """The record of a manifest's autotune metrics (``Manifest.metrics("autotune")``), None where autotune
    has recorded none (it has not finished)."""
    return AutotuneMetrics.from_dict(recorded, where) if recorded else None


def _verdict(v: Any) -> AccuracyVerdict | None:
    """A verdict as AccuracyVerdict.to_dict() wrote it (keys it lacks read as unknown)."""
    if v is None:
        return None
    return AccuracyVerdict.from_dict({"ok": None, "metric": "", "what": "", **json_typed(v, "a verdict", Mapping)})


__all__ = ["AutotuneMetrics", "GuardSource", "ModeSummary", "TunedAccuracy", "autotune_metrics"]
