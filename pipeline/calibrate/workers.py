"""Calibration's per-tensor searches in worker processes.

The error-minimizing threshold searches of a large model (entropy's KL scan and mse's grid, for each of
hundreds of tensors) are numpy work on small arrays: bound by the GIL in one process, however many cores
the machine has. ``map_in_workers`` runs them in fresh Python processes (``python -m
pipeline.calibrate.workers``, items and results pickled through pipes) where there are enough to pay for
their start, in order and with the same results as one process. Fresh processes, not multiprocessing's:
a fork would copy a process running ONNX Runtime's threads, and spawn or forkserver run the caller's main
script again in every worker (a user's script that calls ``tune`` at top level would tune again there).
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

log = logging.getLogger("tune.quantize")

T = TypeVar("T")
R = TypeVar("R")

# items from which workers are started: below, their start costs more than the searches take
PARALLEL_FROM = 64


def map_in_workers(fn: Callable[..., R], items: Sequence[T], *args: Any, workers: int) -> list[R]:
    """``[fn(item, *args) for item in items]``, split over ``workers`` processes where there are two or more
    and at least PARALLEL_FROM items (``fn`` and ``args`` must pickle: a module-level function); in this
    process otherwise, or where a worker cannot start here (one line says so). An exception ``fn`` raises
    reaches the caller as it would in this process."""
    if workers < 2 or len(items) < PARALLEL_FROM:
        return [fn(item, *args) for item in items]
    size = -(-len(items) // workers)
    parts = [list(items[i:i + size]) for i in range(0, len(items), size)]
    root = str(Path(__file__).resolve().parents[2])  # where this package is imported from
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    try:
        procs = [subprocess.Popen([sys.executable, "-m", "pipeline.calibrate.workers"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, env=env) for _ in parts]
    except OSError as exc:
        log.info("calibration: searching in one process (a worker could not start: %s)", exc)
        return [fn(item, *args) for item in items]
    try:
        for proc, part in zip(procs, parts, strict=True):  # each worker reads all of its part before it answers
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps((fn, part, args), protocol=pickle.HIGHEST_PROTOCOL))
            proc.stdin.close()
        answers = []
        for proc in procs:
            assert proc.stdout is not None
            answers.append(proc.stdout.read())
            proc.wait()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    out: list[R] = []
    for proc, answer in zip(procs, answers, strict=True):
        if proc.returncode != 0 or not answer:
            raise RuntimeError(f"a calibration worker ended with exit code {proc.returncode} and no answer")
        ok, value = pickle.loads(answer)
        if not ok:
            raise value
        out += value
    return out


def _serve() -> None:
    """A worker: (fn, items, args) pickled on stdin; (True, results) or (False, the exception) on stdout."""
    fn, items, args = pickle.load(sys.stdin.buffer)
    try:
        answer = (True, [fn(item, *args) for item in items])
    except Exception as exc:  # noqa: BLE001 - handed to the caller, which raises it
        answer = (False, exc)
    sys.stdout.buffer.write(pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    _serve()
