"""The one header of the autotuner's resumable files, and its one check before a run continues.

Region mode resumes from ``autotuner_state.yaml``, subgraph mode from ``autotune_cache.json``, the
runtime search from ``runtime_search.json``; the float baseline's choice (``float_baseline.json``), the
crash guard's records (``in_flight.json``, ``crashed_candidates.json``) and the pattern cache are kept
the same way. Each is a ``StateDocument``: a ``StateHeader`` (the
format version, the model's hash, the measurement context, a fingerprint of calibration, backend,
rules, ..., and the settings the file must have been made with, such as its kind) followed by the
file's own tables. A corrupt file is refused with a one-line ``StateError`` naming the file and the
fix. A file made for another model or under other settings is stale (``StaleStateError``): the stage
re-runs because its inputs changed, so ``resume_or_set_aside`` moves the pipeline's own stale files to
``<folder>/stale/<content hash>/`` (nothing is lost) and the run starts afresh; a state file the user
named explicitly is still refused.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pipeline.artifacts import set_aside
from pipeline.errors import StaleStateError, StateError, first_line

log = logging.getLogger("tune.autotune")


@dataclass(frozen=True)
class StateFileKind:
    """How the messages about one kind of state file read, and how strictly its context is checked."""

    what: str  # the file's name in messages
    corrupt_fix: str  # the fix for a file that cannot be read
    mismatch_fix: str  # the fix for a file of another model, version or setting
    context_changes: str  # what a different context means, in the user's terms
    context_fix: str
    # region state files from before contexts were recorded have none: accepted, as is any file
    # when the run has no context
    lenient_context: bool = False

    def corrupt(self, path: str | Path, detail: str, fix: str | None = None) -> StateError:
        return StateError(f"{self.what} {path} is corrupt ({detail}); {fix or self.corrupt_fix}")


REGION_STATE = StateFileKind(
    what="autotune state file",
    corrupt_fix="delete it to start the search afresh",
    mismatch_fix="delete it or set autotune.state_file to another path",
    context_changes="calibration, QDQ baseline, backend or quantize rules changed",
    context_fix="delete it to tune afresh or set autotune.state_file to another path",
    lenient_context=True,
)
SUBGRAPH_CACHE = StateFileKind(
    what="autotune cache",
    corrupt_fix="delete it to tune afresh",
    mismatch_fix="delete it to tune afresh",
    context_changes="calibration, backend, quantize rules, accuracy budget or subgraph settings changed",
    context_fix="delete it to tune afresh",
)
RUNTIME_STATE = StateFileKind(
    what="runtime search state",
    corrupt_fix="delete it to search the runtime settings afresh",
    mismatch_fix="delete it to search afresh",
    context_changes="the shipped model, backend or accuracy budget changed",
    context_fix="delete it to search afresh",
)
FLOAT_BASELINE = StateFileKind(
    what="float baseline record",
    corrupt_fix="delete it to choose the float baseline again",
    mismatch_fix="delete it to choose the float baseline again",
    context_changes="the model, runtime, accuracy budget or held-out data changed",
    context_fix="delete it to choose the float baseline again",
)
CRASH_RECORD = StateFileKind(
    what="crash record",
    corrupt_fix="delete it (the candidates it names are measured again)",
    mismatch_fix="delete it",
    context_changes="another runtime version or its properties",
    context_fix="delete it",
)
PATTERN_CACHE = StateFileKind(
    what="pattern cache",
    corrupt_fix="delete it or point autotune.pattern_cache at another file",
    mismatch_fix="delete it or point autotune.pattern_cache at another file",
    context_changes="",
    context_fix="delete it or point autotune.pattern_cache at another file",
    lenient_context=True,
)


@dataclass(frozen=True)
class StateHeader:
    """What a resumable file starts with: what it was made for, and so what a run must match to resume."""

    version: int  # the file's format version
    model_sha256: str | None
    context: str | None  # the measurement context's fingerprint
    # (key, value) the file must have been made with, in file order: its kind, the quant type, ...
    settings: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, version: int, model_sha256: str | None, context: str | None, **settings: Any) -> StateHeader:
        return cls(version, model_sha256, context, tuple(settings.items()))

    @property
    def setting_keys(self) -> tuple[str, ...]:
        return tuple(k for k, _ in self.settings)

    @property
    def keys(self) -> tuple[str, ...]:
        """The header's keys in a file, in order."""
        return ("version", "model_sha256", "context", *self.setting_keys)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "model_sha256": self.model_sha256, "context": self.context,
                **dict(self.settings)}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], settings: Iterable[str] = ()) -> StateHeader:
        """The header of a loaded document whose header has the setting keys ``settings`` (a key it
        lacks reads as None)."""
        return cls(doc.get("version"), doc.get("model_sha256"), doc.get("context"),
                   tuple((k, doc.get(k)) for k in settings))

    def check(self, doc: Mapping[str, Any], path: str | Path, kind: StateFileKind) -> None:
        """Raise a one-line StaleStateError unless ``doc`` (a loaded state document) was written with
        this header: this format version (a document without a version is taken as this one), model,
        settings and measurement context (how strictly: ``kind.lenient_context``)."""
        found = StateHeader.from_dict({"version": self.version, **doc}, self.setting_keys)
        reason = None
        if found.version != self.version:
            reason = f"has format version {found.version}, this qdq-tune reads version {self.version}"
        elif found.model_sha256 != self.model_sha256:
            reason = "belongs to a different model"
        else:
            for (key, want), (_, got) in zip(self.settings, found.settings, strict=True):
                if got != want:
                    reason = f"was made with {key}={got}, this run uses {want}"
                    break
        if reason is not None:
            raise StaleStateError(f"{kind.what} {path} {reason}; {kind.mismatch_fix}", reason)
        if kind.lenient_context:
            differs = self.context is not None and found.context not in (None, self.context)
        else:
            differs = found.context != self.context
        if differs:
            reason = f"was measured with other inputs or settings ({kind.context_changes})"
            raise StaleStateError(f"{kind.what} {path} {reason}; {kind.context_fix}", reason)


