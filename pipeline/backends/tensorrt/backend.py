"""TensorRT backends: the `tensorrt` Python API and the same code path on TensorRT-RTX.

build = parse the ONNX file with TensorRT's ONNX parser, configure the builder (strongly typed
network for Q/DQ models, precision flags for float models, workspace, optimization profile, timing
cache, plugins) and serialize the engine; measure = deserialize it, bind device buffers and time
``execute_async_v3`` with CUDA events.

Building and measuring have different requirements, so they are checked separately:
``check_available`` only needs the Python module (TensorRT-RTX builds ahead of time on a CPU-only
machine), while anything that runs an engine asks for a CUDA GPU first and says so in one line.
Device buffers, streams and events come from torch's CUDA runtime (a CUDA build of torch).

The build's set-up beyond the network (precision flag, timing cache, plugin libraries) is in
``pipeline.backends.tensorrt.builder``, the captured TensorRT log and parser errors in
``pipeline.backends.tensorrt.build_log``. What the trtexec backend shares with these (build options,
profile shapes, plugin paths, layer-info parsers) lives in ``pipeline.backends.tensorrt.common``.
"""

from __future__ import annotations

import importlib
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from omegaconf import DictConfig

from pipeline.artifacts import atomic_output, atomic_write_text
from pipeline.backends.base import (
    Backend,
    BuildResult,
    Deployment,
    ModelIO,
    PreparedModel,
    SearchSpace,
    ShippedSettings,
    Timing,
)
from pipeline.backends.tensorrt.build_log import ParseError, capture_logger, parser_errors
from pipeline.backends.tensorrt.builder import (
    PluginLibraries,
    open_timing_cache,
    save_timing_cache,
    set_precision,
)
from pipeline.backends.tensorrt.common import (
    EngineBuildConfig,
    parse_builder_layers,
    profile_shapes,
    tensorrt_qdq_view,
)
from pipeline.backends.tensorrt.settings import TrtBuildSettings
from pipeline.data.adapters import fixed_feeds
from pipeline.errors import BackendUnavailable, StageError
from pipeline.graph.layer_info import parse_layer_info
from pipeline.graph.model import InputSpec, has_qdq, input_specs

log = logging.getLogger("tune.backend")

ENGINE_SUFFIXES = (".engine", ".plan", ".trt")


# --------------------------------------------------------------------------- running engines

# TensorRT DataType name -> torch dtype name
_TORCH_DTYPES = {"FLOAT": "float32", "HALF": "float16", "BF16": "bfloat16", "INT8": "int8", "INT32": "int32",
                 "INT64": "int64", "BOOL": "bool", "UINT8": "uint8", "FP8": "float8_e4m3fn"}


