"""The backend protocol: build an engine from ONNX, run it, and measure its latency.

Every backend prepares a model once (`prepare`) into a ``PreparedModel`` that can run feeds and
time a number of runs; a ``Timing`` is the same statistics for every backend (median with p10/p90
spread over timed runs after warm-up). Several models timed in alternating blocks, so that machine
drift hits all of them alike, is ``pipeline.backends.timing``'s.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig

from pipeline.errors import json_types, record_layout
from pipeline.graph.model import InputSpec, input_specs, load_model, model_hash

log = logging.getLogger("tune.backend")


@dataclass(frozen=True)
class Timing:
    """One latency measurement. ``ok=False`` carries the error and log path, never a fake latency."""

    median_ms: float = float("nan")
    p10_ms: float = float("nan")
    p90_ms: float = float("nan")
    mean_ms: float = float("nan")
    min_ms: float = float("nan")
    n: int = 0
    backend: str = ""
    ok: bool = True
    error: str | None = None
    log_path: str | None = None

    @classmethod
    def from_samples(cls, samples_ms: list[float] | np.ndarray, backend: str, log_path: str | None = None) -> Timing:
        a = np.asarray(samples_ms, dtype=np.float64)
        return cls(
            median_ms=float(np.median(a)), p10_ms=float(np.percentile(a, 10)), p90_ms=float(np.percentile(a, 90)),
            mean_ms=float(a.mean()), min_ms=float(a.min()), n=int(a.size), backend=backend, log_path=log_path,
        )

    @classmethod
    def failed(cls, backend: str, error: str, log_path: str | None = None) -> Timing:
        return cls(backend=backend, ok=False, error=error, log_path=log_path)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Timing:
        return cls(**d)


@dataclass(frozen=True)
class ShippedSettings:
    """How a backend's tuned runtime settings ship beside the model (autotune's runtime search): their
    type (to_dict/from_dict/load/save/describe/changed), their artifact, and what messages call them."""

    type: type
    artifact: str  # e.g. "autotune/ort_session.json"
    what: str  # e.g. "session settings"
    defaults: str  # what runs without them, e.g. "ORT's defaults"


@dataclass(frozen=True)
class SearchSpace:
    """A runtime's settings search (autotune.runtime): where it starts, what it tries, how a change
    applies. The settings are of the backend's ``shipped_settings.type``."""

    # backend -> the settings the search starts from, and that ship when nothing helped
    base: Callable[[Backend], Any]
    # (backend, shipped model) -> ([(name, change)] in the order they are tried, what the metrics add)
    candidates: Callable[[Backend, Path], tuple[list[tuple[str, dict]], dict[str, Any]]]
    # (settings, change) -> the settings with that change
    apply: Callable[[Any, dict], Any]
    # after a kept change, try once more each candidate that ran within the budget but was not clearly
    # faster: where the runtime's settings interact (OpenVINO's precision with its threads)
    retry_after_kept: bool = False


@dataclass(frozen=True)
class FusionSource:
    """What a runtime fuses in a model, for autotune's subgraph mode: the layer information it reports
    (``layers``: each layer with the ONNX nodes fused into it, as ``pipeline.graph.layer_info.parse_layer_info``
    normalizes it) or the optimized graph it runs (``optimized``), where it came from, and the file
    it was written to beside the results (if any)."""

    description: str
    layers: dict[str, Any] | None = None
    optimized: Any = None  # an onnx.ModelProto
    path: Path | None = None


# DeploymentMetrics' keys in the order manifest.json has always held them (each runtime writes its own); the
# field of "backend" is ``runtime``
_DEPLOYMENT_KEYS = ("source", "model", "backend", "engine_bytes", "build_seconds", "optimized_op_counts",
                    "precision", "strongly_typed", "layer_precisions", "profile", "layers", "headline")
