"""The accuracy verdict per CPU kind, and what a deployment was checked on.

A quantized model computes differently on different CPUs: u8 x s8 kernels saturate without VNNI, and
OpenVINO runs float layers in bf16 only where the CPU has it. So the shipped model's verdict is given
for every x86 kind (``kind_verdicts``), on the same held-out samples and with the same confidence
bound: on this host's kind by running it here; on a kind whose int8 kernels are exact (VNNI, AMX) by
its Q/DQ math, which exact kernels compute (this host's run where its kernels are exact too, else the
Q/DQ graph run as written); on a kind whose kernels saturate by its saturating twin
(``pipeline.quant.saturation``), which computes what they compute.

``CheckedOn`` is what the manifest keeps of it (the ``checked_on`` of quantize's and autotune's metrics
records; ``pipeline.records.stages.shipped_record`` reads the shipped model's): the host's CPU and kind, the
runtime and its package versions, the float precision, the shipped settings, the target and each kind's
verdict. ``host_warning`` compares a host with it where the model is loaded.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.accuracy.budget import AccuracyBudget, AccuracyVerdict
from pipeline.accuracy.holdout import Holdout
from pipeline.backend_config import runtime_packages
from pipeline.backends.base import Backend
from pipeline.errors import first_line
from pipeline.graph.model import load_model, model_hash, save_model
from pipeline.quant.cpu import KINDS, CpuFacts, cpu_facts, target_kinds
from pipeline.quant.placement import PLACEMENTS
from pipeline.quant.saturation import saturating_twin
from pipeline.runtime_choice import CHOICE

log = logging.getLogger("tune.accuracy")

MEASURED = "run on this host"
QDQ_MATH = "Q/DQ math (its int8 kernels are exact)"
QDQ_MATH_HERE = "Q/DQ math as this host's exact int8 kernels ran it (its int8 kernels are exact too)"
SATURATION = "saturating twin (its u8 x s8 kernels' int16 pair sums)"
NO_INT8 = "float model (no int8 kernels)"
DEFERRED = "not judged yet"

# while set: why kind_verdicts leaves unjudged the kinds (neither this host's nor targets) whose verdict
# takes a run of its own
_DEFERRED: ContextVar[str | None] = ContextVar("kinds_deferred", default=None)


@contextmanager
def kinds_deferred(why: str) -> Iterator[None]:
    """Within it, ``kind_verdicts`` judges this host's kind, the target kinds and the kinds this host's run
    already judges (exact kernels where the host's are exact too), and leaves each other kind not judged
    (``DEFERRED``, ``why`` as its note): backend=auto quantizes a runtime its race may still drop, and a
    runtime that is tuned judges what it ships on every kind."""
    token = _DEFERRED.set(why)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


@dataclass(frozen=True)
class KindVerdict:
    """The shipped model's accuracy verdict on one CPU kind, and how it was reached."""

    kind: str
    how: str
    verdict: AccuracyVerdict | None  # None: not judged (accuracy budget off)
    note: str = ""

    @property
    def ok(self) -> bool | None:
        return None if self.verdict is None else self.verdict.ok

    def line(self) -> str:
        state = "not judged" if self.verdict is None else ("meets the budget" if self.verdict.ok else "MISSES the budget")
        what = f": {self.verdict.what}" if self.verdict is not None else ""
        return f"{self.kind}: {state} ({self.how}{'; ' + self.note if self.note else ''}){what}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "how": self.how, "note": self.note,
                "verdict": self.verdict.to_dict() if self.verdict is not None else None}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KindVerdict:
        v = d.get("verdict")
        return cls(str(d["kind"]), str(d.get("how", "")), AccuracyVerdict.from_dict(v) if v else None,
                   str(d.get("note", "")))


