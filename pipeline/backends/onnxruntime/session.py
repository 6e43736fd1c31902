"""ONNX Runtime sessions on ONNX models, for every stage that runs a model in ORT (export checks,
calibration, bias correction, smoothing, subgraph extraction) and for the ORT backend: session
options by optimization level, the settings a tuned model ships with (``SessionSettings``), a
session on a proto, bytes or path with intermediate tensors as extra outputs, a session that runs a
Q/DQ model as its plain math (``qdq_math_session``), and the guard that keeps ORT's int8 QDQ
rewrites away from FP8 models.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from pipeline.backends.settings import RuntimeSettings, check_integer, string_map
from pipeline.graph import weights
from pipeline.graph.model import graph_reads
from pipeline.graph.weights import fits_one_proto, save_external

_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "layout": "ORT_ENABLE_LAYOUT",
    "all": "ORT_ENABLE_ALL",
}


SPINNING = "session.intra_op.allow_spinning"  # session config entry: worker threads spin between runs
# intra-op threads of the pipeline's own sessions: the run's backend.intra_op_threads (0, ORT's choice,
# outside a run); per run: a ContextVar
_THREADS: ContextVar[int] = ContextVar("pipeline_ort_threads", default=0)


def configured_threads() -> int:
    """The intra-op thread count of the pipeline's own sessions (0, ORT's choice, outside a run)."""
    return _THREADS.get()


@contextlib.contextmanager
def threads_configured(threads: int) -> Iterator[None]:
    """Give the pipeline's own sessions (calibration, transforms, checks) the run's thread count for the
    block: `backend.intra_op_threads=1` means one thread for all of ONNX Runtime's work (shared machines,
    and qemu-user, whose multi-threaded guests crash). The previous count is back after it, also when it
    raises."""
    token = _THREADS.set(int(threads))
    try:
        yield
    finally:
        _THREADS.reset(token)


def ort_session_options(optimization: str = "all", *, threads: int | None = None,
                        optimized_path: str | os.PathLike | None = None, spinning: bool | None = None) -> Any:
    """ONNX Runtime SessionOptions: graph optimization ``optimization`` (disable, basic, extended,
    layout, all), ``threads`` intra-op threads (0: ORT's choice; None: the run's, threads_configured),
    errors-only logging, ORT's optimized graph saved to ``optimized_path`` if given, and worker threads
    that spin between runs or not as ``spinning`` says (None: ORT's default, they spin)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    if spinning is not None:
        so.add_session_config_entry(SPINNING, "1" if spinning else "0")
    so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[optimization])
    so.intra_op_num_threads = _THREADS.get() if threads is None else threads
    so.log_severity_level = 3
    if optimized_path:
        so.optimized_model_filepath = str(optimized_path)
    return so


@dataclass(frozen=True)
class SessionSettings(RuntimeSettings):
    """The ONNX Runtime session settings a model ships with (autotune/ort_session.json): they are not
    stored in the .onnx file, and speed depends on them (a fusion that is slower than what it
    replaces, the thread count). Defaults are ORT's own."""

    what = "ORT session settings"

    disabled_optimizers: tuple[str, ...] = ()  # ORT graph transformer names, e.g. "SkipLayerNormFusion"
    config_entries: tuple[tuple[str, str], ...] = string_map()  # session config entries, e.g. gelu approximation
    graph_optimization_level: str = "all"  # all | extended | basic | disable
    intra_op_num_threads: int = 0  # 0: ORT's choice (one per physical core)

    def __post_init__(self) -> None:
        super().__post_init__()
        names = self.disabled_optimizers
        if isinstance(names, str) or not isinstance(names, (list, tuple)):
            raise ValueError(f"disabled_optimizers={names!r}, expected a list of ORT graph transformer names")
        self._set("disabled_optimizers", tuple(str(x) for x in names))
        if not isinstance(self.graph_optimization_level, str) or self.graph_optimization_level not in _LEVELS:
            raise ValueError(f"graph_optimization_level={self.graph_optimization_level!r}, expected one of "
                             f"{', '.join(_LEVELS)}")
        check_integer("intra_op_num_threads", self.intra_op_num_threads, 0)

    def session(self, model: str | os.PathLike, providers: Iterable[str] = ("CPUExecutionProvider",)) -> Any:
        """An InferenceSession of ``model`` with these settings, as they were measured (one inter-op
        thread, FP8 models kept away from ORT's int8 QDQ rewrites): what a deployment runs."""
        so = self.apply(ort_session_options(spinning=True))
        so.inter_op_num_threads = 1
        disable_qdq_fusion_if_fp8(so, model)
        return inference_session(model, so, providers=providers, disabled_optimizers=self.disabled_optimizers)

    def apply(self, so: Any) -> Any:
        """Set these settings on a SessionOptions (disabled_optimizers go to ``inference_session``)."""
        import onnxruntime as ort

        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _LEVELS[self.graph_optimization_level])
        if self.intra_op_num_threads:
            so.intra_op_num_threads = self.intra_op_num_threads
        for key, value in self.config_entries:
            so.add_session_config_entry(key, value)
        return so

    def describe(self) -> str:
        parts = [f"disabled {', '.join(self.disabled_optimizers)}"] if self.disabled_optimizers else []
        parts += [f"{k}={v}" for k, v in self.config_entries]
        if self.graph_optimization_level != "all":
            parts.append(f"graph optimization {self.graph_optimization_level}")
        if self.intra_op_num_threads:
            parts.append(f"{self.intra_op_num_threads} intra-op thread(s)")
        return "; ".join(parts) or "ORT's defaults"


