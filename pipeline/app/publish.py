"""backend=auto's result at the top level of results_dir: the top-level manifest's quantize and autotune
entries point at the winner's files (with every runtime's seconds), the exported float and its settings
where a float won, and the shipped model and its settings linked into results_dir/autotune/ so a reader
finds them without the manifest."""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

from pipeline.accuracy.kinds import checked_on, float_kinds
from pipeline.app.choice import float_deployment
from pipeline.app.host_choice import HOST_CHOICES, judged_hosts
from pipeline.app.race import STAGE_RACES, Race
from pipeline.app.runtime_runs import (
    PER_RUNTIME,
    RuntimeRun,
    reroot,
)
from pipeline.artifacts import Manifest, entry_name, external_data_files, read_json
from pipeline.errors import StateError
from pipeline.records.autotune import AutotuneMetrics
from pipeline.runtime_choice import CHOICE, FLOAT, RuntimeChoice

log = logging.getLogger("tune.auto")


def publish(top: Path, winner: RuntimeRun, choice: RuntimeChoice | None, settings_files: list[str] = ()) -> None:
    """The top-level manifest's quantize and autotune entries: the winner's, pointing at its files, the
    autotune one with the choice beside it (``choice`` None: no choice made yet). Where the winner's float
    ships (clearly faster than its own shipped model in the final comparison), autotune's model is the exported
    float and its settings file the float deployment's, written at the top level. With a choice, what ships is
    linked into results_dir/autotune/ (``place_shipped``; ``settings_files``: every runtime's settings file)."""
    sub = Manifest(winner.results_dir)
    manifest = Manifest(top)
    for stage in PER_RUNTIME:
        entry = sub.entry(stage)
        if entry is not None:
            manifest.stages[stage] = {**reroot(entry, winner.results_dir, top), **_every_runtime_seconds(top, stage)}
    auto = manifest.stages.get("autotune")
    if auto is not None and choice is not None:
        auto["outputs"][CHOICE] = manifest.describe_file(top / CHOICE)
        own = AutotuneMetrics.from_dict(auto.get("metrics") or {}, entry_name(winner.results_dir, "autotune"))
        auto["metrics"] = _published(manifest, winner, choice, auto["outputs"], own).to_dict()
    manifest.save()
    if choice is not None:
        place_shipped(top, list(settings_files))


SHIPPED_MODEL = "autotune/optimized_final.onnx"


def place_shipped(top: Path, settings_files: list[str]) -> None:
    """The shipped deployment where a reader finds it without the manifest, whatever runtime won: the model
    the top-level autotune entry ships (with the data files it names) linked as
    results_dir/autotune/optimized_final.onnx, and its settings file (one of ``settings_files``, the
    runtimes' settings artifacts) beside it; another runtime's settings file left there by an earlier
    choice is removed."""
    outputs = (Manifest(top).entry("autotune") or {}).get("outputs", {})
    for key in settings_files:
        if key not in outputs:
            (top / key).unlink(missing_ok=True)
    for key in [SHIPPED_MODEL, *dict.fromkeys(k for k in settings_files if k in outputs)]:
        if key not in outputs:
            continue
        src, dst = (top / outputs[key]["path"]).resolve(), top / key
        if src == dst.resolve():
            continue
        extra = [(f, dst.parent / f.name) for f in external_data_files(src)] if key == SHIPPED_MODEL else []
        for a, b in [(src, dst), *extra]:
            _link(a, b)


def _link(src: Path, dst: Path) -> None:
    """``dst`` the same file as ``src`` (a hard link, a copy across file systems), replaced atomically."""
    import shutil

    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copy2(src, tmp)
    os.replace(tmp, dst)


def _every_runtime_seconds(top: Path, stage: str) -> dict[str, Any]:
    """The seconds every runtime's own run spent in ``stage`` (the ones the race dropped too) and the races
    run within it took (``STAGE_RACES``), and their sum: what the top level's entry reports for the whole
    auto run."""
    spent = {}
    for sub in sorted((top / "runtimes").glob("*/manifest.json")):
        entry = Manifest(sub.parent).entry(stage) or {}
        if entry.get("seconds") is not None:
            spent[sub.parent.name] = float(entry["seconds"])
    if not spent:
        return {}
    raced = round(sum(Race.from_dict(read_json(top / name, name)).seconds
                      for name in STAGE_RACES.get(stage, ()) if (top / name).exists()), 3)
    return {"seconds": round(sum(spent.values()) + raced, 3), "seconds_by_runtime": spent, "race_seconds": raced}


def _published(manifest: Manifest, winner: RuntimeRun, choice: RuntimeChoice, outputs: dict[str, Any],
               own: AutotuneMetrics) -> AutotuneMetrics:
    """The top level's autotune metrics: a new record built from the winner's ``own`` (left as it is), with
    what ships where its float does, each host's choice, and the choice with the winner's own headline."""
    top = manifest.results_dir
    metrics = own
    if choice.ships == FLOAT:
        metrics = _ship_float(manifest, winner, outputs, metrics)
    if (top / HOST_CHOICES).exists():
        outputs[HOST_CHOICES] = manifest.describe_file(top / HOST_CHOICES)
        choices = read_json(top / HOST_CHOICES, HOST_CHOICES)
        metrics = replace(metrics, host_choices=choices)
        if metrics.checked_on and choice.ships != FLOAT:  # the winner's model as other hosts judged it
            metrics = replace(metrics, checked_on={**metrics.checked_on, "hosts": judged_hosts(choices, winner.name)})
    return replace(metrics, headline=choice.headline, runtime_choice=choice.to_dict(), runtime_headline=own.headline)


def _ship_float(manifest: Manifest, winner: RuntimeRun, outputs: dict[str, Any], metrics: AutotuneMetrics
                ) -> AutotuneMetrics:
    """Point ``outputs`` at the exported float and the float deployment's settings (written at the top level);
    the autotune metrics of what ships then: the float, with its verdict against FP32 where it runs lower."""
    top = manifest.results_dir
    backend = float_deployment(winner, metrics)
    float_path = manifest.artifact("export/model.onnx")
    if float_path is None:
        raise StateError(f"backend=auto: no export/model.onnx in {top}: run stage 'export' first")
    outputs["autotune/optimized_final.onnx"] = manifest.describe_file(float_path)
    kind = backend.shipped_settings
    if kind is not None:
        outputs.pop(kind.artifact, None)
        if backend.settings is not None:
            pinned = backend.settings.pinned(backend)
            outputs[kind.artifact] = manifest.describe_file(pinned.save(top / kind.artifact))
    chosen = metrics.float_baseline
    judged = chosen.verdict if chosen is not None and chosen.precision == chosen.default else None
    return replace(metrics, shipped="float", shipped_reason="auto: its float ran clearly faster than its shipped model",
                   final_ms=metrics.baseline_ms, speedup=1.0, accuracy=replace(metrics.accuracy, final=judged),
                   checked_on=checked_on(backend, float_kinds(judged)).to_dict())
