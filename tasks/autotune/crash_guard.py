"""Candidates that crashed the process: a run that resumes gets past a runtime that dies on some.

A runtime's compiler can crash the whole process on a model (OpenVINO segfaulted on two Q/DQ pairs
along an Identity chain). No exception reaches the search, and a resumed run would build the same
candidate and die again. So the candidate in flight is named in ``in_flight.json`` before it is built
and timed, and the name is removed after. A run that finds the file left behind knows the previous
one ended on that candidate, by a crash or by a kill. When the search comes to it again, it is built
and run once in a child process first; so is every later candidate of its family (its region: the
search's next schemes there vary the same points). A candidate whose child dies of a signal is
recorded in ``crashed_candidates.json`` with one warning, and every measurement of it is a failed
one, as if the runtime had refused to build it; the others are measured as usual.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pipeline.artifacts import atomic_write_json

log = logging.getLogger("tune.autotune")

IN_FLIGHT = "in_flight.json"
CRASHED = "crashed_candidates.json"


class CrashGuard:
    """The crashed candidates of the runs in ``folder`` (by model content hash), the families probed
    before they are measured, and the candidate in flight."""

    def __init__(self, folder: Path):
        self.folder = folder
        record = self._read(folder / CRASHED)
        self.crashed: dict[str, str] = dict(record.get("crashed") or {})
        self.fragile: set[str] = set(record.get("fragile") or [])
        # the candidate the last run ended on (model hash -> what it was), probed before it is measured
        left = self._read(folder / IN_FLIGHT)
        self.suspects: dict[str, str] = {left["model"]: left.get("what") or "a candidate"} if left.get("model") else {}
        if left.get("family"):
            self.fragile.add(left["family"])

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        """The file's record; an unreadable one (a write the crash cut short) counts as none."""
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def why_failed(self, model_key: str, backend: Any, path: Path, what: str, family: str | None) -> str | None:
        """Why ``model_key`` (at ``path``) cannot be measured: it crashed the process; None: measure it.
        The candidate the last run ended on and the later ones of its family are probed first."""
        suspect = self.suspects.pop(model_key, None)
        if model_key not in self.crashed and (suspect is not None or (family is not None and family in self.fragile)):
            what = suspect or what
            code = probe(backend, path)
            if code < 0:
                self.crashed[model_key] = f"{backend.name} crashed on it ({_signal_name(-code)}; {what})"
                first = family is None or family not in self.fragile or suspect is not None
                if family is not None:
                    self.fragile.add(family)
                atomic_write_json(self.folder / CRASHED, {"crashed": self.crashed, "fragile": sorted(self.fragile)})
                (log.warning if first else log.info)(
                    "autotune: %s crashes %s (%s): it counts as a failed measurement%s (%s)", what, backend.name,
                    _signal_name(-code), f", and the rest of {family} is built in a child process first"
                    if first and family else "", self.folder / CRASHED)
        return self.crashed.get(model_key)

    @contextlib.contextmanager
    def flight(self, model_key: str, what: str, family: str | None) -> Iterator[None]:
        """The measurement of ``model_key``: named in the folder while it runs."""
        self.folder.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.folder / IN_FLIGHT, {"model": model_key, "what": what, "family": family,
                                                    "started": time.strftime("%Y-%m-%d %H:%M:%S")})
        try:
            yield
        finally:
            (self.folder / IN_FLIGHT).unlink(missing_ok=True)


def _build_and_run(backend: Any, path: str) -> None:
    from pipeline.data.adapters import fixed_feeds

    with backend.prepare(path) as prepared:
        prepared.run(fixed_feeds(prepared.specs))


def probe(backend: Any, path: Path) -> int:
    """Build and run ``path`` once with ``backend`` in a fresh process: its exit code (negative: the
    signal that killed it)."""
    child = multiprocessing.get_context("spawn").Process(target=_build_and_run, args=(backend, str(path)))
    child.start()
    child.join()
    return child.exitcode if child.exitcode is not None else 0


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"

