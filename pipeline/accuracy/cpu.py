"""What this CPU's integer kernels can do: vendor, model and the instruction-set flags that decide
whether ONNX Runtime's u8 x s8 kernels are exact.

On x86 without VNNI (AVX2, or AVX-512 before Cascade Lake), MLAS multiplies uint8 activations by
int8 weights with VPMADDUBSW, which adds each pair of products in int16 with saturation: 2 x 255 x
127 = 64770 does not fit, so layers with full-range activations and weights near +-127 silently
compute wrong sums. VNNI (VPDPBUSD) accumulates in int32 and is exact. The flags are read with
CPUID (archspec), i.e. what this process's instructions really see, which is what MLAS dispatches on.
"""

from __future__ import annotations

import functools
import platform
from typing import Any

# x86 flags (archspec's names, as in /proc/cpuinfo) that matter for int8 kernels
X86_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_int8")
VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
# aarch64: SDOT/UDOT and the int8 matrix multiply extension accumulate in int32 (exact)
ARM_FLAGS = ("asimddp", "i8mm", "sve")


@functools.lru_cache(maxsize=1)
def cpu_facts() -> dict[str, Any]:
    """Vendor, brand, architecture, int8-relevant flags, and whether u8 x s8 kernels may saturate.

    ``u8s8_saturates`` is True on x86 without VNNI, False where dot-product instructions accumulate
    in int32, and None when unknown (archspec missing or an unfamiliar architecture).
    """
    arch = platform.machine().lower()
    facts: dict[str, Any] = {"arch": arch, "vendor": None, "brand": None, "flags": [], "u8s8_saturates": None,
                             "source": None}
    try:
        import archspec.cpu.detect as detect
    except ImportError:
        facts["source"] = "unknown (archspec not installed)"
        return facts
    try:
        if arch in ("x86_64", "amd64"):
            info = detect.cpuid_info()  # CPUID itself: what this process (or an emulator) really offers
            facts["source"] = "cpuid"
        else:
            info = detect.detected_info()
            facts["source"] = "os"
        features = set(info.features)
        facts["vendor"] = info.vendor or None
    except Exception:  # noqa: BLE001 - facts are informational; the fidelity check still measures
        return {**facts, "source": "unknown (CPU detection failed)"}
    try:
        facts["brand"] = detect.brand_string()
    except Exception:  # noqa: BLE001
        facts["brand"] = None
    if arch in ("x86_64", "amd64", "i386", "i686"):
        facts["flags"] = [f for f in X86_FLAGS if f in features]
        facts["u8s8_saturates"] = not any(f in features for f in VNNI_FLAGS)
    elif arch in ("aarch64", "arm64"):
        facts["flags"] = [f for f in ARM_FLAGS if f in features]
        facts["u8s8_saturates"] = False
    return facts


def describe(facts: dict[str, Any] | None = None) -> str:
    """One line, e.g. 'AMD EPYC (x86_64; avx2 avx512f avx512_vnni)'."""
    f = facts or cpu_facts()
    flags = " ".join(f.get("flags") or []) or "no int8 dot-product flags"
    return f"{f.get('brand') or f.get('vendor') or 'unknown CPU'} ({f.get('arch')}; {flags})"
