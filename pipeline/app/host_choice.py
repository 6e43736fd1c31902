"""The runtime choice on this host: deployments checked on another host are judged here first, and each
host's choice is kept (autotune/host_choices.json), keyed by its CPU kind and runtime versions
(``pipeline.accuracy.kinds.host_key``). backend=auto's choice (``pipeline.app.auto``) uses both; a
results_dir copied to another machine is chosen again there with `tune-rechoose`
(``pipeline.app.rechoose``)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from pipeline.accuracy.budget import AccuracyBudget, AccuracyVerdict
from pipeline.accuracy.holdout import Holdout
from pipeline.accuracy.kinds import CheckedOn, host_key, runtime_versions
from pipeline.artifacts import atomic_write_json, read_json
from pipeline.backends import Backend, compute_backend
from pipeline.graph.model import input_specs, load_model
from pipeline.quant.cpu import cpu_facts
from pipeline.records.autotune import AutotuneMetrics

log = logging.getLogger("tune.auto")

HOST_CHOICES = "autotune/host_choices.json"


def checked_elsewhere(record: CheckedOn | None) -> bool:
    """Whether a shipped model was checked (``record``) on another CPU kind or with other versions of its
    runtime than this host's (True where nothing was recorded)."""
    if record is None:
        return True
    here = runtime_versions()
    return record.kind != cpu_facts().kind or record.versions.get(record.runtime) != here.get(record.runtime)


def recheck_here(cfg: DictConfig, float_path: Path, shipped: dict[str, tuple[Backend, Path, AutotuneMetrics]]
                 ) -> dict[str, AccuracyVerdict]:
    """runtime -> its shipped model's verdict on this host, for every runtime in ``shipped`` (backend with
    its settings, model, autotune metrics) checked on another host; judged on the held-out samples of
    ``cfg`` (one runtime's config) with this machine's kernels."""
    stale = {name: (backend, model) for name, (backend, model, metrics) in shipped.items()
             if checked_elsewhere(metrics.checked)}
    if not stale:
        return {}
    float_model = load_model(float_path, check=False)
    holdout = Holdout.from_config(cfg, input_specs(float_model), model=float_model)
    with compute_backend(cfg).prepare(float_path) as pm:
        holdout.set_reference(pm)
    budget = AccuracyBudget.from_config(cfg)
    verdicts = {}
    for name, (backend, model) in stale.items():
        with backend.prepare(model) as pm:
            verdicts[name] = holdout.score(pm, budget)
        log.info("auto: %s's shipped model on this host (%s): %s", name, cpu_facts().describe(), verdicts[name].what)
    return verdicts


def remember(top: Path, choice: Any, judged: dict[str, AccuracyVerdict]) -> dict[str, Any]:
    """Keep ``choice`` (a RuntimeChoice) as this host's in autotune/host_choices.json, with the verdicts of
    the runtimes ``judged`` here (``recheck_here``); every host's choice."""
    path = top / HOST_CHOICES
    kept = read_json(path, HOST_CHOICES) if path.exists() else {}
    kept[host_key()] = {"cpu": cpu_facts().describe(), "winner": choice.winner, "ships": choice.ships,
                        "headline": choice.headline,
                        "judged": {name: {"ok": v.ok, "what": v.what} for name, v in judged.items()}}
    atomic_write_json(path, kept, indent=1)
    return kept


def judged_hosts(choices: dict[str, Any], runtime: str) -> dict[str, dict[str, Any]]:
    """host_key -> {"ok", "what"} of ``runtime``'s shipped model on every host that judged it (``remember``)."""
    return {host: entry["judged"][runtime] for host, entry in choices.items() if runtime in entry.get("judged", {})}


__all__ = ["HOST_CHOICES", "checked_elsewhere", "judged_hosts", "recheck_here", "remember"]
