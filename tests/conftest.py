from __future__ import annotations

import os
from pathlib import Path

import pytest

# pytest-xdist's workers share the machine's cores: torch's OpenMP pool in each worker and in every `tune`
# it starts gets one thread (two workers each spinning two made the digits training 3x slower)
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

from tests import models  # noqa: E402 - after the thread setting, which torch reads when it loads
from tests.helpers import run_tune  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``extra`` run when selected by ``-m extra`` (the second half of .ci/run): under the
    README's plain command they skip even where their extra is installed, since the emulated-CPU ones
    alone take minutes and the default suite must stay under ten.

    Tests marked ``slow`` are handed out first: pytest-xdist deals tests in collection order, and a long
    test dealt last leaves one worker running it alone while the other idles (a stable sort: each group
    keeps its order, the same on every worker)."""
    items.sort(key=lambda item: "slow" not in item.keywords)
    if "extra" in (config.getoption("markexpr") or ""):
        return
    for item in items:
        marker = item.get_closest_marker("extra")
        if marker is not None:
            need = marker.args[0] if marker.args else "an optional extra"
            item.add_marker(pytest.mark.skip(
                reason=f"needs {need}; then run `python -m pytest -q -m extra` (bash .ci/run does)"))



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


# the residual-block models the end-to-end tests tune, by role; each file is written once per session
RESIDUAL_MODELS = {
    "tiny": {"blocks": 3, "channels": 16},  # region mode's kill/resume, multirun, exactness
    "sweep": {"blocks": 2, "channels": 16},  # a multirun of three jobs
    "blocks": {"blocks": 3, "channels": 32, "size": 24},  # subgraph mode: groups worth profiling
}


@pytest.fixture(scope="session")
def residual_models(tmp_path_factory) -> dict[str, Path]:
    """Residual-block ONNX files shared by every test that tunes one (read-only: copy before editing)."""
    root = tmp_path_factory.mktemp("residual")
    return {k: models.save(models.residual_block(**kw), root, k) for k, kw in RESIDUAL_MODELS.items()}

