"""What this CPU's integer kernels can do: vendor, model and the instruction-set flags that decide
whether ONNX Runtime's and oneDNN's u8 x s8 kernels are exact.

On x86 without VNNI (AVX2, or AVX-512 before Cascade Lake), MLAS and oneDNN multiply uint8 activations
by int8 weights with VPMADDUBSW, which adds each pair of products in int16 with saturation: 2 x 255 x
127 = 64770 does not fit, so layers with full-range activations and weights near +-127 silently
compute wrong sums. VNNI (VPDPBUSD) accumulates in int32 and is exact. The flags are read with
CPUID (archspec), i.e. what this process's instructions really see, which is what MLAS dispatches on.

CPU kinds (``KINDS``) name what a deployment must be right on: `avx2` (AMD Zen 2/3, Intel before
Skylake-SP), `avx512` (Skylake-SP: AVX-512 without VNNI), `avx_vnni` (Alder Lake and later clients),
`avx512_vnni` (Ice Lake, Cascade Lake, AMD Zen 4) and `amx` (Sapphire Rapids and later). A run's
target (`target.cpus`, set for the run by ``target_configured``) lists the kinds beside this host's:
numerics are chosen for the weakest of them (``decision_facts``), and OpenVINO's float precision is
bf16 only where every one of them runs bf16 (``bf16_everywhere``).

``QDQ_TUNE_CPU_FLAGS`` pins the flags the tool decides from (a test seam: the user's way to prepare a
model for other CPUs is `target.cpus`): a comma- or space-separated list of the flags below, or
``none``. The kernels still run on the real CPU, so every fidelity check still measures what this
machine computes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any

from pipeline.errors import InputError

# x86 flags (archspec's names, as in /proc/cpuinfo) that matter for int8 kernels
X86_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
# aarch64: SDOT/UDOT and the int8 matrix multiply extension accumulate in int32 (exact)
ARM_FLAGS = ("asimddp", "i8mm", "sve")
PIN_ENV = "QDQ_TUNE_CPU_FLAGS"


@dataclass(frozen=True)
class CpuKind:
    """A kind of x86 CPU as its int8 kernels see it: whether u8 x s8 dot products saturate in int16
    pair sums (no VNNI), and whether OpenVINO runs float layers in bf16 there by default (only AMX is
    sure to; among AVX-512 VNNI CPUs, Zen 4 has AVX-512 BF16 and Cascade Lake does not)."""

    name: str
    flags: tuple[str, ...]  # the flags (X86_FLAGS' names) a CPU of this kind has at least
    saturates: bool
    bf16: bool
    examples: str


KINDS: dict[str, CpuKind] = {k.name: k for k in (
    CpuKind("avx2", ("avx2",), True, False, "AMD Zen 2/3, Intel before Skylake-SP"),
    CpuKind("avx512", ("avx2", "avx512f", "avx512bw"), True, False, "Intel Skylake-SP"),
    CpuKind("avx_vnni", ("avx2", "avx_vnni"), False, False, "Intel Alder Lake and later clients"),
    CpuKind("avx512_vnni", ("avx2", "avx512f", "avx512bw", "avx512_vnni"), False, False,
            "Intel Ice Lake, Cascade Lake; AMD Zen 4"),
    CpuKind("amx", ("avx2", "avx512f", "avx512bw", "avx512_vnni", "amx_int8"), False, True,
            "Intel Sapphire Rapids and later"),
)}
# `target.cpus` shorthand for every x86 kind
ALL_X86 = "x86"
_TARGET: ContextVar[tuple[str, ...]] = ContextVar("target_cpus", default=())


@dataclass(frozen=True)
class CpuFacts:
    """The CPU the tool decides for. ``u8s8_saturates`` is True on x86 without VNNI, False where
    dot-product instructions accumulate in int32, and None when unknown (archspec missing or an
    unfamiliar architecture). ``source`` says where the flags come from (cpuid, os, the pin)."""

    arch: str
    vendor: str | None = None
    brand: str | None = None
    flags: tuple[str, ...] = ()
    u8s8_saturates: bool | None = None
    source: str | None = None
    pinned: bool = False  # the flags come from QDQ_TUNE_CPU_FLAGS, not from this CPU

    @property
    def kind(self) -> str | None:
        """The CPU kind (``KINDS``) these flags make, None off x86 or without AVX2."""
        if self.arch not in ("x86_64", "amd64", "i386", "i686"):
            return None
        for name in ("amx", "avx512_vnni", "avx_vnni", "avx512", "avx2"):
            if set(KINDS[name].flags) <= set(self.flags):
                return name
        return None

    def describe(self) -> str:
        """One line, e.g. 'AMD EPYC (x86_64; avx2 avx512f avx512_vnni)'."""
        flags = " ".join(self.flags) or "no int8 dot-product flags"
        pin = f"; {self.source}" if self.pinned else ""
        return f"{self.brand or self.vendor or 'unknown CPU'} ({self.arch}; {flags}{pin})"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "flags": list(self.flags)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CpuFacts:
        return cls(str(d.get("arch") or ""), d.get("vendor"), d.get("brand"), tuple(d.get("flags") or ()),
                   d.get("u8s8_saturates"), d.get("source"), bool(d.get("pinned", False)))


def cpu_facts() -> CpuFacts:
    """This CPU's facts, or the pinned ones where ``QDQ_TUNE_CPU_FLAGS`` is set."""
    return _facts(os.environ.get(PIN_ENV, "").strip())


