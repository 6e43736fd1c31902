"""Calibration and evaluation data as numpy batches shaped for a model with static inputs.

``to_feeds`` is the DataLoader-to-numpy adapter: a batch may be a numpy array, a torch tensor, a
tuple/list whose first item is the input (a second item, if present, is taken as labels), or a dict
holding the input under ``key`` or one of DEFAULT_KEYS; multi-input models take dicts keyed by input
name (or tuples in input order). ``DataProvider`` turns a configured source (digits, synthetic, npz,
custom) into fixed-size batches: ragged source batches are re-cut to the model's batch size and the
last one is padded, with ``Batch.valid`` telling how many samples are real.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
from collections.abc import Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from omegaconf import DictConfig, OmegaConf

from pipeline.config import resolved_data_source
from pipeline.data.digits import digits_arrays
from pipeline.errors import InputError
from pipeline.graph.model import InputSpec
from pipeline.registry import import_object

log = logging.getLogger("tune.data")

DEFAULT_KEYS = ("input", "data", "x", "images", "images_left", "images_right")
LABEL_KEYS = ("label", "labels", "target", "targets", "y")


@dataclass
class Batch:
    feeds: dict[str, np.ndarray]
    labels: np.ndarray | None
    valid: int  # real samples; the rest (padding) must be ignored by metrics


def to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "cpu"):  # torch.Tensor without importing torch
        return x.detach().cpu().numpy()
    return np.asarray(x)


def to_feeds(batch: Any, specs: list[InputSpec], key: str | None = None) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """Split one loader batch into {input name: array} and optional labels."""
    names = [s.name for s in specs]
    labels = None
    if isinstance(batch, Mapping):  # dicts and dict-likes (e.g. tokenizer BatchEncoding)
        if all(n in batch for n in names):
            feeds = {n: batch[n] for n in names}
        else:
            keys = [key] if key else [k for k in DEFAULT_KEYS if k in batch]
            if not keys or keys[0] not in batch:
                raise InputError(
                    f"data batch is a dict with keys {sorted(map(str, batch))}; none holds the input "
                    f"(looked for {key or ', '.join(DEFAULT_KEYS)} or the model's input names {names}); "
                    f"set data.key=<key>"
                )
            if len(names) > 1:
                raise InputError(f"model has inputs {names}; a dict batch must hold each by name")
            feeds = {names[0]: batch[keys[0]]}
        for lk in LABEL_KEYS:
            if lk in batch:
                labels = batch[lk]
                break
    elif isinstance(batch, (tuple, list)):
        if not batch:
            raise InputError("data batch is an empty tuple/list")
        first = batch[0]
        if isinstance(first, dict):
            feeds, _ = to_feeds(first, specs, key)
        elif len(names) > 1 and isinstance(first, (tuple, list)):
            feeds = dict(zip(names, first, strict=False))
        else:
            feeds = {names[0]: first}
        if len(batch) > 1:
            labels = batch[1]
    else:
        if len(names) > 1:
            raise InputError(f"model has inputs {names}; batches must be dicts keyed by input name")
        feeds = {names[0]: batch}
    out = {}
    for spec in specs:
        if spec.name not in feeds:
            raise InputError(f"data batch has no value for model input '{spec.name}'")
        arr = to_numpy(feeds[spec.name])
        if arr.ndim == len(spec.shape) - 1:
            arr = arr[None]
        if arr.shape[1:] != tuple(spec.shape[1:]):
            raise InputError(
                f"data for input '{spec.name}' has sample shape {tuple(arr.shape[1:])}, model expects "
                f"{tuple(spec.shape[1:])} (full shape {tuple(spec.shape)})"
            )
        out[spec.name] = arr.astype(spec.dtype, copy=False)
    return out, (None if labels is None else to_numpy(labels).reshape(-1))


def batch_inputs(batch: Any) -> dict[str, np.ndarray]:
    """The model inputs in one loader batch, named so that ``to_feeds`` finds them again: ``input`` for
    a lone input, a dict's keys (labels left out), or input_0, input_1, ... for a tuple of inputs."""
    if isinstance(batch, Mapping):
        return {str(k): to_numpy(v) for k, v in batch.items() if k not in LABEL_KEYS}
    if isinstance(batch, (tuple, list)):
        if not batch:
            raise InputError("data batch is an empty tuple/list")
        first = batch[0]
        if isinstance(first, Mapping):
            return batch_inputs(first)
        if isinstance(first, (tuple, list)):
            return {f"input_{i}": to_numpy(x) for i, x in enumerate(first)}
        return {"input": to_numpy(first)}
    return {"input": to_numpy(batch)}


