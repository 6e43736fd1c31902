"""Every float pass's postcondition, the float-exact rule: a rewrite is kept only if the float outputs on
calibration feeds move by at most FLOAT_EXACT (relative L2) from the graph it was applied to."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

FLOAT_EXACT = 1e-5  # largest relative output change a float-exact transform may cause


def float_rel_error(before: onnx.ModelProto, after: onnx.ModelProto, feeds: Sequence[Mapping[str, np.ndarray]]
                    ) -> float:
    """max over outputs of ||y_after - y_before|| / ||y_before|| (norms over all ``feeds``), both run
    on ORT CPU with graph optimizations off so fusions cannot differ between the two graphs (one
    session at a time: a large model is not held by ORT twice)."""
    from pipeline.backends.onnxruntime.session import inference_session, ort_session_options

    names = [o.name for o in before.graph.output]
    missing = sorted(set(names) - {o.name for o in after.graph.output})
    if missing:
        raise ValueError(f"transformed model lacks output(s) {missing}; transforms must keep every output")

    def outputs(m: onnx.ModelProto) -> list[list[np.ndarray]]:
        session = inference_session(m, ort_session_options("disable"))
        return [session.run(names, dict(f)) for f in feeds]

    ref, got = outputs(before), outputs(after)
    num = dict.fromkeys(names, 0.0)
    den = dict.fromkeys(names, 0.0)
    for rb, ra in zip(ref, got, strict=True):
        for n, yb, ya in zip(names, rb, ra, strict=True):
            yb64, ya64 = np.asarray(yb, np.float64), np.asarray(ya, np.float64)
            num[n] += float(np.sum((ya64 - yb64) ** 2))
            den[n] += float(np.sum(yb64 ** 2))
    return max((np.sqrt(num[n] / den[n]) if den[n] > 0 else np.sqrt(num[n]) for n in names), default=0.0)


__all__ = ["FLOAT_EXACT", "float_rel_error"]
