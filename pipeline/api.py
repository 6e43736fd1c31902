"""The public Python API: ``from pipeline.api import tune, ort_session, openvino_model, TuneResult``, and
``checked_on`` / ``host_warning``: what a deployment was checked on, and whether this host is such a one.

The names users import live here, at the top of the package, so that the application's inner layout
(``pipeline/app/``) can change without breaking a user's script. The implementation is
``pipeline.app.api``.
"""

from __future__ import annotations

from pipeline.app.api import TuneResult, checked_on, host_warning, openvino_model, ort_session, tune

__all__ = ["TuneResult", "checked_on", "host_warning", "openvino_model", "ort_session", "tune"]
