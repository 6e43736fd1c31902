"""Candidates that crashed the process: a run that resumes gets past a runtime that dies on some.

A runtime's compiler can crash the whole process on a model (OpenVINO segfaulted on two Q/DQ pairs
along an Identity chain). No exception reaches the search, and a resumed run would build the same
candidate and die again. So the candidate in flight is named in ``in_flight.json`` before it is built
and timed, and the name is removed after. A run that finds the file left behind knows the previous
one ended on that candidate, by a crash or by a kill. When the search comes to it again, it is built
and run once in a child process first. A child that dies of a crash signal (SIGSEGV, SIGBUS, SIGILL,
SIGFPE, SIGABRT) marks the candidate crashed, and the rest of its family (its region: the search's
next schemes there vary the same points) is probed the same way. A crashed candidate is recorded in
``crashed_candidates.json`` with one warning, and every measurement of it is a failed one, as if the
runtime had refused to build it. A candidate whose probe passed and that is found in flight again
(it crashes only in the full run) is recorded crashed without another probe. Records belong to the
runtime they were made with (its name, version and properties): another one starts afresh. Both
files are state documents (``tasks.autotune.state_file``): a corrupt one is a one-line error.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import multiprocessing
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_json
from pipeline.backends.base import Backend
from tasks.autotune.state_file import CRASH_RECORD, StateDocument, StateHeader, read_state

log = logging.getLogger("tune.autotune")

IN_FLIGHT = "in_flight.json"
CRASHED = "crashed_candidates.json"
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE, signal.SIGABRT})
RECORD_VERSION = 1  # of both files (files from before it have no version and read as this one)


def runtime_id(backend: Backend) -> str:
    """What a crash record holds for: the runtime's name, version and properties."""
    return hashlib.sha256(json.dumps(backend.describe(), sort_keys=True, default=str).encode()).hexdigest()[:16]


class CrashGuard:
    """The crashed candidates of ``backend``'s runs in ``folder`` (by model content hash), the families
    probed before they are measured, and the candidate in flight."""

    def __init__(self, folder: Path, backend: Backend):
        self.folder = folder
        self.backend = backend
        self.runtime = runtime_id(backend)
        self.header = StateHeader.of(RECORD_VERSION, None, None, runtime=self.runtime)
        record = self._read(CRASHED, {"crashed": dict, "fragile": list})
        self.crashed: dict[str, str] = dict(record.get("crashed", {}))
        self.fragile: set[str] = set(record.get("fragile", []))
        self.probed: set[str] = set()  # candidates whose probe passed in this run
        # the candidate the last run ended on (model hash -> what it was), probed before it is measured
        left = self._read(IN_FLIGHT, {"model": str})
        self.suspects: dict[str, str] = {}
        if left.get("model"):
            what = left.get("what") or "a candidate"
            if left.get("probed"):  # it passed its probe and still ended the run
                self._record(left["model"], f"{backend.name} crashed the process on it twice ({what}; its "
                             f"build and run in a child process passed)", left.get("family"), what, "a crash")
            else:
                self.suspects[left["model"]] = what

    def _read(self, name: str, types: dict[str, type]) -> dict[str, Any]:
        """The body of the record ``name`` of this runtime; empty where there is none or it is another
        runtime's. One whose fields are not of ``types`` is corrupt (a one-line StateError)."""
        path = self.folder / name
        document = read_state(path, CRASH_RECORD, self.header)
        if document is None:
            return {}
        body = document.body
        for key, kind in types.items():
            if key in body and not isinstance(body[key], kind):
                raise CRASH_RECORD.corrupt(path, f"'{key}' is not a {kind.__name__}")
        return body

    def _write(self, name: str, body: dict[str, Any]) -> None:
        atomic_write_json(self.folder / name, StateDocument(self.header, body).to_dict())

    def _record(self, model_key: str, why: str, family: str | None, what: str, how: str) -> None:
        first = family is None or family not in self.fragile
        self.crashed[model_key] = why
        if family is not None:
            self.fragile.add(family)
        self._write(CRASHED, {"crashed": self.crashed, "fragile": sorted(self.fragile)})
        (log.warning if first else log.info)(
            "autotune: %s crashes %s (%s): it counts as a failed measurement%s (%s)", what, self.backend.name, how,
            f", and the rest of {family} is built in a child process first" if first and family else "",
            self.folder / CRASHED)

    def why_failed(self, model_key: str, path: Path, what: str, family: str | None) -> str | None:
        """Why ``model_key`` (at ``path``) cannot be measured: it crashed the process; None: measure it.
        The candidate the last run ended on and the later ones of a family with a crasher are probed
        first."""
        suspect = self.suspects.pop(model_key, None)
        if model_key in self.crashed or (suspect is None and (family is None or family not in self.fragile)):
            return self.crashed.get(model_key)
        what = suspect or what
        try:
            code = probe(self.backend, path)
        except Exception as exc:  # noqa: BLE001 - a backend a child cannot rebuild: measured unprobed
            log.debug("autotune: cannot probe %s in a child process: %s", what, exc)
            return None
        if (name := crash_signal(code)) is not None:
            self._record(model_key, f"{self.backend.name} crashed on it ({name}; {what})", family, what, name)
        elif code == 0:  # another end (a kill, an exception) proves nothing either way
            self.probed.add(model_key)
        return self.crashed.get(model_key)

    @contextlib.contextmanager
    def flight(self, model_key: str, what: str, family: str | None) -> Iterator[None]:
        """The measurement of ``model_key``: named in the folder while it runs."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write(IN_FLIGHT, {"model": model_key, "what": what, "family": family, "probed": model_key in self.probed,
                                "started": time.strftime("%Y-%m-%d %H:%M:%S")})
        try:
            yield
        finally:
            (self.folder / IN_FLIGHT).unlink(missing_ok=True)


def _build_and_run(backend: Backend, path: str, scratch: str) -> None:
    from pipeline.data.adapters import fixed_feeds

    os.environ["TMPDIR"] = tempfile.tempdir = scratch  # what a crash leaves behind, the parent removes
    with backend.prepare(path) as prepared:
        prepared.run(fixed_feeds(prepared.specs))


def probe(backend: Backend, path: Path) -> int:
    """Build and run ``path`` once with ``backend`` in a fresh process: its exit code (negative: the
    signal that killed it). Raises where the backend cannot be handed to a child (not picklable)."""
    with tempfile.TemporaryDirectory(prefix="qdq-tune-probe-") as scratch:
        child = multiprocessing.get_context("spawn").Process(target=_build_and_run,
                                                             args=(backend, str(path), scratch))
        child.start()
        child.join()
    return child.exitcode if child.exitcode is not None else 0


def crash_signal(exit_code: int) -> str | None:
    """The crash signal that ended a child with this exit code (SIGSEGV, ...), None for any other end."""
    if exit_code >= 0:
        return None
    try:
        sig = signal.Signals(-exit_code)
    except ValueError:
        return None
    return sig.name if sig in CRASH_SIGNALS else None

