"""Progress bars for long work: shown on an interactive terminal when `progress=true`, silent otherwise."""

from __future__ import annotations

from typing import Any

from tqdm import tqdm


def progress_bar(enabled: bool = True, **kwargs: Any) -> tqdm:
    # disable=None lets tqdm hide the bar when stderr is not a terminal (CI logs, pipes)
    kwargs.setdefault("leave", False)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(disable=None if enabled else True, **kwargs)
