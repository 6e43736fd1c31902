"""The quantize stage's decisions on the held-out batches: the nodes the runtime cannot run quantized,
the weight storage (and the kernel-fidelity culprits left float), the nodes recovery leaves float to
meet the accuracy budget, and bias correction of the placement that will be written.

The result is calibration.json's ``decisions`` table (autotune follows it) and, when recovery ran,
sensitivity.json.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import onnx

from pipeline.errors import StageError
from pipeline.graph import weights
from pipeline.graph.bodies import QUANTIZED_BODIES
from pipeline.graph.model import iter_nodes
from pipeline.quant.cpu import decision_facts, describe
from pipeline.quant.placement import PASS_THROUGH_OPS
from pipeline.records.quantize import QuantizeDecisions
from tasks.quantize._placer import Placer
from tasks.quantize._setup import QuantizeSetup
from tasks.quantize.checker import Candidate, recovery_checker
from tasks.quantize.culprits import runnable
from tasks.quantize.recovery import MissedBudget, recover_budget, recovery_allowance
from tasks.quantize.weight_storage import WeightStorage, storage_of

log = logging.getLogger("tune.quantize")


def decide(setup: QuantizeSetup, placer: Placer, outliers: dict[str, str] | None = None, started: float | None = None,
           placed: onnx.ModelProto | None = None) -> tuple[QuantizeDecisions, dict[str, Any] | None]:
    """(decisions, sensitivity report or None): weight storage, kernel-fidelity culprits, float nodes and
    bias correction of ``placer``'s model, decided on ``setup.checker``'s held-out batches. ``outliers``
    are the element-wise nodes on tensors with outlier channels, recovery's first candidates; ``started``
    the ``time.monotonic()`` calibration started at (recovery's time allowance counts from it); ``placed``
    the default placement built already (``choose_ranges``'s model), checked here as a build is."""
    checker, budget, holdout = setup.checker, setup.checker.budget, setup.checker.holdout
    facts = decision_facts()
    ops = {n.name: n.op_type for n in iter_nodes(placer.model.graph, QUANTIZED_BODIES)}
    start = setup.start_weights
    if placed is not None:
        weights.check_model(placed)
    unsupported, verified = runnable(lambda s: placed if placed is not None and not s else placer.build(start, s)[1],
                                     checker, set(ops))
    storage = storage_of(setup, placer, unsupported, ops, facts, verified)
    weight_range, why, chosen = storage.weight_range, storage.reason, storage.chosen
    unsupported |= set(storage.culprits)
    if chosen.error is not None:
        raise StageError(f"quantize: the quantized model is not written because {chosen.error}")
    if weight_range == "full":
        log.info("quantize: full-range int8 weights on %s (%s)", describe(facts), why)
    else:
        log.warning("quantize: %s [%s]", why, describe(facts))
    final = chosen  # the candidate of the placement that will be written
    float_nodes: list[str] = []
    sensitivity = None
    if chosen.verdict is not None and not chosen.verdict.ok and budget.enabled and bool(setup.cfg.accuracy.recovery):
        before_s = time.monotonic() - started if started is not None else 0.0
        float_nodes, final, sensitivity = _recover(setup, placer, unsupported, ops, storage, outliers or {}, before_s)
    bias = None
    if bool(setup.q.bias_correction) and final.verdict is not None:
        bias, corrected = placer.fix_bias(weight_range, unsupported | set(float_nodes), final)
        if corrected is not None:
            final = corrected
    decisions = QuantizeDecisions(
        weight_range=weight_range, weight_range_reason=why, cpu=facts,
        unsupported_nodes=sorted(unsupported - set(storage.culprits)),
        fidelity_culprits=storage.culprits,
        bias_correction=bias,
        kernel_fidelity=chosen.fidelity,
        variants=[c.record() for c in storage.checked],
        budget=budget.describe(), holdout=holdout.source, holdout_samples=holdout.samples,
        accuracy=final.verdict,
        float_nodes=sorted(set(float_nodes) | unsupported),
    )
    return decisions, sensitivity


def _recover(setup: QuantizeSetup, placer: Placer, unsupported: set[str], ops: dict[str, str],
             storage: WeightStorage, outliers: dict[str, str], before_s: float
             ) -> tuple[list[str], Candidate, dict[str, Any]]:
    """(float nodes, the candidate to write, sensitivity report) of recovery from the verdict of
    ``storage``'s chosen candidate, which misses the budget (``before_s``: the seconds calibration and
    placement took)."""
    checker, cfg = setup.checker, setup.cfg
    weight_range, chosen = storage.weight_range, storage.chosen
    holdout, budget, verdict = checker.holdout, checker.budget, chosen.verdict

    def placed(float_nodes: set[str]) -> onnx.ModelProto:
        return placer.build(weight_range, set(float_nodes) | unsupported)[1]

    plan = placer.plan(weight_range, unsupported)
    units = [n for n in plan.quantized_nodes() if ops.get(n) not in PASS_THROUGH_OPS]
    log.warning("quantize: the PTQ model misses the accuracy budget on %d held-out samples (%s); "
                "ranking %d quantized nodes by their contribution to the output error",
                holdout.samples, verdict.what, len(units))
    if verdict.hint:
        log.warning("quantize: %s", verdict.hint)
    max_float = math.floor(float(cfg.accuracy.max_float_fraction) * len(units))
    started = time.monotonic()
    with recovery_allowance(cfg, before_s) as allowance:
        found = recover_budget(placer.model, MissedBudget(units, verdict, outliers), placed,
                               recovery_checker(checker, cfg), max_float, allowance, checker)
    float_nodes, recovered, report = found.float_nodes, found.candidate, found.report
    took = time.monotonic() - started
    log.info("quantize: recovery took %.1f s (%d checks; calibration and placement before it: %.1f s)", took,
             allowance.checks, before_s)
    final = chosen
    if recovered is not None:  # judged again by the budget itself (recovery aimed inside it)
        final = checker.check(placed(set(float_nodes)), "recovered")
    sensitivity = {
        "budget": budget.describe(), "holdout": holdout.source, "samples": holdout.samples,
        "full_placement": verdict.to_dict() if verdict else None, **report,
        "float_nodes": float_nodes, "met": recovered is not None,
        "accuracy": final.verdict.to_dict() if final.verdict else None,
        "seconds": round(took, 2), "checks": allowance.checks, "seconds_before": round(before_s, 2),
        "allowance_seconds": allowance.seconds,
    }
    return float_nodes, final, sensitivity
