"""Multirun summary: every job of a sweep side by side (summary.md, summary.json, summary.png).

``SweepSummary`` is a Hydra callback registered in the packaged config (``hydra.callbacks``), so it
runs for spec files too. At the end of a multirun it reads what each job left in its results_dir
(the sweep folder's job sub-folders: .hydra/, manifest.json, job.json), so it works the same with
any launcher, for jobs that ran elsewhere (Ray) and for jobs that were skipped as up to date (their
manifest keeps the recorded numbers). A failed job is a row with its one-line reason.

Latency is only comparable between jobs that did not time at the same moment on the same CPU: jobs
whose timing stages overlapped on one host with a CPU backend are flagged.
"""

from __future__ import annotations

import json
import logging
import math
import shlex
from pathlib import Path
from typing import Any

import yaml
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pipeline.accuracy.budget import AccuracyVerdict
from pipeline.artifacts import atomic_write_json, atomic_write_text, entry_name
from pipeline.errors import StateError, first_line
from pipeline.records.autotune import AutotuneMetrics, autotune_metrics

log = logging.getLogger("tune")

JOB_FILE = "job.json"  # written by every multirun job: status, reason, host, command, environment
TIMED_STAGES = ("autotune", "evaluate")


def accuracy_drop(verdict: AccuracyVerdict | None) -> float | None:
    """Points lost against float: top-1 drop with labels, else top-1 disagreement with the float model."""
    if verdict is None:
        return None
    if verdict.top1_drop is not None:
        return float(verdict.top1_drop)
    if verdict.agreement is not None:
        return 100.0 * (1.0 - float(verdict.agreement))
    return None


def job_objectives(summary: dict[str, Any]) -> tuple[float, float] | None:
    """(speedup, accuracy drop) of the shipped model of a finished run, for Hydra's sweepers; None
    when the run did not autotune."""
    m = (summary.get("autotune") or {}).get("metrics")
    if not isinstance(m, AutotuneMetrics) or m.speedup is None:
        return None
    drop = accuracy_drop(m.accuracy.final)
    return float(m.speedup), float(drop if drop is not None else 0.0)


def reproduce_command(hydra_cfg: dict[str, Any]) -> str:
    """The `tune` command line that reruns one job on its own: its spec file (if any), its overrides,
    and its own folder as results_dir."""
    job = hydra_cfg.get("job", {})
    parts = ["tune"]
    for src in (hydra_cfg.get("runtime", {}) or {}).get("config_sources", []) or []:
        if src.get("provider") == "main" and src.get("schema") == "file":
            parts += ["--config-path", src["path"]]
    if job.get("config_name") and job["config_name"] != "tune":
        parts += ["--config-name", job["config_name"]]
    parts += [o for o in (hydra_cfg.get("overrides") or {}).get("task") or [] if not o.startswith("results_dir=")]
    out_dir = (hydra_cfg.get("runtime") or {}).get("output_dir")
    if out_dir:
        parts.append(f"results_dir={out_dir}")
    return " ".join(shlex.quote(p) for p in parts)


def _read_json(p: Path) -> dict[str, Any]:
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def collect_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = []
    # job folders are named after their overrides, which may hold slashes (paths): search at any depth
    for overrides_file in sorted(sweep_dir.rglob(".hydra/overrides.yaml")):
        job_dir = overrides_file.parent.parent
        overrides = yaml.safe_load(overrides_file.read_text()) or []
        hydra_file = job_dir / ".hydra" / "hydra.yaml"
        hydra_cfg = (yaml.safe_load(hydra_file.read_text()) or {}).get("hydra", {}) if hydra_file.exists() else {}
        job = _read_json(job_dir / JOB_FILE)
        manifest = _read_json(job_dir / "manifest.json")
        stages = manifest.get("stages", {})
        at = _tuned(stages, job_dir)
        failed = [(n, e) for n, e in stages.items() if e.get("status") in ("failed", "interrupted", "running")]
        status = job.get("status") or ("failed" if failed else "done" if stages else "unknown")
        reason = job.get("reason") or (f"{failed[0][0]}: {failed[0][1].get('error') or failed[0][1]['status']}"
                                       if failed and status != "done" else None)
        final = at.accuracy.final
        entry_at = stages.get("autotune") or {}
        rows.append({
            "job": str(job_dir.relative_to(sweep_dir)), "dir": str(job_dir), "overrides": overrides, "status": status, "reason": reason,
            "float_ms": at.baseline_ms, "ptq_ms": at.ptq_ms, "tuned_ms": at.final_ms,
            "speedup": at.speedup, "ptq_speedup": at.ptq_speedup, "shipped": at.shipped,
            "accuracy": final.what if final else None, "accuracy_ok": final.ok if final else None,
            "accuracy_drop": accuracy_drop(final),
            "tuning_seconds": (entry_at["finished"] - entry_at["started"]) if entry_at.get("finished") and
            entry_at.get("started") else None,
            "measurements": at.search.measurements, "mode": at.search.mode,
            "backend": job.get("backend"), "host": job.get("host"),
            "timing_windows": [[e.get("started"), e.get("finished")] for n, e in stages.items()
                               if n in TIMED_STAGES and e.get("started") and e.get("finished")],
            "command": job.get("command") or reproduce_command(hydra_cfg),
            "environment": manifest.get("environment") or job.get("environment"),
        })
    return rows


