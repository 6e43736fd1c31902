"""The runtime half of int8 speed: the ONNX Runtime session settings the shipped model runs fastest
with, searched after placement and shipped beside it as autotune/ort_session.json.

ORT rewrites the graph before it runs it, and some of its fusions are slower than what they replace
on a given CPU and shape (a fused SkipLayerNormalization around the residual Adds recovery left
float, BiasGelu on one thread). The candidates come from the graph ORT actually runs: each fused op
found there names the transformer that made it (``FUSIONS``, ORT's own transformer names), plus the
gelu approximation where a Gelu runs, the intra-op thread counts below the machine's cores and the
extended optimization level. The search is greedy and sequential: every candidate is the current
settings plus one change, checked against the accuracy budget, then timed against the current
settings on the same model in paired rounds until the 95% interval of the latency ratio is clear of
``keep_below``; it is kept only when it lies below. Every step is saved to
autotune/runtime_search.json, so an interrupted search resumes at the next candidate.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from pipeline.artifacts import atomic_write_json, read_json
from pipeline.backends.base import time_interleaved
from pipeline.errors import first_line
from pipeline.graph import model_hash
from pipeline.ort import SessionSettings
from tasks.autotune.benchmark import ratio_interval, round_ratios, sequential_verdict
from tasks.autotune.state_file import StateFileKind, check_state, resume_or_set_aside

log = logging.getLogger("tune.autotune")

STATE_VERSION = 1
RUNTIME_STATE = StateFileKind(
    what="runtime search state",
    corrupt_fix="delete it to search the session settings afresh",
    mismatch_fix="delete it to search afresh",
    context_changes="the shipped model, backend or accuracy budget changed",
    context_fix="delete it to search afresh",
)

# fused op (domain, op_type) in ORT's optimized graph -> the graph transformer that made it
FUSIONS: dict[tuple[str, str], str] = {
    ("com.microsoft", "SkipLayerNormalization"): "SkipLayerNormFusion",
    ("com.microsoft", "BiasGelu"): "BiasGeluFusion",
    ("com.microsoft", "Gelu"): "GeluFusion",
    ("com.microsoft", "FastGelu"): "FastGeluFusion",
    ("com.microsoft", "QuickGelu"): "QuickGeluFusion",
    ("com.microsoft", "Attention"): "AttentionFusion",
    ("com.microsoft", "EmbedLayerNormalization"): "EmbedLayerNormFusion",
    ("com.microsoft", "BiasSoftmax"): "BiasSoftmaxFusion",
    ("com.microsoft", "FusedMatMul"): "MatmulTransposeFusion",
    ("com.microsoft", "FusedGemm"): "GemmActivationFusion",
    ("com.microsoft", "FusedConv"): "ConvActivationFusion",
    ("com.microsoft", "MatMulIntegerToFloat"): "MatMulIntegerToFloatFusion",
    ("com.microsoft", "DynamicQuantizeMatMul"): "DynamicQuantizeMatMulFusion",
}
GELU_APPROXIMATION = ("optimization.enable_gelu_approximation", "1")  # Gelu -> FastGelu (tanh form)
_GELU_OPS = {"Gelu", "BiasGelu"}


@dataclass(frozen=True)
class Candidate:
    """One change to the current settings, and what it is called in logs and the state file."""

    name: str
    settings: SessionSettings


def candidates(optimized: onnx.ModelProto, original: onnx.ModelProto, cores: int) -> list[tuple[str, dict]]:
    """(name, change) for every setting worth measuring on this graph: the transformers whose fused
    ops ORT put in it (LayerNormFusion only where it made LayerNormalization the model did not
    have), the gelu approximation where a Gelu runs, fewer threads than ``cores`` (the backend's
    thread count), the extended level."""
    ops = {(n.domain or "", n.op_type) for n in optimized.graph.node}
    out: list[tuple[str, dict]] = [(f"disable {t}", {"disable": t}) for (d, op), t in FUSIONS.items()
                                   if (d, op) in ops]
    had_ln = any(n.op_type == "LayerNormalization" for n in original.graph.node)
    if not had_ln and any(op == "LayerNormalization" for _, op in ops):
        out.append(("disable LayerNormFusion", {"disable": "LayerNormFusion"}))
    if any(op in _GELU_OPS for _, op in ops):
        out.append(("gelu approximation", {"entry": GELU_APPROXIMATION}))
    if any(d == "com.microsoft.nchwc" for d, _ in ops):
        out.append(("graph optimization extended (no NCHWc layout)", {"level": "extended"}))
    out += [(f"{n} intra-op thread{'s' if n > 1 else ''}", {"threads": n}) for n in range(cores - 1, 0, -1)]
    return out


def base_settings(backend: Any) -> SessionSettings:
    """The settings the backend's own keys give (backend.graph_optimization_level, intra_op_threads):
    where the search starts, and what ships when nothing helped."""
    from pipeline.config import enum_value

    return SessionSettings(graph_optimization_level=enum_value(backend.cfg.graph_optimization_level),
                           intra_op_num_threads=int(backend.cfg.intra_op_threads))


def apply_change(settings: SessionSettings, change: dict) -> SessionSettings:
    if "disable" in change:
        return settings.changed(disabled_optimizers=tuple(sorted({*settings.disabled_optimizers, change["disable"]})))
    if "entry" in change:
        entries = dict(settings.config_entries)
        entries[change["entry"][0]] = change["entry"][1]
        return settings.changed(config_entries=tuple(sorted(entries.items())))
    if "level" in change:
        return settings.changed(graph_optimization_level=change["level"])
    return settings.changed(intra_op_num_threads=int(change["threads"]))


def float_matmuls(qmodel: onnx.ModelProto, optimized: onnx.ModelProto) -> list[str]:
    """Quantized MatMul/Gemm nodes of ``qmodel`` (fed by DequantizeLinear) that ORT still runs as a
    float MatMul/Gemm in ``optimized``: its integer kernel did not take them (a signed activation
    feeding several MatMuls, an unsupported zero point), so their Q/DQ only costs time."""
    producer = {o: n.op_type for n in qmodel.graph.node for o in n.output}
    quantized = {n.name for n in qmodel.graph.node if n.op_type in ("MatMul", "Gemm")
                 and any(producer.get(i) == "DequantizeLinear" for i in n.input[:2])}
    return sorted(n.name for n in optimized.graph.node if n.op_type in ("MatMul", "Gemm") and n.name in quantized)


class RuntimeSearch:
    """The greedy search over session settings for one shipped model (see module docstring)."""

    def __init__(self, backend: Any, model: Path, judge: Any, cfg: Any, state_path: Path, context: str):
        self.backend, self.model, self.judge, self.cfg = backend, model, judge, cfg
        self.state_path = state_path
        self.doc: dict[str, Any] = {"version": STATE_VERSION, "model_sha256": model_hash(model), "context": context,
                                    "steps": [], "settings": base_settings(backend).to_dict(), "done": False}

    def _load(self) -> None:
        doc = read_json(self.state_path, RUNTIME_STATE.what)
        if not isinstance(doc, dict) or not isinstance(doc.get("steps"), list):
            raise RUNTIME_STATE.corrupt(self.state_path, "no 'steps' list")
        check_state(doc, self.state_path, RUNTIME_STATE, version=STATE_VERSION,
                    model_sha=self.doc["model_sha256"], context=self.doc["context"])
        try:
            SessionSettings.from_dict(doc.get("settings") or {})
        except (ValueError, TypeError) as exc:
            raise RUNTIME_STATE.corrupt(self.state_path, first_line(exc)) from None
        self.doc = doc

    def run(self, optimized: onnx.ModelProto, original: onnx.ModelProto, cores: int) -> SessionSettings:
        """The settings found (resuming from the state file when it is this model's)."""
        if resume_or_set_aside(self._load, self.state_path, RUNTIME_STATE, own=True):
            log.info("runtime search: resuming from %s (%d candidates measured)", self.state_path.name,
                     len(self.doc["steps"]))
        settings = SessionSettings.from_dict(self.doc["settings"])
        done = {st["name"] for st in self.doc["steps"]}
        t0 = time.time()
        for name, change in candidates(optimized, original, cores):
            if self.doc["done"] or name in done:
                continue
            if time.time() - t0 > float(self.cfg.max_seconds):
                log.info("runtime search: autotune.runtime.max_seconds=%g reached; the rest is not measured",
                         float(self.cfg.max_seconds))
                break
            step = self._step(Candidate(name, apply_change(settings, change)), settings)
            if step["kept"]:
                settings = SessionSettings.from_dict(step["settings"])
                self.doc["settings"] = settings.to_dict()
            self.doc["steps"].append(step)
            atomic_write_json(self.state_path, self.doc, indent=1)
        else:
            self.doc["done"] = True
        atomic_write_json(self.state_path, self.doc, indent=1)
        return settings

    def _step(self, cand: Candidate, current: SessionSettings) -> dict[str, Any]:
        """Judge ``cand`` on the holdout, then time it against ``current`` in paired rounds."""
        step: dict[str, Any] = {"name": cand.name, "settings": cand.settings.to_dict(), "kept": False}
        ref_pm = cand_pm = None
        try:
            ref_pm = self.backend.with_settings(current).prepare(self.model)
            cand_pm = self.backend.with_settings(cand.settings).prepare(self.model)
            verdict = self.judge(cand_pm)
            step["accuracy"] = verdict.to_dict()
            if not verdict.ok:
                step["why"] = f"misses the accuracy budget ({verdict.what})"
                log.info("runtime search: %s: %s", cand.name, step["why"])
                return step
            blocks, errors = time_interleaved(
                [ref_pm, cand_pm], int(self.cfg.max_rounds), max(2, self.backend.timing_runs // 8),
                self.backend.warmup_runs, stop_on_error=True,
                until=lambda b: sequential_verdict(round_ratios(b[0], b[1]), float(self.cfg.keep_below)) is not None)
        except Exception as exc:  # noqa: BLE001 - a setting ORT rejects is a failed step, not a failed run
            step["why"] = f"failed: {first_line(exc)}"
            log.info("runtime search: %s %s", cand.name, step["why"])
            return step
        finally:
            for pm in (ref_pm, cand_pm):
                if pm is not None:
                    pm.close()
        if any(errors):
            step["why"] = f"timing failed: {next(e for e in errors if e)}"
            return step
        ratios = round_ratios(blocks[0], blocks[1])
        low, high = ratio_interval(ratios)
        step.update(ratio=float(sorted(ratios)[len(ratios) // 2]) if ratios else None, interval=[low, high],
                    rounds=len(ratios), kept=high < float(self.cfg.keep_below))
        step["why"] = (f"{step['ratio']:.3f}x the latency (95% interval {low:.3f}-{high:.3f}, {len(ratios)} rounds): "
                       + ("kept" if step["kept"] else f"not below {float(self.cfg.keep_below):g}"))
        log.info("runtime search: %s: %s", cand.name, step["why"])
        return step


def tune_runtime(setup: Any, rcfg: Any) -> tuple[dict[str, Path], dict[str, Any]]:
    """Search the shipped model's session settings (ONNX Runtime only), write autotune/ort_session.json
    and compare float and shipped models with ORT's defaults and with the settings, in one
    interleaved run; (artifacts, metrics["runtime"])."""
    import tempfile

    from pipeline.artifacts import fingerprint
    from pipeline.graph import load_model

    backend, out = setup.backend, setup.out
    if backend.name != "onnxruntime":
        return {}, {"searched": False, "why": f"session settings are searched on ONNX Runtime only, not {backend.name}"}
    shipped = out / "optimized_final.onnx"
    path = out / "ort_session.json"
    base = base_settings(backend)
    if not bool(rcfg.enabled):
        base.save(path)
        return {"autotune/ort_session.json": path}, {"searched": False, "why": "autotune.runtime.enabled=false",
                                                     "settings": base.to_dict()}
    with tempfile.TemporaryDirectory(dir=out, prefix=".runtime.") as tmp:
        optimized = onnx.load(str(backend.build(shipped, Path(tmp) / "optimized.onnx").engine_path),
                              load_external_data=False)
    original = load_model(shipped, check=False)
    slow = float_matmuls(original, optimized)
    if slow:
        log.info("runtime search: ONNX Runtime runs %d quantized MatMul/Gemm node(s) as float (its integer kernel "
                 "did not take them: their Q/DQ only adds rounding): %s", len(slow), ", ".join(slow[:8]))
    # max_seconds is left out: raising it must let an unfinished search go on, not start it again
    context = fingerprint({**setup.context_items, "shipped": model_hash(shipped),
                           "runtime": {k: rcfg[k] for k in ("max_rounds", "keep_below")}})
    search = RuntimeSearch(backend, shipped, setup.judge, rcfg, out / "runtime_search.json", context)
    settings = search.run(optimized, original, backend.threads)
    metrics: dict[str, Any] = {"steps": search.doc["steps"], "float_matmuls": slow}
    if settings != base:
        metrics.update(_honest_speedups(backend, setup.baseline_path, shipped, settings))
        ms = metrics.get("p10_ms")
        if ms is None or ms["shipped_tuned"] >= ms["shipped_default"]:
            # each step was paired against the previous settings; the final guard compares the end
            # result with the start once more, and the defaults ship unless it is faster there too
            log.info("runtime search: %s measured no faster than the backend's own settings in the final "
                     "comparison; shipping those", settings.describe())
            metrics["rejected"] = settings.to_dict()
            settings = base
            for k in ("speedup_vs_float_default", "speedup_vs_float_same_settings"):
                metrics.pop(k, None)
    settings.save(path)
    metrics.update(searched=True, settings=settings.to_dict(), describe=settings.describe())
    log.info("runtime search: ships %s%s", settings.describe(),
             f" ({metrics['speedup_vs_float_default']:.2f}x float with ORT's defaults, "
             f"{metrics['speedup_vs_float_same_settings']:.2f}x float with the same settings)"
             if "speedup_vs_float_default" in metrics else "")
    return {"autotune/ort_session.json": path, "autotune/runtime_search.json": out / "runtime_search.json"}, metrics


def _honest_speedups(backend: Any, float_path: Path, shipped: Path, settings: SessionSettings) -> dict[str, Any]:
    """p10 latencies of float and shipped models, with ORT's default session and with ``settings``,
    from one interleaved run: a runtime win is not reported as a quantization win."""
    from pipeline.backends.base import compare_prepared

    plain, tuned = backend, backend.with_settings(settings)
    prepared = []
    try:
        for b, p in ((plain, float_path), (tuned, float_path), (plain, shipped), (tuned, shipped)):
            prepared.append(b.prepare(p))
        t = compare_prepared(backend.name, prepared, rounds=6, runs_per_round=max(2, backend.timing_runs // 6),
                             warmup_runs=backend.warmup_runs)
    finally:
        for pm in prepared:
            pm.close()
    if not all(x.ok for x in t):
        return {"comparison_error": next(x.error for x in t if not x.ok)}
    ms = {k: x.p10_ms for k, x in zip(("float_default", "float_tuned", "shipped_default", "shipped_tuned"), t,
                                      strict=True)}
    return {"p10_ms": ms, "speedup_vs_float_default": ms["float_default"] / ms["shipped_tuned"],
            "speedup_vs_float_same_settings": ms["float_tuned"] / ms["shipped_tuned"],
            "speedup_default_session": ms["float_default"] / ms["shipped_default"]}
