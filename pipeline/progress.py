"""Progress bars for long work: shown on an interactive terminal when `progress=true`, silent otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

from tqdm import tqdm

# the run's `progress` key, for bars deep inside library code (True outside a run); per run: a ContextVar
_ENABLED: ContextVar[bool] = ContextVar("progress_bars", default=True)


def is_enabled() -> bool:
    """Whether bars that are not told otherwise show (the run's `progress` key; True outside a run)."""
    return _ENABLED.get()


@contextlib.contextmanager
def configured(enabled: bool) -> Iterator[None]:
    """Bars on or off for the block (its thread and the threads it hands its context to); the previous
    value is back after it, also when it raises."""
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def progress_bar(enabled: bool | None = None, **kwargs: Any) -> tqdm:
    """A tqdm bar (its ETA included); ``enabled=None``: as the run's `progress` key says."""
    # disable=None lets tqdm hide the bar when stderr is not a terminal (CI logs, pipes)
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    on = _ENABLED.get() if enabled is None else enabled
    return tqdm(disable=None if on else True, **kwargs)


def work_bar(total: float, desc: str, unit: str = "it", **kwargs: Any) -> tqdm:
    """A bar for work inside a step that is only sometimes long (weights of a large model, its saves):
    shown once it has run for 2 s, so small models stay quiet."""
    return progress_bar(total=total, desc=desc, unit=unit, delay=2.0, **kwargs)
