"""Accuracy is part of every decision: the budget, the held-out slice it is checked on, and the
kernel-fidelity check.

- ``AccuracyBudget`` (``accuracy.*``) says how far a quantized model may drift from the
  float model: top-1 drop with labels; without labels every float output must meet the SNR floor on
  its own (an embedding is never excused by argmax agreement), and for class scores top-1 agreement
  on the decisive samples (a clear float top-1; near-tied random logits flip on any noise) must hold
  too. Explicit metrics (top1, agreement, snr, cosine) apply alone; snr and cosine to every output.
- ``Holdout`` is a slice of the calibration data the calibrator did not see (the batches after the
  first ``quantize.calibration.batches``), with the float model's outputs on it; ``score`` runs a
  prepared model on it and judges the result against the budget.
- ``CustomMetric`` is the user's own accuracy (accuracy.custom_metric), called over whole slices.
Kernel fidelity (fused kernels vs plain Q/DQ math) is pipeline/accuracy/fidelity.py; the scores
every verdict reads are pipeline/accuracy/scores.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from omegaconf import DictConfig

from pipeline.accuracy.metrics import FIRST_OUTPUT, ModelScores, db_text, json_safe, valid_rows
from pipeline.accuracy.scores import Scores
from pipeline.data.live import metric_name
from pipeline.errors import ConfigError, InputError, first_line
from pipeline.values import enum_value

log = logging.getLogger("tune.accuracy")

@dataclass(frozen=True)
class AccuracyBudget:
    """How far a quantized model may drift from the float model (see module docstring)."""

    metric: str = "auto"
    max_drop: float = 1.0  # points: top-1 (labels) or top-1 agreement; metric=custom: the metric's units
    min_snr_db: float = 20.0
    min_cosine: float = 0.99
    enabled: bool = True
    outputs: tuple[str, ...] = ()  # the outputs judged (empty: every output)
    per_output: tuple[tuple[str, str], ...] = ()  # (output, snr|cosine|agreement) replacing the default metric
    custom_metric: str | None = None  # metric=custom: the function's dotted path
    relative: bool = False  # metric=custom: max_drop in percent of the float model's score
    # the share of max_drop that top-1 agreement with the float model may lose (tightened() lowers it)
    agreement_share: float = 1.0

    @classmethod
    def from_config(cls, cfg: DictConfig) -> AccuracyBudget:
        a = cfg.accuracy
        return cls(enum_value(a.metric), float(a.max_drop), float(a.min_snr_db), float(a.min_cosine),
                   bool(a.enabled), tuple(a.outputs or ()),
                   tuple((str(k), enum_value(v)) for k, v in (a.per_output or {}).items()),
                   a.custom_metric or None, bool(a.relative))

    def tightened(self, margin_db: float) -> AccuracyBudget:
        """This budget ``margin_db`` inside its SNR floor, and the same factor on 1 - cosine, on a
        custom metric's allowed drop and on the top-1 disagreement with the float model allowed
        (top-1 against labels unchanged: it is not an error the quantization adds)."""
        factor = 10 ** (-margin_db / 10)
        return replace(self, min_snr_db=self.min_snr_db + margin_db, min_cosine=1.0 - (1.0 - self.min_cosine) * factor,
                       max_drop=self.max_drop * factor if self.metric == "custom" else self.max_drop,
                       agreement_share=self.agreement_share * factor)

    def agreement_tightened(self, margin_db: float) -> AccuracyBudget:
        """This budget with only the top-1 disagreement allowed tightened as ``tightened`` does."""
        return replace(self, agreement_share=self.tightened(margin_db).agreement_share)

    @property
    def max_disagreement(self) -> float:
        """Points of top-1 agreement with the float model that may be lost."""
        return self.max_drop * self.agreement_share

    def describe(self) -> str:
        if self.metric == "custom":
            what = f"{metric_name(self.custom_metric or 'custom')} drop <= {self.max_drop:g}{'% of the float score' if self.relative else ''}"
            return what + self._scope()
        base = {"top1": f"top-1 drop <= {self.max_drop:g} points",
                "agreement": f"top-1 agreement >= {100 - self.max_disagreement:.3g}%",
                "snr": f"SNR >= {self.min_snr_db:g} dB on every output",
                "cosine": f"cosine >= {self.min_cosine:g} on every output"}.get(
            self.metric, f"top-1 drop <= {self.max_drop:g} points with labels, else SNR >= {self.min_snr_db:g} dB "
                         f"on every output and, for class scores, agreement >= {100 - self.max_disagreement:.3g}% on "
                         f"decisive samples")
        return base + self._scope()

    def _scope(self) -> str:
        parts = []
        if self.outputs:
            parts.append("judged on " + ", ".join(f"'{o}'" for o in self.outputs))
        if self.per_output:
            parts.append(", ".join(f"{m} on '{o}'" for o, m in self.per_output))
        return f" ({'; '.join(parts)})" if parts else ""

    def check_outputs(self, names: list[str] | None) -> None:
        """A ConfigError naming the model's outputs when accuracy.outputs / per_output name another."""
        if not names:
            return
        for key, given in (("accuracy.outputs", self.outputs), ("accuracy.per_output", [o for o, _ in self.per_output])):
            unknown = [o for o in given if o not in names]
            if unknown:
                raise ConfigError(f"{key}: the model has no output {', '.join(repr(o) for o in unknown)}; its outputs "
                                  f"are {', '.join(names)}")

    def judge(self, scores: Scores | Mapping[str, Any], float_top1: float | None,
              custom: tuple[float, float] | None = None) -> AccuracyVerdict:
        """Verdict for a model's Scores, or their ``to_dict`` form (``float_top1``: the float model's
        top-1; ``custom``: (float model's, this model's) score of accuracy.custom_metric).

        Without labels every judged float output is held to the budget on its own (its SNR, or its
        cosine with ``metric=cosine``, or the metric ``per_output`` names for it) and the worst one
        decides; for class scores, top-1 agreement on the decisive samples is an extra condition,
        never an excuse for a noisy output.
        """
        if not isinstance(scores, Scores):
            scores = Scores.from_dict(scores)
        judged = _judged(scores, self.outputs, {o for o, _ in self.per_output})
        verdict = (self._custom(judged, custom) if self.metric == "custom" else
                   self._default(judged, float_top1) if judged.any_judged() or not self.per_output else None)
        for output, metric in self.per_output:
            own = self._one_output(scores, output, metric)
            verdict = own if verdict is None else verdict.combined(own)
        if verdict is not None and not verdict.ok:
            verdict = replace(verdict, passing=_passing(scores, self))
        return verdict if self.enabled or verdict.ok else replace(verdict, ok=True)

    def _custom(self, scores: Scores, custom: tuple[float, float] | None) -> AccuracyVerdict:
        if custom is None:
            raise RuntimeError("metric=custom: judge() needs the custom scores (Holdout.judge computes them)")
        ref, got = custom
        drop = ref - got
        allowed = self.max_drop * abs(ref) / 100.0 if self.relative else self.max_drop
        name = metric_name(self.custom_metric or "custom")
        limit = f"{self.max_drop:g}% of float" if self.relative else f"{self.max_drop:g}"
        worst_snr, _, _ = scores.worst("snr_db")
        return AccuracyVerdict(ok=drop <= allowed, metric="custom",
                               what=f"{name} {got:.4g} (float {ref:.4g}, drop {drop:.4g}, max {limit})",
                               snr_db=worst_snr, custom=got, custom_float=ref)

    def _one_output(self, scores: Scores, output: str, metric: str) -> AccuracyVerdict:
        """``output`` judged by ``metric`` alone (accuracy.per_output)."""
        i = (scores.output_names or []).index(output)
        if metric == "agreement":
            own = scores.outputs[i]
            agree, n = own.decisive_agreement, own.decisive_samples
            if agree is None:
                agree = own.agreement
            ok = agree is not None and 100.0 * (1.0 - agree) <= self.max_disagreement
            on = f" on {n} decisive samples" if n else ""
            what = (f"agreement n/a on output '{output}' (no class scores)" if agree is None else
                    f"agreement {100 * agree:.1f}%{on} on output '{output}' (min {100 - self.max_disagreement:.3g}%)")
            return AccuracyVerdict(ok=ok, metric="agreement", what=what, snr_db=own.snr_db, agreement=agree,
                                   output=_name(output))
        return replace(self, metric=metric, outputs=(), per_output=())._default(scores.only(i), None)

    def _default(self, scores: Scores, float_top1: float | None) -> AccuracyVerdict:
        top1 = scores.top1
        drop = None if top1 is None or float_top1 is None else 100.0 * (float_top1 - top1)
        agree = scores.agreement
        # scores that never counted decisive samples (a bare dict) are judged on their plain agreement
        decisive = scores.decisive_agreement if scores.decisive_samples is not None else agree
        worst_snr, snr_out, n_out = scores.worst("snr_db")
        worst_cos, cos_out, _ = scores.worst("cosine")
        metric = self.metric
        if metric == "auto":
            metric = "top1" if drop is not None else ("snr_and_agreement" if agree is not None else "snr")
        if metric == "top1" and drop is None:
            metric = "agreement" if agree is not None else "snr"
        if metric == "agreement" and agree is None:
            metric = "snr"
        of = f" of {n_out} outputs" if n_out > 1 else ""
        snr_ok = worst_snr is not None and (worst_snr == math.inf or worst_snr >= self.min_snr_db)
        snr_what = f"SNR {db_text(worst_snr)} on {_name(snr_out)} (min {self.min_snr_db:g} dB{', worst' + of if of else ''})"
        output = snr_out
        if metric == "top1":
            ok, what = drop <= self.max_drop, f"top-1 drop {drop:.2f} points (max {self.max_drop:g})"
            output = None
        elif metric == "agreement":
            ok = 100.0 * (1.0 - agree) <= self.max_disagreement
            what = f"agreement {100 * agree:.1f}% (min {100 - self.max_disagreement:.3g}%)"
        elif metric == "snr_and_agreement":
            n_dec = scores.decisive_samples
            agree_ok = decisive is None or 100.0 * (1.0 - decisive) <= self.max_disagreement
            ok = snr_ok and agree_ok
            on = f" on {n_dec} decisive samples" if n_dec is not None else ""
            what = snr_what + ("; agreement n/a (no decisive samples)" if decisive is None else
                               f"; agreement {100 * decisive:.1f}%{on} (min {100 - self.max_disagreement:.3g}%)")
        elif metric == "cosine":
            ok = worst_cos is not None and worst_cos >= self.min_cosine
            what = (f"cosine {worst_cos if worst_cos is not None else float('nan'):.4f} on {_name(cos_out)} "
                    f"(min {self.min_cosine:g}{', worst' + of if of else ''})")
            output = cos_out
        else:
            ok, what = snr_ok, snr_what
        return AccuracyVerdict(ok=bool(ok), metric=metric, what=what, snr_db=worst_snr, cosine=worst_cos,
                               agreement=agree, top1=top1, top1_drop=drop,
                               output=_name(output) if output is not None else None)


