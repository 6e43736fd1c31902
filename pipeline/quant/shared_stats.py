"""Calibration statistics shared by the runs of one scope (``backend=auto``'s runtimes).

Statistics depend on the float graph, the calibration data and the calibration method, not on the
runtime: where several runtimes are quantized in one ``tune`` call, the first one's quantize collects
them and the others reuse them. ``sharing()`` opens such a scope; ``collect_once`` collects, or returns
what a run of the same scope collected for the same key. The statistics live in memory for the scope
only: a user's data objects can change between calls without any config key changing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from pipeline.artifacts import fingerprint
from pipeline.quant.calibration import TensorStats

log = logging.getLogger("tune.quantize")

_SHARED: ContextVar[dict[str, dict[str, TensorStats]] | None] = ContextVar("shared_calibration_statistics", default=None)


@contextmanager
def sharing() -> Iterator[None]:
    """A scope whose quantize runs share the statistics they collect (restored when it ends)."""
    token = _SHARED.set({})
    try:
        yield
    finally:
        _SHARED.reset(token)


def collect_once(key_items: dict[str, Any], collect: Callable[[], dict[str, TensorStats]]) -> dict[str, TensorStats]:
    """``collect()``'s statistics, collected once per scope for ``key_items`` (what determines them: the
    float graph's hash, the data, the method); outside a scope, always collected. Each caller gets its
    own table of the same records (frozen: a range choice replaces a record, it never edits one)."""
    shared = _SHARED.get()
    if shared is None:
        return collect()
    key = fingerprint(key_items)
    if key in shared:
        log.info("quantize: calibration statistics of %d tensors reused (collected by an earlier runtime "
                 "of this run on the same graph and data)", len(shared[key]))
    else:
        shared[key] = collect()
    return dict(shared[key])