class TensorRTPrepared(PreparedModel):
    """A deserialized engine with device buffers bound once; runs on its own CUDA stream."""

    def __init__(self, trt: Any, engine: Any, io: ModelIO, device: int, torch: Any, keep_alive: tuple[Any, ...] = ()):
        self.trt, self.engine, self.specs, self.torch = trt, engine, io.specs, torch
        self._keep_alive = keep_alive  # runtime and logger must outlive the engine
        self.device = torch.device("cuda", device)
        self.stream = torch.cuda.Stream(device=self.device)
        self.context = engine.create_execution_context()
        if self.context is None:
            raise StageError("TensorRT could not create an execution context (out of GPU memory?)")
        tensors = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
        self.input_names = [n for n in tensors if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.engine_outputs = [n for n in tensors if n not in self.input_names]
        # ONNX output order, as ORT returns them, so outputs compare one to one across backends
        self.output_names = [n for n in io.output_names if n in self.engine_outputs] or self.engine_outputs
        self.buffers: dict[str, Any] = {}
        self._bind({s.name: s.shape for s in self.specs})
        self.run_feeds(fixed_feeds(self.specs))

    def _torch_dtype(self, name: str) -> Any:
        dt = self.engine.get_tensor_dtype(name)
        return getattr(self.torch, _TORCH_DTYPES.get(getattr(dt, "name", str(dt)), "float32"))

    def _allowed(self, name: str) -> str:
        """The shapes the engine accepts for an input, for error messages."""
        try:
            lo, opt, hi = ([int(d) for d in s] for s in self.engine.get_tensor_profile_shape(name, 0))
        except Exception:  # noqa: BLE001 - a static engine has no profile
            return f"the engine was built for {list(self.engine.get_tensor_shape(name))}"
        return f"the engine's optimization profile allows min {lo}, opt {opt}, max {hi}"

    def _bind(self, shapes: dict[str, tuple[int, ...]]) -> None:
        torch = self.torch
        for name in self.input_names:
            shape = tuple(shapes[name])
            if not self.context.set_input_shape(name, shape):
                raise StageError(f"TensorRT rejected shape {list(shape)} for input '{name}': {self._allowed(name)}")
            buf = self.buffers.get(name)
            if buf is None or tuple(buf.shape) != shape:
                self.buffers[name] = torch.empty(shape, dtype=self._torch_dtype(name), device=self.device)
        for name in [*self.input_names, *self.engine_outputs]:
            if name not in self.input_names:
                shape = tuple(self.context.get_tensor_shape(name))
                buf = self.buffers.get(name)
                if buf is None or tuple(buf.shape) != shape:
                    self.buffers[name] = torch.empty(shape, dtype=self._torch_dtype(name), device=self.device)
            self.context.set_tensor_address(name, self.buffers[name].data_ptr())

    def run_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        torch = self.torch
        shapes = {n: tuple(np.asarray(feeds[n]).shape) for n in self.input_names}
        if any(tuple(self.buffers[n].shape) != s for n, s in shapes.items()):
            self._bind(shapes)
        with torch.cuda.stream(self.stream):
            for n in self.input_names:
                self.buffers[n].copy_(torch.from_numpy(np.ascontiguousarray(feeds[n])), non_blocking=False)
        self.stream.synchronize()

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        self.run_feeds(feeds)
        if not self.context.execute_async_v3(self.stream.cuda_stream):
            raise StageError("TensorRT execute_async_v3 failed (see the TensorRT log)")
        self.stream.synchronize()
        out = []
        for n in self.output_names:
            t = self.buffers[n]
            if t.dtype in (self.torch.bfloat16, getattr(self.torch, "float8_e4m3fn", None)):
                t = t.float()  # numpy has no bf16/fp8
            out.append(t.cpu().numpy())
        return out

    def time_runs(self, n: int) -> list[float]:
        torch = self.torch
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        handle = self.stream.cuda_stream
        for s, e in zip(starts, ends, strict=True):
            s.record(self.stream)
            self.context.execute_async_v3(handle)
            e.record(self.stream)
        self.stream.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)]

    def close(self) -> None:
        self.context = None
        self.buffers = {}
        self.engine = None
        self._keep_alive = ()


# --------------------------------------------------------------------------- backends


