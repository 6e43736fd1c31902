"""Region mode: regions discovered in the full model, their patterns, and the ask/tell search over each
pattern's insertion schemes, measured on the whole model.

The vocabulary of the search lives here too, and subgraph mode builds on it: its fusion groups are LEAF
``Region``s of one ``QDQAutotunerBase`` (``autotuner``), so regions (``region``), patterns (``pattern``),
insertion points (``insertion_points``), schemes and their measurements (``scheme``) and the plan a
region assignment becomes (``plan_builder``) are region mode's. What only region mode uses: region
discovery (``search``), the resumable search state (``autotuner_state``), the pattern cache across runs
(``pattern_cache``), the workflow the stage runs (``workflow``) and ``python -m
tasks.autotune.region.inspect``.
"""
