"""The TensorRT half of autotune's runtime search: which builder settings are worth measuring for a
shipped Q/DQ model on backend=tensorrt or backend=trtexec, and why each is on the list.

Every candidate is one documented IBuilderConfig setting with its trtexec flag
(pipeline.backends.tensorrt.settings.KNOBS, which names the sources). A setting the user already fixed in
backend.trtexec_args is not searched (their flag wins on the command line), and one the TensorRT
version lacks is not proposed. The search itself is tasks.autotune.runtime.search.

Considered and left out, with TensorRT's documentation as the reason:

- clearing TF32 (``--noTF32`` / ``config.clear_flag(trt.BuilderFlag.TF32)``): TF32 is "Enabled by
  default" and only lets float32 layers round their inner products to TF32; turning it off can only
  take that faster path away, so it is an accuracy choice, not a speed one;
- tactic sources (``--tacticSources=-JIT_CONVOLUTIONS`` / ``config.set_tactic_sources``): the builder
  times the tactics of every enabled source and keeps the fastest, so removing a source only removes
  choices; TensorRT 11 lists only EDGE_MASK_CONVOLUTIONS ("tradeoff memory for performance") and
  JIT_CONVOLUTIONS as optional, and the sources that are off by default in TensorRT 10 (CUBLAS,
  CUBLAS_LT, CUDNN) are deprecated there.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from pipeline.backends.base import Backend, SearchSpace
from pipeline.backends.tensorrt.settings import KNOB, TrtBuildSettings

log = logging.getLogger("tune.autotune")

_DEFAULT_BUILDER_LEVEL = 3  # trtexec --help: "(default is 3)"
# TilingOptimizationLevel FAST (1) "Slightly increases engine build time", MODERATE (2) "Moderately
# increases engine build time"; FULL (3) "Significantly increases engine build time" is left out:
# every step of the search builds two engines
_TILING_LEVELS = (1, 2)


def tensorrt_version(backend: Backend) -> tuple[int, int] | None:
    """(major, minor) of the TensorRT the backend runs: trtexec's banner, or the Python module's
    ``__version__``; None while unknown."""
    text = backend.version if backend.name == "trtexec" else getattr(backend.trt, "__version__", None)
    m = re.match(r"(\d+)\.(\d+)", str(text or ""))
    return (int(m[1]), int(m[2])) if m else None


def _fixed_by_user(backend: Backend) -> set[str]:
    """trtexec flags the user set in backend.trtexec_args (they win over ours on the command line)."""
    if backend.name != "trtexec":
        return set()
    return {str(a).split("=", 1)[0] for a in backend.cfg.trtexec_args}


def candidates(backend: Backend) -> list[tuple[str, dict]]:
    """(name, change) for every builder setting worth measuring on this backend, in the order the
    greedy search tries them."""
    fixed, version = _fixed_by_user(backend), tensorrt_version(backend)
    skipped = sorted(fixed & {k.flag for k in KNOB.values()})
    if skipped:
        log.info("runtime search: backend.trtexec_args sets %s; not searched", ", ".join(skipped))
    out: list[tuple[str, dict]] = []
    if KNOB["builder_optimization_level"].flag not in fixed:
        # IBuilderConfig.builder_optimization_level (Python API reference): "Setting a higher optimization
        # level allows TensorRT to spend longer engine building time searching for more optimization
        # options. The resulting engine may have better performance compared to an engine built with a
        # lower optimization level." Levels above the backend's own, up to the maximum (5)
        start = backend.cfg.get("builder_optimization_level")
        start = _DEFAULT_BUILDER_LEVEL if start is None else int(start)
        out += [(f"builder optimization level {n}", {"builder_optimization_level": n})
                for n in range(start + 1, int(KNOB["builder_optimization_level"].high) + 1)]
    tiling = KNOB["tiling_optimization_level"]
    if tiling.flag not in fixed and version is not None and version >= tiling.since:
        # trt.TilingOptimizationLevel: "TensorRT will try tiling optimization for on-chip caching if
        # non-zero level is set"; the default is NONE, so an engine gets none unless asked
        out += [(f"tiling optimization level {tiling.names[n]}", {"tiling_optimization_level": n})
                for n in _TILING_LEVELS]
    elif tiling.flag not in fixed:
        log.info("runtime search: TensorRT %s has no tiling optimization level (10.8 or later); not searched",
                 ".".join(map(str, version)) if version else "(version unknown)")
    if KNOB["max_aux_streams"].flag not in fixed:
        # IBuilderConfig.max_aux_streams: TensorRT's heuristic decides by default; "Allowing more auxiliary
        # streams does not always give better performance since there will be synchronizations overhead
        # between streams ... Set this to 0 to enforce single-stream inference." A synchronization weighs
        # more where kernels are short, as int8 ones are
        out.append(("single stream (max_aux_streams 0)", {"max_aux_streams": 0}))
    return out


def base_settings(backend: Backend) -> TrtBuildSettings:
    """Where the search starts and what ships when nothing helped: nothing changed, the backend's own
    configuration (backend.builder_optimization_level, backend.trtexec_args) as it is."""
    return TrtBuildSettings()


def apply_change(settings: TrtBuildSettings, change: dict) -> TrtBuildSettings:
    return settings.changed(**change)


def search_candidates(backend: Backend, shipped: Path) -> tuple[list[tuple[str, dict]], dict[str, Any]]:
    """The candidates on this backend (they do not depend on the model), and the TensorRT version
    they were chosen for."""
    version = tensorrt_version(backend)
    return candidates(backend), {"tensorrt_version": ".".join(map(str, version)) if version else None}


# what autotune's runtime search runs on this runtime (its Backend.search_space())
SPACE = SearchSpace(base_settings, search_candidates, apply_change)
