"""Deployments timed side by side in one interleaved run, each deployment once: backend=auto's race after
PTQ (``pipeline.app.race``) and its final comparison (``pipeline.app.auto``) both build their pairs here."""

from __future__ import annotations

from pathlib import Path

from pipeline.artifacts import fingerprint, sha256_file
from pipeline.backends import Backend


class Comparison:
    """The deployments of the final comparison, each once: the reference float is often a runtime's own
    float (ONNX Runtime's), and a runtime that ships float ships its float deployment; timed twice, one
    deployment would read as two speeds (and be held in memory twice)."""

    def __init__(self) -> None:
        self.pairs: list[tuple[Backend, Path]] = []
        self._index: dict[str, int] = {}
        self._digests: dict[Path, str] = {}

    def slot(self, backend: Backend, model: Path) -> int:
        """The index of (``backend``, ``model``) in ``pairs``, added unless the same deployment is there."""
        digest = self._digests.setdefault(model, sha256_file(model))
        key = fingerprint([backend.describe(), backend.settings.to_dict() if backend.settings is not None else None,
                           digest])
        if key not in self._index:
            self._index[key] = len(self.pairs)
            self.pairs.append((backend, model))
        return self._index[key]


__all__ = ["Comparison"]
