"""Weights that stay on disk: a model stored with external data is loaded without its large tensors'
values, and each of them is read when something needs it, one tensor at a time.

A large weight stays a reference in the proto (``data_location=EXTERNAL``). ONNX Runtime must find
its file from a relative location inside one folder (it refuses absolute paths and symlinks that lead
out of that folder), so every data file a loaded model refers to is hard-linked into this process's
weights folder (``weights_root``) under a name of its own, and the tensors' locations are rewritten
to it. Any proto holding such references is then complete on its own: ORT opens it with
``session.model_external_initializers_file_folder_path`` set to that folder, ``array`` reads one
tensor's values, and ``save_model`` streams them into the new model's data file. A hard link keeps
the bytes a model was loaded with even when the file it came from is replaced (every write here is
an atomic replace). The folder is removed after each stage (``release``), after a run (``own_folder``)
and at exit: while it exists, onnx's own loader and checker refuse the linked files (they reject data
files with several hard links), so code outside the pipeline reads them after the stage.

Where a hard link cannot be made (the data file is on another file system than ``TMPDIR``), the
model's tensors are read into memory as before, with a warning naming the fix.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import onnx
from onnx import numpy_helper

log = logging.getLogger("tune.weights")

LAZY_MIN_BYTES = 64 * 1024  # external tensors at least this large stay on disk; smaller ones are read
FOLDER_ENTRY = "session.model_external_initializers_file_folder_path"  # ORT session config entry
_CHUNK = 16 * 2**20

@dataclass
class _Folder:
    """A weights folder and what it holds: made on first use (``weights_root``)."""

    root: Path | None = None
    links: dict[tuple[int, int], str] = field(default_factory=dict)  # (st_dev, st_ino) of a data file -> link name
    digests: dict[tuple[str, int, int], str] = field(default_factory=dict)
    unlinkable: set[tuple[int, int]] = field(default_factory=set)  # data files a hard link failed for (warned once)


# the folder in use: each run's own (``own_folder``, per run: a ContextVar), else the process's
_FOLDER: ContextVar[_Folder | None] = ContextVar("weights_folder", default=None)
_PROCESS_FOLDER = _Folder()


def _folder() -> _Folder:
    return _FOLDER.get() or _PROCESS_FOLDER


def weights_root() -> Path:
    """The folder of hard links to the data files of loaded models in use (made on first use)."""
    folder = _folder()
    if folder.root is None:
        folder.root = Path(tempfile.mkdtemp(prefix="qdq-tune-weights-"))
        atexit.register(shutil.rmtree, folder.root, True)
    return folder.root


def release() -> None:
    """Remove the weights folder: the protos that refer to it must not be used any more. The data files
    it linked get their single link back (onnx's own loader and checker refuse files with several)."""
    folder = _folder()
    if folder.root is not None:
        shutil.rmtree(folder.root, ignore_errors=True)
    folder.root = None
    folder.links.clear()
    folder.digests.clear()
    folder.unlinkable.clear()


def current_root() -> Path | None:
    """The weights folder in use, or None where none is made (``weights_root`` makes one)."""
    return _folder().root


@contextlib.contextmanager
def own_folder() -> Iterator[None]:
    """A weights folder of the block's own: made on first use, released at the end (also when the block
    raises), and the folder and links in use before it back after it, so one run's per-stage
    ``release`` never removes the folder a caller's loaded models read."""
    token = _FOLDER.set(_Folder())
    try:
        yield
    finally:
        release()
        _FOLDER.reset(token)


def _info(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def is_lazy(t: onnx.TensorProto) -> bool:
    """Whether ``t``'s values are in this process's weights folder rather than in the proto."""
    folder = _folder()
    return (t.data_location == onnx.TensorProto.EXTERNAL and folder.root is not None
            and _info(t).get("location", "") in folder.links.values())


def has_lazy(model: onnx.ModelProto) -> bool:
    return any(is_lazy(t) for t in model.graph.initializer)


def all_tensors(graph: onnx.GraphProto) -> Iterator[tuple[onnx.TensorProto, bool]]:
    """(tensor, whether it is a main-graph initializer) for every tensor of ``graph`` and its bodies."""
    for t in graph.initializer:
        yield t, True
    for node in graph.node:
        for a in node.attribute:
            if a.HasField("t"):
                yield a.t, False
            for t in a.tensors:
                yield t, False
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                for t, _ in all_tensors(g):
                    yield t, False


def _link(source: Path) -> str | None:
    """The name of ``source``'s hard link in the weights folder (made once per file), or None where a
    hard link cannot be made."""
    st = source.stat()
    key = (st.st_dev, st.st_ino)
    folder = _folder()
    if key in folder.unlinkable:
        return None
    if key not in folder.links:
        # named after the file's path, size and time: the same file gets the same name in every run (so
        # serialized candidates hash the same on resume), a rewritten one another
        ident = f"{source.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()
        name = f"{hashlib.sha256(ident).hexdigest()[:12]}-{source.name}"
        try:
            os.link(source, weights_root() / name)
        except OSError as exc:
            folder.unlinkable.add(key)
            log.warning("%s cannot be hard-linked into %s (%s): its weights are read into memory. Set TMPDIR to a "
                        "folder on the same file system to keep them on disk", source, weights_root(), exc.strerror)
            return None
        folder.links[key] = name
    return folder.links[key]


def attach(model: onnx.ModelProto, base_dir: str | os.PathLike) -> onnx.ModelProto:
    """Make ``model`` (loaded with ``load_external_data=False`` from ``base_dir``) complete: its main
    graph's external tensors of LAZY_MIN_BYTES or more refer to the weights folder, every other
    external tensor (small ones, those in bodies and attributes) is read into the proto. ValueError
    names a tensor whose bytes its data file does not hold."""
    base = Path(base_dir)
    for t, top in all_tensors(model.graph):
        if t.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = _info(t)
        source = base / info.get("location", "")
        offset = int(info.get("offset", 0))
        size = source.stat().st_size if source.is_file() else None
        length = int(info["length"]) if "length" in info else (size or 0) - offset
        if size is None or offset + length > size:
            raise ValueError(f"tensor {t.name} needs bytes {offset}..{offset + length} of {source.name}, "
                             f"which {'has ' + str(size) + ' bytes' if size is not None else 'is missing'}")
        name = _link(source) if top and length >= LAZY_MIN_BYTES else None
        if name is None:
            with open(source, "rb") as fh:
                fh.seek(offset)
                t.raw_data = fh.read(length)
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]
            continue
        for e in t.external_data:
            if e.key == "location":
                e.value = name
    return model


def check_model(model: onnx.ModelProto, full_check: bool = False) -> None:
    """onnx.checker on ``model`` whatever its size and wherever its values are: tensors stored outside
    the proto are checked as references to a stand-in file (onnx's checker refuses a data file with
    several hard links, and this folder's are; ``attach`` has checked the real bytes), and so are the main
    graph's initializers of more than CHECKED_INLINE bytes, once their byte counts are checked against
    their shapes here (the checker would serialize the whole model to read them: 0.5 s a check for a
    BERT-base); a model past 2 GB goes through a file with external data."""
    external = [t for t, _ in all_tensors(model.graph) if t.data_location == onnx.TensorProto.EXTERNAL]
    large = [t for t in model.graph.initializer
             if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) > CHECKED_INLINE]
    if not external and not large:
        onnx.checker.check_model(model, full_check=full_check)
        return
    for t in large:
        _check_raw_size(t)
    with tempfile.TemporaryDirectory(prefix="qdq-tune-check-") as tmp:
        path = Path(tmp) / "model.onnx"
        (Path(tmp) / "stub.data").write_bytes(b"")
        view = onnx.ModelProto()
        view.CopyFrom(without_initializers(model))
        for t in model.graph.initializer:
            stand_in = t.data_location == onnx.TensorProto.EXTERNAL or len(t.raw_data) > CHECKED_INLINE
            view.graph.initializer.append(_stub(t) if stand_in else t)
        for t, top in all_tensors(view.graph):
            if not top and t.data_location == onnx.TensorProto.EXTERNAL:
                t.CopyFrom(_stub(t))
        if fits_one_proto(view):
            path.write_bytes(view.SerializeToString())
        else:
            save_external(view, path)
        onnx.checker.check_model(str(path), full_check=full_check)


