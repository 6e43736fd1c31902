"""What every TensorRT backend shares: ``tensorrt``, ``tensorrt_rtx`` and ``trtexec``.

- ``EngineBuildConfig``: what one engine build asks for, declared once: it is the
  `gen_trt_engine.tensorrt` schema (its YAML keys are the field names) and what every builder takes
  (measurement builds fill it from the backend section);
- ``plugin_paths``: plugin libraries checked and made absolute;
- ``shape_problems`` and ``profile_shapes``: the check of explicit min/opt/max shapes and the
  optimization profile a model needs (explicit shapes or the batch shortcut);
- the parser of the builder's own layer table (the engine inspector's JSON, also what trtexec
  --exportLayerInfo writes, is read by ``pipeline.graph.layer_info``);
- ``tensorrt_qdq_view``: a Q/DQ model as TensorRT can parse it (ORT's uint8 asymmetric Q/DQ and
  int32 bias DQs rewritten as symmetric int8 and float biases by ``to_symmetric_int8`` and
  ``fold_int32_biases``).

Nothing here imports TensorRT: config validation and the trtexec backend use it without one.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from pipeline.artifacts import user_path
from pipeline.backend_config import DataType, EngineBuildConfig, shape_problems

# --------------------------------------------------------------------------- build options
from pipeline.errors import InputError, StageError
from pipeline.graph import weights
from pipeline.graph.layer_info import onnx_nodes_of
from pipeline.graph.model import graph_inputs, graph_reads, subgraphs, value_dims

PLUGIN_KEYS = "backend.plugin_libraries / gen_trt_engine.tensorrt.plugin_libraries"


def plugin_paths(libraries: list[str] | Any, key: str = PLUGIN_KEYS) -> list[str]:
    """Plugin libraries as absolute paths (relative to where tune started), each an existing file,
    duplicates dropped; a missing one is an InputError naming ``key``."""
    out: list[str] = []
    for lib in libraries or []:
        p = user_path(lib)
        if not p.is_file():
            raise InputError(f"plugin library {p} does not exist ({key})")
        out.append(str(p))
    return list(dict.fromkeys(out))


def profile_shapes(model: onnx.ModelProto, options: EngineBuildConfig,
                   source: str = "model") -> dict[str, tuple[list[int], list[int], list[int]]]:
    """Min/opt/max shape per input that needs an optimization profile (empty for static models).

    Inputs named in the explicit shapes take them as given; an input whose only dynamic dim is the
    first takes the batch shortcut (TAO's min/opt/max batch size); any other dynamic input is an
    error naming the keys to set.
    """
    # -1 for every dim that is not a positive number
    dims = {vi.name: [d if isinstance(d, int) and d > 0 else -1 for d in value_dims(vi)] for vi in graph_inputs(model)}
    named = set(options.min_shapes) | set(options.opt_shapes) | set(options.max_shapes)
    unknown = sorted(named - set(dims))
    if unknown:
        raise StageError(f"gen_trt_engine.tensorrt shapes name {unknown}, but {source} has inputs {sorted(dims)}")
    problems = shape_problems(options.min_shapes, options.opt_shapes, options.max_shapes)
    if problems:
        raise StageError("; ".join(problems))
    out: dict[str, tuple[list[int], list[int], list[int]]] = {}
    for name, d in dims.items():
        if name in named:
            shapes = tuple([int(v) for v in s[name]] for s in (options.min_shapes, options.opt_shapes,
                                                               options.max_shapes))
            for s in shapes:
                if len(s) != len(d):
                    raise StageError(f"gen_trt_engine.tensorrt shapes for '{name}' have rank {len(s)}, but "
                                     f"{source} declares rank {len(d)} ({d})")
            out[name] = shapes  # type: ignore[assignment]
            continue
        if -1 not in d:
            continue
        if d[0] == -1 and -1 not in d[1:]:
            rest = d[1:]
            out[name] = ([options.min_batch_size, *rest], [options.opt_batch_size, *rest],
                         [options.max_batch_size, *rest])
            continue
        shown = "x".join("N" if v == -1 else str(v) for v in d)
        raise StageError(
            f"{source} input '{name}' has dynamic dims ({shown}) beyond the batch: give them with "
            f"gen_trt_engine.tensorrt.min_shapes/opt_shapes/max_shapes, e.g. "
            f"gen_trt_engine.tensorrt.opt_shapes='{{{name}: [{', '.join('1' if v == -1 else str(v) for v in d)}]}}'"
        )
    return out


# --------------------------------------------------------------------------- layer information

_LAYER_LINE = re.compile(r"^Name: (?P<name>.*?), LayerType: (?P<type>[^,]*),")
_TACTIC = re.compile(r", TacticName: (?P<tactic>.*?), StreamId: (?P<stream>\d+)")
_METADATA = re.compile(r", Metadata: (?P<meta>.*)$")


def parse_builder_layers(message: str) -> dict[str, Any]:
    """Parse the layer table the builder logs (VERBOSE, with DETAILED profiling verbosity).

    It is the only source of fusion information when the engine cannot be deserialized, which is the
    case for TensorRT-RTX engines built on a machine without a GPU. One line per layer:
    ``Name: <n>, LayerType: <t>, Inputs: [...], ..., TacticName: <x>, StreamId: 0, Metadata: <m>``.
    """
    layers = []
    for line in message.splitlines():
        m = _LAYER_LINE.match(line.strip())
        if not m:
            continue
        rec: dict[str, Any] = {"Name": m["name"], "LayerType": m["type"]}
        t = _TACTIC.search(line)
        if t:
            rec["TacticName"] = t["tactic"]
        md = _METADATA.search(line)
        rec["Metadata"] = md["meta"].strip() if md else ""
        rec["onnx_nodes"] = onnx_nodes_of(rec["Metadata"])
        layers.append(rec)
    return {"source": "build_log", "layers": layers, "io_tensors": []}


# --------------------------------------------------------------------------- Q/DQ as TensorRT takes it


def _graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """A graph and its subgraphs (control-flow bodies, nested ones included): quantize places Q/DQ in
    Loop/Scan bodies too, each with its scales and zero points among the body's own initializers."""
    yield graph
    for n in graph.node:
        for sub in subgraphs(n):
            yield from _graphs(sub)


def _drop_unread(graph: onnx.GraphProto) -> None:
    used = graph_reads(graph)
    live = [i for i in graph.initializer if i.name in used]
    del graph.initializer[:]
    graph.initializer.extend(live)


def fold_int32_biases(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Replace DequantizeLinear nodes of int32 initializers (ORT-style biases) by float initializers."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    count = 0
    for graph in list(_graphs(out.graph)):
        inits = {i.name: i for i in graph.initializer}
        keep = []
        for n in graph.node:
            if n.op_type == "DequantizeLinear" and n.input[0] in inits and inits[n.input[0]].data_type == TensorProto.INT32:
                q = weights.array(inits[n.input[0]]).astype(np.float64)
                s = weights.array(inits[n.input[1]])
                axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
                if s.ndim == 1 and q.ndim > 0:
                    shape = [1] * q.ndim
                    shape[axis if axis >= 0 else q.ndim + axis] = -1
                    s = s.reshape(shape)
                graph.initializer.append(numpy_helper.from_array((q * s).astype(s.dtype), n.output[0]))
                count += 1
            else:
                keep.append(n)
        del graph.node[:]
        graph.node.extend(keep)
        _drop_unread(graph)
    return out, count


def has_asymmetric_uint8(model: onnx.ModelProto) -> bool:
    """Whether any Q/DQ node has a uint8 zero point (ORT's CPU convention, which TensorRT rejects)."""
    for graph in _graphs(model.graph):
        inits = {i.name: i for i in graph.initializer}
        if any(n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2
               and n.input[2] in inits and inits[n.input[2]].data_type == TensorProto.UINT8 for n in graph.node):
            return True
    return False


def to_symmetric_int8(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Rewrite uint8 (asymmetric, ORT's CPU convention) Q/DQ pairs as symmetric int8 for TensorRT.

    TensorRT only takes symmetric signed Q/DQ. The calibrated range [lo, hi] a uint8 pair encodes,
    lo = -zp * s and hi = (255 - zp) * s, becomes scale max(|lo|, |hi|) / 127 with zero point 0:
    same placement, same calibrated range. Returns the new model and the number of pairs rewritten.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    count = 0
    for graph in list(_graphs(out.graph)):
        inits = {i.name: i for i in graph.initializer}
        done: dict[tuple[str, str], tuple[str, str]] = {}
        for n in graph.node:
            if n.op_type not in ("QuantizeLinear", "DequantizeLinear") or len(n.input) < 3:
                continue
            zp_t = inits.get(n.input[2])
            if zp_t is None or zp_t.data_type != TensorProto.UINT8:
                continue
            key = (n.input[1], n.input[2])
            if key not in done:
                s = weights.array(inits[n.input[1]]).astype(np.float64)
                z = weights.array(zp_t).astype(np.float64)
                amax = np.maximum(np.abs(-z * s), np.abs((255.0 - z) * s))
                new_s = np.where(amax > 0, amax / 127.0, 1.0).astype(
                    helper.tensor_dtype_to_np_dtype(inits[n.input[1]].data_type))
                s_name, z_name = f"{n.input[1]}_s8", f"{n.input[2]}_s8"
                graph.initializer.extend([numpy_helper.from_array(new_s, s_name),
                                          numpy_helper.from_array(np.zeros(z.shape, np.int8), z_name)])
                done[key] = (s_name, z_name)
                count += 1
            n.input[1], n.input[2] = done[key]
        _drop_unread(graph)
    return out, count


@contextlib.contextmanager
def tensorrt_qdq_view(model_path: Path, note: Callable[[str], None] | None = None) -> Iterator[Path]:
    """The model as TensorRT can parse it: ORT's CPU conventions (uint8 asymmetric Q/DQ, int32 bias
    DQs) rewritten as symmetric int8 and float biases in a temporary copy next to the original (so
    external data still resolves)."""
    model = onnx.load(str(model_path), load_external_data=False)
    converted, nb = fold_int32_biases(model)
    n = 0
    if has_asymmetric_uint8(converted):
        converted, n = to_symmetric_int8(converted)
    if n == 0 and nb == 0:
        yield model_path
        return
    fd, tmp = tempfile.mkstemp(prefix=f".{model_path.stem}.s8.", suffix=".onnx", dir=model_path.parent)
    os.close(fd)
    try:
        Path(tmp).write_bytes(converted.SerializeToString())
        if note is not None:
            note(f"{model_path.name}: rewrote {n} uint8 asymmetric Q/DQ scale/zero-point pairs as symmetric int8 "
                 f"and {nb} int32 bias DQs as float biases (TensorRT takes symmetric int8 only; same placement "
                 f"and calibrated ranges)")
        yield Path(tmp)
    finally:
        Path(tmp).unlink(missing_ok=True)


__all__ = ["PLUGIN_KEYS", "DataType", "EngineBuildConfig", "fold_int32_biases",
           "has_asymmetric_uint8", "parse_builder_layers", "plugin_paths", "profile_shapes", "shape_problems",
           "tensorrt_qdq_view", "to_symmetric_int8"]
