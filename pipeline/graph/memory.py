"""How much memory a pass over a model needs, and how to split one that would not fit.

A pass that observes intermediate tensors (calibration, smoothing statistics) holds the model's
weights (in ONNX Runtime) and, per batch, the tensors it asked for. ``tensor_nbytes`` sizes those
tensors from the graph alone (shape inference on a skeleton whose large constants carry dims but no
data, so a model past 2 GB costs nothing extra to size); ``observation_groups`` splits the tensors into
groups that each fit a budget: the pass then runs the model once per group and batch, slower but
bounded; ``check_weights_fit`` is the one-line error for a model whose weights alone do not fit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper

from pipeline.errors import InputError
from pipeline.graph.model import value_dims
from pipeline.graph.shapes import skeleton

GB = 1024**3


def machine_memory_bytes() -> int:
    """Physical memory of this machine (0 where the OS does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def _itemsize(elem_type: int) -> int:
    try:
        return int(np.dtype(helper.tensor_dtype_to_np_dtype(elem_type)).itemsize)
    except (KeyError, TypeError, ValueError):
        return 4


def weights_nbytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's initializers, from their dims (external data is not read)."""
    return sum(weights_nbytes_of(t) for t in model.graph.initializer)


def weights_nbytes_of(t: onnx.TensorProto) -> int:
    return int(np.prod(t.dims, dtype=np.int64)) * _itemsize(t.data_type)


def tensor_nbytes(model: onnx.ModelProto) -> dict[str, int]:
    """Bytes of every tensor whose shape is static after shape inference (of the main graph)."""
    try:
        inferred = onnx.shape_inference.infer_shapes(skeleton(model), strict_mode=False)
    except Exception:  # noqa: BLE001 - sizing is best effort: unknown sizes are estimated by the caller
        inferred = model
    out: dict[str, int] = {}
    for vi in (*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output):
        dims = value_dims(vi)
        if vi.type.tensor_type.HasField("shape") and all(isinstance(d, int) for d in dims):
            out[vi.name] = int(np.prod(dims, dtype=np.int64)) * _itemsize(vi.type.tensor_type.elem_type)
    return out


def observation_groups(tensors: Sequence[str], sizes: dict[str, int], budget: float | None) -> list[list[str]]:
    """``tensors`` in order, cut into groups whose summed sizes stay within ``budget`` bytes (one group
    when there is no budget; a tensor of unknown size counts as the largest known one; a tensor
    larger than the budget forms its own group)."""
    if budget is None or not tensors:
        return [list(tensors)] if tensors else []
    fallback = max(sizes.values(), default=0)
    groups: list[list[str]] = [[]]
    used = 0
    for t in tensors:
        n = sizes.get(t, fallback)
        if groups[-1] and used + n > budget:
            groups.append([])
            used = 0
        groups[-1].append(t)
        used += n
    return groups


def memory_limit_bytes(max_memory_gb: float | None) -> float:
    """The working-set bound: ``max_memory_gb``, else 80% of this machine's memory (inf if unknown)."""
    if max_memory_gb is not None:
        return float(max_memory_gb) * GB
    ram = machine_memory_bytes()
    return 0.8 * ram if ram else float("inf")


def check_weights_fit(model: onnx.ModelProto, limit: float, key: str) -> int:
    """The model's weight bytes; an InputError when they alone exceed ``limit`` bytes."""
    weights = weights_nbytes(model)
    if weights > limit:
        ram = machine_memory_bytes()
        raise InputError(f"the model's weights alone take {weights / GB:.2f} GB, over {key}={limit / GB:.2f} GB "
                         f"(this machine has {ram / GB:.1f} GB of memory); raise {key} or quantize on a machine "
                         "with more memory")
    return weights


__all__ = ["GB", "check_weights_fit", "machine_memory_bytes", "memory_limit_bytes", "observation_groups",
           "tensor_nbytes", "weights_nbytes", "weights_nbytes_of"]