_FOUR_BIT = {getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1") if hasattr(onnx.TensorProto, n)}
CHECKED_INLINE = 1 << 16  # bytes of an initializer's raw_data past which check_model checks it itself


def _check_raw_size(t: onnx.TensorProto) -> None:
    """onnx.checker's rule for raw data: as many bytes as the shape's elements of the data type."""
    count = int(np.prod(t.dims, dtype=np.int64))
    if t.data_type in _FOUR_BIT:
        want = (count + 1) // 2  # two values a byte
    else:
        want = count * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    if len(t.raw_data) != want:
        raise onnx.checker.ValidationError(f"initializer {t.name}: raw_data holds {len(t.raw_data)} bytes, its "
                                           f"shape {list(t.dims)} of {onnx.TensorProto.DataType.Name(t.data_type)} "
                                           f"takes {want}")


def _stub(t: onnx.TensorProto) -> onnx.TensorProto:
    ref = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims, data_location=onnx.TensorProto.EXTERNAL)
    ref.external_data.add(key="location", value="stub.data")
    return ref


def _span(t: onnx.TensorProto) -> tuple[Path, int, int]:
    info = _info(t)
    path = weights_root() / info["location"]
    offset = int(info.get("offset", 0))
    length = int(info["length"]) if "length" in info else path.stat().st_size - offset
    return path, offset, length


