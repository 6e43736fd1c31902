"""OpenVINO's compile settings and the shared Core: the properties a shipped model compiles with
(``CompileSettings``, autotune/openvino_compile.json), the values each accepts, and how OpenVINO spells them
back (``property_text``). The backend (``pipeline.backends.openvino.backend``) and its settings search
(``pipeline.backends.openvino.search``) both read them."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from pipeline.backends.base import Backend
from pipeline.backends.settings import RuntimeSettings, string_map
from pipeline.errors import BackendUnavailable

INSTALL = "pip install openvino"
# config value -> INFERENCE_PRECISION_HINT (default: what OpenVINO picks on this CPU)
PRECISIONS = {"default": None, "bf16": "bf16", "f16": "f16", "f32": "f32"}
# a float_precision() label -> the INFERENCE_PRECISION_HINT value that pins it
SHIPPED_PRECISION = {"BF16": "bf16", "FP16": "f16", "FP32": "f32"}
HINTS = ("LATENCY", "THROUGHPUT", "CUMULATIVE_THROUGHPUT")
# the compile properties a shipped openvino_compile.json may hold, with the values each accepts
# (None: a non-negative integer)
PROPERTIES: dict[str, tuple[str, ...] | None] = {
    "INFERENCE_PRECISION_HINT": ("bf16", "f16", "f32"),
    "PERFORMANCE_HINT": HINTS,
    "EXECUTION_MODE_HINT": ("PERFORMANCE", "ACCURACY"),
    "INFERENCE_NUM_THREADS": None,
    "NUM_STREAMS": None,
    "ENABLE_CPU_PINNING": ("YES", "NO"),
    "ENABLE_HYPER_THREADING": ("YES", "NO"),
    "CPU_DENORMALS_OPTIMIZATION": ("YES", "NO"),
}
def openvino_module() -> Any:
    try:
        import openvino
    except ImportError:
        raise BackendUnavailable(f"backend=openvino needs OpenVINO, which is not installed; {INSTALL}") from None
    return openvino


@functools.lru_cache(maxsize=1)
def core() -> Any:
    """One OpenVINO Core per process (it holds the loaded plugins)."""
    return openvino_module().Core()


def _check_value(name: str, value: Any) -> str:
    allowed = PROPERTIES[name]
    text = str(value).upper() if allowed is None or allowed[0].isupper() else str(value).lower()
    if allowed is None:
        if not text.isdigit():
            raise ValueError(f"{name}={value!r}: expected a non-negative integer")
    elif text not in allowed:
        raise ValueError(f"{name}={value!r}: choose one of {', '.join(allowed)}")
    return text


@functools.lru_cache(maxsize=1)
def available_devices() -> tuple[str, ...]:
    """The devices OpenVINO sees in this process (asking the plugins takes tens of ms each time)."""
    return tuple(core().available_devices)


def check_device(device: str, key: str) -> None:
    """A BackendUnavailable naming ``key`` when OpenVINO has no such device here."""
    devices = list(available_devices())
    if device not in devices:
        raise BackendUnavailable(f"{key}={device}: OpenVINO sees only {devices} here; set {key} to one of them")


@dataclass(frozen=True)
class CompileSettings(RuntimeSettings):
    """The OpenVINO compile properties a model ships with (autotune/openvino_compile.json): they are
    not stored in the model, and its speed and accuracy depend on them. Empty: OpenVINO's defaults.
    The file is the flat map ``compile_model`` takes (property name -> value), not one key per field."""

    what = "OpenVINO compile settings"
    key_kind = "OpenVINO property"

    properties: tuple[tuple[str, str], ...] = string_map()

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_keys(k for k, _ in self.properties)
        self._set("properties", tuple((k, _check_value(k, v)) for k, v in self.properties))

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(PROPERTIES)

    def to_dict(self) -> dict[str, str]:
        return dict(self.properties)

    @classmethod
    def _from_known(cls, d: dict[str, Any]) -> CompileSettings:
        return cls(properties=d)

    def changed(self, **properties: Any) -> CompileSettings:
        """These settings with ``properties`` set (a value of None removes one)."""
        merged = {**self.to_dict(), **properties}
        return self.from_dict({k: v for k, v in merged.items() if v is not None})

    def describe(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in self.properties) or "OpenVINO's defaults"

    def pinned(self, backend: Backend) -> CompileSettings:
        """With INFERENCE_PRECISION_HINT always set: the precision ``backend`` ran float layers in with these
        settings. Left open, OpenVINO picks it per CPU (bf16 with AMX or AVX-512 BF16, f32 elsewhere), so a
        file checked in f32 would compile in bf16, a precision no check ran, on the next machine."""
        if "INFERENCE_PRECISION_HINT" in dict(self.properties):
            return self
        precision = backend.with_settings(self).float_precision()
        return self.changed(INFERENCE_PRECISION_HINT=SHIPPED_PRECISION.get(precision, precision.lower()))

    def compile(self, model: str | os.PathLike, device: str = "CPU") -> Any:
        """``model`` compiled with these properties, as they were measured: what a deployment runs."""
        check_device(device, "device")
        return core().compile_model(str(model), device, self.to_dict())


def property_text(value: Any) -> str:
    """An OpenVINO property value as openvino_compile.json spells it: a Type as its short name (bf16),
    a bool as YES/NO, an enum as its member name, anything else as str."""
    if isinstance(value, bool):
        return "YES" if value else "NO"
    if hasattr(value, "to_string"):  # openvino.Type
        return str(value.to_string())
    if hasattr(value, "name") and not isinstance(value, str):  # a property enum, e.g. PerformanceMode
        return str(value.name)
    return str(value)
