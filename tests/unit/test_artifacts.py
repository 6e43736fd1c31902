from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pipeline.artifacts import Manifest, ResultsDirLock, atomic_write_json, atomic_write_text, read_json
from pipeline.errors import ResultsDirLocked, StateError


def test_atomic_write_leaves_no_temp_files(tmp_path):
    atomic_write_text(tmp_path / "a.txt", "one")
    atomic_write_json(tmp_path / "b.json", {"x": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.json"]
    assert (tmp_path / "a.txt").stat().st_mode & 0o044  # readable like any other file, not 0600
    assert read_json(tmp_path / "b.json") == {"x": 1}


def test_corrupt_json_is_a_state_error(tmp_path):
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(StateError, match="corrupt"):
        Manifest(tmp_path)


def test_lock_excludes_live_holder_and_takes_over_stale(tmp_path):
    with ResultsDirLock(tmp_path):
        # a live process (this one) holds it: a second owner is refused
        holder = json.loads((tmp_path / ".lock").read_text())
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            holder["pid"] = child.pid
            (tmp_path / ".lock").write_text(json.dumps(holder))
            with pytest.raises(ResultsDirLocked, match=str(child.pid)):
                ResultsDirLock(tmp_path).acquire()
        finally:
            child.kill()
            child.wait()
        # the holder is gone now: its lock is stale and is taken over
        lock = ResultsDirLock(tmp_path).acquire()
        assert lock.took_over_from and lock.took_over_from["pid"] == child.pid
        lock.release()
    assert not (tmp_path / ".lock").exists()


def test_manifest_artifact_lookup(tmp_path):
    m = Manifest(tmp_path)
    f = tmp_path / "export" / "model.onnx"
    f.parent.mkdir()
    f.write_bytes(b"abc")
    m.update("export", status="done", outputs={"export/model.onnx": m.describe_file(f)})
    again = Manifest(tmp_path)
    assert again.artifact("export/model.onnx") == f
    assert again.artifact("quantize/quantized_model.onnx") is None
    os.remove(f)
    assert again.artifact("export/model.onnx") is None