def _judged(scores: Scores, outputs: tuple[str, ...], elsewhere: set[str]) -> Scores:
    """``scores`` restricted to the outputs the default metric judges: ``outputs`` (empty: all) less
    those judged ``elsewhere`` (accuracy.per_output)."""
    names = scores.output_names
    if not names or (not outputs and not elsewhere):
        return scores
    return scores.restricted([(not outputs or n in outputs) and n not in elsewhere for n in names])


def _passing(scores: Scores, budget: AccuracyBudget) -> tuple[str, ...]:
    """The outputs that meet the budget's per-output floor on their own (SNR, or cosine), when there
    are several: a verdict that fails on one output names the others, so the user can say which
    output matters (accuracy.outputs)."""
    names = scores.output_names or []
    if len(names) < 2 or budget.metric in ("custom", "top1") or (budget.metric == "auto" and scores.top1 is not None):
        return ()  # a whole-model metric decided: judging fewer outputs would not change it
    attr, floor = ("cosine", budget.min_cosine) if budget.metric == "cosine" else ("snr_db", budget.min_snr_db)
    return tuple(o.name for o in scores.outputs
                 if o.is_float and getattr(o, attr) is not None and getattr(o, attr) >= floor)


def _name(output: str | int | None) -> str:
    if output is None:
        return "the output"
    return f"output {output}" if isinstance(output, int) else f"output '{output}'"


