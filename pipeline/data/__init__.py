"""Calibration and evaluation data: every source as batches of numpy feeds (``adapters``: the bundled
digits, synthetic, .npz/.npy folders, a user DataLoader) and the objects a ``pipeline.api.tune`` call
was given in memory (``live``). Imports the framework and ``pipeline.graph``."""
