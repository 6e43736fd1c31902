"""Atomic file writes, content hashes, the results_dir lock and the manifest.

Every file qdq-tune writes goes through ``atomic_write_*`` or ``atomic_output``: the data lands in a
temporary file in the destination folder, is fsynced and renamed over the target, so a killed run
leaves either the old file or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from pipeline.errors import InputError, ResultsDirLocked, StateError

T = TypeVar("T")


def user_path(value: str | os.PathLike) -> Path:
    """A path from the config, relative paths taken from the folder tune was started in (Hydra may
    have changed into its run folder since)."""
    from hydra.utils import to_absolute_path

    return Path(to_absolute_path(str(value)))


def user_cache() -> Path:
    """The user's cache folder of this tool ($XDG_CACHE_HOME/qdq-tune, else ~/.cache/qdq-tune): data
    and trained weights any run may reuse, each file named by what made it."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qdq-tune"


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, suffix: str | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on success fsync it and rename it onto ``path``.

    For writers that insist on a file name (torch.onnx.export, ORT's optimized-model output).
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=suffix or target.suffix, dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as fh:
            os.fsync(fh.fileno())
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; results are ordinary files
        os.replace(tmp_path, target)
        _fsync_dir(target.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_output(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def read_settings(path: str | os.PathLike, what: str, from_dict: Callable[[Any], T]) -> T:
    """Runtime settings the pipeline stored as JSON (``what``: "ORT session settings", ...), read through
    their record's ``from_dict``; a StateError names a file that is not one."""
    doc = read_json(path, what)
    try:
        return from_dict(doc)
    except (ValueError, TypeError, AttributeError) as exc:
        raise StateError(f"{what} {path} are corrupt ({exc}); re-run the autotune stage") from None


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> Path:
    """``obj`` as JSON text (numpy values and paths converted), one trailing newline."""
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False, default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    import numpy as np

    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    """Load JSON, turning corruption into a StateError that names the file and the fix."""
    p = Path(path)
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise StateError(
            f"{what} {p} is corrupt ({exc.msg} at line {exc.lineno}); delete it to start that part afresh"
        ) from None
    except ValueError as exc:  # not UTF-8 text at all
        raise StateError(f"{what} {p} is corrupt ({type(exc).__name__}); delete it to start that part afresh") \
            from None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    """sha256 of a file's bytes; for an ONNX file that keeps tensors in external data files, of the
    .onnx and of every data file it names (a changed .data file is a changed model)."""
    h = hashlib.sha256()
    onnx_file = str(path).lower().endswith(".onnx")
    tail, mentions = b"", False
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
            if onnx_file and not mentions:
                # external data entries are key/value strings "location" -> file: only a file that says
                # "location" somewhere is parsed for them
                # the chunk itself, and the seam with the previous one (no copy of the whole chunk)
                mentions = b"location" in block or b"location" in tail + block[:16]
                tail = block[-16:]
    digest = h.hexdigest()
    if not mentions:
        return digest
    files = external_data_files(path)
    if not files:
        return digest
    h = hashlib.sha256(digest.encode())
    for f in files:
        h.update(f.name.encode())
        h.update(sha256_file(f, chunk).encode())
    return h.hexdigest()


def external_data_files(path: str | os.PathLike) -> list[Path]:
    """The external data files an ONNX file's tensors name (main graph and subgraphs), sorted."""
    import onnx

    def tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
        yield from graph.initializer
        for node in graph.node:
            for a in node.attribute:
                if a.HasField("t"):
                    yield a.t
                yield from a.tensors
                for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                    yield from tensors(g)

    model = onnx.load(str(path), load_external_data=False)
    found = {entry.value for t in tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL
             for entry in t.external_data if entry.key == "location"}
    return sorted(Path(path).parent / f for f in found)


def set_aside(path: str | os.PathLike, companions: Iterable[str | os.PathLike] = ()) -> Path:
    """Move a stale state or cache file (and its existing ``companions``) into
    ``<folder>/stale/<12 hex of its content hash>/`` instead of deleting or overwriting it; returns
    that folder. Renames within one file system are atomic."""
    path = Path(path)
    dest = path.parent / "stale" / sha256_file(path)[:12]
    dest.mkdir(parents=True, exist_ok=True)
    for p in (path, *map(Path, companions)):
        if p.exists():
            os.replace(p, dest / p.name)
    _fsync_dir(path.parent)
    return dest


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fingerprint(obj: Any) -> str:
    """Stable hash of a JSON-able object (a config section, a list of input hashes)."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, default=_json_default).encode())[:16]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ResultsDirLock:
    """Exclusive ownership of a results_dir by one live process.

    The lock file holds host, pid and start time. A lock left by a dead process on this host is
    stale and is taken over with a notice; a lock held by a live process is an error.
    """

    def __init__(self, results_dir: Path):
        self.path = Path(results_dir) / ".lock"
        self.took_over_from: dict | None = None
        self._held = False

    def acquire(self) -> ResultsDirLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        me = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read_holder()
                if holder is not None and not self._is_stale(holder):
                    raise ResultsDirLocked(
                        f"results_dir {self.path.parent} is in use by pid {holder.get('pid')} on "
                        f"{holder.get('host')}; wait for it to finish or choose another results_dir=..."
                    ) from None
                self.took_over_from = holder or {}
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            with os.fdopen(fd, "w") as fh:
                json.dump(me, fh)
                fh.flush()
                os.fsync(fh.fileno())
            self._held = True
            return self
        raise ResultsDirLocked(f"could not take the lock {self.path}; remove it if no run is using the folder")

    def _read_holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            return None  # unreadable lock: a writer died mid-write; treat as stale

    @staticmethod
    def _is_stale(holder: dict) -> bool:
        if holder.get("host") != socket.gethostname():
            return False  # cannot probe another host's pid; be safe
        pid = holder.get("pid")
        return not isinstance(pid, int) or pid == os.getpid() or not _pid_alive(pid)

    def release(self) -> None:
        if self._held:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            self._held = False

    def __enter__(self) -> ResultsDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def entry_name(results_dir: str | Path, stage: str) -> str:
    """How an error names ``stage``'s entry in results_dir's manifest.json (a record that does not read)."""
    return f"{Path(results_dir) / 'manifest.json'}'s {stage} entry"


class Manifest:
    """results_dir/manifest.json: per stage status, artifacts with sha256, fingerprint, times, metrics."""

    VERSION = 1

    def __init__(self, results_dir: Path):
        self.results_dir = Path(results_dir)
        self.path = self.results_dir / "manifest.json"
        self.data: dict[str, Any] = {"version": self.VERSION, "stages": {}}
        if self.path.exists():
            loaded = read_json(self.path, "manifest")
            if not isinstance(loaded, dict) or not isinstance(loaded.get("stages"), dict):
                raise StateError(f"manifest {self.path} has an unknown layout; delete it to re-run every stage")
            self.data = loaded

    @property
    def stages(self) -> dict[str, dict[str, Any]]:
        return self.data["stages"]

    def entry(self, stage: str) -> dict[str, Any] | None:
        return self.stages.get(stage)

    def entry_name(self, stage: str) -> str:
        """How an error names ``stage``'s entry in this manifest (``entry_name``)."""
        return entry_name(self.results_dir, stage)

    def metrics(self, stage: str) -> dict[str, Any]:
        """The metrics a finished stage recorded ({} when it has not finished)."""
        entry = self.stages.get(stage)
        return (entry.get("metrics") or {}) if entry and entry.get("status") == "done" else {}

    def artifact(self, key: str) -> Path | None:
        """Path of a finished stage's output artifact ``"<stage>/<name>"`` if recorded and present."""
        stage, _, _ = key.partition("/")
        entry = self.stages.get(stage)
        if not entry or entry.get("status") != "done":
            return None
        rec = entry.get("outputs", {}).get(key)
        if not rec:
            return None
        p = self.results_dir / rec["path"]
        return p if p.exists() else None

    def update(self, stage: str, **fields: Any) -> None:
        entry = self.stages.setdefault(stage, {})
        entry.update(fields)
        self.save()

    def save(self) -> None:
        atomic_write_json(self.path, self.data)

    def describe_file(self, path: Path, sha256: str | None = None) -> dict[str, Any]:
        """The manifest's record of a file: its path (relative to results_dir where inside), sha256 (hashed
        here unless given: the caller hashed it a moment ago) and size."""
        p = Path(path)
        try:
            rel = str(p.resolve().relative_to(self.results_dir.resolve()))
        except ValueError:
            rel = str(p.resolve())
        return {"path": rel, "sha256": sha256 or sha256_file(p), "bytes": p.stat().st_size}

def check_onnx_path(path: str | os.PathLike, what: str = "model") -> Path:
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"{what} file {p} does not exist; give the path of an existing .onnx file")
    if p.is_dir():
        raise InputError(f"{what} path {p} is a folder; give the path of an .onnx file")
    if p.suffix.lower() != ".onnx":
        raise InputError(f"{what} file {p} is not an ONNX file (name must end in .onnx)")
    return p
