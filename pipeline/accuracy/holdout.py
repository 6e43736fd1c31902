"""The held-out slice every accuracy decision is judged on, sized for the decision it makes.

The calibration data is split once: the first batches calibrate, later ones are held out, and no
held-out sample is ever calibrated on. The holdout is ``accuracy.holdout_samples`` samples or
``accuracy.holdout_fraction`` of the data when that is more, at most
``accuracy.holdout_max_samples`` (each candidate runs on all of it); ``accuracy.holdout_batches``
sets it in batches instead. When the data is too short for both, calibration gives up batches
first, down to half the data, and one warning line says how many samples the verdicts rest on and
what to add. ``Holdout`` holds the held-out feeds with the float model's outputs on them;
``score`` runs a prepared model on it and judges the result against an ``AccuracyBudget``.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from omegaconf import DictConfig

from pipeline.accuracy.budget import AccuracyBudget, AccuracyVerdict, CustomMetric, CustomScore
from pipeline.accuracy.class_scores import guess_class_output
from pipeline.accuracy.confidence import CALL_RESAMPLES, bound
from pipeline.accuracy.metrics import FIRST_OUTPUT, ModelScores, valid_rows
from pipeline.accuracy.scores import Scores
from pipeline.errors import ConfigError
from pipeline.values import enum_value

log = logging.getLogger("tune.accuracy")


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


@dataclass(frozen=True)
class HoldoutSplit:
    """How the calibration data divides between calibration (its first batches) and the holdout
    (the batches after those), in batches of model.batch_size."""

    calibration_batches: int  # what the calibrator reads: quantize.calibration.batches or fewer
    holdout_batches: int
    seen: int  # batches the data had, read up to calibration + the most the holdout may take
    overlap: bool = False  # one batch only: the holdout is the calibration batch itself

    @classmethod
    def plan(cls, cfg: DictConfig, seen: int, batch: int) -> HoldoutSplit:
        """The split of ``seen`` batches of ``batch`` samples (all the data there is when fewer than
        ``reach``)."""
        a, cal = cfg.accuracy, int(cfg.quantize.calibration.batches)
        want = cls.wanted(cfg, seen, batch)
        if seen < 2:
            return cls(seen, seen, seen, overlap=True)
        if seen - cal >= want:
            return cls(cal, want, seen)
        held = want if a.holdout_batches is not None else min(want, max(seen - cal, seen // 2))
        held = min(held, seen - 1)
        return cls(min(cal, seen - held), held, seen)

    @staticmethod
    def most(cfg: DictConfig, batch: int) -> int:
        """The most batches the holdout may take (accuracy.holdout_batches, else holdout_max_samples)."""
        a = cfg.accuracy
        return int(a.holdout_batches) if a.holdout_batches is not None else max(1, int(a.holdout_max_samples) // batch)

    @staticmethod
    def reach(cfg: DictConfig, batch: int) -> int:
        """The batches read to size the split: enough to know whether a holdout_fraction of the data
        reaches the most the holdout may take."""
        most = HoldoutSplit.most(cfg, batch)
        cal = int(cfg.quantize.calibration.batches)
        if cfg.accuracy.holdout_batches is not None:
            return cal + most
        return max(cal + most, math.ceil(most / float(cfg.accuracy.holdout_fraction)))

    @staticmethod
    def wanted(cfg: DictConfig, seen: int, batch: int) -> int:
        """Held-out batches wanted of ``seen``: at least holdout_samples, a holdout_fraction of the data
        when that is more, at most holdout_max_samples."""
        a = cfg.accuracy
        if a.holdout_batches is not None:
            return int(a.holdout_batches)
        return min(HoldoutSplit.most(cfg, batch),
                   max(math.ceil(int(a.holdout_samples) / batch), math.ceil(float(a.holdout_fraction) * seen)))


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
    split: HoldoutSplit | None = None
    float_values: np.ndarray | None = None  # ``metric``'s per-sample values of the float model
    _float_calls: dict[tuple[int, ...], float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: DictConfig, specs: list, warn: bool = True,
                    model: onnx.ModelProto | None = None) -> Holdout:
        """The held-out batches of ``HoldoutSplit`` (quantize and autotune use the same slice);
        ``warn``: log the one-line warning when the holdout is smaller than accuracy.holdout_samples;
        ``model``: the float model, whose outputs the class-score guess reads (``class_outputs``)."""
        from pipeline.data.adapters import DataProvider

        provider = DataProvider(cfg, specs)
        bs = provider.batch_size
        window: deque = deque(maxlen=HoldoutSplit.most(cfg, bs))  # the holdout is among the last ones read
        seen = samples = 0
        for b in provider.batches("calibration", HoldoutSplit.reach(cfg, bs)):
            seen, samples = seen + 1, samples + b.valid
            window.append(b)
        split = HoldoutSplit.plan(cfg, seen, bs)
        held = list(window)[-split.holdout_batches:] if split.holdout_batches else []
        first = seen - len(held)
        source = (f"calibration batches {first}..{seen - 1} (not calibrated on; calibration reads batches "
                  f"0..{split.calibration_batches - 1})")
        if split.overlap:
            source = "the only calibration batch (also calibrated on: the calibration data has one batch)"
        holdout = cls([b.feeds for b in held], [b.labels for b in held], [b.valid for b in held], source=source,
                      budget=AccuracyBudget.from_config(cfg), class_outputs=class_outputs(cfg, model),
                      metric=CustomMetric.from_config(cfg), split=split)
        if warn:
            holdout.warn_if_small(cfg, samples, bs)
        return holdout

    def warn_if_small(self, cfg: DictConfig, data_samples: int, batch: int) -> None:
        """One warning line when fewer samples than accuracy.holdout_samples judge every decision, or
        when the holdout left calibration fewer batches than quantize.calibration.batches."""
        need, cal = int(cfg.accuracy.holdout_samples), int(cfg.quantize.calibration.batches)
        cut = self.split is not None and self.split.calibration_batches < cal
        if self.samples < need and cfg.accuracy.holdout_batches is None:
            log.warning("accuracy: only %d held-out samples judge every accuracy decision, so verdicts are loose: "
                        "the calibration data has %d samples; give it at least %d (%d x %d to calibrate, %d more "
                        "held out)", self.samples, data_samples, cal * batch + need, cal, batch, need)
        elif cut:
            log.warning("accuracy: the holdout takes %d of the calibration data's %d batches, so calibration reads "
                        "%d of quantize.calibration.batches=%d: give the calibration data more samples",
                        self.split.holdout_batches, self.split.seen, self.split.calibration_batches, cal)

    def set_reference(self, prepared: Any) -> None:
        """Run the float model (a PreparedModel) once; its outputs are what candidates are compared with."""
        self.reference = self.outputs(prepared)
        self.output_names = list(getattr(prepared, "output_names", None) or []) or None
        check_output_names(self.budget, self.class_outputs, self.output_names)
        self.float_top1 = self.scores(self.reference).top1
        self._float_calls = {}
        if self.metric is not None:
            named = self._named(self.reference)
            self.float_custom, self.float_values = self.metric.values(named, named, labels_of(self.labels, self.valid))

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

    def custom_score(self, outputs: list[list[np.ndarray]], budget: AccuracyBudget) -> CustomScore:
        """accuracy.custom_metric on ``outputs`` with the upper bound of its drop from the float model:
        over per-sample values when the function returns them, else over resampled whole batches."""
        assert self.metric is not None and self.float_custom is not None
        named, ref = self._named(outputs), self._named(self.reference)
        labels = labels_of(self.labels, self.valid)
        got, values = self.metric.values(named, ref, labels)
        allowed = budget.max_drop * abs(self.float_custom) / 100.0 if budget.relative else budget.max_drop
        if self.float_custom - got > allowed:  # misses on its value: no bound can save it
            return CustomScore(self.float_custom, got)
        if values is not None and self.float_values is not None and values.size == self.float_values.size:
            d = self.float_values - values
            high = bound(lambda idx: d[idx].mean(axis=1), d.size, budget.confidence, upper=True)
            return CustomScore(self.float_custom, got, high)

        def pick(rows: np.ndarray, items: list | None) -> list | None:
            return None if items is None else [items[i] for i in rows]

        def drop(rows: np.ndarray) -> float:
            key = tuple(int(i) for i in rows)
            if key not in self._float_calls:
                self._float_calls[key] = self.metric(pick(rows, ref), pick(rows, ref), pick(rows, labels))
            return self._float_calls[key] - self.metric(pick(rows, named), pick(rows, ref), pick(rows, labels))

        n = len(self.feeds)
        high = bound(lambda idx: np.array([drop(row) for row in idx]), n, budget.confidence, upper=True,
                     resamples=CALL_RESAMPLES) if n > 1 else None
        return CustomScore(self.float_custom, got, high)

    def judge(self, outputs: list[list[np.ndarray]], budget: AccuracyBudget) -> AccuracyVerdict:
        """``budget``'s verdict on a model's outputs on the holdout (``outputs(prepared)``)."""
        custom = self.custom_score(outputs, budget) if self.metric is not None and budget.metric == "custom" else None
        return budget.judge(self.scores(outputs), self.float_top1, custom, where="held-out samples")

    def score(self, prepared: Any, budget: AccuracyBudget) -> AccuracyVerdict:
        """Run ``prepared`` on the holdout and judge it against ``budget``."""
        if not self.reference:
            raise RuntimeError("Holdout.score before set_reference")
        return self.judge(self.outputs(prepared), budget)

    @property
    def samples(self) -> int:
        return int(sum(self.valid))


def class_outputs(cfg: DictConfig, model: onnx.ModelProto | None = None) -> list[str] | None:
    """accuracy.class_outputs, plus the outputs accuracy.per_output judges by agreement (which needs
    class scores counted on them). Unset, ``model``'s first output where the guess says it holds class
    scores (``class_scores.guess_class_output``, said once in one line), none where it holds features;
    without a model, None: the shape guess on the first output."""
    a = cfg.accuracy
    agreement = [str(o) for o, m in (a.per_output or {}).items() if enum_value(m) == "agreement"]
    if a.class_outputs is None:
        guess = guess_class_output(model) if model is not None else None
        if guess is None:
            return None if not agreement else [FIRST_OUTPUT, *agreement]
        if guess.line() not in _SAID:
            _SAID.add(guess.line())
            log.info("%s", guess.line())
        return list(dict.fromkeys([*([guess.output] if guess.classes else []), *agreement]))
    return list(dict.fromkeys([*a.class_outputs, *agreement]))


_SAID: set[str] = set()  # the guesses' lines already logged in this process


def check_output_names(budget: AccuracyBudget | None, class_outputs: list[str] | None,
                       names: list[str] | None) -> None:
    """A ConfigError naming the model's outputs when an accuracy key names an output it does not have."""
    if budget is not None:
        budget.check_outputs(names)
    unknown = [o for o in class_outputs or [] if names and o not in names and o != FIRST_OUTPUT]
    if unknown:
        raise ConfigError(f"accuracy.class_outputs: the model has no output {', '.join(repr(o) for o in unknown)}; "
                          f"its outputs are {', '.join(names or [])}")
