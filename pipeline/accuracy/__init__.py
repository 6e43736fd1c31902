"""Accuracy as part of every decision: the budget, its verdicts and custom metrics (``budget``), the
held-out slice (``holdout``) and the confidence bound every verdict passes on (``confidence``), output
error measures (``metrics``), a model's scores whole and per output (``scores``), which outputs hold
class scores (``class_scores``), fused kernels vs plain Q/DQ math (``fidelity``), per-node error and its
charts (``sensitivity``) and the verdict per CPU kind (``kinds``). The records stages write and read back
live in ``pipeline.records``. Imports the framework and the packages below it."""
