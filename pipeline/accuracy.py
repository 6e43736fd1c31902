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


# ... or the fused model is at most this much further from the float model than the Q/DQ reference
# is (error energies). Integer kernels round at other points than float Q/DQ math, so with exact
# kernels the fused model is one more quantized run of the same graph, about as far from float as the
# reference; where quantization noise is large the two runs differ by about that noise (a paddle2onnx
# detector on a VNNI CPU: fused-vs-reference 1.5x the quantization noise) and are still equally far
# from float. Saturating u8 x s8 kernels add error of their own: the fused-vs-reference noise was
# 1.9x the quantization noise for resnet18 on AVX2 (0.26x with VNNI), about 2.9x (1.3x) the
# reference's error vs float when the two add; digits_cnn lost 65 points of top-1.
FIDELITY_MAX_NOISE_RATIO = 2.0


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
        a = cfg.accuracy
        return cls(enum_value(a.metric), float(a.max_drop), float(a.min_snr_db), float(a.min_cosine),
                   bool(a.enabled))

    def tightened(self, margin_db: float) -> AccuracyBudget:
        """This budget ``margin_db`` inside its SNR floor, and the same factor on 1 - cosine (top-1 budgets
        unchanged)."""
        from dataclasses import replace

        return replace(self, min_snr_db=self.min_snr_db + margin_db,
                       min_cosine=1.0 - (1.0 - self.min_cosine) * 10 ** (-margin_db / 10))

    def describe(self) -> str:
        return {"top1": f"top-1 drop <= {self.max_drop:g} points",
                "agreement": f"top-1 agreement >= {100 - self.max_drop:g}%",
                "snr": f"SNR >= {self.min_snr_db:g} dB on every output",
                "cosine": f"cosine >= {self.min_cosine:g} on every output"}.get(
            self.metric, f"top-1 drop <= {self.max_drop:g} points with labels, else SNR >= {self.min_snr_db:g} dB "
                         f"on every output and, for class scores, agreement >= {100 - self.max_drop:g}% on "
                         f"decisive samples")

    def judge(self, scores: dict[str, Any], float_top1: float | None) -> AccuracyVerdict:
        """Verdict for a model's ModelScores.result() (``float_top1``: the float model's top-1).

        Without labels every float output is held to the budget on its own (its SNR, or its cosine
        with ``metric=cosine``) and the worst one decides; for class scores, top-1 agreement on the
        decisive samples is an extra condition, never an excuse for a noisy output.
        """
        top1 = scores.get("top1")
        drop = None if top1 is None or float_top1 is None else 100.0 * (float_top1 - top1)
        agree = scores.get("agreement")
        # ModelScores gives agreement on decisive samples; a bare dict (tests, old metrics) its plain agreement
        decisive = scores.get("decisive_agreement") if "decisive_samples" in scores else agree
        worst_snr, snr_out, n_out = _worst(scores, "snr_db_per_output", "snr_db")
        worst_cos, cos_out, _ = _worst(scores, "cosine_per_output", "cosine")
        metric = self.metric
        if metric == "auto":
            metric = "top1" if drop is not None else ("snr_and_agreement" if agree is not None else "snr")
        if metric == "top1" and drop is None:
            metric = "agreement" if agree is not None else "snr"
        if metric == "agreement" and agree is None:
            metric = "snr"
        of = f" of {n_out} outputs" if n_out > 1 else ""
        snr_ok = worst_snr is not None and (worst_snr == math.inf or worst_snr >= self.min_snr_db)
        snr_what = f"SNR {_db(worst_snr)} on {_name(snr_out)} (min {self.min_snr_db:g} dB{', worst' + of if of else ''})"
        output = snr_out
        if metric == "top1":
            ok, what = drop <= self.max_drop, f"top-1 drop {drop:.2f} points (max {self.max_drop:g})"
            output = None
        elif metric == "agreement":
            ok = 100.0 * (1.0 - agree) <= self.max_drop
            what = f"agreement {100 * agree:.1f}% (min {100 - self.max_drop:g}%)"
        elif metric == "snr_and_agreement":
            n_dec = scores.get("decisive_samples")
            agree_ok = decisive is None or 100.0 * (1.0 - decisive) <= self.max_drop
            ok = snr_ok and agree_ok
            on = f" on {n_dec} decisive samples" if n_dec is not None else ""
            what = snr_what + ("; agreement n/a (no decisive samples)" if decisive is None else
                               f"; agreement {100 * decisive:.1f}%{on} (min {100 - self.max_drop:g}%)")
        elif metric == "cosine":
            ok = worst_cos is not None and worst_cos >= self.min_cosine
            what = (f"cosine {worst_cos if worst_cos is not None else float('nan'):.4f} on {_name(cos_out)} "
                    f"(min {self.min_cosine:g}{', worst' + of if of else ''})")
            output = cos_out
        else:
            ok, what = snr_ok, snr_what
        return AccuracyVerdict(bool(ok) or not self.enabled, metric, what, worst_snr, worst_cos, agree, top1, drop,
                               output=_name(output) if output is not None else None)


