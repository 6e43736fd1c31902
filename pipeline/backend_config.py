"""The `backend` group: the registry of built-in runtimes (``RUNTIMES``, one line each; each runtime's own
schema lives in its sub-package), the base every runtime's section extends, custom's and auto's schemas, and
what a TensorRT engine build asks for (``EngineBuildConfig``)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, make_dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from omegaconf import MISSING, DictConfig

from pipeline.values import enum_value

# --------------------------------------------------------------------------- TensorRT build options


class DataType(str, Enum):
    """Builder precision of float layers (Q/DQ models are strongly typed: their precision is the model's)."""

    FP32 = "FP32"
    FP16 = "FP16"
    BF16 = "BF16"


@dataclass
class EngineBuildConfig:
    """What one engine build asks for: the `gen_trt_engine.tensorrt` schema (TAO-style keys, YAML keys equal
    field names, validated by tasks/gen_trt_engine/config.py) and what the tensorrt, tensorrt_rtx and
    trtexec builders take. Measurement builds fill it from the backend section (``from_backend_cfg``)."""

    data_type: DataType = DataType.FP32  # builder precision for float layers (Q/DQ models are strongly typed)
    # MB; None: the runtime's default (measurement builds on a backend without backend.workspace_size;
    # gen_trt_engine asks for a size)
    workspace_size: Optional[int] = 1024
    # batch shortcut for inputs whose first dim is the only dynamic one; explicit shapes below win
    min_batch_size: int = 1
    opt_batch_size: int = 1
    max_batch_size: int = 1
    # input name -> shape, per optimization profile point; an input named here gets exactly these shapes
    min_shapes: dict[str, list[int]] = field(default_factory=dict)
    opt_shapes: dict[str, list[int]] = field(default_factory=dict)
    max_shapes: dict[str, list[int]] = field(default_factory=dict)
    # persistent timing cache file shared across builds (relative to where tune started until a stage or
    # backend resolves it with user_path)
    timing_cache: Optional[str] = None
    # plugin libraries (.so/.dll) loaded before parsing, in addition to backend.plugin_libraries
    plugin_libraries: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        # OmegaConf's enum members, a backend's float_precision ("bf16") and any case become one member
        self.data_type = DataType(enum_value(self.data_type).upper())

    @property
    def timing_cache_path(self) -> Path | None:
        """``timing_cache`` as the path the builders open (None: no persistent cache)."""
        return Path(self.timing_cache) if self.timing_cache else None

    @classmethod
    def from_backend_cfg(cls, cfg: DictConfig) -> EngineBuildConfig:
        """Build options for measurement builds, from the backend section alone (tensorrt*, trtexec)."""
        from pipeline.artifacts import user_path

        tc = cfg.get("timing_cache")
        ws = cfg.get("workspace_size")
        return cls(data_type=cfg.get("float_precision") or "FP32",
                   workspace_size=int(ws) if ws is not None else None,
                   timing_cache=str(user_path(tc)) if tc else None,
                   plugin_libraries=list(cfg.get("plugin_libraries") or []))


def shape_problems(min_shapes: Any, opt_shapes: Any, max_shapes: Any,
                   key: str = "gen_trt_engine.tensorrt") -> list[str]:
    """min/opt/max shapes name the same inputs, with equal ranks, dims >= 1 and min <= opt <= max per dim.

    The one check of explicit profile shapes: config validation and every build call it.
    """
    keys = ("min_shapes", "opt_shapes", "max_shapes")
    tables = [min_shapes or {}, opt_shapes or {}, max_shapes or {}]
    problems = []
    for name in sorted({str(n) for t in tables for n in t}):
        missing = [k for k, t in zip(keys, tables, strict=True) if name not in t]
        if missing:
            problems.append(f"{key}: input '{name}' needs all of min_shapes, opt_shapes and max_shapes "
                            f"(missing from {', '.join(missing)})")
            continue
        lo, opt, hi = trio = [[int(v) for v in t[name]] for t in tables]
        bad = [f"{key}.{k}.{name}={s}" for k, s in zip(keys, trio, strict=True) if any(d < 1 for d in s)]
        if bad:
            problems.append(f"{', '.join(bad)}: every dim must be >= 1 (a concrete size, not -1 or 0)")
        elif not len(lo) == len(opt) == len(hi):
            problems.append(f"{key}: shapes of '{name}' differ in rank: {lo}, {opt}, {hi}")
        elif not all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True)):
            problems.append(f"{key}: shapes of '{name}' need min <= opt <= max in every dim, got {lo}, {opt}, {hi}")
    return problems


@dataclass(frozen=True)
class Runtime:
    """A built-in runtime: one entry of ``RUNTIMES``. ``backend=<name>`` picks conf/backend/<name>.yaml, which
    extends the schema ``base_<name>`` (``schema`` with ``name`` set); under backend=auto it is the section
    ``backend.<name>``. ``backend`` and ``schema`` are dotted paths into the runtime's own sub-package,
    imported when first needed (a runtime that is not installed costs nothing until chosen). Everything
    else the tool knows of a runtime its Backend class says: its placement, its settings file, whether
    it runs here, how its shipped deployment opens."""

    name: str
    backend: str  # its pipeline.backends.base.Backend subclass
    schema: str  # its `backend` section's dataclass (a subclass of BackendConfig)
    # the PyPI distributions it runs on (any build of it): their versions key what was measured and checked
    packages: tuple[str, ...] = ()


