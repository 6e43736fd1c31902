"""evaluate/metrics.json as typed records: what evaluate measured per model and for the run.

The evaluate stage builds one ``EvaluateMetrics`` and writes its ``to_dict``; the report, the runtime
table of ``backend=auto``, the end-of-run summary and every other reader take it back through
``EvaluateMetrics.from_dict``, so a renamed field fails where it is written, not in a distant reader.
The JSON layout is the one metrics.json always had (files written before a field existed read with
that field empty). ``FloatBaseline`` is autotune's choice of float baseline, which evaluate follows
and reports.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pipeline.accuracy.budget import AccuracyVerdict
from pipeline.accuracy.fidelity import FidelityResult
from pipeline.accuracy.kinds import CheckedOn
from pipeline.accuracy.scores import Scores
from pipeline.backends.base import Timing
from pipeline.errors import record_layout
from pipeline.quant.cpu import CpuFacts
from pipeline.records.quantize import BiasCorrection
from pipeline.runtime_choice import ModelSummary, RuntimeEvaluation
from pipeline.transforms.record import TransformRecord


def _known(cls: type, d: Mapping[str, Any]) -> dict[str, Any]:
    """The items of ``d`` that are fields of dataclass ``cls`` (a newer or older writer's extras left out)."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in d.items() if k in names}


def _opt(d: Mapping[str, Any] | None, read: Any) -> Any:
    return read(d) if d else None


@dataclass(frozen=True)
class FloatBaseline:
    """The float the guard and every speedup compare against (autotune's ``float_baseline``): the
    runtime's default precision, or FP32 where the default misses the accuracy budget or runs slower
    (``reason`` and ``note`` say which)."""

    precision: str  # what the baseline float runs in ("BF16", "FP32", ...)
    default: str  # the runtime's own float precision here
    verdict: AccuracyVerdict | None = None  # the default float's verdict against FP32 (None: not judged)
    note: str = ""  # why the baseline is not the default ("" when it is)
    reason: str = ""  # the note's short form: "misses the budget" or "is slower here"
    fp32_ratio: float | None = None  # the FP32 float's latency over the default float's (None: not timed)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict.to_dict() if self.verdict is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FloatBaseline:
        return cls(**{**_known(cls, d), "verdict": _opt(d.get("verdict"), AccuracyVerdict.from_dict)})


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
class LatencySummary:
    """How the interleaved timing ran (``latency`` in metrics.json; each model's times are its own), and
    the float in the precision the baseline does not run against the baseline's."""

    rounds: int
    runs_per_round: int
    warmup_runs: int
    max_p90_over_p10: float | None = None
    warning: str | None = None  # the timings were too noisy for their medians to be trusted
    float_fp32_ms: ModelLatency | None = None
    float_speedup_over_fp32_p10: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rounds": self.rounds, "runs_per_round": self.runs_per_round,
                               "warmup_runs": self.warmup_runs, "max_p90_over_p10": self.max_p90_over_p10}
        if self.warning is not None:
            out["warning"] = self.warning
        if self.float_fp32_ms is not None:
            out["float_fp32_ms"] = self.float_fp32_ms.to_dict()
            out["float_speedup_over_fp32_p10"] = self.float_speedup_over_fp32_p10
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LatencySummary:
        return cls(**{**_known(cls, d), "float_fp32_ms": _opt(d.get("float_fp32_ms"), ModelLatency.from_dict)})


@dataclass(frozen=True)
class PromiseCheck:
    """A quantized model's holdout verdict (what the pipeline promised) against its verdict on the
    evaluation data."""

    holdout: AccuracyVerdict | None
    evaluation_ok: bool
    evaluation_what: str
    samples: int | None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "holdout": self.holdout.to_dict() if self.holdout is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PromiseCheck:
        return cls(**{**_known(cls, d), "holdout": _opt(d.get("holdout"), AccuracyVerdict.from_dict)})


@dataclass(frozen=True)
class SessionComparison:
    """The autotuned model against float run with the same shipped runtime settings (so a runtime win is
    not read as a quantization win), and which settings those were."""

    speedup: float
    speedup_p10: float
    session: str  # the settings, described
    settings_file: str
    settings_what: str
    settings_defaults: str


