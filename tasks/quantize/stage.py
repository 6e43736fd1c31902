"""The quantize stage: calibrate every Q/DQ candidate tensor, then write the default placement.

Outputs: quantize/calibration.json (statistics and scale/zero point per dtype for every candidate
activation, per-channel scales for every weight) and quantize/quantized_model.onnx (the "PTQ" model:
Q/DQ placed for the configured backend's fusions, with per-node dtypes from `quantize.layers`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

import numpy as np
import onnx
from omegaconf import DictConfig

from pipeline.artifacts import atomic_write_json
from pipeline.config import enum_value
from pipeline.data import DataProvider
from pipeline.errors import StageError
from pipeline.graph import input_specs, load_model, save_model
from pipeline.placement import (
    GraphIndex,
    NodeDtypes,
    _weight_inputs,
    activation_type,
    onnxruntime_plan,
    placement_kind,
    resolve_rules,
    tensorrt_plan,
    weight_axis,
)
from pipeline.progress import progress_bar
from pipeline.qdq import FP8, QTYPES, Calibration, activation_params, apply_plan, qdq_summary, weight_params
from pipeline.stage import Stage, StageContext, StageResult

log = logging.getLogger("tune.quantize")




def weight_records(model: onnx.ModelProto) -> dict[str, Any]:
    """Per-channel scales of every weight of a weighted op, for each weight dtype."""
    g = GraphIndex(model)
    out: dict[str, Any] = {}
    for node in model.graph.node:
        for i in _weight_inputs(g, node):
            name = node.input[i]
            if name in out:
                continue
            w = onnx.numpy_helper.to_array(g.inits[name]).astype(np.float32)
            axis = weight_axis(node, i, w.shape)
            rec: dict[str, Any] = {"node": node.name, "op_type": node.op_type, "axis": axis,
                                   "shape": list(w.shape), "absmax": float(np.abs(w).max()) if w.size else 0.0}
            for dt in ("int8", *FP8):
                rec[dt] = {"scale": weight_params(w, axis, dt).scale.tolist(), "zero_point": 0}
            out[name] = rec
    return out


def calibration_document(stats: dict[str, dict], model: onnx.ModelProto, cfg: DictConfig) -> dict[str, Any]:
    tensors = {}
    for name, s in stats.items():
        rec = dict(s)
        for dt in QTYPES:
            p = activation_params(s, dt)
            rec[dt] = {"scale": float(p.scale), "zero_point": float(p.zero_point)}
        tensors[name] = rec
    return {
        "version": 1,
        "algorithm": enum_value(cfg.quantize.algorithm),
        "percentile": float(cfg.quantize.percentile),
        "batches": int(cfg.quantize.calibration.batches),
        "tensors": tensors,
        "weights": weight_records(model),
    }


class QuantizeStage(Stage):
    name = "quantize"
    inputs = ("export/model.onnx",)
    outputs = ("quantize/quantized_model.onnx", "quantize/calibration.json")
    config_keys = ("quantize", "data", "seed", "backend.name")

    def run(self, ctx: StageContext) -> StageResult:
        cfg = ctx.cfg
        q = cfg.quantize
        out_dir = ctx.stage_dir("quantize")
        float_path = ctx.require("export/model.onnx")
        model = load_model(float_path)
        out_model, out_calib = out_dir / "quantized_model.onnx", out_dir / "calibration.json"
        rules = resolve_rules(model, q.layers, q.skip_names, q.op_types_to_quantize)
        if not rules:
            log.warning("quantize: no layer rule quantizes anything (quantize=none or empty rules); "
                        "passing the float model through unchanged")
            save_model(model, out_model)
            atomic_write_json(out_calib, {"version": 1, "algorithm": None, "tensors": {}, "weights": {}})
            return StageResult({"quantize/quantized_model.onnx": out_model, "quantize/calibration.json": out_calib},
                               {"quantized_nodes": 0, "headline": "float model passed through (no quantization)"})

        specs = input_specs(model)
        provider = DataProvider(cfg, specs)
        n_batches = int(q.calibration.batches)
        total = provider.count("calibration", n_batches)

        def batches():
            return provider.batches("calibration", n_batches)

        def progress(it, desc):
            return progress_bar(bool(cfg.progress), iterable=it, total=total, desc=f"quantize: {desc}", unit="batch")

        from pipeline.backends.onnxruntime import physical_cores
        from tasks.quantize._calibrate import collect

        t0 = time.time()
        stats = collect(model, batches, enum_value(q.algorithm), float(q.percentile), int(q.calibration.num_bins),
                        physical_cores(), progress)
        calib_seconds = time.time() - t0
        doc = calibration_document(stats, model, cfg)
        atomic_write_json(out_calib, doc)
        samples = next(iter(stats.values()))["samples"] if stats else 0
        log.info("calibrated %d tensors on %d samples with %s in %.1f s", len(stats), samples,
                 enum_value(q.algorithm), calib_seconds)

        kind = placement_kind(cfg)
        act_type = activation_type(cfg)
        builder = onnxruntime_plan if kind == "onnxruntime" else tensorrt_plan
        plan = builder(model, rules, act_type, per_channel=bool(q.per_channel))
        calibration = Calibration(doc["tensors"])
        if not plan.activations and not plan.weights:
            raise StageError("quantize: the rules match no quantizable op in this model (Conv, Gemm, MatMul, ...); "
                             "check quantize.layers / skip_names / op_types_to_quantize")
        qmodel = apply_plan(model, plan, calibration)
        save_model(qmodel, out_model, external_data=bool(q.use_external_data_format))
        self._log_rules(model, plan, rules, act_type)
        counts = qdq_summary(qmodel)
        dtypes = Counter(a.dtype for a in plan.activations) + Counter(w.dtype for w in plan.weights)
        headline = (f"{enum_value(q.algorithm)} calibration, {kind} placement: {len(plan.node_rules)} nodes quantized "
                    f"({', '.join(f'{k} x{v}' for k, v in sorted(dtypes.items()))}), "
                    f"{counts['QuantizeLinear']} Q / {counts['DequantizeLinear']} DQ")
        log.info("wrote %s (%s)", out_model, headline)
        metrics = {
            "placement": kind, "activation_type": act_type, "calibrated_tensors": len(stats),
            "calibration_samples": samples, "calibration_seconds": round(calib_seconds, 2),
            "quantized_nodes": len(plan.node_rules), "node_rules": plan.node_rules, **counts,
            "headline": headline,
        }
        return StageResult({"quantize/quantized_model.onnx": out_model, "quantize/calibration.json": out_calib},
                           metrics)

    @staticmethod
    def _log_rules(model: onnx.ModelProto, plan, rules: dict[str, NodeDtypes], act_type: str) -> None:
        ops = {n.name: n.op_type for n in model.graph.node}
        wd = {w.node: w.dtype for w in plan.weights}
        for name, why in plan.skipped.items():
            log.info("  %s (%s) left float: %s", name, ops.get(name, "?"), why)
        for name, rule in plan.node_rules.items():
            r = rules.get(name)
            acts = r.activations if r else "?"
            if acts == "int8" and act_type == "uint8":
                acts = "uint8 (int8 rule, ORT asymmetric activations)"
            log.info("  %s (%s) <- %s: weights %s, activations %s", name, ops.get(name, "?"), rule,
                     wd.get(name, "none"), acts)