@dataclass(frozen=True)
class AccuracyVerdict:
    ok: bool
    metric: str
    what: str  # the numbers the verdict rests on, for log lines
    snr_db: float | None = None
    cosine: float | None = None
    agreement: float | None = None
    top1: float | None = None
    top1_drop: float | None = None
    output: str | None = None  # the output the verdict rests on (the worst one)
    custom: float | None = None  # metric=custom: this model's score
    custom_float: float | None = None  # ... and the float model's
    passing: tuple[str, ...] = ()  # a failed verdict: the outputs that meet the budget on their own

    def combined(self, other: AccuracyVerdict) -> AccuracyVerdict:
        """Both verdicts must hold; the numbers are the worse of the two."""
        worse = self if (other.snr_db is None or (self.snr_db is not None and self.snr_db <= other.snr_db)) else other
        failing = self if not self.ok else other if not other.ok else worse
        low = [x for x in (self.cosine, other.cosine) if x is not None]
        return replace(self, ok=self.ok and other.ok, what=f"{self.what}; {other.what}", snr_db=worse.snr_db,
                       cosine=min(low) if low else None, output=failing.output,
                       agreement=self.agreement if self.agreement is not None else other.agreement)

    @property
    def hint(self) -> str:
        """For a failed verdict on a model with several outputs, how to judge only the ones that matter."""
        if self.ok or not self.passing:
            return ""
        names = ", ".join(self.passing)
        return (f"output{'s' if len(self.passing) > 1 else ''} {names} meet{'' if len(self.passing) > 1 else 's'} "
                f"the budget on {'their' if len(self.passing) > 1 else 'its'} own: if only "
                f"{'they matter' if len(self.passing) > 1 else 'it matters'}, set accuracy.outputs=[{names}]")

    def to_dict(self) -> dict[str, Any]:
        return json_safe(asdict(self))

    @property
    def error(self) -> float:
        """Noise-to-signal ratio of the outputs (lower is better), for ranking."""
        if self.snr_db is None or math.isnan(self.snr_db):
            return math.inf
        return 10 ** (-self.snr_db / 10) if self.snr_db != math.inf else 0.0


