"""The quantize stage: calibrate every Q/DQ candidate tensor, then write the default placement.

Outputs: quantize/calibration.json (statistics and scale/zero point per dtype for every candidate
activation, per-channel scales for every weight) and quantize/quantized_model.onnx (the "PTQ" model:
Q/DQ placed for the configured backend's fusions, with per-node dtypes from `quantize.layers`).

A run (``QuantizeStage.run``) is setup (``_setup.QuantizeSetup``) -> the float-exact transforms and
calibration (``pipeline.calibrate.collect``; what is kept is chosen in ``_held_out``) -> the decisions on the
held-out batches (``_decide``) -> writing; ``_placer.Placer`` builds every candidate model on the way.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from omegaconf import DictConfig

from pipeline.accuracy.kinds import checked_on, kind_verdicts, log_kinds
from pipeline.artifacts import atomic_write_json
from pipeline.graph import weights
from pipeline.graph.bodies import QUANTIZED_BODIES, unique_names, walk_views
from pipeline.graph.index import GraphIndex, weight_inputs
from pipeline.graph.model import iter_nodes, load_model, save_model
from pipeline.quant.calibration import Calibration, TensorStats
from pipeline.quant.placement import NodeDtypes, resolve_rules, weight_axis
from pipeline.quant.qdq import qdq_summary
from pipeline.quant.qmath import FP8
from pipeline.records.quantize import QuantizeDecisions, QuantizeMetrics, RangeChoice
from pipeline.stage import Stage, StageContext, StageResult
from pipeline.transforms.record import TransformRecord
from pipeline.values import enum_value
from tasks.quantize._decide import decide
from tasks.quantize._held_out import choose_ranges, keep_transforms, refine_ranges
from tasks.quantize._placer import Placer
from tasks.quantize._setup import QuantizeSetup
from tasks.quantize.passes.sequence import FLOAT_PASSES, PassContext, run_passes, summary, weighed
from tasks.quantize.recovery import outlier_units

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
            w = weights.array(g.inits[name]).astype(np.float32)
            axis = weight_axis(node, i, w.shape)
            rec: dict[str, Any] = {"node": node.name, "op_type": node.op_type, "axis": axis,
                                   "shape": list(w.shape), "absmax": float(np.abs(w).max()) if w.size else 0.0}
            for dt in ("int8", *FP8):
                rec[dt] = {"scale": calibration.weight_params(name, w, axis, dt).scale.tolist(), "zero_point": 0}
            out[name] = rec
    return out


def calibration_document(stats: dict[str, TensorStats], model: onnx.ModelProto, cfg: DictConfig,
                         calibration: Calibration | None = None, batches: int | None = None) -> dict[str, Any]:
    """calibration.json: ``stats`` with scale/zero point per dtype, and the weights' scales as
    ``calibration`` (default: one made from ``stats`` for the configured algorithm) searches them;
    ``batches``: the batches calibrated on (default quantize.calibration.batches; fewer where the
    holdout needed some of them)."""
    if calibration is None:
        calibration = Calibration(stats, weight_clip=Calibration.weight_clip_for(enum_value(cfg.quantize.algorithm)))
    weight_clip = calibration.weight_clip
    tensors = {name: s.with_scales().to_dict() for name, s in stats.items()}
    return {
        "version": 1,
        "algorithm": enum_value(cfg.quantize.algorithm),
        "percentile": float(cfg.quantize.percentile),
        "batches": int(cfg.quantize.calibration.batches) if batches is None else batches,
        "tensors": tensors,
        # how weight scales are searched; load_calibration hands it to apply_plan (autotune's models)
        "weight_clip": weight_clip,
        "weights": weight_records(model, calibration),
    }


@dataclass
class Calibrated:
    """The float graph calibration settled on and its statistics (``QuantizeStage._calibrate``); auto's
    range choice after recovery replaces ``stats`` and ``doc`` (``QuantizeStage._decide``)."""

    model: onnx.ModelProto  # the float graph Q/DQ go into: float_model.onnx
    stats: dict[str, TensorStats]  # in force (auto: those of the chosen ranges)
    auto_stats: dict[str, TensorStats]  # before auto's whole-model range choice, with every candidate threshold
    transforms: list[TransformRecord]
    ranges: RangeChoice | None  # auto's range choice
    calibration: Calibration
    doc: dict[str, Any]  # calibration.json, completed when written
    float_path: Path
    seconds: float
    samples: int
    # auto: the default placement with the chosen ranges, checked by the range choice (its runtime form
    # kept by the checker); the first model the decisions place, unless they change the calibration first
    placed: onnx.ModelProto | None = None


def _sensitivity_chart(sensitivity: dict[str, Any], path: Path) -> Path:
    """The budget was missed: how much of the PTQ model's output error each node removes when it alone
    is left float (recovery's ranking), with the nodes recovery left float marked."""
    from pipeline.accuracy.sensitivity import plot_node_sensitivity

    full = (sensitivity.get("full_placement") or {}).get("snr_db")
    full_nsr = 10 ** (-full / 10) if full is not None else 0.0
    rows = [{"node": r["node"], "op_type": r.get("op_type"), "value": max(full_nsr - r["error_without"], 0.0),
             "label": f"{r['snr_db_without']:.1f} dB with it float" if r.get("snr_db_without") is not None
             else (r.get("error") or "n/a")}
            for r in sensitivity["ranking"] if r.get("error_without") is not None and math.isfinite(r["error_without"])]
    title = ("quantize: the PTQ model misses the accuracy budget; output error removed by leaving each node "
             "alone float" + (f"\n(every node int8: {full:.1f} dB; grey: left float by recovery)" if full is not None
                              else ""))
    return plot_node_sensitivity(rows, path, title, "noise / signal removed", sensitivity.get("float_nodes") or [])


class QuantizeStage(Stage):
    name = "quantize"
    inputs = ("export/model.onnx",)
    # float_model.onnx: the float graph after the float-exact transforms, the one calibration.json
    # describes and autotune places Q/DQ into
    outputs = ("quantize/quantized_model.onnx", "quantize/calibration.json", "quantize/float_model.onnx")
    # autotune.quant_type: fp8 tuning needs fp8 ranges, which calibration searches only when asked
    config_keys = ("quantize", "data", "seed", "backend.name", "accuracy", "autotune.quant_type", "target")
    tunes = True

    def run(self, ctx: StageContext) -> StageResult:
        cfg, q = ctx.cfg, ctx.cfg.quantize
        out_dir = ctx.stage_dir("quantize")
        float_path = ctx.require("export/model.onnx")
        model = load_model(float_path)
        if unique_names(model):  # plans and calibration.json name body nodes and tensors
            log.info("quantize: named the nodes of Loop/Scan bodies (and renamed values sibling bodies share)")
        rules = resolve_rules(model, q.layers, q.skip_names, q.op_types_to_quantize)
        if not rules:
            return self._pass_through(out_dir, model)
        setup = QuantizeSetup.create(cfg, out_dir, float_path, model, rules)
        started = time.monotonic()
        cal = self._calibrate(setup)
        placer = Placer(setup, cal.model, cal.calibration)
        decisions, sensitivity = self._decide(setup, placer, cal, started)
        setup.work.cleanup()
        return self._write(setup, placer, cal, decisions, sensitivity)

    @staticmethod
    def _pass_through(out_dir: Path, model: onnx.ModelProto) -> StageResult:
        log.warning("quantize: no layer rule quantizes anything (quantize=none or empty rules); "
                    "passing the float model through unchanged")
        out_model, out_calib = out_dir / "quantized_model.onnx", out_dir / "calibration.json"
        save_model(model, out_model)
        save_model(model, out_dir / "float_model.onnx")
        atomic_write_json(out_calib, {"version": 1, "algorithm": None, "tensors": {}, "weights": {}})
        return StageResult({"quantize/quantized_model.onnx": out_model, "quantize/calibration.json": out_calib,
                            "quantize/float_model.onnx": out_dir / "float_model.onnx"},
                           QuantizeMetrics(quantized_nodes=0, headline="float model passed through (no quantization)"))

    @staticmethod
    def _calibrate(setup: QuantizeSetup) -> Calibrated:
        """The float-exact transforms, calibration, the transforms kept or not and (auto) the ranges, all
        on the held-out error of the PTQ model; writes float_model.onnx."""
        q = setup.q
        model, transforms = run_passes(setup.model, FLOAT_PASSES,
                                       PassContext(q, setup.batches, setup.backend.threads, setup.act_type))
        weight_clip = Calibration.weight_clip_for(enum_value(q.algorithm))
        t0 = time.time()
        with Placer(setup, model, setup.calibration_of({}, weight_clip)).weights_ahead():
            stats = setup.calibrate(model)
            if model is not setup.model and weighed(transforms):
                model, stats, transforms = keep_transforms(setup, model, stats, transforms, weight_clip)
            ranges, auto_stats, placed = None, stats, None
            if enum_value(q.algorithm) == "auto":
                stats, weight_clip, ranges, placed = choose_ranges(setup, model, stats)
        if setup.lowering is not None:
            transforms.insert(0, setup.lowering)
        float_path = save_model(model, setup.out_dir / "float_model.onnx")
        seconds = time.time() - t0
        calibration = setup.calibration_of(stats, weight_clip)
        doc = calibration_document(stats, model, setup.cfg, calibration, setup.total)
        samples = next(iter(stats.values())).samples if stats else 0
        log.info("calibrated %d tensors on %d samples with %s in %.1f s", len(stats), samples,
                 enum_value(q.algorithm), seconds)
        return Calibrated(model, stats, auto_stats, transforms, ranges, calibration, doc, float_path, seconds, samples,
                          placed)

    @staticmethod
    def _decide(setup: QuantizeSetup, placer: Placer, cal: Calibrated, started: float
                ) -> tuple[QuantizeDecisions, dict[str, Any] | None]:
        """(decisions, sensitivity report or None); with auto ranges and nodes left float, the ranges are
        chosen again for that placement."""
        outliers = outlier_units(cal.model, cal.stats, list(setup.rules), float(setup.q.outlier_threshold))
        decisions, sensitivity = decide(setup, placer, outliers, started, cal.placed)
        if cal.ranges is not None and decisions.float_nodes:
            stats, cal.ranges, decisions = refine_ranges(setup, placer, cal.auto_stats, cal.ranges, decisions)
            cal.stats = stats if stats is not None else cal.stats
            cal.doc = calibration_document(cal.stats, cal.model, setup.cfg, placer.calibration, setup.total)
        return decisions, sensitivity

    def _write(self, setup: QuantizeSetup, placer: Placer, cal: Calibrated, decisions: QuantizeDecisions,
               sensitivity: dict[str, Any] | None) -> StageResult:
        """calibration.json (with ``decisions``), quantized_model.onnx, sensitivity.json; the metrics."""
        out_dir, doc = setup.out_dir, cal.doc
        out_model, out_calib = out_dir / "quantized_model.onnx", out_dir / "calibration.json"
        doc["transforms"] = [t.to_dict() for t in cal.transforms]
        if cal.ranges is not None:
            doc["ranges"] = cal.ranges.to_dict()
        doc["bias_corrections"] = placer.calibration.bias_corrections
        plan, qmodel = placer.build(decisions.weight_range, set(decisions.float_nodes))
        # the Loop/Scan body placement, which autotune keeps (it tunes the main graph)
        doc["bodies"] = {k: p.to_dict() for k, p in plan.bodies.items()}
        decisions = replace(decisions, transforms=cal.transforms, ranges=cal.ranges,
                            body_nodes=sorted(n for p in plan.bodies.values() for n in p.quantized_nodes()),
                            all_float=not plan.quantized_nodes())
        doc["decisions"] = decisions.to_dict()
        atomic_write_json(out_calib, doc)
        save_model(qmodel, out_model, external_data=bool(setup.q.use_external_data_format))
        self._log_rules(cal.model, plan, setup.rules, setup.kind.name)
        counts = qdq_summary(qmodel)
        headline = self._headline(setup, plan, counts, cal, decisions, sensitivity)
        log.info("wrote %s (%s)", out_model, headline)
        artifacts = {"quantize/quantized_model.onnx": out_model, "quantize/calibration.json": out_calib,
                     "quantize/float_model.onnx": cal.float_path}
        if sensitivity is not None:
            artifacts["quantize/sensitivity.json"] = atomic_write_json(out_dir / "sensitivity.json", sensitivity)
            if sensitivity.get("ranking"):
                artifacts["quantize/sensitivity.png"] = _sensitivity_chart(sensitivity, out_dir / "sensitivity.png")
        headline += self._details(plan, cal, decisions)
        metrics = self._metrics(setup, plan, counts, cal, decisions, headline)
        checker = setup.checker
        kinds = kind_verdicts(checker.backend, out_model, checker.holdout, checker.budget, decisions.accuracy,
                              quantized=bool(plan.quantized_nodes())) if setup.kind.cpu_kernels else []
        log_kinds(kinds, "quantize")
        return StageResult(artifacts, replace(metrics, checked_on=checked_on(checker.backend, kinds).to_dict()))

    @staticmethod
    def _headline(setup: QuantizeSetup, plan: Any, counts: dict[str, int], cal: Calibrated,
                  decisions: QuantizeDecisions, sensitivity: dict[str, Any] | None) -> str:
        """What was placed: algorithm, placement, quantized nodes by dtype, Q/DQ counts."""
        dtypes = Counter(a.dtype for p in plan.walk() for a in p.activations) + \
            Counter(w.dtype for p in plan.walk() for w in p.weights)
        quantized = plan.quantized_nodes()
        algorithm = enum_value(setup.q.algorithm) + (f" ({cal.ranges.chosen} ranges)" if cal.ranges else "")
        if quantized:
            return (f"{algorithm} calibration, {setup.kind.name} placement: {len(quantized)} nodes quantized "
                    f"({', '.join(f'{k} x{v}' for k, v in sorted(dtypes.items()))}), "
                    f"{counts['QuantizeLinear']} Q / {counts['DequantizeLinear']} DQ")
        # recovery's last resort: the rules matched, the budget left every node float
        full = (sensitivity or {}).get("full_placement") or {}
        headline = (f"float model: every quantizable node left float to meet the accuracy budget "
                    f"(the {decisions.weight_range}-range int8 placement reached {full.get('what')})")
        log.warning("quantize: %s; quantized_model.onnx is the float model", headline)
        return headline

    @staticmethod
    def _details(plan: Any, cal: Calibrated, decisions: QuantizeDecisions) -> str:
        """The headline's tail: held-out accuracy, weight storage, what improved int8, float nodes."""
        quantized = plan.quantized_nodes()
        in_bodies = len(quantized) - len(plan.node_rules)
        acc = decisions.accuracy
        out = ""
        if acc is not None and quantized:
            out += f"; holdout {acc.what}" + ("" if acc.ok else " OVER BUDGET")
        if decisions.weight_range != "full":
            out += f"; weights {decisions.weight_range}"
        improved = summary(cal.transforms, decisions.bias_correction)
        if improved:
            out += "; " + ", ".join(improved)
        if decisions.float_nodes and quantized:
            out += f"; {len(decisions.float_nodes)} sensitive nodes left float"
        if in_bodies:
            out += f"; {in_bodies} nodes inside Loop/Scan bodies quantized (autotune keeps them as placed)"
        return out

    @staticmethod
    def _metrics(setup: QuantizeSetup, plan: Any, counts: dict[str, int], cal: Calibrated,
                 decisions: QuantizeDecisions, headline: str) -> QuantizeMetrics:
        quantized = plan.quantized_nodes()
        return QuantizeMetrics(
            weight_range=decisions.weight_range, weight_range_reason=decisions.weight_range_reason, cpu=decisions.cpu,
            kernel_fidelity=decisions.kernel_fidelity, accuracy=decisions.accuracy, float_nodes=decisions.float_nodes,
            transforms=[t.to_dict() | {"changes": len(t.changes)} for t in cal.transforms],
            bias_correction=decisions.bias_correction, fidelity_culprits=decisions.fidelity_culprits, ranges=cal.ranges,
            placement=setup.kind.name, activation_type=setup.act_type, calibrated_tensors=len(cal.stats),
            calibration_samples=cal.samples, calibration_seconds=round(cal.seconds, 2),
            quantized_nodes=len(quantized), body_nodes=len(quantized) - len(plan.node_rules), node_rules=quantized,
            quantize_linear=counts["QuantizeLinear"], dequantize_linear=counts["DequantizeLinear"], headline=headline)

    @staticmethod
    def _log_rules(model: onnx.ModelProto, plan, rules: dict[str, NodeDtypes], kind: str) -> None:
        """One INFO line per rule (its nodes counted by op type and weights) and per reason a node was left
        float; every node's decision at DEBUG (calibration.json's `node_rules` keeps them all)."""
        nodes = list(iter_nodes(model.graph, QUANTIZED_BODIES))
        ops = {n.name: n.op_type for n in nodes}
        wd = {w.node: w.dtype for p in plan.walk() for w in p.weights}
        skipped = {k: v for p in plan.walk() for k, v in p.skipped.items()}
        by_reason: dict[str, list[str]] = {}
        for name, why in skipped.items():
            by_reason.setdefault(why, []).append(name)
            log.debug("  %s (%s) left float: %s", name, ops.get(name, "?"), why)
        for why, names in by_reason.items():
            log.info("  left float (%s): %s", why, _some(names))
        # the dtypes the plan gives each node's activation inputs (a runtime's placement may store an
        # int8 rule's activations as asymmetric uint8, or only some ops' as such)
        readers_of: dict[str, list[str]] = {}
        for n in nodes:
            for t in n.input:
                readers_of.setdefault(t, []).append(n.name)
        read: dict[str, set[str]] = {}
        for p in plan.walk():
            for a in p.activations:
                readers = [c[0] for c in a.consumers] if a.consumers is not None else readers_of.get(a.tensor, [])
                for r in readers:
                    read.setdefault(r, set()).add(a.dtype)
        groups: dict[tuple[str, str], Counter] = {}
        for name, rule in plan.quantized_nodes().items():
            r = rules.get(name)
            stored = "/".join(sorted(read.get(name, ()))) or (r.activations if r else "?")
            acts = stored if not (r and r.activations == "int8" and stored == "uint8") else \
                f"uint8 (int8 rule; asymmetric for {kind}'s u8 x s8 kernels)"
            weights_of = wd.get(name)
            groups.setdefault((str(rule), acts), Counter())[
                f"{ops.get(name, '?')} ({'weights ' + weights_of if weights_of else 'no weights'})"] += 1
            log.debug("  %s (%s) <- %s: weights %s, activations %s", name, ops.get(name, "?"), rule,
                      weights_of or "none", acts)
        for (rule, acts), counts in groups.items():
            log.info("  %s: %s; activations %s", rule, ", ".join(f"{n} {k}" for k, n in counts.most_common()), acts)


def _some(names: list[str], shown: int = 4) -> str:
    """Up to `shown` names, then how many more."""
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")
