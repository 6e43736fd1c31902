"""Choosing again on the machine a results_dir was copied to: `tune-rechoose RESULTS_DIR`.

A results_dir holds every runtime's tuned deployment (backend=auto) and the choice made on the host that
tuned them. Another kind of CPU or other runtime versions can rank them otherwise, or compute one of
them wrongly (u8 x s8 kernels saturate without VNNI). `tune-rechoose` runs the results_dir's own spec
again on this host (its overrides, .hydra/overrides.yaml) with the stages after export: every stage that tunes is up to
date and skipped (nothing is tuned again), auto's choice is keyed by this host's CPU kind and runtime
versions (``pipeline.accuracy.kinds.host_key``), so it is made here, and gen_trt_engine and evaluate are
host-bound, so they run here on what ships. Before the choice, each runtime's shipped model that was
checked on another host is judged here on the held-out samples with this machine's own kernels
(``recheck_here``); one that misses the budget here does not ship here. Each host's choice is kept
(autotune/host_choices.json, and the manifest's autotune metrics).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from pipeline.accuracy.budget import AccuracyBudget
from pipeline.accuracy.holdout import Holdout
from pipeline.accuracy.kinds import CheckedOn, host_key, runtime_versions
from pipeline.artifacts import atomic_write_json, read_json
from pipeline.backends import Backend, compute_backend
from pipeline.errors import InputError, PipelineError
from pipeline.graph.model import input_specs, load_model
from pipeline.quant.cpu import cpu_facts

log = logging.getLogger("tune.auto")

HOST_CHOICES = "autotune/host_choices.json"
# the stages a re-choice runs (those of the original run's stages): tuning is up to date and skipped
STAGES = ("quantize", "autotune", "gen_trt_engine", "evaluate")


def checked_elsewhere(metrics: dict[str, Any]) -> bool:
    """Whether a runtime's autotune (its ``metrics``) checked its shipped model on another CPU kind or with
    other versions of its runtime than this host's (True where it recorded nothing)."""
    recorded = metrics.get("checked_on")
    if not recorded:
        return True
    record = CheckedOn.from_dict(recorded)
    here = runtime_versions()
    return record.kind != cpu_facts().kind or record.versions.get(record.runtime) != here.get(record.runtime)


def recheck_here(cfg: DictConfig, float_path: Path, shipped: dict[str, tuple[Backend, Path, dict[str, Any]]]
                 ) -> dict[str, str]:
    """runtime -> why its shipped model misses the accuracy budget on this host, for every runtime in
    ``shipped`` (backend with its settings, model, autotune metrics) checked on another host; judged on
    the held-out samples of ``cfg`` (one runtime's config) with this machine's kernels."""
    stale = {name: (backend, model) for name, (backend, model, metrics) in shipped.items()
             if checked_elsewhere(metrics)}
    if not stale:
        return {}
    holdout = Holdout.from_config(cfg, input_specs(load_model(float_path, check=False)))
    with compute_backend(cfg).prepare(float_path) as pm:
        holdout.set_reference(pm)
    budget = AccuracyBudget.from_config(cfg)
    misses = {}
    for name, (backend, model) in stale.items():
        with backend.prepare(model) as pm:
            verdict = holdout.score(pm, budget)
        log.info("auto: %s's shipped model on this host (%s): %s", name, cpu_facts().describe(), verdict.what)
        if not verdict.ok:
            misses[name] = f"misses the accuracy budget on this host ({verdict.what})"
    return misses


def remember(top: Path, choice: Any) -> dict[str, Any]:
    """Keep ``choice`` (a RuntimeChoice) as this host's in autotune/host_choices.json; every host's choice."""
    path = top / HOST_CHOICES
    kept = read_json(path, HOST_CHOICES) if path.exists() else {}
    kept[host_key()] = {"cpu": cpu_facts().describe(), "winner": choice.winner, "ships": choice.ships,
                        "headline": choice.headline}
    atomic_write_json(path, kept, indent=1)
    return kept


def rechoose_args(results_dir: Path, overrides: list[str]) -> tuple[str | None, str, list[str]]:
    """(the folder of the run's spec files or None for the packaged ones, its config name, the overrides
    that run it again here): the run's own overrides (.hydra/overrides.yaml), its results_dir, and the
    stages after export that it had, then ``overrides``."""
    hydra_dir = results_dir / ".hydra"
    if not (hydra_dir / "overrides.yaml").is_file() or not (hydra_dir / "hydra.yaml").is_file():
        raise InputError(f"{results_dir}: no .hydra/overrides.yaml (not a results_dir made by tune); give a "
                         f"results_dir a tune run wrote")
    hydra = OmegaConf.load(hydra_dir / "hydra.yaml").hydra
    ran = [str(o) for o in OmegaConf.load(hydra_dir / "overrides.yaml")]
    kept = [o for o in ran if o.split("=", 1)[0].lstrip("+~") not in ("results_dir", "stages")]
    stages_cfg = OmegaConf.load(hydra_dir / "config.yaml").get("stages", []) \
        if (hydra_dir / "config.yaml").is_file() else []
    stages = [s for s in STAGES if s in [str(x) for x in stages_cfg]]
    if "autotune" not in stages:
        raise InputError(f"{results_dir}: its run has no autotune stage, so there is no deployment to choose "
                         f"among; run tune with autotune in stages")
    config_dir = next((str(src.path) for src in hydra.runtime.config_sources
                       if src.provider == "command-line" and src.schema == "file"), None)
    if config_dir is not None and not Path(config_dir).is_dir():
        raise InputError(f"{results_dir} was made from spec files in {config_dir}, which is not on this machine; "
                         f"copy that folder there too")
    return config_dir, str(hydra.job.config_name), [*kept, f"results_dir={results_dir}",
                                                     f"stages=[{','.join(stages)}]", *overrides]


def main(argv: list[str] | None = None) -> int:
    """`tune-rechoose RESULTS_DIR [overrides...]`."""
    from pipeline.app.cli import checked_config, run_job
    from pipeline.config import register_configs

    parser = argparse.ArgumentParser(prog="tune-rechoose", description=__doc__.split("\n\n")[1])
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides, as for tune (e.g. progress=false)")
    args = parser.parse_args(argv)
    try:
        config_dir, name, overrides = rechoose_args(args.results_dir.resolve(), list(args.overrides))
        register_configs()
        checked_config(overrides, config_dir, name)
        run_job(overrides, config_dir, name)
    except PipelineError as exc:
        print(f"tune-rechoose: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


__all__ = ["HOST_CHOICES", "checked_elsewhere", "main", "recheck_here", "remember", "rechoose_args", "cli"]


def cli() -> None:
    """The console script: exits with main's status."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
