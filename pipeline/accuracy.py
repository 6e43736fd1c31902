"""Accuracy is part of every decision: the budget, the held-out slice it is checked on, and the
kernel-fidelity check.

- ``AccuracyBudget`` (``autotune.accuracy.*``) says how far a quantized model may drift from the
  float model: top-1 drop with labels; for class scores without labels, top-1 agreement or output
  SNR (whichever holds: random-weight classifiers have near-tied logits, so agreement alone would
  reject good models); otherwise output SNR. Explicit metrics (top1, agreement, snr, cosine) apply
  alone.
- ``Holdout`` is a slice of the calibration data the calibrator did not see (the batches after the
  first ``quantize.calibration.batches``), with the float model's outputs on it; ``score`` runs a
  prepared model on it and judges the result against the budget.
- ``kernel_fidelity`` compares a quantized model run with the backend's fused kernels against the
  same model run as plain Q/DQ math (``Backend.prepare_reference``): disagreement means this
  machine's kernels do not compute what the graph says (ORT's u8 x s8 kernels on x86 without VNNI).
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from pipeline.config import enum_value
from pipeline.metrics import ModelScores, energies, snr_from_energies

log = logging.getLogger("tune.accuracy")

# fused-vs-reference output SNR at or above this passes outright (see kernel_fidelity for the rest):
# measured with exact kernels 34 dB (resnet18) to 84 dB (digits_cnn); saturating AVX2 kernels 25-41 dB
FIDELITY_MIN_SNR_DB = 40.0


# ... or the kernels add at most as much noise as the quantization itself: integer kernels round at
# other points than float Q/DQ math, which adds a fraction of the quantization noise (measured: resnet18
# 0.26 with VNNI; digits_cnn placements 0.01-0.80 with exact U8U8 kernels on AVX2), while saturating
# u8 x s8 kernels add more than the quantization itself (resnet18 1.9; digits_cnn even with its worst
# conv left float 1.4)
FIDELITY_MAX_NOISE_RATIO = 1.0


@dataclass(frozen=True)
class AccuracyBudget:
    """How far a quantized model may drift from the float model (see module docstring)."""

    metric: str = "auto"
    max_drop: float = 1.0  # points: top-1 (labels) or top-1 agreement with the float model
    min_snr_db: float = 20.0
    min_cosine: float = 0.99
    enabled: bool = True

    @classmethod
    def from_config(cls, cfg: DictConfig) -> AccuracyBudget:
        a = cfg.autotune.accuracy
        return cls(enum_value(a.metric), float(a.max_drop), float(a.min_snr_db), float(a.min_cosine),
                   bool(a.enabled))

    def describe(self) -> str:
        return {"top1": f"top-1 drop <= {self.max_drop:g} points",
                "agreement": f"top-1 agreement >= {100 - self.max_drop:g}%",
                "snr": f"output SNR >= {self.min_snr_db:g} dB",
                "cosine": f"output cosine >= {self.min_cosine:g}"}.get(
            self.metric, f"top-1 drop <= {self.max_drop:g} points with labels, else agreement >= "
                         f"{100 - self.max_drop:g}% or SNR >= {self.min_snr_db:g} dB")

    def judge(self, scores: dict[str, Any], float_top1: float | None) -> AccuracyVerdict:
        """Verdict for a model's ModelScores.result() (``float_top1``: the float model's top-1)."""
        snr, cos, agree, top1 = scores.get("snr_db"), scores.get("cosine"), scores.get("agreement"), scores.get("top1")
        drop = None if top1 is None or float_top1 is None else 100.0 * (float_top1 - top1)
        agree_drop = None if agree is None else 100.0 * (1.0 - agree)
        metric = self.metric
        if metric == "auto":
            metric = "top1" if drop is not None else ("agreement_or_snr" if agree_drop is not None else "snr")
        if metric == "top1" and drop is None:
            metric = "agreement" if agree_drop is not None else "snr"
        if metric == "agreement" and agree_drop is None:
            metric = "snr"
        snr_ok = snr is not None and (snr == math.inf or snr >= self.min_snr_db)
        if metric == "top1":
            ok, what = drop <= self.max_drop, f"top-1 drop {drop:.2f} points (max {self.max_drop:g})"
        elif metric == "agreement":
            ok, what = agree_drop <= self.max_drop, f"agreement {100 - agree_drop:.1f}% (min {100 - self.max_drop:g}%)"
        elif metric == "agreement_or_snr":
            ok = agree_drop <= self.max_drop or snr_ok
            what = (f"agreement {100 - agree_drop:.1f}% (min {100 - self.max_drop:g}%), "
                    f"SNR {_db(snr)} (min {self.min_snr_db:g} dB)")
        elif metric == "cosine":
            ok = cos is not None and cos >= self.min_cosine
            what = f"cosine {cos if cos is not None else float('nan'):.4f} (min {self.min_cosine:g})"
        else:
            ok, what = snr_ok, f"SNR {_db(snr)} (min {self.min_snr_db:g} dB)"
        return AccuracyVerdict(bool(ok) or not self.enabled, metric, what, snr, cos, agree, top1, drop)


def _db(x: float | None) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else (
        "inf dB" if x == math.inf else f"{x:.1f} dB")


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

    def to_dict(self) -> dict[str, Any]:
        from pipeline.metrics import json_safe

        return json_safe(asdict(self))

    @property
    def error(self) -> float:
        """Noise-to-signal ratio of the outputs (lower is better), for ranking."""
        if self.snr_db is None or math.isnan(self.snr_db):
            return math.inf
        return 10 ** (-self.snr_db / 10) if self.snr_db != math.inf else 0.0


@dataclass
class Holdout:
    """Feeds the calibrator did not see, with labels and the float model's outputs on them."""

    feeds: list[dict[str, np.ndarray]]
    labels: list[np.ndarray | None]
    valid: list[int]
    reference: list[list[np.ndarray]] = field(default_factory=list)
    float_top1: float | None = None
    source: str = ""

    @classmethod
    def from_config(cls, cfg: DictConfig, specs: list) -> Holdout:
        """The ``autotune.accuracy.holdout_batches`` calibration batches after the
        ``quantize.calibration.batches`` calibrated on; when the data runs out before that, its last
        batches (then overlapping calibration, and said so). Quantize and autotune use the same slice."""
        from pipeline.data import DataProvider

        skip, count = int(cfg.quantize.calibration.batches), int(cfg.autotune.accuracy.holdout_batches)
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
        return cls([b.feeds for b in window], [b.labels for b in window], [b.valid for b in window], source=source)

    def set_reference(self, prepared: Any) -> None:
        """Run the float model (a PreparedModel) once; its outputs are what candidates are compared with."""
        self.reference = self.outputs(prepared)
        self.float_top1 = self.scores(self.reference)["top1"]

    def scores(self, outputs: list[list[np.ndarray]]) -> dict[str, Any]:
        """ModelScores.result() of a model's outputs on the holdout against the float outputs."""
        s = ModelScores(top_k=1)
        for ref, out, labels, valid in zip(self.reference, outputs, self.labels, self.valid, strict=True):
            s.update(ref, out, labels, valid)
        return s.result()

    def outputs(self, prepared: Any) -> list[list[np.ndarray]]:
        return [[np.asarray(o) for o in prepared.run(f)] for f in self.feeds]

    def score(self, prepared: Any, budget: AccuracyBudget) -> AccuracyVerdict:
        """Run ``prepared`` on the holdout and judge it against ``budget``."""
        if not self.reference:
            raise RuntimeError("Holdout.score before set_reference")
        return budget.judge(self.scores(self.outputs(prepared)), self.float_top1)

    @property
    def samples(self) -> int:
        return int(sum(self.valid))


