"""The autotune stage: Q/DQ placement chosen by measured latency, in region or subgraph mode.

Inputs: export's float model (the baseline every speedup is against), quantize's float_model.onnx
(the graph Q/DQ go into), calibration.json (Q/DQ get calibrated scales; a default scale only where a
tensor has no statistics, with a warning) and quantized_model.onnx as QDQ baseline
(``autotune.qdq_baseline`` overrides it). ``_setup`` builds what both modes share once; ``_region``
or ``_subgraph`` tunes; ``_finalize`` guards. Outputs: COMMON_OUTPUTS plus MODE_OUTPUTS[mode].

The shipped optimized_final.onnx is decided by a fresh interleaved measurement of the float model,
the PTQ model and the tuned model (not by the search's best-of-N), or, in subgraph mode, by the
paired steps that already measured these very models (by content hash) when they decide clearly:
it must beat the precision-matched float baseline by ``performance_threshold`` or the float model
ships, and if the PTQ model measures faster than the tuned one, the PTQ model ships. Either way the
stage says so, and the file written is byte for byte the model that was measured.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.accuracy import AccuracyBudget, Holdout
from pipeline.artifacts import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    fingerprint,
    sha256_file,
    user_path,
)
from pipeline.backends import create_backend
from pipeline.calibration import Calibration, load_calibration, quantize_decisions
from pipeline.config import enum_value, section
from pipeline.errors import InputError, StageError, first_line
from pipeline.graph import input_specs, load_model, model_hash, recorded_shapes, save_model
from pipeline.placement import activation_type, placement_kind, resolve_rules
from pipeline.progress import progress_bar
from pipeline.stage import Stage, StageContext, StageResult
from tasks.autotune.config import PRESETS

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


@dataclass(frozen=True)
class TuneSetup:
    """What both modes share, built once per run (see ``AutotuneStage._setup``)."""

    out: Path
    inputs: dict[str, Path]
    model: Any  # the float graph Q/DQ go into (quantize/float_model.onnx, else export's)
    backend: Any
    config: Any  # tasks.autotune.autotuner.Config
    calibration: Calibration
    budget: AccuracyBudget
    holdout: Holdout
    baseline_path: Path  # export's float model: every speedup is against it
    qdq_baseline: Any  # the placement region mode seeds its search with (None: start from no Q/DQ)
    context_items: dict[str, Any]  # what a state file must have been made with to be resumed
    runs: tuple[int, int, int, int]  # schemes_per_region, warmup_runs, timing_runs, rounds
    performance_threshold: float  # the shipped Q/DQ model must beat float by this factor

    def judge(self, prepared: Any) -> Any:
        return self.holdout.score(prepared, self.budget)

    @property
    def accuracy_check(self) -> Any:
        """What candidates are checked with before they are timed (None: budget off)."""
        return self.judge if self.budget.enabled else None


@dataclass
class ModeResult:
    """A mode's tuned model (not yet guarded), its metrics and its own artifacts."""

    tuned: Path
    metrics: dict[str, Any]
    artifacts: dict[str, Path]
    bench: Any = None  # a live benchmark to close before the final measurement
    report: Any = None  # called with the final metrics to write the mode's report
    # the mode's paired full-model measurements (subgraph mode's phase-3 steps), which the guard
    # reuses where they measured the models it compares
    steps: list[dict[str, Any]] | None = None


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
    config_keys = ("autotune", "accuracy", "backend", "quantize", "seed")

    def run(self, ctx: StageContext) -> StageResult:
        mode = enum_value(ctx.cfg.autotune.mode)
        setup = self._setup(ctx)
        result = (self._region if mode == "region" else self._subgraph)(ctx, setup)
        metrics = self._finalize(setup, result)
        metrics.update(result.metrics)
        if result.report is not None:
            result.report(metrics)
        result.tuned.unlink(missing_ok=True)
        artifacts = {"autotune/optimized_final.onnx": setup.out / "optimized_final.onnx",
                     "autotune/baseline.onnx": setup.baseline_path, **result.artifacts}
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
        config = self._tuner_config(cfg, model, inputs, quant_type, schemes)
        baseline_path = out / "baseline.onnx"
        save_model(model, baseline_path)
        if "quantize/float_model.onnx" in inputs:
            model = load_model(inputs["quantize/float_model.onnx"])
        budget = AccuracyBudget.from_config(cfg)
        holdout = Holdout.from_config(cfg, input_specs(model))
        with backend.prepare(baseline_path) as pm:
            holdout.set_reference(pm)
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
        return TuneSetup(out, inputs, model, backend, config, calibration, budget, holdout, baseline_path,
                         qdq_baseline, context_items, (schemes, warmup, timing, 4),
                         float(cfg.autotune.performance_threshold))

    @staticmethod
    def _tuner_config(cfg: DictConfig, model: Any, inputs: dict[str, Path], quant_type: str, schemes: int) -> Any:
        """The autotuner's Config: the autotune keys plus what the quantize stage decided."""
        from tasks.autotune.autotuner import SHARED_FIELDS, Config

        a = cfg.autotune
        decisions = quantize_decisions(inputs.get("quantize/calibration.json"))
        rules = resolve_rules(model, cfg.quantize.layers, cfg.quantize.skip_names, cfg.quantize.op_types_to_quantize)
        node_dtypes = None if a.quant_type is not None else rules
        if node_dtypes is not None and not node_dtypes:
            raise StageError("autotune: the quantize rules leave every node float (quantize=none?); set "
                             "autotune.quant_type=int8 to tune anyway")
        if decisions["all_float"]:
            log.info("autotune: the quantize stage left every quantizable node float to meet the accuracy budget; "
                     "nothing to place, the float model ships unless a measured candidate says otherwise")
        elif decisions["weight_range"] != "full" or decisions["float_nodes"]:
            log.info("autotune: following the quantize stage: %s weights%s", decisions["weight_range"],
                     f", {len(decisions['float_nodes'])} nodes float" if decisions["float_nodes"] else "")
        return Config(
            **{k: a[k] for k in SHARED_FIELDS},
            default_quant_type=quant_type, default_dq_dtype=enum_value(a.default_dq_dtype),
            schemes_per_region=schemes, placement=placement_kind(cfg),
            activation_type=activation_type(cfg) if quant_type == "int8" else "int8",
            seed=int(cfg.seed), node_filter_list=_node_filters(list(a.node_filter_list)), node_dtypes=node_dtypes,
            weight_range=decisions["weight_range"], float_nodes=list(decisions["float_nodes"]),
        )

    def _region(self, ctx: StageContext, setup: TuneSetup) -> ModeResult:
        """Region mode (tasks/autotune/region_workflow.py): pattern search on the full model, every
        candidate measured against a live float baseline."""
        from tasks.autotune.region_workflow import init_benchmark_instance, region_pattern_autotuning_workflow

        a, out, config = ctx.cfg.autotune, setup.out, setup.config
        schemes, warmup, timing, rounds = setup.runs
        bench = init_benchmark_instance(setup.backend, setup.baseline_path, warmup, timing, rounds,
                                        setup.accuracy_check)
        first = bench.measure(setup.baseline_path, use_cache=False)  # fails fast if the backend cannot measure here
        if not first.ok:
            raise StageError(f"autotune: cannot measure the float model on {setup.backend.name}: {first.error}")
        pattern_cache = None
        if a.pattern_cache:
            from tasks.autotune.pattern_cache import PatternCache

            pattern_cache = PatternCache.load(user_path(a.pattern_cache), config.pattern_cache_minimum_distance,
                                              config.pattern_cache_max_entries_per_pattern)
            log.info("warm start: %d patterns from %s", pattern_cache.num_patterns, a.pattern_cache)
        state_file = str(user_path(a.state_file)) if a.state_file else None
        bar = progress_bar(bool(ctx.cfg.progress), total=None, desc="autotune", unit="pattern")

        def on_progress(ev: dict) -> None:
            bar.total = ev["patterns"]
            bar.n = ev["patterns_done"]
            sp = ev.get("best_speedup")
            bar.set_postfix(schemes=ev["measurements"], best=f"{sp:.2f}x" if sp else "-", refresh=False)
            bar.refresh()

        try:
            tuner = region_pattern_autotuning_workflow(
                setup.model, out, bench, config, setup.calibration, pattern_cache, state_file,
                setup.qdq_baseline, on_progress, fingerprint(setup.context_items))
        finally:
            bar.close()
        self._warn_defaulted(setup)
        tuned = out / "optimized_tuned.onnx"
        save_model(tuner.export_model(), tuned)
        state = Path(state_file) if state_file else out / "autotuner_state.yaml"
        artifacts = {"autotune/autotuner_state.yaml": state}
        cache_file = state.with_name(f"{state.stem}_pattern_cache.yaml")
        if cache_file.exists():
            artifacts["autotune/autotuner_state_pattern_cache.yaml"] = cache_file
        metrics = dict(
            mode="region", full_model_measurements=tuner.num_measurements,
            regions=len(tuner.regions), patterns=tuner.num_patterns, measurements=tuner.num_measurements,
            benchmark_runs=bench.count, schemes_per_region=schemes,
            over_budget_candidates=sum(1 for ps in tuner.pattern_schemes.values() for r in ps.records
                                       for m in r.measurements if m.over_budget),
            **self._common_metrics(setup),
        )
        return ModeResult(tuned, metrics, artifacts, bench=bench)

    def _subgraph(self, ctx: StageContext, setup: TuneSetup) -> ModeResult:
        """Subgraph mode (tasks/autotune/subgraph_workflow.py): fusion groups, per-group profiling of
        extracted subgraphs, incremental validation on the full model."""
        import time

        from tasks.autotune.subgraph_workflow import subgraph_autotuning_workflow

        cfg, a, out = ctx.cfg, ctx.cfg.autotune, setup.out
        _, warmup, timing, rounds = setup.runs
        t0 = time.time()
        groups, graph_json, source = self._fusion_groups(cfg, setup)
        log.info("autotune: %d fusion groups from %s", len(groups), source)
        context = fingerprint({**setup.context_items, "mode": "subgraph", "groups": source,
                               "graph_json": sha256_file(graph_json) if graph_json is not None else None})
        with _PhaseBars(bool(cfg.progress)) as bars:
            result = subgraph_autotuning_workflow(
                setup.model, out, setup.backend, groups, setup.config, setup.calibration, warmup, timing, rounds,
                setup.accuracy_check, shapes={**setup.backend.opt_shapes(), **recorded_shapes(setup.model)},
                incremental_validation=bool(a.incremental_validation), context=context, on_progress=bars.update,
                float_model=setup.baseline_path, ptq_model=setup.inputs.get("quantize/quantized_model.onnx"))
        raw = self._check_raw(setup.backend, out / "optimized_raw.onnx", setup.judge)
        tuned = out / "optimized_tuned.onnx"
        if result.tuned is not None:  # byte for byte the model phase 3 measured
            atomic_write_bytes(tuned, result.tuned)
        else:
            save_model(result.tuner.export_model(assignment=result.assignment), tuned)
        metrics = dict(
            mode="subgraph", fusion_groups=len(groups), groups=result.groups, distinct_groups=result.keys,
            measurements=result.measurements, full_model_measurements=result.full_model_measurements,
            subgraph_measurements=result.measurements - result.full_model_measurements,
            kept_groups=sum(1 for g in result.report if g["validation"] == "kept"),
            tuning_seconds=round(time.time() - t0, 1), incremental_validation=bool(a.incremental_validation),
            group_report=result.report, phases=result.phases, steps=result.step_report, raw=raw,
            **self._common_metrics(setup),
        )
        artifacts = {k: out / Path(k).name for k in MODE_OUTPUTS["subgraph"]}
        if graph_json is not None and graph_json.parent == out:
            artifacts[f"autotune/{graph_json.name}"] = graph_json
        return ModeResult(tuned, metrics, artifacts, report=lambda m: write_group_report(out / "report.md", m),
                          steps=result.steps)

    @staticmethod
    def _common_metrics(setup: TuneSetup) -> dict[str, Any]:
        c = setup.config
        return dict(quant_type=c.default_quant_type, placement=c.placement, budget=setup.budget.describe(),
                    weight_range=c.weight_range, float_nodes=c.float_nodes,
                    defaulted_scales=len(setup.calibration.defaulted))

    @staticmethod
    def _warn_defaulted(setup: TuneSetup) -> None:
        if setup.calibration.defaulted:
            log.warning("autotune: %d tensors had no calibration statistics and use the default scale %.3g: "
                        "run the quantize stage first for calibrated scales", len(setup.calibration.defaulted),
                        setup.config.default_q_scale)

    @staticmethod
    def _check_raw(backend, path: Path, judge) -> dict[str, Any]:
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

        autotune.graph_json names a TensorRT layer-information file; without it, ONNX Runtime groups
        come from its own optimized graph, TensorRT groups from one float build of the model
        (``<model>.<precision>.graph.json`` in the autotune folder, reused when present)."""
        import json

        from pipeline.backends.trt_common import parse_layer_info
        from tasks.autotune.fusion_grouping import ort_fusion_groups, trt_fusion_groups

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
            groups = trt_fusion_groups(model, info)
            if not groups:
                raise InputError(f"autotune.graph_json={a.graph_json} names none of this model's nodes in its layers' "
                                 f"metadata: export it with --profilingVerbosity=detailed from this model")
            return groups, path, f"{path.name} (TensorRT layer information)"
        if backend.name == "onnxruntime":
            return ort_fusion_groups(model), None, "ONNX Runtime's optimized graph"
        precision = str(backend.cfg.get("float_precision", "FP16")).lower()
        path = out / f"{name}.{precision}.graph.json"
        if not path.exists():
            info = backend.layer_info(model_path)
            if not info or not info.get("layers"):
                raise StageError(f"autotune: {backend.name} gave no layer information for {model_path.name}; pass "
                                 f"autotune.graph_json=PATH (trtexec --onnx=MODEL --exportLayerInfo=graph.json "
                                 f"--profilingVerbosity=detailed)")
            atomic_write_json(path, {"Layers": info["layers"], "Bindings": info.get("io_tensors", [])}, indent=1)
        return trt_fusion_groups(model, parse_layer_info(json.loads(path.read_text()), path.name)), path, \
            f"{path.name} ({backend.name} {precision.upper()} build)"

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

    def _finalize(self, setup: TuneSetup, result: ModeResult) -> dict[str, Any]:
        """The float, PTQ and tuned models' timings and accuracy verdicts (from the mode's own paired
        steps when they measured these very models and decide clearly, else from one fresh
        interleaved measurement); ship the fastest model that meets the budget and beats float by
        ``performance_threshold``, else the float model."""
        if result.bench is not None:
            result.bench.close()  # free the search's live reference before the final comparison
        baseline, tuned, ptq = setup.baseline_path, result.tuned, setup.inputs.get("quantize/quantized_model.onnx")
        paths = [baseline, tuned] + ([ptq] if ptq is not None and model_hash(ptq) != model_hash(tuned) else [])
        timings, verdicts, source = self._from_steps(setup, paths, result.steps) if result.steps else (None, None, "")
        guard = {"measured": timings is None, "why": source}
        if timings is None:
            timings, verdicts = self._measure_final(setup, paths)
            source = f"p10 of {timings[1].n} interleaved runs"
            guard["why"] = ("measured float, tuned" + (" and PTQ models" if len(paths) > 2 else " models")
                            + f" in one interleaved run ({guard['why'] or 'no paired steps to reuse'})")
        choice, why = self._choose(setup, paths, timings, verdicts)
        if choice == baseline and quantize_decisions(setup.inputs.get("quantize/calibration.json"))["all_float"]:
            why = "the quantize stage left every quantizable node float to meet the accuracy budget"
        base_t, tuned_t = timings[0], timings[1]
        ptq_t = timings[2] if len(timings) > 2 and timings[2].ok else None
        ptq_v = verdicts[2] if len(verdicts) > 2 else None
        chosen_t = timings[paths.index(choice)]
        chosen_v = verdicts[paths.index(choice)]
        atomic_write_bytes(setup.out / "optimized_final.onnx", choice.read_bytes())
        speedup = base_t.p10_ms / chosen_t.p10_ms
        backend = setup.backend
        # the CPU EP runs float models in FP32; TensorRT backends build them at backend.float_precision
        precision = "FP32" if backend.name == "onnxruntime" else str(backend.cfg.get("float_precision", "FP32")).upper()
        line = (f"Baseline: {base_t.p10_ms:.3f} ms / Final: {chosen_t.p10_ms:.3f} ms ({speedup:.2f}x speedup), "
                f"accuracy {chosen_v.what} [{source}; baseline = {precision} float model on {backend.name}]")
        log.info(line)
        if choice != tuned:
            log.warning("autotune: optimized_final.onnx is %s because %s", choice.name, why)
        shipped = {baseline: "float", tuned: "tuned", ptq: "ptq"}.get(choice, "tuned")
        return {
            "baseline_ms": base_t.p10_ms, "final_ms": chosen_t.p10_ms, "speedup": speedup,
            "baseline_median_ms": base_t.median_ms, "final_median_ms": chosen_t.median_ms,
            "tuned_ms": tuned_t.p10_ms, "tuned_speedup": base_t.p10_ms / tuned_t.p10_ms,
            "ptq_ms": ptq_t.p10_ms if ptq_t else None,
            "ptq_speedup": (base_t.p10_ms / ptq_t.p10_ms) if ptq_t else None,
            "accuracy": {"final": chosen_v.to_dict(), "tuned": verdicts[1].to_dict(),
                         "ptq": ptq_v.to_dict() if ptq_v is not None else None},
            "shipped": shipped, "shipped_reason": why, "guard": guard,
            "baseline_precision": precision, "runtime": backend.describe(), "final_line": line,
            "headline": f"{speedup:.2f}x vs {precision} float, {chosen_v.what} ({shipped if choice == tuned else why})",
        }

    @staticmethod
    def _from_steps(setup: TuneSetup, paths: list[Path], steps: list[dict[str, Any]]
                    ) -> tuple[list[Any] | None, list[Any] | None, str]:
        """(timings, verdicts, where they come from) of ``paths`` (float, tuned[, PTQ]) from the mode's
        paired steps, or (None, None, why not).

        The kept steps chain paired ratios from the float model to the tuned one (each step's
        reference is the previous one's candidate, by content hash); the PTQ model is on that chain
        or was measured against the float model. Latencies are the float model's times the chained
        ratio. Reused only when the chain's interval clears (or misses) the performance threshold.
        """
        from pipeline.accuracy import AccuracyVerdict
        from pipeline.backends import Timing
        from tasks.autotune.benchmark import chain_interval

        shas = [model_hash(p) for p in paths]
        ratio: dict[str, float] = {shas[0]: 1.0}
        rounds: dict[str, list[list[float]]] = {shas[0]: []}
        via: dict[str, list[int]] = {shas[0]: []}
        verdict: dict[str, Any] = {shas[0]: AccuracyVerdict(True, "reference", "the float model itself")}
        float_ms = None
        for st in steps:
            ref, cand = st.get("reference_sha"), st.get("candidate_sha")
            if not st["measured"] or ref not in ratio or cand in ratio or (not st["kept"] and cand not in shas):
                continue
            if st["accuracy"] is not None:
                verdict[cand] = AccuracyVerdict(**st["accuracy"])
            if st["ratio"] is None:
                continue  # over the budget: a verdict, no timing
            float_ms = float_ms or (st["reference_ms"] / ratio[ref])
            ratio[cand] = ratio[ref] * st["ratio"]
            rounds[cand] = [*rounds[ref], st["round_ratios"]]
            via[cand] = [*via[ref], st["index"]]
        if shas[1] not in ratio:
            return None, None, "the paired steps do not reach the tuned model from the float model"
        if any(sh not in ratio and sh not in verdict for sh in shas[2:]):
            return None, None, "the PTQ model was not measured against the float model"
        if float_ms is None:
            return None, None, "no paired step measured the float model"
        low, high = chain_interval(rounds[shas[1]])
        if low < 1.0 / setup.performance_threshold < high:
            return None, None, (f"the paired steps put the tuned model at {ratio[shas[1]]:.3f}x the float latency "
                                f"(95% interval {low:.3f}-{high:.3f}), too close to the performance threshold")
        timings = [Timing(median_ms=float_ms * ratio[sh], p10_ms=float_ms * ratio[sh],
                          n=sum(len(r) for r in rounds[sh]), backend=setup.backend.name) if sh in ratio
                   else Timing.failed(setup.backend.name, "not timed: over the accuracy budget") for sh in shas]
        verdicts = []
        for p, sh in zip(paths, shas, strict=True):
            if sh not in verdict:  # the accuracy budget is off (the steps judged nothing), or a build failed
                try:
                    with setup.backend.prepare(p) as pm:
                        verdict[sh] = setup.judge(pm)
                except Exception as exc:  # noqa: BLE001 - the fresh measurement reports it
                    return None, None, f"{p.name} could not be judged ({first_line(exc)})"
            verdicts.append(verdict[sh])
        used = sorted({i for sh in shas if sh in via for i in via[sh]})
        return timings, verdicts, (f"reused phase-3 paired step{'s' if len(used) != 1 else ''} "
                                   f"{', '.join(map(str, used)) or '(none: the tuned model is the float model)'}"
                                   f"; ratios chained from the float model, not measured again")

    @staticmethod
    def _measure_final(setup: TuneSetup, paths: list[Path]) -> tuple[list[Any], list[Any]]:
        """Timings (one interleaved run) and accuracy verdicts of ``paths``; the float baseline and the
        tuned model must both be measurable."""
        from pipeline.backends.base import compare_prepared

        backend = setup.backend
        _, warmup, timing, _ = setup.runs
        prepared, verdicts = [], []
        try:
            for p in paths:
                try:
                    pm = backend.prepare(p)
                except Exception as exc:  # noqa: BLE001 - a model the runtime rejects is not shipped
                    raise StageError(f"autotune: {p.name} cannot be loaded by {backend.name}: "
                                     f"{first_line(exc)}") from None
                prepared.append(pm)
                verdicts.append(setup.judge(pm))
            timings = compare_prepared(backend.name, prepared, rounds=6, runs_per_round=max(2, timing // 2),
                                       warmup_runs=warmup)
        finally:
            for pm in prepared:
                pm.close()
        if not all(t.ok for t in timings[:2]):
            bad = next(t for t in timings if not t.ok)
            raise StageError(f"autotune: final measurement failed: {bad.error}")
        return timings, verdicts

    @staticmethod
    def _choose(setup: TuneSetup, paths: list[Path], timings: list[Any], verdicts: list[Any]) -> tuple[Path, str]:
        """(model to ship, why): tuned unless it misses the budget or the PTQ model is faster; float
        when no quantized model meets the budget or beats float by the performance threshold."""
        budget, threshold = setup.budget, setup.performance_threshold
        baseline, tuned = paths[0], paths[1]
        ptq = paths[2] if len(paths) > 2 else None
        tuned_t, tuned_v = timings[1], verdicts[1]
        ptq_t = timings[2] if ptq is not None and timings[2].ok else None
        ptq_v = verdicts[2] if ptq is not None else None
        ok = {tuned: tuned_v.ok or not budget.enabled, ptq: ptq_v is not None and (ptq_v.ok or not budget.enabled)}
        choice, why = tuned, "tuned placement"
        if not ok[tuned]:
            choice, why = ptq, f"the tuned placement misses the accuracy budget ({tuned_v.what})"
        elif ptq_t is not None and ok[ptq] and ptq_t.p10_ms < tuned_t.p10_ms * 0.98:
            choice, why = ptq, "the quantize stage's model measured faster than the tuned placement"
        if choice == ptq and (ptq_t is None or not ok[ptq]):
            return baseline, (f"no quantized model meets the accuracy budget ({budget.describe()}; tuned: "
                              f"{tuned_v.what}" + (f"; PTQ: {ptq_v.what}" if ptq_v is not None else "")
                              + "): shipping the float model")
        speedup = timings[0].p10_ms / timings[paths.index(choice)].p10_ms
        if speedup < threshold:
            return baseline, (f"no Q/DQ model beat the float baseline by the performance threshold "
                              f"{threshold:.2f}x (best {speedup:.3f}x): shipping the float model")
        return choice, why


class _PhaseBars:
    """One progress bar per subgraph-mode phase, the previous one closed when the next starts."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bars: dict[str, Any] = {}

    def update(self, phase: str, done: int, total: int) -> None:
        bar = self.bars.get(phase)
        if bar is None:
            for b in self.bars.values():
                b.close()
            bar = self.bars[phase] = progress_bar(self.enabled, total=total, desc=phase, unit="step")
        bar.total = total
        bar.n = done
        bar.refresh()

    def __enter__(self) -> _PhaseBars:
        return self

    def __exit__(self, *exc: object) -> None:
        for b in self.bars.values():
            b.close()


def write_group_report(path: Path, metrics: dict[str, Any]) -> None:
    """autotune/report.md of a subgraph-mode run: the final line and one row per distinct group."""
    rows = metrics.get("group_report") or []
    lines = [
        "# autotune (subgraph mode)", "",
        metrics["final_line"], "",
        f"Shipped: {metrics['shipped']} ({metrics['shipped_reason']}).", "",
        f"{metrics['fusion_groups']} fusion groups, {metrics['groups']} with something to quantize, "
        f"{metrics['distinct_groups']} distinct (each measured once on its subgraph); {metrics['measurements']} "
        f"measurements ({metrics['tuning_seconds']:.0f} s of tuning in this invocation); incremental validation "
        f"{'on' if metrics['incremental_validation'] else 'off'}, {metrics['kept_groups']} groups kept.", "",
        "optimized_raw.onnx (every local winner, unvalidated): " + (
            f"runs; accuracy {metrics['raw']['accuracy']['what']}"
            f"{'' if metrics['raw']['accuracy']['ok'] else ' (OVER BUDGET)'}" if metrics["raw"].get("runs")
            else f"does not run ({metrics['raw'].get('error')})") + ".", "",
    ]
    phases = metrics.get("phases") or []
    if phases:
        guard = metrics.get("guard") or {}
        steps = [*phases, {"phase": "final guard", "steps": int(bool(guard.get("measured"))), "known": 0,
                           "why": guard.get("why", "")}]
        counts = ", ".join(f"{r['phase']} {r['steps']}" for r in steps)
        lines += [f"Full-model steps: {sum(r['steps'] for r in steps)} ({counts}).", "",
                  "| phase | full-model steps | why |", "|---|---|---|"]
        for r in steps:
            known = f" (+{r['known']} known from their parent)" if r["known"] else ""
            lines.append(f"| {r['phase']} | {r['steps']}{known} | {r['why']} |")
        lines += ["", "| step | phase | groups | bisects step | result |", "|---|---|---|---|---|"]
        for st in metrics.get("steps") or []:
            parent = "-" if st["parent"] is None else str(st["parent"])
            lines.append(f"| {st['step']} | {st['phase']} | {st['groups']} | {parent} | {st['reason']} |")
        lines.append("")
    lines += [
        "| group | instances | nodes | scheme (subgraph) | local gain | validation | full model | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g in rows:
        nodes = ", ".join(g["nodes"][:4]) + (f" (+{len(g['nodes']) - 4})" if len(g["nodes"]) > 4 else "")
        full = f"{1.0 / g['full_model_ratio']:.3f}x" if g.get("full_model_ratio") else "-"
        lines.append(f"| {g['group']} | {g['instances']} | {nodes} | {g['scheme']} | {g['local_gain']:.2f}x "
                     f"({g['metric']}) | {g['validation']}{' (' + g['kept_scheme'] + ')' if g.get('kept_scheme') else ''}"
                     f" | {full} | {g.get('reason') or ''} |")
    atomic_write_text(path, "\n".join(lines) + "\n")
