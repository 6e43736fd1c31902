"""The config reference (docs/config.md), generated from the schemas: every key of every group's dataclass
schema with its type, default and the comment the schema carries for it. `tests/unit/test_config.py` keeps
docs/config.md in step with it; regenerate with `python -m pipeline.app.config_reference > docs/config.md`."""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
import io
import textwrap
import tokenize
from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from pipeline.config import TuneConfig, shared_groups
from pipeline.registry import stage_schemas

CONF = Path(__file__).resolve().parents[2] / "conf"
HEADER = """# Config reference

Generated from the schemas by `python -m pipeline.app.config_reference > docs/config.md` (a test keeps it in
step). Every key can be set on the command line (`tune accuracy.min_snr_db=25`) or in a spec file. A group
(`backend=openvino`) picks one of the YAML files under `conf/<group>/`, each extending the schema named
after it; its keys are listed under the schema.
"""


@cache
def _comments(cls: type) -> dict[str, str]:
    """field name -> the comment written above it (contiguous lines) or after it, in ``cls``'s own source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    notes: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            notes[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    body = ast.parse(source).body[0]
    for node in getattr(body, "body", []):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, k = [], node.lineno - 1
        while k >= 1 and k in notes and lines[k - 1].lstrip().startswith("#"):
            above.insert(0, notes[k])
            k -= 1
        text = " ".join([*above, *([notes[node.lineno]] if node.lineno in notes else [])])
        out[node.target.id] = text.replace("|", "\\|")
    return out


def _comment(cls: type, name: str) -> str:
    for klass in cls.__mro__:  # the nearest class that says what the field is (a redeclaration may not)
        if _comments(klass).get(name):
            return _comments(klass)[name]
    return ""


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return MISSING


def _value(v: Any) -> str:
    if v is MISSING or v == "???":
        return "required"
    if isinstance(v, enum.Enum):
        return f"`{v.value}`"
    if isinstance(v, list):
        return "`[" + ", ".join(str(x.value if isinstance(x, enum.Enum) else x) for x in v) + "]`"
    if v is None:
        return "`null`"
    if isinstance(v, bool):
        return f"`{str(v).lower()}`"
    return f"`{v}`"


def _type(cls: type, f: dataclasses.Field) -> str:
    hint = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    optional = hint.startswith("Optional[") and hint.endswith("]")
    inner = hint[len("Optional["):-1] if optional else hint
    enum_type = next((t for t in _enums(cls) if t.__name__ == inner), None)
    shown = "one of " + ", ".join(m.value for m in enum_type) if enum_type is not None else inner
    return (shown + (" or null" if optional else "")).replace("|", "\\|")


def _enums(cls: type) -> list[type]:
    module = inspect.getmodule(cls)
    return [v for v in vars(module).values() if isinstance(v, type) and issubclass(v, enum.Enum)] if module else []


def rows(cls: type, prefix: str, values: Any = None) -> list[tuple[str, str, str, str]]:
    """(key, type, default, comment) of every key of schema ``cls`` under ``prefix`` (nested schemas
    flattened to dotted keys; ``values``: the instance a nested section defaults to, whose values are its
    defaults)."""
    out = []
    for f in dataclasses.fields(cls):
        default = getattr(values, f.name) if values is not None else _default(f)
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(default):
            out += rows(type(default), f"{key}.", default)
            continue
        out.append((key, _type(cls, f), _value(default), _comment(cls, f.name)))
    return out


def _options(group: str) -> str:
    names = sorted(p.stem for p in (CONF / group).glob("*.yaml")) if (CONF / group).is_dir() else []
    return ", ".join(f"`{group}={n}`" for n in names)


def _table(cls: type, prefix: str) -> list[str]:
    lines = ["| key | type | default | what it does |", "|---|---|---|---|"]
    lines += [f"| `{k}` | {t} | {d} | {c} |" for k, t, d, c in rows(cls, prefix)]
    return lines


def _doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    own = doc != (inspect.getdoc(cls.__mro__[1]) or "") if len(cls.__mro__) > 1 else bool(doc)
    return " ".join(doc.split("\n\n")[0].split()) if doc and own and not doc.startswith(cls.__name__ + "(") else ""


def _groups() -> dict[str, dict[str, type]]:
    """group -> {schema name: dataclass}: the shared groups, then each stage's."""
    return {**shared_groups(), **{stage: {f"base_{stage}": schema} for stage, schema in stage_schemas().items()}}


def render() -> str:
    """docs/config.md."""
    top = [f for f in dataclasses.fields(TuneConfig) if _default(f) is not MISSING or f.name == "results_dir"]
    out = [HEADER, "## Top-level keys", "", "| key | type | default | what it does |", "|---|---|---|---|"]
    out += [f"| `{f.name}` | {_type(TuneConfig, f)} | {_value(_default(f))} | {_comment(TuneConfig, f.name)} |"
            for f in top]
    for group, schemas in _groups().items():
        out += ["", f"## `{group}`", ""]
        note = _comment(TuneConfig, group)
        out += [f"{note[0].upper()}{note[1:]}." if note else "", ""] if note else []
        options = _options(group)
        if options:
            out += [f"Options: {options}.", ""]
        for name, cls in schemas.items():
            if len(schemas) > 1:
                out += [f"### {name} (`{cls.__name__}`)", ""]
            doc = _doc(cls)
            out += [doc, ""] if doc else []
            out += _table(cls, f"{group}.")
            out.append("")
    return "\n".join(out).rstrip() + "\n"


def keys() -> set[str]:
    """Every key the reference lists."""
    found = {f.name for f in dataclasses.fields(TuneConfig)}
    for group, schemas in _groups().items():
        for cls in schemas.values():
            found |= {k for k, *_ in rows(cls, f"{group}.")}
    return found


if __name__ == "__main__":
    print(render(), end="")
