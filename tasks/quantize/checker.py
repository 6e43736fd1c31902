"""The quantize stage's checks of a candidate model on the held-out batches: ``Checker`` runs each
candidate on the runtime's own fused kernels for ONNX Runtime and OpenVINO placements (what will be
deployed), as plain Q/DQ math on ONNX Runtime for TensorRT placements (TensorRT's integer kernels are
exact; its numbers cannot be measured on this machine), and judges it against the accuracy budget."""

from __future__ import annotations

import contextvars
import logging
import tempfile
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import onnx

from pipeline.accuracy.budget import AccuracyBudget, AccuracyVerdict
from pipeline.accuracy.fidelity import FidelityResult
from pipeline.accuracy.holdout import Holdout
from pipeline.backends.base import Backend
from pipeline.errors import first_line
from pipeline.graph.model import save_model
from pipeline.records.quantize import StorageCheck

log = logging.getLogger("tune.quantize")


@dataclass
class Candidate:
    """A quantized model checked on the holdout: loads, runs, kernel fidelity, accuracy verdict."""

    name: str
    path: Path
    verdict: AccuracyVerdict | None = None
    fidelity: FidelityResult | None = None
    latency_p10_ms: float | None = None
    error: str | None = None
    reference: Any = field(default=None, repr=False)  # its plain Q/DQ form prepared already, while it is checked

    @property
    def usable(self) -> bool:
        return self.error is None and (self.fidelity is None or self.fidelity.ok)

    @property
    def scored(self) -> bool:
        """It ran and was judged: ``verdict`` holds the budget's verdict."""
        return self.error is None and self.verdict is not None

    def record(self) -> StorageCheck:
        """What calibration.json keeps of the check (its model file is gone after the stage)."""
        return StorageCheck(self.name, self.error, self.latency_p10_ms, self.fidelity, self.verdict)


@dataclass
class Checker:
    backend: Backend  # ONNX Runtime, or OpenVINO for its placement
    holdout: Holdout
    budget: AccuracyBudget
    fused: bool  # run with the backend's fused kernels (ORT placement) or as plain Q/DQ math
    workdir: Path
    # the model ``runs`` found running, its file and both prepared forms: the next check of that very
    # model takes them instead of writing and preparing it again
    _ran: tuple[onnx.ModelProto, Path, Any, Any] | None = field(default=None, init=False, repr=False)

    def write(self, model: onnx.ModelProto, name: str) -> Path:
        return save_model(model, self.workdir / f"{name}.onnx", share_weights=True)

    def runs(self, model: onnx.ModelProto) -> str | None:
        """None if the model loads and runs on a holdout batch with the fused kernels and as plain Q/DQ
        math (the fidelity reference), else the runtime's first error line."""
        self._drop_ran()
        path = self.write(model, "runs")
        prepared: list[Any] = []
        try:
            for prepare in (self.backend.prepare, self.backend.prepare_reference):
                prepared.append(prepare(path))
                prepared[-1].run(self.holdout.feeds[0])
        except Exception as exc:  # noqa: BLE001 - the runtime's own error types
            for pm in prepared:
                pm.close()
            return first_line(exc)
        self._ran = (model, path, *prepared)
        return None

    def _drop_ran(self) -> None:
        if self._ran is not None:
            for pm in self._ran[2:]:
                pm.close()
            self._ran = None

    def check(self, model: onnx.ModelProto, name: str, fidelity: bool = False) -> Candidate:
        """Load and run ``model`` on the holdout; never raises for a model the runtime rejects."""
        return self._judge(*self._load(model, name), fidelity)

    def check_each(self, models: Iterable[tuple[onnx.ModelProto, str]]) -> Iterator[Candidate]:
        """``check`` of each (model, name) in turn, each model written and built by the runtime in a
        worker thread while the one before runs on the holdout: a runtime's build (OpenVINO's compile,
        ONNX Runtime's session) releases the GIL and is most of a check's time on small models. Names
        must differ from one model to the next (their files are written side by side)."""
        it = iter(models)
        with ThreadPoolExecutor(1, thread_name_prefix="qdq-tune-check") as pool:
            item = next(it, None)
            # the worker runs in this run's context (its threads, progress, weights folder: ContextVars)
            pending = pool.submit(contextvars.copy_context().run, self._load, *item) if item is not None else None
            try:
                while pending is not None:
                    item = next(it, None)  # built here (Python) while the worker builds the runtime's model
                    loaded = pending.result()
                    pending = pool.submit(contextvars.copy_context().run, self._load, *item) \
                        if item is not None else None
                    yield self._judge(*loaded)
            finally:  # a caller that stops early: the model loaded ahead is closed
                if pending is not None and (ahead := pending.result()[1]) is not None:
                    ahead.close()

    def _load(self, model: onnx.ModelProto, name: str) -> tuple[Candidate, Any]:
        """(the candidate, its prepared model or None where the runtime cannot load it)."""
        if self._ran is not None and self._ran[0] is model and self.fused:
            _, path, fused, reference = self._ran
            self._ran = None
            return Candidate(name, path, reference=reference), fused
        self._drop_ran()
        c = Candidate(name, self.write(model, name))
        try:
            return c, self.backend.prepare(c.path) if self.fused else self.backend.prepare_reference(c.path)
        except Exception as exc:  # noqa: BLE001 - a model the runtime cannot load is a rejected candidate
            c.error = f"{self.backend.name} cannot load it: {first_line(exc)}"
            return c, None

    def _judge(self, c: Candidate, pm: Any, fidelity: bool = False) -> Candidate:
        from pipeline.accuracy.fidelity import kernel_fidelity

        if pm is None:
            return c
        try:
            outputs = self.holdout.outputs(pm)
            c.verdict = self.holdout.judge(outputs, self.budget)
            if fidelity and self.fused:
                c.fidelity = kernel_fidelity(self.backend, c.path, self.holdout.feeds, float_outputs=self.holdout.reference,
                                             fused_outputs=outputs, reference=c.reference)
        except Exception as exc:  # noqa: BLE001 - a model that fails to run is a rejected candidate
            c.error = f"{self.backend.name} cannot run it: {first_line(exc)}"
        finally:
            pm.close()
            if c.reference is not None:
                c.reference.close()
                c.reference = None
        return c


def temp_workdir(parent: Path) -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix=".checks.", dir=parent)



def recovery_checker(checker: Checker, cfg: Any) -> Checker:
    """``checker`` with the budget accuracy.recovery_margin_db inside itself, for recovery's searches."""

    return replace(checker, budget=checker.budget.tightened(float(cfg.accuracy.recovery_margin_db)))