@dataclass(frozen=True)
class CustomMetric:
    """accuracy.custom_metric: the user's ``fn(outputs, reference, labels) -> float`` (higher is better),
    called once per model over all held-out (or evaluation) batches, so dataset-level metrics work.
    ``outputs`` and ``reference`` hold one {output name: array} dict per batch (the model's and the
    float model's, padding samples removed); ``labels`` one array per batch, or None without labels."""

    path: str
    fn: Callable[..., Any]

    @classmethod
    def from_config(cls, cfg: DictConfig) -> CustomMetric | None:
        from pipeline.registry import import_object

        a = cfg.accuracy
        if enum_value(a.metric) != "custom" or not a.custom_metric:
            return None
        return cls(str(a.custom_metric), import_object(str(a.custom_metric), "accuracy.custom_metric"))

    @property
    def name(self) -> str:
        return metric_name(self.path)

    def __call__(self, outputs: list[dict[str, np.ndarray]], reference: list[dict[str, np.ndarray]],
                 labels: list[np.ndarray] | None) -> float:
        try:
            value = self.fn(outputs, reference, labels)
        except Exception as exc:  # noqa: BLE001 - the user's code: one line naming it, not our traceback
            raise InputError(f"accuracy.custom_metric={self.path} raised {type(exc).__name__}: {first_line(exc)}; "
                             f"fix the function (it is called as fn(outputs, reference, labels))") from None
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise InputError(f"accuracy.custom_metric={self.path} returned {type(value).__name__}, not a number; "
                             f"it must return a float (higher is better)") from None
        if math.isnan(value):
            raise InputError(f"accuracy.custom_metric={self.path} returned NaN; it must return a number "
                             f"(higher is better)")
        return value


def by_name(outputs: list[np.ndarray], names: list[str] | None, valid: int) -> dict[str, np.ndarray]:
    """One batch's outputs as {name: array} with the padding samples removed (what a custom metric sees)."""
    batch = next((o.shape[0] for o in outputs if o.ndim), None)
    keys = names if names and len(names) == len(outputs) else [str(i) for i in range(len(outputs))]
    return {k: valid_rows(np.asarray(o), valid, batch) for k, o in zip(keys, outputs, strict=True)}


def labels_of(labels: list[np.ndarray | None], valid: list[int]) -> list[np.ndarray] | None:
    """Each batch's labels without padding, or None when a batch has none."""
    if not labels or any(x is None for x in labels):
        return None
    return [np.asarray(x)[:v] for x, v in zip(labels, valid, strict=True)]