@dataclass(frozen=True)
class FidelityResult:
    """Fused kernels vs plain Q/DQ math on the same model and feeds."""

    checked: bool
    ok: bool
    snr_db: float | None = None  # of the fused outputs against the reference outputs
    max_abs_diff: float | None = None
    batches: int = 0
    reason: str = ""
    noise_ratio: float | None = None  # kernel noise / the model's own quantization noise

    def to_dict(self) -> dict[str, Any]:
        from pipeline.metrics import json_safe

        return json_safe(asdict(self))


def kernel_fidelity(backend: Any, model_path: str | Path, feeds: list[dict[str, np.ndarray]],
                    min_snr_db: float = FIDELITY_MIN_SNR_DB, prepared: Any = None,
                    float_outputs: list[list[np.ndarray]] | None = None,
                    max_noise_ratio: float = FIDELITY_MAX_NOISE_RATIO) -> FidelityResult:
    """Whether ``backend``'s fused kernels compute what ``model_path``'s Q/DQ graph says on ``feeds``.

    The fused outputs pass when their SNR against the reference is at least ``min_snr_db``, or, given
    the float model's outputs on the same feeds, when the kernels add at most ``max_noise_ratio`` of
    the model's own quantization noise (reference vs float): rounding differences between integer kernels and
    float Q/DQ math grow with depth (resnet18: 34 dB) but stay a fraction of the quantization noise,
    while saturating kernels add more than the quantization itself. ``prepared`` reuses a model the
    caller prepared (not closed here). Backends without a reference runner give an unchecked result.
    """
    ref = backend.prepare_reference(model_path)
    if ref is None:
        return FidelityResult(False, True, reason=f"{backend.name} has no plain Q/DQ reference runner")
    own = prepared is None
    fused = backend.prepare(model_path) if own else prepared
    quant_noise = 0.0
    try:
        signal = noise = 0.0
        max_diff = 0.0
        for k, f in enumerate(feeds):
            floats = float_outputs[k] if float_outputs is not None else None
            for j, (r, o) in enumerate(zip(ref.run(f), fused.run(f), strict=True)):
                r, o = np.asarray(r), np.asarray(o)
                if not np.issubdtype(r.dtype, np.floating):
                    continue
                s, e = energies(r, o)
                signal, noise = signal + s, noise + e
                if floats is not None:
                    quant_noise += energies(np.asarray(floats[j]), r)[1]
                if r.size:
                    max_diff = max(max_diff, float(np.max(np.abs(r.astype(np.float64) - o))))
    finally:
        ref.close()
        if own:
            fused.close()
    snr = snr_from_energies(signal, noise)
    ratio = None if not quant_noise else noise / quant_noise
    ok = snr == math.inf or snr >= min_snr_db or (ratio is not None and ratio <= max_noise_ratio)
    reason = ""
    if not ok:
        reason = f"fused kernels disagree with the Q/DQ reference (output SNR {_db(snr)}"
        reason += f", {ratio:.2f}x the quantization noise)" if ratio is not None else f" < {min_snr_db:g} dB)"
    return FidelityResult(True, ok, snr, max_diff, len(feeds), reason, ratio)
