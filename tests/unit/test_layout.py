"""The tree shows the architecture: the module map in docs/layout.md matches it, imports point down only (no
circle among modules or packages, every import resolved, also those inside functions), no private
name crosses a module, and no file grows past what one reader can hold."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYOUT = (ROOT / "docs" / "layout.md").read_text()
# pipeline's sub-packages, lowest first: each may import the framework and those before it
LAYERS = ["graph", "transforms", "quant", "data", "backends", "calibrate", "accuracy", "records", "app"]


def _modules() -> dict[str, Path]:
    out = {}
    for top in ("pipeline", "tasks"):
        for p in (ROOT / top).rglob("*.py"):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str) -> list[tuple[str, str]]:
    """(imported module, imported name or "") for every import in ``module``, anywhere in the file."""
    path = MODULES[module]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(t, "") for a in node.names if (t := _resolve(a.name))]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in MODULES:
                    out.append((sub, ""))
                elif (t := _resolve(base)) is not None:
                    out.append((t, a.name))
    return [(t, n) for t, n in out if t != module]


EDGES = {m: _imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                found.append(sorted([v, *comp]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_among_modules():
    graph = {m: {t for t, _ in ts if not MODULES[t].name == "__init__.py" or t == m} for m, ts in EDGES.items()}
    assert _cycles(graph) == []


def _layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "pipeline":
        return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "framework"
    return "tasks"


def test_pipeline_packages_import_only_downwards():
    order = ["framework", *LAYERS]
    wrong = []
    for m, targets in EDGES.items():
        if not m.startswith("pipeline") or m == "pipeline.api":  # api: the public face of app
            continue
        for t, _ in targets:
            if t.startswith("tasks"):
                wrong.append(f"{m} imports {t}")
            elif t.startswith("pipeline") and order.index(_layer(t)) > order.index(_layer(m)):
                wrong.append(f"{m} ({_layer(m)}) imports {t} ({_layer(t)})")
    assert wrong == []


def test_no_private_name_crosses_a_module():
    """A name starting with `_` is imported only from its own module; a private module (`_x.py`) only
    from inside its package."""
    wrong = []
    for m, targets in EDGES.items():
        for t, name in targets:
            if name.startswith("_") and not name.startswith("__"):
                wrong.append(f"{m} imports {t}.{name}")
            leaf = t.rpartition(".")[2]
            if leaf.startswith("_") and not leaf.startswith("__") and not m.startswith(t.rpartition(".")[0] + "."):
                wrong.append(f"{m} imports private module {t}")
    for p in (ROOT / "tests").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(("pipeline", "tasks")):
                wrong += [f"{p.name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and not a.name.startswith("__")
                          and f"{node.module}.{a.name}" not in MODULES]  # modules: the test below
    assert wrong == []


def _private_stage_module(dotted: str) -> str | None:
    """The stage-private module (``tasks.<stage>...._x``) that ``dotted`` names or lies in, if any."""
    parts = dotted.split(".")
    for i in range(3, len(parts) + 1):
        name = ".".join(parts[:i])
        leaf = parts[i - 1]
        if name in MODULES and leaf.startswith("_") and not leaf.startswith("__"):
            return name
    return None


def test_tests_import_no_private_module_of_a_stage():
    """A stage's ``_x.py`` is its own: tests reach a stage through its public modules (or pipeline/), by
    import, importlib or a monkeypatch target given as a string."""
    wrong = []
    for p in sorted((ROOT / "tests").rglob("*.py")):
        rel = p.relative_to(ROOT)
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                named = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                named = re.findall(r"\btasks(?:\.\w+)+", node.value)
            else:
                continue
            wrong += [f"{rel}:{node.lineno} names {m}" for n in named
                      if n.startswith("tasks.") and (m := _private_stage_module(n))]
    assert wrong == []


def test_pipeline_top_level_is_small_and_every_package_says_what_it_owns():
    top = [p.name for p in (ROOT / "pipeline").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 10, top
    for init in [*(ROOT / "pipeline").rglob("__init__.py"), *(ROOT / "tasks").rglob("__init__.py")]:
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 60, f"{init.relative_to(ROOT)} needs a docstring saying what it owns"


def test_autotune_top_level_holds_the_stage_and_what_both_modes_share():
    """tasks/autotune/'s top level holds the stage, its config and what both modes share (at most 10
    modules, ``__init__.py`` included); each mode's own modules live in its sub-package (region/,
    subgraph/, runtime/). Subgraph mode builds on region mode's regions and autotuner, never the reverse."""
    top = sorted(p.name for p in (ROOT / "tasks" / "autotune").glob("*.py"))
    assert len(top) <= 10, top
    wrong = [f"{m} imports {t}" for m, ts in EDGES.items() if m.startswith("tasks.autotune.region")
             for t, _ in ts if t.startswith("tasks.autotune.subgraph")]
    assert wrong == []


