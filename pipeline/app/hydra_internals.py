"""Every use of Hydra's private API (``hydra._internal``), in one place.

`tune` composes its config before Hydra runs (to print one line for a bad key instead of Hydra's
traceback) and runs a plain job without the compose hydra.main makes only to learn the run mode; both
need Hydra's own search path, app object and argument parser, which Hydra does not export.
``PRIVATE`` lists what is used; tests/unit/test_hydra_internals.py fails naming whatever a Hydra
upgrade moved.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# (module, attribute) of every private name used below, with the methods used on it
PRIVATE = (("hydra._internal.hydra", "Hydra", ("create_main_hydra2", "compose_config", "run")),
           ("hydra._internal.utils", "create_automatic_config_search_path", ()),
           ("hydra._internal.utils", "get_args_parser", ()))


def missing() -> list[str]:
    """What of ``PRIVATE`` this Hydra lacks ([] when everything is where it was)."""
    out = []
    for module, name, methods in PRIVATE:
        try:
            obj = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            out.append(f"{module}.{name}")
            continue
        out += [f"{module}.{name}.{m}" for m in methods if not hasattr(obj, m)]
    return out


def search_path(config_dir: str | None) -> Any:
    """The packaged conf/ plus an optional user folder searched first, as `tune --config-dir` has it."""
    from hydra._internal.utils import create_automatic_config_search_path
    from hydra.core.config_search_path import SearchPathQuery

    path = create_automatic_config_search_path(None, None, "pkg://conf")
    if config_dir:
        path.prepend("command-line", f"file://{os.path.abspath(config_dir)}", anchor=SearchPathQuery(provider="schema"))
    return path


def main_hydra(task_name: str, config_dir: str | None) -> Any:
    """Hydra's app object over ``search_path(config_dir)`` (``compose_config``, ``run``)."""
    from hydra._internal.hydra import Hydra

    return Hydra.create_main_hydra2(task_name=task_name, config_search_path=search_path(config_dir))


def args_parser() -> Any:
    """Hydra's own command-line parser (the one hydra.main uses)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser()