def kind_verdicts(backend: Backend, model: Path, holdout: Holdout, budget: AccuracyBudget,
                  host_verdict: AccuracyVerdict | None, quantized: bool = True) -> list[KindVerdict]:
    """The verdict of ``model`` (judged ``host_verdict`` on this host with ``backend``) on every x86 kind,
    the run's target kinds first; none where ``backend``'s placement does not run on CPU kernels
    (TensorRT). Kinds that compute alike share one evaluation; the saturating twin pairs as the
    backend's kernels do (its placement's ``pair_order``). A float model (``quantized=False``) has no
    int8 kernels, and its float layers run in the precision its settings pin or in f32 (more exact)
    where a kind lacks it, so every kind gets the host's verdict."""
    placement = PLACEMENTS[backend.placement]
    if not placement.cpu_kernels:
        return []
    host = cpu_facts().kind
    order = [*target_kinds(), *(k for k in KINDS if k not in target_kinds())]
    judged: dict[str, tuple[str, AccuracyVerdict | None, str]] = {}
    # where this host's int8 kernels are exact too, they computed the Q/DQ math on the same samples
    if host_verdict is not None and host in KINDS and not KINDS[host].saturates:
        judged["exact"] = (QDQ_MATH_HERE, host_verdict, "")

    def exact() -> tuple[str, AccuracyVerdict | None, str]:
        if "exact" not in judged:
            judged["exact"] = (QDQ_MATH, _judge_reference(backend, model, holdout, budget), "")
        return judged["exact"]

    def saturating() -> tuple[str, AccuracyVerdict | None, str]:
        if "saturating" not in judged:
            judged["saturating"] = _judge_twin(backend, model, holdout, budget, placement.pair_order, exact)
        return judged["saturating"]

    out = []
    deferred = _DEFERRED.get()
    for kind in order:
        if not quantized:
            out.append(KindVerdict(kind, NO_INT8, host_verdict))
        elif kind == host:
            out.append(KindVerdict(kind, MEASURED, host_verdict))
        elif deferred is not None and kind not in target_kinds() and (KINDS[kind].saturates or "exact" not in judged):
            out.append(KindVerdict(kind, DEFERRED, None, deferred))  # a verdict that takes a run of its own
        elif budget.enabled:
            how, verdict, note = saturating() if KINDS[kind].saturates else exact()
            out.append(KindVerdict(kind, how, verdict, note))
        else:
            out.append(KindVerdict(kind, "accuracy budget off", None))
    return out


def _judge_twin(backend: Backend, model: Path, holdout: Holdout, budget: AccuracyBudget, pairing: str,
                exact: Callable[[], tuple[str, AccuracyVerdict | None, str]]
                ) -> tuple[str, AccuracyVerdict | None, str]:
    """(how, verdict, note) on a kind whose u8 x s8 kernels saturate: the model's Q/DQ math where no layer
    can saturate; its saturating twin judged as Q/DQ math where every layer that can is modelled; no
    verdict where one is not (the twin would compute less than the kernels) or the twin fails to run."""
    try:
        twin, report = saturating_twin(load_model(model, check=False), pairing)
        if report.skipped:
            name, why = report.skipped[0]
            return (SATURATION, None, f"not judged: {len(report.skipped)} layer(s) that can saturate are not "
                                      f"modelled ({name}: {why})")
        if not report.can_saturate:
            how, verdict, _ = exact()
            return how, verdict, "no layer's pair sums can leave int16"
        key = (model_hash(twin), budget, _holdout_digest(holdout))
        if key in _TWIN_VERDICTS:
            _TWIN_VERDICTS.move_to_end(key)
            verdict = _TWIN_VERDICTS[key]
        else:
            with tempfile.TemporaryDirectory(dir=model.parent, prefix=".twin-") as tmp:  # its weights too
                verdict = _judge_reference(backend, save_model(twin, Path(tmp) / model.name), holdout, budget)
            _TWIN_VERDICTS[key] = verdict
            while len(_TWIN_VERDICTS) > TWINS_KEPT:
                _TWIN_VERDICTS.popitem(last=False)
        return SATURATION, verdict, f"{len(report.corrected)} layer(s) can saturate"
    except Exception as exc:  # noqa: BLE001 - a twin that fails is a kind not judged, never a failed stage
        log.warning("accuracy: the saturating twin of %s could not be judged: %s", model.name, first_line(exc))
        return SATURATION, None, f"not judged: the twin failed ({first_line(exc)})"


# the saturating twins' verdicts of this process, by everything that decides one (the twin, the budget, the
# held-out samples): a stage judging a model an earlier stage judged (autotune shipping the PTQ model) takes
# the verdict instead of running the twin again; the TWINS_KEPT latest are kept
_TWIN_VERDICTS: OrderedDict[tuple[str, AccuracyBudget, str], AccuracyVerdict | None] = OrderedDict()
TWINS_KEPT = 4


