"""The autotune stage (region mode): Q/DQ placement chosen by paired latency measurements.

Inputs: export's float model, quantize's calibration.json (Q/DQ get calibrated scales; a default
scale only where a tensor has no statistics, with a warning) and quantize's quantized_model.onnx as
QDQ baseline (``autotune.qdq_baseline`` overrides it). Outputs, as the reference tool lists them:
autotune/baseline.onnx, optimized_final.onnx, autotuner_state.yaml,
autotuner_state_pattern_cache.yaml, logs/ and region_models/.

The shipped optimized_final.onnx is decided by a fresh interleaved measurement of the float model,
the PTQ model and the tuned model (not by the search's best-of-N): it must beat the
precision-matched float baseline by ``performance_threshold`` or the float model ships, and if the
PTQ model measures faster than the tuned one, the PTQ model ships. Either way the stage says so,
and the file written is byte for byte the model that was measured.
"""

from __future__ import annotations

import logging
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
from pipeline.config import enum_value, section
from pipeline.errors import InputError, StageError, first_line
from pipeline.graph import input_specs, load_model, model_hash, recorded_shapes, save_model
from pipeline.placement import activation_type, placement_kind, resolve_rules
from pipeline.progress import progress_bar
from pipeline.qdq import Calibration, load_calibration, quantize_decisions
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


