"""The autotune stage: Q/DQ placement chosen by measured latency, in region or subgraph mode.

Inputs: export's float model (the baseline every speedup is against), quantize's float_model.onnx
(the graph Q/DQ go into), calibration.json (Q/DQ get calibrated scales; a default scale only where a
tensor has no statistics, with a warning) and quantized_model.onnx as QDQ baseline
(``autotune.qdq_baseline`` overrides it). ``_setup`` builds what both modes share once (a
``TuneSetup``); ``_region`` or ``_subgraph`` tunes (a ``ModeResult``); ``guard.finalize`` decides
what ships as optimized_final.onnx. Outputs: COMMON_OUTPUTS plus MODE_OUTPUTS[mode].
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.accuracy.budget import AccuracyBudget
from pipeline.accuracy.holdout import Holdout
from pipeline.artifacts import fingerprint, sha256_file, user_path
from pipeline.backends import Backend, activation_type, create_backend, placement_kind
from pipeline.errors import InputError, StageError, first_line
from pipeline.graph.model import (
    input_specs,
    load_model,
    model_hash,
    remove_model,
    save_model,
    write_model_bytes,
)
from pipeline.quant.calibration import Calibration, activation_dtypes, load_calibration
from pipeline.quant.placement import resolve_rules
from pipeline.records.autotune import ModeSummary
from pipeline.records.quantize import quantize_decisions
from pipeline.stage import Stage, StageContext, StageResult
from pipeline.values import enum_value, section
from tasks.autotune.config import PRESETS
from tasks.autotune.guard import checked_where, finalize
from tasks.autotune.progress import ProgressBars
from tasks.autotune.runtime.search import search_runtime
from tasks.autotune.tune_setup import ModeResult, TuneRuns, TuneSetup, float_baseline

log = logging.getLogger("tune.autotune")


def _node_filters(entries: list[str]) -> list[str]:
    """Wildcards from the config; an entry naming an existing file contributes its lines."""
    out: list[str] = []
    for e in entries:
        p = user_path(e)
        if p.is_file():
            out += [ln.strip() for ln in p.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
        else:
            out.append(e)
    return out


def settings(cfg: DictConfig) -> tuple[int, int, int]:
    """(schemes_per_region, warmup_runs, timing_runs): the preset, overridden by explicit keys."""
    a = cfg.autotune
    s, w, t = PRESETS[enum_value(a.preset)]
    return (a.schemes_per_region or s, a.warmup_runs if a.warmup_runs is not None else w,
            a.timing_runs or t)


def quant_type_of(cfg: DictConfig) -> str:
    """autotune.quant_type, defaulting from the quantize stage's first rule."""
    if cfg.autotune.quant_type is not None:
        return enum_value(cfg.autotune.quant_type)
    for rule in cfg.quantize.layers:
        dt = enum_value(rule.activations.dtype)
        if dt != "native":
            return "fp8" if dt.startswith("fp8") else "int8"
    return "int8"


# artifacts every run writes, and each mode's own (declared here, checked at the end of a run)
COMMON_OUTPUTS = ("autotune/optimized_final.onnx", "autotune/baseline.onnx")
MODE_OUTPUTS = {
    "region": ("autotune/autotuner_state.yaml",),  # + autotuner_state_pattern_cache.yaml once one pattern is done
    "subgraph": ("autotune/optimized_raw.onnx", "autotune/autotune_cache.json", "autotune/report.md"),
}


