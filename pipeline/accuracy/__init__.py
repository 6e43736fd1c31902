"""Accuracy as part of every decision: the budget, the held-out check and custom metrics (``budget``),
output error measures (``metrics``), a model's scores whole and per output (``scores``), fused
kernels vs plain Q/DQ math (``fidelity``), per-node error and its charts (``sensitivity``) and the
CPU's instruction sets (``cpu``). Imports the framework, ``graph``, ``quant`` and ``data``."""
