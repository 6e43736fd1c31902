"""Kernel fidelity: a quantized model run with the backend's fused kernels against the same model run
as plain Q/DQ math (``Backend.prepare_reference``). Disagreement means this machine's kernels do not
compute what the graph says (ORT's u8 x s8 kernels on x86 without VNNI)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.accuracy.metrics import db_text, energies, snr_from_energies
from pipeline.backends.base import Backend

# fused-vs-reference output SNR at or above this passes outright (see kernel_fidelity for the rest):
# exact kernels stay above it on the built-in models, saturating AVX2 kernels fall below it
FIDELITY_MIN_SNR_DB = 40.0


# ... or the fused model is at most this much further from the float model than the Q/DQ reference
# is (error energies). Integer kernels round at other points than float Q/DQ math, so with exact
# kernels the fused model is one more quantized run of the same graph, about as far from float as the
# reference, even where the two runs differ by about the quantization noise itself. Saturating
# u8 x s8 kernels add error of their own on top (docs/design.md, "Kernel fidelity", has the measurements).
FIDELITY_MAX_NOISE_RATIO = 2.0


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
        from pipeline.accuracy.metrics import json_safe

        return json_safe(asdict(self))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> FidelityResult:
        """A result from its ``to_dict`` form; keys a newer or older writer added are left out."""
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass(frozen=True)
class FidelityThresholds:
    """When fused outputs pass: an SNR against the Q/DQ reference of at least ``min_snr_db``, or (given
    the float model's outputs) at most ``max_noise_ratio`` times the reference's error vs float."""

    min_snr_db: float = FIDELITY_MIN_SNR_DB
    max_noise_ratio: float = FIDELITY_MAX_NOISE_RATIO


def kernel_fidelity(backend: Backend, model_path: str | Path, feeds: list[dict[str, np.ndarray]],
                    prepared: Any = None, float_outputs: list[list[np.ndarray]] | None = None,
                    thresholds: FidelityThresholds = FidelityThresholds(),
                    fused_outputs: list[list[np.ndarray]] | None = None, reference: Any = None) -> FidelityResult:
    """Whether ``backend``'s fused kernels compute what ``model_path``'s Q/DQ graph says on ``feeds``.

    The fused outputs pass when their SNR against the reference is at least ``thresholds.min_snr_db``,
    or, given the float model's outputs on the same feeds, when the fused model is at most
    ``thresholds.max_noise_ratio`` times as far from float as the reference is: two quantized runs of a
    noisy model differ by about its quantization noise, which is no kernel fault; a faulty kernel adds
    error of its own. ``prepared`` reuses a model the caller prepared (not closed here), and
    ``fused_outputs`` its outputs on ``feeds`` where the caller has run it already, ``reference`` its
    plain Q/DQ form where the caller prepared it (neither closed here). Backends without a reference
    runner give an unchecked result.
    """
    own_ref = reference is None
    ref = backend.prepare_reference(model_path) if own_ref else reference
    if ref is None:
        return FidelityResult(False, True, reason=f"{backend.name} has no plain Q/DQ reference runner")
    own = prepared is None and fused_outputs is None
    fused = backend.prepare(model_path) if own else prepared
    ref_err = fused_err = 0.0
    try:
        signal = noise = 0.0
        max_diff = 0.0
        for k, f in enumerate(feeds):
            floats = float_outputs[k] if float_outputs is not None else None
            outputs = fused_outputs[k] if fused_outputs is not None else fused.run(f)
            for j, (r, o) in enumerate(zip(ref.run(f), outputs, strict=True)):
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
        if own_ref:
            ref.close()
        if own:
            fused.close()
    snr = snr_from_energies(signal, noise)
    ratio = None if float_outputs is None else (fused_err / ref_err if ref_err else (0.0 if not fused_err else math.inf))
    ok = (snr == math.inf or snr >= thresholds.min_snr_db
          or (ratio is not None and ratio <= thresholds.max_noise_ratio))
    reason = ""
    if not ok:
        reason = f"fused kernels disagree with the Q/DQ reference (output SNR {db_text(snr)}"
        reason += (f"; {ratio:.2f}x the reference's error vs float)" if ratio is not None
                   else f" < {thresholds.min_snr_db:g} dB)")
    return FidelityResult(True, ok, snr, max_diff, len(feeds), reason, ratio)
