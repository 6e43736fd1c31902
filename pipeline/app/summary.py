"""The short table `tune` prints when a run ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pipeline.records.evaluate import EvaluateMetrics


def print_summary(summary: dict[str, Any], results_dir: Path) -> None:
    rows = []
    for stage, info in summary.items():
        m = info.get("metrics") or {}
        headline = m.get("headline") or ""
        rows.append((stage, info.get("status", "?"), headline))
    if not rows:
        return
    w1 = max(len(r[0]) for r in rows)
    w2 = max(len(r[1]) for r in rows)
    print(f"\nresults_dir: {results_dir}")
    for stage, status, headline in rows:
        print(f"  {stage:<{w1}}  {status:<{w2}}  {headline}")
    evaluated = (summary.get("evaluate") or {}).get("metrics")
    if evaluated:  # models past the accuracy budget, with the likely cause, in words
        for text in EvaluateMetrics.from_dict(evaluated, "evaluate's metrics").over_budget:
            print(f"  WARNING: {text}")