def test_no_file_over_500_lines():
    long = [str(p.relative_to(ROOT)) for m, p in MODULES.items() if len(p.read_text().splitlines()) > 500]
    assert long == []


def _readme_map() -> set[str]:
    block = LAYOUT.split("```text\n", 1)[1].split("```", 1)[0]
    paths, stack = set(), []
    for line in block.splitlines():
        indent = (len(line) - len(line.lstrip())) // 2
        name, _, rest = line.strip().partition(" ")
        stack = stack[:indent]
        if name.endswith("/"):
            stack.append(name.rstrip("/"))
            # a package line may list its small modules inline: "config.py, stage.py; _models.py (...)"
            paths.update("/".join([*stack, f]) for f in re.findall(r"(\w+\.py)", rest))
        else:
            paths.add("/".join([*stack, name]))
    return paths


def test_readme_module_map_lists_every_module_and_nothing_else():
    tree = {str(p.relative_to(ROOT)) for p in MODULES.values() if p.name != "__init__.py"}
    listed = _readme_map()
    assert sorted(tree - listed) == [], "modules docs/layout.md's map leaves out"
    assert sorted(listed - tree) == [], "docs/layout.md's map names modules that do not exist"


# pipeline.backends modules any stage may use: the protocol, the settings base, and ONNX Runtime's sessions
# as the pipeline's own compute engine (calibration and reference sessions), which every stage runs on
# whatever the deployment runtime is (not the ONNX Runtime backend: pipeline.backends.onnxruntime)
SHARED_BACKEND_MODULES = {"pipeline.backends", "pipeline.backends.base", "pipeline.backends.ratios",
                          "pipeline.backends.timing",
                          "pipeline.backends.settings", "pipeline.backends.onnxruntime.session"}
# string constants in tasks/ equal to a runtime name, each allowed for its reason
RUNTIME_NAME_ALLOWED: set[tuple[str, str]] = set()


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def test_tasks_never_name_a_runtime():
    """Stages reach a runtime only through the Backend protocol: no stage imports a runtime's own module
    or compares, keys or branches on a runtime's name (a new runtime is a plugin, not an edit of tasks/)."""
    from pipeline.backends import builtin_runtimes

    names = set(builtin_runtimes())
    wrong = []
    for m, targets in EDGES.items():
        if m.startswith("tasks"):
            wrong += [f"{m} imports {t}" for t, _ in targets
                      if t.startswith("pipeline.backends") and t not in SHARED_BACKEND_MODULES]
    for p in sorted((ROOT / "tasks").rglob("*.py")):
        rel = str(p.relative_to(ROOT))
        tree = ast.parse(p.read_text())
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                    and id(node) not in skip and (rel, node.value) not in RUNTIME_NAME_ALLOWED):
                wrong.append(f"{rel}:{node.lineno} names the runtime {node.value!r}")
    assert wrong == []


def test_the_app_never_names_a_runtime():
    """pipeline/app/ (auto's race and choice, the API, the sweep, the runner) reaches runtimes through the
    registry and the Backend protocol: no string in it is a built-in runtime's name or one of its packages."""
    from pipeline.backend_config import RUNTIMES

    names = {r.name for r in RUNTIMES} | {p for r in RUNTIMES for p in r.packages}
    wrong = []
    for p in sorted((ROOT / "pipeline" / "app").rglob("*.py")):
        tree = ast.parse(p.read_text())
        skip = _docstrings(tree)
        wrong += [f"{p.relative_to(ROOT)}:{node.lineno} names {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names
                  and id(node) not in skip]
    assert wrong == []


