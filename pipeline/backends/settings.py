"""The runtime settings a tuned model ships with: ``RuntimeSettings``, the base of ONNX Runtime's
``SessionSettings`` (autotune/ort_session.json), OpenVINO's ``CompileSettings``
(autotune/openvino_compile.json) and TensorRT's ``TrtBuildSettings`` (autotune/trt_build.json).

A model's speed depends on settings its .onnx file does not hold (ORT's fusions and threads, OpenVINO's
compile properties, TensorRT's builder levels); autotune's runtime search picks them and ships them
beside the model as a small JSON object. The base does what every such record does the same way: the
JSON object (one key per field, in field order), the atomic save, the load that names a file that is
not JSON, not an object, or holds a key or value the record does not take in one line, ``changed``,
equality and hashing (frozen dataclasses). A subclass is a frozen dataclass that declares its fields,
normalizes and checks their values in ``__post_init__`` (so a constructed, loaded and changed record
pass the same checks, with a ValueError naming the key and what it takes) and says what it sets with
``describe``.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pipeline.artifacts import atomic_write_json, read_settings
from pipeline.backends.base import Backend

S = TypeVar("S", bound="RuntimeSettings")

_STRING_MAP = "string_map"  # field metadata key of string_map() fields


def string_map() -> Any:
    """A field holding a str -> str map as (key, value) pairs sorted by key, so the record stays hashable:
    a JSON object in the file; the constructor takes a dict or pairs (values become strings)."""
    return field(default=(), metadata={_STRING_MAP: True})


def check_integer(name: str, value: Any, low: int, high: int | None = None, *, nullable: bool = False) -> None:
    """A ValueError naming ``name`` unless ``value`` is an integer in low..high (None: no upper bound), or
    None when ``nullable``; a bool is not an integer here (JSON true is not 1)."""
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        allowed = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value!r}, expected {'null or ' if nullable else ''}an integer {allowed}")


@dataclass(frozen=True)
class RuntimeSettings(ABC):
    """Runtime settings shipped as one JSON object beside the model; see the module docstring."""

    what: ClassVar[str] = "runtime settings"  # messages: "<what> <file> are corrupt (...)"
    key_kind: ClassVar[str] = "key"  # what the JSON object's keys are, in messages

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.metadata.get(_STRING_MAP):
                self._set(f.name, _string_pairs(f.name, getattr(self, f.name)))

    def _set(self, name: str, value: Any) -> None:
        """Store a normalized value in ``__post_init__`` (the dataclass is frozen)."""
        object.__setattr__(self, name, value)

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The keys the JSON object may hold."""
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: one key per field, a string_map field as an object, a tuple as a list."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get(_STRING_MAP):
                value = dict(value)
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls: type[S], d: Any) -> S:
        """The settings of a JSON object; a ValueError names what is not an object, a key this record does not
        know, or (from ``__post_init__``) a value it does not take. Keys left out keep their defaults."""
        if not isinstance(d, dict):
            raise ValueError(f"expected an object of {', '.join(cls.keys())}, got {type(d).__name__}")
        cls.check_keys(d)
        return cls._from_known(d)

    @classmethod
    def check_keys(cls, names: Iterable[Any]) -> None:
        """A ValueError naming every one of ``names`` that is not one of ``keys()``."""
        known = cls.keys()
        unknown = sorted(set(map(str, names)) - set(known))
        if unknown:
            raise ValueError(f"unknown {cls.key_kind} {', '.join(map(repr, unknown))}, expected {', '.join(known)}")

    @classmethod
    def _from_known(cls: type[S], d: dict[str, Any]) -> S:
        """The record of a JSON object whose keys are all known (a flat-map record overrides it)."""
        return cls(**d)

    @classmethod
    def load(cls: type[S], path: str | os.PathLike) -> S:
        """The settings a file holds; a StateError names a file that is not one (not JSON, not an object, an
        unknown key, a bad value) in one line."""
        return read_settings(path, cls.what, cls.from_dict)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the JSON object atomically (a killed run leaves the old file or the new one)."""
        return atomic_write_json(path, self.to_dict())

    def changed(self: S, **values: Any) -> S:
        """These settings with ``values`` (field names) replaced, checked as a new record is."""
        return replace(self, **values)

    def pinned(self: S, backend: Backend) -> S:
        """These settings as they ship from ``backend``: whatever the runtime would resolve from the host
        where they leave it open, and that every check ran with, written out (OpenVINO's inference
        precision), so the file means the same on every machine. Thread and stream counts are never
        pinned: a count left open is the runtime's own rule (one per physical core), which scales with
        the host. Here: nothing is left open that changes numerics."""
        return self

    @abstractmethod
    def describe(self) -> str:
        """One line for logs and headlines: what these settings change (or what runs without them)."""


def _string_pairs(name: str, value: Any) -> tuple[tuple[str, str], ...]:
    items = value.items() if isinstance(value, dict) else value
    try:
        return tuple(sorted((str(k), str(v)) for k, v in items))
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}, expected an object of names to values") from None


__all__ = ["RuntimeSettings", "check_integer", "string_map"]
