"""The evaluate stage: accuracy, agreement with the float model and latency of every model in results_dir.

The float model (export/model.onnx) is the reference for agreement, cosine similarity and SNR, and
the baseline for speedups. Each quantized model present (PTQ from quantize, the autotuned one from
autotune) is run on the same evaluation batches through the configured backend; a file identical to
one already listed is not measured twice. Where the runtime's float precision is below FP32
(``Backend.fp32_variant``), the float model run in FP32 is scored and timed as one more model; where
autotune chose the FP32 float as its baseline, because the runtime's own float misses the accuracy
budget or runs slower (``float_baseline`` in its metrics), evaluate follows it: the float model and
PTQ run in FP32, and the float model in the runtime's own precision is the one more model.
Latency comes from one interleaved run over all models, so machine drift hits every model alike.
Each model is prepared (on TensorRT: its engine built) once and serves both the scoring pass and
the latency run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from pipeline.accuracy.fidelity import FidelityResult
from pipeline.accuracy.metrics import ModelScores, json_safe
from pipeline.artifacts import atomic_write_json, atomic_write_text, read_json, sha256_file
from pipeline.backends import create_backend, settings_artifacts
from pipeline.backends.base import Backend, PreparedModel
from pipeline.backends.timing import TimingPlan, compare_prepared
from pipeline.config import resolved_data_source
from pipeline.data.adapters import DataProvider
from pipeline.errors import PipelineError, StageError, first_line
from pipeline.graph.model import InputSpec, has_qdq, input_specs, load_model
from pipeline.progress import progress_bar
from pipeline.records.autotune import autotune_metrics
from pipeline.records.evaluate import (
    DataSummary,
    Duplicate,
    EvaluateMetrics,
    FloatBaseline,
    ModelLatency,
    ModelMetrics,
    Reproduce,
    SensitiveNode,
    SensitivitySummary,
)
from pipeline.records.stages import shipped_record
from pipeline.runtime_choice import CHOICE, RuntimeChoice
from pipeline.stage import Stage, StageContext, StageResult
from tasks.evaluate._custom import CustomScores
from tasks.evaluate._latency import LatencyRun, same_session
from tasks.evaluate._runtimes import runtimes_metrics
from tasks.evaluate.report import backend_text, reproduce_commands
from tasks.evaluate.verdicts import judge_models

log = logging.getLogger("tune.evaluate")


@dataclass(frozen=True)
class EvaluatedModel:
    """One model to evaluate: short key for metrics, label for humans, artifact key and file."""

    key: str
    label: str
    artifact: str
    path: Path
    sha256: str


@dataclass(frozen=True)
class EvaluationPlan:
    """What is evaluated: the models (float first), the files left out as byte-identical to one of
    them, the inputs they all take, the float model's precision and the runtime settings the
    autotuned model ships with (None: none that change anything)."""

    models: list[EvaluatedModel]
    duplicates: list[Duplicate]
    specs: list[InputSpec]
    precision: str
    settings: Any
    float_choice: FloatBaseline | None = None  # autotune's float_baseline where evaluate follows it to FP32


@dataclass(frozen=True)
class Measurements:
    """What the evaluation pass measured, per model key: scores over ``batches`` batches, kernel
    fidelity (None where the check could not run) and the interleaved latency (None when not timed)."""

    scores: dict[str, ModelScores]
    batches: int
    fidelity: dict[str, FidelityResult | None]
    latency: LatencyRun | None


@dataclass(frozen=True)
class Runtimes:
    """Which backend runs each model: ``by_key`` for the keys it names, ``plain`` for the others; the
    float model's second row (metrics key, label), if any; and autotune's ``float_baseline`` where
    evaluate follows it to FP32 (None: the runtime's own float is the baseline)."""

    plain: Backend
    by_key: dict[str, Backend]
    extra_float: tuple[str, str] | None = None
    choice: FloatBaseline | None = None

    def of(self, key: str) -> Backend:
        return self.by_key.get(key) or self.plain


# (metrics key, report label, artifact key) in the order they are listed and measured
_MODELS = (
    ("float", "float", "export/model.onnx"),
    ("ptq", "PTQ", "quantize/quantized_model.onnx"),
    ("autotuned", "autotuned", "autotune/optimized_final.onnx"),
)
# the float model as the baseline runs it and in the other precision (FP32, or the runtime's own when
# the baseline is FP32): references, not quantized models (no budget or kernel-fidelity check)
_FLOATS = ("float", "float_fp32", "float_default")


class EvaluateStage(Stage):
    name = "evaluate"
    inputs = ("export/model.onnx",)
    optional_inputs = ("quantize/quantized_model.onnx", "autotune/optimized_final.onnx", "quantize/calibration.json",
                       "quantize/float_model.onnx", CHOICE)
    outputs = ("evaluate/metrics.json", "evaluate/report.md")
    config_keys = ("evaluate", "data", "backend", "seed", "accuracy", "target")
    host_bound = True  # latency and accuracy measured on this host

    def optional_input_keys(self, ctx: StageContext) -> tuple[str, ...]:
        # the runtime settings the autotuned model ships with (the configured runtime's file)
        return (*self.optional_inputs, *settings_artifacts(ctx.cfg.backend))

    def run(self, ctx: StageContext) -> StageResult:
        ecfg = ctx.cfg.evaluate
        out_dir = ctx.stage_dir("evaluate")
        record = shipped_record(ctx.manifest)
        warning = record.host_warning(results_dir=ctx.results_dir) if record is not None else None
        if warning:
            log.warning("evaluate: %s (what follows is measured on this host)", warning)
        backend = create_backend(ctx.cfg.backend)
        settings = self._session_settings(ctx, backend)
        runs_on = model_runtimes(ctx, backend, settings)
        evaluated, duplicates = self._evaluated_models(ctx, settings is not None, runs_on.extra_float)
        float_model = load_model(evaluated[0].path, check=False)
        specs = self._specs(evaluated, float_model)
        stored = _precision(float_model)  # an FP32 model runs in the baseline's float precision
        plan = EvaluationPlan(evaluated, duplicates, specs,
                              runs_on.plain.float_precision() if stored == "FP32" else stored, settings,
                              runs_on.choice)
        max_batches = int(ecfg.max_batches) if ecfg.max_batches is not None else None

        # every model is prepared once (a full engine build on TensorRT) for scoring and latency alike
        prepared: dict[str, PreparedModel] = {}
        try:
            for c in evaluated:
                prepared[c.key] = self._prepare(runs_on.of(c.key), c)
            scores, batches = self._score(ctx, backend, evaluated, specs, max_batches, prepared, float_model)
            fidelity = self._fidelity(ctx, backend, evaluated, specs, prepared)
            if settings is not None and ecfg.latency and "autotuned" in prepared:
                # float with the same settings: so a runtime win is not read as a quantization win
                prepared["float_same_session"] = self._prepare(backend.with_settings(settings), evaluated[0])
            timings = (self._latency(backend, evaluated, prepared, int(ecfg.latency_repeats))
                       if ecfg.latency else None)
        finally:
            for pm in prepared.values():
                pm.close()

        measured = Measurements(scores, batches, fidelity, timings)
        metrics = self._metrics(ctx, backend, plan, measured)
        from tasks.evaluate import report

        artifacts = self._sensitivity(ctx, evaluated, specs, out_dir, metrics) if ecfg.sensitivity.enabled else {}
        metrics_path = atomic_write_json(out_dir / "metrics.json", json_safe(metrics.to_dict()))
        report_path = atomic_write_text(out_dir / "report.md", report.markdown(metrics))
        artifacts.update({"evaluate/metrics.json": metrics_path, "evaluate/report.md": report_path})
        if ecfg.plot:
            artifacts["evaluate/summary.png"] = report.plot(metrics, out_dir / "summary.png")
        log.info("%s", metrics.headline)
        notes = [timings.warning] if timings is not None and timings.warning is not None else []
        return StageResult(artifacts=artifacts, metrics=metrics, notes=notes)

    @staticmethod
    def _sensitivity(ctx: StageContext, evaluated: list[EvaluatedModel], specs: list[InputSpec], out_dir: Path,
                     metrics: EvaluateMetrics) -> dict[str, Path]:
        """Each quantized node's own contribution to the shipped model's error (tasks/evaluate/_sensitivity.py);
        its summary goes into ``metrics.sensitivity`` for the report."""
        from tasks.evaluate import _sensitivity

        graph = ctx.artifact("quantize/float_model.onnx")
        # the newest model that carries Q/DQ (an autotuned model may be the float graph again)
        shipped, qmodel = None, None
        for c in reversed(evaluated[1:] if graph is not None else []):
            qmodel = load_model(c.path, check=False)
            if any(n.op_type == "DequantizeLinear" for n in qmodel.graph.node):
                shipped = c
                break
        if shipped is None:
            return {}
        s = ctx.cfg.evaluate.sensitivity
        batches = list(DataProvider(ctx.cfg, specs).batches("evaluation", int(s.batches)))
        left_float = list(metrics.quantization.float_nodes) if metrics.quantization is not None else []
        artifacts, doc = _sensitivity.analyse(ctx.cfg, load_model(graph, check=False),
                                              _sensitivity.ShippedModel(shipped.label, qmodel, left_float), batches,
                                              out_dir, int(s.max_nodes), bool(ctx.cfg.evaluate.plot))
        if artifacts:
            top = [SensitiveNode(str(r.get("node")), str(r.get("op_type")), str(r.get("label"))) for r in doc["nodes"][:5]]
            metrics.sensitivity = SensitivitySummary(shipped.label, doc["whole_model"]["label"], top, len(doc["nodes"]),
                                                     doc["quantized_nodes"], left_float,
                                                     sorted(Path(p).name for p in artifacts.values()))
        return artifacts

    # ------------------------------------------------------------------ which models
    @staticmethod
    def _evaluated_models(ctx: StageContext, own_session: bool = False, extra_float: tuple[str, str] | None = None
                          ) -> tuple[list[EvaluatedModel], list[Duplicate]]:
        """The models to evaluate, each file once; with ``own_session`` (the autotuned model ships
        session settings of its own) the autotuned model is evaluated even when its bytes repeat; with
        ``extra_float`` (metrics key, label) the float model follows itself once more under that key
        (run in the other float precision, ``Runtimes``)."""
        evaluated: list[EvaluatedModel] = []
        duplicates: list[Duplicate] = []
        for key, label, artifact in _MODELS:
            path = ctx.require(artifact) if key == "float" else ctx.artifact(artifact)
            if path is None:
                continue
            digest = sha256_file(path)
            same = next((c for c in evaluated if c.sha256 == digest), None)
            if same is not None and not (own_session and key == "autotuned"):
                # quantize with quantize=none, or an autotune that kept the PTQ placement, gives the
                # same bytes: measuring it again would only add noise to the comparison
                log.info("%s model %s is identical to the %s model; evaluated once", label, artifact, same.label)
                duplicates.append(Duplicate(key, artifact, same.key))
                continue
            evaluated.append(EvaluatedModel(key, label, artifact, Path(path), digest))
            if key == "float" and extra_float is not None:
                evaluated.append(replace(evaluated[0], key=extra_float[0], label=extra_float[1]))
        return evaluated, duplicates

    @staticmethod
    def _specs(evaluated: list[EvaluatedModel], float_model: onnx.ModelProto) -> list[InputSpec]:
        """Input specs of the float model; every other model must take exactly the same inputs."""
        specs = input_specs(float_model)
        want = [(s.name, s.shape, s.dtype) for s in specs]
        for c in evaluated[1:]:
            try:
                got = [(s.name, s.shape, s.dtype) for s in input_specs(load_model(c.path, check=False))]
            except PipelineError as exc:
                raise StageError(f"cannot evaluate {c.label} model {c.artifact}: {exc}") from None
            if got != want:
                raise StageError(f"{c.label} model {c.artifact} takes inputs {got}, but the float model "
                                 f"export/model.onnx takes {want}; both must have the same static inputs")
        return specs

    # ------------------------------------------------------------------ accuracy and agreement
    def _score(self, ctx: StageContext, backend: Backend, evaluated: list[EvaluatedModel], specs: list[InputSpec],
               max_batches: int | None, prepared: dict[str, PreparedModel], float_model: onnx.ModelProto
               ) -> tuple[dict[str, ModelScores], int]:
        """One pass over the evaluation data; every model runs each batch, so nothing is stored.
        ``prepared`` holds every model, prepared by the caller (who also closes them); ``float_model``'s
        outputs are the ones the class-score guess reads."""
        from pipeline.accuracy.budget import AccuracyBudget
        from pipeline.accuracy.holdout import check_output_names, class_outputs

        provider = DataProvider(ctx.cfg, specs)
        top_k = int(ctx.cfg.evaluate.top_k)
        names = list(getattr(prepared["float"], "output_names", None) or [])
        classes = class_outputs(ctx.cfg, float_model)
        check_output_names(AccuracyBudget.from_config(ctx.cfg), classes, names)
        # evaluate's verdicts are on the values over its data: no per-sample values kept
        scores = {c.key: ModelScores(top_k=top_k, output_names=names, class_outputs=classes, keep_samples=False)
                  for c in evaluated}
        custom = CustomScores.from_config(ctx.cfg, names, [c.key for c in evaluated])
        batches = 0
        bar = progress_bar(bool(ctx.cfg.progress), total=provider.count("evaluation", max_batches),
                           desc="evaluate", unit="batch")
        with bar:
            for batch in provider.batches("evaluation", max_batches):
                reference = self._run(prepared["float"], evaluated[0], batch.feeds, backend)
                scores["float"].update(reference, reference, batch.labels, batch.valid)
                custom.add("float", reference, batch.labels, batch.valid)
                for c in evaluated[1:]:
                    outputs = self._run(prepared[c.key], c, batch.feeds, backend)
                    got, want = [o.shape for o in outputs], [r.shape for r in reference]
                    if got != want:
                        raise StageError(f"{c.label} model {c.artifact} produces outputs of shapes {got}, "
                                         f"the float model {want}; they cannot be compared")
                    scores[c.key].update(reference, outputs, batch.labels, batch.valid)
                    custom.add(c.key, outputs, batch.labels, batch.valid)
                batches += 1
                bar.update(1)
        if batches == 0:
            raise StageError(f"the evaluation data (data.source={resolved_data_source(ctx.cfg)}) yielded no "
                             f"batches; nothing to evaluate")
        for key, value in custom.result().items():
            scores[key].custom = value
        return scores, batches

    @staticmethod
    def _prepare(backend: Backend, c: EvaluatedModel) -> PreparedModel:
        try:
            return backend.prepare(c.path)
        except Exception as exc:  # noqa: BLE001 - runtimes raise their own types for unloadable models
            log.debug("prepare %s failed", c.path, exc_info=True)
            raise StageError(f"{c.label} model {c.artifact} cannot be loaded by {backend.name}: "
                             f"{first_line(exc)}") from None

    @staticmethod
    def _run(pm: PreparedModel, c: EvaluatedModel, feeds: dict[str, np.ndarray], backend: Backend) -> list[np.ndarray]:
        try:
            return [np.asarray(o) for o in pm.run(feeds)]
        except Exception as exc:  # noqa: BLE001 - runtimes raise their own types for failed runs
            log.debug("run %s failed", c.path, exc_info=True)
            raise StageError(f"{c.label} model {c.artifact} failed to run on {backend.name}: "
                             f"{first_line(exc)}") from None

    @staticmethod
    def _fidelity(ctx: StageContext, backend: Backend, evaluated: list[EvaluatedModel], specs: list[InputSpec],
                  prepared: dict[str, PreparedModel]) -> dict[str, FidelityResult | None]:
        """Kernel fidelity of each quantized model on the first evaluation batches (fused kernels vs
        plain Q/DQ math), where the backend has a reference runner."""
        from pipeline.accuracy.fidelity import kernel_fidelity

        batches = list(DataProvider(ctx.cfg, specs).batches("evaluation", 2))
        feeds = [b.feeds for b in batches]
        floats = [[np.asarray(o) for o in prepared["float"].run(f)] for f in feeds]
        out = {}
        for c in (c for c in evaluated if c.key not in _FLOATS):
            try:
                out[c.key] = kernel_fidelity(backend, c.path, feeds, prepared=prepared[c.key], float_outputs=floats)
            except Exception as exc:  # noqa: BLE001 - the reference runner may reject what the fused one runs
                log.debug("fidelity check of %s failed", c.path, exc_info=True)
                out[c.key] = None
                log.warning("kernel-fidelity check of the %s model could not run: %s", c.label, first_line(exc))
        return out

    # ------------------------------------------------------------------ latency
    @staticmethod
    def _latency(backend: Backend, evaluated: list[EvaluatedModel], prepared: dict[str, PreparedModel],
                 rounds: int) -> LatencyRun:
        """Interleaved timing of the models already prepared for scoring (no second build)."""
        keys = [c.key for c in evaluated] + [k for k in prepared if k not in {c.key for c in evaluated}]
        # evaluate.latency_repeats rounds of the backend's timing_runs in all
        plan = TimingPlan.final(backend.timing_runs, backend.warmup_runs, rounds=rounds,
                                runs_per_round=max(1, backend.timing_runs // rounds))
        timings = compare_prepared(backend.name, [prepared[k] for k in keys], plan)
        for c, t in zip(evaluated, timings, strict=False):
            if not t.ok:
                raise StageError(f"latency of the {c.label} model {c.artifact} could not be measured on "
                                 f"{backend.name}: {(t.error or 'unknown error').strip().splitlines()[0]}")
        timed = dict(zip(keys, timings, strict=True))
        extra = {k: timed.pop(k) for k in keys[len(evaluated):]}
        return LatencyRun(rounds, plan.runs_per_round, backend.warmup_runs, timed, extra)

    @staticmethod
    def _session_settings(ctx: StageContext, backend: Backend) -> Any:
        """The runtime settings autotune shipped for this backend (its ``shipped_settings`` file) when they
        change anything, else None."""
        kind = backend.shipped_settings
        path = ctx.artifact(kind.artifact) if kind is not None else None
        if path is None:
            return None
        settings = kind.type.load(path)
        return None if settings == kind.type() else settings

    # ------------------------------------------------------------------ assembling the metrics
    def _metrics(self, ctx: StageContext, backend: Backend, plan: EvaluationPlan,
                 measured: Measurements) -> EvaluateMetrics:
        latency = measured.latency
        info = backend.describe()
        models = _model_metrics(plan.models, measured)
        first = models["float"].scores
        data = DataSummary(resolved_data_source(ctx.cfg), first.samples, measured.batches,
                           plan.specs[0].batch if plan.specs else 1, first.top1 is not None, ctx.cfg.evaluate.max_batches)
        reproduce = Reproduce(**reproduce_commands(ctx))
        metrics = EvaluateMetrics(f"{plan.precision} float model on {backend_text(info)}", info, data,
                                  int(ctx.cfg.evaluate.top_k), models, reproduce, str(ctx.cfg.model.name),
                                  plan.duplicates, latency.summary() if latency is not None else None,
                                  shipped_model(plan), plan.float_choice)
        if latency is not None:
            if "autotuned" in models and plan.settings is not None:
                same_session(models["autotuned"], latency, plan.settings, backend)
            if latency.warning is not None:
                log.warning("%s", latency.warning)
        judge_models(ctx, metrics, measured.scores, measured.fidelity, _FLOATS)
        metrics.headline = headline(metrics)
        choice = ctx.artifact(CHOICE)  # the run chose its runtime: every runtime beside this one
        if choice is not None:
            metrics.runtimes = runtimes_metrics(RuntimeChoice.from_dict(read_json(choice, CHOICE)), metrics)
            metrics.headline = f"on {metrics.runtimes.winner}: {metrics.headline}"
        return metrics


def model_runtimes(ctx: StageContext, backend: Backend, settings: Any) -> Runtimes:
    """The backend each model runs on. The autotuned model runs with the runtime settings it ships
    with, the others as deployed without them (ORT: its default session, whose threads spin, as the
    tuned one's do). The float baseline is the runtime's own float precision, with the float model in
    FP32 as a second row, unless autotune chose the FP32 float because the runtime's own misses the
    accuracy budget or runs slower: then the float model and PTQ run in FP32 (as autotune measured
    them), and the runtime's own float is the second row."""
    plain = backend.as_deployed() if settings else backend
    tuned = {"autotuned": backend.with_settings(settings)} if settings else {}
    fp32 = plain.fp32_variant()
    if fp32 is None:
        return Runtimes(plain, tuned)
    own = plain.float_precision()
    recorded = autotune_metrics(ctx.manifest.metrics("autotune"), f"{ctx.manifest.path}'s autotune entry")
    choice = recorded.float_baseline if recorded is not None else None
    # followed only where autotune judged the float this backend runs (not one of another precision)
    if choice is None or choice.precision != "FP32" or choice.default != own:
        return Runtimes(plain, {**tuned, "float_fp32": fp32}, ("float_fp32", "float (FP32)"))
    return Runtimes(fp32, {**tuned, "float_default": plain}, ("float_default", f"float ({own})"), choice)


def _model_metrics(evaluated: list[EvaluatedModel], measured: Measurements) -> dict[str, ModelMetrics]:
    """Each model's entry in metrics.json: its file, scores, custom metric, times and speedups."""
    latency = measured.latency
    models: dict[str, ModelMetrics] = {}
    for c in evaluated:
        scores = measured.scores[c.key]
        m = ModelMetrics(c.label, c.artifact, scores.scores(), c.sha256, scores.custom)
        if latency is not None:
            base, t = latency.timings["float"], latency.timings[c.key]
            m.latency_ms = ModelLatency.from_timing(t)
            m.speedup = base.median_ms / t.median_ms if t.median_ms > 0 else None
            m.speedup_p10 = base.p10_ms / t.p10_ms if t.p10_ms > 0 else None
        models[c.key] = m
    return models


def shipped_model(plan: EvaluationPlan) -> str | None:
    """The key of the model that ships (the newest of float, PTQ, autotuned), resolved to the model it
    is byte-identical to (as autotune names it), and to "float" where it holds no Q/DQ node; None when
    only the float model was evaluated (there is no choice to name)."""
    present = {c.key: c for c in plan.models}
    same = {d.model: d.identical_to for d in plan.duplicates}
    newest = next(k for k, _, _ in reversed(_MODELS) if k in present or k in same)
    if newest == "float":
        return None
    key = same.get(newest, newest)
    if key == "autotuned" and "ptq" in present and present["ptq"].sha256 == present[key].sha256:
        key = "ptq"  # autotune shipped the PTQ model (evaluated again under the runtime settings it ships with)
    if key != "float" and not has_qdq(onnx.load(str(present[key].path), load_external_data=False)):
        return "float"
    return key


def headline(metrics: EvaluateMetrics) -> str:
    """One line for the end-of-run table, e.g. 'float 97.0% 1.2 ms | ptq 96.8% 2.10x (p10 2.20x) | ...'.

    Both ratios are shown because on a busy machine the median drifts with other processes' load
    while the ratio of p10s holds up (shared/reference/field-notes.md).
    """
    parts = []
    for key, m in metrics.models.items():
        text = key
        found = m.accuracy(key, metrics.custom_name)
        if found is not None:  # top-1 reads as a bare percentage in this line
            what, value = found
            text += f" {value}" if what == "top-1" else f" agree {value}" if what == "agreement" else f" {what} {value}"
        if m.over_budget:
            text += " OVER BUDGET"
        if key == "float" and m.latency_ms is not None:
            text += f" {m.latency_ms.median:.3g} ms"
        elif m.speedup is not None:
            text += f" {m.speedup:.2f}x"
            if m.speedup_p10 is not None:
                text += f" (p10 {m.speedup_p10:.2f}x)"
        parts.append(text)
    chosen = metrics.float_baseline
    why = f"; baseline: FP32 float ({chosen.default} float {chosen.reason or 'misses the budget'})" if chosen else ""
    ships = f"ships {metrics.shipped}: " if metrics.shipped else ""
    return ships + " | ".join(parts) + why


def _precision(model: onnx.ModelProto) -> str:
    """FP32 unless most float weights of the baseline are FP16/BF16 (a user's half-precision ONNX)."""
    from onnx import TensorProto

    counts: dict[int, int] = {}
    for init in model.graph.initializer:
        counts[init.data_type] = counts.get(init.data_type, 0) + 1
    names = {TensorProto.FLOAT: "FP32", TensorProto.FLOAT16: "FP16", TensorProto.BFLOAT16: "BF16"}
    floats = {t: n for t, n in counts.items() if t in names}
    return names[max(floats, key=floats.__getitem__)] if floats else "FP32"
