"""The application: the ``tune`` command (``cli``), the Python call behind ``pipeline.api``
(``api``), the stage runner (``runner``), multirun sweeps (``sweep``), the run's summary (``summary``)
and console logging (``logs``). May import every package of ``pipeline``; nothing imports it but
``pipeline.api``."""
