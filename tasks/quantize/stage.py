"""The quantize stage: calibrate every Q/DQ candidate tensor, then write the default placement.

Outputs: quantize/calibration.json (statistics and scale/zero point per dtype for every candidate
activation, per-channel scales for every weight) and quantize/quantized_model.onnx (the "PTQ" model:
Q/DQ placed for the configured backend's fusions, with per-node dtypes from `quantize.layers`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from omegaconf import DictConfig

from pipeline.artifacts import atomic_write_json
from pipeline.bodies import QUANTIZED_BODIES, unique_names, walk_views
from pipeline.calibration import Calibration
from pipeline.config import enum_value
from pipeline.data import DataProvider
from pipeline.errors import StageError
from pipeline.graph import control_flow, input_specs, iter_nodes, load_model, save_model
from pipeline.graph_index import GraphIndex, weight_inputs
from pipeline.placement import (
    NodeDtypes,
    activation_type,
    onnxruntime_plan,
    placement_kind,
    resolve_rules,
    tensorrt_plan,
    weight_axis,
)
from pipeline.progress import progress_bar
from pipeline.qdq import apply_plan, qdq_summary
from pipeline.qmath import FP8, QTYPES, activation_params
from pipeline.stage import Stage, StageContext, StageResult
from tasks.quantize import _prepare

log = logging.getLogger("tune.quantize")




def weight_records(model: onnx.ModelProto, calibration: Calibration) -> dict[str, Any]:
    """Per-channel scales of every weight of a weighted op (inside Loop/Scan bodies too), for each weight
    dtype, as ``calibration`` searches them (its cache then serves apply_plan: the mse search runs once
    per weight)."""
    out: dict[str, Any] = {}
    for m in [model, *(v.model for v in walk_views(model))]:
        out.update(_weight_records(m, calibration, set(out)))
    return out


def _weight_records(model: onnx.ModelProto, calibration: Calibration, done: set[str]) -> dict[str, Any]:
    g = GraphIndex(model)
    out: dict[str, Any] = {}
    for node in model.graph.node:
        for i in weight_inputs(g, node):
            name = node.input[i]
            if name in out or name in done:
                continue
            w = onnx.numpy_helper.to_array(g.inits[name]).astype(np.float32)
            axis = weight_axis(node, i, w.shape)
            rec: dict[str, Any] = {"node": node.name, "op_type": node.op_type, "axis": axis,
                                   "shape": list(w.shape), "absmax": float(np.abs(w).max()) if w.size else 0.0}
            for dt in ("int8", *FP8):
                rec[dt] = {"scale": calibration.weight_params(name, w, axis, dt).scale.tolist(), "zero_point": 0}
            out[name] = rec
    return out


def calibration_document(stats: dict[str, dict], model: onnx.ModelProto, cfg: DictConfig,
                         calibration: Calibration | None = None) -> dict[str, Any]:
    """calibration.json: ``stats`` with scale/zero point per dtype, and the weights' scales as
    ``calibration`` (default: one made from ``stats`` for the configured algorithm) searches them."""
    if calibration is None:
        calibration = Calibration(stats, weight_clip=Calibration.weight_clip_for(enum_value(cfg.quantize.algorithm)))
    weight_clip = calibration.weight_clip
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
        # how weight scales are searched; load_calibration hands it to apply_plan (autotune's models)
        "weight_clip": weight_clip,
        "weights": weight_records(model, calibration),
    }


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def _held_out_error(checker: Any, model: onnx.ModelProto, place: Callable[[onnx.ModelProto], Any],
                    calibration: Calibration, name: str) -> float | None:
    """Held-out error of ``model`` quantized with its default placement; None when that model does not
    load or run (sorted out later, node by node)."""
    c = checker.check(apply_plan(model, place(model), calibration), name)
    return c.verdict.error if c.scored else None


def _ort_backend(cfg: DictConfig):
    """The ONNX Runtime backend checks run on: the configured one, or ORT's defaults under TensorRT."""
    from omegaconf import OmegaConf

    from pipeline.backends.onnxruntime import OnnxRuntimeBackend
    from pipeline.config import OnnxRuntimeBackendConfig

    bcfg = cfg.backend if enum_value(cfg.backend.name) == "onnxruntime" else \
        OmegaConf.structured(OnnxRuntimeBackendConfig())
    return OnnxRuntimeBackend(bcfg)


