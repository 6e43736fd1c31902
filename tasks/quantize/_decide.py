"""The quantize stage's decisions on the held-out batches: the nodes the runtime cannot run quantized,
the weight storage (and the kernel-fidelity culprits left float), the nodes recovery leaves float to
meet the accuracy budget, and bias correction of the placement that will be written.

The result is calibration.json's ``decisions`` table (autotune follows it) and, when recovery ran,
sensitivity.json.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx

from pipeline.bodies import QUANTIZED_BODIES
from pipeline.config import enum_value
from pipeline.errors import StageError
from pipeline.graph import iter_nodes
from pipeline.placement import PASS_THROUGH_OPS
from tasks.quantize._accuracy import Checker, choose_weight_range, recovery_checker, runnable, start_range
from tasks.quantize._recovery import recover_budget

log = logging.getLogger("tune.quantize")


def decide(cfg: Any, model: onnx.ModelProto, checker: Checker, kind: str,
           build: Callable[..., tuple[Any, onnx.ModelProto]],
           fix_bias: Callable[..., tuple[dict, Any]] | None = None, outliers: dict[str, str] | None = None
           ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Weight storage, kernel-fidelity culprits, float nodes and bias correction of the quantize stage's
    model, decided on ``checker``'s held-out batches. ``build(weight_range, float_nodes)`` places the
    model; ``fix_bias`` tries bias correction on the final placement; ``outliers`` are the element-wise
    nodes on tensors with outlier channels, recovery's first candidates."""
    from pipeline.backends.base import compare_interleaved
    from pipeline.cpu import cpu_facts, describe

    q, a = cfg.quantize, cfg.accuracy
    backend, holdout, budget = checker.backend, checker.holdout, checker.budget
    facts = cpu_facts()
    requested = enum_value(q.weight_range)

    def measure(paths: list[Path]) -> list[float | None]:
        timings = compare_interleaved(backend, paths, rounds=4, runs_per_round=max(2, backend.timing_runs // 8),
                                      warmup_runs=backend.warmup_runs)
        return [t.p10_ms if t.ok else None for t in timings]

    ops = {n.name: n.op_type for n in iter_nodes(model.graph, QUANTIZED_BODIES)}
    start = start_range(requested)
    unsupported = runnable(lambda s: build(start, s)[1], checker, set(ops))

    def placed(wr: str, float_nodes: set[str] = frozenset()) -> onnx.ModelProto:
        """The quantized model with the nodes the runtime cannot run quantized left float."""
        return build(wr, set(float_nodes) | unsupported)[1]

    culprits: list[str] = []
    if kind == "onnxruntime":
        units = [n for n in build(start, unsupported)[0].quantized_nodes()
                 if ops.get(n) not in (None, *PASS_THROUGH_OPS)]
        weight_range, why, checked, culprits = choose_weight_range(
            placed, checker, requested, facts["u8s8_saturates"], measure, units)
        chosen = next(c for c in checked if c.name == f"weights_{weight_range}")
        unsupported |= set(culprits)
    else:
        weight_range = start_range(requested)
        why = ("TensorRT placement: full-range int8 (TensorRT's integer kernels do not saturate)"
               if requested == "auto" else f"quantize.weight_range={requested}")
        chosen = checker.check(placed(weight_range), f"weights_{weight_range}")
        checked = [chosen]
    if chosen.error is not None:
        raise StageError(f"quantize: the quantized model is not written because {chosen.error}")
    if weight_range == "full":
        log.info("quantize: full-range int8 weights on %s (%s)", describe(facts), why)
    else:
        log.warning("quantize: %s [%s]", why, describe(facts))
    verdict = chosen.verdict
    final = chosen  # the candidate of the placement that will be written
    float_nodes: list[str] = []
    sensitivity = None
    if verdict is not None and not verdict.ok and budget.enabled and bool(a.recovery):
        plan, _ = build(weight_range, unsupported)
        units = [n for n in plan.quantized_nodes() if ops.get(n) not in PASS_THROUGH_OPS]
        log.warning("quantize: the PTQ model misses the accuracy budget on %d held-out samples (%s); "
                    "ranking %d quantized nodes by their contribution to the output error",
                    holdout.samples, verdict.what, len(units))
        float_nodes, recovered, report = recover_budget(
            model, units, lambda s: placed(weight_range, s), recovery_checker(checker, cfg), verdict,
            outliers or {}, math.floor(float(a.max_float_fraction) * len(units)), bool(cfg.progress))
        if recovered is not None:  # judged again by the budget itself (recovery aimed inside it)
            recovered = checker.check(placed(weight_range, set(float_nodes)), "recovered")
            verdict, final = recovered.verdict, recovered
        sensitivity = {
            "budget": budget.describe(), "holdout": holdout.source, "samples": holdout.samples,
            "full_placement": chosen.verdict.to_dict() if chosen.verdict else None, **report,
            "float_nodes": float_nodes, "met": recovered is not None,
            "accuracy": verdict.to_dict() if verdict else None,
        }
    bias = None
    if fix_bias is not None and final.verdict is not None:
        bias, corrected = fix_bias(weight_range, unsupported | set(float_nodes), checker, final)
        if corrected is not None:
            verdict = corrected.verdict
    decisions = {
        "weight_range": weight_range, "weight_range_reason": why, "cpu": facts,
        "unsupported_nodes": sorted(unsupported - set(culprits)),
        "fidelity_culprits": culprits,
        "bias_correction": bias,
        "kernel_fidelity": chosen.fidelity.to_dict() if chosen.fidelity else None,
        "variants": [c.to_dict() for c in checked],
        "budget": budget.describe(), "holdout": holdout.source, "holdout_samples": holdout.samples,
        "accuracy": verdict.to_dict() if verdict else None,
        "float_nodes": sorted(set(float_nodes) | unsupported),
    }
    return decisions, sensitivity