@dataclass
class ModelMetrics:
    """One evaluated model: its file, scores against the float model, latency and speedups over the
    baseline float, and (for a quantized model) its verdict against the budget on the evaluation data."""

    label: str
    file: str
    scores: Scores
    sha256: str = ""
    custom_metric: float | None = None  # the user's metric (accuracy.metric=custom)
    latency_ms: ModelLatency | None = None
    speedup: float | None = None  # float median / this median
    speedup_p10: float | None = None  # float p10 / this p10
    same_session: SessionComparison | None = None
    budget: AccuracyVerdict | None = None
    kernel_fidelity: FidelityResult | None = None
    promise: PromiseCheck | None = None
    over_budget: str | None = None  # the one line saying why it misses the budget

    def accuracy(self, key: str, custom_name: str | None) -> tuple[str, str] | None:
        """(what, value) of the accuracy reported for this model (metrics key ``key``): the user's custom
        metric, else top-1, else (for a quantized model) agreement with float; None without any. The
        headline and the runtime table word it each their way from this one choice."""
        if self.custom_metric is not None:
            return str(custom_name), f"{self.custom_metric:.4g}"
        if self.scores.top1 is not None:
            return "top-1", f"{100 * self.scores.top1:.1f}%"
        if key != "float" and self.scores.agreement is not None:
            return "agreement", f"{100 * self.scores.agreement:.1f}%"
        return None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label, "file": self.file, "sha256": self.sha256, **self.scores.to_dict()}
        if self.custom_metric is not None:
            out["custom_metric"] = self.custom_metric
        if self.latency_ms is not None:
            out.update(latency_ms=self.latency_ms.to_dict(), speedup=self.speedup, speedup_p10=self.speedup_p10)
        s = self.same_session
        if s is not None:
            out.update(speedup_same_session=s.speedup, speedup_same_session_p10=s.speedup_p10, session=s.session,
                       settings_file=s.settings_file, settings_what=s.settings_what,
                       settings_defaults=s.settings_defaults)
        if self.budget is not None:
            out["budget"] = self.budget.to_dict()
            out["kernel_fidelity"] = self.kernel_fidelity.to_dict() if self.kernel_fidelity is not None else None
        if self.promise is not None:
            out["promise"] = self.promise.to_dict()
        if self.over_budget is not None:
            out["over_budget"] = self.over_budget
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelMetrics:
        same = None
        if d.get("speedup_same_session") is not None:
            same = SessionComparison(d["speedup_same_session"], d["speedup_same_session_p10"], str(d["session"]),
                                     d.get("settings_file", "autotune/ort_session.json"),
                                     d.get("settings_what", "session settings"),
                                     d.get("settings_defaults", "ORT's defaults"))
        return cls(str(d["label"]), str(d["file"]), Scores.from_dict(d), str(d.get("sha256", "")),
                   d.get("custom_metric"), _opt(d.get("latency_ms"), ModelLatency.from_dict), d.get("speedup"),
                   d.get("speedup_p10"), same, _opt(d.get("budget"), AccuracyVerdict.from_dict),
                   _opt(d.get("kernel_fidelity"), FidelityResult.from_dict),
                   _opt(d.get("promise"), PromiseCheck.from_dict), d.get("over_budget"))


@dataclass(frozen=True)
class DataSummary:
    """The evaluation data: where it came from and how much of it was scored."""

    source: str
    samples: int | None
    batches: int
    batch_size: int
    labelled: bool
    max_batches: int | None = None


@dataclass(frozen=True)
class Duplicate:
    """A model left out of the table: its file is byte-identical to the ``identical_to`` model's."""

    model: str
    file: str
    identical_to: str


@dataclass(frozen=True)
class Reproduce:
    """`tune` command lines that rebuild the results_dir and that re-run only the evaluation; the config
    groups that came from a Python session (a shell cannot reach them)."""

    full: str
    evaluate_only: str
    in_memory: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class MachineSummary:
    """The CPU the models ran on, the one they were quantized on (its brand, where known), and what the
    shipped deployment was checked on."""

    cpu: CpuFacts
    cpu_line: str
    quantized_on: str | None = None
    # what the shipped deployment was checked on, with its verdict per CPU kind (None: not recorded)
    checked_on: CheckedOn | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu.to_dict(), "cpu_line": self.cpu_line, "quantized_on": self.quantized_on,
                "checked_on": self.checked_on.to_dict() if self.checked_on is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> MachineSummary:
        checked = d.get("checked_on")
        return cls(CpuFacts.from_dict(dict(d.get("cpu") or {})), str(d.get("cpu_line", "")), d.get("quantized_on"),
                   CheckedOn.from_dict(checked) if checked else None)


