"""The records stages hand on: what one stage wrote (calibration.json's decisions, a manifest's metrics) as
typed records that later stages, the report, the sweep summary and the Python API read back. One module
per stage: ``export`` (its metrics), ``quantize`` (its decisions), ``autotune`` (its metrics), ``evaluate``
(evaluate/metrics.json).
Imports the framework and the packages below ``app``."""
