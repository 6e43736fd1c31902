"""A candidate that crashes the process (a runtime's compiler segfaulting) stops costing runs: the one a
run died on, and the rest of its region, are built in a child process first, and the crashers are
failed measurements from then on."""

from __future__ import annotations

import os
import signal

from omegaconf import OmegaConf

from pipeline.backend_config import OnnxRuntimeBackendConfig
from pipeline.backends.onnxruntime import OnnxRuntimeBackend
from pipeline.graph.model import model_hash
from tasks.autotune.benchmark import PairedBenchmark
from tasks.autotune.crash_guard import CRASHED, IN_FLIGHT, CrashGuard
from tests import models


class CrashingOrt(OnnxRuntimeBackend):
    """ONNX Runtime, except that building a model whose file name says "crash" kills the process."""

    def prepare(self, model_path, *args, **kwargs):
        if "crash" in os.path.basename(str(model_path)):
            os.kill(os.getpid(), signal.SIGSEGV)
        return super().prepare(model_path, *args, **kwargs)


def _backend() -> CrashingOrt:
    return CrashingOrt(OmegaConf.structured(OnnxRuntimeBackendConfig()))


def test_the_candidate_a_run_died_on_is_probed_recorded_and_skipped(tmp_path):
    ok = models.save(models.single_matmul(), tmp_path, "ok")
    crash = models.save(models.single_matmul(seed=1), tmp_path, "crash")
    folder = tmp_path / "autotune"
    died = CrashGuard(folder)
    in_flight = died.flight("k-crash", "region 3 scheme 2", "region 3")
    in_flight.__enter__()  # the process ends inside it: never left
    assert (folder / IN_FLIGHT).exists()

    resumed = CrashGuard(folder)
    backend = _backend()
    # another region's candidates are not probed (this one would crash the test if it were built)
    assert resumed.why_failed("k-other", backend, crash, "region 5 scheme 0", "region 5") is None
    why = resumed.why_failed("k-crash", backend, crash, "region 3 scheme 2", "region 3")
    assert why is not None and "SIGSEGV" in why and "region 3 scheme 2" in why
    # the rest of region 3 is probed: a candidate that builds is measured as usual
    assert resumed.why_failed("k-ok", backend, ok, "region 3 scheme 4", "region 3") is None
    assert resumed.why_failed("k-crash-2", backend, crash, "region 3 scheme 5", "region 3") is not None

    later = CrashGuard(folder)  # the record outlives the run: no probe, no crash
    assert later.why_failed("k-crash", None, crash, "region 3 scheme 2", "region 3") == why
    assert set(later.crashed) == {"k-crash", "k-crash-2"} and (folder / CRASHED).exists()

    bench = PairedBenchmark(backend, ok, warmup_runs=1, timing_runs=4, rounds=2, guard=later)
    later.crashed[model_hash(crash)] = why
    m = bench.measure(crash)
    assert not m.ok and m.error == why
    assert bench.measure(ok).ok and not (folder / IN_FLIGHT).exists()
    bench.close()


def test_an_unreadable_record_counts_as_none(tmp_path):
    (tmp_path / CRASHED).write_text("{not json")
    (tmp_path / IN_FLIGHT).write_text("")
    guard = CrashGuard(tmp_path)
    assert guard.crashed == {} and guard.suspects == {} and guard.fragile == set()
