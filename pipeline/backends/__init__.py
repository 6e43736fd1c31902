"""Runtimes behind one protocol (``base.Backend``: prepare, run, time, build), chosen by `backend=`, each
in its own sub-package: ONNX Runtime (``onnxruntime``, with its sessions and session settings in
``onnxruntime.session``), OpenVINO (``openvino``), TensorRT, TensorRT-RTX and trtexec (``tensorrt``,
builder settings in ``tensorrt.settings``). Imports the framework, ``graph`` and ``data``."""

from __future__ import annotations

from omegaconf import DictConfig

from pipeline import backend_config
from pipeline.backend_config import AUTO, CUSTOM
from pipeline.backends.base import Backend, BuildResult, PreparedModel, Timing
from pipeline.backends.timing import compare_interleaved
from pipeline.errors import ConfigError, InputError
from pipeline.quant.placement import PLACEMENTS, PlacementKind
from pipeline.registry import import_object
from pipeline.values import enum_value


def builtin_runtimes() -> dict[str, str]:
    """Built-in runtime name -> the dotted path of its Backend class, from ``pipeline.backend_config.RUNTIMES``
    (imported lazily: a missing TensorRT only matters when chosen)."""
    return {r.name: r.backend for r in backend_config.RUNTIMES}


def named_runtime(name: str | None) -> type[Backend]:
    """The Backend class of built-in runtime ``name`` (as a results_dir records it), imported; None: the
    reference runtime (``Backend.reference``). An InputError names any other."""
    if name is None:
        return next(c for c in (import_object(p, "backend.name") for p in builtin_runtimes().values()) if c.reference)
    if name not in builtin_runtimes():
        raise InputError(f"{name}: not a built-in runtime; load gen_trt_engine's artifact with the runtime's own "
                          f"API")
    return import_object(builtin_runtimes()[name], "backend.name")


def settings_artifacts(cfg: DictConfig) -> tuple[str, ...]:
    """The artifact autotune ships the configured runtime's settings in (its ``shipped_settings``), as a
    stage's optional input: () where the runtime ships none."""
    kind = runtime_class(cfg).shipped_settings
    return (kind.artifact,) if kind is not None else ()


def runtime_class(cfg: DictConfig) -> type[Backend]:
    """The Backend class the `backend` config names (imported, not instantiated: its class attributes say
    what the runtime is, e.g. its ``placement``, without loading the runtime's own libraries)."""
    name = enum_value(cfg.name)
    if name == AUTO:
        raise ConfigError("backend=auto is several runtimes: a stage runs on one of backend.runtimes at a time")
    if name == CUSTOM:
        target = cfg.get("_target_")
        if not target:
            raise ConfigError("backend._target_: required for a custom runtime (the dotted path of your "
                              "pipeline.backends.base.Backend subclass; under backend=auto: backend.custom._target_)")
        cls = import_object(target, "backend._target_")
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            raise ConfigError(f"backend._target_={target}: not a runtime (a subclass of "
                              f"pipeline.backends.base.Backend); see docs/layout.md, 'Adding a runtime'")
        return cls
    builtin = builtin_runtimes()
    if name not in builtin:
        raise ConfigError(f"backend.name={name}: choose one of {', '.join(builtin)}, {CUSTOM} or {AUTO}")
    return import_object(builtin[name], "backend.name")


def create_backend(cfg: DictConfig) -> Backend:
    """Instantiate the configured backend and check that it can run here (BackendUnavailable if not)."""
    backend = runtime_class(cfg)(cfg)
    backend.check_available()
    return backend


def compute_backend(cfg: DictConfig) -> Backend:
    """ONNX Runtime on the CPU as the pipeline computes with it (calibration, float references, Q/DQ
    math): the configured one where `backend` is ONNX Runtime, else ORT's defaults."""
    from omegaconf import OmegaConf

    from pipeline.backends.onnxruntime import OnnxRuntimeBackend
    from pipeline.backends.onnxruntime.config import OnnxRuntimeBackendConfig

    own = runtime_class(cfg.backend) is OnnxRuntimeBackend
    return OnnxRuntimeBackend(cfg.backend if own else OmegaConf.structured(OnnxRuntimeBackendConfig()))


