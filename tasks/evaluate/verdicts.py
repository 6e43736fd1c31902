"""Evaluate's verdicts: every quantized model held to the accuracy budget on the evaluation data,
with the likely cause of a miss (kernel fidelity, another CPU), and the promise checked: each model
passed the budget on the held-out calibration samples; on evaluation data the pipeline never tuned
on, its metric is reported next to that holdout verdict, and a model that passed the holdout but
misses the budget there is flagged in one line. Verdicts on the evaluation data are on the metric's value
over it (the user's own data), not on its confidence bound."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from pipeline.accuracy.budget import AccuracyBudget, AccuracyVerdict, CustomScore
from pipeline.accuracy.fidelity import FidelityResult
from pipeline.accuracy.kinds import CheckedOn
from pipeline.accuracy.metrics import ModelScores
from pipeline.config import resolved_data_source
from pipeline.data.adapters import takes_split
from pipeline.data.live import metric_name
from pipeline.quant.cpu import CpuFacts, cpu_facts, describe
from pipeline.records.autotune import autotune_metrics
from pipeline.records.evaluate import (
    CustomMetricSummary,
    EvaluateMetrics,
    MachineSummary,
    PromiseCheck,
    QuantizationSummary,
)
from pipeline.records.quantize import QuantizeDecisions, quantize_decisions
from pipeline.records.stages import shipped_record
from pipeline.stage import StageContext

log = logging.getLogger("tune.evaluate")


def unseen_data(cfg: DictConfig) -> str | None:
    """None when evaluation reads data the pipeline did not calibrate or hold out on, else why not
    (for the report)."""
    d, source = cfg.data, resolved_data_source(cfg)
    if source == "digits":
        return None  # the test split (data.test_fraction), never calibrated on
    if source in ("synthetic", "none"):
        return "the evaluation data is synthetic"
    if source == "npz":
        if d.eval_path and Path(str(d.eval_path)).expanduser().resolve() != Path(str(d.path)).expanduser().resolve():
            return None
        return "evaluation reads the calibration data (set data.eval_path to data the pipeline never saw)"
    args = d.get("args") or {}
    if "calibration" in args and "evaluation" in args:  # in-memory data given to pipeline.api.tune
        return None if args["calibration"] != args["evaluation"] else \
            "evaluation reads the calibration data (pass eval_data= to pipeline.api.tune)"
    return None if takes_split(str(d._target_)) else \
        "evaluation reads the calibration data (give data._target_ a split argument that returns other data)"


@dataclass(frozen=True)
class Promise:
    """What the pipeline promised about one quantized model: its verdict on the held-out samples."""

    key: str  # "ptq" or "autotuned"
    holdout: AccuracyVerdict | None

    @classmethod
    def of(cls, key: str, ctx: StageContext) -> Promise:
        """The holdout verdict quantize (ptq) or autotune (autotuned) recorded for its model."""
        if key == "ptq":
            return cls(key, quantize_decisions(ctx.artifact("quantize/calibration.json")).accuracy)
        tuned = autotune_metrics(ctx.manifest.metrics("autotune"), f"{ctx.manifest.path}'s autotune entry") \
            if key == "autotuned" else None
        return cls(key, tuned.accuracy.final if tuned is not None else None)

    def check(self, verdict: AccuracyVerdict, samples: int | None, label: str) -> tuple[PromiseCheck, str | None]:
        """(the record for metrics.json, the one-line flag when the holdout passed and ``verdict``, the
        model's verdict on the evaluation data, misses the budget; else None)."""
        record = PromiseCheck(self.holdout, verdict.ok, verdict.what, samples)
        if self.holdout is None or not self.holdout.ok or verdict.ok:
            return record, None
        return record, (f"{label} model passed the holdout ({self.holdout.what}) but misses the budget on "
                        f"{samples} evaluation samples it never saw: {verdict.what}; give the calibration data more "
                        f"samples like these (accuracy.holdout_samples) or raise accuracy.confidence")


def judge_models(ctx: StageContext, metrics: EvaluateMetrics, scores: dict[str, ModelScores],
                 fidelity: dict[str, FidelityResult | None], floats: tuple[str, ...]) -> None:
    """Hold every quantized model (the keys of ``metrics.models`` not in ``floats``) to the accuracy
    budget on the evaluation data; say in words which ones miss it and why, and which broke the
    holdout's promise."""
    budget = AccuracyBudget.from_config(ctx.cfg)
    decisions = quantize_decisions(ctx.artifact("quantize/calibration.json"))
    facts = _facts(metrics, budget, decisions, shipped_record(ctx.manifest))
    models = metrics.models
    float_top1 = models["float"].scores.top1
    flagged = []
    unseen = unseen_data(ctx.cfg)
    metrics.unseen_data = unseen is None
    metrics.promise_unchecked = unseen
    for key, m in models.items():
        if key in floats:
            continue
        custom = CustomScore(models["float"].custom_metric, m.custom_metric) if budget.metric == "custom" else None
        # judged on the value over the evaluation data (ModelScores keep no per-sample values here)
        s = scores[key].scores()
        v = budget.judge(s, float_top1, custom, where="evaluation samples")
        fid = fidelity.get(key)
        m.budget, m.kernel_fidelity = v, fid
        broken = None
        if unseen is None:
            m.promise, broken = Promise.of(key, ctx).check(v, s.samples, m.label)
        if not v.ok:
            cause = _cause(fid, facts, decisions)
            # one line per model: a broken promise says it misses the budget, with the holdout it passed
            miss = broken or f"{m.label} model misses the accuracy budget: {v.what}"
            m.over_budget = miss + (f"; {cause}" if cause else "")
            flagged.append(m.over_budget)
    for line in flagged:
        log.warning("%s", line)
    metrics.over_budget = flagged


def _facts(metrics: EvaluateMetrics, budget: AccuracyBudget, decisions: QuantizeDecisions,
           checked: CheckedOn | None) -> CpuFacts:
    """The machine (with what the shipped deployment was ``checked`` on), the quantization decisions and
    the budget into ``metrics``; the CPU's facts."""
    facts = cpu_facts()
    metrics.machine = MachineSummary(facts, describe(facts), decisions.cpu.brand if decisions.cpu else None,
                                     checked)
    metrics.quantization = QuantizationSummary(
        decisions.weight_range.value, decisions.weight_range_reason, list(decisions.float_nodes or []), decisions.budget,
        decisions.transforms, decisions.bias_correction, decisions.fidelity_culprits, decisions.body_nodes)
    metrics.budget = budget.describe()
    if budget.metric == "custom":
        metrics.custom_metric = CustomMetricSummary(
            metric_name(budget.custom_metric), str(budget.custom_metric), bool(budget.relative),
            {k: m.custom_metric for k, m in metrics.models.items()})
    return facts


def _cause(fid: FidelityResult | None, facts: CpuFacts, decisions: QuantizeDecisions) -> str:
    """The likely cause of a model over budget: its kernels' fidelity here, or another CPU."""
    if fid is not None and fid.checked and not fid.ok:
        cause = f"likely cause: {fid.reason} on {describe(facts)}"
        if facts.u8s8_saturates and decisions.weight_range == "full":
            cause += ", whose u8s8 kernels saturate with full-range int8 weights (AVX2 without VNNI)"
        return cause
    quantized_on = decisions.cpu
    if quantized_on is not None and (quantized_on.brand, quantized_on.flags) != (facts.brand, facts.flags):
        return (f"likely cause: quantized on {quantized_on.describe()}, evaluated on "
                f"{facts.describe()}: re-run stages=[quantize,...] on this machine")
    return ""