@dataclass(frozen=True)
class QuantizationSummary:
    """What the quantize stage did for accuracy (from its decisions), as the report tells it."""

    weight_range: str | None = None
    weight_range_reason: str | None = None
    float_nodes: list[str] = field(default_factory=list)
    budget: str | None = None
    transforms: list[TransformRecord] | None = None  # None: quantize ran none (as its decisions say)
    bias_correction: BiasCorrection | None = None
    fidelity_culprits: list[str] | None = None
    body_nodes: list[str] | None = None

    def to_dict(self) -> dict[str, Any]:
        transforms = [t.to_dict() for t in self.transforms] if self.transforms is not None else None
        return {**asdict(self), "transforms": transforms,
                "bias_correction": self.bias_correction.to_dict() if self.bias_correction is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantizationSummary:
        return cls(**{**_known(cls, {k: v for k, v in d.items() if v is not None}),
                      "transforms": None if d.get("transforms") is None else
                      [TransformRecord.from_dict(t) for t in d["transforms"]],
                      "bias_correction": _opt(d.get("bias_correction"), BiasCorrection.from_dict)})


@dataclass(frozen=True)
class CustomMetricSummary:
    """The user's metric (accuracy.metric=custom): its name, where it came from, each model's score."""

    name: str
    path: str
    relative: bool
    scores: dict[str, float | None]


@dataclass(frozen=True)
class SensitiveNode:
    node: str
    op_type: str
    label: str


@dataclass(frozen=True)
class SensitivitySummary:
    """Where the shipped model's error comes from (evaluate/sensitivity.json in brief): the largest
    per-node contributions, how many nodes were measured, and the charts written."""

    model: str
    whole_model: str
    top: list[SensitiveNode]
    nodes: int
    quantized_nodes: int
    left_float: list[str]
    files: list[str]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SensitivitySummary:
        return cls(**{**_known(cls, d), "top": [SensitiveNode(**_known(SensitiveNode, r)) for r in d["top"]]})


@dataclass(frozen=True)
class RuntimeTableRow:
    """One runtime of ``backend=auto``'s final comparison, as the report shows it: what it ships, its
    speed and its float's against the reference float, and its evaluation."""

    runtime: str
    shipped: str  # what ships of it: its own autotune's pick, or its float where that won
    float_precision: str
    accuracy: str
    p10_ms: float | None = None
    float_p10_ms: float | None = None
    error: str | None = None
    evaluation: RuntimeEvaluation | None = None
    evaluation_error: str | None = None
    vs_reference: float | None = None
    float_vs_reference: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RuntimeTableRow:
        return cls(**{**_known(cls, d), "evaluation": _opt(d.get("evaluation"), RuntimeEvaluation.from_dict)})


@dataclass(frozen=True)
class RuntimesTable:
    """Every runtime beside the one that ships, where the run chose its runtime by measurement."""

    reference: str
    reference_p10_ms: float
    winner: str
    rows: list[RuntimeTableRow]
    left_out: dict[str, str] = field(default_factory=dict)
    race: str = ""  # the race after PTQ in one line, where one ran (pipeline.app.race)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "rows": [r.to_dict() for r in self.rows]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RuntimesTable:
        return cls(**{**_known(cls, d), "rows": [RuntimeTableRow.from_dict(r) for r in d["rows"]]})


@dataclass
class EvaluateMetrics:
    """evaluate/metrics.json: the run's baseline, data and latency run, each model's metrics (by key:
    float, float_fp32 or float_default, ptq, autotuned), what ships, and the accuracy context."""

    baseline: str
    runtime: dict[str, Any]  # metrics.json's "backend": the runtime's own description (Backend.describe())
    data: DataSummary
    top_k: int
    models: dict[str, ModelMetrics]
    reproduce: Reproduce
    model_name: str = "model"
    duplicates: list[Duplicate] = field(default_factory=list)
    latency: LatencySummary | None = None
    shipped: str | None = None  # the key of the model that ships; None: only float was evaluated
    float_baseline: FloatBaseline | None = None  # autotune's choice, where evaluate follows it to FP32
    headline: str = ""
    runtimes: RuntimesTable | None = None
    machine: MachineSummary | None = None
    quantization: QuantizationSummary | None = None
    budget: str | None = None  # the accuracy budget, described
    custom_metric: CustomMetricSummary | None = None
    unseen_data: bool | None = None  # the evaluation data is not the calibration data
    promise_unchecked: str | None = None  # why the holdout verdicts could not be checked on unseen data
    over_budget: list[str] = field(default_factory=list)
    sensitivity: SensitivitySummary | None = None

    @property
    def custom_name(self) -> str | None:
        return self.custom_metric.name if self.custom_metric is not None else None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "baseline": self.baseline, "backend": self.runtime, "data": asdict(self.data), "top_k": self.top_k,
            "models": {k: m.to_dict() for k, m in self.models.items()},
            "duplicates": [asdict(d) for d in self.duplicates],
            "latency": self.latency.to_dict() if self.latency is not None else None,
            "model_name": self.model_name, "reproduce": asdict(self.reproduce), "shipped": self.shipped,
        }
        if self.float_baseline is not None:
            out["float_baseline"] = self.float_baseline.to_dict()
        if self.unseen_data is not None:
            out["unseen_data"] = self.unseen_data
        if self.promise_unchecked is not None:
            out["promise_unchecked"] = self.promise_unchecked
        if self.machine is not None:
            out["machine"] = self.machine.to_dict()
        if self.quantization is not None:
            out["quantization"] = self.quantization.to_dict()
        if self.budget is not None:
            out["budget"] = self.budget
        if self.custom_metric is not None:
            out["custom_metric"] = asdict(self.custom_metric)
        out["over_budget"] = list(self.over_budget)
        out["headline"] = self.headline
        if self.runtimes is not None:
            out["runtimes"] = self.runtimes.to_dict()
        if self.sensitivity is not None:
            out["sensitivity"] = asdict(self.sensitivity)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], where: str = "evaluate/metrics.json") -> EvaluateMetrics:
        """The record of a metrics.json (or the evaluate entry of a manifest); a layout no writer made is
        a one-line StateError naming ``where``."""
        with record_layout(where, "evaluate"):
            data = dict(d["data"])
            data.setdefault("max_batches", None)
            return cls(
                baseline=str(d["baseline"]), runtime=dict(d.get("backend") or {}), data=DataSummary(**_known(DataSummary, data)),
                top_k=int(d.get("top_k", 1)), models={k: ModelMetrics.from_dict(m) for k, m in d["models"].items()},
                reproduce=Reproduce(**_known(Reproduce, d.get("reproduce") or {"full": "", "evaluate_only": ""})),
                model_name=str(d.get("model_name", "model")),
                duplicates=[Duplicate(**_known(Duplicate, x)) for x in d.get("duplicates") or []],
                latency=_opt(d.get("latency"), LatencySummary.from_dict), shipped=d.get("shipped"),
                float_baseline=_opt(d.get("float_baseline"), FloatBaseline.from_dict), headline=str(d.get("headline", "")),
                runtimes=_opt(d.get("runtimes"), RuntimesTable.from_dict),
                machine=_opt(d.get("machine"), MachineSummary.from_dict),
                quantization=_opt(d.get("quantization"), QuantizationSummary.from_dict), budget=d.get("budget"),
                custom_metric=_opt(d.get("custom_metric"), lambda c: CustomMetricSummary(**_known(CustomMetricSummary, c))),
                unseen_data=d.get("unseen_data"), promise_unchecked=d.get("promise_unchecked"),
                over_budget=list(d.get("over_budget") or []),
                sensitivity=_opt(d.get("sensitivity"), SensitivitySummary.from_dict))


def runtime_evaluation(metrics: EvaluateMetrics, report: str) -> RuntimeEvaluation:
    """A runtime's evaluate run as the top-level report of ``backend=auto`` shows it (``report``: its
    report.md, relative to the top-level results_dir)."""
    models = []
    for key, m in metrics.models.items():
        found = m.accuracy(key, metrics.custom_name)
        models.append(ModelSummary(key, m.label, f"{found[0]} {found[1]}" if found else None, m.speedup_p10,
                                   m.over_budget is not None))
    return RuntimeEvaluation(metrics.baseline, metrics.shipped, models, report)
