"""Each stage's metrics record, by stage name: how a manifest entry is read back as the record its stage
wrote (the runner's summary of a stage skipped as up to date, backend=auto's summary, the Python API) and
what the shipped deployment was checked on."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pipeline.accuracy.kinds import CheckedOn
from pipeline.artifacts import Manifest
from pipeline.backends.base import DeploymentMetrics
from pipeline.errors import StateError, first_line
from pipeline.records.autotune import AutotuneMetrics
from pipeline.records.evaluate import EvaluateMetrics
from pipeline.records.export import ExportMetrics
from pipeline.records.quantize import QuantizeMetrics
from pipeline.stage import MODEL_KEYS, StageMetrics

# stage name -> the reader of its manifest metrics (``from_dict(d, where)``); the registry's stages, each once
STAGE_RECORDS: dict[str, Callable[[Mapping[str, Any], str], StageMetrics]] = {
    "export": ExportMetrics.from_dict, "quantize": QuantizeMetrics.from_dict, "autotune": AutotuneMetrics.from_dict,
    "gen_trt_engine": DeploymentMetrics.from_dict, "evaluate": EvaluateMetrics.from_dict,
}


def stage_metrics(stage: str, recorded: Mapping[str, Any] | None, where: str) -> StageMetrics | None:
    """The record of ``stage``'s manifest metrics (``Manifest.metrics(stage)``), None where it recorded none
    (it has not finished); a layout its stage never wrote is the record's one-line StateError naming ``where``."""
    return STAGE_RECORDS[stage](recorded, where) if recorded else None


def shipped_record(manifest: Manifest) -> CheckedOn | None:
    """What the deployment ``manifest``'s run shipped was checked on, as the stage that wrote the shipped
    model recorded it (quantize or autotune; None for the exported float, or a run made before the record
    existed)."""
    key = next((k for k in MODEL_KEYS if manifest.artifact(k) is not None), None)
    stage = key.split("/")[0] if key is not None else None
    if stage not in ("quantize", "autotune"):  # the exported float: no stage checked it
        return None
    recorded = stage_metrics(stage, manifest.metrics(stage), manifest.entry_name(stage))
    if not isinstance(recorded, (QuantizeMetrics, AutotuneMetrics)):
        return None
    try:
        return recorded.checked
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise StateError(f"{manifest.path}: the {stage} entry's checked_on record is not one ({first_line(exc)}); "
                         f"run that stage again (tune force=true stages=[...])") from None
