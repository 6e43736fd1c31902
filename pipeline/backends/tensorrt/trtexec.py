"""trtexec backend: TensorRT's command-line tool as a subprocess.

Each invocation's command line and full output are saved (atomically) under ``logs_dir``. Latency
comes from trtexec's own measurement:

- per-iteration times from ``--exportTimes`` (its ``computeMs``, the GPU time of one inference)
  when the file is written, so median/p10/p90 are computed the same way as for every backend;
- otherwise the "=== Performance summary ===" lines, from the "GPU Compute Time" line (falling back
  to "Latency", which adds host<->device copies). We ask for ``--percentile=10,90,95,99``; where p10
  is still missing (a user's own --percentile, an old trtexec) the minimum stands in for it.

GPU compute time is used because the Python backends time ``execute_async_v3`` alone, and Q/DQ
placement changes the kernels, not the copies. The command line is made in
``pipeline.backends.tensorrt.trtexec_command``, trtexec's output is read in
``pipeline.backends.tensorrt.trtexec_parse``; build options and shapes live in
``pipeline.backends.tensorrt.common``.

Warm-up is ``backend.warmup_ms`` (trtexec's --warmUp is in MILLISECONDS); ``backend.warmup_runs`` does
not apply here. Profiling flags (--exportProfile, --exportLayerInfo, --profilingVerbosity,
--separateProfileRun) are optional: when trtexec rejects one as an unknown option, the run is
retried once without them and they stay off for the rest of this backend's life.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import shlex
import shutil
import subprocess
import tempfile
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
from pipeline.backends.tensorrt.common import (
    EngineBuildConfig,
    plugin_paths,
    profile_shapes,
    tensorrt_qdq_view,
)
from pipeline.backends.tensorrt.settings import TrtBuildSettings
from pipeline.backends.tensorrt.trtexec_command import (
    PROFILING_FLAGS,
    SHAPE_FLAGS,
    TrtexecEngine,
    TrtexecRun,
    option_name,
    parse_shape_spec,
    strip_profiling,
)
from pipeline.backends.tensorrt.trtexec_parse import (
    error_lines,
    loads_lenient,
    output_dtypes,
    parse_outputs,
    parse_profile,
    parse_summary,
    parse_times,
    timing_from_summary,
)
from pipeline.errors import BackendUnavailable, InputError, StageError
from pipeline.graph.layer_info import parse_layer_info
from pipeline.graph.model import has_qdq, input_specs

log = logging.getLogger("tune.backend")

# trtexec's messages when it cannot use a GPU at all (CUDA init / device query failures)
_NO_GPU = re.compile(r"no CUDA-capable device|CUDA initialization failure|CUDA driver version is insufficient|"
                     r"cudaErrorNoDevice|Cuda failure: (?:no|100)", re.IGNORECASE)
# the version line trtexec prints first ("TensorRT v100900" for 10.9.0)
_VERSION = re.compile(r"TensorRT v(\d+)")


# TensorRT's names for the layers it inserts to convert formats ("Reformatting CopyNode for Input
# Tensor 0 to ...", "... reformatter 0"): overhead, not compute, when subgraphs are compared
REFORMAT_LAYER = re.compile(r"reformat", re.IGNORECASE)


# --------------------------------------------------------------------------- backend


class TrtexecPrepared(PreparedModel):
    """An engine built once by trtexec; every time_runs / run call is one trtexec --loadEngine run.

    Each call pays trtexec's start-up and its own --warmUp (backend.warmup_ms), so interleaved
    comparisons with trtexec are slow but still fair: every block is warmed the same way. No settle
    run after a switch (``settle_runs = 0``): each call is a fresh process that inherits nothing from
    the model timed before it, and its own warm-up is what a settle run would be.
    """

    settle_runs = 0

    def __init__(self, backend: TrtexecBackend, workdir: Path, engine: TrtexecEngine, io: ModelIO,
                 profile: bool = False):
        self.backend, self.workdir, self.engine, self.specs = backend, workdir, engine, io.specs
        self.output_names = io.output_names
        self.output_types = io.output_types or {}
        self.profile = profile
        self._samples: list[list[dict[str, float]]] = []

    def time_runs(self, n: int) -> list[float]:
        b = self.backend
        times = self.workdir / "times.json"
        times.unlink(missing_ok=True)  # a stale file from the previous call must not stand in for this one
        prof = self.workdir / "profile.json" if self.profile and b.profiling_supported else None
        if prof is not None:
            prof.unlink(missing_ok=True)
        run = self.engine.run(warmup_ms=b.warmup_ms, iterations=n, export_times=times, export_profile=prof,
                              extra_args=b.run_args())
        text, log_path = b.invoke(run, "time", self.engine.path.stem)
        if self.profile:
            layers = parse_profile(prof.read_text())["layers"] if prof is not None and prof.exists() else []
            # one record of per-layer averages per call (trtexec reports no per-run layer times)
            self._samples.append([{str(r["name"]): float(r["averageMs"]) for r in layers}] if layers else [])
        samples = parse_times(times.read_text(), b.warmup_ms) if times.exists() else []
        if samples:
            return samples[:n]
        t = timing_from_summary(parse_summary(text), str(log_path))
        if t is None:
            raise StageError(f"trtexec printed no performance summary; see {log_path}")
        # no per-iteration times: the median stands for every run (documented in the module docstring)
        return [t.median_ms] * n

    def layer_samples(self) -> list[list[dict[str, float]]] | None:
        if not self.profile or not self._samples or not all(self._samples):
            return None  # not profiled, or this trtexec rejected the profiling flags
        self.overhead_layers = frozenset(name for call in self._samples for run in call for name in run
                                         if REFORMAT_LAYER.search(name))
        return self._samples

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        b = self.backend
        inputs = {}
        for spec in self.specs:
            p = self.workdir / f"in_{len(inputs)}.bin"
            p.write_bytes(np.ascontiguousarray(feeds[spec.name], dtype=spec.dtype).tobytes())
            inputs[spec.name] = p
        out_json = self.workdir / "outputs.json"
        out_json.unlink(missing_ok=True)  # a stale file from the previous call must not stand in for this one
        run = self.engine.run(warmup_ms=0, iterations=1, percentiles=None, load_inputs=inputs, export_output=out_json,
                              extra_args=b.run_args())
        _, log_path = b.invoke(run, "run", self.engine.path.stem)
        if not out_json.exists():
            raise StageError(f"trtexec wrote no outputs; see {log_path}")
        outs = parse_outputs(out_json.read_text(), self.output_types)
        return [outs[n] for n in self.output_names if n in outs] or list(outs.values())

    def close(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


class TrtexecBackend(Backend):
    name = "trtexec"
    shipped_settings = ShippedSettings(TrtBuildSettings, "autotune/trt_build.json", "build settings",
                                       "the backend's own build settings")
    # the builder settings a tuned model ships with (autotune/trt_build.json): flags on every build
    settings: TrtBuildSettings | None = None

    def __init__(self, cfg: DictConfig):
        super().__init__(cfg)
        self.exe: str | None = None
        # flipped to False the first time trtexec rejects a profiling flag; kept for the rest of the run
        self.profiling_supported = True
        self.version: str | None = None
        # a stage may point this into its results_dir folder; by default a fresh temporary folder
        self.logs_dir: Path | None = None
        self.last_profile: dict[str, Any] | None = None
        self.last_layer_info: dict[str, Any] | None = None
        # shared with the copies with_settings makes, so their logs in logs_dir never take one name
        self._invocations = itertools.count(1)

    @property
    def warmup_ms(self) -> int:
        return int(self.cfg.warmup_ms)

    # ------------------------------------------------------------------ availability
    def search_space(self) -> SearchSpace:
        from pipeline.backends.tensorrt import search

        return search.SPACE

    def check_available(self) -> None:
        exe = str(self.cfg.trtexec_path)
        found = shutil.which(exe)
        if not found:
            where = "does not exist or is not executable" if "/" in exe else "not found on PATH"
            raise BackendUnavailable(
                f"backend.trtexec_path={exe}: {where}; install TensorRT and put trtexec on PATH, set "
                f"backend.trtexec_path=/path/to/trtexec, or use backend=tensorrt (Python API) or backend=onnxruntime")
        self.exe = found

    def _exe(self) -> str:
        if self.exe is None:
            self.check_available()
        assert self.exe is not None
        return self.exe

    # ------------------------------------------------------------------ invocation
    def _logs(self) -> Path:
        if self.logs_dir is None:
            self.logs_dir = Path(tempfile.mkdtemp(prefix="qdq-tune-trtexec-"))
            log.debug("trtexec logs go to %s", self.logs_dir)
        return Path(self.logs_dir)

    def run_args(self) -> list[str]:
        return [str(a) for a in self.cfg.trtexec_args]

    def for_subgraphs(self) -> TrtexecBackend:
        """This backend without the shape flags of backend.trtexec_args (they name the full model's inputs)."""
        from omegaconf import OmegaConf

        args = [a for a in self.run_args() if option_name(a) not in SHAPE_FLAGS]
        if len(args) == len(self.cfg.trtexec_args):
            return self
        cfg = OmegaConf.merge(self.cfg, {"trtexec_args": args})
        other = TrtexecBackend(cfg)
        other.exe, other.version, other.logs_dir = self.exe, self.version, self.logs_dir
        other.profiling_supported, other.settings = self.profiling_supported, self.settings
        other._invocations = self._invocations
        return other

    def opt_shapes(self) -> dict[str, list[int]]:
        """--optShapes (else --shapes) of backend.trtexec_args, e.g. ``--optShapes=input:8x3x224x224``."""
        for flag in ("--optShapes", "--shapes"):
            for a in self.run_args():
                if option_name(a) == flag and "=" in a:
                    return parse_shape_spec(a.split("=", 1)[1])
        return {}

    def invoke(self, run: TrtexecRun, kind: str, stem: str, log_path: Path | None = None) -> tuple[str, Path]:
        """Run trtexec; save its log; retry once without profiling flags on "Unknown option".

        Returns the output and the log path; a failed run raises StageError naming the log, and
        one that finds no GPU raises BackendUnavailable.
        """
        if run.onnx is None:  # running a saved engine
            return self._invoke(run, kind, stem, log_path)
        with tensorrt_qdq_view(Path(run.onnx), lambda msg: log.info("trtexec: %s", msg)) as onnx_path:
            original, run.onnx = run.onnx, onnx_path
            try:
                return self._invoke(run, kind, stem, log_path)
            finally:
                run.onnx = original

    def _invoke(self, run: TrtexecRun, kind: str, stem: str, log_path: Path | None) -> tuple[str, Path]:
        argv = run.argv(self._exe())
        if not self.profiling_supported:
            argv = strip_profiling(argv)
        text, code, log_path = self._run_once(argv, kind, stem, log_path)
        if code != 0 and "unknown option" in text.lower() and argv != strip_profiling(argv):
            self.profiling_supported = False
            log.warning("trtexec (%s) rejected a profiling flag; continuing without per-layer profiles and "
                        "layer info (log: %s)", self.exe, log_path)
            failed_log = log_path.with_name(log_path.stem + ".unknown-option.log")
            log_path.replace(failed_log)
            text, code, log_path = self._run_once(strip_profiling(argv), kind, stem, log_path)
        if code != 0:
            if _NO_GPU.search(text):
                raise BackendUnavailable(
                    f"backend=trtexec found no usable CUDA GPU ({error_lines(text, 1)}); trtexec needs an NVIDIA "
                    f"GPU to build and measure; backend=tensorrt_rtx builds engines on the CPU (log: {log_path})")
            raise StageError(f"trtexec failed (exit {code}) for {stem}: {error_lines(text)}; full log: {log_path}")
        return text, log_path

    def _run_once(self, argv: list[str], kind: str, stem: str, log_path: Path | None) -> tuple[str, int, Path]:
        if log_path is None:
            log_path = self._logs() / f"{next(self._invocations):04d}_{kind}_{stem}.log"
        timeout = float(self.cfg.get("timeout") or 0) or None
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  errors="replace", timeout=timeout, check=False)
            text, code = proc.stdout or "", proc.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            text, code = out + f"\n[qdq-tune] killed after {timeout:g} s (backend.timeout)\n", -9
        except OSError as exc:
            raise BackendUnavailable(f"backend.trtexec_path={argv[0]}: cannot run it ({exc})") from None
        seconds = time.perf_counter() - t0
        if self.version is None:
            m = _VERSION.search(text)
            if m:
                v = int(m[1])
                self.version = f"{v // 10000}.{v // 100 % 100}.{v % 100}"
        atomic_write_text(log_path, f"$ {shlex.join(argv)}\n{text}\n[qdq-tune] exit code {code} after "
                                    f"{seconds:.1f} s\n")
        return text, code, log_path

    # ------------------------------------------------------------------ build options
    def default_options(self) -> EngineBuildConfig:
        """Build options for measurement builds, from the backend section alone."""
        return EngineBuildConfig.from_backend_cfg(self.cfg)

    def _build_run(self, model_path: Path, options: EngineBuildConfig) -> tuple[TrtexecRun, onnx.ModelProto]:
        model = onnx.load(str(model_path), load_external_data=False)
        plugins = plugin_paths(options.plugin_libraries)
        run = TrtexecRun(onnx=model_path, strongly_typed=has_qdq(model), data_type=options.data_type.value,
                         workspace_size=options.workspace_size, shapes=profile_shapes(model, options, model_path.name),
                         timing_cache=options.timing_cache_path, plugins=plugins, extra_args=self.run_args(),
                         build_args=self.settings.trtexec_flags() if self.settings is not None else [])
        return run, model

    # ------------------------------------------------------------------ protocol
    def deploy(self, model_path: Path, out_dir: Path, source: str, cfg: DictConfig) -> Deployment:
        from pipeline.backends.tensorrt.deploy import deploy_engine

        return deploy_engine(self, model_path, out_dir, source, cfg)

    def build(self, model_path: str | Path, out_path: str | Path | None = None,
              log_path: str | Path | None = None, options: EngineBuildConfig | None = None) -> BuildResult:
        """Build with trtexec --skipInference; the engine is written atomically to ``out_path``."""
        model_path = Path(model_path)
        options = options or self.default_options()
        run, _ = self._build_run(model_path, options)
        run.skip_inference = True
        with tempfile.TemporaryDirectory(prefix="qdq-tune-trtexec-") as tmpdir:
            layers_json = Path(tmpdir) / "layers.json"
            if self.cfg.export_layer_info:
                run.export_layer_info = layers_json
            t0 = time.perf_counter()
            if out_path is not None:
                with atomic_output(out_path) as tmp:
                    run.save_engine = tmp
                    _, written_log = self.invoke(run, "build", model_path.stem, Path(log_path) if log_path else None)
                    if tmp.stat().st_size == 0:
                        raise StageError(f"trtexec wrote no engine for {model_path.name}; see {written_log}")
            else:
                _, written_log = self.invoke(run, "build", model_path.stem, Path(log_path) if log_path else None)
            seconds = time.perf_counter() - t0
            info: dict[str, Any] = {**self.describe(), "source": str(model_path), "build_seconds": round(seconds, 3),
                                    "strongly_typed": run.strongly_typed,
                                    # as TensorRTBackend reports it: Q/DQ models take no precision flag
                                    "data_type": "strongly_typed" if run.strongly_typed else run.data_type,
                                    "log": str(written_log)}
            if run.shapes:
                info["profile"] = {n: {"min": s[0], "opt": s[1], "max": s[2]} for n, s in run.shapes.items()}
            if out_path is not None:
                info["engine_bytes"] = Path(out_path).stat().st_size
            if layers_json.exists():
                self.last_layer_info = parse_layer_info(loads_lenient(layers_json.read_text()), "trtexec")
                info["layers"] = len(self.last_layer_info["layers"])
        return BuildResult(Path(out_path) if out_path else None, written_log, info)

    def _measure_uncached(self, model_path: str | Path, warmup_runs: int, timing_runs: int) -> Timing:
        """Build and time in one trtexec run (warm-up: backend.warmup_ms, not warmup_runs; runs: timing_runs
        or backend.duration). Backend.measure caches the result by content hash."""
        model_path = Path(model_path)
        with tempfile.TemporaryDirectory(prefix="qdq-tune-trtexec-") as tmpdir:
            tmp = Path(tmpdir)
            try:
                run, _ = self._build_run(model_path, self.default_options())
            except (StageError, InputError) as exc:
                return Timing.failed(self.name, str(exc))
            run.warmup_ms, run.iterations = self.warmup_ms, timing_runs
            run.duration_s = float(self.cfg.duration) or None
            run.export_times = tmp / "times.json"
            if self.cfg.export_profile:
                run.export_profile = tmp / "profile.json"
            if self.cfg.export_layer_info:
                run.export_layer_info = tmp / "layers.json"
            try:
                text, log_path = self.invoke(run, "measure", model_path.stem)
            except StageError as exc:
                return Timing.failed(self.name, str(exc))
            timing = None
            if run.export_times.exists():
                samples = parse_times(run.export_times.read_text(), self.warmup_ms)
                if samples:
                    timing = Timing.from_samples(samples, self.name, str(log_path))
            if timing is None:
                timing = timing_from_summary(parse_summary(text), str(log_path))
            if timing is None or math.isnan(timing.median_ms):
                return Timing.failed(self.name, "trtexec printed no performance summary", str(log_path))
            self.last_profile = (parse_profile(run.export_profile.read_text())
                                 if run.export_profile is not None and run.export_profile.exists() else None)
            if run.export_layer_info is not None and run.export_layer_info.exists():
                self.last_layer_info = parse_layer_info(loads_lenient(run.export_layer_info.read_text()), "trtexec")
        return timing

    def prepare(self, model_path: str | Path, profile: bool = False) -> TrtexecPrepared:
        """Build the engine once into a private folder; runs load it with --loadEngine (``profile``:
        each run also exports a per-layer profile)."""
        model_path = Path(model_path)
        workdir = Path(tempfile.mkdtemp(prefix="qdq-tune-trtexec-"))
        try:
            engine = workdir / f"{model_path.stem}.engine"
            run, model = self._build_run(model_path, self.default_options())
            run.skip_inference = True
            run.save_engine = engine
            self.invoke(run, "build", model_path.stem)
            specs = input_specs(model, {name: s[1] for name, s in run.shapes.items()})
            io = ModelIO(specs, [o.name for o in model.graph.output], output_dtypes(model))
            return TrtexecPrepared(self, workdir, TrtexecEngine(engine, run.shapes, run.plugins), io, profile)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise

    def layer_info(self, model_path: str | Path) -> dict[str, Any] | None:
        """--exportLayerInfo of a --profilingVerbosity=detailed build; None if this trtexec lacks the flags."""
        model_path = Path(model_path)
        if not self.profiling_supported:
            return None
        with tempfile.TemporaryDirectory(prefix="qdq-tune-trtexec-") as tmpdir:
            run, _ = self._build_run(model_path, self.default_options())
            run.skip_inference = True
            run.export_layer_info = Path(tmpdir) / "layers.json"
            self.invoke(run, "layers", model_path.stem)
            if not run.export_layer_info.exists():
                return None
            self.last_layer_info = parse_layer_info(loads_lenient(run.export_layer_info.read_text()), "trtexec")
            return self.last_layer_info

    def describe(self) -> dict[str, Any]:
        info = {"backend": self.name, "trtexec": self.exe or str(self.cfg.trtexec_path),
                "tensorrt_version": self.version}
        if self.settings is not None:
            info["build_settings"] = self.settings.describe()
        return info


# the command-line pieces and output readers stay importable from here for the tests, which import them
# by this module's name
__all__ = ["PROFILING_FLAGS", "REFORMAT_LAYER", "SHAPE_FLAGS", "TrtexecBackend", "TrtexecPrepared", "TrtexecRun",
           "option_name", "parse_outputs", "parse_profile", "parse_shape_spec", "parse_summary", "parse_times",
           "strip_profiling", "timing_from_summary"]