# each key's JSON type (None where a runtime does not record it)
_DEPLOYMENT_TYPES: dict[str, type | tuple[type, ...]] = {
    **dict.fromkeys(("source", "model", "precision", "headline"), str), **dict.fromkeys(("engine_bytes", "layers"), int),
    "build_seconds": (int, float), "strongly_typed": bool,
    **dict.fromkeys(("backend", "optimized_op_counts", "layer_precisions", "profile"), dict)}


@dataclass(frozen=True)
class DeploymentMetrics:
    """What a runtime's deploy says of its artifact: gen_trt_engine's manifest metrics. Every runtime names
    the model it built from (``source``: an artifact key or gen_trt_engine.onnx_file) and a one-line
    ``headline``; the built-in ones also the model file, their own ``describe()``, the artifact's size
    and build time, and their own facts (None where a runtime has none: left out of ``to_dict``)."""

    source: str
    headline: str
    model: str | None = None  # the ONNX file built from
    runtime: dict[str, Any] | None = None  # the entry's "backend": the runtime's own description (Backend.describe())
    engine_bytes: int | None = None  # the engine, optimized graph or compiled blob
    build_seconds: float | None = None
    optimized_op_counts: dict[str, int] | None = None  # ONNX Runtime: the optimized graph's nodes by op type
    precision: str | None = None  # OpenVINO: the inference precision; TensorRT: the builder's precision
    strongly_typed: bool | None = None  # TensorRT: built strongly typed (the Q/DQ decide the precision)
    layer_precisions: dict[str, int] | None = None  # OpenVINO: runtime layers by "<type> <precision>"
    profile: dict[str, dict[str, Any]] | None = None  # TensorRT: each input's shape range (min, opt, max)
    layers: int | None = None  # TensorRT: the engine's layers

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k in _DEPLOYMENT_KEYS if (v := getattr(self, _deployment_field(k))) is not None}

    @classmethod
    def from_dict(cls, d: Any, where: str = "manifest.json's gen_trt_engine entry") -> DeploymentMetrics:
        """The record of gen_trt_engine's manifest metrics (keys an older or newer writer added are left out);
        a layout no writer made is a one-line StateError naming ``where``."""
        with record_layout(where, "gen_trt_engine"):
            if not isinstance(d, Mapping):
                raise TypeError(f"not an object but {type(d).__name__}")
            json_types(d, _DEPLOYMENT_TYPES)
            return cls(**{_deployment_field(k): d[k] for k in _DEPLOYMENT_KEYS if k in d})


def _deployment_field(key: str) -> str:
    return "runtime" if key == "backend" else key


@dataclass(frozen=True)
class Deployment:
    """What a deployment of this runtime loads (``Backend.deploy``, written by gen_trt_engine): its files
    (name in the stage's folder -> path) and what the runtime says of them."""

    artifacts: dict[str, Path]
    metrics: DeploymentMetrics


@dataclass(frozen=True)
class ModelIO:
    """What a prepared engine feeds and returns: the model's inputs (at the shapes it binds) and its
    outputs in ONNX order, with their dtypes where the model declares them."""

    specs: list[InputSpec]
    output_names: list[str]
    output_types: dict[str, np.dtype] = field(default_factory=dict)


@dataclass
class BuildResult:
    engine_path: Path | None  # engine file (TensorRT) or optimized graph (ORT), if written
    log_path: Path | None
    info: dict[str, Any] = field(default_factory=dict)


