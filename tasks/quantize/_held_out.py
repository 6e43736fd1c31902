"""Whole-model choices the quantize stage makes on the held-out error of the PTQ model: whether the
float-exact transforms are kept, and (``quantize.algorithm=auto``) which activation ranges, first for
the full placement and again once recovery has left nodes float."""

from __future__ import annotations

import logging
from dataclasses import replace

import onnx

from pipeline.calibrate.collect import with_ranges
from pipeline.calibrate.search import AUTO_CANDIDATES
from pipeline.graph.memory import weights_nbytes
from pipeline.graph.shapes import node_macs
from pipeline.progress import work_bar
from pipeline.quant.calibration import PER_TENSOR, TensorStats, stats_table
from pipeline.records.quantize import QuantizeDecisions, RangeChoice
from pipeline.transforms.record import TransformRecord
from tasks.quantize._placer import Placer
from tasks.quantize._setup import QuantizeSetup
from tasks.quantize.checker import Candidate, recovery_checker

log = logging.getLogger("tune.quantize")


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _weight_clip(method: str) -> str:
    return "mse" if method in (PER_TENSOR, "mse") else "max"


def keep_transforms(setup: QuantizeSetup, transformed: onnx.ModelProto, stats: dict[str, TensorStats],
                    transforms: list[TransformRecord], weight_clip: str
                    ) -> tuple[onnx.ModelProto, dict, list[TransformRecord]]:
    """(model, statistics, the transforms' records with both held-out errors): the float-exact
    transforms are kept only if the PTQ model made from them has the lower held-out error than
    ``setup.model``'s: equalization shifts range from weights into activations, which per-channel
    weights may not need (measured: a VAD's held-out error rose from 0.0033 to 0.030 with it, 24.8 to
    15.2 dB)."""
    original = setup.model
    stats_o = setup.calibrate(original)

    err_t = Placer(setup, transformed, setup.calibration_of(stats, weight_clip)).held_out_error("transformed")
    err_o = Placer(setup, original, setup.calibration_of(stats_o, weight_clip)).held_out_error("original")
    errors = {"with": err_t, "without": err_o}
    records = [replace(t, held_out_error=errors) if t.applied else t for t in transforms]
    if err_t is None or err_o is None or err_t <= err_o:
        log.info("quantize: transformed graph kept (held-out error %s with, %s without)", _num(err_t), _num(err_o))
        return transformed, stats, records
    log.warning("quantize: the transforms raised the PTQ model's held-out error (%s with, %s without); "
                "calibrating the original graph instead", _num(err_t), _num(err_o))
    why = f"raised the held-out error of the PTQ model ({_num(err_t)} vs {_num(err_o)} without)"
    return original, stats_o, [t.not_applied(why) if t.applied else t for t in records]


# the range choice keeps its best candidate built where the float weights times this fit the working set
# (quantize.calibration.max_memory_gb): the float model, and three built int8 models of a quarter its size
KEPT_MODELS_OF_WEIGHTS = 4


def choose_ranges(setup: QuantizeSetup, model: onnx.ModelProto, stats: dict[str, TensorStats]
                  ) -> tuple[dict[str, TensorStats], str, RangeChoice, onnx.ModelProto | None]:
    """``auto``: (statistics, weight search, record, the chosen model) of the whole-model range choice with
    the lowest held-out error of the PTQ model. A tensor's own lowest-MSE clip is not the output's: on a
    trained MobileNetV3 the per-tensor choice gave 19.7 dB held out where entropy everywhere gave 27.0 dB.
    The chosen model is the default placement with those statistics (None where no candidate scored);
    the checker keeps its runtime form built for the checks that come next."""
    errors: dict[str, float | None] = {}
    methods = (PER_TENSOR, *AUTO_CANDIDATES)
    options = {m: (with_ranges(stats, m), _weight_clip(m)) for m in methods}
    models: dict[str, onnx.ModelProto] = {}

    def built():
        for m in methods:
            models[m] = Placer(setup, model, setup.calibration_of(*options[m])).default_model()
            yield models[m], f"ranges_{m}"

    kept: list[str] = []  # the method of the best candidate so far, whose model the checker keeps built

    def keep(c: Candidate) -> bool:  # the first of equal errors, as min() below
        better = all(e is None or c.verdict.error < e for e in errors.values())
        if better:
            kept[:] = [c.name.removeprefix("ranges_")]
        return better

    # the kept model is one more built beside the two check_each holds: not where the weights are large
    # against the working set
    keeps = weights_nbytes(model) * KEPT_MODELS_OF_WEIGHTS <= setup.max_bytes
    with work_bar(len(methods), "quantize: auto ranges", unit="candidate") as bar:
        for method, c in zip(methods, setup.checker.check_each(built(), keep=keep if keeps else None), strict=True):
            bar.set_postfix_str(method)
            errors[method] = c.verdict.error if c.scored else None
            for m in [m for m in models if m in errors and m not in kept]:
                del models[m]
            bar.update(1)
    usable = {k: v for k, v in errors.items() if v is not None}
    best = min(usable, key=lambda k: usable[k]) if usable else PER_TENSOR
    log.info("quantize: auto ranges: %s (held-out error %s)", best,
             ", ".join(f"{k} {_num(v)}" for k, v in errors.items()))
    st, clip = options[best]
    return st, clip, RangeChoice(best, clip, errors), models.get(best) if kept == [best] else None


