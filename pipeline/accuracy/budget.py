"""Accuracy is part of every decision: the budget, the held-out slice it is checked on, and the
kernel-fidelity check.

- ``AccuracyBudget`` (``accuracy.*``) says how far a quantized model may drift from the
  float model: top-1 drop with labels; without labels every float output must meet the SNR floor on
  its own (an embedding is never excused by argmax agreement), and for class scores top-1 agreement
  on the decisive samples (a clear float top-1; near-tied random logits flip on any noise) must hold
  too. Explicit metrics (top1, agreement, snr, cosine) apply alone; snr and cosine to every output.
  A model passes only when the budget holds at the one-sided ``accuracy.confidence`` bound of the
  metric over the samples it was judged on (pipeline/accuracy/confidence.py), so a verdict on few
  samples is stricter than one on many; every verdict names the metric, its spread, the bound and
  the number of samples.
- ``CustomMetric`` is the user's own accuracy (accuracy.custom_metric), called over whole slices.
The held-out slice the budget is checked on is pipeline/accuracy/holdout.py; kernel fidelity (fused
kernels vs plain Q/DQ math) is pipeline/accuracy/fidelity.py; the scores every verdict reads are
pipeline/accuracy/scores.py.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
from omegaconf import DictConfig

from pipeline.accuracy.metrics import db_text, json_safe
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
    confidence: float = 0.95  # one-sided: the budget must hold at this bound of the metric

    @classmethod
    def from_config(cls, cfg: DictConfig) -> AccuracyBudget:
        a = cfg.accuracy
        return cls(enum_value(a.metric), float(a.max_drop), float(a.min_snr_db), float(a.min_cosine),
                   bool(a.enabled), tuple(a.outputs or ()),
                   tuple((str(k), enum_value(v)) for k, v in (a.per_output or {}).items()),
                   a.custom_metric or None, bool(a.relative), confidence=float(a.confidence))

    def tightened(self, margin_db: float) -> AccuracyBudget:
        """This budget ``margin_db`` inside its SNR floor, and the same factor on 1 - cosine, on a
        custom metric's allowed drop and on the top-1 disagreement with the float model allowed
        (top-1 against labels unchanged: it is not an error the quantization adds)."""
        factor = 10 ** (-margin_db / 10)
        return replace(self, min_snr_db=self.min_snr_db + margin_db, min_cosine=1.0 - (1.0 - self.min_cosine) * factor,
                       max_drop=self.max_drop * factor if self.metric == "custom" else self.max_drop,
                       agreement_share=self.agreement_share * factor)

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

    def judge(self, scores: Scores, float_top1: float | None,
              custom: CustomScore | None = None, where: str = "samples") -> AccuracyVerdict:
        """Verdict for a model's Scores (``float_top1``: the float model's top-1; ``custom``:
        accuracy.custom_metric's scores; ``where``: what the samples are, for the verdict's text, e.g.
        "held-out samples").

        Without labels every judged float output is held to the budget on its own (its SNR, or its
        cosine with ``metric=cosine``, or the metric ``per_output`` names for it) and the worst one
        decides; for class scores, top-1 agreement on the decisive samples is an extra condition,
        never an excuse for a noisy output. Each condition holds at its confidence bound when the
        scores carry their per-sample values, else at its value.
        """
        judge = _Judge(self, scores, where)
        judged = _judged(scores, self.outputs, {o for o, _ in self.per_output})
        verdict = (judge.custom(custom) if self.metric == "custom" else
                   judge.default(judged, float_top1) if judged.any_judged() or not self.per_output else None)
        for output, metric in self.per_output:
            own = judge.one_output(output, metric)
            verdict = own if verdict is None else verdict.combined(own)
        if verdict is not None and not verdict.ok:
            verdict = replace(verdict, passing=_passing(scores, self))
        return verdict if self.enabled or verdict.ok else replace(verdict, ok=True)


@dataclass(frozen=True)
class CustomScore:
    """accuracy.custom_metric on the float model and on the judged one (higher is better), and the
    upper confidence bound of the drop between them (None: the drop itself)."""

    float_score: float
    score: float
    drop_bound: float | None = None

    @property
    def drop(self) -> float:
        return self.float_score - self.score


@dataclass(frozen=True)
class _Judge:
    """One judge() call: the budget, the scores and the confidence bounds of their metrics."""

    budget: AccuracyBudget
    scores: Scores
    where: str

    @property
    def _pct(self) -> str:
        return f"{100 * self.budget.confidence:g}%"

    def _on(self, n: int | None) -> str:
        return f"{n} {self.where}" if n is not None else self.where

    def _sure(self, bound_text: str, n: int | None, upper: bool = False, spread: str = "") -> str:
        """"sd S, 95% lower bound B, N held-out samples; " when the scores carry per-sample values
        (the bound was computed), else "N samples; " (the verdict is on the value)."""
        ps = self.scores.per_sample
        if ps is None or not ps.n:
            return f"{self._on(n)}; " if n is not None else ""
        parts = [f"sd {spread}"] if spread else []
        parts.append(f"{self._pct} {'upper' if upper else 'lower'} bound {bound_text}")
        parts += [self._on(n)] if n is not None else []
        return ", ".join(parts) + "; "

    def custom(self, custom: CustomScore | None) -> AccuracyVerdict:
        b = self.budget
        if custom is None:
            raise RuntimeError("metric=custom: judge() needs the custom scores (Holdout.judge computes them)")
        ref, got, drop = custom.float_score, custom.score, custom.drop
        high = drop if custom.drop_bound is None or math.isnan(custom.drop_bound) else max(drop, custom.drop_bound)
        allowed = b.max_drop * abs(ref) / 100.0 if b.relative else b.max_drop
        name = metric_name(b.custom_metric or "custom")
        limit = f"{b.max_drop:g}% of float" if b.relative else f"{b.max_drop:g}"
        worst_snr, _, _ = self.scores.worst("snr_db")
        return AccuracyVerdict(ok=high <= allowed, metric="custom",
                               what=f"{name} {got:.4g} (float {ref:.4g}, drop {drop:.4g}, "
                                    f"{self._sure(f'{high:.4g}', self.scores.samples, True)}max {limit})",
                               snr_db=worst_snr, custom=got, custom_float=ref, bound=high,
                               samples=self.scores.samples, confidence=b.confidence)

    def one_output(self, output: str, metric: str) -> AccuracyVerdict:
        """``output`` judged by ``metric`` alone (accuracy.per_output)."""
        scores, b = self.scores, self.budget
        i = scores.index_of(output)
        if metric == "agreement":
            own = scores.outputs[i]
            decisive = own.decisive_agreement is not None
            agree = own.decisive_agreement if decisive else own.agreement
            low = self.agreement_bound(i, agree, decisive)
            n = own.decisive_samples if decisive else None
            ok = low is not None and 100.0 * (1.0 - low) <= b.max_disagreement
            on = f" on {n} decisive samples" if n else ""
            what = (f"agreement n/a on output '{output}' (no class scores)" if agree is None else
                    f"agreement {100 * agree:.1f}%{on} on output '{output}' "
                    f"({self._sure(f'{100 * low:.1f}%', scores.samples)}min {100 - b.max_disagreement:.3g}%)")
            return AccuracyVerdict(ok=ok, metric="agreement", what=what, snr_db=own.snr_db, agreement=agree,
                                   output=_name(output), bound=low, samples=n, confidence=b.confidence)
        alone = replace(b, metric=metric, outputs=(), per_output=())
        return replace(self, budget=alone).default(scores.only(i), None)

    def agreement_bound(self, i: int | None, agree: float | None, decisive: bool) -> float | None:
        ps = self.scores.per_sample
        if agree is None or ps is None or i is None or not ps.n:
            return agree
        low = ps.agreement_bound(i, self.budget.confidence, decisive)
        return agree if math.isnan(low) else min(agree, low)

    def worst(self, scores: Scores, attr: str) -> tuple[float | None, float | None, str | int | None, int]:
        """(value, lower bound, output, outputs judged) of the judged float output with the lowest
        bound of ``attr`` (snr_db or cosine); bounds are the values without per-sample scores."""
        ps, conf = scores.per_sample, self.budget.confidence
        value, label, n = scores.worst(attr)
        if ps is None or not ps.n or not scores.outputs or n == 0:
            return value, value, label, n
        best: tuple[float, float, str | int] | None = None
        for i, o in enumerate(scores.outputs):
            v = getattr(o, attr)
            if not (o.is_float and o.judged) or v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            low = ps.snr_bound(i, conf) if attr == "snr_db" else ps.cosine_bound(i, conf)
            low = v if math.isnan(low) else min(v, low)
            if best is None or low < best[1]:
                best = (v, low, o.label(i))
        return (best[0], best[1], best[2], n) if best else (value, value, label, n)

    def _spread(self, scores: Scores, attr: str, label: str | int | None) -> float | None:
        ps = scores.per_sample
        if ps is None or not ps.n or label is None:
            return None
        i = scores.index_of(label)
        return (ps.snr_spread(i) if attr == "snr_db" else ps.cosine_spread(i))[0]

    def default(self, scores: Scores, float_top1: float | None) -> AccuracyVerdict:
        b = self.budget
        top1 = scores.top1
        drop = None if top1 is None or float_top1 is None else 100.0 * (float_top1 - top1)
        agree = scores.agreement
        # scores that never counted decisive samples (a bare dict) are judged on their plain agreement
        counted = scores.decisive_samples is not None
        decisive = scores.decisive_agreement if counted else agree
        metric = b.metric
        if metric == "auto":
            metric = "top1" if drop is not None else ("snr_and_agreement" if agree is not None else "snr")
        if metric == "top1" and drop is None:
            metric = "agreement" if agree is not None else "snr"
        if metric == "agreement" and agree is None:
            metric = "snr"
        common = {"agreement": agree, "top1": top1, "top1_drop": drop, "samples": scores.samples,
                  "confidence": b.confidence}
        if metric == "top1":
            ps = scores.per_sample
            high = drop if ps is None or not ps.drop else max(drop, ps.drop_bound(b.confidence))
            worst_snr, _, _ = scores.worst("snr_db")
            return AccuracyVerdict(ok=high <= b.max_drop, metric=metric, snr_db=worst_snr, bound=high, **common,
                                   what=f"top-1 drop {drop:.2f} points ({self._sure(f'{high:.2f}', scores.samples, True)}"
                                        f"max {b.max_drop:g})")
        if metric == "cosine":
            return self._floor(scores, "cosine", common)
        snr = self._floor(scores, "snr_db", common)
        if metric == "agreement":
            low = self.agreement_bound(scores.first_class, agree, False)
            return replace(snr, metric=metric, ok=100.0 * (1.0 - low) <= b.max_disagreement, bound=low, output=None,
                           what=f"agreement {100 * agree:.1f}% ({self._sure(f'{100 * low:.1f}%', scores.samples)}"
                                f"min {100 - b.max_disagreement:.3g}%)")
        if metric == "snr_and_agreement":
            low = self.agreement_bound(scores.first_class, decisive, counted)
            agree_ok = low is None or 100.0 * (1.0 - low) <= b.max_disagreement
            n_dec = scores.decisive_samples
            on = f" on {n_dec} decisive samples" if n_dec is not None else ""
            extra = ("; agreement n/a (no decisive samples)" if decisive is None else
                     f"; agreement {100 * decisive:.1f}%{on} ({self._sure(f'{100 * low:.1f}%', None)}"
                     f"min {100 - b.max_disagreement:.3g}%)")
            return replace(snr, metric=metric, ok=snr.ok and agree_ok, what=snr.what + extra)
        return snr

    def _floor(self, scores: Scores, attr: str, common: dict[str, Any]) -> AccuracyVerdict:
        """The verdict of the per-output floor of ``attr`` (snr_db or cosine) on the worst output."""
        b = self.budget
        value, low, label, n_out = self.worst(scores, attr)
        spread = self._spread(scores, attr, label)
        worst_snr = value if attr == "snr_db" else scores.worst("snr_db")[0]
        of = f", worst of {n_out} outputs" if n_out > 1 else ""
        n = scores.samples
        if attr == "snr_db":
            ok = low is not None and (low == math.inf or low >= b.min_snr_db)
            sd = f"{spread:.1f} dB" if spread is not None and value is not None and math.isfinite(value) else ""
            what = (f"SNR {db_text(value)} on {_name(label)} ({self._sure(db_text(low), n, spread=sd)}"
                    f"min {b.min_snr_db:g} dB{of})")
            return AccuracyVerdict(ok=bool(ok), metric="snr", what=what, snr_db=worst_snr, bound=low, spread=spread,
                                   output=_name(label), **common)
        ok = low is not None and low >= b.min_cosine
        sd = f"{spread:.4f}" if spread is not None else ""
        what = (f"cosine {value if value is not None else math.nan:.4f} on {_name(label)} "
                f"({self._sure(f'{low if low is not None else math.nan:.4f}', n, spread=sd)}min {b.min_cosine:g}{of})")
        return AccuracyVerdict(ok=bool(ok), metric="cosine", what=what, snr_db=worst_snr, cosine=value, bound=low,
                               spread=spread, output=_name(label), **common)


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
    # the one-sided confidence bound the verdict was decided on (lower for cosine, SNR and agreement,
    # upper for a drop), the samples it rests on, the confidence, and the per-sample standard
    # deviation of the deciding metric
    bound: float | None = None
    samples: int | None = None
    confidence: float | None = None
    spread: float | None = None

    def combined(self, other: AccuracyVerdict) -> AccuracyVerdict:
        """Both verdicts must hold; the numbers are the worse of the two."""
        worse = self if (other.snr_db is None or (self.snr_db is not None and self.snr_db <= other.snr_db)) else other
        failing = self if not self.ok else other if not other.ok else worse
        low = [x for x in (self.cosine, other.cosine) if x is not None]
        return replace(self, ok=self.ok and other.ok, what=f"{self.what}; {other.what}", snr_db=worse.snr_db,
                       cosine=min(low) if low else None, output=failing.output, bound=failing.bound,
                       spread=failing.spread, agreement=self.agreement if self.agreement is not None else other.agreement)

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

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> AccuracyVerdict:
        """A verdict from its ``to_dict`` form; keys a newer or older writer added are left out."""
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**{**known, "passing": tuple(known.get("passing") or ())})

    @property
    def error(self) -> float:
        """Noise-to-signal ratio of the outputs (lower is better), for ranking."""
        if self.snr_db is None or math.isnan(self.snr_db):
            return math.inf
        return 10 ** (-self.snr_db / 10) if self.snr_db != math.inf else 0.0


@dataclass(frozen=True)
class CustomMetric:
    """accuracy.custom_metric: the user's ``fn(outputs, reference, labels) -> float`` (higher is better),
    called over all held-out (or evaluation) batches, so dataset-level metrics work (and on resampled
    batches for the bound of its drop, see pipeline/accuracy/holdout.py).
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
        return self.values(outputs, reference, labels)[0]

    def values(self, outputs: list[dict[str, np.ndarray]], reference: list[dict[str, np.ndarray]],
               labels: list[np.ndarray] | None) -> tuple[float, np.ndarray | None]:
        """(score, per-sample values or None): a function may return one number, or one value per
        sample (the score is then their mean, and the bound resamples them)."""
        try:
            value = self.fn(outputs, reference, labels)
        except Exception as exc:  # noqa: BLE001 - the user's code: one line naming it, not our traceback
            raise InputError(f"accuracy.custom_metric={self.path} raised {type(exc).__name__}: {first_line(exc)}; "
                             f"fix the function (it is called as fn(outputs, reference, labels))") from None
        per_sample = None
        if isinstance(value, (list, tuple, np.ndarray)) and np.ndim(value) == 1:
            samples = sum(next(iter(o.values())).shape[0] if o and np.ndim(next(iter(o.values()))) else 1
                          for o in outputs)
            if len(value) != samples:
                raise InputError(f"accuracy.custom_metric={self.path} returned {len(value)} values for {samples} "
                                 f"samples; return one number, or one value per sample")
            per_sample = np.asarray(value, dtype=np.float64)
            value = float(np.mean(per_sample)) if per_sample.size else math.nan
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise InputError(f"accuracy.custom_metric={self.path} returned {type(value).__name__}, not a number; "
                             f"it must return a float, or one value per sample (higher is better)") from None
        if math.isnan(value):
            raise InputError(f"accuracy.custom_metric={self.path} returned NaN; it must return a number "
                             f"(higher is better)")
        return value, per_sample
