"""What the quantize stage does to make int8 itself accurate, before and after placement.

First, LSTMs are unrolled into MatMuls where that is exact (``quantize.lower_rnn``; pipeline/transforms/rnn.py).
Before calibration, float-exact transforms of the float graph (``quantize.equalization``,
``quantize.smoothing``; see transforms): each one is run on calibration feeds against the graph it
was applied to and kept only if the outputs move by at most FLOAT_EXACT (relative L2), so the model
autotune and evaluate compare against is the model the user gave. After placement, bias correction
(``quantize.bias_correction``; see bias_correction), kept only when it lowers the held-out error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from itertools import islice
from typing import Any

import onnx

from pipeline.data.adapters import Batch

log = logging.getLogger("tune.quantize")

FLOAT_EXACT = 1e-5  # largest relative output change a float-exact transform may cause
CHECK_BATCHES = 4  # calibration batches the float outputs are compared on
BIAS_BATCHES = 8  # calibration batches the mean output shifts are measured on


def transform_float(model: onnx.ModelProto, q: Any, batches: Callable[[], Iterable[Batch]], threads: int,
                    act_type: str) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """(the float model after the configured transforms, one record per transform)."""
    from tasks.quantize import transforms as tf

    feeds = [b.feeds for b in islice(batches(), CHECK_BATCHES)]
    records: list[dict[str, Any]] = []

    def keep(name: str, new: onnx.ModelProto, changes: list[dict], current: onnx.ModelProto) -> onnx.ModelProto:
        if not changes:
            records.append({"transform": name, "applied": False, "reason": "nothing to change", "changes": []})
            return current
        err = tf.float_rel_error(current, new, feeds)
        if err > FLOAT_EXACT:
            log.warning("quantize: %s changed the float outputs by %.2e (> %.0e); not applied", name, err, FLOAT_EXACT)
            records.append({"transform": name, "applied": False, "float_rel_error": err,
                            "reason": f"float outputs changed by {err:.2e}", "changes": changes})
            return current
        records.append({"transform": name, "applied": True, "float_rel_error": err, "changes": changes})
        return new

    if bool(q.fold_scales):
        from tasks.quantize.scale_folding import fold_matmul_scales

        new, changes = fold_matmul_scales(model)
        model = keep("fold_scales", new, changes, model)
        if changes and records[-1]["applied"]:
            log.info("quantize: %d constant scale(s) on MatMul outputs folded into the layers before them "
                     "(float outputs within %.1e)", len(changes), records[-1]["float_rel_error"])
    if bool(q.equalization):
        new, changes = tf.equalize_cross_layer(model)
        model = keep("equalization", new, changes, model)
        if changes:
            log.info("quantize: cross-layer equalization of %d conv pair(s) (float outputs within %.1e)",
                     len(changes), records[-1].get("float_rel_error", 0.0))
    if bool(q.smoothing):
        candidates = tf.smoothing_candidates(model)
        if candidates:
            from pipeline.graph.memory import memory_limit_bytes

            absmax, samples = tf.channel_absmax(model, batches, candidates, threads,
                                                max_bytes=memory_limit_bytes(q.calibration.max_memory_gb))
            new, changes = tf.smooth_outliers(model, absmax, samples, act_dtype=act_type if act_type in
                                              ("int8", "uint8") else "int8")
            model = keep("smoothing", new, changes, model)
            if changes:
                log.info("quantize: outlier channels of %d MatMul/Gemm input(s) migrated into their producers "
                         "(%d absorbed, %d by an inserted Mul)", len(changes),
                         sum(not c["inserted_mul"] for c in changes), sum(c["inserted_mul"] for c in changes))
        else:
            records.append({"transform": "smoothing", "applied": False, "reason": "no MatMul/Gemm with a constant "
                            "weight reads an activation", "changes": []})
    return model, records


def lower_rnn(model: onnx.ModelProto, batches: Callable[[], Iterable[Batch]]
              ) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """(the model with its LSTMs unrolled where that is exact, the record). Unlike the transforms above it
    is not weighed against the PTQ error: it makes more of the model quantizable, which recovery and
    autotune then weigh node by node."""
    from pipeline.transforms.rnn import lower_lstm
    from tasks.quantize import transforms as tf

    new, changes = lower_lstm(model)
    record: dict[str, Any] = {"transform": "rnn_lowering", "applied": False, "changes": changes}
    if new is model:
        record["reason"] = "no LSTM to lower" if not changes else "; ".join(c["reason"] for c in changes)
        return model, record
    err = tf.float_rel_error(model, new, [b.feeds for b in islice(batches(), CHECK_BATCHES)])
    record["float_rel_error"] = err
    if err > FLOAT_EXACT:
        log.warning("quantize: unrolling LSTMs changed the float outputs by %.2e (> %.0e); not applied", err,
                    FLOAT_EXACT)
        record["reason"] = f"float outputs changed by {err:.2e}"
        return model, record
    record["applied"] = True
    done = [c for c in changes if c["lowered"]]
    log.info("quantize: unrolled %d LSTM(s) into %d MatMuls (float outputs within %.1e)", len(done),
             sum(c["matmuls"] for c in done), err)
    return new, record


def correct_bias(model: onnx.ModelProto, build: Callable[[dict[str, list[float]]], onnx.ModelProto],
                 quantized: Iterable[str], batches: Callable[[], Iterable[Batch]], threads: int
                 ) -> tuple[dict[str, list[float]], list[dict]]:
    """Mean output shift per quantized node with a bias, measured on calibration batches."""
    from tasks.quantize.bias_correction import corrections

    feeds = [b.feeds for b in islice(batches(), BIAS_BATCHES)]
    return corrections(model, build, feeds, quantized, threads)


def summary(records: list[dict[str, Any]], bias: dict[str, Any] | None) -> list[str]:
    """One phrase per transform that changed the model, for headlines and reports."""
    out = []
    for r in records:
        if not r.get("applied"):
            continue
        n = len(r["changes"])
        if r["transform"] == "rnn_lowering":
            done = [c for c in r["changes"] if c.get("lowered")]
            out.append(f"unrolled {len(done)} LSTM(s) into {sum(c['matmuls'] for c in done)} MatMuls")
        elif r["transform"] == "equalization":
            out.append(f"equalized {n} conv pair(s)")
        elif r["transform"] == "smoothing":
            muls = sum(c["inserted_mul"] for c in r["changes"])
            out.append(f"smoothed {n} outlier tensor(s)" + (f" ({muls} by an inserted Mul)" if muls else ""))
    if bias and bias.get("applied"):
        out.append(f"bias-corrected {bias['nodes']} node(s)")
    return out
