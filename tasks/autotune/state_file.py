"""The one check of the autotuner's resumable files before a run continues from them.

Region mode resumes from ``autotuner_state.yaml``, subgraph mode from ``autotune_cache.json``. Both
record the format version, the model's hash and the measurement context (a fingerprint of
calibration, backend, rules, ...). A corrupt file is refused with a one-line ``StateError`` naming
the file and the fix. A file made for another model or under other settings is stale
(``StaleStateError``): the stage re-runs because its inputs changed, so ``resume_or_set_aside``
moves the pipeline's own stale files to ``<folder>/stale/<content hash>/`` (nothing is lost) and the
run starts afresh; a state file the user named explicitly is still refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.artifacts import set_aside
from pipeline.errors import StaleStateError, StateError

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


def check_state(doc: Mapping[str, Any], path: str | Path, kind: StateFileKind, *, version: int, model_sha: str,
                context: str | None, settings: Mapping[str, Any] | None = None) -> None:
    """Raise a one-line StateError unless ``doc`` (a loaded state document) was written in format
    ``version`` (a document without a version is taken as the current one) for the model hashed
    ``model_sha``, with ``settings`` (key -> value this run uses) and measurement ``context``."""
    reason = None
    if doc.get("version", version) != version:
        reason = f"has format version {doc.get('version')}, this qdq-tune reads version {version}"
    elif doc.get("model_sha256") != model_sha:
        reason = "belongs to a different model"
    else:
        for key, want in (settings or {}).items():
            if doc.get(key) != want:
                reason = f"was made with {key}={doc.get(key)}, this run uses {want}"
                break
    if reason is not None:
        raise StaleStateError(f"{kind.what} {path} {reason}; {kind.mismatch_fix}", reason)
    found = doc.get("context")
    if kind.lenient_context:
        differs = context is not None and found not in (None, context)
    else:
        differs = found != context
    if differs:
        reason = f"was measured with other inputs or settings ({kind.context_changes})"
        raise StaleStateError(f"{kind.what} {path} {reason}; {kind.context_fix}", reason)


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
