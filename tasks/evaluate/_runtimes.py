"""Every runtime beside the one that ships, where the run chose its runtime by measurement.

The choice record (autotune/runtime_choice.json, ``pipeline.runtime_choice``) holds each runtime's p10
latency and its own float's against the reference float, from one interleaved run, and the evaluation
of every runtime that did not ship (made in its own results_dir). This evaluation is the shipped
runtime's. metrics.json's ``runtimes`` and report.md's "Every runtime" section put them side by side.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pipeline.runtime_choice import FLOAT, RuntimeChoice, RuntimeEvaluation

THIS_REPORT = "evaluate/report.md"


def runtimes_metrics(choice: RuntimeChoice, metrics: dict[str, Any]) -> dict[str, Any]:
    """metrics.json's ``runtimes``: the choice, each row with its speedups over the reference float and its
    evaluation (the shipped runtime's is this one, ``metrics``)."""
    ref = choice.reference_p10_ms
    rows = []
    for r in choice.rows:
        ev = RuntimeEvaluation.from_metrics(metrics, THIS_REPORT) if r.runtime == choice.winner else r.evaluation
        row = {**asdict(r), "evaluation": asdict(ev) if ev is not None else None, "vs_reference": r.speedup(ref),
               "float_vs_reference": ref / r.float_p10_ms if r.float_p10_ms else None}
        if r.runtime == choice.winner and choice.ships == FLOAT:  # its float ran faster than its own pick
            best = choice.contenders[0]
            row.update(shipped=f"{best.label} (its {r.shipped} model {r.speedup(ref):.2f}x)",
                       vs_reference=ref / best.p10_ms)
        rows.append(row)
    return {"reference": choice.reference, "reference_p10_ms": ref, "winner": choice.winner, "rows": rows,
            "left_out": dict(choice.left_out)}


def _cell(models: dict[str, dict[str, Any]], key: str, fallback: str = "–") -> str:
    m = models.get(key)
    if m is None:
        return fallback
    text = m["accuracy"] or "not scored"
    if m.get("speedup_p10") is not None and key != "float":
        text += f", {m['speedup_p10']:.2f}x its float"
    return text + (" **OVER BUDGET**" if m.get("over_budget") else "")


def section(metrics: dict[str, Any]) -> list[str]:
    """report.md's "Every runtime" section ([] where the run did not choose its runtime)."""
    rt = metrics.get("runtimes")
    if not rt:
        return []
    lines = ["", "## Every runtime", "",
             f"The run tuned each runtime in its own results_dir and timed every runtime's shipped model and its "
             f"own float side by side with the {rt['reference']} ({rt['reference_p10_ms']:.3g} ms p10); "
             f"**{rt['winner']}** is the fastest that meets the accuracy budget and ships. Accuracy and the "
             f"speedups over each runtime's own float are that runtime's evaluation on this data.", "",
             f"| runtime | ships | vs {rt['reference']} (p10) | its float vs it | float | PTQ | tuned | report |",
             "|---|---|---:|---:|---|---|---|---|"]
    for r in rt["rows"]:
        speed = f"{r['vs_reference']:.2f}x" if r.get("vs_reference") else f"not timed ({r.get('error')})"
        own = f"{r['float_precision']} {r['float_vs_reference']:.2f}x" if r.get("float_vs_reference") else "–"
        ev = r.get("evaluation")
        if ev is None:
            why = r.get("evaluation_error") or "not evaluated"
            cells = ["–", "–", "–", why]
        else:
            models = {m["key"]: m for m in ev["models"]}
            report = "this report" if ev["report"] == THIS_REPORT else f"[report.md](../{ev['report']})"
            cells = [_cell(models, "float"), _cell(models, "ptq"), _cell(models, "autotuned", "as PTQ"), report]
        name = f"**{r['runtime']}**" if r["runtime"] == rt["winner"] else r["runtime"]
        lines.append(f"| {name} | {r['shipped']} | {speed} | {own} | " + " | ".join(cells) + " |")
    for name, why in rt.get("left_out", {}).items():
        lines.append(f"| {name} | left out | {why} | | | | | |")
    return lines
