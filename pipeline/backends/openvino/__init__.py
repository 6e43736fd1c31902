"""OpenVINO's CPU plugin: the backend (``backend``: ``OpenVinoBackend``), its compile settings and the
shared Core (``settings``), and the compile properties worth searching (``search``)."""

from pipeline.backends.openvino.backend import OpenVinoBackend

__all__ = ["OpenVinoBackend"]
