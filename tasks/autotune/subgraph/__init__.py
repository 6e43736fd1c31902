"""Subgraph mode: tune Q/DQ per fusion group on extracted subgraphs, then validate on the full model.

Phase 1 (fusion_grouping): the runtime's own fusion groups become LEAF regions of one
QDQAutotunerBase, so schemes, insertion and calibrated scales are region mode's.

Phase 2 (``profiling``): groups with the same structure, boundary shapes and weight shapes share a
reuse key and are measured once, on a standalone subgraph (``subgraphs/``), on the instance with the
most nodes the rules quantize. Each gets the heuristic schemes (no Q/DQ, full Q/DQ, weights only,
activations only, the runtime's preferred fused form) and its form in the PTQ placement where that is
none of them, measured side by side in interleaved rounds, compared by the time of the group's own
compute layers where the runtime profiles layers (ORT's profiler, trtexec --exportProfile; edge
reformats/transposes and the Q of an input or DQ of an output left out), else by total subgraph latency.

Phase 3 (``validation``): ``optimized_raw.onnx`` applies every group's local winner. Incremental
validation measures full-model steps, each a paired measurement of a candidate against the current
model on the held-out accuracy budget, sequential (it ends once the ratio is clearly above or below
the keep threshold), kept only if it meets the budget and is faster by more than its noise:

- start: the PTQ placement (quantize's model; without one, every group in its preferred form)
  against the float model. Within budget and faster, phase 3 starts from it and pass 1 tests only
  the groups whose local result says they should change (a scheme, float included, beat the group's
  PTQ form on its subgraph); else from the float model, and pass 1 tests every local winner.
- pass 1 applies its groups in ONE step (largest expected gain first). A step that is rejected
  because it is slower or over the budget is bisected (group testing: k bad groups among n cost
  O(k log n) steps, not n): the first half is tested, and if all of it is kept, the second half's
  step is the parent's very model, so its verdict is known without measuring. A single group over
  the budget falls back to its next locally faster scheme (accuracy verdicts are deterministic).
  A step that is neither faster nor slower is rejected whole: its groups do not pay together.
- pass 2 retries the same way, in graph order: from the float model, every group not kept (without
  a local winner: its preferred form), since a data-movement group or a lone conversion only pays
  once its neighbours are quantized; from the PTQ placement, what pass 1 rejected, if it kept
  anything (else the same steps would measure the same models).

``autotune_cache.json`` (``records``) holds every phase-2 result and phase-3 step (a bisected step
lists its children, a known one the step it is known from), written atomically after each: a killed
run replays the recorded steps and resumes where it stopped without measuring anything twice. The
kept steps form a chain of paired measurements from the float model to the tuned one (each step
names its two models by content hash), which the final guard reuses instead of measuring again.

``driver.subgraph_autotuning_workflow`` runs the phases; ``report`` turns the records into the
stage's metrics rows and ``report.md``.
"""

from __future__ import annotations
