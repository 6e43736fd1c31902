"""The `tune` console script: a Hydra app over conf/tune.yaml.

Before handing over to Hydra, the command line is composed once with Hydra's compose API so that a
bad key, a wrong type or an unknown group option is reported on one line (exit 2) instead of
Hydra's multi-line report. `--config-path DIR` is taken relative to the current directory and
searched in addition to the packaged conf/, so a spec file kept in a user's repo can extend `tune`.

``checked_config`` (that one-line check) and ``run_job`` (one Hydra run that raises instead of
exiting) are what the Python API (pipeline/api.py) runs too, so both entry points behave alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import hydra
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline.app import hydra_internals
from pipeline.app.logs import kept_root_logging
from pipeline.config import register_configs
from pipeline.errors import ConfigError, PipelineError

log = logging.getLogger("tune")

# Hydra's app state (GlobalHydra), the running job's config (HydraConfig) and its job logging (the root
# logger's handlers) are process-wide: compositions and jobs of one process take turns, each whole
# (re-entrant: a job composes too). Every other run-wide setting is a ContextVar (pipeline.app.scope).
HYDRA_TURN = threading.RLock()

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _fail(msg: str, code: int) -> None:
    print(f"tune: error: {msg}", file=sys.stderr)
    sys.exit(code)


def user_config_dir(value: str | os.PathLike, what: str = "--config-path") -> str:
    """The absolute folder of a user's spec files, searched next to the packaged configs."""
    value = str(value)
    if value.startswith("pkg://"):
        raise ConfigError(f"{what} {value}: give a folder holding your spec files")
    d = Path(value).expanduser().resolve()
    if not d.is_dir():
        raise ConfigError(f"{what} {value}: no such folder ({d})")
    return str(d)


def _rewrite_config_path(argv: list[str]) -> list[str]:
    """`--config-path/-cp DIR` -> `--config-dir <abs DIR>`: searched next to the packaged configs."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        value = None
        if a in ("--config-path", "-cp") and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
        elif a.startswith("--config-path="):
            value, i = a.split("=", 1)[1], i + 1
        else:
            out.append(a)
            i += 1
            continue
        try:
            out += ["--config-dir", user_config_dir(value)]
        except ConfigError as exc:
            _fail(str(exc), EXIT_USAGE)
    if out.count("--config-dir") + sum(a in ("-cd",) for a in out) > 1:
        _fail("give either --config-path or --config-dir, not both", EXIT_USAGE)
    return out


# Dict-typed schema fields: Hydra's struct mode refuses new keys inside them on plain `key=value`
# overrides, so such overrides are passed as `++key=value` (add-or-override) on the user's behalf.
_DICT_FIELDS = ("input_shapes", "min_shapes", "opt_shapes", "max_shapes", "args", "input_dtypes", "batch_axes",
                "fixed_inputs")


def open_dict_overrides(argv: list[str]) -> list[str]:
    """The command line as Hydra composes it: overrides of dict-valued fields get ``++`` (they may add
    keys), and ``backend=[a,b]`` means backend=auto over those runtimes."""
    out = []
    for a in argv:
        if a.startswith("backend=[") and a.endswith("]"):
            out += ["backend=auto", f"backend.runtimes={a.split('=', 1)[1]}"]
            continue
        key = a.split("=", 1)[0]
        if "=" in a and not a.startswith(("-", "+", "~")) and any(
                key.endswith("." + f) or "." + f + "." in key for f in _DICT_FIELDS):
            a = "++" + a
        out.append(a)
    return out


def _first_of_sweeps(overrides: list[str]) -> list[str]:
    """Collapse `key=a,b,c` sweeps to their first value, to check a multirun before it starts."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    out = []
    for o, raw in zip(parsed, overrides, strict=True):
        if o.is_sweep_override():
            first = next(iter(o.sweep_string_iterator()))
            out.append(f"{o.get_key_element()}={first}")
        else:
            out.append(raw)
    return out