def _requantize_costliest_first(setup: QuantizeSetup, placer: Placer, decisions: QuantizeDecisions,
                                float_nodes: set[str], final: Candidate | None) -> tuple[bool, Candidate | None]:
    """Quantize each of ``float_nodes`` again (removing it from the set) where the budget with
    recovery's margin still holds, the costliest first by multiply-accumulates. (whether any was, the
    check of the placement now in force or ``final`` where none was)."""
    strict = recovery_checker(setup.checker, setup.cfg)  # recovery's margin holds here too
    wr, macs = decisions.weight_range, node_macs(placer.model)
    requantized = False
    for n in sorted(float_nodes - set(decisions.unsupported_nodes) - set(decisions.fidelity_culprits),
                    key=lambda n: (-macs.get(n, 0), n)):
        c = strict.check(placer.build(wr, float_nodes - {n})[1], "ranges_requantize")
        if c.scored and c.verdict.ok:
            float_nodes.discard(n)
            requantized = True
            log.info("quantize: %s quantized again: %s", n, c.verdict.what)
    if requantized:  # the placement now in force, judged by the budget itself (once, at the end)
        now = setup.checker.check(placer.build(wr, float_nodes)[1], "ranges_requantized")
        final = now if now.scored else None
    return requantized, final


def refine_ranges(setup: QuantizeSetup, placer: Placer, auto_stats: dict[str, TensorStats], ranges: RangeChoice,
                  decisions: QuantizeDecisions) -> tuple[dict[str, TensorStats] | None, RangeChoice, QuantizeDecisions]:
    """``auto`` after recovery: the range choice again, for the placement that leaves the recovered nodes
    float (the full placement's error, which chose the ranges first, is dominated by those nodes). If
    another choice is better there, it is taken. Then each float node is quantized again where the
    budget (with recovery's margin) still holds, the costliest first (by multiply-accumulates: a 3x3
    conv at a quarter of the image's resolution before the elementwise Adds that share its slack), and
    bias correction is redone. Updates ``placer.calibration``; returns (the statistics now in force,
    None if the choice stands; the range choice with the errors of this placement; the decisions)."""
    calibration, checker = placer.calibration, setup.checker
    wr, float_nodes = decisions.weight_range, set(decisions.float_nodes)

    def use(method: str) -> dict[str, TensorStats]:
        stats = with_ranges(auto_stats, method)
        calibration.tensors = stats_table(stats)
        calibration.weight_clip = _weight_clip(method)
        calibration.bias_corrections = {}
        return stats

    def check(nodes: set[str], name: str) -> Candidate | None:
        c = checker.check(placer.build(wr, nodes)[1], name)
        return c if c.scored else None

    saved = (calibration.tensors, calibration.weight_clip, calibration.bias_corrections)
    errors: dict[str, float | None] = {}
    methods = (PER_TENSOR, *AUTO_CANDIDATES)

    def with_each_range():  # each model is built before the next range is put in force
        for method in methods:
            use(method)
            yield placer.build(wr, float_nodes)[1], f"ranges_{method}_recovered"

    for method, c in zip(methods, checker.check_each(with_each_range()), strict=True):
        errors[method] = c.verdict.error if c.scored else None
    ranges = replace(ranges, with_float_nodes=errors)
    usable = {k: v for k, v in errors.items() if v is not None}
    best = min(usable, key=lambda k: usable[k]) if usable else ranges.chosen
    stats: dict[str, TensorStats] | None = None
    if best == ranges.chosen:
        calibration.tensors, calibration.weight_clip, _ = saved
        calibration.bias_corrections = {}  # fit to this float set: refit below if it changes
    else:
        log.info("quantize: auto ranges with the %d float nodes: %s (held-out error %s)", len(float_nodes), best,
                 ", ".join(f"{k} {_num(v)}" for k, v in errors.items()))
        stats = use(best)
        ranges = replace(ranges, chosen=best, weight_clip=calibration.weight_clip, rechosen_after_recovery=True)
    final = check(float_nodes, "ranges_final") if stats is not None else None
    requantized, final = _requantize_costliest_first(setup, placer, decisions, float_nodes, final)
    if stats is None and not requantized:
        calibration.bias_corrections = saved[2]
        return None, ranges, decisions
    decisions = replace(decisions, float_nodes=sorted(float_nodes))
    if bool(setup.q.bias_correction) and final is not None:
        bias, corrected = placer.fix_bias(wr, float_nodes, final)
        decisions = replace(decisions, bias_correction=bias)
        final = corrected or final
    if final is not None:
        decisions = replace(decisions, accuracy=final.verdict)
    return stats, ranges, decisions
