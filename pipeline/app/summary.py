"""The short table `tune` prints when a run ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.records.evaluate import EvaluateMetrics
from pipeline.stage import StageMetrics


def print_summary(summary: dict[str, Any], results_dir: Path) -> None:
    """The runner's summary (each stage's status and metrics record) as one row per stage, then the models
    past the accuracy budget."""
    rows = []
    for stage, info in summary.items():
        m: StageMetrics | None = info.get("metrics")
        rows.append((stage, info.get("status", "?"), m.headline if m is not None else ""))
    if not rows:
        return
    w1 = max(len(r[0]) for r in rows)
    w2 = max(len(r[1]) for r in rows)
    print(f"\nresults_dir: {results_dir}")
    for stage, status, headline in rows:
        print(f"  {stage:<{w1}}  {status:<{w2}}  {headline}")
    evaluated = (summary.get("evaluate") or {}).get("metrics")
    if isinstance(evaluated, EvaluateMetrics):  # models past the accuracy budget, with the likely cause, in words
        for text in evaluated.over_budget:
            print(f"  WARNING: {text}")