class QuantizeStage(Stage):
    name = "quantize"
    inputs = ("export/model.onnx",)
    # float_model.onnx: the float graph after the float-exact transforms, the one calibration.json
    # describes and autotune places Q/DQ into
    outputs = ("quantize/quantized_model.onnx", "quantize/calibration.json", "quantize/float_model.onnx")
    config_keys = ("quantize", "data", "seed", "backend.name", "accuracy")

    def run(self, ctx: StageContext) -> StageResult:
        cfg = ctx.cfg
        q = cfg.quantize
        out_dir = ctx.stage_dir("quantize")
        float_path = ctx.require("export/model.onnx")
        model = load_model(float_path)
        if unique_names(model):  # plans and calibration.json name body nodes and tensors
            log.info("quantize: named the nodes of Loop/Scan bodies (and renamed values sibling bodies share)")
        out_model, out_calib = out_dir / "quantized_model.onnx", out_dir / "calibration.json"
        rules = resolve_rules(model, q.layers, q.skip_names, q.op_types_to_quantize)
        if not rules:
            log.warning("quantize: no layer rule quantizes anything (quantize=none or empty rules); "
                        "passing the float model through unchanged")
            save_model(model, out_model)
            save_model(model, out_dir / "float_model.onnx")
            atomic_write_json(out_calib, {"version": 1, "algorithm": None, "tensors": {}, "weights": {}})
            return StageResult({"quantize/quantized_model.onnx": out_model, "quantize/calibration.json": out_calib,
                                "quantize/float_model.onnx": out_dir / "float_model.onnx"},
                               {"quantized_nodes": 0, "headline": "float model passed through (no quantization)"})

        specs = input_specs(model)
        provider = DataProvider(cfg, specs)
        n_batches = int(q.calibration.batches)
        total = provider.count("calibration", n_batches)

        def batches():
            return provider.batches("calibration", n_batches)

        def progress(it, desc):
            return progress_bar(bool(cfg.progress), iterable=it, total=total, desc=f"quantize: {desc}", unit="batch")

        from pipeline.accuracy import AccuracyBudget, Holdout
        from tasks.quantize._accuracy import Checker, recovery_checker, start_range, temp_workdir
        from tasks.quantize._calibrate import collect
        from tasks.quantize._decide import decide
        from tasks.quantize._recovery import outlier_units

        backend = _ort_backend(cfg)  # calibration and every check run on it
        kind = placement_kind(cfg)
        act_type = activation_type(cfg)
        holdout = Holdout.from_config(cfg, specs)
        with backend.prepare(float_path) as pm:
            holdout.set_reference(pm)
        work = temp_workdir(out_dir)  # the candidates checked on the holdout; removed when decided
        # ORT placements are checked with the fused kernels that will run them, TensorRT ones as Q/DQ math
        checker = Checker(backend, holdout, AccuracyBudget.from_config(cfg), fused=kind == "onnxruntime",
                          workdir=Path(work.name))
        lowering = None
        if bool(q.lower_rnn):
            model, lowering = _prepare.lower_rnn(model, batches)
            if lowering["applied"]:
                rules = resolve_rules(model, q.layers, q.skip_names, q.op_types_to_quantize)
        original = model
        model, transforms = _prepare.transform_float(model, q, batches, backend.threads, act_type)
        builder = onnxruntime_plan if kind == "onnxruntime" else tensorrt_plan

        def calibrate(m: onnx.ModelProto) -> dict[str, dict]:
            return collect(m, batches, enum_value(q.algorithm), float(q.percentile), int(q.calibration.num_bins),
                           backend.threads, progress)

        def place(m: onnx.ModelProto):
            return builder(m, rules, act_type, per_channel=bool(q.per_channel), weight_range=start_range(q.weight_range))

        weight_clip = Calibration.weight_clip_for(enum_value(q.algorithm))
        t0 = time.time()
        stats = calibrate(model)
        if model is not original:
            model, stats = self._keep_transforms(original, model, stats, calibrate, transforms, checker, place,
                                                 weight_clip)
        if lowering is not None:
            transforms.insert(0, lowering)
        ranges, auto_stats = None, stats
        if enum_value(q.algorithm) == "auto":
            stats, weight_clip, ranges = self._choose_ranges(model, stats, checker, place)
        out_float = save_model(model, out_dir / "float_model.onnx")
        calib_seconds = time.time() - t0
        calibration = Calibration(stats, weight_clip=weight_clip)
        doc = calibration_document(stats, model, cfg, calibration)
        samples = next(iter(stats.values()))["samples"] if stats else 0
        log.info("calibrated %d tensors on %d samples with %s in %.1f s", len(stats), samples,
                 enum_value(q.algorithm), calib_seconds)

        def build(weight_range: str, float_nodes: set[str] = frozenset()):
            kept = {k: v for k, v in rules.items() if k not in float_nodes}
            plan = builder(model, kept, act_type, per_channel=bool(q.per_channel), weight_range=weight_range)
            if not any(p.activations or p.weights for p in plan.walk()) and not set(float_nodes) & set(rules):
                cf = control_flow(model)
                if cf["weighted_inside"] and not cf["weighted_outside"]:
                    raise StageError(f"quantize: all {cf['weighted_inside']} weighted ops of this model sit inside "
                                     f"If/Loop/Scan bodies ({cf['nodes']} nodes) and none is quantizable: If bodies "
                                     f"stay float, and no Loop/Scan body holds a quantizable op; the main graph has "
                                     f"nothing to quantize")
                raise StageError("quantize: the rules match no quantizable op in this model (Conv, Gemm, MatMul, "
                                 "...); check quantize.layers / skip_names / op_types_to_quantize")
            return plan, apply_plan(model, plan, calibration)

        def fix_bias(weight_range: str, float_nodes: set[str], checker: Any, before: Any) -> tuple[dict, Any]:
            """Bias correction of this placement, kept (in ``calibration``) only if the held-out error falls."""
            def placed(corr: dict[str, list[float]]) -> onnx.ModelProto:
                calibration.bias_corrections = corr
                return build(weight_range, float_nodes)[1]

            plan, _ = build(weight_range, float_nodes)
            corrections, records = _prepare.correct_bias(model, placed, {w.node for w in plan.weights}, batches,
                                                         backend.threads)
            rec: dict[str, Any] = {"applied": False, "nodes": len(corrections), "records": records,
                                   "before": before.verdict.what if before.verdict else None}
            if not corrections:
                rec["reason"] = "no quantized node has a bias initializer"
                return rec, None
            calibration.bias_corrections = corrections
            after = checker.check(build(weight_range, float_nodes)[1], "bias_corrected")
            rec["after"] = after.verdict.what if after.verdict else after.error
            better = after.scored and before.verdict is not None and after.verdict.error < before.verdict.error
            if not better:
                calibration.bias_corrections = {}
                rec["reason"] = "did not lower the held-out error"
                log.info("quantize: bias correction not kept (%s -> %s)", rec["before"], rec["after"])
                return rec, None
            rec["applied"] = True
            log.info("quantize: bias correction of %d node(s): %s -> %s", len(corrections), rec["before"], rec["after"])
            return rec, after

        outliers = outlier_units(model, stats, list(rules), float(q.outlier_threshold))
        decisions, sensitivity = decide(cfg, model, checker, kind, build,
                                        fix_bias if bool(q.bias_correction) else None, outliers)
        if ranges is not None and decisions["float_nodes"]:
            stats = self._refine_ranges(auto_stats, ranges, calibration, decisions, build, checker,
                                        recovery_checker(checker, cfg), fix_bias if bool(q.bias_correction) else None)
            doc = calibration_document(stats, model, cfg, calibration)
        work.cleanup()
        decisions["transforms"] = transforms
        doc["transforms"] = transforms
        if ranges is not None:
            doc["ranges"] = decisions["ranges"] = ranges
        doc["bias_corrections"] = calibration.bias_corrections
        plan, qmodel = build(decisions["weight_range"], set(decisions["float_nodes"]))
        # the Loop/Scan body placement, which autotune keeps (it tunes the main graph)
        doc["bodies"] = {k: p.to_dict() for k, p in plan.bodies.items()}
        decisions["body_nodes"] = sorted(n for p in plan.bodies.values() for n in p.quantized_nodes())
        decisions["all_float"] = not plan.quantized_nodes()
        doc["decisions"] = decisions
        atomic_write_json(out_calib, doc)
        save_model(qmodel, out_model, external_data=bool(q.use_external_data_format))
        self._log_rules(model, plan, rules, act_type)
        counts = qdq_summary(qmodel)
        dtypes = Counter(a.dtype for p in plan.walk() for a in p.activations) + \
            Counter(w.dtype for p in plan.walk() for w in p.weights)
        quantized = plan.quantized_nodes()
        in_bodies = len(quantized) - len(plan.node_rules)
        algorithm = enum_value(q.algorithm) + (f" ({ranges['chosen']} ranges)" if ranges else "")
        if quantized:
            headline = (f"{algorithm} calibration, {kind} placement: {len(quantized)} nodes quantized "
                        f"({', '.join(f'{k} x{v}' for k, v in sorted(dtypes.items()))}), "
                        f"{counts['QuantizeLinear']} Q / {counts['DequantizeLinear']} DQ")
        else:  # recovery's last resort: the rules matched, the budget left every node float
            full = (sensitivity or {}).get("full_placement") or {}
            headline = (f"float model: every quantizable node left float to meet the accuracy budget "
                        f"(the {decisions['weight_range']}-range int8 placement reached {full.get('what')})")
            log.warning("quantize: %s; quantized_model.onnx is the float model", headline)
        log.info("wrote %s (%s)", out_model, headline)
        artifacts = {"quantize/quantized_model.onnx": out_model, "quantize/calibration.json": out_calib,
                     "quantize/float_model.onnx": out_float}
        if sensitivity is not None:
            artifacts["quantize/sensitivity.json"] = atomic_write_json(out_dir / "sensitivity.json", sensitivity)
        acc = decisions.get("accuracy") or {}
        if acc and quantized:
            headline += f"; holdout {acc.get('what')}" + ("" if acc.get("ok") else " OVER BUDGET")
        if decisions["weight_range"] != "full":
            headline += f"; weights {decisions['weight_range']}"
        improved = _prepare.summary(transforms, decisions.get("bias_correction"))
        if improved:
            headline += "; " + ", ".join(improved)
        if decisions["float_nodes"] and quantized:
            headline += f"; {len(decisions['float_nodes'])} sensitive nodes left float"
        if in_bodies:
            headline += f"; {in_bodies} nodes inside Loop/Scan bodies quantized (autotune keeps them as placed)"
        metrics = {
            "weight_range": decisions["weight_range"], "weight_range_reason": decisions["weight_range_reason"],
            "cpu": decisions["cpu"], "kernel_fidelity": decisions.get("kernel_fidelity"),
            "accuracy": acc, "float_nodes": decisions["float_nodes"],
            "transforms": [{k: v for k, v in t.items() if k != "changes"} | {"changes": len(t["changes"])}
                           for t in transforms],
            "bias_correction": {k: v for k, v in (decisions.get("bias_correction") or {}).items() if k != "records"},
            "fidelity_culprits": decisions.get("fidelity_culprits", []), "ranges": ranges,
            "placement": kind, "activation_type": act_type, "calibrated_tensors": len(stats),
            "calibration_samples": samples, "calibration_seconds": round(calib_seconds, 2),
            "quantized_nodes": len(quantized), "body_nodes": in_bodies, "node_rules": quantized, **counts,
            "headline": headline,
        }
        return StageResult(artifacts, metrics)

    @staticmethod
    def _keep_transforms(original: onnx.ModelProto, transformed: onnx.ModelProto, stats: dict[str, dict],
                         calibrate: Callable[[onnx.ModelProto], dict[str, dict]], transforms: list[dict[str, Any]],
                         checker: Any, place: Callable[[onnx.ModelProto], Any], weight_clip: str
                         ) -> tuple[onnx.ModelProto, dict]:
        """The float-exact transforms are kept only if the PTQ model made from them has the lower held-out
        error: equalization shifts range from weights into activations, which per-channel weights may
        not need (measured: a VAD's held-out error rose from 0.0033 to 0.030 with it, 24.8 to 15.2 dB)."""
        stats_o = calibrate(original)

        err_t = _held_out_error(checker, transformed, place, Calibration(stats, weight_clip=weight_clip), "transformed")
        err_o = _held_out_error(checker, original, place, Calibration(stats_o, weight_clip=weight_clip), "original")
        for t in transforms:
            if t.get("applied"):
                t["held_out_error"] = {"with": err_t, "without": err_o}
        if err_t is None or err_o is None or err_t <= err_o:
            log.info("quantize: transformed graph kept (held-out error %s with, %s without)", _num(err_t), _num(err_o))
            return transformed, stats
        log.warning("quantize: the transforms raised the PTQ model's held-out error (%s with, %s without); "
                    "calibrating the original graph instead", _num(err_t), _num(err_o))
        for t in transforms:
            if t.get("applied"):
                t["applied"] = False
                t["reason"] = f"raised the held-out error of the PTQ model ({_num(err_t)} vs {_num(err_o)} without)"
        return original, stats_o

    @staticmethod
    def _choose_ranges(model: onnx.ModelProto, stats: dict[str, dict], checker: Any,
                       place: Callable[[onnx.ModelProto], Any]) -> tuple[dict[str, dict], str, dict[str, Any]]:
        """``auto``: (statistics, weight search, record) of the whole-model range choice with the lowest
        held-out error of the PTQ model. A tensor's own lowest-MSE clip is not the output's: on a trained
        MobileNetV3 the per-tensor choice gave 19.7 dB held out where entropy everywhere gave 27.0 dB."""
        from tasks.quantize._calibrate import AUTO_CANDIDATES, PER_TENSOR, with_ranges

        errors: dict[str, float | None] = {}
        options = {}
        for method in (PER_TENSOR, *AUTO_CANDIDATES):
            st = with_ranges(stats, method)
            clip = "mse" if method in (PER_TENSOR, "mse") else "max"
            errors[method] = _held_out_error(checker, model, place, Calibration(st, weight_clip=clip), f"ranges_{method}")
            options[method] = (st, clip)
        usable = {k: v for k, v in errors.items() if v is not None}
        best = min(usable, key=lambda k: usable[k]) if usable else PER_TENSOR
        log.info("quantize: auto ranges: %s (held-out error %s)", best,
                 ", ".join(f"{k} {_num(v)}" for k, v in errors.items()))
        st, clip = options[best]
        return st, clip, {"chosen": best, "weight_clip": clip, "held_out_error": errors}

    @staticmethod
    def _refine_ranges(auto_stats: dict[str, dict], ranges: dict[str, Any], calibration: Calibration,
                       decisions: dict[str, Any], build: Callable[..., Any], checker: Any, strict: Any,
                       fix_bias: Callable[..., Any] | None) -> dict[str, dict]:
        """``auto`` after recovery: the range choice again, for the placement that leaves the recovered nodes
        float (the full placement's error, which chose the ranges first, is dominated by those nodes). If
        another choice is better there, it is taken, each float node it makes unnecessary is quantized
        again, and bias correction is redone. Updates ``calibration`` and ``decisions``; returns the
        statistics in force."""
        from tasks.quantize._calibrate import AUTO_CANDIDATES, PER_TENSOR, with_ranges

        wr, float_nodes = decisions["weight_range"], set(decisions["float_nodes"])

        def use(method: str) -> dict[str, dict]:
            calibration.tensors = with_ranges(auto_stats, method)
            calibration.weight_clip = "mse" if method in (PER_TENSOR, "mse") else "max"
            calibration.bias_corrections = {}
            return calibration.tensors

        def check(nodes: set[str], name: str, by: Any = checker):
            c = by.check(build(wr, nodes)[1], name)
            return c if c.scored else None

        saved = (calibration.tensors, calibration.weight_clip, calibration.bias_corrections)
        errors: dict[str, float | None] = {}
        for method in (PER_TENSOR, *AUTO_CANDIDATES):
            use(method)
            c = check(float_nodes, f"ranges_{method}_recovered")
            errors[method] = c.verdict.error if c else None
        ranges["with_float_nodes"] = errors
        usable = {k: v for k, v in errors.items() if v is not None}
        best = min(usable, key=lambda k: usable[k]) if usable else ranges["chosen"]
        if best == ranges["chosen"]:
            calibration.tensors, calibration.weight_clip, calibration.bias_corrections = saved
            return saved[0]
        log.info("quantize: auto ranges with the %d float nodes: %s (held-out error %s)", len(float_nodes), best,
                 ", ".join(f"{k} {_num(v)}" for k, v in errors.items()))
        stats = use(best)
        ranges.update(chosen=best, weight_clip=calibration.weight_clip, rechosen_after_recovery=True)
        final = check(float_nodes, "ranges_final")
        for n in sorted(float_nodes - set(decisions["unsupported_nodes"]) - set(decisions["fidelity_culprits"])):
            c = check(float_nodes - {n}, "ranges_requantize", strict)  # recovery's margin holds here too
            if c is not None and c.verdict.ok:
                float_nodes.discard(n)
                final = check(float_nodes, "ranges_requantized")
                log.info("quantize: %s quantized again: %s", n, c.verdict.what)
        decisions["float_nodes"] = sorted(float_nodes)
        if fix_bias is not None and final is not None:
            bias, corrected = fix_bias(wr, float_nodes, checker, final)
            decisions["bias_correction"] = bias
            final = corrected or final
        if final is not None:
            decisions["accuracy"] = final.verdict.to_dict()
        return stats

    @staticmethod
    def _log_rules(model: onnx.ModelProto, plan, rules: dict[str, NodeDtypes], act_type: str) -> None:
        ops = {n.name: n.op_type for n in iter_nodes(model.graph, QUANTIZED_BODIES)}
        wd = {w.node: w.dtype for p in plan.walk() for w in p.weights}
        for name, why in {k: v for p in plan.walk() for k, v in p.skipped.items()}.items():
            log.info("  %s (%s) left float: %s", name, ops.get(name, "?"), why)
        for name, rule in plan.quantized_nodes().items():
            r = rules.get(name)
            acts = r.activations if r else "?"
            if acts == "int8" and act_type == "uint8":
                acts = "uint8 (int8 rule, ORT asymmetric activations)"
            log.info("  %s (%s) <- %s: weights %s, activations %s", name, ops.get(name, "?"), rule,
                     wd.get(name, "none"), acts)