class PreparedModel:
    """A model loaded into a backend, ready to run and time."""

    specs: list[InputSpec]
    # untimed runs (at least settle_runs, for at least settle_seconds) after a switch from another model
    # in time_interleaved: the other model's worker threads linger (ORT's spin between runs); the
    # largest of the models timed together applies
    settle_runs: int = 1
    settle_seconds: float = 0.0

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def time_runs(self, n: int) -> list[float]:
        """Run ``n`` times on fixed inputs; per-run latency in ms."""
        raise NotImplementedError

    def set_timing_feeds(self, feeds: dict[str, np.ndarray]) -> None:
        """Time on these inputs instead of the generated ones (real token ids, say, where a generated
        id would index past an embedding table)."""
        raise NotImplementedError(f"{type(self).__name__} times on its own inputs only")

    def layer_samples(self) -> list[list[dict[str, float]]] | None:
        """Per-layer times (ms) of the timed runs so far, one list per ``time_runs`` call and in it one
        dict per run (or one dict of averages where the runtime reports those); None when the model
        was not prepared with ``profile=True`` or the runtime has no per-layer timing here. May end
        the profiling: call it once, after the last ``time_runs``."""
        return None

    # layers that only adapt data at the model's edges (reformats, layout transposes, the Q of an
    # input and the DQ of an output): left out when comparing the compute of extracted subgraphs
    overhead_layers: frozenset[str] = frozenset()

    def close(self) -> None:
        pass

    def __enter__(self) -> PreparedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Backend:
    """Base class: subclasses implement ``check_available``, ``prepare`` and ``build``."""

    name = "base"
    # whose fusions the Q/DQ placement follows here (a name in pipeline.quant.placement.PLACEMENTS)
    placement = "tensorrt"
    # the kind of settings autotune tunes for this runtime and ships (None: none are searched)
    shipped_settings: ShippedSettings | None = None
    # the settings applied to every model this backend prepares or builds (None: its config alone)
    settings: Any = None
    # the runtime whose FP32 float backend=auto compares every runtime with (where it takes part), and that
    # loads a results_dir that records no runtime
    reference: bool = False

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg
        self.warmup_runs = int(cfg.warmup_runs)
        self.timing_runs = int(cfg.timing_runs)
        self._cache: dict[tuple[str, int, int], Timing] = {}

    def with_settings(self, settings: Any) -> Backend:
        """This backend with ``settings`` (its ``shipped_settings`` type) applied over its config to
        every model it prepares or builds."""
        other = copy.copy(self)
        other.settings = settings
        other._cache = {}  # a cached timing is of one model under the settings it was measured with
        return other

    def as_deployed(self) -> Backend:
        """This backend as a deployment runs it with no tuned settings (their kind's defaults, e.g. ORT's
        own session defaults): the baseline a tuned model's settings are compared against."""
        kind = self.shipped_settings
        return self.with_settings(kind.type()) if kind is not None else self

    @classmethod
    def open_deployment(cls, model: Path, settings_path: Path | None, device: str = "CPU") -> Any:
        """The shipped ``model`` ready to run in this runtime's own API, with the settings file it ships
        with (None: the runtime's defaults): what ``TuneResult.load`` returns."""
        from pipeline.errors import InputError

        raise InputError(f"{cls.name}: load gen_trt_engine's artifact with the runtime's own API (a shipped model "
                         f"opens in Python for the runtimes that implement Backend.open_deployment)")

    # -- to implement
    def check_available(self) -> None:
        raise NotImplementedError

    def search_space(self) -> SearchSpace | None:
        """The runtime settings autotune searches for the shipped model (None: none are searched)."""
        return None

    def prepare(self, model_path: str | Path, profile: bool = False) -> PreparedModel:
        """Load a model to run and time; ``profile=True`` asks for per-layer timing (layer_samples)."""
        raise NotImplementedError

    def build(self, model_path: str | Path, out_path: str | Path | None = None,
              log_path: str | Path | None = None) -> BuildResult:
        raise NotImplementedError

    def deploy(self, model_path: Path, out_dir: Path, source: str, cfg: DictConfig) -> Deployment:
        """Write into ``out_dir`` what a deployment of ``model_path`` loads on this runtime (an engine, an IR
        and its compiled blob, an optimized graph), with this backend's settings; ``source`` names the
        model in messages, ``cfg`` is the run's config (gen_trt_engine.* holds build options)."""
        raise NotImplementedError(f"{self.name} writes no deployable artifact")

    def prepare_reference(self, model_path: str | Path) -> PreparedModel | None:
        """The model run as plain Q/DQ math (no fused low-precision kernels), for the kernel-fidelity
        check; None where the runtime has no such mode."""
        return None

    def describe(self) -> dict[str, Any]:
        """Runtime name and version, recorded with every measurement."""
        return {"backend": self.name}

    def layer_info(self, model_path: str | Path) -> dict[str, Any] | None:
        """Per-layer engine information (fused ONNX nodes per layer) where the runtime exposes it."""
        return None

    def fusion_source(self, model_path: Path, out_dir: Path, stem: str) -> FusionSource:
        """What this runtime fuses in ``model_path`` (subgraph mode's fusion groups): by default the
        layer information of one float build, kept as ``<stem>.<precision>.graph.json`` in ``out_dir``
        and reused when present."""
        import json

        from pipeline.errors import StageError
        from pipeline.graph.layer_info import parse_layer_info

        precision = self.float_precision().lower()
        path = out_dir / f"{stem}.{precision}.graph.json"
        if not path.exists():
            info = self.layer_info(model_path)
            if not info or not info.get("layers"):
                raise StageError(f"autotune: {self.name} gave no layer information for {Path(model_path).name}; "
                                 f"pass autotune.graph_json=PATH (trtexec --onnx=MODEL --exportLayerInfo=graph.json "
                                 f"--profilingVerbosity=detailed)")
            from pipeline.artifacts import atomic_write_json

            atomic_write_json(path, {"Layers": info["layers"], "Bindings": info.get("io_tensors", [])}, indent=1)
        return FusionSource(f"{path.name} ({self.name} {precision.upper()} build)",
                            layers=parse_layer_info(json.loads(path.read_text()), path.name), path=path)

    def for_subgraphs(self) -> Backend:
        """The backend to measure extracted subgraphs with (static shapes, other input names): this
        one, unless its settings name the full model's inputs."""
        return self

    def opt_shapes(self) -> dict[str, list[int]]:
        """Input shapes this backend's own settings give a dynamic-shape model (its optimization
        profile's opt shapes), if any."""
        return {}

    def float_precision(self) -> str:
        """The precision a float (no Q/DQ) model runs in here: the baseline every speedup is against
        (FP32 on ORT's CPU EP, backend.float_precision on TensorRT)."""
        return str(self.cfg.get("float_precision", "FP32")).upper()

    def fp32_variant(self) -> Backend | None:
        """This backend running float layers in FP32, where its float precision is lower (the FP32 row
        reports show beside the runtime's own float); None where it runs FP32 already."""
        return None

    def has_fast_kernels(self, quant_type: str) -> bool:
        """Whether this backend runs ``quant_type`` ("int8"/"fp8") Q/DQ models with real low-precision kernels."""
        return True

    # -- shared
    def measure(self, model_path: str | Path, warmup_runs: int | None = None,
                timing_runs: int | None = None) -> Timing:
        """Median latency of one model; identical models (by content hash) are measured once."""
        warm = self.warmup_runs if warmup_runs is None else warmup_runs
        runs = self.timing_runs if timing_runs is None else timing_runs
        key = (model_hash(model_path), warm, runs)
        if key in self._cache:
            return self._cache[key]
        timing = self._measure_uncached(model_path, warm, runs)
        if timing.ok:
            self._cache[key] = timing
        return timing

    def _measure_uncached(self, model_path: str | Path, warmup_runs: int, timing_runs: int) -> Timing:
        """One measurement, no cache: prepare, warm up, time. A failure is a failed Timing."""
        try:
            with self.prepare(model_path) as pm:
                if warmup_runs:
                    pm.time_runs(warmup_runs)
                return Timing.from_samples(pm.time_runs(timing_runs), self.name)
        except Exception as exc:  # noqa: BLE001 - a failed build/run is a failed measurement, reported as such
            log.debug("measurement of %s failed", model_path, exc_info=True)
            return Timing.failed(self.name, f"{type(exc).__name__}: {exc}")

    def run(self, model_path: str | Path, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with self.prepare(model_path) as pm:
            return pm.run(feeds)


def specs_of(model_path: str | Path) -> list[InputSpec]:
    return input_specs(load_model(model_path, check=False))