def data_fingerprint(batches: Iterable[Any]) -> str:
    """A content hash of every array (dtype, shape, bytes) in every batch, in order: in-memory data
    passed to the Python API is recorded by it, so a re-run on the same data skips finished stages."""
    from pipeline.artifacts import fingerprint, sha256_bytes

    def leaves(x: Any) -> Iterator[Any]:
        if isinstance(x, Mapping):
            for k in sorted(x, key=str):
                yield str(k)
                yield from leaves(x[k])
        elif isinstance(x, (tuple, list)):
            for item in x:
                yield from leaves(item)
        elif isinstance(x, np.ndarray) or hasattr(x, "detach"):
            a = np.ascontiguousarray(to_numpy(x))
            yield [str(a.dtype), list(a.shape), sha256_bytes(a.tobytes())]
        else:
            yield repr(x)

    return fingerprint([list(leaves(b)) for b in batches])


def rebatch(batches: Iterable[tuple[dict[str, np.ndarray], np.ndarray | None]], batch_size: int,
            max_batches: int | None = None) -> Iterator[Batch]:
    """Re-cut a stream of (feeds, labels) of any size into batches of exactly ``batch_size``."""
    pending: list[tuple[dict[str, np.ndarray], np.ndarray | None]] = []
    have = 0
    emitted = 0

    def cut(n: int) -> Batch:
        nonlocal pending, have
        take: list[tuple[dict[str, np.ndarray], np.ndarray | None]] = []
        need = n
        while need > 0 and pending:
            feeds, labels = pending[0]
            m = next(iter(feeds.values())).shape[0]
            if m <= need:
                take.append(pending.pop(0))
                need -= m
            else:
                take.append(({k: v[:need] for k, v in feeds.items()}, None if labels is None else labels[:need]))
                pending[0] = ({k: v[need:] for k, v in feeds.items()}, None if labels is None else labels[need:])
                need = 0
        have -= n - need
        valid = n - need
        feeds = {k: np.concatenate([t[0][k] for t in take]) for k in take[0][0]}
        has_labels = all(t[1] is not None for t in take)
        labels = np.concatenate([t[1] for t in take]) if has_labels else None
        if valid < batch_size:  # pad by repeating the last sample; metrics use only `valid`
            reps = batch_size - valid
            feeds = {k: np.concatenate([v, np.repeat(v[-1:], reps, axis=0)]) for k, v in feeds.items()}
            if labels is not None:
                labels = np.concatenate([labels, np.repeat(labels[-1:], reps)])
        return Batch({k: np.ascontiguousarray(v) for k, v in feeds.items()}, labels, valid)

    for feeds, labels in batches:
        m = next(iter(feeds.values())).shape[0]
        if m == 0:
            continue
        pending.append((feeds, labels))
        have += m
        while have >= batch_size:
            yield cut(batch_size)
            emitted += 1
            if max_batches is not None and emitted >= max_batches:
                return
    if have > 0 and (max_batches is None or emitted < max_batches):
        yield cut(have)


# --------------------------------------------------------------------------- sources


