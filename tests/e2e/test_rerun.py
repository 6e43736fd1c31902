"""Re-running a spec after the model changed: each stage that keeps state starts afresh, setting the
old state aside; an unchanged spec skips every stage; a state file the user named stays a refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests import models
from tests.helpers import PLAIN_QUANTIZE, run_tune

QUICK = ["autotune.preset=quick", "backend.warmup_runs=1", "autotune.warmup_runs=1", "autotune.timing_runs=6",
         "quantize.calibration.batches=2", "data.num_samples=16", "progress=false", *PLAIN_QUANTIZE]


def _args(model: Path, rd: Path, mode: str, extra: list[str] | None = None) -> list[str]:
    return ["stages=[export,quantize,autotune]", "model=onnx", f"model.onnx_path={model}", "data=synthetic",
            f"results_dir={rd}", f"autotune.mode={mode}", *QUICK, *(extra or [])]


def _statuses(rd: Path) -> dict[str, str]:
    return {k: v["status"] for k, v in json.loads((rd / "manifest.json").read_text())["stages"].items()}


STATE = {"region": "autotuner_state.yaml", "subgraph": "autotune_cache.json"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["region", "subgraph"])
def test_a_changed_model_re_tunes_and_sets_the_old_state_aside(tmp_path, mode):
    model = tmp_path / "m.onnx"
    models.save(models.conv_chain(seed=0), tmp_path, "m")
    rd = tmp_path / "r"
    run_tune(_args(model, rd, mode), cwd=tmp_path, check=True)
    state = rd / "autotune" / STATE[mode]
    old = state.read_bytes()

    models.save(models.conv_chain(seed=1), tmp_path, "m")  # retrained weights, same file
    proc = run_tune(_args(model, rd, mode), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    notes = [ln for ln in proc.stderr.splitlines() if "starting afresh" in ln and STATE[mode] in ln]
    assert len(notes) == 1 and "belongs to a different model" in notes[0], proc.stderr
    assert "moved to autotune/stale/" in notes[0]
    stale = list((rd / "autotune" / "stale").glob(f"*/{STATE[mode]}"))
    assert len(stale) == 1 and stale[0].read_bytes() == old  # nothing lost
    assert state.read_bytes() != old
    assert set(_statuses(rd).values()) == {"done"}

    third = run_tune(_args(model, rd, mode), cwd=tmp_path, check=True)
    assert third.stderr.count("up to date, skipped") == 3, third.stderr


def test_a_state_file_the_user_named_for_another_model_is_refused(tmp_path):
    from tasks.autotune.region.autotuner_state import STATE_VERSION

    model = models.save(models.conv_chain(), tmp_path, "m")
    named = tmp_path / "mine.yaml"
    named.write_text(yaml.safe_dump({"version": STATE_VERSION, "model_sha256": "0" * 64, "patterns": {}}))
    proc = run_tune(_args(model, tmp_path / "r", "region", [f"autotune.state_file={named}"]), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "mine.yaml belongs to a different model" in last and "Traceback" not in proc.stderr
    assert named.exists() and not (tmp_path / "r" / "autotune" / "stale").exists()


def test_a_model_whose_budget_leaves_every_node_float_ships_the_float_model(tmp_path):
    """One MatMul whose int8 output misses a tight budget: recovery leaves it float, the run says why
    in one line and exits 0 (never "the rules match no quantizable op")."""
    model = models.save(models.single_matmul(), tmp_path, "mm")
    rd = tmp_path / "r"
    proc = run_tune(_args(model, rd, "region", ["accuracy.min_snr_db=60"]), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "match no quantizable op" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "every quantizable node left float" in ln]
    assert lines and "min 60 dB" in lines[0], proc.stderr
    metrics = json.loads((rd / "manifest.json").read_text())["stages"]["autotune"]["metrics"]
    assert metrics["shipped"] == "float" and "left every quantizable node float" in metrics["shipped_reason"]


@pytest.mark.slow
def test_autotune_asked_for_fp8_after_an_int8_calibration_is_one_line_naming_the_rerun(tmp_path):
    models.save(models.conv_chain(seed=0), tmp_path, "m")
    rd = tmp_path / "r"
    base = ["model=onnx", f"model.onnx_path={tmp_path / 'm.onnx'}", "data=synthetic", f"results_dir={rd}",
            *[o for o in QUICK if not o.startswith("quantize.algorithm=")], "quantize.algorithm=mse"]
    run_tune([*base, "stages=[export,quantize]"], cwd=tmp_path, check=True)
    # quantize searched int8 and uint8 ranges only: autotune alone cannot tune fp8 on them
    proc = run_tune([*base, "stages=[autotune]", "autotune.quant_type=fp8"], cwd=tmp_path)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "has no fp8_e4m3fn ranges" in proc.stderr and "stages=[quantize,autotune]" in proc.stderr
    assert not (rd / "autotune" / "optimized_final.onnx").exists()