def one_line(exc: BaseException) -> str:
    """Turn a Hydra/OmegaConf composition error into one line naming the key and what is allowed."""
    from hydra.errors import MissingConfigException
    from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    for e in chain:
        if isinstance(e, MissingConfigException):
            opts = getattr(e, "options", None) or []
            first = str(e).strip().splitlines()[0]
            if opts:
                shown = sorted(o for o in opts if not o.startswith("base_"))
                return f"{first.rstrip('.')}; available: {', '.join(shown)}"
            return first
    for e in chain:
        if isinstance(e, OmegaConfBaseException) and getattr(e, "full_key", None):
            msg = str(e).strip().splitlines()[0]
            if isinstance(e, (ConfigKeyError, ConfigAttributeError)) and " not in " in msg:

                otype = getattr(e, "object_type", None)
                allowed = ""
                if otype is not None and dataclasses.is_dataclass(otype):
                    allowed = f"; allowed: {', '.join(f.name for f in dataclasses.fields(otype))}"
                return f"unknown config key '{e.full_key}'{allowed}"
            return f"{e.full_key}: {msg}"
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def compose(config_dir: str | None, config_name: str, overrides: list[str]) -> DictConfig:
    """Compose exactly as the app will: packaged conf/ plus an optional user folder searched first."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    with HYDRA_TURN:
        GlobalHydra.instance().clear()
        try:
            app = hydra_internals.main_hydra("tune", config_dir)
            cfg = app.compose_config(config_name=config_name, overrides=overrides, run_mode=RunMode.RUN,
                                     with_log_configuration=False)
        finally:
            GlobalHydra.instance().clear()
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.pop("hydra", None)
    return cfg


# Hydra plugins behind optional extras: group option -> (plugin module, extra)
_PLUGINS = {"hydra/sweeper=optuna": ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
            "hydra/launcher=ray": ("hydra_plugins.hydra_ray_launcher", "ray"),
            "hydra/launcher=ray_gpu": ("hydra_plugins.hydra_ray_launcher", "ray")}


def module_available(name: str) -> bool:
    """Whether `name` can be imported; False (not an exception) when a parent package is missing too."""

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # find_spec("a.b") imports "a", which may itself be missing
        return False


def _check_plugins(overrides: list[str]) -> None:
    """A sweeper or launcher from an extra that is not installed: one line naming the extra."""
    for o in overrides:
        module, extra = _PLUGINS.get(o, (None, None))
        if module is not None and not module_available(module):
            _fail(f"{o} needs the {extra} extra: pip install 'qdq-tune[{extra}]'", EXIT_USAGE)


def checked_config(overrides: list[str], config_dir: str | None = None, config_name: str = "tune",
                   multirun: bool = False) -> DictConfig:
    """Compose the config a run of ``overrides`` gets (a sweep: its first job) and validate it; a bad
    key, value, group option or missing runtime raises a PipelineError whose message is the one line
    `tune` prints after "tune: error: "."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from pipeline.backends import check_backend
    from pipeline.config import validate

    overrides = [o for o in overrides if not o.startswith("hydra.") and not o.startswith("hydra/")]
    try:
        overrides = _first_of_sweeps(overrides) if multirun else overrides
        cfg = compose(config_dir, config_name, overrides)
        validate(cfg)
        check_backend(cfg)
    except ConfigError as exc:
        raise ConfigError(f"invalid config: {exc}") from exc
    except PipelineError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError) as exc:  # Hydra/OmegaConf's many types for bad input
        raise ConfigError(one_line(exc)) from exc
    return cfg


def _precheck(argv: list[str]) -> Any:
    """Compose and validate the config the command line asks for; exit 2 with one line if it is bad.
    Returns the parsed command line when it asks for one plain run, else None (Hydra handles it)."""
    try:
        args = hydra_internals.args_parser().parse_args(argv)
    except SystemExit:
        return None  # let Hydra print its own usage error
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return None
    _check_plugins(args.overrides)
    if args.multirun and args.cfg:
        _fail("-m and --cfg cannot be combined: print one job's config with --cfg job and single values",
              EXIT_USAGE)
    try:
        cfg = checked_config(args.overrides, args.config_dir, args.config_name or "tune", multirun=args.multirun)
    except PipelineError as exc:
        _fail(str(exc), exc.exit_code)
    if args.cfg == "job" and not args.package:
        # the validated config (deprecated aliases moved to their new keys) is what the job runs
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg, resolve=args.resolve), end="")
        sys.exit(0)
    plain = not (args.multirun or args.cfg or args.run or args.experimental_rerun
                 or any(o.startswith(("hydra.mode", "hydra/", "+hydra/")) for o in args.overrides))
    return args if plain else None


def _run_checked(args: Any) -> None:
    """One plain run of a command line ``_precheck`` composed and validated: Hydra's run without the
    compose that hydra.main makes first only to learn the run mode (the mode is RUN)."""
    from hydra.core.global_hydra import GlobalHydra

    with HYDRA_TURN:
        GlobalHydra.instance().clear()
        app = hydra_internals.main_hydra(Path(__file__).stem, args.config_dir)
        app.run(config_name=args.config_name or "tune", task_function=_job,
                overrides=[*args.overrides, "hydra.mode=RUN"])


