"""autotune stage: Q/DQ placement chosen by measured latency (region mode and subgraph mode).

The public API keeps the reference tool's names; they are imported on first use so that loading the
stage's config schema (and `tune --help`) stays instant::

    from tasks.autotune import QDQAutotuner, Config, PatternCache, get_quantized_tensors
    from tasks.autotune.region_workflow import region_pattern_autotuning_workflow
"""

from __future__ import annotations

import importlib
from typing import Any

_API = {
    "Config": "tasks.autotune.autotuner",
    "QDQAutotuner": "tasks.autotune.autotuner",
    "QDQAutotunerBase": "tasks.autotune.autotuner",
    "PatternCache": "tasks.autotune.pattern_cache",
    "Region": "tasks.autotune.region",
    "RegionType": "tasks.autotune.region",
    "RegionPattern": "tasks.autotune.pattern",
    "InsertionPoint": "tasks.autotune.insertion_points",
    "InsertionScheme": "tasks.autotune.scheme",
    "CombinedRegionSearch": "tasks.autotune.region_search",
    "get_quantized_tensors": "pipeline.quant.qdq",
    "region_pattern_autotuning_workflow": "tasks.autotune.region_workflow",
    "init_benchmark_instance": "tasks.autotune.region_workflow",
    "benchmark_onnx_model": "tasks.autotune.region_workflow",
}

__all__ = sorted(_API)


def __getattr__(name: str) -> Any:
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'tasks.autotune' has no attribute {name!r}")