@functools.lru_cache(maxsize=8)
def _facts(pin: str) -> CpuFacts:
    real = _detected()
    if not pin:
        return real
    known = X86_FLAGS if real.arch in ("x86_64", "amd64", "i386", "i686") else ARM_FLAGS
    flags = tuple(f for f in pin.replace(",", " ").split() if f != "none")
    bad = [f for f in flags if f not in known]
    if bad:
        raise InputError(f"{PIN_ENV}={pin!r}: unknown CPU flag(s) {', '.join(bad)}; allowed: "
                         f"{', '.join(known)} (or none); unset it to use this CPU's own flags")
    saturates = not any(f in flags for f in VNNI_FLAGS) if known is X86_FLAGS else False
    return CpuFacts(real.arch, real.vendor, real.brand, tuple(f for f in known if f in flags), saturates,
                    f"pinned by {PIN_ENV}", pinned=True)


@functools.lru_cache(maxsize=1)
def _detected() -> CpuFacts:
    arch = platform.machine().lower()
    try:
        import archspec.cpu.detect as detect
    except ImportError:
        return CpuFacts(arch, source="unknown (archspec not installed)")
    try:
        if arch in ("x86_64", "amd64"):
            info = detect.cpuid_info()  # CPUID itself: what this process (or an emulator) really offers
            source = "cpuid"
        else:
            info = detect.detected_info()
            source = "os"
        features = set(info.features)
        vendor = info.vendor or None
    except Exception:  # noqa: BLE001 - facts are informational; the fidelity check still measures
        return CpuFacts(arch, source="unknown (CPU detection failed)")
    try:
        brand = detect.brand_string()
    except Exception:  # noqa: BLE001
        brand = None
    if arch in ("x86_64", "amd64", "i386", "i686"):
        return CpuFacts(arch, vendor, brand, tuple(f for f in X86_FLAGS if f in features),
                        not any(f in features for f in VNNI_FLAGS), source)
    if arch in ("aarch64", "arm64"):
        return CpuFacts(arch, vendor, brand, tuple(f for f in ARM_FLAGS if f in features), False, source)
    return CpuFacts(arch, vendor, brand, (), None, source)


def describe(facts: CpuFacts | None = None) -> str:
    """One line, e.g. 'AMD EPYC (x86_64; avx2 avx512f avx512_vnni)'."""
    return (facts or cpu_facts()).describe()


def target_cpus(cpus: Iterable[str], key: str = "target.cpus") -> tuple[str, ...]:
    """The kinds ``cpus`` lists (``x86``: every x86 kind), in KINDS' order; an InputError naming ``key``
    for a name that is not a kind."""
    names = [str(getattr(c, "value", c)).strip().lower() for c in cpus]
    bad = [n for n in names if n not in KINDS and n != ALL_X86]
    if bad:
        raise InputError(f"{key}: unknown CPU kind(s) {', '.join(bad)}; choose from {', '.join(KINDS)} or "
                         f"{ALL_X86} (every x86 kind)")
    wanted = set(KINDS) if ALL_X86 in names else set(names)
    return tuple(k for k in KINDS if k in wanted)


@contextlib.contextmanager
def target_configured(cpus: Iterable[str]) -> Iterator[None]:
    """The run's target kinds for the block (empty: this host only); the previous ones after it."""
    token = _TARGET.set(target_cpus(cpus))
    try:
        yield
    finally:
        _TARGET.reset(token)


def target_kinds() -> tuple[str, ...]:
    """The kinds the run's deployment must be right on: this host's and the target's, in KINDS' order
    (this host alone where its kind is unknown and no target is set)."""
    host = cpu_facts().kind
    wanted = set(_TARGET.get()) | ({host} if host else set())
    return tuple(k for k in KINDS if k in wanted)


def decision_facts() -> CpuFacts:
    """The facts numerics are chosen by: this CPU's, as saturating where a target kind's u8 x s8 kernels
    saturate though this CPU's do not (the weakest kind decides)."""
    facts = cpu_facts()
    weak = [k for k in _TARGET.get() if KINDS[k].saturates]
    if not weak or facts.u8s8_saturates:
        return facts
    return CpuFacts(facts.arch, facts.vendor, facts.brand, facts.flags, True,
                    f"target.cpus has {', '.join(weak)}, whose u8s8 kernels saturate", pinned=True)


def bf16_everywhere() -> bool:
    """Whether every target kind runs float layers in bf16 by default (True with no target: the host
    decides, as the runtime does)."""
    return all(KINDS[k].bf16 for k in _TARGET.get())