class AutotuneStage(Stage):
    name = "autotune"
    inputs = ("export/model.onnx",)
    # quantize/float_model.onnx: the float graph after quantize's float-exact transforms (equalization,
    # outlier smoothing), the one calibration.json describes; Q/DQ go into it, timing is against export's
    optional_inputs = ("quantize/calibration.json", "quantize/quantized_model.onnx", "quantize/float_model.onnx")
    outputs = COMMON_OUTPUTS
    config_keys = ("autotune", "accuracy", "backend", "quantize", "seed", "target")
    tunes = True

    def run(self, ctx: StageContext) -> StageResult:
        mode = enum_value(ctx.cfg.autotune.mode)
        setup = self._setup(ctx)
        result = (self._region if mode == "region" else self._subgraph)(ctx, setup)
        guarded = finalize(setup, result)
        runtime_artifacts, runtime = search_runtime(setup, ctx.cfg.autotune.runtime)
        final = guarded.accuracy.final
        metrics = replace(guarded, runtime=runtime.to_dict(), headline=guarded.headline + runtime.headline(),
                          checked_on=checked_where(setup, final, guarded.shipped == "float", runtime_artifacts).to_dict())
        if result.report is not None:
            result.report(metrics)
        remove_model(result.tuned)
        artifacts = {"autotune/optimized_final.onnx": setup.out / "optimized_final.onnx",
                     "autotune/baseline.onnx": setup.baseline_path, **result.artifacts, **runtime_artifacts}
        missing = [k for k in (*COMMON_OUTPUTS, *MODE_OUTPUTS[mode]) if k not in artifacts]
        if missing:
            raise StageError(f"autotune ({mode} mode) did not write {', '.join(missing)}")
        return StageResult(artifacts, metrics)

    def _setup(self, ctx: StageContext) -> TuneSetup:
        """The float baseline, calibration, tuner config, accuracy holdout and resume context."""
        cfg = ctx.cfg
        out = ctx.stage_dir("autotune")
        inputs = self.resolve_inputs(ctx)
        model = load_model(inputs["export/model.onnx"])
        backend = create_backend(cfg.backend)
        quant_type = quant_type_of(cfg)
        if not backend.has_fast_kernels(quant_type):
            log.warning("backend %s has no fast %s kernels: tuning can only find that fewer Q/DQ is faster. "
                        "Use a backend that runs %s (e.g. backend=tensorrt on an Ada/Hopper GPU for fp8, "
                        "backend=onnxruntime for int8)", backend.name, quant_type, quant_type)
        schemes, warmup, timing = settings(cfg)
        calibration = self._calibration(inputs, cfg.autotune, load_calibration)
        missing = calibration.missing_dtypes(activation_dtypes(cfg))
        if missing:
            raise StageError(f"autotune: quantize/calibration.json has no {' or '.join(missing)} ranges (quantize "
                             f"calibrates the dtypes its run can store): run `stages=[quantize,autotune]` so "
                             f"quantize calibrates them for this autotune.quant_type")
        config = self._tuner_config(cfg, model, inputs, quant_type, schemes)
        baseline_path = out / "baseline.onnx"
        save_model(model, baseline_path)
        if "quantize/float_model.onnx" in inputs:
            model = load_model(inputs["quantize/float_model.onnx"])
        # candidates are held to the budget itself: its confidence bound already demands more of a
        # verdict on few samples (quantize's recovery margin would leave the PTQ model no room)
        budget = AccuracyBudget.from_config(cfg)
        # quantize warned already when the holdout is small
        holdout = Holdout.from_config(cfg, input_specs(model), warn="quantize/calibration.json" not in inputs,
                                      model=model)
        backend, baseline = float_baseline(backend, baseline_path, holdout, budget, out / "float_baseline.json")
        log.info("autotune: every candidate is held to the accuracy budget (%s) on %d samples of %s",
                 budget.describe(), holdout.samples, holdout.source)
        qdq_baseline = self._qdq_baseline(ctx, inputs)
        context_items = {
            "calibration": sha256_file(inputs["quantize/calibration.json"]) if "quantize/calibration.json" in inputs
            else None,
            "qdq_baseline": model_hash(qdq_baseline) if qdq_baseline is not None else None,
            "backend": section(cfg, "backend"), "activation_type": config.activation_type,
            "default_dq_dtype": config.default_dq_dtype, "node_filter_list": config.node_filter_list,
            "node_dtypes": sorted((k, v.weights, v.activations) for k, v in (config.node_dtypes or {}).items()),
            "weight_range": config.weight_range, "float_nodes": config.float_nodes,
            "accuracy": section(cfg, "accuracy"),
        }
        if baseline.verdict is not None or baseline.fp32_ratio is not None:  # the float was chosen: its
            context_items["float_precision"] = baseline.precision  # precision is part of the search
        return TuneSetup(out, inputs, model, backend, config, calibration, budget, holdout, baseline_path,
                         qdq_baseline, context_items, TuneRuns(schemes, warmup, timing, 4),
                         float(cfg.autotune.performance_threshold), baseline)

    @staticmethod
    def _tuner_config(cfg: DictConfig, model: Any, inputs: dict[str, Path], quant_type: str, schemes: int) -> Any:
        """The autotuner's Config: the autotune keys plus what the quantize stage decided."""
        from tasks.autotune.region.autotuner import SHARED_FIELDS, Config

        a = cfg.autotune
        decisions = quantize_decisions(inputs.get("quantize/calibration.json"))
        rules = resolve_rules(model, cfg.quantize.layers, cfg.quantize.skip_names, cfg.quantize.op_types_to_quantize)
        node_dtypes = None if a.quant_type is not None else rules
        if node_dtypes is not None and not node_dtypes:
            raise StageError("autotune: the quantize rules leave every node float (quantize=none?); set "
                             "autotune.quant_type=int8 to tune anyway")
        if decisions.all_float:
            log.info("autotune: the quantize stage left every quantizable node float to meet the accuracy budget; "
                     "nothing to place, the float model ships unless a measured candidate says otherwise")
        elif decisions.weight_range != "full" or decisions.float_nodes:
            log.info("autotune: following the quantize stage: %s weights%s", decisions.weight_range,
                     f", {len(decisions.float_nodes)} nodes float" if decisions.float_nodes else "")
        return Config(
            **{k: a[k] for k in SHARED_FIELDS},
            default_quant_type=quant_type, default_dq_dtype=enum_value(a.default_dq_dtype),
            schemes_per_region=schemes, placement=placement_kind(cfg).name,
            activation_type=activation_type(cfg) if quant_type == "int8" else "int8",
            seed=int(cfg.seed), node_filter_list=_node_filters(list(a.node_filter_list)), node_dtypes=node_dtypes,
            weight_range=decisions.weight_range, float_nodes=list(decisions.float_nodes),
        )

    def _region(self, ctx: StageContext, setup: TuneSetup) -> ModeResult:
        """Region mode (tasks/autotune/region/workflow.py): pattern search on the full model, every
        candidate measured against a live float baseline."""
        from tasks.autotune.region.workflow import (
            SearchSession,
            init_benchmark_instance,
            region_pattern_autotuning_workflow,
        )

        a, out, config = ctx.cfg.autotune, setup.out, setup.config
        runs = setup.runs
        bench = init_benchmark_instance(setup.backend, setup.baseline_path, runs.warmup_runs, runs.timing_runs,
                                        runs.rounds, setup.accuracy_check, setup.crash_guard)
        first = bench.measure(setup.baseline_path, use_cache=False)  # fails fast if the backend cannot measure here
        if not first.ok:
            raise StageError(f"autotune: cannot measure the float model on {setup.backend.name}: {first.error}")
        pattern_cache = None
        if a.pattern_cache:
            from tasks.autotune.region.pattern_cache import PatternCache

            pattern_cache = PatternCache.load(user_path(a.pattern_cache), config.pattern_cache_minimum_distance,
                                              config.pattern_cache_max_entries_per_pattern)
            log.info("warm start: %d patterns from %s", pattern_cache.num_patterns, a.pattern_cache)
        state_file = str(user_path(a.state_file)) if a.state_file else None
        with ProgressBars(bool(ctx.cfg.progress)) as bars:
            session = SearchSession(state_file, fingerprint(setup.context_items), bars,
                                    pattern_cache=pattern_cache, qdq_baseline=setup.qdq_baseline)
            tuner = region_pattern_autotuning_workflow(setup.model, out, bench, config, setup.calibration, session)
        self._warn_defaulted(setup)
        tuned = out / "optimized_tuned.onnx"
        save_model(tuner.export_model(), tuned)
        state = Path(state_file) if state_file else out / "autotuner_state.yaml"
        artifacts = {"autotune/autotuner_state.yaml": state}
        cache_file = state.with_name(f"{state.stem}_pattern_cache.yaml")
        if cache_file.exists():
            artifacts["autotune/autotuner_state_pattern_cache.yaml"] = cache_file
        summary = self._summary(setup, "region", tuner.num_measurements, tuner.num_measurements, dict(
            regions=len(tuner.regions), patterns=tuner.num_patterns, benchmark_runs=bench.count,
            schemes_per_region=runs.schemes_per_region,
            over_budget_candidates=sum(1 for ps in tuner.pattern_schemes.values() for r in ps.records
                                       for m in r.measurements if m.over_budget)))
        return ModeResult(tuned, summary, artifacts, bench=bench)

    def _subgraph(self, ctx: StageContext, setup: TuneSetup) -> ModeResult:
        """Subgraph mode (tasks/autotune/subgraph/): fusion groups, per-group profiling of
        extracted subgraphs, incremental validation on the full model."""

        from tasks.autotune.subgraph.driver import subgraph_autotuning_workflow
        from tasks.autotune.subgraph.report import write_group_report

        cfg, a, out = ctx.cfg, ctx.cfg.autotune, setup.out
        t0 = time.time()
        groups, graph_json, source = self._fusion_groups(cfg, setup)
        log.info("autotune: %d fusion groups from %s", len(groups), source)
        context = fingerprint({**setup.context_items, "mode": "subgraph", "groups": source,
                               "graph_json": sha256_file(graph_json) if graph_json is not None else None})
        with ProgressBars(bool(cfg.progress)) as bars:
            result = subgraph_autotuning_workflow(setup, groups, context, bool(a.incremental_validation), bars)
        raw = self._check_raw(setup.backend, out / "optimized_raw.onnx", setup.judge)
        tuned = out / "optimized_tuned.onnx"
        if result.tuned is not None:  # byte for byte the model phase 3 measured
            write_model_bytes(result.tuned, tuned)
        else:
            save_model(result.tuner.export_model(assignment=result.assignment), tuned)
        summary = self._summary(setup, "subgraph", result.measurements, result.full_model_measurements, dict(
            fusion_groups=len(groups), groups=result.groups, distinct_groups=result.keys,
            subgraph_measurements=result.measurements - result.full_model_measurements,
            kept_groups=sum(1 for g in result.report if g["validation"] == "kept"),
            tuning_seconds=round(time.time() - t0, 1), incremental_validation=bool(a.incremental_validation),
            group_report=result.report, phases=result.phases, steps=result.step_report, raw=raw))
        artifacts = {k: out / Path(k).name for k in MODE_OUTPUTS["subgraph"]}
        if graph_json is not None and graph_json.parent == out:
            artifacts[f"autotune/{graph_json.name}"] = graph_json
        return ModeResult(tuned, summary, artifacts, report=lambda m: write_group_report(out / "report.md", m),
                          steps=result.steps)

    @staticmethod
    def _summary(setup: TuneSetup, mode: str, measurements: int, full_model_measurements: int,
                 details: dict[str, Any]) -> ModeSummary:
        """The mode's part of autotune's metrics: its counts, its own ``details`` and what both modes tuned with."""
        c = setup.config
        return ModeSummary(mode, measurements, full_model_measurements, details, quant_type=c.default_quant_type,
                           placement=c.placement, budget=setup.budget.describe(), weight_range=c.weight_range,
                           float_nodes=c.float_nodes, defaulted_scales=len(setup.calibration.defaulted))

    @staticmethod
    def _warn_defaulted(setup: TuneSetup) -> None:
        if setup.calibration.defaulted:
            log.warning("autotune: %d tensors had no calibration statistics and use the default scale %.3g: "
                        "run the quantize stage first for calibrated scales", len(setup.calibration.defaulted),
                        setup.config.default_q_scale)

    @staticmethod
    def _check_raw(backend: Backend, path: Path, judge) -> dict[str, Any]:
        """optimized_raw.onnx (every local winner, unvalidated) is run once and judged on the held-out
        batches, so its report line says whether it loads, runs and meets the budget."""
        try:
            with backend.prepare(path) as pm:
                verdict = judge(pm)
        except Exception as exc:  # noqa: BLE001 - reported, not shipped
            log.warning("autotune: optimized_raw.onnx does not run on %s: %s", backend.name, first_line(exc))
            return {"runs": False, "error": first_line(exc)}
        if not verdict.ok:
            log.warning("autotune: optimized_raw.onnx (all local winners, unvalidated) misses the accuracy budget: %s",
                        verdict.what)
        return {"runs": True, "accuracy": verdict.to_dict()}

    @staticmethod
    def _fusion_groups(cfg: DictConfig, setup: TuneSetup):
        """Phase 1: (groups, graph JSON used or written, description of the source).

        autotune.graph_json names a TensorRT layer-information file; without it, the groups are what the
        backend reports it fuses (``Backend.fusion_source``: ONNX Runtime's optimized graph, OpenVINO's
        runtime graph, the layers of one TensorRT float build)."""
        from tasks.autotune.subgraph.fusion_grouping import layer_fusion_groups, map_fusions

        a = cfg.autotune
        backend, model_path, model, out = setup.backend, setup.baseline_path, setup.model, setup.out
        name = setup.inputs["export/model.onnx"].stem
        if a.graph_json:
            path = user_path(a.graph_json)
            if not path.is_file():
                raise InputError(f"autotune.graph_json={a.graph_json}: no such file (write one with trtexec "
                                 f"--onnx=MODEL --exportLayerInfo=graph.json --profilingVerbosity=detailed)")
            try:
                info = json.loads(path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise InputError(f"autotune.graph_json={a.graph_json} is not JSON ({first_line(exc)})") from None
            if not isinstance(info, (dict, list)):
                raise InputError(f"autotune.graph_json={a.graph_json} is not TensorRT layer information (expected "
                                 f"an object with 'Layers', as trtexec --exportLayerInfo writes)")
            groups = layer_fusion_groups(model, info)
            if not groups:
                raise InputError(f"autotune.graph_json={a.graph_json} names none of this model's nodes in its layers' "
                                 f"metadata: export it with --profilingVerbosity=detailed from this model")
            return groups, path, f"{path.name} (TensorRT layer information)"
        source = backend.fusion_source(model_path, out, name)
        groups = layer_fusion_groups(model, source.layers) if source.layers is not None else \
            map_fusions(model, source.optimized)
        return groups, source.path, source.description

    @staticmethod
    def _calibration(inputs: dict[str, Path], a: DictConfig, load_calibration) -> Calibration:
        path = inputs.get("quantize/calibration.json")
        if path is None:
            log.warning("autotune: no quantize/calibration.json; Q/DQ get the placeholder scale %.3g, so the tuned "
                        "model's accuracy is meaningless. Run stages=[quantize,autotune] for calibrated scales",
                        float(a.default_q_scale))
            return Calibration(default_scale=float(a.default_q_scale), default_zero_point=float(a.default_q_zero_point))
        return load_calibration(path, float(a.default_q_scale), float(a.default_q_zero_point))

    @staticmethod
    def _qdq_baseline(ctx: StageContext, inputs: dict[str, Path]):
        a = ctx.cfg.autotune
        if not a.import_qdq_baseline:
            return None
        if a.qdq_baseline:
            return load_model(user_path(a.qdq_baseline), what="autotune.qdq_baseline")
        p = inputs.get("quantize/quantized_model.onnx")
        return load_model(p) if p is not None else None
