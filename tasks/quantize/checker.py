"""The quantize stage's checks of a candidate model on the held-out batches: ``Checker`` runs each
candidate on the runtime's own fused kernels for ONNX Runtime and OpenVINO placements (what will be
deployed), as plain Q/DQ math on ONNX Runtime for TensorRT placements (TensorRT's integer kernels are
exact; its numbers cannot be measured on this machine), and judges it against the accuracy budget."""

from __future__ import annotations

import contextvars
import logging
import tempfile
from collections.abc import Callable, Iterable, Iterator
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
    # the model ``runs`` found running (or ``check_each`` kept), its file and its prepared forms (fused,
    # reference; the reference None where not prepared yet): the next check of that very model takes them
    # instead of writing and preparing it again
    _ran: tuple[onnx.ModelProto, Path, Any, Any] | None = field(default=None, init=False, repr=False)

    def write(self, model: onnx.ModelProto, name: str) -> Path:
        return save_model(model, self.workdir / f"{name}.onnx", share_weights=True)

    def runs(self, model: onnx.ModelProto) -> str | None:
        """None if the model loads and runs on a holdout batch with the fused kernels and as plain Q/DQ
        math (the fidelity reference), else the runtime's first error line. A model ``check_each`` kept
        has run with the fused kernels already: only its reference is prepared and run."""
        ran = self._ran
        held = ran if ran is not None and ran[0] is model else None
        if held is None:
            self._drop_ran()
        elif held[3] is not None:
            return None  # it ran both ways already
        path = held[1] if held is not None else self.write(model, "runs")
        prepared: list[Any] = [held[2]] if held is not None else []
        try:
            for prepare in (self.backend.prepare, self.backend.prepare_reference)[len(prepared):]:
                prepared.append(prepare(path))
                prepared[-1].run(self.holdout.feeds[0])
        except Exception as exc:  # noqa: BLE001 - the runtime's own error types
            self._ran = None
            for pm in prepared:
                pm.close()
            return first_line(exc)
        self._ran = (model, path, *prepared)
        return None

    def _drop_ran(self) -> None:
        if self._ran is not None:
            for pm in self._ran[2:]:
                if pm is not None:
                    pm.close()
            self._ran = None

    def check(self, model: onnx.ModelProto, name: str, fidelity: bool = False) -> Candidate:
        """Load and run ``model`` on the holdout; never raises for a model the runtime rejects."""
        return self._judge(*self._load(model, name), fidelity)

    def check_each(self, models: Iterable[tuple[onnx.ModelProto, str]],
                   keep: Callable[[Candidate], bool] | None = None) -> Iterator[Candidate]:
        """``check`` of each (model, name) in turn, each model written and built by the runtime in a
        worker thread while the one before runs on the holdout: a runtime's build (OpenVINO's compile,
        ONNX Runtime's session) releases the GIL and is most of a check's time on small models. Names
        must differ from one model to the next (their files are written side by side). A scored
        candidate ``keep`` says yes to stays built with the fused kernels, in place of the one kept
        before: ``runs`` and ``check`` of that very model take it (the range choice keeps its best)."""
        it = iter(models)
        with ThreadPoolExecutor(1, thread_name_prefix="qdq-tune-check") as pool:
            item = next(it, None)
            # the worker runs in this run's context (its threads, progress, weights folder: ContextVars)
            pending = pool.submit(contextvars.copy_context().run, self._load, *item) if item is not None else None
            try:
                while pending is not None:
                    model = item[0]
                    item = next(it, None)  # built here (Python) while the worker builds the runtime's model
                    c, pm = pending.result()
                    pending = pool.submit(contextvars.copy_context().run, self._load, *item) \
                        if item is not None else None
                    kept = self._judge(c, pm, close=False)
                    if pm is not None and kept.scored and self.fused and keep is not None and keep(kept):
                        self._drop_ran()
                        self._ran = (model, kept.path, pm, None)
                    elif pm is not None:
                        pm.close()
                    yield kept
            finally:  # a caller that stops early: the model loaded ahead is closed
                if pending is not None and (ahead := pending.result()[1]) is not None:
                    ahead.close()

    def _load(self, model: onnx.ModelProto, name: str) -> tuple[Candidate, Any]:
        """(the candidate, its prepared model or None where the runtime cannot load it)."""
        ran = self._ran  # read once: check_each keeps a candidate from the caller's thread meanwhile
        if ran is not None and ran[0] is model and self.fused:
            self._ran = None
            return Candidate(name, ran[1], reference=ran[3]), ran[2]
        if ran is not None and ran[3] is not None:  # what ``runs`` held is for that model only
            self._drop_ran()
        c = Candidate(name, self.write(model, name))
        try:
            return c, self.backend.prepare(c.path) if self.fused else self.backend.prepare_reference(c.path)
        except Exception as exc:  # noqa: BLE001 - a model the runtime cannot load is a rejected candidate
            c.error = f"{self.backend.name} cannot load it: {first_line(exc)}"
            return c, None

    def _judge(self, c: Candidate, pm: Any, fidelity: bool = False, close: bool = True) -> Candidate:
        """``c`` run and judged on the holdout with ``pm`` (closed after unless ``close`` is False)."""
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
            if close:
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