def judging_backend(cfg: DictConfig, compute: Backend) -> Backend:
    """The backend quantize judges candidates on: the configured runtime itself where its placement's fused
    kernels run here (its int8 kernels and its float precision decide accuracy), else ``compute``
    (TensorRT placements are judged as Q/DQ math)."""
    cls = runtime_class(cfg.backend)
    if isinstance(compute, cls) or not PLACEMENTS[cls.placement].cpu_kernels:
        return compute
    return create_backend(cfg.backend)


def placement_kind(cfg: DictConfig) -> PlacementKind:
    """`quantize.placement`, with `auto` resolved from the backend (the placement its runtime declares)."""
    name = enum_value(cfg.quantize.placement)
    return PLACEMENTS[runtime_class(cfg.backend).placement if name == "auto" else name]


def activation_type(cfg: DictConfig) -> str:
    """`quantize.activation_type`, with `auto` resolved from the placement: uint8 (asymmetric) for the
    fused kernels of CPU runtimes, int8 (symmetric) elsewhere."""
    t = enum_value(cfg.quantize.activation_type)
    if t != "auto":
        return t
    return "uint8" if placement_kind(cfg).cpu_kernels else "int8"


def auto_runtimes(cfg: DictConfig) -> list[tuple[str, DictConfig]]:
    """`backend=auto`: (name, its backend section) of every runtime in ``backend.runtimes``, in order; a
    ConfigError naming the key for an unknown or repeated one."""
    names = [enum_value(n) for n in cfg.runtimes]
    builtin = builtin_runtimes()
    bad = [n for n in names if (n not in builtin and n != CUSTOM) or not isinstance(cfg.get(n), DictConfig)]
    if bad or not names or len(set(names)) != len(names):
        raise ConfigError(f"backend.runtimes={names}: give each runtime once, from {', '.join(builtin)} or "
                          f"{CUSTOM} (your own, backend.{CUSTOM}._target_)")
    renamed = [f"backend.{n}.name={cfg[n].get('name')}" for n in names if cfg[n].get("name") != n]
    if renamed:
        raise ConfigError(f"{', '.join(renamed)}: a runtime's section under backend=auto keeps its own name; "
                          f"list the runtimes to tune in backend.runtimes")
    if CUSTOM in names:
        runtime_class(cfg.custom)  # a custom runtime without its class is one line now, not after export
    return [(n, cfg[n]) for n in names]


def times_on_host_cpu(name: str) -> bool:
    """Whether a run with `backend=<name>` (as a job records it) times models on this host's CPU, where two
    jobs timing at once slow each other: every runtime whose placement runs CPU kernels, auto (its
    runtimes do), and a custom or unknown one (its timing cannot be told apart)."""
    builtin = builtin_runtimes()
    if name not in builtin:
        return True
    cls = import_object(builtin[name], "backend.name")
    return PLACEMENTS[cls.placement].cpu_kernels


def is_auto(cfg: DictConfig) -> bool:
    """The `backend` section is backend=auto (several runtimes, one chosen by measurement)."""
    return enum_value(cfg.name) == AUTO


def check_backend(cfg: DictConfig) -> None:
    """Start-up check of the whole config's backend: raises BackendUnavailable (one line naming the fix)
    when the chosen runtime is missing, before any stage runs. Measuring may still need a GPU later;
    that is reported when a stage measures. backend=auto checks its list here; a runtime in it that
    cannot run is left out, in one line, when auto runs."""
    if is_auto(cfg.backend):
        auto_runtimes(cfg.backend)
        return
    create_backend(cfg.backend)


__all__ = ["builtin_runtimes", "Backend", "named_runtime", "BuildResult", "PreparedModel", "Timing", "check_backend", "compare_interleaved",
           "activation_type", "auto_runtimes", "compute_backend", "is_auto", "create_backend", "judging_backend", "placement_kind", "runtime_class"]
