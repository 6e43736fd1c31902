"""The OpenVINO half of autotune's runtime search: which compile properties are worth measuring for a
shipped model on backend=openvino, read from what OpenVINO picks for that model on this machine.

OpenVINO resolves every property the compile leaves open (its inference precision, thread count,
streams, pinning) from the CPU and the performance hint. The shipped model is compiled once with the
backend's own properties, and each candidate sets one property to a value other than the one the
compiled model reports, so no candidate measures what already runs. The CPU plugin's properties
(threads, pinning, denormals) are only searched on device CPU. The search itself is
tasks.autotune.runtime.search.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from pipeline.backends.base import Backend, SearchSpace
from pipeline.backends.openvino.settings import PROPERTIES, CompileSettings, core, property_text

log = logging.getLogger("tune.autotune")

# the properties the candidates change, as the compiled model reports them (see ``picked``)
SEARCHED = ("INFERENCE_PRECISION_HINT", "INFERENCE_NUM_THREADS", "NUM_STREAMS", "ENABLE_CPU_PINNING",
            "CPU_DENORMALS_OPTIMIZATION")


def candidates(picked: dict[str, str], capabilities: list[str], cpu: bool = True) -> list[tuple[str, dict]]:
    """(name, change) for every compile property worth measuring, in the order the greedy search tries
    them: the other inference precision (bf16 only where the device has BF16), one thread, a single
    stream, CPU pinning flipped, denormals flushed. Thread and stream counts are only ever rules that
    mean the same on every machine (one thread, one stream, or OpenVINO's own choice, left open): a
    count taken from this host's cores would mean something else on the next. ``picked`` is what the compiled
    model reports for ``SEARCHED``; a value equal to it is not a candidate; ``cpu=False`` leaves out
    the CPU plugin's own properties."""
    out: list[tuple[str, dict]] = []
    precisions = ["f32", *(["bf16"] if "BF16" in capabilities else [])]
    out += [(f"inference precision {p}", {"INFERENCE_PRECISION_HINT": p}) for p in precisions
            if p != picked.get("INFERENCE_PRECISION_HINT")]
    if cpu:
        if picked.get("INFERENCE_NUM_THREADS") != "1":
            out.append(("1 inference thread", {"INFERENCE_NUM_THREADS": 1}))
    if picked.get("NUM_STREAMS") != "1":
        out.append(("single stream (NUM_STREAMS 1)", {"NUM_STREAMS": 1}))
    if cpu:
        pinning = "NO" if picked.get("ENABLE_CPU_PINNING", "YES") == "YES" else "YES"
        out.append((f"CPU pinning {'off' if pinning == 'NO' else 'on'}", {"ENABLE_CPU_PINNING": pinning}))
        if picked.get("CPU_DENORMALS_OPTIMIZATION") != "YES":
            out.append(("denormals optimization on", {"CPU_DENORMALS_OPTIMIZATION": "YES"}))
    return out


def base_settings(backend: Backend) -> CompileSettings:
    """The compile properties the backend's own keys give (backend.performance_hint,
    inference_precision, threads, streams): where the search starts, and what ships when nothing
    helped, so a deployment compiling with the shipped file alone runs what was measured."""
    own = backend.with_settings(None).properties()
    return CompileSettings.from_dict({k: v for k, v in own.items() if k in PROPERTIES})


def apply_change(settings: CompileSettings, change: dict) -> CompileSettings:
    return settings.changed(**change)


def picked(compiled: Any) -> dict[str, str]:
    """The values of ``SEARCHED`` a compiled model runs with (those its device does not report are
    left out)."""
    out = {}
    for name in SEARCHED:
        try:
            out[name] = property_text(compiled.get_property(name))
        except RuntimeError:  # a property another device's plugin does not have
            continue
    return out


def search_candidates(backend: Backend, shipped: Path) -> tuple[list[tuple[str, dict]], dict[str, Any]]:
    """The candidates for ``shipped`` on this OpenVINO backend, and what the search reports beside its
    steps: the OpenVINO version and the properties it picked for the model with the backend's own."""
    device = str(backend.cfg.device)
    compiled = backend.with_settings(base_settings(backend)).compile(shipped)
    chosen = picked(compiled)
    capabilities = [str(c) for c in core().get_property(device, "OPTIMIZATION_CAPABILITIES")]
    log.info("runtime search: OpenVINO compiles %s on %s with %s", shipped.name, device,
             ", ".join(f"{k}={v}" for k, v in chosen.items()))
    found = {"openvino_version": backend.describe()["openvino"], "openvino_picked": chosen}
    return candidates(chosen, capabilities, cpu=device == "CPU"), found


# what autotune's runtime search runs on this runtime (its Backend.search_space())
# its precision and its threads interact: f32 on one thread can beat the bf16 it lost to on every core
SPACE = SearchSpace(base_settings, search_candidates, apply_change, retry_after_kept=True)