def test_each_runtime_is_a_sub_package_of_backends():
    """pipeline/backends/ holds the protocol and what every runtime shares; each built-in runtime is a
    plugin in its own sub-package, whose ``__init__`` exports the Backend class the registry names."""
    from pipeline.backends import builtin_runtimes

    top = sorted(p.name for p in (ROOT / "pipeline" / "backends").glob("*.py"))
    assert top == ["__init__.py", "base.py", "ratios.py", "settings.py", "timing.py"]
    wrong = [f"{name}: {path}" for name, path in builtin_runtimes().items()
             if not ((pkg := path.rpartition(".")[0]).count(".") == 2 and pkg.startswith("pipeline.backends.")
                     and pkg in MODULES and MODULES[pkg].name == "__init__.py")]
    assert wrong == []


def test_every_backend_parameter_is_typed_with_the_protocol():
    """A parameter or field that holds a backend is annotated with ``Backend`` (or a subclass), never Any
    or nothing (a ``str`` one holds a runtime's name)."""
    allowed = {"pipeline/config.py"}  # TuneConfig.backend: the `backend` config group, not a Backend
    wrong = []
    for top in ("pipeline", "tasks"):
        for p in sorted((ROOT / top).rglob("*.py")):
            rel = str(p.relative_to(ROOT))
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                    held = [(a.arg, a.annotation) for a in args if a.arg == "backend"]
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                        and node.target.id == "backend":
                    held = [("backend", node.annotation)]
                else:
                    continue
                for name, ann in held:
                    text = ast.unparse(ann) if ann is not None else ""
                    if rel not in allowed and (not text or "Any" in text):
                        wrong.append(f"{rel}:{node.lineno} {name}: {text or 'no annotation'}")
    assert wrong == []


# annotations of calibration statistics and quantize decisions that are not their records, by file, with why
_UNTYPED_ALLOWED = {
    ("pipeline/calibrate/collect.py", "dict[str, Partial]"): "statistics while collect's passes fill them in",
}
_STATS_OR_DECISIONS = re.compile(r"(^|_)(stats|statistics|decisions|metrics)$")
# stage metrics left as open JSON documents, by file, with why: none. Every stage's metrics are its record (a
# StageMetrics) from the stage to manifest.json (their to_dict), the runner's summary and TuneResult.metrics
_OPEN_METRICS: dict[str, str] = {}
def _annotations(tree: ast.AST):
    """(name, annotation text) of every annotated argument, variable and field."""
    for node in ast.walk(tree):
        if isinstance(node, ast.arg) and node.annotation is not None:
            yield node.arg, ast.unparse(node.annotation)
        elif isinstance(node, ast.AnnAssign):
            target = node.target.id if isinstance(node.target, ast.Name) else ast.unparse(node.target).split(".")[-1]
            yield target, ast.unparse(node.annotation)


def test_statistics_decisions_and_metrics_are_records_from_producer_to_consumer():
    """No bare ``dict[str, dict]`` anywhere, and nothing named for statistics, decisions or metrics annotated
    as a string-keyed table of plain dicts or Any instead of its records (TensorStats, QuantizeDecisions; every
    stage's metrics: ExportMetrics, QuantizeMetrics, AutotuneMetrics, DeploymentMetrics, EvaluateMetrics, each a
    StageMetrics from the stage to the manifest, the runner's summary and TuneResult; trtexec's TrtexecSummary)."""
    found = []
    for path in sorted([*(ROOT / "pipeline").rglob("*.py"), *(ROOT / "tasks").rglob("*.py")]):
        rel = str(path.relative_to(ROOT))
        for name, text in _annotations(ast.parse(path.read_text())):
            bare = re.search(r"dict\[str, dict\](?!\[)", text)
            untyped = _STATS_OR_DECISIONS.search(name) and re.search(r"\b(dict|Mapping)\[str, (Any|dict|Partial)\b", text)
            if untyped and name.endswith("metrics") and rel in _OPEN_METRICS:
                continue
            if (bare or untyped) and (rel, text) not in _UNTYPED_ALLOWED:
                found.append(f"{rel}: {name}: {text}")
    assert found == []
