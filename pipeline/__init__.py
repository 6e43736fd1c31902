"""qdq-tune's shared framework.

At the top, the modules a stage author reads: ``errors`` (one exception hierarchy), ``artifacts``
(results_dir, atomic writes, hashes, manifest), ``stage`` (the Stage contract), ``registry`` (the
explicit stage list), ``config`` (schemas and validation), ``progress`` (bars) and ``values`` (config
values as plain Python); ``api`` is the public Python entry point. They import no sub-package (``api``
re-exports ``app``). Below them, one sub-package per concern, each importing only the framework and
the sub-packages listed before it:

``graph`` < ``transforms`` < ``quant`` < ``data`` < ``backends`` < ``calibrate`` < ``accuracy`` < ``app``.
"""
