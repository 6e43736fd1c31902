"""The weight storage of a placement, chosen in one place: full-range int8 where this CPU's fused kernels
compute it exactly (a few culprit nodes left float where only they disagree), else the fastest exact
storage (7-bit or uint8) within the budget, measured side by side (``TimingPlan.race``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import onnx

from pipeline.backends.base import Backend
from pipeline.errors import StageError
from pipeline.quant.placement import PASS_THROUGH_OPS
from pipeline.quant.plan import WeightVariant
from pipeline.values import enum_value
from tasks.quantize.checker import Candidate, Checker
from tasks.quantize.culprits import localize

if TYPE_CHECKING:
    from pipeline.quant.cpu import CpuFacts
    from tasks.quantize._placer import Placer
    from tasks.quantize._setup import QuantizeSetup

log = logging.getLogger("tune.quantize")

# an exact weight storage that is more accurate wins unless the faster one is faster by more than this
ACCURACY_BAND = 1.10


@dataclass(frozen=True)
class WeightStorage:
    """The weight storage chosen for a placement: ``chosen`` is the checked candidate of the placement
    that will be written, ``checked`` every candidate tried (calibration.json's ``variants``)."""

    weight_range: WeightVariant
    reason: str
    chosen: Candidate
    checked: list[Candidate]
    culprits: list[str] = field(default_factory=list)  # left float: their fused kernels disagree


def choose_weight_range(build: Callable[..., onnx.ModelProto], checker: Checker, requested: str,
                        saturates: bool | None, measure: Callable[[list[Path]], list[float | None]],
                        units: list[str] | None = None) -> WeightStorage:
    """The weight storage of an ORT placement, with the culprit nodes to leave float.

    ``build(weight_range, float_nodes)`` places the model. ``auto``: full range where the fused kernels
    agree with the Q/DQ reference and the CPU has int8 dot-product instructions. Where they disagree on
    a CPU whose u8 x s8 kernels are not known to saturate, the disagreement is first localized to the
    quantized ``units`` responsible (group testing on models with only some units quantized): a few
    culprits stay float and the rest keeps full-range weights; only a fault most units show (or any on
    a saturating CPU) switches the whole model to the fastest exact storage that meets the budget
    (else the most accurate exact one). A forced value is checked and reported, not changed.
    """
    if requested != "auto":
        forced = WeightVariant.of(requested)
        cand = checker.check(build(forced), forced.candidate, fidelity=True)
        return WeightStorage(forced, f"quantize.weight_range={forced}", cand, [cand])
    full = checker.check(build(WeightVariant.full), WeightVariant.full.candidate, fidelity=True)
    if full.usable and not saturates:
        return WeightStorage(WeightVariant.full, "fused kernels agree with the Q/DQ reference", full, [full])
    why = ("u8s8 kernels saturate (AVX2 without VNNI) on a CPU it must run on" if saturates else
           f"this CPU's fused kernels disagree with the Q/DQ reference ({full.fidelity.reason if full.fidelity else full.error})")
    if not saturates and full.error is None and units:
        kept, why = _localized(build, checker, full, why, saturates, units)
        if kept is not None:
            return kept
    return _exact_storage(build, checker, full, why, measure)


def _localized(build: Callable[..., onnx.ModelProto], checker: Checker, full: Candidate, why: str,
               saturates: bool | None, units: list[str]) -> tuple[WeightStorage | None, str]:
    """(full-range weights with the culprits among ``units`` left float, or None; ``why`` completed):
    the fused kernels' disagreement with the Q/DQ reference localized by group testing."""
    everything = set(units)

    def fails(quantized: set[str]) -> bool:
        c = checker.check(build(WeightVariant.full, everything - quantized), "fidelity_localize", fidelity=True)
        return c.error is None and c.fidelity is not None and not c.fidelity.ok

    culprits = localize(list(units), fails)
    if culprits and len(culprits) * 2 <= len(units):
        fixed = checker.check(build(WeightVariant.full, set(culprits)), WeightVariant.full.candidate, fidelity=True)
        if fixed.usable:
            log.warning("quantize: %s; localized to %d node(s) left float: %s", why, len(culprits),
                        ", ".join(culprits))
            return WeightStorage(WeightVariant.full, (f"full-range int8 weights; {len(culprits)} node(s) whose fused kernels "
                                          f"disagree with the Q/DQ reference left float: {', '.join(culprits)}"),
                                 fixed, [fixed], culprits), why
    if saturates is False and not culprits:
        # exact kernels and no node to blame: what differs is the model's own quantization noise
        log.warning("quantize: %s, but no node is responsible on its own; keeping full-range weights on a CPU "
                    "whose u8s8 kernels are exact", why)
        return WeightStorage(WeightVariant.full, f"full-range int8 weights ({why}; no culprit node: not a kernel fault)",
                             full, [full]), why
    if culprits:
        why += f"; {len(culprits)} of {len(units)} quantized nodes show it"
    return None, why


def _exact_storage(build: Callable[..., onnx.ModelProto], checker: Checker, full: Candidate, why: str,
                   measure: Callable[[list[Path]], list[float | None]]) -> WeightStorage:
    """The fastest exact weight storage (7-bit or uint8) within the budget, else the most accurate one."""
    exact_variants = (WeightVariant.reduced, WeightVariant.uint8)
    variants = [checker.check(build(v), v.candidate, fidelity=True) for v in exact_variants]
    exact = [(v, c) for v, c in zip(exact_variants, variants, strict=True) if c.usable]
    if not exact:
        raise StageError(f"quantize: no int8 weight storage runs exactly on this CPU ({why}; "
                         + "; ".join(f"{c.name}: {c.error or c.fidelity.reason}" for c in variants)
                         + "); use backend=tensorrt or quantize=none")
    for (_, c), t in zip(exact, measure([c.path for _, c in exact]), strict=True):
        c.latency_p10_ms = t
    within = [c for _, c in exact if c.scored and c.verdict.ok]
    if within:
        # the fastest within the budget, unless the most accurate is within ACCURACY_BAND of its speed:
        # 7-bit weights cost ~3-6 dB of output SNR, worth it only for a clear speed gain
        fastest = min(within, key=lambda c: c.latency_p10_ms if c.latency_p10_ms is not None else math.inf)
        accurate = min(within, key=lambda c: c.verdict.error)
        slow, fast = accurate.latency_p10_ms, fastest.latency_p10_ms
        best = accurate if slow is not None and fast is not None and slow <= fast * ACCURACY_BAND else fastest
        rule = (f"most accurate exact variant within {ACCURACY_BAND - 1:.0%} of the fastest" if best is accurate
                else "fastest exact variant within the budget")
    else:
        best = min((c for _, c in exact), key=lambda c: c.verdict.error if c.verdict else math.inf)
        rule = "most accurate exact variant; none meets the budget"
    choice = next(v for v, c in exact if c is best)
    desc = {WeightVariant.reduced: "weights use 7-bit range",
            WeightVariant.uint8: "weights stored as uint8 (U8U8 kernels)"}[choice]
    timing = ", ".join(f"{v} {c.latency_p10_ms:.3f} ms" for v, c in exact if c.latency_p10_ms is not None)
    snr = ", ".join(f"{v} {c.verdict.what}" for v, c in exact if c.scored)
    return WeightStorage(choice, f"{desc}: {why} ({rule}; p10 {timing}; {snr})", best, [full, *variants])


def measure_latencies(backend: Backend, paths: list[Path]) -> list[float | None]:
    """p10 latency of each model in ``paths`` (None where it failed), raced side by side."""
    from pipeline.backends.timing import TimingPlan, compare_interleaved

    timings = compare_interleaved(backend, paths, TimingPlan.race(backend.timing_runs, backend.warmup_runs))
    return [t.p10_ms if t.ok else None for t in timings]


def storage_of(setup: QuantizeSetup, placer: Placer, unsupported: set[str], ops: dict[str, str],
               facts: CpuFacts, verified: onnx.ModelProto | None = None) -> WeightStorage:
    """The weight storage (and kernel-fidelity culprits) with the nodes the runtime cannot run quantized
    left float: chosen on this CPU for the CPU runtimes' placements (their fused kernels are checked
    against the Q/DQ math here), the requested one for TensorRT. ``verified``: the placement of the
    starting storage with ``unsupported`` float, built already (``culprits.runnable``)."""
    checker = setup.checker
    requested, start = enum_value(setup.q.weight_range), setup.start_weights

    def placed(wr: str, float_nodes: set[str] = frozenset()) -> onnx.ModelProto:
        if verified is not None and wr == start and not float_nodes:
            return verified
        return placer.build(wr, set(float_nodes) | unsupported)[1]

    if not setup.kind.cpu_kernels:
        why = ("TensorRT placement: full-range int8 (TensorRT's integer kernels do not saturate)"
               if requested == "auto" else f"quantize.weight_range={requested}")
        cand = checker.check(placed(start), start.candidate)
        return WeightStorage(start, why, cand, [cand])
    units = [n for n in placer.plan(start, unsupported).quantized_nodes()
             if ops.get(n) not in (None, *PASS_THROUGH_OPS)]
    return choose_weight_range(placed, checker, requested, facts.u8s8_saturates,
                               lambda paths: measure_latencies(checker.backend, paths), units)