# the built-in runtimes, in the order `backend.name` lists them; adding one is one line here, its sub-package
# under pipeline/backends/ and its conf/backend/<name>.yaml (docs/layout.md, "Adding a runtime")
RUNTIMES: tuple[Runtime, ...] = (
    Runtime("onnxruntime", "pipeline.backends.onnxruntime.OnnxRuntimeBackend",
            "pipeline.backends.onnxruntime.config.OnnxRuntimeBackendConfig",
            ("onnxruntime", "onnxruntime-gpu", "onnxruntime-openvino", "onnxruntime-directml")),
    Runtime("tensorrt", "pipeline.backends.tensorrt.TensorRTBackend",
            "pipeline.backends.tensorrt.config.TensorRTBackendConfig", ("tensorrt", "tensorrt-cu12")),
    Runtime("tensorrt_rtx", "pipeline.backends.tensorrt.TensorRTRtxBackend",
            "pipeline.backends.tensorrt.config.TensorRTBackendConfig", ("tensorrt-rtx-cu13-bindings",)),
    Runtime("trtexec", "pipeline.backends.tensorrt.TrtexecBackend",
            "pipeline.backends.tensorrt.config.TrtexecBackendConfig"),
    Runtime("openvino", "pipeline.backends.openvino.OpenVinoBackend",
            "pipeline.backends.openvino.config.OpenVinoBackendConfig", ("openvino",)),
)
CUSTOM = "custom"  # `backend=custom`: a runtime of your own, backend._target_ names its Backend class
AUTO = "auto"  # `backend=auto`: every runtime in backend.runtimes tuned, the fastest accurate one shipped


def runtime_packages() -> tuple[str, ...]:
    """Every built-in runtime's distributions, sorted (the order host keys and version records list them in)."""
    return tuple(sorted({p for r in RUNTIMES for p in r.packages}))


def runtime_schema(runtime: Runtime) -> type:
    """The schema class of ``runtime`` (imported)."""
    from pipeline.registry import import_object

    return import_object(runtime.schema, f"the schema of runtime {runtime.name}")


def runtime_section(runtime: Runtime) -> Any:
    """``runtime``'s section with its defaults (its schema with ``name`` set)."""
    return runtime_schema(runtime)(name=runtime.name)


@dataclass
class BackendConfig:
    # a built-in runtime's name (pipeline.backend_config.RUNTIMES), custom or auto; conf/backend/<name>.yaml sets it
    name: str = MISSING
    warmup_runs: int = 10
    timing_runs: int = 50
    # every timed block of an interleaved timing lasts at least this long (ms) of its fastest model's warm-up
    # run, more runs than timing_runs asks where that is short: blocks of a few runs of a 0.1 ms model time
    # the switch between models. Run-wide: under backend=auto, auto's value holds for every runtime.
    min_block_ms: float = 10.0


@dataclass
class CustomBackendConfig(BackendConfig):
    """A runtime defined outside qdq-tune (`backend=custom`): ``_target_`` is the dotted path of its
    ``pipeline.backends.base.Backend`` subclass, built with this section as its config; ``options`` are
    its own settings, read by it as ``cfg.options``. Under backend=auto it is the section
    ``backend.custom`` (``backend.runtimes=[onnxruntime, custom] backend.custom._target_=...``)."""

    name: str = CUSTOM
    _target_: str = ""  # required for backend=custom: the dotted path of your Backend subclass
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class AutoBackendFields(BackendConfig):
    """backend=auto's own keys; its schema (``auto_backend_schema``) adds a section per runtime."""

    name: str = AUTO
    runtimes: list[str] = field(default_factory=lambda: ["onnxruntime", "openvino"])
    # tune every runtime to the end: no runtime is dropped when it falls out of the leader's reach after PTQ
    # (pipeline.app.race)
    tune_all: bool = False
    # compare only the runtimes tuned before, tuning nothing (tune-rechoose sets it)
    tuned_only: bool = False


_AUTO_DOC = """`backend=auto`: quantize and autotune run once per runtime in ``runtimes`` that can run here (one
    that cannot is reported in one line and left out), each in results_dir/runtimes/<name>/ with its
    own section below (e.g. ``backend.openvino.inference_precision=f32``); then every runtime's shipped
    model and float are timed side by side in one interleaved run (``warmup_runs``, ``timing_runs``), and
    the fastest that met the accuracy budget ships: gen_trt_engine and evaluate run on it. A section per
    runtime of ``RUNTIMES``, and ``custom`` for a runtime of your own."""


@functools.cache
def _auto_schema(runtimes: tuple[Runtime, ...]) -> type:
    sections = [(r.name, runtime_schema(r), field(default_factory=functools.partial(runtime_section, r)))
                for r in runtimes]
    sections.append((CUSTOM, CustomBackendConfig, field(default_factory=CustomBackendConfig)))
    return make_dataclass("AutoBackendConfig", sections, bases=(AutoBackendFields,),
                          namespace={"__doc__": _AUTO_DOC, "__module__": __name__})


def auto_backend_schema() -> type:
    """``AutoBackendConfig``: auto's keys with a section per built-in runtime (its defaults) and ``custom``,
    built from ``RUNTIMES`` as it is (one class per registry), and bound to this module's
    ``AutoBackendConfig``, where pickle looks a config's class up."""
    cls = _auto_schema(RUNTIMES)
    globals()["AutoBackendConfig"] = cls
    return cls


def __getattr__(name: str) -> Any:
    # a process that unpickles a config before composing one (a launcher's worker) finds the schema too
    if name == "AutoBackendConfig":
        return auto_backend_schema()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
