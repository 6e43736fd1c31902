"""The ONNX Runtime half of autotune's runtime search: which session settings are worth measuring for
a shipped model, read from the graph ORT actually runs.

ORT rewrites the graph before it runs it, and some of its fusions are slower than what they replace
on a given CPU and shape (a fused SkipLayerNormalization around the residual Adds recovery left
float, BiasGelu on one thread). Each fused op found in ORT's optimized graph names the transformer
that made it (``FUSIONS``, ORT's own transformer names); the gelu approximation where a Gelu runs,
one intra-op thread (where more run now) and the extended optimization level complete the list.
A thread count ships only as a rule that means the same on every machine: ORT's own (one thread per
physical core, the file's 0) or one thread; never a count derived from this host's cores, which would
mean something else on a server with 16 times as many. The search itself is tasks.autotune.runtime.search.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import onnx

from pipeline.backends.base import Backend, SearchSpace
from pipeline.backends.onnxruntime.session import SessionSettings

log = logging.getLogger("tune.autotune")

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


def candidates(optimized: onnx.ModelProto, original: onnx.ModelProto, cores: int) -> list[tuple[str, dict]]:
    """(name, change) for every setting worth measuring on this graph: the transformers whose fused
    ops ORT put in it (LayerNormFusion only where it made LayerNormalization the model did not
    have), the gelu approximation where a Gelu runs, one thread where ``cores`` (the backend's thread
    count) is more, the extended level."""
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
    if cores > 1:
        out.append(("1 intra-op thread", {"threads": 1}))
    return out


def base_settings(backend: Backend) -> SessionSettings:
    """The settings the backend's own keys give (backend.graph_optimization_level, intra_op_threads):
    where the search starts, and what ships when nothing helped."""
    from pipeline.values import enum_value

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


def search_candidates(backend: Backend, shipped: Path) -> tuple[list[tuple[str, dict]], dict[str, Any]]:
    """The candidates for ``shipped`` on this ORT backend, and what the search reports beside its steps:
    the quantized MatMuls ORT still runs in float (named in a warning too)."""
    from pipeline.graph.model import load_model

    with tempfile.TemporaryDirectory(dir=shipped.parent, prefix=".runtime.") as tmp:
        optimized = onnx.load(str(backend.build(shipped, Path(tmp) / "optimized.onnx").engine_path),
                              load_external_data=False)
    original = load_model(shipped, check=False)
    slow = float_matmuls(original, optimized)
    if slow:
        log.info("runtime search: ONNX Runtime runs %d quantized MatMul/Gemm node(s) as float (its integer kernel "
                 "did not take them: their Q/DQ only adds rounding): %s", len(slow), ", ".join(slow[:8]))
    return candidates(optimized, original, backend.threads), {"float_matmuls": slow}


# what autotune's runtime search runs on this runtime (its Backend.search_space())
SPACE = SearchSpace(base_settings, search_candidates, apply_change)