@dataclass
class StateDocument:
    """One resumable file: its header, then the file's own tables (``body``, in file order)."""

    header: StateHeader
    body: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {**self.header.to_dict(), **self.body}

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any], settings: Iterable[str] = ()) -> StateDocument:
        """Split a loaded document whose header has the setting keys ``settings``."""
        header = StateHeader.from_dict(doc, settings)
        return cls(header, {k: v for k, v in doc.items() if k not in header.keys})

    @classmethod
    def resume(cls, doc: Mapping[str, Any], path: str | Path, kind: StateFileKind, header: StateHeader
               ) -> StateDocument:
        """``doc`` (a loaded document of the right shape) with ``header``, once ``header.check`` passed."""
        header.check(doc, path, kind)
        return cls(header, cls.from_dict(doc, header.setting_keys).body)


def read_state(path: Path, kind: StateFileKind, header: StateHeader, *, own: bool = True,
               yaml_text: bool = False) -> StateDocument | None:
    """The document at ``path`` made with ``header``; None where there is none, or where the pipeline
    owns the file (``own``) and it was made for another model, runtime or setting: the caller starts
    afresh and overwrites it (one log line says why). A file that cannot be parsed or holds no table
    raises ``kind.corrupt`` (writes are atomic: no run leaves one half-written); a stale file the user
    named raises StaleStateError."""
    if not path.exists():
        return None
    try:
        text = path.read_text(encoding="utf-8")
        doc = yaml.safe_load(text) if yaml_text else json.loads(text)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise kind.corrupt(path, f"{type(exc).__name__}: {first_line(exc)}") from None
    if not isinstance(doc, dict):
        raise kind.corrupt(path, "not a table")
    try:
        return StateDocument.resume(doc, path, kind, header)
    except StaleStateError as exc:
        if not own:
            raise
        log.info("autotune: %s %s %s; starting afresh", kind.what, path.name, exc.reason)
        return None


def resume_or_set_aside(load: Callable[[], Any], path: Path, kind: StateFileKind, *, own: bool,
                        companions: Iterable[Path] = ()) -> bool:
    """Resume from the state at ``path`` with ``load()`` (True), or, if there is none (False) or it
    is stale and the pipeline owns it (``own``: the stage's default location, not a path the user
    gave), set it aside with one log line and return False so the caller starts afresh. Corrupt
    files, and stale ones the user named, still raise."""
    if not path.exists():
        return False
    try:
        load()
        return True
    except StaleStateError as exc:
        if not own:
            raise
        dest = set_aside(path, companions)
        log.info("autotune: %s %s %s; moved to %s/stale/%s/, starting afresh", kind.what, path.name, exc.reason,
                 path.parent.name, dest.name)
        return False
