"""The float-exact transforms quantize makes before calibration, as passes.

Each transform is one ``FloatPass``: whether the config turns it on, its precondition (why it has
nothing to do on a model), the rewrite, and its log line. ``run_passes`` applies a list of them in
order under one postcondition, the float-exact rule: a rewrite is kept only if the float outputs on
calibration feeds move by at most FLOAT_EXACT (relative L2) from the graph it was applied to, so the
model autotune and evaluate compare against is the model the user gave. Each pass leaves one
``TransformRecord``. Adding a transform is one class and one entry in FLOAT_PASSES (the anchor: onnx
ir-py's ``PassBase`` / ``PassResult`` / ``Sequential``).

RNN lowering (``quantize.lower_rnn``) is a pass too, run alone before the others: it makes more of the
model quantizable, which recovery and autotune then weigh node by node, so it is not weighed against
the PTQ error as FLOAT_PASSES are (``_held_out.keep_transforms``).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import onnx

from pipeline.data.adapters import Batch
from pipeline.records.quantize import BiasCorrection
from pipeline.transforms.record import TransformRecord
from tasks.quantize.passes.postcondition import FLOAT_EXACT

log = logging.getLogger("tune.quantize")

CHECK_BATCHES = 4  # calibration batches the float outputs are compared on


@dataclass(frozen=True)
class PassContext:
    """What a pass may read: the quantize config, the calibration batches, the pipeline's ORT threads
    and the activation storage type."""

    q: Any
    batches: Callable[[], Iterable[Batch]]
    threads: int
    act_type: str

    @functools.cached_property
    def feeds(self) -> list[dict[str, Any]]:
        """The first CHECK_BATCHES calibration feeds, which the float-exact rule is checked on."""
        return [b.feeds for b in islice(self.batches(), CHECK_BATCHES)]


class FloatPass:
    """One float-graph transform. Subclasses set ``name`` and ``config_key`` and implement ``rewrite``."""

    name: str
    config_key: str  # the quantize.<key> that turns it on
    # held to the PTQ model's held-out error (``_held_out.keep_transforms``): a pass that moves range between
    # weights and activations can cost int8 accuracy; one that only removes float ops between quantized
    # ones cannot, and is kept on the float-exact rule alone
    weighed: bool = True

    def enabled(self, q: Any) -> bool:
        return bool(q.get(self.config_key))

    def precondition(self, model: onnx.ModelProto) -> str | None:
        """Why the pass has nothing to do on ``model`` (it is recorded, not run); None: run it."""
        return None

    def rewrite(self, model: onnx.ModelProto, ctx: PassContext) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
        """(the rewritten model, one entry per change); the input model is never mutated."""
        raise NotImplementedError

    def announce(self, record: TransformRecord) -> None:
        """The log line of an applied rewrite."""

    def phrase(self, record: TransformRecord) -> str | None:
        """What the applied rewrite did, for headlines and reports; None to say nothing."""
        return None


class FoldScales(FloatPass):
    name, config_key = "fold_scales", "fold_scales"
    weighed = False  # the Div goes; the layer's per-channel weight scales and its output's range follow it

    def rewrite(self, model, ctx):
        from tasks.quantize.passes.scale_folding import fold_matmul_scales

        return fold_matmul_scales(model)

    def announce(self, record):
        log.info("quantize: %d constant scale(s) on MatMul outputs folded into the layers before them "
                 "(float outputs within %.1e)", len(record.changes), record.float_rel_error)


class Equalization(FloatPass):
    name, config_key = "equalization", "equalization"

    def rewrite(self, model, ctx):
        from tasks.quantize.passes.equalization import equalize_cross_layer

        return equalize_cross_layer(model)

    def announce(self, record):
        log.info("quantize: cross-layer equalization of %d conv pair(s) (float outputs within %.1e)",
                 len(record.changes), record.float_rel_error)

    def phrase(self, record):
        return f"equalized {len(record.changes)} conv pair(s)"


class Smoothing(FloatPass):
    name, config_key = "smoothing", "smoothing"

    def precondition(self, model):
        from tasks.quantize.passes.smoothing import smoothing_candidates

        return None if smoothing_candidates(model) else "no MatMul/Gemm with a constant weight reads an activation"

    def rewrite(self, model, ctx):
        from pipeline.graph.memory import memory_limit_bytes
        from tasks.quantize.passes.activations import channel_absmax
        from tasks.quantize.passes.smoothing import smooth_outliers, smoothing_candidates

        absmax, samples = channel_absmax(model, ctx.batches, smoothing_candidates(model), ctx.threads,
                                         max_bytes=memory_limit_bytes(ctx.q.calibration.max_memory_gb))
        act = ctx.act_type if ctx.act_type in ("int8", "uint8") else "int8"
        return smooth_outliers(model, absmax, samples, act_dtype=act)

    def announce(self, record):
        muls = sum(c["inserted_mul"] for c in record.changes)
        log.info("quantize: outlier channels of %d MatMul/Gemm input(s) migrated into their producers "
                 "(%d absorbed, %d by an inserted Mul)", len(record.changes), len(record.changes) - muls, muls)

    def phrase(self, record):
        muls = sum(c["inserted_mul"] for c in record.changes)
        return f"smoothed {len(record.changes)} outlier tensor(s)" + (f" ({muls} by an inserted Mul)" if muls else "")


class RnnLowering(FloatPass):
    name, config_key = "rnn_lowering", "lower_rnn"

    def rewrite(self, model, ctx):
        from pipeline.transforms.rnn import lower_lstm

        new, changes = lower_lstm(model)
        if new is model:  # nothing lowered: say why in the record
            reason = "no LSTM to lower" if not changes else "; ".join(c["reason"] for c in changes)
            raise _NothingToDo(reason, changes)
        return new, changes

    def announce(self, record):
        done = [c for c in record.changes if c["lowered"]]
        log.info("quantize: unrolled %d LSTM(s) into %d MatMuls (float outputs within %.1e)", len(done),
                 sum(c["matmuls"] for c in done), record.float_rel_error)

    def phrase(self, record):
        done = [c for c in record.changes if c.get("lowered")]
        return f"unrolled {len(done)} LSTM(s) into {sum(c['matmuls'] for c in done)} MatMuls"


class _NothingToDo(Exception):
    """A rewrite that found nothing to change, with the reason and its per-candidate entries."""

    def __init__(self, reason: str, changes: list[dict[str, Any]]):
        super().__init__(reason)
        self.reason, self.changes = reason, changes


# the transforms made before calibration, in order (each weighed against the PTQ error afterwards)
FLOAT_PASSES: tuple[FloatPass, ...] = (FoldScales(), Equalization(), Smoothing())
PASSES_BY_NAME = {p.name: p for p in (*FLOAT_PASSES, RnnLowering())}


def weighed(records: Iterable[TransformRecord]) -> bool:
    """Whether a pass held to the PTQ model's held-out error changed the graph (``FloatPass.weighed``)."""
    return any(r.applied and PASSES_BY_NAME[r.transform].weighed for r in records if r.transform in PASSES_BY_NAME)