class TensorRTBackend(Backend):
    """TensorRT through its Python API (`tensorrt`, TensorRT 10.x or later)."""

    name = "tensorrt"
    module_names: tuple[str, ...] = ("tensorrt",)
    install_hint = "pip install 'qdq-tune[tensorrt]'"
    package_title = "the TensorRT Python package"
    builds_without_gpu = False
    supports_timing_cache = True
    shipped_settings: ShippedSettings | None = ShippedSettings(
        TrtBuildSettings, "autotune/trt_build.json", "build settings", "the backend's own build settings")
    # the builder settings a tuned model ships with (autotune/trt_build.json): set on every build's config
    settings: TrtBuildSettings | None = None

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        self._trt: Any = None
        self._timing_cache: Any = None  # shared by every build of this backend instance
        self._plugins = PluginLibraries(self.name)
        # a stage may point this into its results_dir folder to keep the build logs of measurements
        self.logs_dir: Path | None = None
        # shared with the copies with_settings makes, so their build logs never take one name
        self._builds = itertools.count(1)

    # ------------------------------------------------------------------ availability
    def search_space(self) -> SearchSpace | None:
        from pipeline.backends.tensorrt import search

        return None if self.shipped_settings is None else search.SPACE

    def check_available(self) -> None:
        self._module()

    def _module(self) -> Any:
        if self._trt is not None:
            return self._trt
        first_error: str | None = None
        for name in self.module_names:
            try:
                self._trt = importlib.import_module(name)
                return self._trt
            except ModuleNotFoundError as exc:
                if exc.name != name and first_error is None:
                    first_error = f"{type(exc).__name__}: {exc}"
            except ImportError as exc:  # installed but its shared libraries do not load
                if first_error is None:
                    first_error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if first_error:
            raise BackendUnavailable(f"backend={self.name}: importing {self.module_names[0]} failed ({first_error}); "
                                     f"reinstall it with {self.install_hint} (or use backend=onnxruntime)")
        raise BackendUnavailable(f"backend={self.name} needs {self.package_title}: {self.install_hint} "
                                 f"(or use backend=onnxruntime)")

    @property
    def trt(self) -> Any:
        return self._module()

    def _cuda(self, what: str) -> Any:
        """torch with a usable CUDA device, or one line saying what is missing and what still works."""
        try:
            import torch
        except ImportError:
            torch = None
        if torch is None or not torch.cuda.is_available():
            if self.builds_without_gpu:
                also = ("building engines works without one (stages=[...,gen_trt_engine]); "
                        "backend=onnxruntime measures on the CPU")
            else:
                also = ("TensorRT needs the GPU to build engines too; backend=tensorrt_rtx builds them on the CPU "
                        "and backend=onnxruntime measures on the CPU")
            raise BackendUnavailable(f"backend={self.name} cannot {what} here: no CUDA GPU is visible (needs an "
                                     f"NVIDIA GPU and a CUDA build of torch); {also}")
        n = torch.cuda.device_count()
        if not 0 <= int(self.cfg.device) < n:
            raise BackendUnavailable(f"backend.device={self.cfg.device}: this machine has {n} CUDA device(s) "
                                     f"(0..{n - 1})")
        return torch

    # ------------------------------------------------------------------ options
    def default_options(self) -> EngineBuildConfig:
        """Build options for measurement builds, from the backend section alone."""
        return EngineBuildConfig.from_backend_cfg(self.cfg)

    # ------------------------------------------------------------------ build
    def _build_serialized(self, model_path: Path, options: EngineBuildConfig, logger: Any,
                          source: Path | None = None) -> tuple[Any, dict[str, Any]]:
        """Parse ``model_path`` and build; returns the serialized engine (IHostMemory) and facts about the build.

        ``source`` is the file the user gave when ``model_path`` is a temporary rewrite of it
        (``tensorrt_qdq_view``): messages, the log and ``info["source"]`` name it, not the copy.
        """
        trt = self.trt
        source = source or model_path
        model = onnx.load(str(model_path), load_external_data=False)
        strongly_typed = has_qdq(model)
        shapes = profile_shapes(model, options, source=source.name)
        info: dict[str, Any] = {**self.describe(), "source": str(source), "strongly_typed": strongly_typed}
        logger.note(f"{self.trt.__name__} {getattr(trt, '__version__', '?')} building {source}")
        self._plugins.load(self.trt, list(options.plugin_libraries), logger)
        builder = self._builder(logger)
        # the parser owns the weights the network refers to: it lives until the build is done
        network, _parser = self._network(builder, model_path, strongly_typed, logger)
        config = self._builder_config(builder, options, strongly_typed, shapes, info, logger)

        self._use_timing_cache(config, options.timing_cache_path, logger)
        t0 = time.perf_counter()
        serialized = builder.build_serialized_network(network, config)
        info["build_seconds"] = round(time.perf_counter() - t0, 3)
        if serialized is None:
            reason = "; ".join(logger.errors[-3:]) or "no reason given"
            raise StageError(f"{self.name} failed to build an engine from {source.name}: {reason}")
        self._save_timing_cache(config, options.timing_cache_path, logger)
        info["engine_bytes"] = int(serialized.nbytes)
        info["layers"] = len(parse_builder_layers(logger.layer_table)["layers"]) if logger.layer_table else None
        return serialized, info

    def _builder(self, logger: Any) -> Any:
        """A TensorRT builder, or one line saying why none could be made (TensorRT needs a GPU for it)."""
        try:
            return self.trt.Builder(logger)
        except Exception as exc:  # noqa: BLE001 - a failed CUDA init surfaces as a nullptr factory error
            reason = "; ".join(logger.errors[-2:]) or str(exc)
            if self.builds_without_gpu:
                raise StageError(f"{self.name} could not create a builder: {reason}") from None
            raise BackendUnavailable(f"backend={self.name} could not create a builder ({reason}); TensorRT needs a "
                                     f"CUDA GPU to build; backend=tensorrt_rtx builds on the CPU") from None

    def _network(self, builder: Any, model_path: Path, strongly_typed: bool, logger: Any) -> tuple[Any, Any]:
        """(network, parser) of ``model_path``; ParseError with the parser's errors when it fails."""
        trt = self.trt
        flags = 0
        if strongly_typed:
            # Q/DQ models: precision comes from the Q/DQ nodes and the ONNX types (TensorRT 10 needs the
            # flag; TensorRT 11 is always strongly typed and ignores it)
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(model_path)):
            errors = parser_errors(parser) or logger.errors[-3:] or ["unknown parser error"]
            for e in errors:
                logger.note(f"parser error: {e}")
            raise ParseError(errors)
        return network, parser

    def _builder_config(self, builder: Any, options: EngineBuildConfig, strongly_typed: bool,
                        shapes: dict[str, Any], info: dict[str, Any], logger: Any) -> Any:
        """The builder config of one build (workspace, verbosity, optimization level, tuned settings,
        precision, optimization profile); what it chose goes into ``info``."""
        trt = self.trt
        config = builder.create_builder_config()
        if options.workspace_size:
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_size) << 20)
        # DETAILED keeps layer names, tactics and the fused ONNX nodes in the engine (engine inspector)
        config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
        level = self.cfg.get("builder_optimization_level")
        if level is not None and hasattr(config, "builder_optimization_level"):
            config.builder_optimization_level = int(level)
        if self.settings is not None:  # the tuned settings, over the backend's own
            self.settings.apply(trt, config)
            logger.note(f"build settings: {self.settings.describe()}")
        info["data_type"] = set_precision(trt, config, options.data_type.value, strongly_typed, logger)

        if shapes:
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in shapes.items():
                profile.set_shape(name, lo, opt, hi)
            config.add_optimization_profile(profile)
            info["profile"] = {n: {"min": s[0], "opt": s[1], "max": s[2]} for n, s in shapes.items()}
            logger.note(f"optimization profile {info['profile']}")
        return config

    def _use_timing_cache(self, config: Any, path: Path | None, logger: Any) -> None:
        if not self.supports_timing_cache:
            if path is not None:
                log.debug("%s: timing cache %s not used (deprecated in TensorRT-RTX)", self.name, path)
                logger.note(f"timing cache {path} not used: deprecated in TensorRT-RTX")
            return
        self._timing_cache = open_timing_cache(config, self._timing_cache, path, logger)

    def _save_timing_cache(self, config: Any, path: Path | None, logger: Any) -> None:
        if not self.supports_timing_cache or path is None:
            return
        cache = save_timing_cache(config, path, logger)
        if cache is not None:
            self._timing_cache = cache

    def _engine_bytes(self, model_path: Path, options: EngineBuildConfig, log_path: Path | None) -> tuple[Any, dict, Any]:
        """Build (or read, for an engine file) and always write the log, also when the build fails."""
        logger = capture_logger(self.trt)
        if model_path.suffix.lower() in ENGINE_SUFFIXES:
            self._plugins.load(self.trt, list(options.plugin_libraries), logger)
            return model_path.read_bytes(), {"source": str(model_path)}, logger
        try:
            with tensorrt_qdq_view(model_path, logger.note) as parse_path:
                serialized, info = self._build_serialized(parse_path, options, logger, source=model_path)
        except ParseError as exc:
            where = self._write_log(logger, log_path)
            n = len(exc.errors)
            shown = "; ".join(exc.errors[:8]) + (f"; ... {n - 8} more" if n > 8 else "")
            raise StageError(f"{self.name} cannot parse {model_path.name} ({n} error{'s' * (n != 1)}): {shown}"
                             f"{f'; full log: {where}' if where else ''}") from None
        except StageError as exc:
            where = self._write_log(logger, log_path)
            raise StageError(f"{exc}{f'; full log: {where}' if where else ''}") from None
        except BaseException:
            self._write_log(logger, log_path)
            raise
        self._write_log(logger, log_path)
        return serialized, info, logger

    def _write_log(self, logger: Any, log_path: Path | None) -> Path | None:
        if log_path is None:
            if self.logs_dir is None:
                return None
            log_path = Path(self.logs_dir) / f"build_{next(self._builds):04d}.log"
        atomic_write_text(log_path, logger.text())
        return Path(log_path)

    def deploy(self, model_path: Path, out_dir: Path, source: str, cfg: DictConfig) -> Deployment:
        from pipeline.backends.tensorrt.deploy import deploy_engine

        return deploy_engine(self, model_path, out_dir, source, cfg)

    def build(self, model_path: str | Path, out_path: str | Path | None = None,
              log_path: str | Path | None = None, options: EngineBuildConfig | None = None) -> BuildResult:
        """Build an engine from ONNX; with ``out_path`` write it (atomically), with ``log_path`` the builder log."""
        model_path = Path(model_path)
        options = options or self.default_options()
        serialized, info, _ = self._engine_bytes(model_path, options, Path(log_path) if log_path else None)
        if out_path is not None:
            with atomic_output(out_path) as tmp:
                tmp.write_bytes(memoryview(serialized))
        return BuildResult(Path(out_path) if out_path else None, Path(log_path) if log_path else None, info)

    # ------------------------------------------------------------------ run
    def prepare(self, model_path: str | Path, profile: bool = False) -> TensorRTPrepared:
        """``profile`` is not honoured here (layer_samples stays None: callers compare total latency);
        backend=trtexec gives per-layer times with --exportProfile."""
        torch = self._cuda("measure latency")
        torch.cuda.set_device(int(self.cfg.device))
        model_path = Path(model_path)
        options = self.default_options()
        serialized, _, logger = self._engine_bytes(model_path, options, None)
        runtime = self.trt.Runtime(logger)
        engine = runtime.deserialize_cuda_engine(serialized)
        if engine is None:
            raise StageError(f"{self.name} could not deserialize the engine for {model_path.name}: "
                             f"{'; '.join(logger.errors[-2:]) or 'no reason given'}")
        if model_path.suffix.lower() in ENGINE_SUFFIXES:
            specs = _engine_specs(self.trt, engine)
            outputs: list[str] = []
        else:
            model = onnx.load(str(model_path), load_external_data=False)
            shapes = profile_shapes(model, options, model_path.name)
            specs = input_specs(model, {name: s[1] for name, s in shapes.items()})
            outputs = [o.name for o in model.graph.output]
        return TensorRTPrepared(self.trt, engine, ModelIO(specs, outputs), int(self.cfg.device), torch,
                                keep_alive=(runtime, logger))

    def measure(self, model_path: str | Path, warmup_runs: int | None = None,
                timing_runs: int | None = None) -> Timing:
        # a missing GPU is a property of the machine, not of the candidate: raise instead of a failed Timing
        self._cuda("measure latency")
        return super().measure(model_path, warmup_runs, timing_runs)

    # ------------------------------------------------------------------ introspection
    def describe(self) -> dict[str, Any]:
        try:
            trt = self._module()
            module, version = trt.__name__, getattr(trt, "__version__", "?")
        except BackendUnavailable:
            module, version = self.module_names[0], "not installed"
        info = {"backend": self.name, "module": module, "version": version, "device": int(self.cfg.device)}
        if self.settings is not None:
            info["build_settings"] = self.settings.describe()
        return info

    def layer_info(self, model_path: str | Path) -> dict[str, Any] | None:
        """Engine inspector JSON for a DETAILED build; without a GPU (TensorRT-RTX) the builder's layer table."""

        model_path = Path(model_path)
        serialized, _, logger = self._engine_bytes(model_path, self.default_options(), None)
        engine = None
        try:
            runtime = self.trt.Runtime(logger)
            engine = runtime.deserialize_cuda_engine(serialized)
        except Exception:  # noqa: BLE001 - no CUDA device: fall back to the builder's layer table
            log.debug("deserialization for layer info failed", exc_info=True)
        if engine is not None:
            inspector = engine.create_engine_inspector()
            text = inspector.get_engine_information(self.trt.LayerInformationFormat.JSON)
            return parse_layer_info(json.loads(text), "inspector")
        if logger.layer_table:
            return parse_builder_layers(logger.layer_table)
        return None

    def has_fast_kernels(self, quant_type: str) -> bool:
        return True


