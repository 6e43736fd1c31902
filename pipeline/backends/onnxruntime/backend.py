"""ONNX Runtime backend (default): CPU execution provider unless other providers are named.

build = create a session (optionally saving ORT's optimized graph); measure = time session.run on
fixed inputs. ORT fuses DQ -> op -> Q groups into integer kernels (QLinearConv, QLinearMatMul, ...)
during graph optimization, so the optimized graph shows which placements really fused.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from omegaconf import DictConfig

from pipeline.artifacts import atomic_write_json, external_data_files
from pipeline.backends.base import (
    Backend,
    BuildResult,
    Deployment,
    DeploymentMetrics,
    FusionSource,
    PreparedModel,
    SearchSpace,
    ShippedSettings,
    specs_of,
)
from pipeline.backends.onnxruntime.session import (
    SessionSettings,
    disable_qdq_fusion_if_fp8,
    inference_session,
    ort_session_options,
    qdq_math_session,
)
from pipeline.data.adapters import fixed_feeds
from pipeline.errors import BackendUnavailable, StageError, first_line
from pipeline.graph.model import input_specs, load_model, staged_model
from pipeline.values import enum_value


@functools.lru_cache(maxsize=1)
def physical_cores() -> int:
    """Physical cores available to this process (hyper-threads share a core's int8 units)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:
        allowed = set(range(os.cpu_count() or 1))
    cores: set[tuple[str, str]] = set()
    try:
        cpu = phys = core = None
        with open("/proc/cpuinfo") as fh:
            for line in [*fh, "\n"]:
                if not line.strip():
                    if cpu is not None and int(cpu) in allowed:
                        cores.add((phys or "0", core or cpu))
                    cpu = phys = core = None
                    continue
                k, _, v = line.partition(":")
                k, v = k.strip(), v.strip()
                if k == "processor":
                    cpu = v
                elif k == "physical id":
                    phys = v
                elif k == "core id":
                    core = v
    except OSError:
        pass
    return max(1, len(cores) or len(allowed))

log = logging.getLogger("tune.backend")


class OrtPrepared(PreparedModel):
    def __init__(self, session: Any, specs: list):
        self.session = session
        self.specs = specs
        self.output_names = [o.name for o in session.get_outputs()]
        self._feeds = fixed_feeds(specs)

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(self.output_names, feeds)

    def set_timing_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        self._feeds = {k: feeds[k] for k in self._feeds}

    def time_runs(self, n: int) -> list[float]:
        out = []
        run, names, feeds = self.session.run, self.output_names, self._feeds
        for _ in range(n):
            t0 = time.perf_counter()
            run(names, feeds)
            out.append((time.perf_counter() - t0) * 1e3)
        return out

    def close(self) -> None:
        self.session = None


# ops ORT puts at a graph's edges to adapt data: NCHWc reorders and NHWC transposes, the Q of an input
# (a quantized producer would emit it fused) and the DQ of an output (a quantized consumer would read
# the int8 tensor). A DQ after an input's Q, or a Q before an output, is real work: a float op's
# fake quantization, paid in the full model too.
_EDGE_IN = ("ReorderInput", "Transpose", "QuantizeLinear", "Cast")
_EDGE_OUT = ("ReorderOutput", "Transpose", "DequantizeLinear", "Cast")


def edge_nodes(graph: onnx.GraphProto) -> frozenset[str]:
    """Nodes of an (optimized) graph that only adapt data at its edges: chains of ``_EDGE_IN`` ops that
    start at a graph input and of ``_EDGE_OUT`` ops that end at a graph output."""
    outputs = {o.name for o in graph.output}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for t in n.input:
            readers.setdefault(t, []).append(n)
    edge: set[str] = set()
    reached = {i.name for i in graph.input}
    for n in graph.node:  # graph order: forward from the inputs
        if n.op_type in _EDGE_IN and n.input and n.input[0] in reached:
            edge.add(n.name)
            reached.update(n.output)
    back = set(outputs)
    for n in reversed(graph.node):  # backward from the outputs
        if n.op_type in _EDGE_OUT and n.output and all(
                t in back and all(r.name in edge for r in readers.get(t, [])) for t in n.output):
            edge.add(n.name)
            back.update(t for t in n.input[:1] if t)
    return frozenset(edge)


def parse_ort_profile(events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Per run (``model_run`` events, in time order), the kernel time in ms of each node that ran,
    keyed by node name (the profiler's ``<node>_kernel_time`` events)."""
    runs = sorted((e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"),
                  key=lambda e: e["ts"])
    starts = [int(e["ts"]) for e in runs]
    out: list[dict[str, float]] = [{} for _ in runs]
    for e in events:
        name = e.get("name", "")
        if e.get("cat") != "Node" or not name.endswith("_kernel_time"):
            continue
        k = bisect.bisect_right(starts, int(e["ts"])) - 1
        if k < 0 or int(e["ts"]) > starts[k] + int(runs[k]["dur"]):
            continue
        node = name[: -len("_kernel_time")]
        out[k][node] = out[k].get(node, 0.0) + float(e["dur"]) / 1e3
    return out


class OrtProfiled(OrtPrepared):
    """A session with ORT's profiler on: layer_samples() splits its per-node kernel times by run."""

    def __init__(self, session: Any, specs: list, workdir: Path, optimized: onnx.ModelProto):
        super().__init__(session, specs)
        self.workdir = workdir
        self.overhead_layers = edge_nodes(optimized.graph)
        self._calls: list[int] = []

    def time_runs(self, n: int) -> list[float]:
        self._calls.append(n)
        return super().time_runs(n)

    def layer_samples(self) -> list[list[dict[str, float]]] | None:
        path = self.session.end_profiling()
        try:
            runs = parse_ort_profile(json.loads(Path(path).read_text()))
        finally:
            Path(path).unlink(missing_ok=True)
        if len(runs) != sum(self._calls):
            return None  # the profiler dropped runs (buffer limit): no per-run split
        out, k = [], 0
        for n in self._calls:
            out.append(runs[k:k + n])
            k += n
        return out

    def close(self) -> None:
        super().close()

        shutil.rmtree(self.workdir, ignore_errors=True)


SPIN_SETTLE_RUNS = 4  # untimed runs after a switch when a session's worker threads spin ...
SPIN_SETTLE_SECONDS = 0.05  # ... taking at least this long


class OnnxRuntimeBackend(Backend):
    name = "onnxruntime"
    placement = "onnxruntime"
    shipped_settings = ShippedSettings(SessionSettings, "autotune/ort_session.json", "session settings",
                                       "ORT's defaults")
    # the session settings a tuned model ships with (autotune/ort_session.json); None: backend.* alone
    settings: SessionSettings | None = None
    reference = True  # its FP32 float is what every runtime is compared with

    @classmethod
    def open_deployment(cls, model: Path, settings_path: Path | None, device: str = "CPU",
                        providers: Sequence[str] = ("CPUExecutionProvider",)) -> Any:
        """An onnxruntime.InferenceSession of ``model`` with its shipped session settings."""
        settings = SessionSettings.load(settings_path) if settings_path is not None else SessionSettings()
        return settings.session(model, providers)

    def search_space(self) -> SearchSpace:
        from pipeline.backends.onnxruntime import search

        return search.SPACE

    def check_available(self) -> None:
        try:
            import onnxruntime as ort
        except ImportError:
            raise BackendUnavailable("onnxruntime is not installed; pip install onnxruntime") from None
        have = set(ort.get_available_providers())
        missing = [p for p in self.cfg.providers if p not in have]
        if missing:
            raise BackendUnavailable(
                f"backend.providers lists {missing}, not available in this onnxruntime build "
                f"(available: {sorted(have)}); install the matching onnxruntime package or drop them"
            )

    @property
    def threads(self) -> int:
        if self.settings is not None and self.settings.intra_op_num_threads:
            return self.settings.intra_op_num_threads
        n = int(self.cfg.intra_op_threads)
        return n if n > 0 else physical_cores()

    def session_options(self, optimized_path: str | None = None) -> Any:
        # a placement measurement spins as backend.allow_spinning says; with settings, a session runs as
        # deployed: the settings over ORT's defaults (its worker threads spin between runs)
        so = ort_session_options(enum_value(self.cfg.graph_optimization_level), threads=self.threads,
                                 optimized_path=optimized_path,
                                 spinning=self.settings is not None or bool(self.cfg.allow_spinning))
        so.inter_op_num_threads = 1
        if self.settings is not None:
            self.settings.apply(so)
        return so

    def session(self, model_path: str | Path, optimized_path: str | None = None,
                profile_prefix: str | None = None, external_data: str | None = None) -> Any:
        """A session with this backend's options; ``optimized_path`` saves the graph ORT runs (its
        weights in the file ``external_data`` beside it, if given: past 2 GB ORT cannot write them
        inline), ``profile_prefix`` turns its profiler on."""
        so = self.session_options(optimized_path)
        if external_data:
            so.add_session_config_entry("session.optimized_model_external_initializers_file_name", external_data)
        if profile_prefix:
            so.enable_profiling = True
            so.profile_file_prefix = profile_prefix
        disable_qdq_fusion_if_fp8(so, model_path)
        return inference_session(model_path, so, providers=self.cfg.providers,
                           disabled_optimizers=self.settings.disabled_optimizers if self.settings else ())

    def prepare(self, model_path: str | Path, profile: bool = False) -> OrtPrepared:
        if not profile:
            pm = OrtPrepared(self.session(model_path), specs_of(model_path))
            if self.settings is not None or self.cfg.allow_spinning:
                # a spinning session's threads keep the cores busy for tens of ms after its runs, so the
                # next model is timed only after settle runs and a pause
                # (docs/measurements/README-benchmarks-until-2026-11-28.md: "Why the code does what it does")
                pm.settle_runs, pm.settle_seconds = SPIN_SETTLE_RUNS, SPIN_SETTLE_SECONDS
            return pm

        workdir = Path(tempfile.mkdtemp(prefix="qdq-tune-ort-profile-"))
        try:
            session = self.session(model_path, str(workdir / "optimized.onnx"), str(workdir / "profile"))
            optimized = onnx.load(str(workdir / "optimized.onnx"), load_external_data=False)
        except BaseException:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
        return OrtProfiled(session, specs_of(model_path), workdir, optimized)

    def prepare_reference(self, model_path: str | Path) -> OrtPrepared:
        """Without graph optimizations ORT runs every QuantizeLinear, DequantizeLinear and float op as
        written: the Q/DQ math the fused integer kernels must reproduce (``qdq_math_session``: each
        DequantizeLinear of a constant computed once, the same outputs bit for bit)."""
        so = self.session_options()
        # a DequantizeLinear the session computes per run makes a float copy of its weight each time:
        # ORT's arena would keep them all, so the reference session runs without it
        so.enable_cpu_mem_arena = False
        model = load_model(model_path, check=False)
        return OrtPrepared(qdq_math_session(model, options=so, providers=self.cfg.providers), input_specs(model))

    def deploy(self, model_path: Path, out_dir: Path, source: str, cfg: DictConfig) -> Deployment:
        """ONNX Runtime has no engine to build: the graph it runs after its fusions (model.ort.onnx) and the
        build facts (build.json)."""
        out, facts = out_dir / "model.ort.onnx", out_dir / "build.json"
        log.info("backend=onnxruntime has no TensorRT engine to build: writing the graph ONNX Runtime runs "
                 "(after its fusions) to %s", out)
        try:
            result = self.build(model_path, out, facts)
        except Exception as exc:  # noqa: BLE001 - ORT's own error types for models it cannot load or run
            raise StageError(f"gen_trt_engine: onnxruntime cannot load and run {source} ({model_path}): "
                             f"{first_line(exc)}") from None
        ops = result.info.get("optimized_op_counts", {})
        seconds = float(result.info.get("build_seconds", 0.0))
        fused = {k: v for k, v in ops.items() if k.startswith(("QLinear", "QGemm", "MatMulInteger", "ConvInteger"))}
        shown = ", ".join(f"{k} x{v}" for k, v in fused.items()) or "no integer kernels"
        headline = (f"onnxruntime optimized graph from {source}: {sum(ops.values())} nodes ({shown}), "
                    f"{out.stat().st_size / 2**20:.2f} MB in {seconds:.1f} s")
        return Deployment({"model.ort.onnx": out, "build.json": facts}, DeploymentMetrics(
            source=source, headline=headline, model=str(model_path), runtime=self.describe(),
            engine_bytes=out.stat().st_size, build_seconds=seconds, optimized_op_counts=ops))

    def fusion_source(self, model_path: Path, out_dir: Path, stem: str) -> FusionSource:
        """The graph ORT's CPU EP runs after every fusion (level extended: no NCHWc layout rewrite that would
        rename tensors)."""
        return FusionSource("ONNX Runtime's optimized graph", optimized=optimized_graph(model_path, "extended"))

    def build(self, model_path: str | Path, out_path: str | Path | None = None,
              log_path: str | Path | None = None) -> BuildResult:
        """Create a session; with ``out_path``, save the graph ORT actually runs (after its fusions)."""
        t0 = time.perf_counter()
        if out_path is not None:
            out = Path(out_path)
            # staged beside it with its data file: a graph that loads but fails to run is not written
            with staged_model(out) as staged:
                session = self.session(model_path, optimized_path=str(staged),
                                       external_data=out.name + ".data" if external_data_files(model_path) else None)
                session.run(None, fixed_feeds(specs_of(model_path)))
        else:
            self.session(model_path)
        seconds = time.perf_counter() - t0
        info: dict[str, Any] = {"build_seconds": round(seconds, 3), **self.describe()}
        if out_path is not None:
            ops: dict[str, int] = {}
            for node in onnx.load(str(out_path), load_external_data=False).graph.node:
                ops[node.op_type] = ops.get(node.op_type, 0) + 1
            info["optimized_op_counts"] = dict(sorted(ops.items()))
        if log_path is not None:
            atomic_write_json(log_path, info)
        return BuildResult(Path(out_path) if out_path else None, Path(log_path) if log_path else None, info)

    def describe(self) -> dict[str, Any]:
        import onnxruntime as ort

        info = {"backend": self.name, "onnxruntime": ort.__version__, "providers": list(self.cfg.providers),
                "threads": self.threads}
        if self.settings is not None:
            info["session"] = self.settings.describe()
        return info

    def has_fast_kernels(self, quant_type: str) -> bool:
        # the CPU EP has integer kernels for int8/uint8 but none for fp8: FP8 Q/DQ only adds casts
        return quant_type != "fp8"


def optimized_graph(model: onnx.ModelProto | str | Path, level: str = "extended") -> onnx.ModelProto:
    """The graph ONNX Runtime's CPU EP runs after its optimizations at ``level``."""
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    with tempfile.TemporaryDirectory() as d:
        optimized = os.path.join(d, "optimized.onnx")
        inference_session(data, ort_session_options(level, optimized_path=optimized))
        return onnx.load(optimized)
