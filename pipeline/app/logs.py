"""tune's logging: the console format (messages as they are, warnings and errors flagged so they stand out),
and a run's job logging set up and taken down again (``job_logging``, ``kept_root_logging``)."""

from __future__ import annotations

import contextlib
import logging
import logging.config
from collections.abc import Iterator
from importlib.resources import files
from pathlib import Path


class ConsoleFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.ERROR:
            return f"ERROR: {msg}"
        if record.levelno >= logging.WARNING:
            return f"WARNING: {msg}"
        return msg


@contextlib.contextmanager
def kept_root_logging() -> Iterator[None]:
    """The root logger's handlers and level as they were before the block, whatever the block configured
    (Hydra's job logging replaces them); handlers the block added are closed."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        yield
    finally:
        for h in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(h)
            h.close()
        for h in handlers:
            if h not in root.handlers:
                root.addHandler(h)
        root.setLevel(level)


@contextlib.contextmanager
def job_logging(results_dir: Path) -> Iterator[None]:
    """tune's job logging (the packaged conf/hydra/job_logging/tune.yaml: the console, and
    ``results_dir``/tune.log appended) for a run made without Hydra's job; as before afterwards."""
    from omegaconf import OmegaConf

    spec = OmegaConf.load(str(files("conf") / "hydra" / "job_logging" / "tune.yaml"))
    tree = OmegaConf.merge({"hydra": {"runtime": {"output_dir": str(results_dir)}}}, {"job_logging": spec})
    with kept_root_logging():
        logging.config.dictConfig(OmegaConf.to_container(tree.job_logging, resolve=True))
        yield