class TensorRTRtxBackend(TensorRTBackend):
    """TensorRT-RTX: same API; CPU-only ahead-of-time builds, kernels JIT-compiled on the RTX GPU at run time."""

    name = "tensorrt_rtx"
    # the SDK's wheel installs `tensorrt_rtx`; the PyPI wheels (tensorrt-rtx-cu13-bindings) `tensorrt_rtx_bindings`
    module_names = ("tensorrt_rtx", "tensorrt_rtx_bindings")
    install_hint = "pip install 'qdq-tune[rtx]'"
    package_title = "the TensorRT-RTX Python bindings"
    builds_without_gpu = True
    supports_timing_cache = False  # deprecated in TensorRT-RTX: kernels are chosen on the device at run time
    # autotune does not search TensorRT-RTX's build settings (with_settings still applies given ones)
    shipped_settings = None

    def has_fast_kernels(self, quant_type: str) -> bool:
        # the TensorRT-RTX support matrix lists INT8 as weight-only: INT8 activation Q/DQ gives no int8 math
        return quant_type != "int8"


def _engine_specs(trt: Any, engine: Any) -> list[InputSpec]:
    """Input specs of a prebuilt engine (dynamic dims at the first profile's opt shape)."""
    specs = []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        if engine.get_tensor_mode(name) != trt.TensorIOMode.INPUT:
            continue
        shape = tuple(engine.get_tensor_shape(name))
        if any(d < 0 for d in shape):
            shape = tuple(engine.get_tensor_profile_shape(name, 0)[1])
        specs.append(InputSpec(name, shape, np.dtype(trt.nptype(engine.get_tensor_dtype(name)))))
    return specs
