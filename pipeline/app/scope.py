"""One run's run-wide settings, set for the run and restored after it.

A few settings reach code deep below the stages, which takes no config: whether progress bars show
(`progress`), how many threads the pipeline's own ONNX Runtime sessions use
(`backend.intra_op_threads`), the least length of a timed block (`backend.min_block_ms`), the CPU
kinds the deployment must be right on (`target.cpus`), the folder of hard links a loaded model's weights are read from, the
warnings about the data already given, and the objects a ``pipeline.api.tune()`` call was given in
memory. Each is a ContextVar owned by its module; ``run_scope`` composes their context managers: it
sets them for one run and puts back what was there before, also when the run raises, so two runs in
one process (two tune() calls, a notebook's cells, two threads) never see each other's. A worker
thread sees its run's settings where it is handed the run's context (``contextvars.copy_context``).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from pipeline import progress as bars
from pipeline.backends import timing
from pipeline.backends.onnxruntime import session as ort
from pipeline.data import adapters
from pipeline.data import live as live_objects
from pipeline.graph import weights
from pipeline.quant import cpu

# set while a re-choice runs (`tune-rechoose`, backend.tuned_only): a tuning stage that is not up to date
# is an error, not a run (``pipeline.app.runner``)
_TUNING_FROZEN = contextvars.ContextVar("tuning_frozen", default=False)


@contextlib.contextmanager
def tuning_frozen(frozen: bool = True) -> Iterator[None]:
    """No tuning stage runs inside the block (it must be up to date): a re-choice tunes nothing."""
    token = _TUNING_FROZEN.set(bool(frozen))
    try:
        yield
    finally:
        _TUNING_FROZEN.reset(token)


def is_tuning_frozen() -> bool:
    return _TUNING_FROZEN.get()


@contextlib.contextmanager
def run_scope(*, threads: int | None = None, progress: bool | None = None,
              live: Mapping[str, Any] | None = None, min_block_ms: float | None = None,
              target: Iterable[str] | None = None) -> Iterator[None]:
    """The run-wide settings for the block, each back to its previous value after it.

    Args:
        threads: intra-op threads of the pipeline's own ORT sessions (0: ORT's choice).
        progress: whether bars deep inside library code show (on interactive terminals).
        live: objects a tune() call was given, by the key their config args name.
        min_block_ms: the least length of a timed block (``backend.min_block_ms``).
        target: the CPU kinds the deployment must be right on besides this host's (``target.cpus``).

    None keeps the enclosing value: ``pipeline.api.tune`` holds its objects before the config is
    composed, and the runner's scope inside it sets the config's threads and bars. Every scope gets a
    weights folder of its own, removed when it ends.
    """
    with contextlib.ExitStack() as stack:
        if threads is not None:
            stack.enter_context(ort.threads_configured(threads))
        if progress is not None:
            stack.enter_context(bars.configured(progress))
        if live:
            stack.enter_context(live_objects.held(live))
        if min_block_ms is not None:
            stack.enter_context(timing.min_block_configured(min_block_ms))
        if target is not None:
            stack.enter_context(cpu.target_configured(target))
        stack.enter_context(weights.own_folder())
        stack.enter_context(adapters.warnings_once())
        yield