def raw_bytes(t: onnx.TensorProto) -> bytes:
    """The tensor's stored bytes (its raw_data, or read from the weights folder)."""
    if not is_lazy(t):
        return t.raw_data if t.HasField("raw_data") else numpy_helper.to_array(t).tobytes()
    path, offset, length = _span(t)
    with open(path, "rb") as fh:
        fh.seek(offset)
        return fh.read(length)


def array(t: onnx.TensorProto) -> np.ndarray:
    """The tensor's values, whether they are in the proto or on disk (read, never kept)."""
    if not is_lazy(t):
        return numpy_helper.to_array(t)
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
    if dtype.kind in "biuf" and t.data_type not in _PACKED:
        path, offset, length = _span(t)
        return np.fromfile(path, dtype=dtype, count=length // dtype.itemsize, offset=offset).reshape(tuple(t.dims))
    return numpy_helper.to_array(onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims,
                                                   raw_data=raw_bytes(t)))


# bfloat16, float8 and 4-bit types: stored in a layout numpy_helper unpacks
_PACKED = {onnx.TensorProto.BFLOAT16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26}


def copy_to(t: onnx.TensorProto, fh: BinaryIO) -> int:
    """Write the tensor's stored bytes to ``fh`` in chunks; returns how many."""
    if not is_lazy(t):
        raw = raw_bytes(t)
        fh.write(raw)
        return len(raw)
    path, offset, length = _span(t)
    with open(path, "rb") as src:
        src.seek(offset)
        left = length
        while left:
            block = src.read(min(_CHUNK, left))
            if not block:
                raise OSError(f"{path} ends before tensor {t.name}'s {length} bytes at offset {offset}")
            fh.write(block)
            left -= len(block)
    return length


def digest(t: onnx.TensorProto) -> str:
    """A content hash of a lazy tensor's bytes (computed once per tensor and process)."""
    path, offset, length = _span(t)
    key = (path.name, offset, length)
    digests = _folder().digests
    if key not in digests:
        h = hashlib.sha256()
        with open(path, "rb") as src:
            src.seek(offset)
            left = length
            while left:
                block = src.read(min(_CHUNK, left))
                h.update(block)
                left -= len(block)
        digests[key] = h.hexdigest()
    return digests[key]


def referenced(model: onnx.ModelProto | bytes) -> list[str]:
    """The weights folder's files that ``model`` (a proto or its serialization) reads."""
    folder = _folder()
    if folder.root is None:
        return []
    if isinstance(model, bytes):
        return [n for n in folder.links.values() if n.encode() in model]
    return sorted({_info(t)["location"] for t in model.graph.initializer if is_lazy(t)})


def share_into(model: onnx.ModelProto | bytes, folder: str | os.PathLike) -> bool:
    """Hard-link the data files ``model`` reads from the weights folder into ``folder``, so the model
    written there opens by path like any ONNX file; False where a link cannot be made (another file
    system): the caller then writes the model with its own data file."""
    for name in referenced(model):
        dst = Path(folder) / name
        if dst.exists():
            continue
        try:
            os.link(weights_root() / name, dst)
        except OSError:
            return False
    return True


def session_entries(model: onnx.ModelProto | bytes) -> dict[str, str]:
    """The ORT session config entries a proto (or its serialization) needs to find its lazy tensors."""
    return {FOLDER_ENTRY: str(current_root())} if referenced(model) else {}


def stored_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the main graph's initializer values, in the proto or on disk."""
    return sum(_span(t)[2] if is_lazy(t) else len(t.raw_data) if t.HasField("raw_data") else t.ByteSize()
               for t in model.graph.initializer)


