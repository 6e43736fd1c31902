"""On-the-fly training of the default digits CNN on scikit-learn's bundled digits (train split)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pipeline.data.digits import digits_arrays
from pipeline.records.export import Training

log = logging.getLogger("tune.export")


@dataclass(frozen=True)
class TrainingRecipe:
    """How long and how fast to train: epochs, the one-cycle schedule's peak learning rate, batch size."""

    epochs: int
    lr: float
    batch_size: int


def train_digits_cnn(model: nn.Module, image_size: int, seed: int, test_fraction: float, recipe: TrainingRecipe,
                     progress: bool = True) -> Training:
    """Train in place with Adam + light shift augmentation; returns train time and test accuracy."""
    from pipeline.progress import progress_bar

    epochs, lr, batch_size = recipe.epochs, recipe.lr, recipe.batch_size

    torch.manual_seed(seed)
    x_tr, y_tr = digits_arrays("train", seed, test_fraction, (1, image_size, image_size))
    x_te, y_te = digits_arrays("test", seed, test_fraction, (1, image_size, image_size))
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    steps = epochs * -(-len(xt) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    gen = torch.Generator().manual_seed(seed)
    t0 = time.time()
    model.train()
    shift = max(1, image_size // 16)
    with progress_bar(progress, total=steps, desc="export: training digits_cnn", unit="step") as bar:
        for _ in range(epochs):
            perm = torch.randperm(len(xt), generator=gen)
            for i in range(0, len(xt), batch_size):
                idx = perm[i:i + batch_size]
                xb = xt[idx]
                dx, dy = (int(v) for v in torch.randint(-shift, shift + 1, (2,), generator=gen))
                xb = torch.roll(xb, shifts=(dy, dx), dims=(2, 3))
                loss = nn.functional.cross_entropy(model(xb), yt[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                bar.update(1)
                bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()
    with torch.no_grad():
        pred = model(torch.from_numpy(x_te)).argmax(1).numpy()
    acc = float(np.mean(pred == y_te))
    seconds = time.time() - t0
    log.info("trained digits_cnn in %.1f s: test top-1 %.2f%% (%d samples)", seconds, 100 * acc, len(y_te))
    return Training(round(seconds, 2), acc)
