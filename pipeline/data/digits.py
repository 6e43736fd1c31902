"""scikit-learn's bundled digits as the default model's data (``data=digits``): a stratified split fixed
by the seed, resized to the model's input, kept in the user's cache folder so a stage process does not
import scikit-learn and scipy (seconds) to read them again."""

from __future__ import annotations

import functools

import numpy as np

from pipeline.artifacts import atomic_output, user_cache
from pipeline.errors import InputError


def _resize_images(x: np.ndarray, h: int, w: int) -> np.ndarray:
    """Bilinear resize of (N, H0, W0) images to (N, h, w)."""
    if x.shape[1:] == (h, w):
        return x
    from scipy.ndimage import zoom

    return zoom(x, (1, h / x.shape[1], w / x.shape[2]), order=1).astype(np.float32)


@functools.lru_cache(maxsize=8)
def digits_arrays(split: str, seed: int, test_fraction: float, image_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled digits as (N, C, H, W) float32 in [0, 1] and int64 labels.

    The train/test split is stratified and fixed by ``seed``; the export stage trains on "train",
    quantize calibrates on "train", evaluate scores "test".
    """
    if len(image_shape) != 3:
        raise InputError(f"data=digits needs an image input (C, H, W); the model's input sample shape is "
                         f"{tuple(image_shape)}. Use data=synthetic, data=npz or data=custom")
    c, h, w = image_shape
    parts = digits_split(seed, test_fraction, (h, w))
    x, y = (parts["x_train"], parts["y_train"]) if split == "train" else (parts["x_test"], parts["y_test"])
    x = x[:, None]
    if c != 1:
        x = np.repeat(x, c, axis=1)
    return np.ascontiguousarray(x), y


def digits_split(seed: int, test_fraction: float, size: tuple[int, int]) -> dict[str, np.ndarray]:
    """The stratified split of the digits (images in [0, 1] resized to ``size``, labels), as scikit-learn
    makes it. Kept in the user's cache folder per seed, fraction, size and scikit-learn version:
    importing scikit-learn and scipy takes seconds, which every stage that reads the digits would pay
    again in its own process."""
    import importlib.metadata

    root = user_cache()
    path = root / (f"digits-{seed}-{test_fraction!r}-{size[0]}x{size[1]}-"
                   f"sklearn{importlib.metadata.version('scikit-learn')}.npz")
    keys = ("x_train", "y_train", "x_test", "y_test")
    try:
        with np.load(path) as kept:
            return {k: kept[k] for k in keys}
    except (OSError, ValueError, KeyError, EOFError):  # not there yet, or a broken copy: made again below
        pass
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)
    y = d.target.astype(np.int64)
    parts = dict(zip(keys[::2] + keys[1::2], train_test_split(x, y, test_size=test_fraction, random_state=seed,
                                                               stratify=y), strict=True))
    parts = {k: _resize_images(parts[k], *size) if k.startswith("x") else parts[k] for k in keys}
    try:
        root.mkdir(parents=True, exist_ok=True)
        with atomic_output(path, suffix=".npz") as tmp:
            np.savez(tmp, **parts)
    except OSError:  # a read-only home: the next process splits again
        pass
    return parts
