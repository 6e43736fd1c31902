"""The `tune` console script: a Hydra app over conf/tune.yaml.

Before handing over to Hydra, the command line is composed once with Hydra's compose API so that a
bad key, a wrong type or an unknown group option is reported on one line (exit 2) instead of
Hydra's multi-line report. `--config-path DIR` is taken relative to the current directory and
searched in addition to the packaged conf/, so a spec file kept in a user's repo can extend `tune`.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pipeline.config import register_configs
from pipeline.errors import ConfigError, PipelineError

log = logging.getLogger("tune")

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _fail(msg: str, code: int) -> None:
    print(f"tune: error: {msg}", file=sys.stderr)
    sys.exit(code)


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
        if value.startswith("pkg://"):
            _fail(f"--config-path {value}: give a folder holding your spec files", EXIT_USAGE)
        d = Path(value).expanduser().resolve()
        if not d.is_dir():
            _fail(f"--config-path {value}: no such folder ({d})", EXIT_USAGE)
        out += ["--config-dir", str(d)]
    if out.count("--config-dir") + sum(a in ("-cd",) for a in out) > 1:
        _fail("give either --config-path or --config-dir, not both", EXIT_USAGE)
    return out


# Dict-typed schema fields: Hydra's struct mode refuses new keys inside them on plain `key=value`
# overrides, so such overrides are passed as `++key=value` (add-or-override) on the user's behalf.
_DICT_FIELDS = ("input_shapes", "min_shapes", "opt_shapes", "max_shapes", "args", "input_dtypes", "batch_axes")


def _open_dict_overrides(argv: list[str]) -> list[str]:
    out = []
    for a in argv:
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


def _one_line(exc: BaseException) -> str:
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
                import dataclasses

                otype = getattr(e, "object_type", None)
                allowed = ""
                if otype is not None and dataclasses.is_dataclass(otype):
                    allowed = f"; allowed: {', '.join(f.name for f in dataclasses.fields(otype))}"
                return f"unknown config key '{e.full_key}'{allowed}"
            return f"{e.full_key}: {msg}"
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines else type(exc).__name__


def _compose(config_dir: str | None, config_name: str, overrides: list[str]) -> DictConfig:
    """Compose exactly as the app will: packaged conf/ plus an optional user folder searched first."""
    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    GlobalHydra.instance().clear()

    search_path = create_automatic_config_search_path(None, None, "pkg://conf")
    if config_dir:
        search_path.prepend("command-line", f"file://{os.path.abspath(config_dir)}",
                            anchor=SearchPathQuery(provider="schema"))
    app = Hydra.create_main_hydra2(task_name="tune", config_search_path=search_path)
    cfg = app.compose_config(config_name=config_name, overrides=overrides, run_mode=RunMode.RUN,
                             with_log_configuration=False)
    from omegaconf import open_dict

    with open_dict(cfg):
        cfg.pop("hydra", None)
    GlobalHydra.instance().clear()
    return cfg


# Hydra plugins behind optional extras: group option -> (plugin module, extra)
_PLUGINS = {"hydra/sweeper=optuna": ("hydra_plugins.hydra_optuna_sweeper", "optuna"),
            "hydra/launcher=ray": ("hydra_plugins.hydra_ray_launcher", "ray"),
            "hydra/launcher=ray_gpu": ("hydra_plugins.hydra_ray_launcher", "ray")}


def module_available(name: str) -> bool:
    """Whether `name` can be imported; False (not an exception) when a parent package is missing too."""
    import importlib.util

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


def _precheck(argv: list[str]) -> None:
    """Compose and validate the config the command line asks for; exit 2 with one line if it is bad."""
    from hydra._internal.utils import get_args_parser
    from hydra.core.global_hydra import GlobalHydra

    from pipeline.config import validate

    try:
        args = get_args_parser().parse_args(argv)
    except SystemExit:
        return  # let Hydra print its own usage error
    if args.help or args.hydra_help or args.info or args.shell_completion:
        return
    _check_plugins(args.overrides)
    if args.multirun and args.cfg:
        _fail("-m and --cfg cannot be combined: print one job's config with --cfg job and single values",
              EXIT_USAGE)
    overrides = [o for o in args.overrides if not o.startswith("hydra.") and not o.startswith("hydra/")]
    GlobalHydra.instance().clear()
    try:
        overrides = _first_of_sweeps(overrides) if args.multirun else overrides
        cfg = _compose(args.config_dir, args.config_name or "tune", overrides)
        validate(cfg)
        from pipeline.backends import check_backend

        check_backend(cfg)
    except ConfigError as exc:
        _fail(f"invalid config: {exc}", EXIT_USAGE)
    except PipelineError as exc:
        _fail(str(exc), exc.exit_code)
    except Exception as exc:  # noqa: BLE001 - Hydra/OmegaConf raise many types for bad input
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(exc, (HydraException, OmegaConfBaseException, ValueError)):
            _fail(_one_line(exc), EXIT_USAGE)
        raise
    finally:
        GlobalHydra.instance().clear()


@hydra.main(config_path="pkg://conf", config_name="tune", version_base="1.3")
def _hydra_app(cfg: DictConfig) -> tuple[float, float] | None:
    """One run; in a multirun, returns (speedup, accuracy drop) of the shipped model for sweepers."""
    from hydra.core.hydra_config import HydraConfig

    from pipeline.runner import run_pipeline
    from pipeline.summary import print_summary

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
        from pipeline.sweep import job_objectives

        _job_status(results_dir, cfg, "done")
        return job_objectives(summary)
    return None


def _job_status(results_dir: Path, cfg: DictConfig, status: str, reason: str | None = None) -> None:
    """results_dir/job.json of a multirun job: what the sweep summary reads besides the manifest."""
    import socket

    from hydra.core.hydra_config import HydraConfig

    from pipeline.artifacts import atomic_write_json
    from pipeline.config import enum_value
    from pipeline.sweep import reproduce_command

    hc = OmegaConf.to_container(HydraConfig.get(), resolve=False)
    results_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(results_dir / "job.json", {
        "status": status, "reason": reason, "host": socket.gethostname(),
        "backend": enum_value(cfg.backend.name), "command": reproduce_command(hc),
    })


def _job_dirname(override_dirname: str, num: int) -> str:
    """A multirun job's folder: its overrides, or (past what file systems allow in one name) its job
    number and a hash of them (the overrides are in the job's .hydra/overrides.yaml either way)."""
    import hashlib

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
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("tune_groups"):
        OmegaConf.register_new_resolver("tune_groups", _group_listing)
    register_configs()
    argv = _open_dict_overrides(_rewrite_config_path(sys.argv[1:]))
    _precheck(argv)
    sys.argv = [sys.argv[0], *argv]
    os.environ.setdefault("HYDRA_FULL_ERROR", "0")
    _hydra_app()


if __name__ == "__main__":
    main()
