"""Human-readable outputs of the evaluate stage: report.md and summary.png, both built from metrics."""

from __future__ import annotations

import logging
import math
import shlex
from pathlib import Path
from typing import Any

from pipeline.accuracy.budget import AccuracyVerdict
from pipeline.accuracy.fidelity import FidelityResult
from pipeline.artifacts import atomic_output
from pipeline.config import STAGE_ORDER
from pipeline.records.evaluate import EvaluateMetrics, MachineSummary, ModelMetrics, QuantizationSummary
from pipeline.stage import StageContext
from tasks.evaluate import _runtimes

log = logging.getLogger("tune.evaluate")

_COLORS = {"float": "#7f7f7f", "float_fp32": "#c7c7c7", "float_default": "#c7c7c7", "ptq": "#1f77b4", "autotuned": "#ff7f0e"}
_SOURCES = {
    "digits": "scikit-learn digits, held-out test split",
    "synthetic": "seeded synthetic data",
    "none": "seeded synthetic data (no data configured)",
    "npz": "npz evaluation data",
    "custom": "custom data (split=evaluation)",
}


def _pct(v: float | None) -> str:
    return "–" if v is None else f"{100 * v:.2f}%"


def _num(v: float | None, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def _snr(m: ModelMetrics) -> str:
    v = m.scores.snr_db
    if m.scores.identical_outputs or (v is not None and math.isinf(v) and v > 0):
        return "∞ (identical)"
    if v is None or math.isnan(v):
        return "–"
    return f"{v:.1f}"


def _fidelity_text(fid: FidelityResult | None, verdict: AccuracyVerdict) -> str:
    """The kernel-fidelity clause of a budget line. The fused int8 kernels and the plain Q/DQ math
    round differently, so they never match exactly; the difference is a fault only where it puts
    the model over the budget (then it is the likely cause), not when the fused run is noisier but
    still within it."""
    if fid is None or not fid.checked:
        return ""
    snr = f"output SNR {_num(fid.snr_db, '.1f')} dB between them"
    if fid.ok:
        return f"; fused kernels match the plain Q/DQ math ({snr})"
    more = f", {fid.noise_ratio:.1f}x the Q/DQ math's error vs float" if fid.noise_ratio is not None else ""
    if verdict.ok:
        return f"; fused kernels round differently from the plain Q/DQ math ({snr}{more}), within the budget as run"
    return f"; fused kernels disagree with the plain Q/DQ math ({snr}{more}), a likely cause"


def markdown(metrics: EvaluateMetrics) -> str:
    """report.md: what was compared and how, the table, the budget, the machine, how to reproduce."""
    sections = (_header(metrics), _table(metrics), _runtimes.section(metrics), _session(metrics), _budget(metrics),
                _sensitivity(metrics), _machine(metrics), _duplicates(metrics), _definitions(), _reproduce(metrics))
    return "\n".join(line for section in sections for line in section)


def _header(metrics: EvaluateMetrics) -> list[str]:
    """Title, baseline, the data scored and how latency was measured."""
    data = metrics.data
    lat = metrics.latency
    lines = [
        f"# Evaluation: {metrics.model_name}",
        "",
        f"Baseline for every speedup: **{metrics.baseline}**{_baseline_choice(metrics)}.",
        "",
        *_ships(metrics),
        f"Data: {_SOURCES.get(data.source, data.source)}, {data.samples} samples in {data.batches} batches of "
        f"{data.batch_size}" + (" (labelled)." if data.labelled else " (no labels: accuracy not scored)."),
    ]
    if lat is not None:
        lines.append(
            f"Latency: all models measured in one interleaved run, {lat.rounds} rounds x {lat.runs_per_round} "
            f"runs each after {lat.warmup_runs} warm-up runs; speedup = float median / model median "
            f"(ratio of p10s in brackets, the steadier figure on a busy machine)."
        )
        if lat.warning:
            lines.append(f"**Warning:** {lat.warning}.")
    else:
        lines.append("Latency: not measured (evaluate.latency=false).")
    return lines + _other_float(metrics)


_SHIPPED = {"float": "the float model (no quantized model was faster within the budget)",
            "ptq": "the PTQ model (quantize/quantized_model.onnx)", "autotuned": "the autotuned model"}


def _ships(metrics: EvaluateMetrics) -> list[str]:
    """What ships, where a quantized model was evaluated beside the float one."""
    shipped = metrics.shipped
    return [f"Ships: **{_SHIPPED.get(shipped, shipped)}**.", ""] if shipped else []


def _baseline_choice(metrics: EvaluateMetrics) -> str:
    """Why the baseline is the FP32 float (autotune's choice), or "" where it is the runtime's own."""
    chosen = metrics.float_baseline
    if chosen is None:
        return ""
    verdict = chosen.verdict.what if chosen.verdict is not None else None
    runs = "the float model and PTQ run" if "ptq" in metrics.models else "the float model runs"
    if chosen.reason == "is slower here":
        why = (f"the runtime's own {chosen.default} float is slower here (the FP32 float runs at "
               f"{_num(chosen.fp32_ratio, '.2f')}x its latency)")
    else:
        why = (f"the runtime's own {chosen.default} float misses the accuracy budget against it"
               + (f" ({verdict})" if verdict else ""))
    return f", as autotune chose it: {why}; {runs} in FP32"


def _other_float(metrics: EvaluateMetrics) -> list[str]:
    """The float model in the precision the baseline does not run: FP32 where the baseline is the
    runtime's own lower precision, the runtime's own where the baseline is FP32 (autotune's choice).
    Its accuracy next to the baseline's, and how much faster the runtime's own float is."""
    models = metrics.models
    key = "float_default" if "float_default" in models else "float_fp32"
    m, base = models.get(key), models["float"]
    if m is None:
        return []
    if m.custom_metric is not None:
        acc = f"`{metrics.custom_name}` {_num(m.custom_metric, '.4g')} (baseline {_num(base.custom_metric, '.4g')})"
    elif m.scores.top1 is not None:
        acc = f"top-1 {_pct(m.scores.top1)} (baseline {_pct(base.scores.top1)})"
    else:
        acc = f"agreement {_pct(m.scores.agreement)} with the baseline"
    acc += f", SNR {_snr(m)} dB against the baseline's outputs"
    lat = metrics.latency
    speed = "not timed"
    if m.latency_ms is not None and lat is not None and lat.float_speedup_over_fp32_p10:
        t, x = m.latency_ms, lat.float_speedup_over_fp32_p10
        speed = f"{t.median:.3f} ms median, {t.p10:.3f} ms p10; " + (
            f"it runs at {x:.2f}x the FP32 float's speed (p10)" if key == "float_default"
            else f"the runtime's own float (the baseline) is {x:.2f}x faster (p10)")
    if key == "float_fp32" or metrics.float_baseline is None:
        return [f"The float model run in FP32 on the same runtime: {acc}; {speed}."]
    chosen = metrics.float_baseline
    why = "runs slower here" if chosen.reason == "is slower here" else "misses the accuracy budget"
    return [f"The float model run in the runtime's own precision ({chosen.default}), not the baseline as it "
            f"{why}: {acc}; {speed}."]


def _table(metrics: EvaluateMetrics) -> list[str]:
    """One row per model: accuracy, agreement with float, latency and speedup."""
    k = metrics.top_k
    custom = metrics.custom_name
    head = ["model", "file", *([f"`{custom}`"] if custom else []), "top-1",
            *([f"top-{k}"] if k > 1 else []), "agreement", "cosine", "SNR dB", "median ms", "p10 ms", "p90 ms",
            "speedup"]
    lines = ["", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for key, m in metrics.models.items():
        ref = key == "float"
        row = [m.label, f"`{m.file}`", *([_num(m.custom_metric, ".4g")] if custom else []), _pct(m.scores.top1)]
        if k > 1:
            row.append(_pct(m.scores.topk if m.scores.top_k == k else None))
        if ref:
            row += ["reference", "reference", "reference"]
        else:
            row += [_pct(m.scores.agreement), _num(m.scores.cosine, ".5f"), _snr(m)]
        if m.latency_ms is not None:
            t = m.latency_ms
            row += [f"{t.median:.3f}", f"{t.p10:.3f}", f"{t.p90:.3f}"]
            row.append("1.00x (baseline)" if ref else f"{_num(m.speedup, '.2f')}x ({_num(m.speedup_p10, '.2f')}x)")
        else:
            row += ["–", "–", "–", "–"]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _session(metrics: EvaluateMetrics) -> list[str]:
    """The autotuned model's shipped runtime settings, and its speedup against float run with them too."""
    m = metrics.models.get("autotuned")
    s = m.same_session if m is not None else None
    if s is None:
        return []
    defaults = s.settings_defaults + (" in FP32" if metrics.float_baseline is not None else "")
    return ["", f"The autotuned model runs with the {s.settings_what} in `{s.settings_file}` ({s.session}): "
                f"{_num(m.speedup, '.2f')}x ({_num(m.speedup_p10, '.2f')}x) against float with "
                f"{defaults} (the table), {s.speedup:.2f}x ({s.speedup_p10:.2f}x) against float run with the same "
                f"settings."]


def _budget(metrics: EvaluateMetrics) -> list[str]:
    """Each quantized model against the accuracy budget, with the kernel-fidelity clause."""
    if not metrics.budget:
        return []
    lines = ["", "## Accuracy budget", "", f"Budget: {metrics.budget} (`accuracy.*`)."]
    custom = metrics.custom_metric
    if custom is not None:
        scores = ", ".join(f"{metrics.models[k].label} {_num(v, '.6g')}" for k, v in custom.scores.items())
        source = "a function passed to pipeline.api.tune()" if custom.path.startswith("pipeline.data.live.") \
            else f"`{custom.path}`"
        lines.append(f"Custom metric `{custom.name}` ({source}; higher is better): {scores}.")
    classes = metrics.models["float"].scores.class_outputs
    lines.append("Treated as class scores (agreement, top-1): " + (", ".join(f"`{c}`" for c in classes)
                 or "no output") + " (`accuracy.class_outputs`).")
    for key, m in metrics.models.items():
        v = m.budget
        if key == "float" or v is None:
            continue
        verdict = "within budget" if v.ok else "**OVER BUDGET**"
        lines.append(f"- {m.label}: {verdict}: {v.what}{_fidelity_text(m.kernel_fidelity, v)}.")
        promise = m.promise
        if promise is not None and promise.holdout is not None:
            lines.append(f"  Promised on the held-out calibration samples: {promise.holdout.what}; "
                         f"{'kept' if promise.evaluation_ok else '**not kept**'} on the evaluation data.")
        if not v.ok and v.passing:
            lines.append(f"  Output{'s' if len(v.passing) > 1 else ''} {', '.join(f'`{p}`' for p in v.passing)} "
                         f"meet the budget on their own: if only they matter, set `accuracy.outputs=[{','.join(v.passing)}]`.")
    for text in metrics.over_budget:
        lines.append(f"- **{text}**")
    if metrics.promise_unchecked:
        lines.append(f"- The holdout verdicts are not checked on unseen data: {metrics.promise_unchecked}.")
    return lines


def _sensitivity(metrics: EvaluateMetrics) -> list[str]:
    """Where the error comes from: the largest per-node contributions and the charts."""
    sens = metrics.sensitivity
    if sens is None:
        return []
    top = ", ".join(f"`{r.node}` ({r.op_type}, {r.label})" for r in sens.top)
    lines = ["", "## Where the error comes from", "",
             f"Each of the {sens.nodes} quantized nodes of the {sens.model} model"
             + (f" (the first {sens.nodes} of {sens.quantized_nodes}, `evaluate.sensitivity.max_nodes`)"
                if sens.quantized_nodes > sens.nodes else "") + " quantized alone in the float "
             f"graph (the whole model: {sens.whole_model}). Largest contributions: {top}.", ""]
    if "sensitivity.png" in sens.files:
        lines.append("![per-node sensitivity](sensitivity.png)")
    if "ranges.png" in sens.files:
        lines += ["", "Calibration ranges of the activations the largest contributors read "
                      "(histogram on the evaluation data, dashed: the range the Q node represents):", "",
                  "![ranges](ranges.png)"]
    if sens.left_float:
        lines += ["", f"Left float by recovery (marked grey in the chart): {', '.join(f'`{n}`' for n in sens.left_float)}."]
    lines += ["", "Data: `evaluate/sensitivity.json`."]
    return lines


def _machine(metrics: EvaluateMetrics) -> list[str]:
    """The CPU the models ran on and what the quantize stage did for accuracy on it."""
    q = metrics.quantization or QuantizationSummary()
    mach = metrics.machine
    if mach is None:
        return []
    lines = ["", "## Machine and quantization", "", f"CPU: {mach.cpu_line}."]
    sat = mach.cpu.u8s8_saturates
    if sat is not None:
        lines.append("u8 x s8 integer kernels: " + ("may saturate (no VNNI): exact variants needed." if sat
                                                    else "exact (int32 dot-product instructions)."))
    if q.weight_range:
        lines.append(f"Weight storage: {q.weight_range} ({q.weight_range_reason}).")
        if q.weight_range == "full" and sat is False:
            lines.append("These full-range int8 weights are exact on CPUs with VNNI or AMX only: where u8 x s8 "
                         "kernels saturate (AVX2 without VNNI) they may lose accuracy. For such a target, tune "
                         "for it too (`target.cpus=[avx2]`, or `target=x86` for every x86 kind).")
    lines += _kinds(mach)
    if mach.quantized_on and mach.quantized_on != mach.cpu.brand:
        lines.append(f"Quantized on a different CPU: {mach.quantized_on}.")
    lines += _accuracy_steps(q)
    if q.float_nodes:
        lines.append(f"Left float to meet the accuracy budget ({len(q.float_nodes)} nodes, "
                     f"see quantize/sensitivity.json): {', '.join(f'`{n}`' for n in q.float_nodes)}.")
    if q.body_nodes:
        lines.append(f"Inside Loop/Scan bodies: {len(q.body_nodes)} nodes quantized "
                     f"({', '.join(f'`{n}`' for n in q.body_nodes)}); autotune tunes the main graph and keeps "
                     f"the quantize stage's placement inside the bodies.")
    return lines


def _kinds(mach: MachineSummary) -> list[str]:
    """The shipped deployment's verdict on each CPU kind, and how each was reached."""
    checked = mach.checked_on
    if checked is None or not checked.kinds:
        return []
    lines = ["", f"Accuracy of the shipped deployment per CPU kind (checked on {checked.cpu}, {checked.runtime} "
                 f"{checked.versions.get(checked.runtime, '')}, {checked.precision} float layers; target: "
                 f"{', '.join(checked.target) or 'this host'}):", "",
             "| CPU kind | verdict | how |", "|---|---|---|"]
    for k in checked.kinds:
        state = "not judged" if k.ok is None else ("meets the budget" if k.ok else "**MISSES the budget**")
        what = f": {k.verdict.what}" if k.verdict is not None else ""
        target = " (target)" if k.kind in checked.target else ""
        lines.append(f"| {k.kind}{target} | {state}{what} | {k.how}{'; ' + k.note if k.note else ''} |")
    return lines


def _duplicates(metrics: EvaluateMetrics) -> list[str]:
    """Models left out of the table because their file is byte-identical to one in it."""
    lines = []
    for d in metrics.duplicates:
        same = metrics.models[d.identical_to].label
        lines += ["", f"`{d.file}` ({d.model}) is byte-identical to the {same} model and was evaluated once."]
    return lines


def _definitions() -> list[str]:
    """What the table's agreement, cosine and SNR columns mean."""
    return [
        "",
        "Agreement: share of predictions (argmax of the first output over its last axis) equal to the float "
        "model's. Cosine: mean per-sample cosine similarity of the first output with the float model's. "
        "SNR: 10·log10(Σ float² / Σ (model − float)²) over all outputs.",
    ]


def _reproduce(metrics: EvaluateMetrics) -> list[str]:
    """The commands that rebuild this results_dir and that re-run only the evaluation."""
    lines = ["", "## Reproduce", ""]
    r = metrics.reproduce
    if r.in_memory:
        lines += [f"The {' and '.join(r.in_memory)} came from a Python session through "
                  "`pipeline.api.tune`: call it again with the same objects and these overrides (a shell cannot "
                  "reach them).", ""]
    lines += [
        "```sh",
        r.full,
        "```",
        "",
        "Re-run only the evaluation on the models already in results_dir:",
        "",
        "```sh",
        r.evaluate_only,
        "```",
        "",
        "The composed config of the last run is in `.hydra/config.yaml`; each stage's config is in `manifest.json`.",
        "",
    ]
    return lines


def plot(metrics: EvaluateMetrics, path: Path) -> Path:
    """Two panels: latency per model (median, p10-p90 bars) and accuracy (or agreement) per model."""
    # the object-oriented API with the Agg canvas draws without pyplot's global state or a display
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    keys = list(metrics.models)
    labels = [metrics.models[k].label for k in keys]
    colors = [_COLORS.get(k, "#2ca02c") for k in keys]
    fig = Figure(figsize=(10, 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    ax_lat, ax_acc = fig.subplots(1, 2)
    _latency_panel(ax_lat, metrics, keys, colors)
    _accuracy_panel(ax_acc, metrics, keys, colors)
    for ax in (ax_lat, ax_acc):
        ax.set_xticks(list(range(len(keys))), labels)
        ax.set_xlim(-0.6, len(keys) - 0.4)
    fig.suptitle(f"Evaluation of {metrics.model_name}\nbaseline: {metrics.baseline}", fontsize=10)
    with atomic_output(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    return Path(path)


def _latency_panel(ax: Any, metrics: EvaluateMetrics, keys: list[str], colors: list[str]) -> None:
    """Median latency per model with p10-p90 whiskers, each bar labelled with its speedups."""
    models = metrics.models
    times = [models[k].latency_ms for k in keys]
    if metrics.latency is None or any(t is None for t in times):
        ax.text(0.5, 0.5, "latency not measured\n(evaluate.latency=false)", ha="center", va="center",
                transform=ax.transAxes)
        ax.set_yticks([])
        ax.set_title("Latency", fontsize=10)
        return
    med = [t.median for t in times]
    lo = [t.median - t.p10 for t in times]
    hi = [t.p90 - t.median for t in times]
    ax.bar(list(range(len(keys))), med, width=0.6, color=colors, yerr=[lo, hi], capsize=6, ecolor="black")
    for i, k in enumerate(keys):
        sp, sp10 = models[k].speedup, models[k].speedup_p10
        text = f"{med[i]:.3g} ms"
        if k != "float" and sp is not None:
            text += f"\n{sp:.2f}x" + ("" if sp10 is None else f" (p10: {sp10:.2f}x)")
        ax.annotate(text, (i, med[i] + hi[i]), xytext=(0, 4), textcoords="offset points",
                    ha="center", va="bottom", fontsize=9)
    ax.set_ylim(0, max(m + h for m, h in zip(med, hi, strict=True)) * 1.3)
    ax.set_ylabel(f"latency per batch of {metrics.data.batch_size} (ms)")
    ax.set_title("Latency (median, whiskers p10–p90; lower is better)", fontsize=10)


def _accuracy_panel(ax: Any, metrics: EvaluateMetrics, keys: list[str], colors: list[str]) -> None:
    """The custom metric per model in its own units, else top-1 accuracy (or agreement with float)."""
    models = metrics.models
    custom = metrics.custom_metric
    if custom is not None:  # the user's own metric is the accuracy that counts: plotted in its own units
        name = custom.name
        vals = [models[k].custom_metric for k in keys]
        heights = [0.0 if v is None else v for v in vals]
        texts = ["n/a" if v is None else f"{v:.4g}" for v in vals]
        ax.set_ylim(min(0.0, *heights) * 1.12, max(1e-12, *heights) * 1.12)
        title, ylabel = f"custom metric {name}", name
    else:
        labelled = metrics.data.labelled
        title, ylabel = (("Top-1 accuracy", "top-1 accuracy (%)") if labelled else
                         ("Argmax agreement with float", "agreement with float (%)"))
        vals = [models[k].scores.top1 if labelled else models[k].scores.agreement for k in keys]
        heights = [0.0 if v is None else 100 * v for v in vals]
        texts = ["n/a" if v is None else f"{100 * v:.2f}%" for v in vals]
        ax.set_ylim(0, 112)
        ax.set_yticks(range(0, 101, 20))
    ax.bar(list(range(len(keys))), heights, width=0.6, color=colors)
    for i, text in enumerate(texts):
        ax.annotate(text, (i, heights[i]), xytext=(0, 4), textcoords="offset points", ha="center",
                    va="bottom", fontsize=9)
    ax.set_ylabel(ylabel)
    ax.set_title(f"{title}, {metrics.data.samples} samples (higher is better)", fontsize=10)


_TRANSFORMS = {"fold_scales": ("Scales folded into the layer before a MatMul", "Div/Mul node(s)"),
               "equalization": ("Cross-layer equalization", "conv pair(s)"),
               "smoothing": ("Outlier smoothing", "tensor(s)")}


def _accuracy_steps(q: QuantizationSummary) -> list[str]:
    """What the quantize stage did to make int8 accurate: transforms, bias correction, kernel culprits."""
    lines = []
    for t in q.transforms or []:
        name, unit = _TRANSFORMS.get(t.transform, (t.transform, "change(s)"))
        if t.applied:
            muls = sum(bool(c.get("inserted_mul")) for c in t.changes)
            extra = f", {muls} by an inserted Mul" if muls else ""
            lines.append(f"{name}: {len(t.changes)} {unit}{extra}; float outputs within {t.float_rel_error or 0.0:.1e} "
                         "of the original.")
        else:
            lines.append(f"{name}: not applied ({t.reason}).")
    b = q.bias_correction
    if b is not None:
        lines.append(f"Bias correction: {'applied to ' + str(b.nodes) + ' node(s)' if b.applied else 'not kept'}"
                     + (f" ({b.before} -> {b.after})" if b.after else f" ({b.reason})" if b.reason else "") + ".")
    if q.fidelity_culprits:
        lines.append("Left float because their fused kernels disagree with the Q/DQ reference on this CPU: "
                     + ", ".join(f"`{n}`" for n in q.fidelity_culprits) + ".")
    return lines


def backend_text(info: dict[str, Any]) -> str:
    """The runtime in a few words, e.g. 'onnxruntime (version 1.32.0; CPUExecutionProvider; 2 threads)'."""
    name = info.get("backend", "?")
    details = [f"{k} {v}" for k, v in info.items() if k not in ("backend", "providers", "threads")
               and isinstance(v, (str, int, float))]
    if info.get("providers"):
        details.append(", ".join(info["providers"]))
    if info.get("threads"):
        details.append(f"{info['threads']} threads")
    return f"{name} ({'; '.join(details)})" if details else str(name)


def _run_overrides(results_dir: Path) -> list[str]:
    """The overrides of the run: its Hydra job's, else (a run made outside a Hydra job: tune-rechoose) those
    of the run that wrote results_dir/.hydra/, else none (library use)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            return [str(o) for o in HydraConfig.get().overrides.task]
        recorded = results_dir / ".hydra" / "overrides.yaml"
        if recorded.is_file():
            from omegaconf import OmegaConf

            return [str(o) for o in OmegaConf.load(recorded)]
    except Exception:  # noqa: BLE001 - a record that cannot be read leaves no overrides to repeat
        log.debug("no overrides to repeat", exc_info=True)
    return []


def reproduce_commands(ctx: StageContext) -> dict[str, str]:
    """`tune` command lines that rebuild this results_dir and that re-run only the evaluation."""

    done = {s for s, e in ctx.manifest.stages.items() if e.get("status") == "done"}
    stages = [s for s in STAGE_ORDER if s in done or s == "evaluate"]
    overrides = [o for o in _run_overrides(ctx.results_dir) if o.split("=", 1)[0].lstrip("+~") not in
                 ("results_dir", "stages", "backend.tuned_only")]
    rd = str(ctx.results_dir.resolve())

    def cmd(stage_list: list[str]) -> str:
        args = [*overrides, f"stages=[{','.join(stage_list)}]", f"results_dir={rd}"]
        return " ".join(["tune", *(shlex.quote(a) for a in args)])

    from pipeline.data.live import in_memory_groups

    return {"full": cmd(stages), "evaluate_only": cmd(["evaluate"]), "in_memory": in_memory_groups(ctx.cfg)}
