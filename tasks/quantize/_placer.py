"""Quantized candidates of one float graph with one calibration: its default placement, the placement
with some nodes left float and a chosen weight storage, and bias correction of such a placement."""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import onnx

from pipeline.errors import StageError
from pipeline.graph.memory import weights_nbytes
from pipeline.graph.model import control_flow
from pipeline.quant.calibration import Calibration
from pipeline.quant.qdq import apply_plan, search_weights_ahead
from pipeline.records.quantize import BiasCorrection
from tasks.quantize._setup import QuantizeSetup
from tasks.quantize.bias_correction import correct_bias
from tasks.quantize.checker import Candidate

log = logging.getLogger("tune.quantize")

# float weights from which the quantize stage searches their scales beside calibration (Placer.weights_ahead)
AHEAD_FROM_BYTES = 64 * 2**20


class Placer:
    """Places Q/DQ into ``model`` with ``setup``'s rules, builder and activation type, scaled by
    ``calibration`` (which bias correction and the range choice after recovery update in place)."""

    def __init__(self, setup: QuantizeSetup, model: onnx.ModelProto, calibration: Calibration):
        self.setup = setup
        self.model = model
        self.calibration = calibration

    def place(self) -> Any:
        """The default placement: every rule, the weight storage ``quantize.weight_range`` starts from."""
        s = self.setup
        return s.builder(self.model, s.rules, s.act_type, per_channel=bool(s.q.per_channel),
                         weight_range=s.start_weights)

    @contextmanager
    def weights_ahead(self) -> Iterator[None]:
        """Within it, the default placement's weight scales are searched in a thread of their own
        (``search_weights_ahead``): calibration leaves a core idle much of its time, and the first
        candidate model takes them. Not where the run may use only one thread, nor for absmax weights
        (nothing to search), nor for weights under AHEAD_FROM_BYTES (their search is over in moments: a
        thread beside calibration's would only crowd it)."""
        if self.setup.backend.threads == 1 or self.calibration.weight_clip != "mse" \
                or weights_nbytes(self.model) < AHEAD_FROM_BYTES:
            yield
            return
        stop = threading.Event()
        thread = threading.Thread(target=contextvars.copy_context().run, name="qdq-tune-weights-ahead", daemon=True,
                                  args=(self._search_ahead, self.place(), stop))
        thread.start()
        try:
            yield
        except BaseException:
            stop.set()  # a failed or interrupted stage does not wait for the weight being searched
            raise
        stop.set()  # the weight being searched is finished; no later one is started
        thread.join()

    def _search_ahead(self, plan: Any, stop: threading.Event) -> None:
        try:
            search_weights_ahead(self.model, plan, self.calibration, stop)
        except Exception as exc:  # noqa: BLE001 - apply_plan meets the same weight and says what is wrong
            log.debug("quantize: the weight search ahead stopped: %s", exc)

    def held_out_error(self, name: str) -> float | None:
        """Held-out error of the default placement; None when that model does not load or run (sorted
        out later, node by node)."""
        c = self.setup.checker.check(self.default_model(), name)
        return c.verdict.error if c.scored else None

    def default_model(self) -> onnx.ModelProto:
        """The model of the default placement with this calibration (a candidate: not run through
        onnx.checker, see ``build``)."""
        return apply_plan(self.model, self.place(), self.calibration, check=False)

    def build(self, weight_range: str, float_nodes: set[str] = frozenset(), check: bool = True
              ) -> tuple[Any, onnx.ModelProto]:
        """(plan, quantized model) with ``float_nodes`` left float and weights stored as ``weight_range``;
        ``check=False`` for a candidate that is only measured (the placement that runs first and the
        model that is written are checked; a broken candidate fails its measurement anyway)."""
        plan = self.plan(weight_range, float_nodes)
        return plan, apply_plan(self.model, plan, self.calibration, check=check)

    def plan(self, weight_range: str, float_nodes: set[str] = frozenset()) -> Any:
        """The QDQPlan ``build`` places (a StageError where the rules quantize nothing)."""
        s, model, rules = self.setup, self.model, self.setup.rules
        kept = {k: v for k, v in rules.items() if k not in float_nodes}
        plan = s.builder(model, kept, s.act_type, per_channel=bool(s.q.per_channel), weight_range=weight_range)
        if not any(p.activations or p.weights for p in plan.walk()) and not set(float_nodes) & set(rules):
            cf = control_flow(model)
            if cf["weighted_inside"] and not cf["weighted_outside"]:
                raise StageError(f"quantize: all {cf['weighted_inside']} weighted ops of this model sit inside "
                                 f"If/Loop/Scan bodies ({cf['nodes']} nodes) and none is quantizable: If bodies "
                                 f"stay float, and no Loop/Scan body holds a quantizable op; the main graph has "
                                 f"nothing to quantize")
            raise StageError("quantize: the rules match no quantizable op in this model (Conv, Gemm, MatMul, "
                             "...); check quantize.layers / skip_names / op_types_to_quantize")
        return plan

    def fix_bias(self, weight_range: str, float_nodes: set[str], before: Candidate
                 ) -> tuple[BiasCorrection, Candidate | None]:
        """Bias correction of this placement, kept (in ``calibration``) only if the held-out error falls:
        (the record, the corrected candidate or None)."""
        calibration = self.calibration

        def placed(corr: dict[str, list[float]]) -> onnx.ModelProto:
            calibration.bias_corrections = corr
            return self.build(weight_range, float_nodes, check=False)[1]

        plan = self.plan(weight_range, float_nodes)
        corrections, records = correct_bias(self.model, placed, {w.node for w in plan.weights},
                                            self.setup.batches, self.setup.backend.threads)
        rec = BiasCorrection(False, len(corrections), records, before.verdict.what if before.verdict else None)
        if not corrections:
            return replace(rec, reason="no quantized node has a bias initializer"), None
        calibration.bias_corrections = corrections
        after = self.setup.checker.check(self.build(weight_range, float_nodes, check=False)[1], "bias_corrected")
        rec = replace(rec, after=after.verdict.what if after.verdict else after.error)
        better = after.scored and before.verdict is not None and after.verdict.error < before.verdict.error
        if not better:
            calibration.bias_corrections = {}
            log.info("quantize: bias correction not kept (%s -> %s)", rec.before, rec.after)
            return replace(rec, reason="did not lower the held-out error"), None
        log.info("quantize: bias correction of %d node(s): %s -> %s", len(corrections), rec.before, rec.after)
        return replace(rec, applied=True), after