BY_PATH_BYTES = 64 * 2**20  # protos larger than this reach ORT through a temporary file


def inference_session(model: onnx.ModelProto | bytes | str | os.PathLike, options: Any = None, *,
                extra_outputs: Iterable[str] = (), providers: Iterable[str] = ("CPUExecutionProvider",),
                disabled_optimizers: Iterable[str] = ()) -> Any:
    """An InferenceSession for a model (proto, serialized bytes or path) with ``options`` (see
    ort_session_options; None: ORT's defaults) on ``providers``. ``extra_outputs`` (a proto only)
    become graph outputs too, so intermediate tensors can be read from ``run``;
    ``disabled_optimizers`` names ORT graph transformers to skip (SessionSettings)."""
    import onnxruntime as ort

    if options is None:
        options = ort_session_options()
    for k, v in weights.session_entries(model if isinstance(model, (onnx.ModelProto, bytes)) else b"").items():
        options.add_session_config_entry(k, v)  # where a proto's on-disk weights are (pipeline.graph.weights)
    if isinstance(model, onnx.ModelProto) and not fits_one_proto(model):
        # over 2 GB there are no bytes to hand over: ORT reads the model saved with external data

        with tempfile.TemporaryDirectory(prefix="qdq-tune-ort-") as tmp:
            path = Path(tmp) / "model.onnx"
            save_external(model, path, extra_outputs)
            return inference_session(path, options, providers=providers, disabled_optimizers=disabled_optimizers)
    if isinstance(model, onnx.ModelProto):
        data: bytes | str = with_outputs(model, extra_outputs).SerializeToString()
    elif extra_outputs:
        raise TypeError("inference_session: extra_outputs needs the model as an onnx.ModelProto")
    else:
        data = model if isinstance(model, bytes) else str(model)
    if isinstance(data, bytes) and len(data) > BY_PATH_BYTES:
        # ORT parsing serialized bytes holds a copy beside its own; reading from a file holds less

        with tempfile.TemporaryDirectory(prefix="qdq-tune-ort-") as tmp:
            path = Path(tmp) / "model.onnx"
            weights.share_into(data, tmp)
            path.write_bytes(data)
            del data
            return inference_session(path, options, providers=providers, disabled_optimizers=disabled_optimizers)
    disabled = list(disabled_optimizers)
    if disabled:
        return ort.InferenceSession(data, sess_options=options, providers=list(providers),
                                    disabled_optimizers=disabled)
    return ort.InferenceSession(data, sess_options=options, providers=list(providers))


def qdq_math_session(model: onnx.ModelProto, threads: int = 0, extra_outputs: Iterable[str] = (),
                     options: Any = None, providers: Iterable[str] = ("CPUExecutionProvider",)) -> Any:
    """A session that runs a Q/DQ ``model`` as its plain math: no graph optimization, so every
    QuantizeLinear, DequantizeLinear and float op runs as written (with ``extra_outputs`` readable).
    ``options``: the session options to start from (their optimization level is turned off), else
    ``threads`` intra-op threads. Each DequantizeLinear of a constant is computed once, here, as ORT's
    kernel computes it (``fold_constant_dequantize``: otherwise each run makes a float copy of every
    weight, 60% of a BERT-base's run), and handed to ORT in place (its external initializers: no copy,
    no serialization), with prepacking off, so the float kernels read those values as they read a
    DequantizeLinear's output: the same outputs bit for bit."""
    import onnxruntime as ort

    if options is None:
        options = ort_session_options("disable", threads=threads)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    folded = fold_constant_dequantize(model)
    values = [ort.OrtValue.ortvalue_from_numpy(v) for v in folded.values.values()]
    if values:
        options.add_session_config_entry("session.disable_prepacking", "1")
        options.add_external_initializers(list(folded.values), values)
    session = inference_session(folded.model, options, extra_outputs=extra_outputs, providers=providers)
    session.qdq_tune_folded = values  # ORT reads them where they are: they live as long as the session
    return session


FOLDED_BYTES = 2**30  # float values fold_constant_dequantize adds at most (past it, ORT computes the rest per run)
_FOLDED_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16, onnx.TensorProto.UINT16,
                 onnx.TensorProto.INT32)
_FOLDED_LOCATION = "qdq-tune-folded"  # the placeholders' location: ORT takes their values from the session options


@dataclass(frozen=True)
class FoldedModel:
    """A Q/DQ model whose DequantizeLinear of constants are computed: ``model`` reads each one's output
    as an initializer held outside it (a placeholder with its type and shape), ``values`` by name."""

    model: onnx.ModelProto
    values: dict[str, np.ndarray]


