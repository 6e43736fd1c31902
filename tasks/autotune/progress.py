"""One progress protocol for both autotune modes: workflows emit ``Progress`` events, the stage shows
them with ``ProgressBars`` (one bar per phase; a new phase closes the bars before it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pipeline.progress import progress_bar


@dataclass(frozen=True)
class Progress:
    """Where a workflow is: ``done`` of ``total`` units of ``phase``, and a few figures to show."""

    phase: str  # the bar's name: "autotune" (region mode), "phase 2: groups", "phase 3: validation"
    done: int
    total: int | None
    unit: str = "step"
    postfix: dict[str, Any] = field(default_factory=dict)  # shown after the bar, as tqdm formats it


OnProgress = Callable[[Progress], None]


class ProgressBars:
    """One progress bar per phase, the previous ones closed when the next starts."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.bars: dict[str, Any] = {}

    def __call__(self, ev: Progress) -> None:
        bar = self.bars.get(ev.phase)
        if bar is None:
            for b in self.bars.values():
                b.close()
            bar = self.bars[ev.phase] = progress_bar(self.enabled, total=ev.total, desc=ev.phase, unit=ev.unit)
        bar.total = ev.total
        bar.n = ev.done
        if ev.postfix:
            bar.set_postfix(ev.postfix, refresh=False)
        bar.refresh()

    def __enter__(self) -> ProgressBars:
        return self

    def __exit__(self, *exc: object) -> None:
        for b in self.bars.values():
            b.close()