def _tuned(stages: dict[str, Any], job_dir: Path) -> AutotuneMetrics:
    """The job's autotune metrics (an empty record where it has none; a corrupt entry is said and left out)."""
    try:
        return autotune_metrics((stages.get("autotune") or {}).get("metrics"), entry_name(job_dir, "autotune")) or AutotuneMetrics()
    except StateError as exc:
        log.warning("sweep summary: %s", first_line(exc))
        return AutotuneMetrics()


def _varying(rows: list[dict[str, Any]]) -> set[str]:
    """Override keys whose values differ between jobs (what the sweep sweeps)."""
    values: dict[str, list[str]] = {}
    for r in rows:
        for o in r["overrides"]:
            k, _, v = o.partition("=")
            values.setdefault(k, []).append(v)
    # a key some jobs lack varies as well
    return {k for k, vs in values.items() if len(set(vs)) > 1 or len(vs) < len(rows)}


def overlapping(rows: list[dict[str, Any]]) -> set[str]:
    """Jobs whose timing stages overlapped with another job's on the same host, both timing on its CPU
    (every CPU runtime and backend=auto, the default: ``times_on_host_cpu``)."""
    flagged = set()
    from pipeline.backends import times_on_host_cpu

    timed = [r for r in rows if r["timing_windows"] and times_on_host_cpu(str(r["backend"]))]
    for i, a in enumerate(timed):
        for b in timed[i + 1:]:
            if a["host"] != b["host"]:
                continue
            if any(s1 < e2 and s2 < e1 for s1, e1 in a["timing_windows"] for s2, e2 in b["timing_windows"]):
                flagged |= {a["job"], b["job"]}
    return flagged


def pareto(rows: list[dict[str, Any]]) -> list[str]:
    """Jobs no other job beats on both speedup (higher) and accuracy drop (lower)."""
    pts = [r for r in rows if r["speedup"] is not None and r["accuracy_drop"] is not None]
    front = []
    for r in pts:
        if not any((o["speedup"] >= r["speedup"] and o["accuracy_drop"] <= r["accuracy_drop"]) and
                   (o["speedup"] > r["speedup"] or o["accuracy_drop"] < r["accuracy_drop"]) for o in pts):
            front.append(r["job"])
    return front


def write_summary(sweep_dir: Path) -> dict[str, Any] | None:
    """Write summary.md/json/png for the jobs under ``sweep_dir``; the summary, or None without jobs."""
    rows = collect_jobs(sweep_dir)
    if not rows:
        return None
    flagged = overlapping(rows)
    varying = _varying(rows)
    for r in rows:
        r["comparable"] = r["job"] not in flagged
        r["label"] = ",".join(o for o in r["overrides"] if o.split("=", 1)[0] in varying) or r["job"]
    rows.sort(key=lambda r: (r["status"] != "done", -(r["speedup"] or 0.0), r["job"]))
    for k, r in enumerate(rows, 1):
        r["rank"] = k  # the number the chart labels each job with
    ok = [r for r in rows if r["status"] == "done" and r["speedup"] is not None and r["accuracy_ok"]]
    best = max(ok, key=lambda r: r["speedup"])["job"] if ok else None
    summary = {"sweep_dir": str(sweep_dir), "jobs": rows, "best": best, "pareto": pareto(rows),
               "not_comparable": sorted(flagged)}
    atomic_write_json(sweep_dir / "summary.json", summary, indent=1)
    atomic_write_text(sweep_dir / "summary.md", _markdown(summary))
    try:
        _chart(summary, sweep_dir / "summary.png")
    except ImportError:
        log.warning("summary.png not written: matplotlib is not installed")
    return summary


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:{spec}}{suffix}"