def _holdout_digest(holdout: Holdout) -> str:
    """sha256 of what a verdict on ``holdout`` depends on: its feeds, labels, the float model's outputs and
    the outputs judged."""
    h = hashlib.sha256()
    for outputs in holdout.reference:
        for out in outputs:
            h.update(np.ascontiguousarray(out).tobytes())
    for feeds, labels in zip(holdout.feeds, holdout.labels, strict=True):
        for name, value in sorted(feeds.items()):
            a = np.ascontiguousarray(value)
            h.update(f"{name}:{a.dtype}:{a.shape}".encode())
            h.update(a.tobytes())
        if labels is not None:
            h.update(np.ascontiguousarray(labels).tobytes())
    h.update(repr((holdout.valid, holdout.class_outputs, holdout.output_names)).encode())
    return h.hexdigest()


def _judge_reference(backend: Backend, model: Path, holdout: Holdout, budget: AccuracyBudget) -> AccuracyVerdict | None:
    """``model`` run as plain Q/DQ math (the backend's reference runner) and judged on the holdout."""
    ref = backend.prepare_reference(model)
    if ref is None:
        return None
    try:
        return holdout.score(ref, budget)
    finally:
        ref.close()


# the packages whose versions decide what a deployment computes, where installed
def runtime_version(versions: Mapping[str, str], runtime: str) -> str | None:
    """The version of ``runtime``'s package among ``versions`` (a runtime name as `backend=` spells it:
    its package, or a build of it such as onnxruntime-gpu)."""
    if runtime in versions:
        return versions[runtime]
    return next((v for k, v in versions.items() if k.replace("-", "_").startswith(runtime)), None)


def runtime_versions() -> dict[str, str]:
    """The installed version of every built-in runtime's package (``runtime_packages``; those not installed
    are left out)."""
    out = {}
    for name in runtime_packages():
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def host_key(facts: CpuFacts | None = None, versions: Mapping[str, str] | None = None) -> str:
    """This host as the choices it makes are keyed: its CPU kind and the runtime packages' versions, e.g.
    'amx onnxruntime=1.32.0 openvino=2026.4.1'."""
    versions = runtime_versions() if versions is None else versions
    return " ".join([(facts or cpu_facts()).kind or "unknown-cpu", *(f"{k}={v}" for k, v in versions.items())])