@dataclass
class Holdout:
    """Feeds the calibrator did not see, with labels and the float model's outputs on them."""

    feeds: list[dict[str, np.ndarray]]
    labels: list[np.ndarray | None]
    valid: list[int]
    reference: list[list[np.ndarray]] = field(default_factory=list)
    float_top1: float | None = None
    source: str = ""
    output_names: list[str] | None = None
    budget: AccuracyBudget | None = None  # checked against the model's outputs by set_reference
    class_outputs: list[str] | None = None
    metric: CustomMetric | None = None
    float_custom: float | None = None  # the float model's score of ``metric``

    @classmethod
    def from_config(cls, cfg: DictConfig, specs: list) -> Holdout:
        """The ``accuracy.holdout_batches`` calibration batches after the
        ``quantize.calibration.batches`` calibrated on; when the data runs out before that, its last
        batches (then overlapping calibration, and said so). Quantize and autotune use the same slice."""
        from pipeline.data.adapters import DataProvider

        skip, count = int(cfg.quantize.calibration.batches), int(cfg.accuracy.holdout_batches)
        provider = DataProvider(cfg, specs)
        window: list = []
        seen = 0
        for b in provider.batches("calibration", skip + count):
            seen += 1
            window.append(b)
            if len(window) > count:
                window.pop(0)
        fresh = max(0, seen - skip)
        source = f"calibration batches {skip}..{seen - 1} (not calibrated on)"
        if fresh < count:
            source = (f"the last {len(window)} calibration batches ({min(len(window), count - fresh)} of them also "
                      f"calibrated on: the calibration data has only {seen} batches)")
        return cls([b.feeds for b in window], [b.labels for b in window], [b.valid for b in window], source=source,
                   budget=AccuracyBudget.from_config(cfg), class_outputs=class_outputs(cfg),
                   metric=CustomMetric.from_config(cfg))

    def set_reference(self, prepared: Any) -> None:
        """Run the float model (a PreparedModel) once; its outputs are what candidates are compared with."""
        self.reference = self.outputs(prepared)
        self.output_names = list(getattr(prepared, "output_names", None) or []) or None
        check_output_names(self.budget, self.class_outputs, self.output_names)
        self.float_top1 = self.scores(self.reference).top1
        if self.metric is not None:
            self.float_custom = self.metric(self._named(self.reference), self._named(self.reference),
                                            labels_of(self.labels, self.valid))

    def _named(self, outputs: list[list[np.ndarray]]) -> list[dict[str, np.ndarray]]:
        return [by_name(o, self.output_names, v) for o, v in zip(outputs, self.valid, strict=True)]

    def scores(self, outputs: list[list[np.ndarray]]) -> Scores:
        """The scores of a model's outputs on the holdout against the float outputs."""
        s = ModelScores(top_k=1, output_names=list(self.output_names or []), class_outputs=self.class_outputs)
        for ref, out, labels, valid in zip(self.reference, outputs, self.labels, self.valid, strict=True):
            s.update(ref, out, labels, valid)
        return s.scores()

    def outputs(self, prepared: Any) -> list[list[np.ndarray]]:
        return [[np.asarray(o) for o in prepared.run(f)] for f in self.feeds]

    def judge(self, outputs: list[list[np.ndarray]], budget: AccuracyBudget) -> AccuracyVerdict:
        """``budget``'s verdict on a model's outputs on the holdout (``outputs(prepared)``)."""
        custom = None
        if self.metric is not None and budget.metric == "custom":
            custom = (self.float_custom, self.metric(self._named(outputs), self._named(self.reference),
                                                     labels_of(self.labels, self.valid)))
        return budget.judge(self.scores(outputs), self.float_top1, custom)

    def score(self, prepared: Any, budget: AccuracyBudget) -> AccuracyVerdict:
        """Run ``prepared`` on the holdout and judge it against ``budget``."""
        if not self.reference:
            raise RuntimeError("Holdout.score before set_reference")
        return self.judge(self.outputs(prepared), budget)

    @property
    def samples(self) -> int:
        return int(sum(self.valid))


def class_outputs(cfg: DictConfig) -> list[str] | None:
    """accuracy.class_outputs, plus the outputs accuracy.per_output judges by agreement (which needs
    class scores counted on them); None: the shape guess on the first output, and those outputs."""
    a = cfg.accuracy
    agreement = [str(o) for o, m in (a.per_output or {}).items() if enum_value(m) == "agreement"]
    if a.class_outputs is None:
        return None if not agreement else [FIRST_OUTPUT, *agreement]
    return list(dict.fromkeys([*a.class_outputs, *agreement]))


def check_output_names(budget: AccuracyBudget | None, class_outputs: list[str] | None,
                       names: list[str] | None) -> None:
    """A ConfigError naming the model's outputs when an accuracy key names an output it does not have."""
    if budget is not None:
        budget.check_outputs(names)
    unknown = [o for o in class_outputs or [] if names and o not in names and o != FIRST_OUTPUT]
    if unknown:
        raise ConfigError(f"accuracy.class_outputs: the model has no output {', '.join(repr(o) for o in unknown)}; "
                          f"its outputs are {', '.join(names or [])}")
