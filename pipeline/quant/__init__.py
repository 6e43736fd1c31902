"""Quantization math and placement: scales and storage types (``qmath``), what to quantize (``plan``),
where Q/DQ pairs go for each runtime's fusion rules (``placement``), inserting them (``qdq``) and
quantize's record of ranges and decisions (``calibration``). Imports the framework and
``pipeline.graph``."""
