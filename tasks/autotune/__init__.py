"""autotune stage: Q/DQ placement chosen by measured latency (region mode and subgraph mode).

The public API keeps the reference tool's names; they are imported on first use so that loading the
stage's config schema (and `tune --help`) stays instant::

    from tasks.autotune import QDQAutotuner, Config, PatternCache, get_quantized_tensors
    from tasks.autotune.region.workflow import region_pattern_autotuning_workflow
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "Config": "tasks.autotune.region.autotuner",
    "QDQAutotuner": "tasks.autotune.region.autotuner",
    "QDQAutotunerBase": "tasks.autotune.region.autotuner",
    "PatternCache": "tasks.autotune.region.pattern_cache",
    "Region": "tasks.autotune.region.region",
    "RegionType": "tasks.autotune.region.region",
    "RegionPattern": "tasks.autotune.region.pattern",
    "InsertionPoint": "tasks.autotune.region.insertion_points",
    "InsertionScheme": "tasks.autotune.region.scheme",
    "CombinedRegionSearch": "tasks.autotune.region.search",
    "get_quantized_tensors": "pipeline.quant.qdq",
    "region_pattern_autotuning_workflow": "tasks.autotune.region.workflow",
    "init_benchmark_instance": "tasks.autotune.region.workflow",
    "benchmark_onnx_model": "tasks.autotune.region.workflow",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'tasks.autotune' has no attribute {name!r}")