def run_passes(model: onnx.ModelProto, passes: Sequence[FloatPass], ctx: PassContext
               ) -> tuple[onnx.ModelProto, list[TransformRecord]]:
    """(``model`` after the enabled ``passes``, one record per enabled pass), each rewrite kept only
    where it is float-exact."""
    from tasks.quantize.passes.postcondition import float_rel_error

    records = []
    for p in passes:
        if not p.enabled(ctx.q):
            continue
        why, new, changes = p.precondition(model), model, []
        if why is None:
            try:
                new, changes = p.rewrite(model, ctx)
            except _NothingToDo as nothing:
                why, changes = nothing.reason, nothing.changes
            else:
                why = None if changes else "nothing to change"
        if why is not None:
            records.append(TransformRecord(p.name, False, changes, why))
            continue
        err = float_rel_error(model, new, ctx.feeds)
        if err > FLOAT_EXACT:
            log.warning("quantize: %s changed the float outputs by %.2e (> %.0e); not applied", p.name, err,
                        FLOAT_EXACT)
            records.append(TransformRecord(p.name, False, changes, f"float outputs changed by {err:.2e}", err))
            continue
        record = TransformRecord(p.name, True, changes, float_rel_error=err)
        records.append(record)
        p.announce(record)
        model = new
    return model, records


def summary(records: Iterable[TransformRecord], bias: BiasCorrection | None) -> list[str]:
    """One phrase per transform that changed the model (and bias correction), for headlines and reports."""
    out = [phrase for r in records if r.applied and r.transform in PASSES_BY_NAME
           and (phrase := PASSES_BY_NAME[r.transform].phrase(r))]
    if bias is not None and bias.applied:
        out.append(f"bias-corrected {bias.nodes} node(s)")
    return out
