"""quantize stage: static PTQ calibration of every Q/DQ candidate tensor and the default placement."""
