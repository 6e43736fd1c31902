"""A candidate that crashes the process (a runtime's compiler segfaulting) stops costing runs: the one a
run died on, and the rest of its region, are built in a child process first, and the crashers are
failed measurements from then on."""

from __future__ import annotations

import json
import os
import signal

import pytest
from omegaconf import OmegaConf

from pipeline.backends.onnxruntime import OnnxRuntimeBackend
from pipeline.backends.onnxruntime.config import OnnxRuntimeBackendConfig
from pipeline.errors import StateError
from pipeline.graph.model import model_hash
from tasks.autotune.benchmark import PairedBenchmark
from tasks.autotune.crash_guard import CRASHED, IN_FLIGHT, CrashGuard, runtime_id
from tests import models


class CrashingOrt(OnnxRuntimeBackend):
    """ONNX Runtime, except that building a model whose file name says "crash" kills the process (with
    SIGSEGV, or SIGTERM where it says "term")."""

    def prepare(self, model_path, *args, **kwargs):
        name = os.path.basename(str(model_path))
        if "crash" in name:
            os.kill(os.getpid(), signal.SIGTERM if "term" in name else signal.SIGSEGV)
        return super().prepare(model_path, *args, **kwargs)


def _backend(**cfg) -> CrashingOrt:
    return CrashingOrt(OmegaConf.structured(OnnxRuntimeBackendConfig(**cfg)))


def _died_on(folder, backend, key, what, family, **marker):
    """The marker a run leaves when the process ends while measuring ``key`` (what ``flight`` wrote)."""
    with CrashGuard(folder, backend).flight(key, what, family):
        doc = json.loads((folder / IN_FLIGHT).read_text())
    (folder / IN_FLIGHT).write_text(json.dumps({**doc, **marker}))  # the process ended inside it


def test_the_candidate_a_run_died_on_is_probed_recorded_and_skipped(tmp_path):
    ok = models.save(models.single_matmul(), tmp_path, "ok")
    crash = models.save(models.single_matmul(seed=1), tmp_path, "crash")
    folder, backend = tmp_path / "autotune", _backend()
    _died_on(folder, backend, "k-crash", "region 3 scheme 2", "region 3")
    assert (folder / IN_FLIGHT).exists()

    resumed = CrashGuard(folder, backend)
    # no crash yet in region 5, nor in region 3 before the suspect: not probed (this one would crash)
    assert resumed.why_failed("k-other", crash, "region 5 scheme 0", "region 5") is None
    why = resumed.why_failed("k-crash", crash, "region 3 scheme 2", "region 3")
    assert why is not None and "SIGSEGV" in why and "region 3 scheme 2" in why
    # the rest of region 3 is probed: a candidate that builds is measured as usual
    assert resumed.why_failed("k-ok", ok, "region 3 scheme 4", "region 3") is None
    assert resumed.why_failed("k-crash-2", crash, "region 3 scheme 5", "region 3") is not None

    later = CrashGuard(folder, backend)  # the record outlives the run: no probe, no crash
    assert later.why_failed("k-crash", crash, "region 3 scheme 2", "region 3") == why
    assert set(later.crashed) == {"k-crash", "k-crash-2"} and (folder / CRASHED).exists()
    # another runtime (here: other threads) starts afresh
    assert CrashGuard(folder, _backend(intra_op_threads=1)).crashed == {}

    bench = PairedBenchmark(backend, ok, warmup_runs=1, timing_runs=4, rounds=2, guard=later)
    later.crashed[model_hash(crash)] = why
    m = bench.measure(crash)
    assert not m.ok and m.error == why
    assert bench.measure(ok).ok and not (folder / IN_FLIGHT).exists()
    bench.close()


def test_a_kill_is_not_a_crash_and_a_crash_only_in_the_full_run_is_caught_the_second_time(tmp_path):
    term = models.save(models.single_matmul(seed=2), tmp_path, "crash_term")
    ok = models.save(models.single_matmul(), tmp_path, "ok")
    folder, backend = tmp_path / "autotune", _backend()
    _died_on(folder, backend, "k-term", "region 1 scheme 0", "region 1")
    guard = CrashGuard(folder, backend)
    assert guard.why_failed("k-term", term, "region 1 scheme 0", "region 1") is None  # SIGTERM: no verdict
    assert guard.crashed == {} and "region 1" not in guard.fragile

    # a suspect whose probe passes is measured, and flagged so: ending the run again records it
    _died_on(folder, backend, "k-ok", "region 2 scheme 1", "region 2")
    guard = CrashGuard(folder, backend)
    assert guard.why_failed("k-ok", ok, "region 2 scheme 1", "region 2") is None and "k-ok" in guard.probed
    _died_on(folder, backend, "k-ok", "region 2 scheme 1", "region 2", probed=True)
    again = CrashGuard(folder, backend)
    assert "twice" in again.why_failed("k-ok", ok, "region 2 scheme 1", "region 2")


def test_a_corrupt_record_is_a_one_line_error_and_an_unpicklable_backend_is_measured_unprobed(tmp_path):
    backend = _backend()
    wrong_table = json.dumps({"runtime": runtime_id(backend), "crashed": []})
    for name, text in ((CRASHED, "{not json"), (IN_FLIGHT, ""), (CRASHED, wrong_table)):
        (tmp_path / name).write_text(text)
        with pytest.raises(StateError, match=rf"crash record .*{name} is corrupt .*; delete it"):
            CrashGuard(tmp_path, backend)
        (tmp_path / name).unlink()
    guard = CrashGuard(tmp_path, backend)
    assert guard.crashed == {} and guard.suspects == {} and guard.fragile == set()
    guard.suspects["k"] = "region 0 scheme 0"
    backend.unpicklable = lambda: None  # as TensorRT's module and timing cache
    assert guard.why_failed("k", tmp_path / "crash.onnx", "region 0 scheme 0", "region 0") is None
