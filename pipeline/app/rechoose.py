"""Choosing again on the machine a results_dir was copied to: `tune-rechoose RESULTS_DIR`.

A results_dir holds every runtime's tuned deployment (backend=auto) and the choice made on the host that
tuned them. Another kind of CPU or other runtime versions can rank them otherwise, or compute one of
them wrongly (u8 x s8 kernels saturate without VNNI). `tune-rechoose` runs the results_dir's own spec
again on this host (its overrides, .hydra/overrides.yaml, which it leaves as the tuning run wrote them) with
the stages after export: every stage that tunes is up to
date and skipped (nothing is tuned again), auto's choice is keyed by this host's CPU kind and runtime
versions (``pipeline.accuracy.kinds.host_key``), so it is made here, and gen_trt_engine and evaluate are
host-bound, so they run here on what ships. Before the choice, each runtime's shipped model that was
checked on another host is judged here on the held-out samples with this machine's own kernels
(``pipeline.app.host_choice``); one that misses the budget here does not ship here. Each host's choice
is kept (autotune/host_choices.json, and the manifest's autotune metrics).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from pipeline.errors import InputError, PipelineError, first_line

# the stages a re-choice runs (those of the original run's stages): tuning is up to date and skipped
STAGES = ("quantize", "autotune", "gen_trt_engine", "evaluate")


def rechoose_args(results_dir: Path, overrides: list[str]) -> tuple[str | None, str, list[str]]:
    """(the folder of the run's spec files or None for the packaged ones, its config name, the overrides
    that run it again here): the run's own overrides (.hydra/overrides.yaml), its results_dir, and the
    stages after export that it had, then ``overrides``."""
    hydra_dir = results_dir / ".hydra"
    if not (hydra_dir / "overrides.yaml").is_file() or not (hydra_dir / "hydra.yaml").is_file():
        raise InputError(f"{results_dir}: no .hydra/overrides.yaml (not a results_dir made by tune); give a "
                         f"results_dir a tune run wrote")
    try:
        hydra = OmegaConf.load(hydra_dir / "hydra.yaml").hydra
        ran = [str(o) for o in OmegaConf.load(hydra_dir / "overrides.yaml")]
        composed = OmegaConf.load(hydra_dir / "config.yaml") if (hydra_dir / "config.yaml").is_file() \
            else OmegaConf.create()
    except Exception as exc:  # noqa: BLE001 - OmegaConf's and YAML's many error types for a broken file
        raise InputError(f"{hydra_dir}: not the record a tune run writes ({first_line(exc)}); give a results_dir "
                         f"a tune run wrote") from None
    kept = [o for o in ran if o.split("=", 1)[0].lstrip("+~") not in ("results_dir", "stages")]
    stages_cfg = composed.get("stages", [])
    # backend=auto: the runtimes tuned before are compared, nothing is tuned (the race may have dropped some)
    auto = ["backend.tuned_only=true"] if str(OmegaConf.select(composed, "backend.name", default="")) == "auto" else []
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
                                                     f"stages=[{','.join(stages)}]", *auto, *overrides]


def main(argv: list[str] | None = None) -> int:
    """`tune-rechoose RESULTS_DIR [overrides...]`."""
    from pipeline.app.cli import checked_config
    from pipeline.app.logs import job_logging
    from pipeline.app.runner import run_pipeline
    from pipeline.app.scope import tuning_frozen
    from pipeline.app.summary import print_summary
    from pipeline.config import register_configs

    parser = argparse.ArgumentParser(prog="tune-rechoose", description=__doc__.split("\n\n")[1])
    parser.add_argument("results_dir", type=Path)
    parser.add_argument("overrides", nargs="*", help="config overrides, as for tune (e.g. progress=false)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    results_dir = args.results_dir.resolve()
    try:
        config_dir, name, overrides = rechoose_args(results_dir, list(args.overrides))
        register_configs()
        cfg = checked_config(overrides, config_dir, name)
        # the pipeline as tune's job runs it (its logging, tune.log appended) but not in a Hydra job of its own:
        # results_dir/.hydra/ keeps the record of the run that tuned it, which every re-choice replays
        with job_logging(results_dir), tuning_frozen():  # a tuning stage that is not up to date is an error
            summary = run_pipeline(cfg, results_dir)
    except PipelineError as exc:
        print(f"tune-rechoose: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"\ntune-rechoose: interrupted; {results_dir} is as the last finished step left it. Run it again.",
              file=sys.stderr)
        raise
    seconds = time.monotonic() - started
    print_summary(summary, results_dir)
    print(cost_line(results_dir, seconds, summary))
    return 0


# the stages that run on the chosen deployment after the choice; what they cost is reported apart
LATER_STAGES = ("gen_trt_engine", "evaluate")


def cost_line(results_dir: Path, seconds: float, summary: dict[str, Any]) -> str:
    """What the re-choice cost against the tuning it did not repeat (quantize and autotune in every runtime
    and the races among them, as the manifest records them): the choice from the command's start (composing the config, judging and
    timing the deployments, shipping one), and apart from it the later stages this run ran on this host."""
    from pipeline.artifacts import Manifest

    manifest = Manifest(results_dir)
    tuned = sum(float((manifest.entry(s) or {}).get("seconds") or 0.0) for s in ("quantize", "autotune"))
    ran = [s for s in LATER_STAGES if (summary.get(s) or {}).get("status") == "done"]
    later = sum(float((manifest.entry(s) or {}).get("seconds") or 0.0) for s in ran)
    chose = max(0.0, seconds - later)
    share = f" ({100 * chose / tuned:.0f}% of the {tuned:.1f} s the run spent quantizing and tuning)" if tuned > 0 else ""
    after = f"; {' and '.join(ran)} on this host then took {later:.1f} s" if ran else ""
    return f"tune-rechoose: chose again in {chose:.1f} s from the command's start{share}{after}"


__all__ = ["cli", "main", "rechoose_args"]


def cli() -> None:
    """The console script: exits with main's status."""
    sys.exit(main())


if __name__ == "__main__":
    cli()