PROTO_LIMIT = 2**31 - 1  # bytes: protobuf serializes no single message past this


def fits_one_proto(model: onnx.ModelProto) -> bool:
    """Whether ``model`` serializes as one protobuf message (under 2 GB); past that, protobuf's
    ByteSize() itself raises EncodeError, so a model that large is checked, saved and given to ONNX
    Runtime by path, with external data. ``proto_size_bound`` decides every model clear of the limit
    without serializing its values; only one past the bound is measured whole."""
    from google.protobuf.message import EncodeError

    try:
        return proto_size_bound(model) < PROTO_LIMIT or model.ByteSize() < PROTO_LIMIT
    except (EncodeError, ValueError):
        return False


_TYPED_VALUES = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")
# bytes the fields of an initializer other than its name, doc_string, dims, raw_data and external_data
# take at most (data_type, segment, data_location, tags and length prefixes), with room to spare
_TENSOR_FIELDS_BOUND = 256


def proto_size_bound(model: onnx.ModelProto) -> int:
    """An upper bound on ``model.ByteSize()``: the model without its main graph's initializers measured
    exactly, and each initializer held as raw bytes counted by its lengths. protobuf's ByteSize()
    serializes the message to measure it (as slow as saving the model), so this is the size every
    caller that only compares against a limit asks for."""
    return without_initializers(model).ByteSize() + sum(map(_tensor_size_bound, model.graph.initializer))


def _tensor_size_bound(t: onnx.TensorProto) -> int:
    if not t.HasField("raw_data") or any(len(getattr(t, f)) for f in _TYPED_VALUES):
        return t.ByteSize() + 16  # typed values: measured (small ones, as exporters write them)
    return (len(t.raw_data) + len(t.name.encode()) + len(t.doc_string.encode()) + 11 * len(t.dims)
            + sum(e.ByteSize() + 6 for e in t.external_data) + sum(m.ByteSize() + 6 for m in t.metadata_props)
            + _TENSOR_FIELDS_BOUND)


def _copy_fields(src: Any, dst: Any, skip: str) -> None:
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if fd.is_repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` without its main graph's initializers (everything else, bodies included):
    where a large model's weights are handled one tensor at a time instead of copied whole."""
    out = onnx.ModelProto()
    _copy_fields(model, out, "graph")
    _copy_fields(model.graph, out.graph, "initializer")
    return out


def save_external(model: onnx.ModelProto, path: str | os.PathLike, extra_outputs: Iterable[str] = (),
                  data_name: str | None = None, threshold: int = 1024) -> Path:
    """Write ``model`` (with ``extra_outputs`` as graph outputs) to ``path`` with its main graph's
    initializers of ``threshold`` bytes or more in one external data file (``data_name``, default
    ``<name>.data``), streamed one tensor at a time. ``model`` is not changed, and no second copy of its
    weights is made: onnx's own external-data save empties the proto it writes, and reading the
    values back into it grows the process by the whole model (protobuf keeps the emptied memory)."""
    from onnx.external_data_helper import uses_external_data

    from pipeline.progress import work_bar

    path = Path(path)
    data_name = data_name or path.name + ".data"
    out = without_initializers(model)
    existing = {o.name for o in out.graph.output}
    out.graph.output.extend(onnx.helper.make_empty_tensor_value_info(t) for t in dict.fromkeys(extra_outputs)
                            if t not in existing)
    offset = 0
    with open(path.parent / data_name, "wb") as fh, \
            work_bar(stored_bytes(model), f"writing {path.name}", unit="B", unit_scale=True) as bar:
        for t in model.graph.initializer:
            lazy = is_lazy(t)
            if uses_external_data(t) and not lazy:
                raise ValueError(f"initializer {t.name} refers to external data outside pipeline.graph.weights; load the "
                                 "model with pipeline.graph.model.load_model")
            if not lazy and t.ByteSize() < threshold:
                out.graph.initializer.append(t)
                continue
            bar.set_postfix_str(t.name, refresh=False)
            length = copy_to(t, fh)
            bar.update(length)
            ref = out.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims,
                                            data_location=onnx.TensorProto.EXTERNAL)
            for k, v in (("location", data_name), ("offset", str(offset)), ("length", str(length))):
                ref.external_data.add(key=k, value=v)
            offset += length
    path.write_bytes(out.SerializeToString())
    return path
