"""Runs the requested stages in order inside one results_dir.

A stage is skipped when its manifest entry is ``done``, its fingerprint (its config sections plus
the sha256 of every input artifact) is unchanged and its outputs are intact. Once a stage runs, every
later stage in the same invocation runs too. The manifest is rewritten atomically at every status
change, so an interrupted run shows which stage was in flight.
"""

from __future__ import annotations

import functools
import logging
import platform
import shutil
import socket
import subprocess
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.accuracy.metrics import json_safe
from pipeline.app.scope import is_tuning_frozen, run_scope
from pipeline.artifacts import Manifest, ResultsDirLock, fingerprint, sha256_file
from pipeline.backend_config import runtime_packages
from pipeline.backends.timing import MIN_BLOCK_MS
from pipeline.config import ordered_stages, validate
from pipeline.errors import PipelineError, StageError, StateError
from pipeline.graph import weights
from pipeline.records.stages import stage_metrics
from pipeline.registry import load_stage
from pipeline.stage import Stage, StageContext, StageResult
from pipeline.values import section

log = logging.getLogger("tune")


def _version() -> str:

    try:
        return version("qdq-tune")
    except PackageNotFoundError:
        return "dev"


# part of every fingerprint: a new release of qdq-tune re-runs stages instead of trusting old outputs
_VERSION = _version()


# the packages every run records besides the runtimes' own (pipeline.backend_config.runtime_packages)
_PACKAGES = ("qdq-tune", "onnx", "torch", "numpy", "hydra-core", "onnx-graphsurgeon")


def environment() -> dict[str, Any]:
    """What a result depends on besides the config: host, Python, package versions, CPU and GPU."""

    from pipeline.quant.cpu import describe

    packages = {}
    for name in (*_PACKAGES, *runtime_packages()):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            pass
    return {"host": socket.gethostname(), "python": platform.python_version(), "packages": packages,
            "cpu": describe(), "gpus": list(gpus())}


@functools.lru_cache(maxsize=1)
def gpus() -> tuple[str, ...]:
    """This host's NVIDIA GPUs with their driver versions (none without nvidia-smi)."""
    if not shutil.which("nvidia-smi"):
        return ()
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ()
    return tuple(ln.strip() for ln in out.stdout.splitlines() if ln.strip())


def _outputs_intact(manifest: Manifest, entry: dict[str, Any]) -> bool:
    for rec in entry.get("outputs", {}).values():
        p = manifest.results_dir / rec["path"]
        if not p.exists() or p.stat().st_size != rec.get("bytes", -1) or sha256_file(p) != rec["sha256"]:
            return False
    return True


def stage_fingerprint(stage: Stage, cfg: DictConfig, inputs: dict[str, Path],
                      digests: dict[str, str] | None = None) -> str:
    """What a finished stage's outputs depend on: the tool's version, its config sections, its inputs'
    contents (``digests``: their sha256 by key where the caller has them) and, for a host-bound stage,
    the host's CPU kind, runtime versions and GPUs."""
    from pipeline.accuracy.kinds import host_key

    digests = digests if digests is not None else {k: sha256_file(p) for k, p in inputs.items()}
    return fingerprint(
        {
            "qdq_tune": _VERSION,
            "config": {k: section(cfg, k) for k in stage.config_keys},
            "inputs": {k: digests[k] for k in sorted(inputs)},
            **({"host": host_key(), "gpus": list(gpus())} if stage.host_bound else {}),
        }
    )


def run_pipeline(cfg: DictConfig, results_dir: Path) -> dict[str, Any]:
    """Run ``cfg.stages`` in ``results_dir``; returns {stage: {"status", "metrics", ...}}, each stage's metrics
    its record (``StageMetrics``; None where a stage recorded none)."""
    validate(cfg)
    from pipeline.backends import check_backend, is_auto

    check_backend(cfg)  # a missing runtime fails here, before the lock and any stage
    stages = [load_stage(n) for n in ordered_stages(cfg)]  # fail on unbuilt stages before doing any work
    # the bars and ORT sessions deep inside (weights, saves, calibration) follow the config too, for
    # this run only
    with run_scope(threads=int(cfg.backend.get("intra_op_threads", 0) or 0), progress=bool(cfg.progress),
                   min_block_ms=float(cfg.backend.get("min_block_ms", MIN_BLOCK_MS)), target=list(cfg.target.cpus)):
        if is_auto(cfg.backend):
            from pipeline.app.auto import run_auto

            return run_auto(cfg, Path(results_dir), _run_stages)
        return _run_stages(cfg, stages, Path(results_dir))


