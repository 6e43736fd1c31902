"""One exception hierarchy for user-facing failures.

A ``PipelineError`` is a user's mistake or an unmet environment requirement: the CLI prints its
message on one line and exits with its ``exit_code``. Anything else escaping a stage is a bug in
qdq-tune and is shown with its full traceback.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any


class PipelineError(Exception):
    """Base class: the message names the key or file, the value, and the fix."""

    exit_code = 1


class ConfigError(PipelineError):
    """Invalid spec: unknown key, wrong type, or inconsistent values. Lists every problem found."""

    exit_code = 2

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("; ".join(self.problems))


class InputError(PipelineError):
    """A missing, unreadable or unsuitable input file or data source (bad usage: exit 2)."""

    exit_code = 2


class StageError(PipelineError):
    """A stage could not produce its outputs for a reason the user can act on."""


class BackendUnavailable(PipelineError):
    """An optional runtime (TensorRT, trtexec, ...) is not installed or cannot run here."""

    exit_code = 2


class ResultsDirLocked(PipelineError):
    """Another live run owns the results_dir."""


class StateError(PipelineError):
    """A state or cache file is corrupt or belongs to a different model (the user deletes or
    points elsewhere: exit 2, like other bad input)."""

    exit_code = 2


class StaleStateError(StateError):
    """A readable state or cache file made for another model, format version or setting: the
    pipeline sets its own such files aside and starts afresh; one the user named is refused."""

    def __init__(self, message: str, reason: str = ""):
        super().__init__(message)
        self.reason = reason  # what differs, without the file name or the fix


def first_line(exc: BaseException) -> str:
    """The first non-empty line of an exception's message (runtimes and parsers write several)."""
    import yaml

    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem:
        where = f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}" if exc.problem_mark else ""
        return f"{exc.problem}{where}"
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(exc).__name__


# what reading a JSON document into a record raises where the document's layout is not one a writer made
# (a missing key, a list where an object belongs, a string or an Infinity where a count belongs)
LAYOUT_ERRORS = (KeyError, TypeError, ValueError, AttributeError, OverflowError)


# how a record's reader names a JSON type in its error
_JSON_NAMES = {str: "a string", dict: "an object", Mapping: "an object", list: "a list", int: "a whole number", bool: "true or false",
               (int, float): "a number"}


def json_typed(value: Any, key: str, kind: type | tuple[type, ...]) -> Any:
    """``value``, a record's JSON field ``key`` (None: not recorded), where it has the JSON type ``kind`` (a
    bool is a number only where ``kind`` is bool); else a TypeError naming the key (``record_layout`` makes it
    the one-line error)."""
    if value is not None and (isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind)):
        raise TypeError(f"{key} is {value!r}, not {_JSON_NAMES.get(kind, getattr(kind, '__name__', str(kind)))}")
    return value


def json_types(d: Mapping[str, Any], kinds: Mapping[str, type | tuple[type, ...]]) -> None:
    """``json_typed`` of every key of ``kinds`` in the record ``d``."""
    for key, kind in kinds.items():
        json_typed(d.get(key), key, kind)


@contextlib.contextmanager
def record_layout(where: str, stage: str) -> Iterator[None]:
    """Reading ``stage``'s record from the JSON named ``where`` inside the block: a layout no writer made is
    a one-line StateError naming it and the fix (run the stage again), not a traceback."""
    try:
        yield
    except LAYOUT_ERRORS as exc:
        raise StateError(f"{where} has an unknown layout ({type(exc).__name__}: {first_line(exc)}); re-run "
                         f"stages=[{stage}] force=true") from None