def _worst(scores: dict[str, Any], per_output: str, overall: str) -> tuple[float | None, str | int | None, int]:
    """(lowest value over the float outputs, that output's name or index, number of outputs judged)."""
    values = scores.get(per_output)
    if not values:
        v = scores.get(overall)
        return v, None, 1
    floats = scores.get("float_outputs") or [True] * len(values)
    names = scores.get("output_names") or list(range(len(values)))
    judged = [(v, n) for v, n, f in zip(values, names, floats, strict=False) if f and v is not None
              and not (isinstance(v, float) and math.isnan(v))]
    if not judged:
        return scores.get(overall), None, 0
    v, n = min(judged, key=lambda x: x[0])
    return v, n, len(judged)


def _name(output: str | int | None) -> str:
    if output is None:
        return "the output"
    return f"output {output}" if isinstance(output, int) else f"output '{output}'"


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
    output: str | None = None  # the output the verdict rests on (the worst one)

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
    output_names: list[str] | None = None

    @classmethod
    def from_config(cls, cfg: DictConfig, specs: list) -> Holdout:
        """The ``accuracy.holdout_batches`` calibration batches after the
        ``quantize.calibration.batches`` calibrated on; when the data runs out before that, its last
        batches (then overlapping calibration, and said so). Quantize and autotune use the same slice."""
        from pipeline.data import DataProvider

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
        return cls([b.feeds for b in window], [b.labels for b in window], [b.valid for b in window], source=source)

    def set_reference(self, prepared: Any) -> None:
        """Run the float model (a PreparedModel) once; its outputs are what candidates are compared with."""
        self.reference = self.outputs(prepared)
        self.output_names = list(getattr(prepared, "output_names", None) or []) or None
        self.float_top1 = self.scores(self.reference)["top1"]

    def scores(self, outputs: list[list[np.ndarray]]) -> dict[str, Any]:
        """ModelScores.result() of a model's outputs on the holdout against the float outputs."""
        s = ModelScores(top_k=1, output_names=list(self.output_names or []))
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
    noise_ratio: float | None = None  # fused-vs-float error / reference-vs-float error (energies)

    def to_dict(self) -> dict[str, Any]:
        from pipeline.metrics import json_safe

        return json_safe(asdict(self))


def kernel_fidelity(backend: Any, model_path: str | Path, feeds: list[dict[str, np.ndarray]],
                    min_snr_db: float = FIDELITY_MIN_SNR_DB, prepared: Any = None,
                    float_outputs: list[list[np.ndarray]] | None = None,
                    max_noise_ratio: float = FIDELITY_MAX_NOISE_RATIO) -> FidelityResult:
    """Whether ``backend``'s fused kernels compute what ``model_path``'s Q/DQ graph says on ``feeds``.

    The fused outputs pass when their SNR against the reference is at least ``min_snr_db``, or, given
    the float model's outputs on the same feeds, when the fused model is at most ``max_noise_ratio``
    times as far from float as the reference is: two quantized runs of a noisy model differ by about
    its quantization noise, which is no kernel fault; a faulty kernel adds error of its own.
    ``prepared`` reuses a model the caller prepared (not closed here). Backends without a reference
    runner give an unchecked result.
    """
    ref = backend.prepare_reference(model_path)
    if ref is None:
        return FidelityResult(False, True, reason=f"{backend.name} has no plain Q/DQ reference runner")
    own = prepared is None
    fused = backend.prepare(model_path) if own else prepared
    ref_err = fused_err = 0.0
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
                    ref_err += energies(np.asarray(floats[j]), r)[1]
                    fused_err += energies(np.asarray(floats[j]), o)[1]
                if r.size:
                    max_diff = max(max_diff, float(np.max(np.abs(r.astype(np.float64) - o))))
    finally:
        ref.close()
        if own:
            fused.close()
    snr = snr_from_energies(signal, noise)
    ratio = None if float_outputs is None else (fused_err / ref_err if ref_err else (0.0 if not fused_err else math.inf))
    ok = snr == math.inf or snr >= min_snr_db or (ratio is not None and ratio <= max_noise_ratio)
    reason = ""
    if not ok:
        reason = f"fused kernels disagree with the Q/DQ reference (output SNR {_db(snr)}"
        reason += (f"; {ratio:.2f}x the reference's error vs float)" if ratio is not None
                   else f" < {min_snr_db:g} dB)")
    return FidelityResult(True, ok, snr, max_diff, len(feeds), reason, ratio)