def _markdown(s: dict[str, Any]) -> str:
    rows = s["jobs"]
    lines = [f"# Sweep summary: {len(rows)} jobs", "",
             f"Best within the accuracy budget: `{next((r['label'] for r in rows if r['job'] == s['best']), 'none')}`.",
             "",
             f"Sweep folder: `{s['sweep_dir']}`. Sorted by speedup of the shipped model (p10 latency vs the "
             f"float model). ★ = fastest model within the accuracy budget; P = on the speed/accuracy Pareto "
             f"front.", ""]
    if s["not_comparable"]:
        names = ", ".join(f"`{r['label']}`" for r in rows if r["job"] in s["not_comparable"])
        lines += [f"**Latencies of {names} are not comparable**: these jobs timed at "
                  f"the same time on one machine's CPU (a parallel launcher); run timing sweeps with the default "
                  f"sequential launcher or one job per machine.", ""]
    lines += ["| # | job | status | float ms | PTQ ms | tuned ms | speedup | accuracy | tuning s | measurements |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = ("★" if r["job"] == s["best"] else "") + ("P" if r["job"] in s["pareto"] else "")
        status = r["status"] if r["status"] != "failed" else f"failed: {r['reason']}"
        acc = r["accuracy"] or "-"
        if r["accuracy_ok"] is False:
            acc += " (over budget)"
        flag = "" if r["comparable"] else " (not comparable)"
        lines.append(f"| {r['rank']} {mark} | `{r['label']}` | {status} | {_fmt(r['float_ms'], '.3f')} | {_fmt(r['ptq_ms'], '.3f')} | "
                     f"{_fmt(r['tuned_ms'], '.3f')}{flag} | {_fmt(r['speedup'], '.2f', 'x')} | {acc} | "
                     f"{_fmt(r['tuning_seconds'], '.0f')} | {_fmt(r['measurements'], 'd') if isinstance(r['measurements'], int) else '-'} |")
    lines += ["", "## Reproduce", ""]
    for r in rows:
        env = r.get("environment") or {}
        pkgs = ", ".join(f"{k} {v}" for k, v in (env.get("packages") or {}).items())
        where = f" — on {env.get('host')}: {env.get('cpu')}; GPUs: {', '.join(env.get('gpus') or []) or 'none'}; " \
                f"Python {env.get('python')}; {pkgs}" if env else ""
        lines.append(f"- `{r['label']}`: `{r['command']}`{where}")
    return "\n".join(lines) + "\n"


def _chart(s: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in s["jobs"] if r["speedup"] is not None]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in rows:
        color = "#d62728" if r["job"] == s["best"] else ("#1f77b4" if r["comparable"] else "#999999")
        if r["accuracy_drop"] is not None:
            a1.scatter(r["accuracy_drop"], r["speedup"], color=color, zorder=3)
            a1.annotate(f"#{r['rank']}", (r["accuracy_drop"], r["speedup"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        if r["tuning_seconds"] is not None:
            a2.scatter(r["tuning_seconds"], r["speedup"], color=color, zorder=3)
            a2.annotate(f"#{r['rank']}", (r["tuning_seconds"], r["speedup"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    front = sorted((r for r in rows if r["job"] in s["pareto"]), key=lambda r: r["accuracy_drop"])
    if front:
        a1.plot([r["accuracy_drop"] for r in front], [r["speedup"] for r in front], "--o", mfc="none", ms=13,
                color="#ff7f0e",
                label="Pareto front", zorder=2)
        a1.legend(fontsize=8)
    a1.set_xlabel("accuracy drop vs float (points)")
    a1.set_ylabel("speedup vs float (p10)")
    a1.set_title("speed vs accuracy (#: row of summary.md; red: fastest within budget)", fontsize=10)
    a2.set_xlabel("tuning wall time (s)")
    a2.set_ylabel("speedup vs float (p10)")
    a2.set_title("speed vs tuning time")
    for ax in (a1, a2):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


class SweepSummary(Callback):
    """Writes <sweep dir>/summary.{md,json,png} when a multirun ends (see the module docstring)."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        try:
            summary = write_summary(sweep_dir)
        except Exception:  # noqa: BLE001 - a summary bug must not turn a finished sweep into a failure
            log.exception("writing the sweep summary failed")
            return
        if summary is not None:
            done = sum(r["status"] == "done" for r in summary["jobs"])
            best = next((r["label"] for r in summary["jobs"] if r["job"] == summary["best"]), "none")
            print(f"\nsweep: {done}/{len(summary['jobs'])} jobs done; best within budget: {best}; "
                  f"summary: {sweep_dir / 'summary.md'}")