def _run_stages(cfg: DictConfig, stages: list[Stage], results_dir: Path) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    with ResultsDirLock(results_dir) as lock:
        if lock.took_over_from is not None:
            log.warning("took over a stale lock in %s (pid %s is gone)", results_dir,
                        lock.took_over_from.get("pid", "?"))
        manifest = Manifest(results_dir)
        manifest.data["environment"] = environment()  # of the latest invocation
        ctx = StageContext(cfg=cfg, results_dir=results_dir, manifest=manifest, log=log)
        rerun_rest = bool(cfg.get("force", False))
        for stage in stages:
            ctx.log = logging.getLogger(f"tune.{stage.name}")
            inputs = stage.resolve_inputs(ctx)
            digests = {k: sha256_file(p) for k, p in inputs.items()}  # hashed once: a model's data can be GBs
            fp = stage_fingerprint(stage, cfg, inputs, digests)
            entry = manifest.entry(stage.name)
            if (not rerun_rest and entry and entry.get("status") == "done"
                    and entry.get("fingerprint") == fp and _outputs_intact(manifest, entry)):
                log.info("%s: up to date, skipped (inputs and config unchanged)", stage.name)
                summary[stage.name] = {"status": "skipped", "metrics": stage_metrics(
                    stage.name, entry.get("metrics"), manifest.entry_name(stage.name))}
                continue
            if stage.tunes and is_tuning_frozen():
                raise StateError(f"{stage.name} in {results_dir} is not up to date with this run's config and "
                                 f"inputs (another qdq-tune version, or changed spec files or data): a re-choice "
                                 f"tunes nothing; run tune on the results_dir first (it tunes again), then re-choose")
            rerun_rest = True
            summary[stage.name] = _run_one(stage, ctx, inputs, digests, fp)
    return summary


def _run_one(stage: Stage, ctx: StageContext, inputs: dict[str, Path], digests: dict[str, str], fp: str
             ) -> dict[str, Any]:
    manifest = ctx.manifest
    started = time.time()
    manifest.update(
        stage.name, status="running", fingerprint=fp, started=started, finished=None, error=None,
        inputs={k: manifest.describe_file(p, digests[k]) for k, p in inputs.items()},
        config={k: section(ctx.cfg, k) for k in stage.config_keys},
    )
    log.info("%s: running", stage.name)
    try:
        result = stage.run(ctx)
        if not isinstance(result, StageResult):
            raise TypeError(f"stage {stage.name} returned {type(result).__name__}, not StageResult")
        missing = [k for k in stage.outputs if k not in result.artifacts or not Path(result.artifacts[k]).exists()]
        if missing:
            raise StageError(f"stage {stage.name} finished without writing {', '.join(missing)}")
    except KeyboardInterrupt:
        manifest.update(stage.name, status="interrupted", finished=time.time())
        raise
    except PipelineError as exc:
        manifest.update(stage.name, status="failed", finished=time.time(), error=str(exc))
        raise
    except Exception as exc:
        manifest.update(stage.name, status="failed", finished=time.time(), error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        weights.release()  # the stage's models are gone: its data files lose their extra hard links
    finished = time.time()
    manifest.update(
        stage.name, status="done", finished=finished, seconds=round(finished - started, 3),
        outputs={k: manifest.describe_file(Path(p)) for k, p in result.artifacts.items()},
        # strict JSON: a metric that is NaN or infinite is written as null
        metrics=json_safe(result.metrics.to_dict()), notes=result.notes,
    )
    log.info("%s: done in %.1f s", stage.name, finished - started)
    return {"status": "done", "metrics": result.metrics, "seconds": finished - started}