def fold_constant_dequantize(model: onnx.ModelProto, budget: int = FOLDED_BYTES) -> FoldedModel:
    """``model`` with each main-graph DequantizeLinear whose inputs are all initializers (an integer
    value, a float32 scale: per tensor or per axis, no blocks) replaced by the float32 values it
    computes, (x - zero point) as float times the scale as ORT's kernel does, up to ``budget`` bytes;
    ``model`` itself and no values where there is none."""
    inits = {i.name: i for i in model.graph.initializer}
    folded: dict[str, np.ndarray] = {}
    for n in model.graph.node:
        if n.op_type != "DequantizeLinear" or n.domain not in ("", "ai.onnx") or len(n.input) < 2 \
                or not all(t in inits for t in n.input if t) or any(a.name == "block_size" for a in n.attribute):
            continue
        x, scale = inits[n.input[0]], inits[n.input[1]]
        size = 4 * int(np.prod(x.dims))
        if x.data_type not in _FOLDED_TYPES or scale.data_type != onnx.TensorProto.FLOAT or size > budget:
            continue
        y = _dequantized(n, weights.array(x), weights.array(scale),
                         weights.array(inits[n.input[2]]) if len(n.input) > 2 and n.input[2] else None)
        if y is not None:
            folded[n.output[0]] = y
            budget -= size
    if not folded:
        return FoldedModel(model, {})
    out = weights.without_initializers(model)
    del out.graph.node[:]
    out.graph.node.extend(n for n in model.graph.node if not (n.op_type == "DequantizeLinear" and n.output[0] in folded))
    read = graph_reads(out.graph)
    out.graph.initializer.extend(i for i in model.graph.initializer if i.name in read)
    for name, y in folded.items():
        t = out.graph.initializer.add(name=name, data_type=onnx.TensorProto.FLOAT, dims=y.shape,
                                      data_location=onnx.TensorProto.EXTERNAL)
        t.external_data.add(key="location", value=_FOLDED_LOCATION)
    return FoldedModel(out, folded)


def _dequantized(node: onnx.NodeProto, values: np.ndarray, scale: np.ndarray, zero_point: np.ndarray | None
                 ) -> np.ndarray | None:
    """What ORT's DequantizeLinear ``node`` computes from constant inputs, in float32; None where its
    inputs are not a layout the kernel takes (it is left to the kernel, which refuses it)."""
    zp = zero_point if zero_point is not None else np.zeros(scale.shape, values.dtype)
    if zp.shape != scale.shape or scale.ndim > 1:
        return None
    if scale.ndim == 1 and scale.size != 1:  # per axis: one scale per element along the axis
        axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        if not -values.ndim <= axis < values.ndim or values.shape[axis] != scale.size:
            return None
        shape = [1] * values.ndim
        shape[axis] = -1
        scale, zp = scale.reshape(shape), zp.reshape(shape)
    elif scale.ndim == 1:  # one scale as a 1-D tensor: per tensor
        scale, zp = scale.reshape(()), zp.reshape(())
    if values.dtype.itemsize > 2:  # the difference of two such integers is exact in float32 only as int64
        y = (values.astype(np.int64) - zp.astype(np.int64)).astype(np.float32)
    else:
        y = values.astype(np.float32)
        if np.any(zp):
            y -= zp.astype(np.float32)
    y *= scale.astype(np.float32, copy=False)
    return y


def with_outputs(model: onnx.ModelProto, tensors: Iterable[str]) -> onnx.ModelProto:
    """A copy of ``model`` with ``tensors`` that are not graph outputs yet added as untyped outputs;
    the model itself when there is nothing to add."""
    existing = {o.name for o in model.graph.output}
    new = [t for t in tensors if t not in existing]
    if not new:
        return model
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for t in new:
        m.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
    return m


_FP8_TYPES = (17, 18, 19, 20)  # FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ


def has_fp8(model: str | Path | bytes | Any) -> bool:
    """Whether a model stores FP8 tensors (its Q/DQ pairs must not go through ORT's QDQ fusions)."""
    if isinstance(model, (str, Path)):
        model = onnx.load(str(model), load_external_data=False)
    elif isinstance(model, bytes):
        model = onnx.load_from_string(model)
    return any(i.data_type in _FP8_TYPES for i in model.graph.initializer)


def disable_qdq_fusion_if_fp8(so: Any, model: str | Path | bytes | Any) -> None:
    """Keep ORT's int8-minded QDQ rewrites away from FP8 models.

    ORT's CPU QDQ selectors do not check the quantized type: they fuse FP8 DQ -> Conv into a
    QLinearConv that fails type checking, and the level-2 ReluQuantFusion drops a Relu before an
    FP8 Q because zero point 0 "is the bottom of the range" (true for uint8 only), which changes
    results. FP8 Q/DQ has no fast kernels on the CPU EP anyway, so such models run at basic level.
    """
    if has_fp8(model):
        import onnxruntime as ort

        so.add_session_config_entry("session.disable_quant_qdq", "1")
        if so.graph_optimization_level.value > ort.GraphOptimizationLevel.ORT_ENABLE_BASIC.value:
            so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