class AutotuneStage(Stage):
    name = "autotune"
    inputs = ("export/model.onnx",)
    # quantize/float_model.onnx: the float graph after quantize's float-exact transforms (equalization,
    # outlier smoothing), the one calibration.json describes; Q/DQ go into it, timing is against export's
    optional_inputs = ("quantize/calibration.json", "quantize/quantized_model.onnx", "quantize/float_model.onnx")
    # region mode adds autotuner_state.yaml; subgraph mode optimized_raw.onnx and autotune_cache.json
    outputs = ("autotune/optimized_final.onnx", "autotune/baseline.onnx")
    config_keys = ("autotune", "accuracy", "backend", "quantize", "seed")

    def run(self, ctx: StageContext) -> StageResult:
        from tasks.autotune.autotuner import SHARED_FIELDS, Config
        from tasks.autotune.workflows import init_benchmark_instance, region_pattern_autotuning_workflow

        cfg = ctx.cfg
        a = cfg.autotune
        mode = enum_value(a.mode)
        out = ctx.stage_dir("autotune")
        inputs = self.resolve_inputs(ctx)
        model = load_model(inputs["export/model.onnx"])
        quant_type = quant_type_of(cfg)
        backend = create_backend(cfg.backend)
        if not backend.has_fast_kernels(quant_type):
            log.warning("backend %s has no fast %s kernels: tuning can only find that fewer Q/DQ is faster. "
                        "Use a backend that runs %s (e.g. backend=tensorrt on an Ada/Hopper GPU for fp8, "
                        "backend=onnxruntime for int8)", backend.name, quant_type, quant_type)
        schemes, warmup, timing = settings(cfg)
        placement = placement_kind(cfg)

        calibration = self._calibration(inputs, a, load_calibration)
        decisions = quantize_decisions(inputs.get("quantize/calibration.json"))
        baseline_model = self._qdq_baseline(ctx, inputs)
        rules = resolve_rules(model, cfg.quantize.layers, cfg.quantize.skip_names, cfg.quantize.op_types_to_quantize)
        node_dtypes = None if a.quant_type is not None else rules
        if node_dtypes is not None and not node_dtypes:
            raise StageError("autotune: the quantize rules leave every node float (quantize=none?); set "
                             "autotune.quant_type=int8 to tune anyway")
        config = Config(
            **{k: a[k] for k in SHARED_FIELDS},
            default_quant_type=quant_type, default_dq_dtype=enum_value(a.default_dq_dtype),
            schemes_per_region=schemes, placement=placement,
            activation_type=activation_type(cfg) if quant_type == "int8" else "int8",
            seed=int(cfg.seed), node_filter_list=_node_filters(list(a.node_filter_list)), node_dtypes=node_dtypes,
            weight_range=decisions["weight_range"], float_nodes=list(decisions["float_nodes"]),
        )
        if decisions["weight_range"] != "full" or decisions["float_nodes"]:
            log.info("autotune: following the quantize stage: %s weights%s", decisions["weight_range"],
                     f", {len(decisions['float_nodes'])} nodes float" if decisions["float_nodes"] else "")
        baseline_path = out / "baseline.onnx"
        save_model(model, baseline_path)
        if "quantize/float_model.onnx" in inputs:
            model = load_model(inputs["quantize/float_model.onnx"])
        rounds = 4
        budget = AccuracyBudget.from_config(cfg)
        holdout = Holdout.from_config(cfg, input_specs(model))
        with backend.prepare(baseline_path) as pm:
            holdout.set_reference(pm)
        log.info("autotune: every candidate is held to the accuracy budget (%s) on %d samples of %s",
                 budget.describe(), holdout.samples, holdout.source)

        def judge(pm):
            return holdout.score(pm, budget)

        bench = init_benchmark_instance(backend, baseline_path, warmup, timing, rounds,
                                        judge if budget.enabled else None)
        first = bench.measure(baseline_path, use_cache=False)  # fails fast if the backend cannot measure here
        if not first.ok:
            raise StageError(f"autotune: cannot measure the float model on {backend.name}: {first.error}")
        context_items = {
            "calibration": sha256_file(inputs["quantize/calibration.json"]) if "quantize/calibration.json" in inputs
            else None,
            "qdq_baseline": model_hash(baseline_model) if baseline_model is not None else None,
            "backend": section(cfg, "backend"), "activation_type": config.activation_type,
            "default_dq_dtype": config.default_dq_dtype, "node_filter_list": config.node_filter_list,
            "node_dtypes": sorted((k, v.weights, v.activations) for k, v in (node_dtypes or {}).items()),
            "weight_range": config.weight_range, "float_nodes": config.float_nodes,
            "accuracy": section(cfg, "accuracy"),
        }
        if mode == "subgraph":
            return self._subgraph(ctx, model, inputs, backend, config, calibration, budget, holdout, judge,
                                  baseline_path, bench, context_items, (schemes, warmup, timing, rounds))
        pattern_cache = None
        if a.pattern_cache:
            from tasks.autotune.pattern_cache import PatternCache

            pattern_cache = PatternCache.load(user_path(a.pattern_cache), config.pattern_cache_minimum_distance,
                                              config.pattern_cache_max_entries_per_pattern)
            log.info("warm start: %d patterns from %s", pattern_cache.num_patterns, a.pattern_cache)
        state_file = None
        if a.state_file:
            state_file = str(user_path(a.state_file))

        bar = progress_bar(bool(cfg.progress), total=None, desc="autotune", unit="pattern")

        def on_progress(ev: dict) -> None:
            bar.total = ev["patterns"]
            bar.n = ev["patterns_done"]
            sp = ev.get("best_speedup")
            bar.set_postfix(schemes=ev["measurements"], best=f"{sp:.2f}x" if sp else "-", refresh=False)
            bar.refresh()

        context = fingerprint(context_items)
        try:
            tuner = region_pattern_autotuning_workflow(model, out, bench, config, calibration, pattern_cache,
                                                       state_file, baseline_model, on_progress, context)
        finally:
            bar.close()
        if calibration.defaulted:
            log.warning("autotune: %d tensors had no calibration statistics and use the default scale %.3g: "
                        "run the quantize stage first for calibrated scales", len(calibration.defaulted),
                        config.default_q_scale)
        tuned = out / "optimized_tuned.onnx"
        tuned_model = tuner.export_model()
        save_model(tuned_model, tuned)
        metrics = self._finalize(backend, bench, baseline_path, inputs.get("quantize/quantized_model.onnx"),
                                 tuned, out / "optimized_final.onnx", float(a.performance_threshold), timing, warmup,
                                 judge, budget)
        metrics.update(
            mode="region", full_model_measurements=tuner.num_measurements,
            regions=len(tuner.regions), patterns=tuner.num_patterns, measurements=tuner.num_measurements,
            benchmark_runs=bench.count, quant_type=quant_type, placement=placement,
            schemes_per_region=schemes, defaulted_scales=len(calibration.defaulted),
            weight_range=config.weight_range, float_nodes=config.float_nodes, budget=budget.describe(),
            over_budget_candidates=sum(1 for ps in tuner.pattern_schemes.values() for r in ps.records
                                       for m in r.measurements if m.over_budget),
        )
        artifacts = {
            "autotune/optimized_final.onnx": out / "optimized_final.onnx",
            "autotune/baseline.onnx": baseline_path,
            "autotune/autotuner_state.yaml": Path(state_file) if state_file else out / "autotuner_state.yaml",
        }
        cache_file = artifacts["autotune/autotuner_state.yaml"]
        cache_file = cache_file.with_name(f"{cache_file.stem}_pattern_cache.yaml")
        if cache_file.exists():
            artifacts["autotune/autotuner_state_pattern_cache.yaml"] = cache_file
        tuned.unlink(missing_ok=True)
        return StageResult(artifacts, metrics)

    def _subgraph(self, ctx: StageContext, model, inputs: dict[str, Path], backend, config, calibration: Calibration,
                  budget: AccuracyBudget, holdout: Holdout, judge, baseline_path: Path, bench,
                  context_items: dict[str, Any], settings_: tuple[int, int, int, int]) -> StageResult:
        """Subgraph mode (tasks/autotune/subgraph_workflow.py): fusion groups, per-group profiling of
        extracted subgraphs, incremental validation on the full model, then the same final guard."""
        import time

        from tasks.autotune.subgraph_workflow import subgraph_autotuning_workflow

        cfg, a = ctx.cfg, ctx.cfg.autotune
        out = ctx.stage_dir("autotune")
        _, warmup, timing, rounds = settings_
        bench.close()
        t0 = time.time()
        groups, graph_json, source = self._fusion_groups(cfg, backend, baseline_path, model, out,
                                                         inputs["export/model.onnx"].stem)
        log.info("autotune: %d fusion groups from %s", len(groups), source)
        context = fingerprint({**context_items, "mode": "subgraph", "groups": source,
                               "graph_json": sha256_file(graph_json) if graph_json is not None else None})
        bars: dict[str, Any] = {}

        def on_progress(phase: str, done: int, total: int) -> None:
            bar = bars.get(phase)
            if bar is None:
                for b in bars.values():
                    b.close()
                bar = bars[phase] = progress_bar(bool(cfg.progress), total=total, desc=phase, unit="step")
            bar.total = total
            bar.n = done
            bar.refresh()

        try:
            result = subgraph_autotuning_workflow(
                model, out, backend, groups, config, calibration, warmup, timing, rounds,
                judge if budget.enabled else None, shapes={**backend.opt_shapes(), **recorded_shapes(model)},
                incremental_validation=bool(a.incremental_validation), context=context, on_progress=on_progress)
        finally:
            for b in bars.values():
                b.close()
        raw = self._check_raw(backend, out / "optimized_raw.onnx", judge)
        tuned = out / "optimized_tuned.onnx"
        save_model(result.tuner.export_model(assignment=result.assignment), tuned)
        tuning_s = time.time() - t0
        metrics = self._finalize(backend, bench, baseline_path, inputs.get("quantize/quantized_model.onnx"), tuned,
                                 out / "optimized_final.onnx", float(a.performance_threshold), timing, warmup,
                                 judge, budget)
        kept = sum(1 for g in result.report if g["validation"] == "kept")
        metrics.update(
            mode="subgraph", fusion_groups=len(groups), groups=result.groups, distinct_groups=result.keys,
            measurements=result.measurements, full_model_measurements=result.full_model_measurements,
            subgraph_measurements=result.measurements - result.full_model_measurements, kept_groups=kept,
            tuning_seconds=round(tuning_s, 1),
            incremental_validation=bool(a.incremental_validation), group_report=result.report, raw=raw,
            quant_type=config.default_quant_type, placement=config.placement, budget=budget.describe(),
            weight_range=config.weight_range, float_nodes=config.float_nodes,
            defaulted_scales=len(calibration.defaulted),
        )
        write_group_report(out / "report.md", metrics)
        tuned.unlink(missing_ok=True)
        artifacts = {
            "autotune/optimized_final.onnx": out / "optimized_final.onnx",
            "autotune/optimized_raw.onnx": out / "optimized_raw.onnx",
            "autotune/baseline.onnx": baseline_path,
            "autotune/autotune_cache.json": out / "autotune_cache.json",
            "autotune/report.md": out / "report.md",
        }
        if graph_json is not None and graph_json.parent == out:
            artifacts[f"autotune/{graph_json.name}"] = graph_json
        return StageResult(artifacts, metrics)

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
    def _fusion_groups(cfg: DictConfig, backend, model_path: Path, model, out: Path, name: str):
        """Phase 1: (groups, graph JSON used or written, description of the source).

        autotune.graph_json names a TensorRT layer-information file; without it, ONNX Runtime groups
        come from its own optimized graph, TensorRT groups from one float build of the model
        (``<model>.<precision>.graph.json`` in the autotune folder, reused when present)."""
        import json

        from pipeline.backends.trt_common import parse_layer_info
        from tasks.autotune.fusion_grouping import ort_fusion_groups, trt_fusion_groups

        a = cfg.autotune
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

    @staticmethod
    def _finalize(backend, bench, baseline: Path, ptq: Path | None, tuned: Path, final: Path, threshold: float,
                  timing: int, warmup: int, judge, budget: AccuracyBudget) -> dict[str, Any]:
        """Fresh interleaved measurement of float, PTQ and tuned models, each also checked against the
        accuracy budget on the held-out batches; ship the fastest model that meets the budget and beats
        float by ``threshold``, else the float model."""
        from pipeline.backends.base import compare_prepared

        bench.close()  # free the search's live reference before the final comparison
        paths = [baseline, tuned] + ([ptq] if ptq is not None and model_hash(ptq) != model_hash(tuned) else [])
        prepared, verdicts = [], []
        try:
            for p in paths:
                try:
                    pm = backend.prepare(p)
                except Exception as exc:  # noqa: BLE001 - a model the runtime rejects is not shipped
                    raise StageError(f"autotune: {p.name} cannot be loaded by {backend.name}: "
                                     f"{first_line(exc)}") from None
                prepared.append(pm)
                verdicts.append(judge(pm))
            timings = compare_prepared(backend.name, prepared, rounds=6, runs_per_round=max(2, timing // 2),
                                       warmup_runs=warmup)
        finally:
            for pm in prepared:
                pm.close()
        if not all(t.ok for t in timings[:2]):
            bad = next(t for t in timings if not t.ok)
            raise StageError(f"autotune: final measurement failed: {bad.error}")
        base_t, tuned_t = timings[0], timings[1]
        ptq_t = timings[2] if len(timings) > 2 and timings[2].ok else None
        tuned_v = verdicts[1]
        ptq_v = verdicts[2] if len(verdicts) > 2 else None
        ok = {tuned: tuned_v.ok or not budget.enabled, ptq: ptq_v is not None and (ptq_v.ok or not budget.enabled)}
        choice, why = tuned, "tuned placement"
        if not ok[tuned]:
            choice, why = ptq, f"the tuned placement misses the accuracy budget ({tuned_v.what})"
        elif ptq_t is not None and ok[ptq] and ptq_t.p10_ms < tuned_t.p10_ms * 0.98:
            choice, why = ptq, "the quantize stage's model measured faster than the tuned placement"
        if choice == ptq and (ptq_t is None or not ok[ptq]):
            choice = baseline
            why = (f"no quantized model meets the accuracy budget ({budget.describe()}; tuned: {tuned_v.what}"
                   + (f"; PTQ: {ptq_v.what}" if ptq_v is not None else "") + "): shipping the float model")
        chosen_t = {baseline: base_t, tuned: tuned_t, ptq: ptq_t}[choice]
        speedup = base_t.p10_ms / chosen_t.p10_ms
        if choice != baseline and speedup < threshold:
            choice, why = baseline, (f"no Q/DQ model beat the float baseline by the performance threshold "
                                     f"{threshold:.2f}x (best {speedup:.3f}x): shipping the float model")
            chosen_t = base_t
        atomic_write_bytes(final, choice.read_bytes())
        speedup = base_t.p10_ms / chosen_t.p10_ms
        chosen_v = {baseline: verdicts[0], tuned: tuned_v, ptq: ptq_v}[choice]
        runtime = backend.describe()
        # the CPU EP runs float models in FP32; TensorRT backends build them at backend.float_precision
        precision = "FP32" if backend.name == "onnxruntime" else str(backend.cfg.get("float_precision", "FP32")).upper()
        line = (f"Baseline: {base_t.p10_ms:.3f} ms / Final: {chosen_t.p10_ms:.3f} ms ({speedup:.2f}x speedup), "
                f"accuracy {chosen_v.what} [p10 of {chosen_t.n} interleaved runs; baseline = {precision} float "
                f"model on {backend.name}]")
        log.info(line)
        if choice != tuned:
            log.warning("autotune: optimized_final.onnx is %s because %s", choice.name, why)
        shipped = {baseline: "float", tuned: "tuned", ptq: "ptq"}.get(choice, "tuned")
        metrics: dict[str, Any] = {
            "baseline_ms": base_t.p10_ms, "final_ms": chosen_t.p10_ms, "speedup": speedup,
            "baseline_median_ms": base_t.median_ms, "final_median_ms": chosen_t.median_ms,
            "tuned_ms": tuned_t.p10_ms, "tuned_speedup": base_t.p10_ms / tuned_t.p10_ms,
            "ptq_ms": ptq_t.p10_ms if ptq_t else None,
            "ptq_speedup": (base_t.p10_ms / ptq_t.p10_ms) if ptq_t else None,
            "accuracy": {"final": chosen_v.to_dict(), "tuned": tuned_v.to_dict(),
                         "ptq": ptq_v.to_dict() if ptq_v is not None else None},
            "shipped": shipped, "shipped_reason": why,
            "baseline_precision": precision, "runtime": runtime, "final_line": line,
            "headline": f"{speedup:.2f}x vs {precision} float, {chosen_v.what} ({shipped if choice == tuned else why})",
        }
        return metrics


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
