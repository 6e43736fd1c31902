"""What TensorRT says while it builds, for the tensorrt and tensorrt_rtx backends: ``capture_logger``
keeps its messages for the build log (and the verbose layer table, the only fusion record when the
engine cannot be deserialized), ``parser_errors`` turns the ONNX parser's errors into one line each.
"""

from __future__ import annotations

from typing import Any


def capture_logger(trt: Any) -> Any:
    """An ILogger that keeps messages for the build log (INFO and up, plus the verbose layer table)."""

    class CaptureLogger(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.lines: list[str] = []
            self.errors: list[str] = []
            self.layer_table: str | None = None

        def log(self, severity: Any, msg: str) -> None:
            sev = getattr(severity, "name", str(severity))
            if sev == "VERBOSE":
                # verbose output is megabytes for real models; keep only the layer table
                if msg.startswith("Layers:"):
                    self.layer_table = msg
                    self.lines.append(f"[V] {msg}")
                return
            self.lines.append(f"[{sev[0]}] {msg}")
            if sev in ("ERROR", "INTERNAL_ERROR"):
                self.errors.append(msg.strip().replace("\n", " "))

        def note(self, msg: str) -> None:
            self.lines.append(f"[qdq-tune] {msg}")

        def text(self) -> str:
            return "\n".join(self.lines) + "\n"

    return CaptureLogger()


class ParseError(Exception):
    """The ONNX parser rejected the model; ``errors`` holds one line per parser error."""

    def __init__(self, errors: list[str]):
        super().__init__("; ".join(errors))
        self.errors = errors


def parser_errors(parser: Any) -> list[str]:
    """The parser's errors, one line each naming the node, its op and what failed."""
    out = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        node = _call(e, "node_name") or f"#{_call(e, 'node')}"
        op = _call(e, "node_operator") or "?"
        code = getattr(_call(e, "code"), "name", str(_call(e, "code")))
        desc = str(_call(e, "desc") or "").strip()
        # the parser's op checkers report a failed condition as just "false"
        detail = f"{code}" if desc in ("", "false") else f"{code}: {desc}"
        out.append(f"node '{node}' ({op}): {detail}")
    return out


def _call(obj: Any, name: str) -> Any:
    """ParserError fields are methods in the Python bindings; tolerate attributes too."""
    v = getattr(obj, name, None)
    return v() if callable(v) else v


__all__ = ["ParseError", "capture_logger", "parser_errors"]
