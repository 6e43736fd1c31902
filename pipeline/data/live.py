"""The objects a running ``pipeline.api.tune()`` call was given in memory (an nn.Module, data, a metric
function), and the functions the `custom` model and data options' ``_target_`` (and
accuracy.custom_metric) name to hand them to the stages.

``tune()`` holds its objects here (``held``) for the length of the call under keys made of their
fingerprints, which are also the ``args`` of those ``_target_``s; a config naming them in another
process (a spec copied out of a results_dir) gets a one-line InputError instead of another object.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import re
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

from pipeline.errors import InputError

# objects passed to a running tune() call, by the key their config args name; per run: a ContextVar
# holding an immutable mapping (a block adds to a copy)
_LIVE: ContextVar[Mapping[str, Any]] = ContextVar("live_objects", default=MappingProxyType({}))


@contextlib.contextmanager
def held(objects: Mapping[str, Any]) -> Iterator[None]:
    """Hold ``objects`` (key -> object) for the ``_target_``s below while the block runs; after it, also
    when it raises, each key holds what it held before (an enclosing call's object) or nothing."""
    token = _LIVE.set(MappingProxyType({**_LIVE.get(), **objects}))
    try:
        yield
    finally:
        _LIVE.reset(token)


def held_keys() -> frozenset[str]:
    """The keys of the objects held now (none outside a tune() call)."""
    return frozenset(_LIVE.get())


def in_memory_model(class_name: str, parameters: str, code: str) -> Any:
    """`model._target_` of an nn.Module passed to tune(): that module (a CPU copy if it is on a GPU)."""
    module = _live(f"model:{class_name}:{parameters}:{code}", f"the nn.Module {class_name}", "model")
    if any(t.device.type != "cpu" for t in itertools.chain(module.parameters(), module.buffers())):
        module = copy.deepcopy(module).cpu()
    return module


def in_memory_data(calibration: str, evaluation: str, split: str = "calibration") -> Iterable[Any]:
    """`data._target_` of data passed to tune(): the calibration or the evaluation data."""
    fp = calibration if split == "calibration" else evaluation
    return _live(f"data:{fp}", f"the {split} data", "data")


def in_memory_groups(cfg: Any) -> list[str]:
    """The groups (model, data) of a config whose objects were passed to tune() in memory."""
    from omegaconf import OmegaConf

    return [g for g in ("model", "data")
            if str(OmegaConf.select(cfg, f"{g}._target_", default=None) or "").startswith(f"{__name__}.")]


# `accuracy.custom_metric=pipeline.data.live.<function name>__<16 hex of its name and source>`
_METRIC = re.compile(r"^(\w+?)__([0-9a-f]{16})$")


def metric_attribute(qualname: str) -> str:
    """The identifier part of a metric function's attribute name here (its name, dots and <> removed)."""
    return re.sub(r"\W+", "_", qualname).strip("_") or "metric"


def metric_name(path: str) -> str:
    """How verdicts name accuracy.custom_metric: its function's name (a live one without its hash)."""
    last = str(path).rsplit(".", 1)[-1]
    m = _METRIC.match(last)
    return m.group(1) if m and str(path).startswith(f"{__name__}.") else last


def __getattr__(name: str) -> Any:
    """`accuracy.custom_metric=pipeline.data.live.<name>__<hash>`: the metric function passed to tune()."""
    if _METRIC.match(name):
        key, live = f"metric:{name}", _LIVE.get()
        if key not in live:
            raise InputError(f"accuracy.custom_metric=pipeline.data.live.{name}: the metric function was passed to "
                             f"pipeline.api.tune() in another Python process; pass it to tune() again, or set "
                             f"accuracy.custom_metric=pkg.module.function to run from a spec")
        return live[key]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _live(key: str, what: str, group: str) -> Any:
    live = _LIVE.get()
    if key not in live:
        raise InputError(f"{group}._target_=pipeline.data.live.in_memory_{group}: {what} was passed to "
                         f"pipeline.api.tune() in another Python process; pass it to tune() again, or "
                         f"configure {group}=... to run from a spec")
    return live[key]
