from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import models

# quantize without its own searches (range choice, float-exact transforms, bias correction), for tests
# whose subject is another stage: it costs a fraction of the defaults and places the same Q/DQ nodes
PLAIN_QUANTIZE = ["quantize.algorithm=minmax", "quantize.equalization=false", "quantize.smoothing=false",
                  "quantize.bias_correction=false"]


def pytest_collection_modifyitems(config, items):
    """Tests marked ``extra`` run when selected by ``-m extra`` (the second half of .ci/run): under the
    README's plain command they skip even where their extra is installed, since the emulated-CPU ones
    alone take minutes and the default suite must stay under ten."""
    if "extra" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="marked extra: run with `python -m pytest -q -m extra` (bash .ci/run does)")
    for item in items:
        if "extra" in item.keywords:
            item.add_marker(skip)


def record_runtime_search(monkeypatch, kill_at: int | None = None) -> list[str]:
    """The names of the candidates the runtime search measures from now on (a fresh list); with
    ``kill_at``, it raises KeyboardInterrupt (a kill) when it starts measuring that candidate (1-based)."""
    from tasks.autotune.runtime import search as rs

    measured: list[str] = []
    real_step = getattr(rs.RuntimeSearch._step, "__wrapped__", rs.RuntimeSearch._step)

    def step(self, cand, current):
        if kill_at is not None and len(measured) == kill_at - 1:
            raise KeyboardInterrupt
        measured.append(cand.name)
        return real_step(self, cand, current)

    step.__wrapped__ = real_step
    monkeypatch.setattr(rs.RuntimeSearch, "_step", step)
    return measured


def tune_command() -> list[str]:
    exe = shutil.which("tune", path=str(Path(sys.executable).parent)) or shutil.which("tune")
    return [exe] if exe else [sys.executable, "-m", "pipeline.app.cli"]


def run_tune(args: list[str], cwd: Path, timeout: float = 900, check: bool = False,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([*tune_command(), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"tune {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def tune_in_process(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """`tune ARGS --cfg job` as the command line runs it (main() with these argv, in ``cwd``) without a
    new interpreter: the config is composed, validated and printed by the same code, in a fraction of
    a subprocess's start-up. For commands that stop before a job runs (--cfg job, errors)."""
    import contextlib
    import io

    from pipeline.app import cli

    out, err, code = io.StringIO(), io.StringIO(), 0
    argv = sys.argv
    sys.argv = ["tune", *args]
    try:
        with contextlib.chdir(cwd), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        sys.argv = argv
    return subprocess.CompletedProcess(["tune", *args], code, out.getvalue(), err.getvalue())


def compose(overrides: list[str] | None = None, config_dir: str | None = None, config_name: str = "tune"):
    from pipeline.app.cli import compose
    from pipeline.config import register_configs

    register_configs()
    return compose(config_dir, config_name, overrides or [])


@pytest.fixture(scope="session")
def digits_results(tmp_path_factory) -> Path:
    """A results_dir holding the default model exported once for the whole session."""
    root = tmp_path_factory.mktemp("digits")
    run_tune(["stages=[export]", f"results_dir={root / 'run'}"], cwd=root, check=True)
    return root / "run"


@pytest.fixture
def tiny_models(tmp_path) -> dict[str, Path]:
    return {
        "conv_chain": models.save(models.conv_chain(), tmp_path, "conv_chain"),
        "residual_block": models.save(models.residual_block(), tmp_path, "residual_block"),
        "attention_block": models.save(models.attention_block(), tmp_path, "attention_block"),
    }