def synthetic_batches(specs: list[InputSpec], num_samples: int, seed: int) -> Iterator[tuple[dict[str, np.ndarray], None]]:
    """Seeded random feeds in whole batches (the last one as well: the caller knows how many samples
    are real). An input whose first dim is not the batch size (a recurrent state [layers, batch,
    hidden], a scalar sample rate) is generated at its full shape."""
    rng = np.random.default_rng(seed)
    bs = specs[0].batch if specs else 1
    for _ in range(-(-num_samples // max(bs, 1))):
        feeds = {}
        for s in specs:
            shape = tuple(s.shape)
            if np.issubdtype(s.dtype, np.integer):
                feeds[s.name] = rng.integers(0, s.int_high or 100, size=shape).astype(s.dtype)
            elif s.dtype == np.bool_:
                feeds[s.name] = np.ones(shape, dtype=np.bool_)
            else:
                feeds[s.name] = rng.standard_normal(shape).astype(s.dtype)
        yield feeds, None


def fixed_feeds(specs: list[InputSpec], seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs for timing runs (latency does not depend on values for these models)."""
    feeds, _ = next(synthetic_batches(specs, specs[0].batch if specs else 1, seed))
    return feeds


def _read_arrays(p: Path) -> dict[str, np.ndarray]:
    try:
        if p.is_dir():
            files = sorted(p.glob("*.npy"))
            if not files:
                raise InputError(f"data folder {p} holds no .npy or .npz files")
            return {f.stem: np.load(f, mmap_mode="r") for f in files}
        if p.suffix == ".npz":
            with np.load(p) as z:
                return dict(z)
        return {p.stem: np.load(p, mmap_mode="r")}
    except (OSError, ValueError, EOFError) as exc:  # numpy's errors for files that are not arrays
        raise InputError(f"data {p} could not be read as numpy arrays ({type(exc).__name__}: {exc})") from None


def check_fixed(arrays: Mapping[str, Any], fixed: Mapping[str, Any], where: str) -> None:
    """InputError (one line) when data holds a value for a ``model.fixed_inputs`` input other than the
    one the model was specialized for."""
    for name, value in fixed.items():
        if name in arrays and not np.array_equal(to_numpy(arrays[name]), np.asarray(value)):
            got = to_numpy(arrays[name])
            shown = got.tolist() if got.size <= 4 else f"an array of shape {list(got.shape)}"
            raise InputError(f"{where}: input '{name}' is {shown}, but the model is specialized for "
                             f"model.fixed_inputs.{name}={value}; feed {name}={value} or set "
                             f"model.fixed_inputs.{name} to the value the data uses")


def _feed_files(folder: Path, specs: list[InputSpec], labels_key: str, batch_size: int,
                fixed: Mapping[str, Any] | None = None) -> Iterator[Batch]:
    """A folder of .npz files, each one complete feed: every model input by name, at its exact shape
    (the form Polygraphy's and TensorRT's calibrators take; state inputs need no batch axis)."""
    names = [s.name for s in specs]
    for f in sorted(folder.glob("*.npz")):
        arrays = _read_arrays(f)
        check_fixed(arrays, fixed or {}, f"feed file {f}")
        labels = arrays.pop(labels_key, None)
        feeds = {}
        for s in specs:
            if s.name not in arrays:
                raise InputError(f"feed file {f} has no array '{s.name}' (it holds {sorted(arrays)}); each .npz "
                                 f"in {folder} must hold every model input by name: {names}")
            a = np.asarray(arrays[s.name])
            if a.shape != tuple(s.shape):
                raise InputError(f"feed file {f}: input '{s.name}' has shape {a.shape}, the model wants "
                                 f"{tuple(s.shape)}")
            feeds[s.name] = np.ascontiguousarray(a.astype(s.dtype, copy=False))
        yield Batch(feeds, None if labels is None else np.asarray(labels).reshape(-1), batch_size)


def _npz_arrays(path: str, specs: list[InputSpec], labels_key: str, batch_axes: Mapping[str, int | None],
                fixed: Mapping[str, Any] | None = None) -> tuple[dict[str, np.ndarray], np.ndarray | None, dict[str, np.ndarray]]:
    """One .npz/.npy (or a folder of .npy named after the inputs), checked against the model's inputs:
    (inputs with a batch axis, that axis moved to the front; labels; inputs without one, whole)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise InputError(f"data path {p} does not exist; give a .npz file, a folder of .npy files or a folder "
                         f"of per-feed .npz files")
    if p.suffix not in (".npz", ".npy") and not p.is_dir():
        raise InputError(f"data file {p} is neither .npz nor .npy")
    arrays = _read_arrays(p)
    check_fixed(arrays, fixed or {}, f"data {p}")
    labels = arrays.pop(labels_key, None)
    names = [s.name for s in specs]
    if all(n in arrays for n in names):
        chosen = {n: arrays[n] for n in names}
    elif len(names) == 1 and len(arrays) == 1:
        chosen = {names[0]: next(iter(arrays.values()))}
    else:
        raise InputError(f"data {p} holds arrays {sorted(arrays)}; name them after the model inputs {names}")
    unknown = sorted(set(batch_axes) - set(names))
    if unknown:
        raise InputError(f"data.batch_axes names {unknown}, which are not model inputs {names}")
    cut: dict[str, np.ndarray] = {}
    fixed: dict[str, np.ndarray] = {}
    for s in specs:
        a, ax = chosen[s.name], batch_axes.get(s.name, 0)
        if ax is None:  # no batch axis: the same array goes with every batch
            if tuple(a.shape) != tuple(s.shape):
                raise InputError(f"data {p}: input '{s.name}' (data.batch_axes.{s.name}=null) has shape "
                                 f"{tuple(a.shape)}, the model wants {tuple(s.shape)}")
            fixed[s.name] = np.asarray(a, dtype=s.dtype)
            continue
        if not -a.ndim <= ax < a.ndim or len(s.shape) != a.ndim:
            raise InputError(f"data {p}: input '{s.name}' has shape {tuple(a.shape)}, the model wants "
                             f"{tuple(s.shape)} (batch axis {ax}); set data.batch_axes.{s.name} to the axis its "
                             f"samples run along, or give a folder of per-feed .npz files")
        want = tuple(d for i, d in enumerate(s.shape) if i != ax % a.ndim)
        got = tuple(d for i, d in enumerate(a.shape) if i != ax % a.ndim)
        if got != want:
            raise InputError(f"data {p}: input '{s.name}' has samples of shape {got} (array {tuple(a.shape)}), "
                             f"the model wants {want} (input shape {tuple(s.shape)}, batch axis {ax})")
        cut[s.name] = np.moveaxis(a, ax, 0) if ax % a.ndim else a
    if not cut:
        raise InputError(f"data {p}: every input has data.batch_axes null; give a folder of per-feed .npz files")
    return cut, labels, fixed


def _chunks(cut: dict[str, np.ndarray], labels: np.ndarray | None, specs: list[InputSpec], step: int
            ) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray | None]]:
    """Consecutive slices of ``step`` samples along axis 0 (cast to the inputs' dtypes)."""
    dtypes = {s.name: s.dtype for s in specs}
    n = min(a.shape[0] for a in cut.values())
    for start in range(0, n, max(step, 1)):
        feeds = {k: np.asarray(v[start:start + step]).astype(dtypes[k], copy=False) for k, v in cut.items()}
        yield feeds, None if labels is None else np.asarray(labels[start:start + step])


def _restore_axes(batch: Batch, specs: list[InputSpec], axes: Mapping[str, int | None], fixed: dict[str, np.ndarray]
                  ) -> Batch:
    """Undo _npz_arrays' move of each batch axis to the front, and add the inputs without one."""
    feeds = {}
    for s in specs:
        ax = axes.get(s.name, 0)
        if ax is None:
            feeds[s.name] = fixed[s.name]
        else:
            v = batch.feeds[s.name]
            feeds[s.name] = np.ascontiguousarray(np.moveaxis(v, 0, ax)) if ax % v.ndim else v
    return Batch(feeds, batch.labels, batch.valid)


def takes_split(target: str) -> bool:
    """Whether the data._target_ function takes a ``split`` argument ("calibration" or
    "evaluation"): without one, evaluation reads the calibration data again."""
    try:
        return "split" in inspect.signature(import_object(target, "data._target_")).parameters
    except (TypeError, ValueError):
        return False


def _custom_iterable(target: str, args: dict[str, Any], split: str) -> Iterable[Any]:
    kwargs = dict(args)
    if takes_split(target):
        kwargs["split"] = split
    return import_object(target, "data._target_")(**kwargs)


# what this run has warned about already (a run's scope: ``warnings_once``; outside any, the process)
_WARNED: ContextVar[set[str] | None] = ContextVar("data_warnings", default=None)
_PROCESS_WARNED: set[str] = set()


@contextlib.contextmanager
def warnings_once() -> Iterator[None]:
    """The scope of one run: each warning about its data is logged once in it. A scope inside another
    (backend=auto's runtimes inside the tune call) shares the outer one's."""
    token = _WARNED.set(set()) if _WARNED.get() is None else None
    try:
        yield
    finally:
        if token is not None:
            _WARNED.reset(token)


def _warn_once(key: str, message: str) -> None:
    seen = _WARNED.get()
    seen = _PROCESS_WARNED if seen is None else seen
    if key not in seen:
        seen.add(key)
        log.warning("%s", message)


class DataProvider:
    """Fixed-size numpy batches for a model, from the configured data source."""

    def __init__(self, cfg: DictConfig, specs: list[InputSpec]):
        self.cfg = cfg.data
        self.specs = specs
        self.seed = int(cfg.seed)
        self.source = resolved_data_source(cfg)
        fixed = cfg.model.get("fixed_inputs") if "model" in cfg else None
        self.fixed = OmegaConf.to_container(fixed) if fixed else {}
        # npz data may name each input's batch axis: the batch size is that axis of the first batched input
        self.batch_axes = dict(self.cfg.get("batch_axes") or {}) if self.source == "npz" else {}
        batched = [(s, self.batch_axes.get(s.name, 0)) for s in specs if self.batch_axes.get(s.name, 0) is not None]
        self.batch_size = specs[0].batch if specs else 1
        if batched and -len(batched[0][0].shape) <= batched[0][1] < len(batched[0][0].shape):
            self.batch_size = int(batched[0][0].shape[batched[0][1]])

    def _raw(self, split: str) -> Iterator[tuple[dict[str, np.ndarray], np.ndarray | None]]:
        src = self.source
        if src == "digits":
            if len(self.specs) != 1:
                raise InputError("data=digits feeds single-input image models; this model has "
                                 f"{len(self.specs)} inputs")
            x, y = digits_arrays("train" if split == "calibration" else "test", self.seed,
                                 float(self.cfg.test_fraction), self.specs[0].shape[1:])
            name = self.specs[0].name
            for i in range(0, len(x), self.batch_size):
                yield {name: x[i:i + self.batch_size].astype(self.specs[0].dtype)}, y[i:i + self.batch_size]
        elif src in ("synthetic", "none"):
            offset = 0 if split == "calibration" else 1_000_003
            yield from synthetic_batches(self.specs, int(self.cfg.num_samples), self.seed + offset)
        elif src == "custom":
            args = OmegaConf.to_container(self.cfg.args, resolve=True) if self.cfg.args else {}
            source = _custom_iterable(self.cfg._target_, args, split)  # type: ignore[arg-type]
            try:
                items = iter(source)
            except TypeError:
                raise InputError(f"data._target_={self.cfg._target_} returned a {type(source).__name__}, not a "
                                 f"DataLoader or iterable of batches") from None
            for i, raw in enumerate(items):
                if isinstance(raw, Mapping):
                    check_fixed(raw, self.fixed, f"data._target_={self.cfg._target_} batch {i}")
                yield to_feeds(raw, self.specs, self.cfg.key)

    def _npz_path(self, split: str) -> str:
        return self.cfg.path if split == "calibration" or not self.cfg.eval_path else self.cfg.eval_path

    def batches(self, split: str, max_batches: int | None = None) -> Iterator[Batch]:
        """``split`` is "calibration" (train data) or "evaluation" (held-out data)."""
        if split == "calibration" and self.source == "none":  # every pass reads it again: warned once
            _warn_once("synthetic", "no calibration data configured: calibrating on SYNTHETIC random data; "
                       "accuracy will suffer. Configure data=digits|npz|custom for real data.")
        bs = self.batch_size
        if self.source in ("synthetic", "none"):  # whole batches already: no re-cutting along axis 0
            n = int(self.cfg.num_samples)
            out: Iterator[Batch] = (Batch(feeds, None, min(bs, n - i * bs))
                                    for i, (feeds, _) in enumerate(self._raw(split)))
        elif self.source == "npz" and (p := Path(self._npz_path(split)).expanduser()).is_dir() \
                and any(p.glob("*.npz")):
            out = _feed_files(p, self.specs, self.cfg.labels_key, bs, self.fixed)
        elif self.source == "npz":
            cut, labels, fixed = _npz_arrays(str(p), self.specs, self.cfg.labels_key, self.batch_axes, self.fixed)
            out = (_restore_axes(b, self.specs, self.batch_axes, fixed)
                   for b in rebatch(_chunks(cut, labels, self.specs, bs), bs))
        else:
            out = rebatch(self._raw(split), bs)
        yield from itertools.islice(out, max_batches)

    def count(self, split: str, max_batches: int | None = None) -> int | None:
        """Number of batches a split yields (None when it cannot be known without reading it)."""
        if self.source == "digits":
            x, _ = digits_arrays("train" if split == "calibration" else "test", self.seed,
                                 float(self.cfg.test_fraction), self.specs[0].shape[1:])
            n = -(-len(x) // self.batch_size)
        elif self.source in ("synthetic", "none"):
            n = -(-int(self.cfg.num_samples) // self.batch_size)
        else:
            return max_batches
        return n if max_batches is None else min(n, max_batches)
