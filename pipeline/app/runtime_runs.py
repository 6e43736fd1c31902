"""Each runtime's own run under backend=auto: its config (the runtime's section as `backend`) and its
results_dir (results_dir/runtimes/<name>/, whose manifest points at the shared export), a stage run there
with a failure left out in one line (``EachRuntime``), and the runtime's float as a deployment runs it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, open_dict

from pipeline.app.scope import run_scope
from pipeline.artifacts import Manifest
from pipeline.backends import Backend, auto_runtimes, create_backend
from pipeline.errors import BackendUnavailable, PipelineError, first_line
from pipeline.registry import load_stage
from pipeline.stage import Stage

log = logging.getLogger("tune.auto")

PER_RUNTIME = ("quantize", "autotune")  # the stages each runtime runs in its own results_dir


@dataclass(frozen=True)
class RuntimeRun:
    """One runtime's own run: its name, the config with its section as `backend`, its results_dir."""

    name: str
    cfg: DictConfig
    results_dir: Path


class EachRuntime:
    """Runs a stage in each runtime's own results_dir: a runtime whose run fails is left out in one line
    (its error kept), and each runtime's outcome of every stage is kept for the summary."""

    def __init__(self, cfg: DictConfig, top: Path, run_stages: Callable[[DictConfig, list[Stage], Path], dict[str, Any]],
                 left_out: dict[str, str]):
        self.cfg, self.top, self.run_stages, self.left_out = cfg, top, run_stages, left_out
        self.outcomes: dict[str, dict[str, Any]] = {}
        self.failures: list[PipelineError] = []

    def run(self, runs: list[RuntimeRun], stage: str) -> list[RuntimeRun]:
        """``stage`` in each of ``runs``, in order; the runs that did not fail."""
        return [r for r in runs if self.one(r, stage)]

    def one(self, run: RuntimeRun, stage: str) -> bool:
        """``stage`` in ``run``'s results_dir; whether it ran (else it is left out)."""
        share_export(self.top, run.results_dir)
        log.info("auto: %s %s in %s", run.name, stage, run.results_dir)
        try:
            with run_scope_of(self.cfg, run):
                self.outcomes.setdefault(run.name, {}).update(
                    self.run_stages(run.cfg, [load_stage(stage)], run.results_dir))
        except PipelineError as exc:
            log.warning("auto: %s left out: %s", run.name, first_line(exc))
            self.left_out[run.name] = first_line(exc)
            self.failures.append(exc)
            return False
        return True


def run_scope_of(cfg: DictConfig, run: RuntimeRun) -> AbstractContextManager[None]:
    """The run-wide settings of one runtime's own run."""
    return run_scope(threads=int(run.cfg.backend.get("intra_op_threads", 0) or 0), progress=bool(cfg.progress))


def runnable(cfg: DictConfig, results_dir: Path) -> tuple[list[RuntimeRun], dict[str, str]]:
    """The runtimes of backend.runtimes that can run here, and why each other one cannot."""
    runs, left_out = [], {}
    for name, bcfg in auto_runtimes(cfg.backend):
        try:
            create_backend(bcfg)
        except BackendUnavailable as exc:
            log.warning("auto: %s left out: %s", name, first_line(exc))
            left_out[name] = first_line(exc)
            continue
        sub = results_dir / "runtimes" / name
        rcfg = cfg.copy()
        with open_dict(rcfg):
            rcfg.backend = bcfg
            rcfg.results_dir = str(sub)
        runs.append(RuntimeRun(name, rcfg, sub))
    return runs, left_out


def reroot(entry: dict[str, Any], src: Path, dst: Path) -> dict[str, Any]:
    """A manifest entry of results_dir ``src`` as results_dir ``dst`` records it (same files)."""
    outputs = {k: {**rec, "path": os.path.relpath(src / rec["path"], dst)} for k, rec in entry.get("outputs", {}).items()}
    return {**entry, "outputs": outputs}


def share_export(top: Path, sub: Path) -> None:
    """Point ``sub``'s manifest at the top-level export (its files are not copied)."""
    entry = Manifest(top).entry("export")
    if not entry or entry.get("status") != "done":
        return
    sub.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(sub)
    manifest.stages["export"] = reroot(entry, top, sub)
    manifest.save()


def deployed_float(run: RuntimeRun) -> Backend:
    """The runtime's float as a deployment runs it with no tuned settings (its own default precision)."""
    return create_backend(run.cfg.backend).as_deployed()


__all__ = ["PER_RUNTIME", "EachRuntime", "RuntimeRun", "deployed_float", "reroot", "run_scope_of", "runnable", "share_export"]