def run_job(overrides: list[str], config_dir: str | None = None, config_name: str = "tune"
            ) -> tuple[Path, dict[str, Any]]:
    """One run of the pipeline as `tune` makes it: the same Hydra job (.hydra/, tune.log), runner and
    end-of-run table; returns (results_dir, the runner's summary). A failure raises instead of
    exiting, and the process gets back the root logger's handlers (Hydra's job logging replaces them)
    and an unset HydraConfig (relative paths resolve from the current folder again)."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    from pipeline.app.runner import run_pipeline
    from pipeline.app.summary import print_summary

    outcome: dict[str, Any] = {}

    def job(cfg: DictConfig) -> None:
        results_dir = outcome["results_dir"] = Path(HydraConfig.get().runtime.output_dir)
        try:
            outcome["summary"] = run_pipeline(cfg, results_dir)
        except Exception as exc:  # noqa: BLE001 - raised below: through Hydra it would print a second report
            outcome["error"] = exc
            return
        print_summary(outcome["summary"], results_dir)

    HYDRA_TURN.acquire()  # another thread's job waits for this one (see HYDRA_TURN)
    GlobalHydra.instance().clear()
    try:
        # hydra.main names the job after this file and adds hydra.mode: .hydra/ reads as the CLI's would
        app = hydra_internals.main_hydra(Path(__file__).stem, config_dir)
        with kept_root_logging():
            app.run(config_name=config_name, task_function=job, overrides=[*overrides, "hydra.mode=RUN"])
    except KeyboardInterrupt:
        if "results_dir" in outcome:
            print(f"\ntune: interrupted; state saved in {outcome['results_dir']}. Run it again to resume.",
                  file=sys.stderr)
        raise
    finally:
        GlobalHydra.instance().clear()
        HydraConfig.instance().cfg = None
        HYDRA_TURN.release()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["results_dir"], outcome["summary"]


def _job(cfg: DictConfig) -> tuple[float, float] | None:
    """One run; in a multirun, returns (speedup, accuracy drop) of the shipped model for sweepers."""
    from hydra.core.hydra_config import HydraConfig

    from pipeline.app.runner import run_pipeline
    from pipeline.app.summary import print_summary

    hc = HydraConfig.get()
    results_dir = Path(hc.runtime.output_dir)
    multirun = hc.mode == RunMode.MULTIRUN
    if multirun:
        _job_status(results_dir, cfg, "running")
    try:
        summary = run_pipeline(cfg, results_dir)
    except PipelineError as exc:
        log.debug("failure", exc_info=True)
        if not multirun:
            _fail(str(exc), exc.exit_code)
        # one failed job of a sweep must not stop the others: it becomes a row of the summary
        print(f"tune: error: {exc}", file=sys.stderr)
        _job_status(results_dir, cfg, "failed", str(exc))
        return None
    except KeyboardInterrupt:
        print(f"\ntune: interrupted; state saved in {results_dir}. Re-run the same command to resume.",
              file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
    print_summary(summary, results_dir)
    if multirun:
        from pipeline.app.sweep import job_objectives

        _job_status(results_dir, cfg, "done")
        return job_objectives(summary)
    return None


_hydra_app = hydra.main(config_path="pkg://conf", config_name="tune", version_base="1.3")(_job)


def _job_status(results_dir: Path, cfg: DictConfig, status: str, reason: str | None = None) -> None:
    """results_dir/job.json of a multirun job: what the sweep summary reads besides the manifest."""

    from hydra.core.hydra_config import HydraConfig

    from pipeline.app.sweep import reproduce_command
    from pipeline.artifacts import atomic_write_json
    from pipeline.values import enum_value

    hc = OmegaConf.to_container(HydraConfig.get(), resolve=False)
    results_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(results_dir / "job.json", {
        "status": status, "reason": reason, "host": socket.gethostname(),
        "backend": enum_value(cfg.backend.name), "command": reproduce_command(hc),
    })


def _job_dirname(override_dirname: str, num: int) -> str:
    """A multirun job's folder: its overrides, or (past what file systems allow in one name) its job
    number and a hash of them (the overrides are in the job's .hydra/overrides.yaml either way)."""

    if all(len(part.encode()) <= 200 for part in str(override_dirname).split("/")):
        return str(override_dirname)
    return f"job{int(num)}_{hashlib.sha1(str(override_dirname).encode()).hexdigest()[:10]}"


# registered on import: launchers that run jobs in other processes (Ray) resolve the sweep subdir there
if not OmegaConf.has_resolver("tune_job_dir"):
    OmegaConf.register_new_resolver("tune_job_dir", _job_dirname)


def _group_listing() -> str:
    """Config groups and their options for `tune --help` (schemas, stored as base_*, are not options)."""
    import conf

    root = Path(conf.__file__).parent
    lines = []
    for group in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in ("hydra", "__pycache__")):
        options = sorted(f.stem for f in group.glob("*.yaml"))
        if options:
            lines.append(f"{group.name}: {', '.join(options)}")
    return "\n".join(lines)


def main() -> None:
    import faulthandler

    from omegaconf import OmegaConf

    if not faulthandler.is_enabled():
        try:  # a runtime that crashes the process (a segfault in a compiler) shows where
            faulthandler.enable()
        except (AttributeError, OSError, ValueError):
            pass  # a stderr without a file descriptor (tune run inside another program's capture)

    if not OmegaConf.has_resolver("tune_groups"):
        OmegaConf.register_new_resolver("tune_groups", _group_listing)
    register_configs()
    argv = open_dict_overrides(_rewrite_config_path(sys.argv[1:]))
    args = _precheck(argv)
    sys.argv = [sys.argv[0], *argv]
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    if args is not None:
        _run_checked(args)
    else:
        _hydra_app()


if __name__ == "__main__":
    main()
