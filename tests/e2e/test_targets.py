"""Deployments made for the CPU kinds they will run on: a target's numerics chosen for its weakest kind,
every kind's verdict in the manifest, and one warning line where a deployment lands on a kind it misses
its budget on (the manifest's kind edited here: tests/e2e/test_auto.py chooses again on a pinned kind)."""

from __future__ import annotations

import json
import logging

import numpy as np

from pipeline.api import host_warning, tune
from pipeline.quant.cpu import KINDS, PIN_ENV, cpu_facts
from tests import models

# a kind's flags as QDQ_TUNE_CPU_FLAGS spells them
FLAGS = {"avx2": "avx2", "amx": "avx2 avx512f avx512bw avx512_vnni amx_int8"}


def _args(tmp_path, *extra):
    return ["stages=[export,quantize]", "backend=onnxruntime", f"results_dir={tmp_path / 'r'}", "progress=false",
            *extra]


def test_a_target_with_a_saturating_kind_ships_weights_exact_on_every_kind(tmp_path):
    x = np.random.default_rng(0).standard_normal((64, 3, 16, 16)).astype(np.float32)
    result = tune(_args(tmp_path, "target.cpus=[avx2,avx512,avx512_vnni,amx]"), model=models.conv_chain(), data=x)
    quantize = result.metrics["quantize"]
    assert quantize.weight_range != "full", quantize.headline  # 7-bit or uint8: no pair sum leaves int16
    checked = quantize.checked_on
    assert set(checked["target"]) >= {"avx2", "avx512", "avx512_vnni", "amx"}
    kinds = {k["kind"]: k for k in checked["kinds"]}
    assert set(kinds) == set(KINDS) and all(k["verdict"]["ok"] for k in kinds.values())
    assert kinds[cpu_facts().kind]["how"] == "run on this host"
    # no saturating kind computes anything the Q/DQ math does not: its twin has nothing to saturate
    assert all(k["how"].startswith("Q/DQ math") for name, k in kinds.items()
               if KINDS[name].saturates and name != cpu_facts().kind)


def test_loading_on_a_kind_where_the_deployment_misses_its_budget_says_so_in_one_line(tmp_path, monkeypatch, caplog):
    x = np.random.default_rng(0).standard_normal((64, 3, 16, 16)).astype(np.float32)
    result = tune(_args(tmp_path), model=models.conv_chain(), data=x)
    rd = tmp_path / "r"
    assert host_warning(rd) is None  # the host it was checked on
    here = cpu_facts().kind
    other = "avx2" if here != "avx2" else "amx"
    manifest = json.loads((rd / "manifest.json").read_text())
    record = manifest["stages"]["quantize"]["metrics"]["checked_on"]
    entry = next(k for k in record["kinds"] if k["kind"] == other)
    entry["verdict"].update(ok=False, what="top-1 drop 40.00 points")
    (rd / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setenv(PIN_ENV, FLAGS[other])
    with caplog.at_level(logging.WARNING, logger="tune.deploy"):
        result.load()
    lines = [r.getMessage() for r in caplog.records if r.name == "tune.deploy"]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert f"MISSES its accuracy budget on this {other} CPU" in lines[0] and "top-1 drop 40.00 points" in lines[0]
    # one runtime was tuned: nothing to choose among, the fix is tuning for this kind
    assert f"tune again with target.cpus=[{other}]" in lines[0] and "tune-rechoose" not in lines[0]
    entry["verdict"] = None  # a kind no verdict was reached for
    entry["how"] = "accuracy budget off"
    (rd / "manifest.json").write_text(json.dumps(manifest))
    assert "accuracy here is unknown" in host_warning(rd)