@dataclass(frozen=True)
class CheckedOn:
    """What a shipped deployment was checked on: the host's CPU and kind, the runtime and the versions of
    the runtime packages, the precision of its float layers, the settings it ships with, the target kinds
    it was made for, and its verdict on each x86 kind."""

    cpu: str
    kind: str | None
    runtime: str
    versions: dict[str, str]
    precision: str
    settings: dict[str, Any] | None
    target: tuple[str, ...]
    kinds: list[KindVerdict] = field(default_factory=list)
    # host_key -> {"ok", "what"}: the shipped model judged on other hosts by `tune-rechoose`
    hosts: dict[str, dict[str, Any]] = field(default_factory=dict)

    def verdict(self, kind: str | None) -> KindVerdict | None:
        return next((k for k in self.kinds if k.kind == kind), None)

    def failing(self) -> list[KindVerdict]:
        """The kinds whose verdict misses the budget."""
        return [k for k in self.kinds if k.ok is False]

    def host_warning(self, facts: CpuFacts | None = None, versions: Mapping[str, str] | None = None,
                     results_dir: str | Path = "RESULTS_DIR") -> str | None:
        """One line naming the risk where this host is not what the deployment was checked on (None where it
        is, or where `tune-rechoose` judged it on this very host and it met the budget): a CPU kind whose
        verdict misses the budget or was not reached, or another version of the runtime's package; with
        the command that checks this host."""
        if not self.kinds:  # not a deployment on CPU kernels (TensorRT): no CPU kind to compare
            return None
        facts = facts or cpu_facts()
        versions = runtime_versions() if versions is None else versions
        here = self.hosts.get(host_key(facts, versions))
        if here is not None:
            return None if here.get("ok") else (
                f"the deployment MISSES its accuracy budget on this host, judged here ({here.get('what')}); "
                f"{self._fix(results_dir, None)}")
        kind = facts.kind
        ours, theirs = runtime_version(versions, self.runtime), runtime_version(self.versions, self.runtime)
        if kind != self.kind:
            v = self.verdict(kind) if kind is not None else None
            if v is None or (v.ok is None and v.how != NO_INT8):
                return (f"the deployment was checked on {self.kind or 'another CPU'}, not on this "
                        f"{kind or 'kind of'} CPU ({facts.describe()}): its accuracy here is unknown; "
                        f"{self._fix(results_dir, None)}")
            if v.ok is False:
                made = "one of the kinds it was made for" if kind in self.target else \
                    f"it was made for {', '.join(self.target) or self.kind}"
                return (f"the deployment MISSES its accuracy budget on this {kind} CPU ({v.how}: "
                        f"{v.verdict.what if v.verdict else ''}); {made}: {self._fix(results_dir, kind)}")
        if ours != theirs and ours is not None and theirs is not None:
            return (f"the deployment was checked with {self.runtime} {theirs}, this host has {ours}: "
                    f"{self._fix(results_dir, None)}")
        return None

    @staticmethod
    def _fix(results_dir: str | Path, kind: str | None) -> str:
        """The commands that make a deployment right here: choose again among what the run tuned where it
        tuned several runtimes (backend=auto), tune for this kind."""
        top = rechoose_dir(results_dir)
        tune = f"tune again with target.cpus=[{kind}] (or target=x86)" if kind else "tune again on this host"
        if (Path(top) / CHOICE).is_file():
            return f"{tune}, or check and choose again on this host: tune-rechoose {top}"
        return tune

    def to_dict(self) -> dict[str, Any]:
        return {"cpu": self.cpu, "kind": self.kind, "runtime": self.runtime, "versions": dict(self.versions),
                "precision": self.precision, "settings": self.settings, "target": list(self.target),
                "kinds": [k.to_dict() for k in self.kinds], "hosts": dict(self.hosts)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CheckedOn:
        return cls(str(d.get("cpu", "")), d.get("kind"), str(d.get("runtime", "")), dict(d.get("versions") or {}),
                   str(d.get("precision", "")), d.get("settings"), tuple(d.get("target") or ()),
                   [KindVerdict.from_dict(k) for k in d.get("kinds") or ()], dict(d.get("hosts") or {}))


def rechoose_dir(results_dir: str | Path) -> str | Path:
    """The results_dir `tune-rechoose` takes for ``results_dir``: the run's own (the nearest folder up with
    .hydra/overrides.yaml: a runtime's results_dir under backend=auto is part of its top level's run)."""
    path = Path(results_dir)
    return next((p for p in (path, *path.parents) if (p / ".hydra" / "overrides.yaml").is_file()), results_dir)


def float_kinds(verdict: AccuracyVerdict | None) -> list[KindVerdict]:
    """Every kind's verdict of a shipped float model: the host's (no int8 kernels to differ)."""
    return [KindVerdict(k, NO_INT8, verdict) for k in (*target_kinds(), *(k for k in KINDS if k not in target_kinds()))]


def log_kinds(kinds: list[KindVerdict], stage: str) -> None:
    """A warning for the target kinds whose verdict misses the budget, one line for the other kinds that
    miss it (grouped by how they compute), and one summary line."""
    targets = set(target_kinds())
    missed = [k for k in kinds if k.ok is False and k.kind not in targets]
    for k in kinds:
        if k.ok is False and k.kind in targets:
            log.warning("%s: the shipped model misses the accuracy budget on target kind %s", stage, k.line())
    if missed:
        names = ", ".join(k.kind for k in missed)
        log.warning("%s: not for %s CPUs: %s; tune with target.cpus=[%s] (or target=x86) for a deployment "
                    "right there too", stage, names, missed[0].line(), names)
    def state(k: KindVerdict) -> str:
        if k.ok is None:
            return DEFERRED if k.how == DEFERRED else "not judged"
        return "ok" if k.ok else "MISSES"

    later = next((k.note for k in kinds if k.how == DEFERRED), "")
    log.info("%s: accuracy per CPU kind: %s%s", stage, "; ".join(f"{k.kind} {state(k)}" for k in kinds),
             f" ({later})" if later else "")


def checked_on(backend: Backend, kinds: list[KindVerdict]) -> CheckedOn:
    """The record of a deployment on ``backend`` (with the settings it ships) checked here with ``kinds``."""
    facts = cpu_facts()
    settings = backend.settings.pinned(backend).to_dict() if backend.settings is not None else None
    return CheckedOn(facts.describe(), facts.kind, backend.name, runtime_versions(), backend.float_precision(),
                     settings, target_kinds(), kinds)


__all__ = ["CheckedOn", "DEFERRED", "KindVerdict", "checked_on", "float_kinds", "host_key", "kind_verdicts", "kinds_deferred",
           "log_kinds", "runtime_versions"]
