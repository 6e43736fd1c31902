"""What the quantize stage decided beside the ranges (calibration.json's ``decisions``), as records:
the weight storage autotune follows, the nodes left float, and the CPU, kernel-fidelity and accuracy
facts evaluate reports. They sit above ``pipeline.accuracy`` since they hold its verdicts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pipeline.accuracy.budget import AccuracyVerdict
from pipeline.accuracy.fidelity import FidelityResult
from pipeline.accuracy.kinds import CheckedOn
from pipeline.artifacts import read_json
from pipeline.errors import StateError, json_types, record_layout
from pipeline.quant.calibration import check_keys
from pipeline.quant.cpu import CpuFacts
from pipeline.quant.plan import WeightVariant
from pipeline.transforms.record import TransformRecord


@dataclass(frozen=True)
class StorageCheck:
    """One weight storage quantize checked on the holdout (calibration.json's ``decisions.variants``):
    whether it ran, its p10 latency where it was timed, its kernels' fidelity and its verdict."""

    name: str
    error: str | None = None
    latency_p10_ms: float | None = None
    fidelity: FidelityResult | None = None
    accuracy: AccuracyVerdict | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "error": self.error, "latency_p10_ms": self.latency_p10_ms,
                "fidelity": self.fidelity.to_dict() if self.fidelity else None,
                "accuracy": self.accuracy.to_dict() if self.accuracy else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StorageCheck:
        fid, acc = d.get("fidelity"), d.get("accuracy")
        return cls(str(d["name"]), d.get("error"), d.get("latency_p10_ms"),
                   FidelityResult.from_dict(fid) if fid else None, AccuracyVerdict.from_dict(acc) if acc else None)


@dataclass(frozen=True)
class BiasCorrection:
    """Bias correction of the placement written: whether it was kept (it must lower the held-out error),
    the nodes it measured and their per-node entries, the verdicts before and after, and why not."""

    applied: bool
    nodes: int
    records: list[dict[str, Any]] = field(default_factory=list)  # bias_correction.corrections' entries
    before: str | None = None
    after: str | None = None
    reason: str | None = None

    def to_dict(self, with_records: bool = True) -> dict[str, Any]:
        out = {"applied": self.applied, "nodes": self.nodes, **({"records": self.records} if with_records else {}),
               "before": self.before}
        return out | {k: v for k in ("reason", "after") if (v := getattr(self, k)) is not None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BiasCorrection:
        return cls(bool(d["applied"]), int(d["nodes"]), list(d.get("records") or []), d.get("before"), d.get("after"),
                   d.get("reason"))


@dataclass(frozen=True)
class RangeChoice:
    """quantize.algorithm=auto's whole-model range choice: the candidate chosen (``per_tensor`` or one
    algorithm everywhere), the weight search that goes with it, every candidate's PTQ held-out error, and
    after recovery the errors with the nodes left float and whether that changed the choice."""

    chosen: str
    weight_clip: str
    held_out_error: dict[str, float | None]
    with_float_nodes: dict[str, float | None] | None = None
    rechosen_after_recovery: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = {"chosen": self.chosen, "weight_clip": self.weight_clip, "held_out_error": dict(self.held_out_error)}
        if self.with_float_nodes is not None:
            out["with_float_nodes"] = dict(self.with_float_nodes)
        return out | ({"rechosen_after_recovery": True} if self.rechosen_after_recovery else {})

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RangeChoice:
        return cls(str(d["chosen"]), str(d["weight_clip"]), dict(d["held_out_error"]), d.get("with_float_nodes"),
                   bool(d.get("rechosen_after_recovery", False)))


@dataclass(frozen=True, kw_only=True)
class QuantizeDecisions:
    """What the quantize stage decided beside the ranges: calibration.json's ``decisions``, which
    autotune follows (weight storage, nodes left float) and evaluate reports (CPU, accuracy facts).

    Without a ``decisions`` table (the float model passed through, or no quantize stage) the weight
    storage is full range, no node is float and every other field is None.
    """

    weight_range: WeightVariant = WeightVariant.full
    weight_range_reason: str | None = None
    cpu: CpuFacts | None = None  # the facts of the machine that quantized
    unsupported_nodes: list[str] | None = None  # the runtime cannot run them quantized
    fidelity_culprits: list[str] | None = None  # their fused kernels disagree with the Q/DQ reference
    bias_correction: BiasCorrection | None = None
    kernel_fidelity: FidelityResult | None = None  # of the placement written
    variants: list[StorageCheck] | None = None  # every weight storage checked
    budget: str | None = None
    holdout: str | None = None
    holdout_samples: int | None = None
    accuracy: AccuracyVerdict | None = None  # the held-out verdict of the placement written
    float_nodes: list[str] = field(default_factory=list)
    transforms: list[TransformRecord] | None = None
    ranges: RangeChoice | None = None  # quantize.algorithm=auto's range choice, absent otherwise
    body_nodes: list[str] | None = None  # quantized nodes inside Loop/Scan bodies
    all_float: bool = False  # recovery left every quantizable node float

    def __post_init__(self) -> None:
        """A field given another type than its record is our bug: say which, where it was built."""
        for name, (kind, many) in {"weight_range": (WeightVariant, False), **_RECORDS}.items():
            value = getattr(self, name)
            items = value if many and isinstance(value, list) else [value]
            if value is not None and not all(isinstance(v, kind) for v in items):
                raise TypeError(f"QuantizeDecisions.{name} takes {kind.__name__} records, not {type(items[0]).__name__}")

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: v for f in fields(self)
               if (v := getattr(self, f.name)) is not None or f.name not in _OPTIONAL_DECISIONS}
        for name, (_, many) in _RECORDS.items():
            if (value := out.get(name)) is not None:
                out[name] = [v.to_dict() for v in value] if many else value.to_dict()
        return {**out, "weight_range": self.weight_range.value}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantizeDecisions:
        """The record of ``d`` (ValueError naming its unknown or missing keys, an unknown weight storage
        or a record of the wrong shape)."""
        names = [f.name for f in fields(cls)]
        check_keys(d, [k for k in names if k not in _OPTIONAL_DECISIONS], names)
        try:
            records = {k: [kind.from_dict(v) for v in d[k]] if many else kind.from_dict(d[k])
                       for k, (kind, many) in _RECORDS.items() if d.get(k) is not None}
        except (TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"a decision record has the wrong shape ({type(exc).__name__}: {exc})") from None
        return cls(**{**d, **records, "weight_range": WeightVariant.of(d["weight_range"])})


_OPTIONAL_DECISIONS = ("ranges",)
# the fields that hold records: field -> (record type, whether it holds a list of them)
_RECORDS: dict[str, tuple[type, bool]] = {
    "cpu": (CpuFacts, False), "kernel_fidelity": (FidelityResult, False), "accuracy": (AccuracyVerdict, False),
    "bias_correction": (BiasCorrection, False), "ranges": (RangeChoice, False),
    "variants": (StorageCheck, True), "transforms": (TransformRecord, True)}


def quantize_decisions(path: str | Path | None) -> QuantizeDecisions:
    """The quantize stage's decisions in calibration.json (weight storage, nodes left float, CPU and
    accuracy facts): the defaults where it has no ``decisions`` table or there is none, StateError where
    the table has unknown or missing keys."""
    doc = read_json(path, "calibration file") if path is not None else {}
    d = doc.get("decisions") if isinstance(doc, dict) else None
    if d is None:
        return QuantizeDecisions()
    try:
        return QuantizeDecisions.from_dict(d)
    except ValueError as exc:
        raise StateError(f"calibration file {path}: decisions: {exc}; re-run the quantize stage") from None


# QuantizeMetrics' keys in manifest.json's order; the Q/DQ node counts are written by op type
_QUANTIZE_KEYS = ("weight_range", "weight_range_reason", "cpu", "kernel_fidelity", "accuracy", "float_nodes",
                  "transforms", "bias_correction", "fidelity_culprits", "ranges", "placement", "activation_type",
                  "calibrated_tensors", "calibration_samples", "calibration_seconds", "quantized_nodes", "body_nodes",
                  "node_rules", "QuantizeLinear", "DequantizeLinear", "headline", "checked_on")
_QDQ_FIELDS = {"QuantizeLinear": "quantize_linear", "DequantizeLinear": "dequantize_linear"}
# the scalar fields and their JSON type (counts are whole numbers; None where not recorded)
_QUANTIZE_SCALARS: dict[str, type | tuple[type, ...]] = {
    **dict.fromkeys(("quantized_nodes", "calibrated_tensors", "calibration_samples", "body_nodes", "quantize_linear",
                     "dequantize_linear"), int),
    **dict.fromkeys(("headline", "placement", "weight_range_reason", "activation_type"), str),
    "calibration_seconds": (int, float), "float_nodes": list, "transforms": list, "node_rules": dict}
# the sub-records QuantizeMetrics holds (their types: ``_RECORDS``); the manifest keeps bias correction
# without its per-node records, and an absent verdict or bias correction as {}
_QUANTIZE_RECORDS = ("cpu", "kernel_fidelity", "accuracy", "ranges", "bias_correction")
_EMPTY_OBJECT = ("accuracy", "bias_correction")


@dataclass(frozen=True, kw_only=True)
class QuantizeMetrics:
    """manifest.json's ``stages.quantize.metrics``: the placement written (its runtime's rules, nodes, Q/DQ
    counts), the decisions behind it (weight storage, nodes left float, transforms, bias correction, range
    choice), calibration's size and time, its held-out verdict and what it was checked on.

    Where no layer rule quantizes anything the float model passes through: only ``quantized_nodes`` (0)
    and ``headline`` are recorded (``placement`` is None) and ``to_dict`` writes only those.
    """

    quantized_nodes: int
    headline: str
    placement: str | None = None  # the runtime kind whose placement rules were followed
    weight_range: WeightVariant | None = None
    weight_range_reason: str | None = None
    cpu: CpuFacts | None = None
    kernel_fidelity: FidelityResult | None = None
    accuracy: AccuracyVerdict | None = None  # the held-out verdict (None: not judged, written as {})
    float_nodes: list[str] = field(default_factory=list)
    transforms: list[dict[str, Any]] = field(default_factory=list)  # TransformRecord.to_dict(), changes counted
    bias_correction: BiasCorrection | None = None  # written as {} when None, without the per-node records
    fidelity_culprits: list[str] | None = None
    ranges: RangeChoice | None = None
    activation_type: str | None = None
    calibrated_tensors: int | None = None
    calibration_samples: int | None = None
    calibration_seconds: float | None = None
    body_nodes: int | None = None  # quantized nodes inside Loop/Scan bodies
    node_rules: dict[str, str] = field(default_factory=dict)  # quantized node -> its rule
    quantize_linear: int | None = None  # QuantizeLinear nodes, inside bodies too
    dequantize_linear: int | None = None
    checked_on: Mapping[str, Any] | None = None  # CheckedOn.to_dict() (see ``checked``)

    @property
    def checked(self) -> CheckedOn | None:
        """What the quantized model was checked on, as a record (None: not recorded)."""
        return CheckedOn.from_dict(self.checked_on) if self.checked_on else None

    def to_dict(self) -> dict[str, Any]:
        keys = _QUANTIZE_KEYS if self.placement is not None else ("quantized_nodes", "headline", "checked_on")
        out: dict[str, Any] = {}
        for key in keys:
            value = getattr(self, _QDQ_FIELDS.get(key, key))
            if key in _QUANTIZE_RECORDS:
                if value is None:
                    value = {} if key in _EMPTY_OBJECT else None
                else:
                    value = value.to_dict(with_records=False) if key == "bias_correction" else value.to_dict()
            elif key == "weight_range" and value is not None:
                value = value.value
            elif key == "checked_on":
                if value is None:
                    continue
                value = dict(value)
            out[key] = value
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "manifest.json's quantize entry") -> QuantizeMetrics:
        """The record of quantize's manifest metrics (keys an older or newer writer added are left out); a
        layout no writer made is a one-line StateError naming ``where``."""
        with record_layout(where, "quantize"):
            if not isinstance(d, Mapping):
                raise TypeError(f"not an object but {type(d).__name__}")
            values = {_QDQ_FIELDS.get(k, k): v for k, v in d.items() if k in _QUANTIZE_KEYS}
            for key in _QUANTIZE_RECORDS:
                values[key] = _RECORDS[key][0].from_dict(d[key]) if d.get(key) else None
            if d.get("weight_range") is not None:
                values["weight_range"] = WeightVariant.of(d["weight_range"])
            for key in ("float_nodes", "transforms", "node_rules"):
                if values.get(key) is None:
                    values.pop(key, None)
            json_types(values, _QUANTIZE_SCALARS)
            return cls(**values)
