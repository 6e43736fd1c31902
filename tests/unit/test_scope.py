"""pipeline.app.scope: one run's process-wide settings (bars, ORT threads, the weights folder, the objects
tune() was given) hold for that run only; the next run, and the caller, see what was there before."""

from __future__ import annotations

import pytest

from pipeline import progress
from pipeline.app.scope import run_scope
from pipeline.backends.onnxruntime import session as ort
from pipeline.data import live
from pipeline.graph import weights


def _settings() -> tuple[int, bool, frozenset[str], object]:
    return ort.configured_threads(), progress.is_enabled(), live.held_keys(), weights.current_root()


def test_two_runs_in_one_process_do_not_see_each_others_settings():
    before = _settings()
    seen = []
    for threads, bars, key in ((1, False, "data:a"), (3, True, "data:b")):
        with run_scope(live={key: [key]}), run_scope(threads=threads, progress=bars):
            folder = weights.weights_root()
            assert live.in_memory_data(key[5:], key[5:]) == [key]
            seen.append((ort.configured_threads(), progress.is_enabled(), live.held_keys(), folder))
        assert _settings() == before and not folder.exists()
    assert seen[0][:3] == (1, False, {"data:a"}) and seen[1][:3] == (3, True, {"data:b"})
    assert seen[0][3] != seen[1][3]


def test_a_failing_run_restores_every_setting_and_none_keeps_the_enclosing_value():
    before = _settings()
    with pytest.raises(RuntimeError), run_scope(threads=2, progress=False, live={"data:x": []}):
        with run_scope():  # None: the enclosing run's values
            assert (ort.configured_threads(), progress.is_enabled(), live.held_keys()) == (2, False, {"data:x"})
        raise RuntimeError("stage failed")
    assert _settings() == before


def test_a_run_keeps_the_callers_weights_folder_and_an_outer_calls_objects():
    caller = weights.weights_root()
    try:
        with live.held({"data:k": "outer"}):
            with run_scope(live={"data:k": "inner"}):
                assert weights.current_root() != caller and live.in_memory_data("k", "k") == "inner"
                weights.weights_root()
                weights.release()  # the runner's per-stage release removes the run's folder only
            assert weights.current_root() == caller and caller.is_dir()
            assert live.in_memory_data("k", "k") == "outer"
    finally:
        weights.release()


def test_the_synthetic_data_warning_is_given_once_per_run_not_once_per_process(caplog):
    from omegaconf import OmegaConf

    from pipeline.data.adapters import DataProvider
    from pipeline.graph.model import InputSpec

    cfg = OmegaConf.create({"data": {"source": "none", "num_samples": 4}, "seed": 0})
    provider = DataProvider(cfg, [InputSpec("x", [2, 3], "float32")])
    warned = []
    for _ in range(2):  # two tune() calls in one process
        caplog.clear()
        with run_scope(progress=False), run_scope(threads=1):  # auto's inner scopes share the outer one's
            for _ in range(3):
                list(provider.batches("calibration", 1))
        warned.append(sum("SYNTHETIC" in r.message for r in caplog.records))
    assert warned == [1, 1]


def test_two_runs_in_two_threads_at_once_each_see_their_own_settings():
    """The run-wide settings are ContextVars: two runs whose scopes overlap in time, in two threads, each
    read their own threads, bars, objects and weights folder, and the worker threads they hand their
    context to (quantize's model loader) read them too."""
    import contextvars
    import threading
    from concurrent.futures import ThreadPoolExecutor

    both_inside = threading.Barrier(2, timeout=30)
    seen: dict[int, tuple] = {}

    def run(threads: int, bars: bool) -> None:
        with run_scope(live={f"data:{threads}": [threads]}), run_scope(threads=threads, progress=bars):
            weights.weights_root()
            both_inside.wait()  # the other run's scope is open now too
            with ThreadPoolExecutor(1) as pool:
                in_worker = pool.submit(contextvars.copy_context().run, _settings).result()
            seen[threads] = (_settings(), in_worker)
            both_inside.wait()

    workers = [threading.Thread(target=run, args=args) for args in ((1, False), (3, True))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for threads, bars in ((1, False), (3, True)):
        own, in_worker = seen[threads]
        assert own[:3] == (threads, bars, {f"data:{threads}"}) and own == in_worker
    assert seen[1][0][3] != seen[3][0][3]  # a weights folder each


def test_two_tune_calls_in_two_threads_each_log_and_use_their_own_settings(tmp_path, monkeypatch):
    """pipeline.api.tune from two threads at once, with other ORT threads and progress settings: each
    run's stages see its own settings, and each results_dir's tune.log holds its own run only."""
    import threading

    from pipeline import api
    from pipeline.app import runner
    from tests import models

    model = models.save(models.conv_chain(), tmp_path, "m")
    seen: dict[str, list[tuple[int, bool]]] = {"one": [], "two": []}
    real = runner._run_one

    def run_one(stage, ctx, inputs, *rest):
        seen[ctx.results_dir.name].append((ort.configured_threads(), progress.is_enabled()))
        return real(stage, ctx, inputs, *rest)

    monkeypatch.setattr(runner, "_run_one", run_one)
    errors = []

    def call(name: str, threads: int, bars: bool) -> None:
        try:
            api.tune([f"results_dir={tmp_path / name}", "backend=onnxruntime", f"backend.intra_op_threads={threads}",
                      f"progress={str(bars).lower()}", "stages=[export,quantize]", "data=synthetic",
                      "data.num_samples=16", "quantize.calibration.batches=2", "quantize.algorithm=minmax"],
                     model=str(model))
        except Exception as exc:  # noqa: BLE001 - reported below, from the main thread
            errors.append(f"{name}: {exc!r}")

    threads = [threading.Thread(target=call, args=a) for a in (("one", 1, False), ("two", 2, True))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert seen == {"one": [(1, False)] * 2, "two": [(2, True)] * 2}
    for name, other in (("one", "two"), ("two", "one")):
        text = (tmp_path / name / "tune.log").read_text()
        assert "quantize: done" in text and str(tmp_path / other) not in text, text


def test_a_stage_hashes_each_input_once_for_its_fingerprint_and_its_manifest_entry(tmp_path, monkeypatch):
    """A model's data can be gigabytes: the run hashes export/model.onnx when export describes it and once
    more when quantize starts (its fingerprint), and quantize's manifest entry records that same hash."""
    import json
    from pathlib import Path

    from pipeline import api, artifacts
    from pipeline.app import runner
    from tests import models

    model = models.save(models.conv_chain(), tmp_path, "m")
    hashed: list[str] = []
    real = artifacts.sha256_file

    def counted(path, *a, **k):
        hashed.append(Path(path).name)
        return real(path, *a, **k)

    monkeypatch.setattr(artifacts, "sha256_file", counted)
    monkeypatch.setattr(runner, "sha256_file", counted)
    api.tune([f"results_dir={tmp_path / 'run'}", "backend=onnxruntime", "stages=[export,quantize]", "data=synthetic",
              "data.num_samples=16", "quantize.calibration.batches=2", "quantize.algorithm=minmax", "progress=false"],
             model=str(model))
    assert hashed.count("model.onnx") == 2
    entry = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]
    assert entry["quantize"]["inputs"]["export/model.onnx"]["sha256"] == \
        entry["export"]["outputs"]["export/model.onnx"]["sha256"] == real(tmp_path / "run" / "export" / "model.onnx")
