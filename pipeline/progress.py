"""Progress bars for long work: shown on an interactive terminal when `progress=true`, silent otherwise."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from tqdm import tqdm

_enabled = True  # the run's `progress` key (configure), for bars deep inside library code


def configure(enabled: bool) -> None:
    global _enabled
    _enabled = enabled


def is_enabled() -> bool:
    """Whether bars that are not told otherwise show (the run's `progress` key; True outside a run)."""
    return _enabled


@contextlib.contextmanager
def configured(enabled: bool) -> Iterator[None]:
    """``configure(enabled)`` for the block; the previous value is back after it, also when it raises."""
    previous = _enabled
    configure(enabled)
    try:
        yield
    finally:
        configure(previous)


def progress_bar(enabled: bool | None = None, **kwargs: Any) -> tqdm:
    """A tqdm bar (its ETA included); ``enabled=None``: as the run's `progress` key says."""
    # disable=None lets tqdm hide the bar when stderr is not a terminal (CI logs, pipes)
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    on = _enabled if enabled is None else enabled
    return tqdm(disable=None if on else True, **kwargs)


def work_bar(total: float, desc: str, unit: str = "it", **kwargs: Any) -> tqdm:
    """A bar for work inside a step that is only sometimes long (weights of a large model, its saves):
    shown once it has run for 2 s, so small models stay quiet."""
    return progress_bar(total=total, desc=desc, unit=unit, delay=2.0, **kwargs)
