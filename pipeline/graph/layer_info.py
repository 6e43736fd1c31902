"""Layer information: which ONNX nodes a runtime fused into each of its layers, in the form subgraph mode
reads (``{"source", "layers": [..., each with "onnx_nodes"], "io_tensors"}``). TensorRT's engine inspector
JSON (also what trtexec --exportLayerInfo writes) is the interchange format: the backends that read
layers from their runtime write it, and users pass it as autotune.graph_json. A file format, read without
any runtime."""

from __future__ import annotations

import re
from typing import Any

_ONNX_LAYER = re.compile(r"\[ONNX Layer: ([^\]]*)\]")


def onnx_nodes_of(metadata: str | None) -> list[str]:
    """ONNX node names a TensorRT layer was built from (its Metadata lists `[ONNX Layer: name]` per node,
    separated by \\x1f, with \\x1e between sub-groups)."""
    return _ONNX_LAYER.findall(metadata or "")


def parse_layer_info(obj: dict[str, Any] | list[Any], source: str) -> dict[str, Any]:
    """Normalize engine inspector JSON (also what trtexec --exportLayerInfo writes).

    10.x writes ``{"Layers": [...], "Bindings": [...]}``, 11.x names the second key "I/O Tensors";
    with profiling verbosity below DETAILED a layer is only its name (a string). Every layer keeps
    its original keys and gains ``onnx_nodes``.
    """
    if isinstance(obj, list):
        obj = {"Layers": obj}
    layers = []
    for layer in obj.get("Layers", []):
        rec = {"Name": layer} if isinstance(layer, str) else dict(layer)
        rec["onnx_nodes"] = onnx_nodes_of(rec.get("Metadata"))
        layers.append(rec)
    io = obj.get("I/O Tensors", obj.get("Bindings", []))
    return {"source": source, "layers": layers, "io_tensors": io}


__all__ = ["onnx_nodes_of", "parse_layer_info"]
